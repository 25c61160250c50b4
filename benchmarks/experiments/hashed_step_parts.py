"""Where the hashed step's time goes: CPU time, interleaved, in one process.

    taskset -c 0 python3 -m benchmarks.experiments.hashed_step_parts
    LAZY_OPTAX_CPU_KERNELS=0 python3 -m benchmarks.experiments.hashed_step_parts

On one stream of 4,096 Zipf ids (exponent 1.05) from a universe of 10**7, a
1,000,000 x 64 table with `lazy_adam`: after `--fill` steps of `assign`
(the table full, evicting every step), each timed step runs, one after the
other, the fixed-table step (`id % capacity`: `lookup` + `value_and_grad` +
update), the whole hashed step (`assign` + `reset_rows` + the same), and
`assign` and `reset_rows` alone (each on its own copy of the state). Times
are `time.process_time()` (CPU time of every thread: the machine may be
shared), medians over the timed steps. Threads: `taskset`; the XLA path
alone (what GPU/TPU run): `LAZY_OPTAX_CPU_KERNELS=0`. The table takes
`IdTable`'s default `eviction` unless `--eviction` names one.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.experiments.hashed_table import eviction
from benchmarks.experiments.hashed_table import zipf_stream
import lazy_optax
from lazy_optax._src import cpu_kernels


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--capacity', type=int, default=1_000_000)
  parser.add_argument('--dim', type=int, default=64)
  parser.add_argument('--batch', type=int, default=4096)
  parser.add_argument('--universe', type=int, default=10 ** 7)
  parser.add_argument('--fill', type=int, default=2000)
  parser.add_argument('--steps', type=int, default=150)
  parser.add_argument('--eviction', choices=('lru', 'lfu', 'none'),
                      default=None, help="IdTable's eviction (default: "
                      "IdTable's default)")
  args = parser.parse_args(argv)
  cap, dim = args.capacity, args.dim
  stream = zipf_stream(args.universe, args.batch, args.fill + args.steps,
                       1.05, 0)
  words = lazy_optax.split_ids(stream)
  folded = (stream % cap).astype(np.int32)
  tx = lazy_optax.lazy_adam(1e-3)
  init, key = jax.nn.initializers.normal(0.01), jax.random.key(0)
  table = lazy_optax.IdTable(capacity=cap, probe=16, eviction_log=0,
                             **eviction(args))

  def loss_fn(params, rows):
    return jnp.mean((lazy_optax.lookup(params['table'], rows) @ params['w']
                     - 1.0) ** 2)

  def update(params, opt_state, rows):
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params, rows)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  def reset(params, opt_state, fresh):
    return lazy_optax.reset_rows(tx, params, opt_state, {'table': fresh},
                                 init=init, key=key)

  def hashed(params, opt_state, id_state, w, step):
    slots, id_state, fresh = table.assign(id_state, w, step=step)
    params, opt_state = reset(params, opt_state, fresh)
    params, opt_state, loss = update(params, opt_state, slots)
    return params, opt_state, id_state, loss

  steps = {
      'fixed': jax.jit(update, donate_argnums=(0, 1)),
      'hashed': jax.jit(hashed, donate_argnums=(0, 1, 2)),
      'assign': jax.jit(lambda s, w, k: table.assign(s, w, step=k),
                        donate_argnums=0),
      'reset_rows': jax.jit(reset, donate_argnums=(0, 1)),
  }

  def params_state():
    params = {'table': jax.random.normal(jax.random.key(1), (cap, dim))
                       * 0.01, 'w': jnp.ones((dim,), jnp.float32)}
    return params, tx.init(params)

  (p1, s1), (p2, s2), (p3, s3) = params_state(), params_state(), (
      params_state())
  ids = table.init()
  for k in range(args.fill):
    ids = steps['assign'](ids, words[k], jnp.int32(k))[1]
  ids2 = jax.tree.map(jnp.copy, ids)
  times: dict[str, list[float]] = {name: [] for name in steps}

  def timed(name, *a):
    t0 = time.process_time()
    out = jax.block_until_ready(steps[name](*a))
    times[name].append(time.process_time() - t0)
    return out

  for k in range(args.fill, args.fill + args.steps):
    w, now = jnp.asarray(words[k]), jnp.int32(k)
    p1, s1, _ = timed('fixed', p1, s1, jnp.asarray(folded[k]))
    p2, s2, ids, _ = timed('hashed', p2, s2, ids, w, now)
    _, ids2, fresh = timed('assign', ids2, w, now)
    p3, s3 = timed('reset_rows', p3, s3, fresh)
  skip = min(20, args.steps // 4)
  out = {name: float(np.median(t[skip:]) * 1e3) for name, t in times.items()}
  out['ratio'] = out['hashed'] / out['fixed']
  out['stats'] = table.stats(ids)
  out['kernels'] = cpu_kernels.loaded()
  out['eviction'] = table.eviction
  print(json.dumps(out))
  return out


if __name__ == '__main__':
  main()
