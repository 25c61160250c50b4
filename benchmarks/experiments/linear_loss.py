"""A loss linear in its looked-up rows against the quadratic one.

    python3 -m benchmarks.experiments.linear_loss [--threads 1]

`(rows * w).sum()` has a gradient that does not depend on the rows; unless
something orders the lookup before the table's in-place update, XLA copies
the whole donated table inside the step. `lazy_optax.value_and_grad` orders
them. This times, interleaved in one process, the train step (lookup,
`lazy_optax.value_and_grad`, an optimizer, apply; jit, donated;
1,000,000 x 64 float32, 4,096 Zipf ids) with the linear loss and with
`mean((rows @ w - 1)^2)`, for `lazy_adam` and `rowwise_adagrad`, prints the
ratio, and counts the table-sized copies in each compiled step.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import make_batches


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--threads', type=int, default=1)
  parser.add_argument('--rows', type=int, default=1_000_000)
  parser.add_argument('--ids', type=int, default=4096)
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--steps', type=int, default=40)
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = (
      '--xla_cpu_multi_thread_eigen='
      + ('true' if args.threads > 1 else 'false')
      + f' intra_op_parallelism_threads={args.threads}')

  import jax
  import jax.numpy as jnp
  import numpy as np

  import lazy_optax

  v, d = args.rows, 64
  batches = [jnp.asarray(b) for b in make_batches(
      {'rows': v, 'ids': args.ids, 'dist': 'zipf', 'pool': 8, 'seed': 0})]
  losses = {
      'quadratic': lambda rows, w: jnp.mean((rows @ w - 1.0) ** 2),
      'linear': lambda rows, w: jnp.sum(rows * w),
  }
  optimizers = {'lazy_adam': lambda: lazy_optax.lazy_adam(1e-3),
                'rowwise_adagrad': lambda: lazy_optax.rowwise_adagrad(1e-3)}
  runs, copies = {}, {}
  for opt_name, make in optimizers.items():
    for loss_name, loss_of in losses.items():
      tx = make()

      def train_step(params, state, ids, tx=tx, loss_of=loss_of):
        loss, grads = lazy_optax.value_and_grad(
            lambda p: loss_of(lazy_optax.lookup(p['table'], ids), p['w']))(
                params)
        updates, state = tx.update(grads, state, params)
        return lazy_optax.apply_updates(params, updates), state, loss

      rng = np.random.default_rng(1)
      params = {'table': jnp.asarray(
          rng.random((v, d), dtype=np.float32) * 0.02 - 0.01),
                'w': jnp.ones((d,), jnp.float32) * 0.01}
      state = tx.init(params)
      compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(
          params, state, batches[0]).compile()
      copies[(opt_name, loss_name)] = sum(
          1 for line in compiled.as_text().splitlines()
          if ' copy(' in line and f'[{v},{d}]' in line)
      box = [params, state]

      def run(k, compiled=compiled, box=box):
        p, s, loss = compiled(box[0], box[1], batches[k % len(batches)])
        loss.block_until_ready()
        box[0], box[1] = p, s

      for k in range(5):
        run(k)
      runs[(opt_name, loss_name)] = run
  times = {key: [] for key in runs}
  for _ in range(args.rounds):
    for key, run in runs.items():
      t0 = time.perf_counter()
      for k in range(args.steps):
        run(k)
      times[key].append((time.perf_counter() - t0) / args.steps * 1e3)
  print(f'{args.threads} thread(s), {v:,} x {d}, {args.ids:,} ids; medians '
        f'of {args.rounds} rounds of {args.steps} steps, interleaved')
  for opt_name in optimizers:
    quad = float(np.median(times[(opt_name, 'quadratic')]))
    lin = float(np.median(times[(opt_name, 'linear')]))
    n_quad = copies[(opt_name, 'quadratic')]
    n_lin = copies[(opt_name, 'linear')]
    print(f'  {opt_name:16s} quadratic {quad:.3f} ms ({n_quad} table '
          f'copies), linear {lin:.3f} ms ({n_lin} table copies): linear / '
          f'quadratic {lin / quad:.2f}x')


if __name__ == '__main__':
  main()
