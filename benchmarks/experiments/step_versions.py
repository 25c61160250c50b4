"""One jitted lazy_adam step, two versions of lazy_optax, interleaved.

    python3 -m benchmarks.experiments.step_versions OLD_ROOT NEW_ROOT

Each root is a directory that holds a `lazy_optax` package (a checkout, or
`git archive <commit> | tar -x -C DIR`). Two worker processes, one per
version, each build the documented step (1,000,000 x 64 float32 table,
4,096 Zipf ids, lookup + backward + update, jit, donated) and the same step
with its gradient passed through `jax.tree.map` (the id code built, carried
and checked); the driver has them run blocks of steps in turn and prints the
median wall and CPU time per step of each, and the ratios new / old.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_WORKER = r'''
import functools, json, os, sys, time
os.environ['XLA_FLAGS'] = ('--xla_cpu_multi_thread_eigen=false '
                           'intra_op_parallelism_threads=1')
import jax, jax.numpy as jnp, numpy as np
import lazy_optax
assert lazy_optax.__file__.startswith(sys.argv[1]), lazy_optax.__file__
rng = np.random.default_rng(0)
rows, n = 1_000_000, 4096
batches = [jnp.asarray(np.minimum(rng.zipf(1.1, n), rows) - 1, jnp.int32)
           for _ in range(16)]
params = {'table': jnp.zeros((rows, 64)), 'w': jnp.ones((64,))}
tx = lazy_optax.lazy_adam(1e-3)
state = tx.init(params)

def loss_fn(params, ids):
  r = lazy_optax.lookup(params['table'], ids)
  return jnp.mean((r @ params['w'] - 1.0) ** 2)

def make(through_tree_map):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids):
    _, grads = lazy_optax.value_and_grad(loss_fn)(params, ids)
    if through_tree_map:
      grads = jax.tree.map(lambda x: x, grads)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step

steps = {'plain': make(False), 'tree_map': make(True)}
for s in steps.values():
  for ids in batches[:3]:
    params, state = s(params, state, ids)
jax.block_until_ready(params)
print('ready', flush=True)
i = 0
for line in sys.stdin:
  name, count = line.split()
  wall, cpu = [], []
  for _ in range(int(count)):
    ids = batches[i % len(batches)]
    i += 1
    t0, c0 = time.perf_counter(), time.process_time()
    params, state = steps[name](params, state, ids)
    jax.block_until_ready(params)
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  print(json.dumps([wall, cpu]), flush=True)
'''


def main() -> None:
  old_root, new_root = sys.argv[1], sys.argv[2]
  rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
  workers = {}
  for label, root in (('old', old_root), ('new', new_root)):
    # The root is the worker's PYTHONPATH: its `lazy_optax` is imported.
    workers[label] = subprocess.Popen(
        [sys.executable, '-c', _WORKER, os.path.abspath(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.path.abspath(root)))
  for w in workers.values():
    assert w.stdout is not None and w.stdout.readline().strip() == 'ready'
  times: dict = {}
  for _ in range(rounds):
    for name in ('plain', 'tree_map'):
      for label, w in workers.items():
        assert w.stdin is not None and w.stdout is not None
        w.stdin.write(f'{name} 20\n')
        w.stdin.flush()
        wall, cpu = json.loads(w.stdout.readline())
        entry = times.setdefault((label, name), ([], []))
        entry[0].extend(wall)
        entry[1].extend(cpu)
  for w in workers.values():
    assert w.stdin is not None
    w.stdin.close()
    w.wait()

  def median_ms(xs):
    xs = sorted(xs)
    return 1e3 * xs[len(xs) // 2]

  for name in ('plain', 'tree_map'):
    old_w, old_c = (median_ms(x) for x in times[('old', name)])
    new_w, new_c = (median_ms(x) for x in times[('new', name)])
    print(f'{name:9s} wall old {old_w:.3f} ms new {new_w:.3f} ms '
          f'(new/old {new_w / old_w:.3f}); cpu old {old_c:.3f} ms new '
          f'{new_c:.3f} ms (new/old {new_c / old_c:.3f})')


if __name__ == '__main__':
  main()
