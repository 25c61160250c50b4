"""Peak memory while training a big table with lazy_adam (one process).

    python3 -m benchmarks.experiments.memory_big_table          # 4,000,000 x 64
    python3 -m benchmarks.experiments.memory_big_table --no-donate   # contrast

A 4,000,000 x 64 float32 table is 1 GiB; with `mu` and `nu` the state to
keep is 3 GiB. The script builds the table and the state directly on the
device (no host copies), runs jitted, donated `lazy_adam` steps with
row-sparse gradients, and reports the process's resident memory after each
phase, its peak (`ru_maxrss`), and the compiled step's memory analysis. It
checks that the peak stays within 15% above params plus moments (the
runtime's own baseline, measured before the table exists, included).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil

import lazy_optax

GIB = 1 << 30


def rss() -> int:
  return psutil.Process().memory_info().rss


def peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', type=int, default=4_000_000)
  parser.add_argument('--row', type=int, default=64)
  parser.add_argument('--ids', type=int, default=4096)
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--no-donate', action='store_true')
  parser.add_argument('--limit', type=float, default=1.15,
                      help='allowed peak / (params + moments)')
  parser.add_argument('--out', help='write the results as JSON here')
  args = parser.parse_args(argv)

  num_rows, row, n_ids = args.rows, args.row, args.ids
  tx = lazy_optax.lazy_adam(1e-3)

  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  # The runtime's own footprint, before any table exists.
  jnp.ones(8).block_until_ready()
  baseline = rss()

  # Built on the device: a non-zero fill, so every page is really written.
  params = jax.jit(lambda: {'table': jnp.full((num_rows, row), 0.01,
                                               jnp.float32)})()
  jax.block_until_ready(params)
  after_params = rss()
  state = jax.jit(tx.init)(params)
  jax.block_until_ready(state)
  after_init = rss()

  table_bytes = num_rows * row * 4
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  kept = table_bytes + state_bytes  # params + moments (+ the count)

  donate = () if args.no_donate else (0, 1)
  jitted = jax.jit(step, donate_argnums=donate)
  rng = np.random.default_rng(0)

  def batch():
    ids = (rng.zipf(1.2, n_ids) % num_rows).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(
        rng.normal(size=(n_ids, row)).astype(np.float32))

  ids, values = batch()
  compiled = jitted.lower(params, state, ids, values).compile()
  mem = compiled.memory_analysis()
  params, state = jitted(params, state, ids, values)
  jax.block_until_ready(params)
  times = []
  for _ in range(args.steps):
    ids, values = batch()
    t0 = time.perf_counter()
    params, state = jitted(params, state, ids, values)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t0)
  after_steps = rss()
  peak = peak_rss()

  touched = int(np.count_nonzero(
      np.asarray(params['table'][:1000, 0]) != np.float32(0.01)))
  result = {
      'rows': num_rows, 'row': row, 'ids': n_ids, 'steps': args.steps,
      'donated': not args.no_donate,
      'params_plus_moments_gib': kept / GIB,
      'baseline_rss_gib': baseline / GIB,
      'rss_after_params_gib': after_params / GIB,
      'rss_after_init_gib': after_init / GIB,
      'rss_after_steps_gib': after_steps / GIB,
      'peak_rss_gib': peak / GIB,
      'peak_over_kept': peak / kept,
      'peak_minus_baseline_over_kept': (peak - baseline) / kept,
      'compiled_temp_mib': mem.temp_size_in_bytes / (1 << 20),
      'compiled_alias_gib': mem.alias_size_in_bytes / GIB,
      'step_ms_median': 1e3 * float(np.median(times)),
      'rows_changed_among_first_1000': touched,
  }
  print(json.dumps(result, indent=1))
  ok = peak <= args.limit * kept
  print(f'peak RSS {peak / GIB:.3f} GiB for {kept / GIB:.3f} GiB of params + '
        f'moments: {peak / kept:.3f}x ({"within" if ok else "ABOVE"} '
        f'{args.limit:.2f}x); compiled temporaries '
        f'{mem.temp_size_in_bytes / (1 << 20):.2f} MiB; step '
        f'{result["step_ms_median"]:.2f} ms (median)')
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
