"""Memory-lean optimizers side by side: state bytes, step times, peak RSS.

    python3 -m benchmarks.experiments.lean_optimizers          # both (~2 min)
    python3 -m benchmarks.experiments.lean_optimizers --speed  # train steps
    python3 -m benchmarks.experiments.lean_optimizers --memory # peak RSS only
    python3 -m benchmarks.experiments.lean_optimizers --smoke  # tiny sizes

Speed: the whole train step (lookup, backward, update, apply; jitted,
params and state donated) of `rowwise_adagrad`, `partial_rowwise_adam`,
`ftrl` and `lazy(optax.adagrad)` next to `lazy_adam`, on a 1,000,000 x 64
float32 table and a `[64]` dense weight (`loss = mean((table[ids] @ w -
1)^2)`, as in `harness/contenders.py`), with 4,096 Zipf ids a batch.
Every optimizer is timed in the same process, in two interleaved rounds (the
second in reverse order); the ratios to `lazy_adam` come from those medians.

Memory: a fresh subprocess builds a 4,000,000 x 64 float32 table (1 GiB) and
its `rowwise_adagrad` state on the device, trains it with donated steps, and
reports its peak resident memory (VmHWM) against the table's own
bytes, with and without the runtime's baseline (measured before the table
exists). It exits non-zero when the peak minus the baseline exceeds the
table by more than `--limit` (10%).

Timings on a loaded machine mean little; the ratios measured side by side
in one run are what to compare.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import make_batches

GIB = 1 << 30


def zipf_batches(num_rows: int, n_ids: int, pool: int, seed: int = 0):
  """Zipf(1) ranks over a random permutation of the rows (hashed hot ids)."""
  return make_batches({'rows': num_rows, 'ids': n_ids, 'dist': 'zipf',
                       'pool': pool, 'seed': seed})


def optimizers():
  import optax  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top
  return {
      'lazy_adam': lambda: lazy_optax.lazy_adam(1e-3),
      'rowwise_adagrad': lambda: lazy_optax.rowwise_adagrad(1e-2),
      'partial_rowwise_adam': lambda: lazy_optax.partial_rowwise_adam(1e-3),
      'ftrl': lambda: lazy_optax.ftrl(1e-2),
      'lazy(optax.adagrad)': lambda: lazy_optax.lazy(optax.adagrad(1e-2)),
  }


def state_bytes_per_row(state, num_rows: int) -> float:
  import jax  # pylint: disable=g-import-not-at-top
  return sum(x.nbytes for x in jax.tree.leaves(state)
             if x.ndim and x.shape[0] == num_rows) / num_rows


def speed(args) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp

  import lazy_optax  # pylint: disable=g-import-not-at-top

  num_rows, row, n_ids = args.rows, args.row, args.ids
  batches = [jnp.asarray(b) for b in zipf_batches(num_rows, n_ids, 16)]
  distinct = float(np.mean([np.unique(np.asarray(b)).size for b in batches]))

  def loss_fn(rows, w):
    return jnp.mean((rows @ w - 1.0) ** 2)

  runs = {}
  for name, make in optimizers().items():
    tx = make()

    def train_step(params, state, ids, tx=tx):
      # The documented step: the rows looked up inside value_and_grad.
      loss, grads = lazy_optax.value_and_grad(
          lambda p: loss_fn(lazy_optax.lookup(p['table'], ids), p['w']))(
              params)
      updates, state = tx.update(grads, state, params)
      return lazy_optax.apply_updates(params, updates), state, loss

    params = jax.jit(lambda: {
        'table': jnp.full((num_rows, row), 0.01, jnp.float32),
        'w': jnp.ones((row,), jnp.float32)})()
    state = tx.init(params)  # eager: loads the CPU kernels (never traced)
    step = jax.jit(train_step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    step = step.lower(params, state, batches[0]).compile()
    runs[name] = {'box': [params, state], 'step': step, 'samples': [],
                  'compile_s': time.perf_counter() - t0,
                  'state_bytes_per_row': state_bytes_per_row(state,
                                                             num_rows)}

  def measure(name, steps):
    run = runs[name]
    box, step = run['box'], run['step']
    for k in range(args.warmup):
      box[0], box[1], loss = step(box[0], box[1], batches[k % len(batches)])
      loss.block_until_ready()
    for k in range(steps):
      t0 = time.perf_counter()
      box[0], box[1], loss = step(box[0], box[1], batches[k % len(batches)])
      loss.block_until_ready()
      run['samples'].append(time.perf_counter() - t0)

  names = list(runs)
  for order in (names, names[::-1]):
    for name in order:
      measure(name, args.steps)

  base = float(np.median(runs['lazy_adam']['samples']))
  out = {'rows': num_rows, 'row': row, 'ids': n_ids,
         'distinct_ids_per_batch': distinct, 'steps_per_round': args.steps,
         'optimizers': {}}
  print(f'\nTrain step, {num_rows:,} x {row} float32 table, {n_ids:,} Zipf '
        f'ids ({distinct:,.0f} distinct), jit + donated, median of 2 '
        f'interleaved rounds x {args.steps} steps:')
  print(f'  {"optimizer":22s} {"state B/row":>11s} {"median ms":>10s} '
        f'{"p10-p90 ms":>14s} {"/ lazy_adam":>11s}')
  for name, run in runs.items():
    a = np.asarray(run['samples']) * 1e3
    med = float(np.median(a))
    res = {'median_ms': med, 'p10_ms': float(np.percentile(a, 10)),
           'p90_ms': float(np.percentile(a, 90)),
           'ratio_to_lazy_adam': med / (base * 1e3),
           'state_bytes_per_row': run['state_bytes_per_row'],
           'compile_s': run['compile_s']}
    out['optimizers'][name] = res
    print(f'  {name:22s} {res["state_bytes_per_row"]:11.0f} {med:10.2f} '
          f'{res["p10_ms"]:6.2f}-{res["p90_ms"]:<7.2f} '
          f'{res["ratio_to_lazy_adam"]:10.2f}x')
  ada = out['optimizers']['rowwise_adagrad']['ratio_to_lazy_adam']
  print(f'  lazy_adam / rowwise_adagrad: {1 / ada:.2f}x')
  return out


def peak_rss() -> int:
  """This process's peak resident memory in bytes (VmHWM).

  Not `ru_maxrss`: Linux carries it across `exec` from the forked parent, so
  a child started by a big parent would report the parent's size.
  """
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_child(args) -> int:
  """Runs in a fresh process: peak RSS training a big rowwise_adagrad table."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp

  import lazy_optax  # pylint: disable=g-import-not-at-top

  def rss() -> int:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')

  num_rows, row, n_ids = args.big_rows, args.row, args.ids
  tx = lazy_optax.rowwise_adagrad(1e-2)

  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  batches = [jnp.asarray(b) for b in zipf_batches(num_rows, n_ids, 8, 1)]
  rng = np.random.default_rng(0)
  values = [jnp.asarray(rng.normal(size=(n_ids, row)).astype(np.float32))
            for _ in range(8)]
  # Compile everything from shapes first, so that the baseline holds the
  # runtime, the compiled programs and the batches, and the rest is what
  # the table costs while it trains.
  # The fill value is an argument: a constant table would be folded into a
  # 1 GiB literal of the compiled program.
  fill = jnp.float32(0.01)
  build = jax.jit(lambda v: {'table': jnp.full((num_rows, row), v)})
  make_params = build.lower(fill).compile()
  params_abs = jax.eval_shape(build, fill)
  init = jax.jit(tx.init).lower(params_abs).compile()
  state_abs = jax.eval_shape(tx.init, params_abs)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params_abs, state_abs, batches[0], values[0]).compile()
  mem = compiled.memory_analysis()
  gc.collect()
  baseline = rss()
  params = make_params(fill)
  state = init(params)
  jax.block_until_ready((params, state))
  table_bytes = num_rows * row * 4
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  times = []
  for k in range(args.big_steps):
    t0 = time.perf_counter()
    params, state = compiled(params, state, batches[k % 8], values[k % 8])
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t0)
  peak = peak_rss()
  result = {
      'rows': num_rows, 'row': row, 'ids': n_ids, 'steps': args.big_steps,
      'table_gib': table_bytes / GIB, 'state_mib': state_bytes / (1 << 20),
      'baseline_rss_gib': baseline / GIB, 'peak_rss_gib': peak / GIB,
      'peak_over_table': peak / table_bytes,
      'peak_minus_baseline_over_table': (peak - baseline) / table_bytes,
      'compiled_temp_mib': mem.temp_size_in_bytes / (1 << 20),
      'step_ms_median': 1e3 * float(np.median(times[1:])),
      'rows_changed': int(np.count_nonzero(
          np.any(np.asarray(params['table'][:100_000]) != 0.01, axis=1))),
  }
  print(json.dumps(result))
  return 0


def memory(args) -> dict:
  cmd = [sys.executable, '-m', 'benchmarks.experiments.lean_optimizers',
         '--memory-child',
         f'--big-rows={args.big_rows}', f'--row={args.row}',
         f'--ids={args.ids}', f'--big-steps={args.big_steps}']
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise SystemExit(proc.stdout + proc.stderr)
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  ok = res['peak_minus_baseline_over_table'] <= 1 + args.limit
  res['within_limit'] = ok
  print(f'\nPeak RSS, {res["rows"]:,} x {res["row"]} float32 table '
        f'({res["table_gib"]:.3f} GiB) + rowwise_adagrad state '
        f'({res["state_mib"]:.1f} MiB), {res["steps"]} donated steps:')
  print(f'  peak {res["peak_rss_gib"]:.3f} GiB = '
        f'{res["peak_over_table"]:.3f}x the table; minus the runtime '
        f'baseline ({res["baseline_rss_gib"]:.3f} GiB): '
        f'{res["peak_minus_baseline_over_table"]:.3f}x '
        f'({"within" if ok else "ABOVE"} {1 + args.limit:.2f}x); compiled '
        f'temporaries {res["compiled_temp_mib"]:.1f} MiB; step '
        f'{res["step_ms_median"]:.2f} ms')
  return res


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--speed', action='store_true')
  parser.add_argument('--memory', action='store_true')
  parser.add_argument('--smoke', action='store_true',
                      help='tiny sizes, to check that everything runs')
  parser.add_argument('--memory-child', action='store_true',
                      help=argparse.SUPPRESS)
  parser.add_argument('--rows', type=int, default=1_000_000)
  parser.add_argument('--big-rows', type=int, default=4_000_000)
  parser.add_argument('--row', type=int, default=64)
  parser.add_argument('--ids', type=int, default=4096)
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--big-steps', type=int, default=30)
  parser.add_argument('--warmup', type=int, default=5)
  parser.add_argument('--limit', type=float, default=0.10)
  parser.add_argument('--out', help='write the results as JSON here')
  args = parser.parse_args(argv)
  if args.smoke:
    args.rows, args.big_rows, args.ids = 10_000, 20_000, 256
    args.steps, args.big_steps, args.warmup = 5, 3, 1
  if args.memory_child:
    return memory_child(args)
  both = not (args.speed or args.memory)
  result = {}
  if args.speed or both:
    result['speed'] = speed(args)
  if args.memory or both:
    result['memory'] = memory(args)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  ok = result.get('memory', {}).get('within_limit', True) or args.smoke
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
