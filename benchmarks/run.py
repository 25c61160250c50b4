"""lazy_optax against optax and torch, side by side: one command.

    python3 benchmarks/run.py --mode quick     # about two minutes
    python3 benchmarks/run.py --mode full      # about thirty minutes (2 cores)

Every (contender, configuration, thread count) runs in its own subprocess,
pinned with `taskset` to its cores (1 thread: core 0; 2 threads: cores 0 and
1), so that peak resident memory belongs to one contender and every library
sees the same cores. The target configuration is measured in two rounds, the
second in reverse contender order, so that ratios come from interleaved
measurements. Results go to `benchmarks/results/<mode>/`: `results.json`,
`results.md` (tables and the target ratios) and PNG plots; the ratios are
also printed.

Contenders:
  lazy_sparse           lazy_optax.lazy_adam, SparseRows gradient, jit, donated
  lazy_sparse_nodonate  the same step without donate_argnums
  lazy_dense_skip       lazy(optax.adam, skip_zero_rows=True), dense gradient
  optax_dense           optax.adam, dense gradient, jit, donated
  torch_sparse          torch.optim.SparseAdam, nn.Embedding(sparse=True)
  torch_dense           torch.optim.Adam, nn.Embedding (dense gradient)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import report  # pylint: disable=g-import-not-at-top,wrong-import-position

CONTENDERS = ('lazy_sparse', 'lazy_sparse_nodonate', 'lazy_dense_skip',
              'optax_dense', 'torch_sparse', 'torch_dense')
SPARSE = ('lazy_sparse', 'torch_sparse')
TARGET = {'rows': 1_000_000, 'row': 64, 'ids': 4096, 'dist': 'zipf'}

# Steps per measurement: (warm-up, max timed steps, min timed steps, budget s).
_STEPS = {
    'quick': {'sparse': (5, 60, 20, 1.0), 'dense': (1, 4, 2, 0.5)},
    'full': {'sparse': (10, 200, 30, 2.5), 'dense': (1, 8, 3, 1.5)},
}


def _plan(mode: str) -> list[dict]:
  """The measurements of a mode, in the order they run."""
  runs = []
  # Interleaved rounds (the second in reverse order) in full mode; one round
  # keeps the quick mode under about two minutes.
  rounds = 2 if mode == 'full' else 1
  for threads in (1, 2):
    for r in range(rounds):
      order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
      for c in order:
        runs.append(dict(TARGET, contender=c, threads=threads, round=r,
                         sweep='target'))
  if mode == 'quick':
    for rows in (10_000, 4_000_000):
      runs.append(dict(TARGET, rows=rows, contender='lazy_sparse', threads=1,
                       round=0, sweep='rows', opt=False))
    return runs
  sweeps = [('rows', 'rows', (10_000, 100_000, 1_000_000, 4_000_000)),
            ('ids', 'ids', (1024, 4096, 16384)),
            ('row', 'row', (16, 64, 256))]
  for dist in ('zipf', 'uniform'):
    for sweep, key, values in sweeps:
      for value in values:
        cfg = dict(TARGET, dist=dist)
        cfg[key] = value
        if cfg == dict(TARGET, dist=dist) and sweep != 'rows':
          continue  # the centre point is measured once per distribution
        for c in CONTENDERS:
          runs.append(dict(cfg, contender=c, threads=1, round=0, sweep=sweep,
                           opt=False))
  return runs


def _floor_plan(runs: list[dict]) -> list[dict]:
  seen, out = set(), []
  for r in runs:
    key = (r['rows'], r['row'], r['ids'], r['dist'])
    if key not in seen:
      seen.add(key)
      out.append({'rows': r['rows'], 'row': r['row'], 'ids': r['ids'],
                  'dist': r['dist']})
  return out


def _pin(threads: int) -> list[str]:
  if shutil.which('taskset') is None:
    return []
  cpus = sorted(os.sched_getaffinity(0))[:threads]
  return ['taskset', '-c', ','.join(map(str, cpus))]


def _run_one(script: str, cfg: dict, threads: int, timeout: float) -> dict:
  env = dict(os.environ)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env['OMP_NUM_THREADS'] = str(threads)
  env['PYTHONPATH'] = os.pathsep.join(
      [HERE] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  cmd = _pin(threads) + [sys.executable, os.path.join(HERE, script),
                         json.dumps(cfg)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {'error': f'exit {proc.returncode}: ' + ' | '.join(tail)}
  try:
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    return {'error': 'no JSON output: ' + proc.stdout[-300:]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--mode', choices=('quick', 'full'), default='quick')
  parser.add_argument('--out', default=None,
                      help='output folder (default benchmarks/results/MODE)')
  parser.add_argument('--only', nargs='*', default=None,
                      help='run only these contenders')
  args = parser.parse_args()
  out = args.out or os.path.join(HERE, 'results', args.mode)
  os.makedirs(out, exist_ok=True)
  runs = _plan(args.mode)
  if args.only:
    runs = [r for r in runs if r['contender'] in args.only]
  if len(os.sched_getaffinity(0)) < 2:
    runs = [r for r in runs if r['threads'] == 1]

  results = {'mode': args.mode, 'started': time.strftime('%Y-%m-%d %H:%M:%S'),
             'cpus': len(os.sched_getaffinity(0)),
             'load_before': os.getloadavg(), 'runs': [], 'floors': []}
  t_start = time.perf_counter()
  path = os.path.join(out, 'results.json')
  for cfg in _floor_plan(runs):
    cfg = dict(cfg, pool=8)
    res = _run_one('floor.py', cfg, 1, 300)
    results['floors'].append(dict(cfg, **res))
    print(f'[{time.perf_counter() - t_start:6.1f}s] floor {cfg["rows"]:>9} '
          f'x {cfg["row"]:<3} ids {cfg["ids"]:<5} {cfg["dist"]:7} '
          f'{res.get("floor_ms", float("nan")):.3f} ms', flush=True)
  for i, cfg in enumerate(runs):
    kind = 'sparse' if cfg['contender'] in SPARSE else 'dense'
    warmup, steps, min_steps, budget = _STEPS[args.mode][kind]
    cfg = dict(cfg, pool=16, grad_pool=4, warmup=warmup, steps=steps,
               min_steps=min_steps, budget_s=budget)
    res = _run_one('contenders.py', cfg, cfg['threads'], 600)
    results['runs'].append(dict(cfg, **res))
    train = res.get('train', {}).get('median_ms', float('nan'))
    note = res.get('error') or res.get('skipped') or ''
    print(f'[{time.perf_counter() - t_start:6.1f}s] {i + 1:3}/{len(runs)} '
          f'{cfg["contender"]:21} {cfg["rows"]:>9} x {cfg["row"]:<3} ids '
          f'{cfg["ids"]:<5} {cfg["dist"]:7} threads {cfg["threads"]}: '
          f'train {train:9.3f} ms {note}', flush=True)
    with open(path, 'w') as f:
      json.dump(results, f, indent=1)
  results['elapsed_s'] = time.perf_counter() - t_start
  results['load_after'] = os.getloadavg()
  with open(path, 'w') as f:
    json.dump(results, f, indent=1)
  text = report.write(results, out)
  print(text)
  print(f'wrote {out} in {results["elapsed_s"]:.0f} s')


if __name__ == '__main__':
  main()
