"""lazy_optax against TensorFlow, torch, FBGEMM and optax, side by side.

From the repository root (`python3 -m benchmarks.run` works the same):

    python3 benchmarks/run.py --mode quick     # a few minutes (2 cores)
    python3 benchmarks/run.py --mode full      # about forty minutes (2 cores)
    python3 benchmarks/run.py --tf-python /work/venvs/tf/bin/python
    python3 benchmarks/run.py --fbgemm-python /work/venvs/fbgemm/bin/python
    python3 benchmarks/run.py --huge-pages   # every contender on huge pages

Every (contender, configuration, thread count) runs in its own subprocess,
pinned with `taskset` to its cores (1 thread: one core; 2 threads: two), so
that peak resident memory belongs to one contender and every library sees the
same cores. Runs are interleaved: each contender at 1 and then 2 threads,
contenders of one comparison next to each other; full mode measures the
comparisons in two rounds, the second in reverse order. Results go to
`benchmarks/results/<mode>/`: `results.json`, `results.md` (tables, target
ratios, effective bandwidth) and PNG plots; the ratios are also printed.

Target configuration (1,000,000 x 64 float32 table, 4,096 Zipf ids):
  lazy_sparse           lazy_optax.lazy_adam, SparseRows gradient, jit, donated
  tf_lazy_adam          TF Addons LazyAdam, tf.function (needs --tf-python)
  torch_sparse          torch.optim.SparseAdam, nn.Embedding(sparse=True)
  optax_dense           optax.adam, dense gradient, jit, donated
  rowwise_adagrad       lazy_optax.rowwise_adagrad, SparseRows, jit, donated
  fbgemm_rowwise_adagrad  FBGEMM's CPU table-batched embedding with
                        EXACT_ROWWISE_ADAGRAD (needs --fbgemm-python)
  lazy_sparse_nodonate  lazy_adam without donate_argnums (full mode)
  lazy_dense_skip       lazy(optax.adam, skip_zero_rows=True), dense gradient
                        (full mode)
  torch_dense           torch.optim.Adam, nn.Embedding (full mode)
DLRM-shaped model (`dlrm.py`: 26 Criteo Kaggle tables x 16, batch 2,048):
  dlrm_lazy, dlrm_lazy_concat, dlrm_torch_sparse, dlrm_optax_dense,
  dlrm_rowwise_adagrad, dlrm_fbgemm_rowwise_adagrad
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from benchmarks import common
from benchmarks.harness import dlrm
from benchmarks.harness import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, 'benchmarks', 'results')

# Adam against Adam, then row-wise Adagrad against FBGEMM's.
QUICK_CONTENDERS = ('lazy_sparse', 'tf_lazy_adam', 'torch_sparse',
                    'optax_dense', 'rowwise_adagrad', 'fbgemm_rowwise_adagrad')
CONTENDERS = QUICK_CONTENDERS + ('lazy_sparse_nodonate', 'lazy_dense_skip',
                                 'torch_dense')
# The sweeps of full mode compare the Adam contenders.
SWEEP_CONTENDERS = ('lazy_sparse', 'tf_lazy_adam', 'torch_sparse',
                    'optax_dense', 'lazy_sparse_nodonate', 'lazy_dense_skip',
                    'torch_dense')
SPARSE = ('lazy_sparse', 'torch_sparse', 'tf_lazy_adam', 'rowwise_adagrad',
          'fbgemm_rowwise_adagrad')
TARGET = common.TARGET
# The DLRM runs carry the generic keys too (all rows, row size, ids a step),
# and the floor they are compared with: random rows of 64 bytes (16 floats)
# in a 1,000,000-row table, as many ids as a DLRM step looks up.
_D = common.DLRM_DEFAULTS
DLRM = dict(_D, rows=sum(common.cardinalities(_D)),
            ids=_D['batch'] * len(common.CRITEO_KAGGLE),
            floor={'rows': 1_000_000, 'row': _D['row'],
                   'ids': _D['batch'] * len(common.CRITEO_KAGGLE),
                   'dist': 'zipf'})
DLRM_CONTENDERS = dlrm.CONTENDERS + ('dlrm_rowwise_adagrad',
                                     'dlrm_fbgemm_rowwise_adagrad')

# Steps per measurement: (warm-up, max timed steps, min timed steps, budget s).
_STEPS = {
    'quick': {'sparse': (5, 60, 20, 1.0), 'dense': (1, 3, 2, 0.3),
              'dlrm_sparse': (3, 40, 10, 0.8), 'dlrm_dense': (1, 2, 2, 0.3)},
    'full': {'sparse': (10, 200, 30, 2.5), 'dense': (1, 8, 3, 1.5),
             'dlrm_sparse': (5, 150, 30, 3.0), 'dlrm_dense': (1, 6, 3, 2.0)},
}


def _kind(contender: str) -> str:
  if contender.startswith('dlrm_'):
    return 'dlrm_dense' if contender.endswith('dense') else 'dlrm_sparse'
  return 'sparse' if contender in SPARSE else 'dense'


def _plan(mode: str) -> list[dict]:
  """The measurements of a mode, in the order they run."""
  runs = []
  # Two interleaved rounds (the second in reverse order) in full mode; one
  # keeps the quick mode under two minutes. Each contender runs at 1 and then
  # 2 threads, next to the contenders it is compared with.
  rounds = 2 if mode == 'full' else 1
  target = CONTENDERS if mode == 'full' else QUICK_CONTENDERS
  for r in range(rounds):
    order = target if r % 2 == 0 else target[::-1]
    for c in order:
      for threads in (1, 2):
        runs.append(dict(TARGET, contender=c, threads=threads, round=r,
                         sweep='target', opt=mode == 'full'))
    order = DLRM_CONTENDERS if r % 2 == 0 else DLRM_CONTENDERS[::-1]
    for c in order:
      for threads in (1, 2):
        if mode == 'quick' and c == 'dlrm_optax_dense' and threads == 2:
          continue  # its compile time (1 thread) is what quick mode needs
        runs.append(dict(DLRM, contender=c, threads=threads, round=r,
                         sweep='dlrm'))
  if mode == 'quick':
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
        for c in SWEEP_CONTENDERS:
          runs.append(dict(cfg, contender=c, threads=1, round=0, sweep=sweep,
                           opt=False))
  return runs


def _smoke(run: dict) -> dict:
  """A run shrunk to 10,000-row tables (DLRM tables capped at 10,000 rows)."""
  small = 10_000
  if run['sweep'] == 'dlrm':
    cap = dict(run, cap=small)
    return dict(cap, rows=sum(common.cardinalities(cap)),
                floor=dict(run['floor'], rows=small))
  return dict(run, rows=min(run['rows'], small))


def _floor_plan(runs: list[dict]) -> list[dict]:
  seen, out = set(), []
  for r in runs:
    f = r.get('floor', r)
    key = (f['rows'], f['row'], f['ids'], f['dist'])
    if key not in seen:
      seen.add(key)
      out.append({'rows': f['rows'], 'row': f['row'], 'ids': f['ids'],
                  'dist': f['dist']})
  return out


def _pin(threads: int) -> list[str]:
  if shutil.which('taskset') is None:
    return []
  cpus = sorted(os.sched_getaffinity(0))[:threads]
  return ['taskset', '-c', ','.join(map(str, cpus))]


# `--huge-pages`: glibc's malloc then asks the kernel for transparent huge
# pages (madvise) for every large allocation of every contender (Linux,
# glibc 2.35 or newer; read once at process start).
HUGE_PAGES_ENV = {'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1'}
_EXTRA_ENV: dict[str, str] = {}


def _run_one(module: str, cfg: dict, threads: int, timeout: float,
             python: str = sys.executable) -> dict:
  """Runs `python -m benchmarks.harness.MODULE CFG`, pinned; its JSON result."""
  env = dict(os.environ, **_EXTRA_ENV)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['OMP_NUM_THREADS'] = str(threads)
  # The repository root first: `benchmarks` (and, for the JAX contenders,
  # this checkout's `lazy_optax`) import from there in every interpreter.
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  cmd = _pin(threads) + [python, '-m', f'benchmarks.harness.{module}',
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


def _script(contender: str, tf_python: str | None,
            fbgemm_python: str | None) -> tuple[str, str]:
  """(module, interpreter) that measures a contender."""
  if contender.startswith('tf_'):
    return 'tf_contender', tf_python or sys.executable
  if 'fbgemm' in contender:
    return 'fbgemm_contender', fbgemm_python or sys.executable
  if contender.startswith('dlrm_'):
    return 'dlrm', sys.executable
  return 'contenders', sys.executable


def _usable(python: str | None) -> str:
  """Why an interpreter named on the command line is unusable ('' if not)."""
  if not python:
    return 'not given'
  if not os.access(python, os.X_OK):
    return f'{python} is not an executable'
  return ''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--mode', choices=('quick', 'full'), default='quick')
  parser.add_argument('--out', default=None,
                      help='output folder (default benchmarks/results/MODE)')
  parser.add_argument('--only', nargs='*', default=None,
                      help='run only these contenders')
  parser.add_argument('--tf-python', default=None, metavar='PATH',
                      help='Python interpreter with tensorflow-cpu 2.15 and '
                      'tensorflow-addons (see benchmarks/README.md); without '
                      'it the TF Addons LazyAdam contender is skipped')
  parser.add_argument('--fbgemm-python', default=None, metavar='PATH',
                      help='Python interpreter with torch 2.14.1 and '
                      'fbgemm-gpu-cpu 1.9.0 (see benchmarks/README.md); '
                      'without it the FBGEMM contenders are skipped')
  parser.add_argument('--smoke', action='store_true',
                      help='run every path of the mode once at small sizes '
                      '(10,000-row tables, a few steps) into '
                      'benchmarks/results/tmp_smoke: a check that the suite '
                      'works, not a measurement')
  parser.add_argument('--huge-pages', action='store_true',
                      help='run every contender (TF and torch included) with '
                      'GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so that large '
                      'tables sit on transparent huge pages; results go to '
                      'benchmarks/results/MODE-huge-pages')
  args = parser.parse_args()
  if args.huge_pages:
    _EXTRA_ENV.update(HUGE_PAGES_ENV)
  out = args.out or os.path.join(
      RESULTS, 'tmp_smoke' if args.smoke else
      args.mode + ('-huge-pages' if args.huge_pages else ''))
  os.makedirs(out, exist_ok=True)
  runs = _plan(args.mode)
  if args.smoke:
    runs = [_smoke(r) for r in runs]
  if args.only:
    runs = [r for r in runs if r['contender'] in args.only]
  if len(os.sched_getaffinity(0)) < 2:
    runs = [r for r in runs if r['threads'] == 1]
  notes = []
  why = _usable(args.tf_python)
  if why:
    notes.append(f'TF Addons LazyAdam skipped (--tf-python {why}); make its '
                 'interpreter with the commands in benchmarks/README.md and '
                 'pass --tf-python /work/venvs/tf/bin/python')
    runs = [r for r in runs if not r['contender'].startswith('tf_')]
  why = _usable(args.fbgemm_python)
  if why:
    notes.append(f'FBGEMM skipped (--fbgemm-python {why}); make its '
                 'interpreter with the commands in benchmarks/README.md and '
                 'pass --fbgemm-python /work/venvs/fbgemm/bin/python')
    runs = [r for r in runs if 'fbgemm' not in r['contender']]
  for note in notes:
    print('note:', note, flush=True)

  results = {'mode': args.mode, 'started': time.strftime('%Y-%m-%d %H:%M:%S'),
             'cpus': len(os.sched_getaffinity(0)),
             'load_before': os.getloadavg(), 'runs': [], 'floors': [],
             'notes': notes, 'smoke': args.smoke,
             'huge_pages': args.huge_pages,
             'argv': sys.argv[1:]}
  t_start = time.perf_counter()
  path = os.path.join(out, 'results.json')
  for cfg in _floor_plan(runs):
    cfg = dict(cfg, pool=8)
    res = _run_one('floor', cfg, 1, 300)
    results['floors'].append(dict(cfg, **res))
    print(f'[{time.perf_counter() - t_start:6.1f}s] floor {cfg["rows"]:>9} '
          f'x {cfg["row"]:<3} ids {cfg["ids"]:<5} {cfg["dist"]:7} '
          f'{res.get("floor_ms", float("nan")):.3f} ms '
          f'{res.get("error", "")}', flush=True)
  for i, cfg in enumerate(runs):
    warmup, steps, min_steps, budget = _STEPS[args.mode][_kind(
        cfg['contender'])]
    if args.smoke:
      warmup, steps, min_steps, budget = 1, 3, 2, 0.0
    cfg = dict(cfg, pool=16, grad_pool=4, warmup=warmup, steps=steps,
               min_steps=min_steps, budget_s=budget)
    module, python = _script(cfg['contender'], args.tf_python,
                             args.fbgemm_python)
    res = _run_one(module, cfg, cfg['threads'], 600, python)
    results['runs'].append(dict(cfg, **res))
    train = res.get('train', {}).get('median_ms', float('nan'))
    note = res.get('error') or res.get('skipped') or ''
    if 'compile_s' in res and res['compile_s']:
      note = f'compile {res["compile_s"]:.2f} s {note}'
    print(f'[{time.perf_counter() - t_start:6.1f}s] {i + 1:3}/{len(runs)} '
          f'{cfg["contender"]:27} {cfg["rows"]:>9} x {cfg["row"]:<3} ids '
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
  print(report.ratio_lines(results))
  print(f'wrote {out} in {results["elapsed_s"]:.0f} s')


if __name__ == '__main__':
  main()
