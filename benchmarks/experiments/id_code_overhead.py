"""What the id code of `SparseRows` costs in the target train step.

    python3 -m benchmarks.experiments.id_code_overhead [--threads 1]

A `SparseRows` built by lazy_optax keeps its ids as they are; the id code is
made only when the gradient tree is flattened (a `jax.tree.map`, a `lax.cond`,
a jit boundary) and checked where it is consumed. So the plain train step
(1,000,000 x 64 float32 table, 4,096 Zipf ids, lookup + backward + update,
jit, donated) has no id-code work at all; this prints whether its jaxpr holds
any, and times it, interleaved, against the same step with the gradients and
updates passed through `jax.tree.map` (code built, carried, decoded and
checked).
"""

from __future__ import annotations

import argparse
import functools
import os
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--threads', type=int, default=1)
  parser.add_argument('--rows', type=int, default=1_000_000)
  parser.add_argument('--ids', type=int, default=4096)
  parser.add_argument('--steps', type=int, default=200)
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = (
      '--xla_cpu_multi_thread_eigen='
      + ('true' if args.threads > 1 else 'false')
      + f' intra_op_parallelism_threads={args.threads}')

  import jax
  import jax.numpy as jnp
  import numpy as np

  import lazy_optax

  rng = np.random.default_rng(0)
  batches = [jnp.asarray(np.minimum(rng.zipf(1.1, args.ids), args.rows) - 1,
                         jnp.int32) for _ in range(16)]
  params = {'table': jnp.zeros((args.rows, 64)), 'w': jnp.ones((64,))}
  tx = lazy_optax.lazy_adam(1e-3)
  state = tx.init(params)

  def loss_fn(params, ids):
    rows = lazy_optax.lookup(params['table'], ids)
    return jnp.mean((rows @ params['w'] - 1.0) ** 2)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids):
    _, grads = lazy_optax.value_and_grad(loss_fn)(params, ids)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  # The same step with the gradient tree rebuilt from its leaves, as any
  # tree-wide operation (jax.tree.map, optax.apply_if_finite, loss scaling)
  # does: the id code is then built, carried and checked.
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step_through_tree_map(params, state, ids):
    _, grads = lazy_optax.value_and_grad(loss_fn)(params, ids)
    grads = jax.tree.map(lambda x: x, grads)
    updates, state = tx.update(grads, state, params)
    updates = jax.tree.map(lambda x: x, updates)
    return lazy_optax.apply_updates(params, updates), state

  def uses_code(fn):
    text = str(jax.make_jaxpr(fn)(params, state, batches[0]))
    return 'round' in text

  for ids in batches[:3]:
    params, state = step(params, state, ids)
    params, state = step_through_tree_map(params, state, ids)
  step_times, code_times = [], []
  for i in range(args.steps):
    ids = batches[i % len(batches)]
    t0 = time.perf_counter()
    params, state = step(params, state, ids)
    jax.block_until_ready(params)
    t1 = time.perf_counter()
    params, state = step_through_tree_map(params, state, ids)
    jax.block_until_ready(params)
    t2 = time.perf_counter()
    step_times.append(t1 - t0)
    code_times.append(t2 - t1)
  s, c = np.median(step_times) * 1e3, np.median(code_times) * 1e3
  print(f'threads={args.threads} rows={args.rows} ids={args.ids}')
  print(f'id code ops in the plain step: {uses_code(step)}; in the step '
        f'through tree.map: {uses_code(step_through_tree_map)}')
  print(f'train step median {s:.3f} ms; the same step through tree.map '
        f'(id code built and checked) {c:.3f} ms; ratio {c / s:.3f}')


if __name__ == '__main__':
  main()
