"""lazy_optax against TensorFlow, torch, FBGEMM and optax, side by side.

From the repository root (`python3 -m benchmarks.run` works the same), with
the peers' interpreters made by `python3 benchmarks/peers.py setup DIR`:

    export LAZY_OPTAX_TF_PYTHON=DIR/tf/bin/python
    export LAZY_OPTAX_FBGEMM_PYTHON=DIR/fbgemm/bin/python
    python3 benchmarks/run.py --mode quick --out OUT   # about 2 min, 2 idle cores
    python3 benchmarks/run.py --mode full --out OUT    # + opt step, sweeps
    python3 benchmarks/run.py --huge-pages --out OUT   # on huge pages

Each configuration (a workload at 1 or 2 threads) runs every contender in a
`taskset`-pinned process of its own (TensorFlow Addons and FBGEMM in their
own interpreters: their numpy and torch cannot share this one), every
contender's timed step after a write of twice the CPU's largest cache (cold
caches for all, `common.cache_flusher`). The processes take rounds: round 1
of every process, then round 2 (in reverse order), and so on; a contender's
time is the median over rounds of each round's median step. Results go to `OUT`
(`results.json`, `results.md` with every table, PNG plots), never over the
committed `benchmarks/results/` (a folder there must be named `tmp*`); the
table that docs/performance.md shows is printed, then every ratio and goal.

Target configuration (1,000,000 x 64 float32 table, 4,096 Zipf ids):
  lazy_sparse           lazy_optax.lazy_adam, SparseRows gradient, jit, donated
  tf_lazy_adam          TF Addons LazyAdam, tf.function (needs its peer)
  torch_sparse          torch.optim.SparseAdam, nn.Embedding(sparse=True)
  optax_dense           optax.adam, dense gradient, jit, donated
  rowwise_adagrad       lazy_optax.rowwise_adagrad, SparseRows, jit, donated
  fbgemm_rowwise_adagrad  FBGEMM's CPU table-batched embedding with
                        EXACT_ROWWISE_ADAGRAD (needs its peer)
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
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import common
from benchmarks import peers
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

# Steps a round: (warm-up, max timed steps, min timed steps, budget s).
_STEPS = {
    'quick': {'sparse': (3, 40, 10, 0.5), 'dense': (1, 2, 2, 0.2),
              'dlrm_sparse': (2, 30, 8, 0.5), 'dlrm_dense': (1, 2, 2, 0.2)},
    'full': {'sparse': (5, 100, 20, 1.2), 'dense': (1, 4, 3, 0.8),
             'dlrm_sparse': (3, 80, 20, 1.5), 'dlrm_dense': (1, 3, 2, 1.0)},
}
ROUNDS = 3  # of the target and DLRM configurations; the sweeps take 1


def _kind(contender: str) -> str:
  if contender.startswith('dlrm_'):
    return 'dlrm_dense' if contender.endswith('dense') else 'dlrm_sparse'
  return 'sparse' if contender in SPARSE else 'dense'


def _group(cfg: dict, contenders, threads: int, sweep: str, rounds: int,
           opt: bool = False) -> dict:
  """One configuration at one thread count: its contenders, run together."""
  return {'cfg': dict(cfg, sweep=sweep, threads=threads, opt=opt),
          'contenders': list(contenders), 'rounds': rounds}


def _plan(mode: str) -> list[dict]:
  """The groups of a mode, in the order they run."""
  full = mode == 'full'
  groups = []
  for threads in (1, 2):
    groups.append(_group(TARGET, CONTENDERS if full else QUICK_CONTENDERS,
                         threads, 'target', ROUNDS, opt=full))
  for threads in (1, 2):
    dlrm_c = [c for c in DLRM_CONTENDERS if full or threads == 1
              or c != 'dlrm_optax_dense']  # quick: its 1-thread compile
    groups.append(_group(DLRM, dlrm_c, threads, 'dlrm', ROUNDS))
  if not full:
    return groups
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
        groups.append(_group(cfg, SWEEP_CONTENDERS, 1, sweep, 1))
  return groups


def _smoke(cfg: dict) -> dict:
  """A configuration shrunk to 10,000-row tables (DLRM's capped there)."""
  small = 10_000
  if cfg['sweep'] == 'dlrm':
    cap = dict(cfg, cap=small)
    return dict(cap, rows=sum(common.cardinalities(cap)),
                floor=dict(cfg['floor'], rows=small))
  return dict(cfg, rows=min(cfg['rows'], small))


def _floor_plan(groups: list[dict]) -> list[dict]:
  seen, out = set(), []
  for g in groups:
    f = g['cfg'].get('floor', g['cfg'])
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


def _env(threads: int) -> dict:
  """A contender process's environment: this checkout first on its path."""
  env = dict(os.environ, **_EXTRA_ENV)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['OMP_NUM_THREADS'] = str(threads)
  env['PYTHONPATH'] = os.pathsep.join(
      [ROOT] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
  return env


def _run_one(module: str, cfg: dict, threads: int, timeout: float) -> dict:
  """Runs `python -m benchmarks.harness.MODULE CFG`, pinned; its JSON result."""
  cmd = _pin(threads) + [sys.executable, '-m', f'benchmarks.harness.{module}',
                         json.dumps(cfg)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=_env(threads), timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {'error': f'exit {proc.returncode}: ' + ' | '.join(tail)}
  try:
    return json.loads(proc.stdout.strip().splitlines()[-1])
  except (ValueError, IndexError):
    return {'error': 'no JSON output: ' + proc.stdout[-300:]}


class _Process:
  """A contender process (`common.serve`): started, asked for rounds, ended."""

  def __init__(self, module: str, python: str, cfgs: list[dict],
               threads: int):
    self.names = [c['contender'] for c in cfgs]
    self.err = tempfile.TemporaryFile(mode='w+')
    cmd = _pin(threads) + [python, '-m', f'benchmarks.harness.{module}',
                           json.dumps(cfgs)]
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=self.err,
                                 text=True, env=_env(threads))
    self.lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._pump, daemon=True).start()

  def _pump(self) -> None:
    for line in self.proc.stdout:
      if line.startswith(common.MARK):
        self.lines.put(json.loads(line[len(common.MARK):]))
    self.lines.put(None)

  def answer(self, timeout: float = 900) -> dict:
    """The next answer, or `{name: {'error': ...}}` where none came."""
    try:
      got = self.lines.get(timeout=timeout)
    except queue.Empty:
      got, why = None, f'no answer in {timeout:.0f} s'
    if got is None:
      if self.proc.poll() is not None:
        self.err.seek(0)
        tail = self.err.read().strip().splitlines()[-3:]
        why = f'exit {self.proc.returncode}: ' + ' | '.join(tail)
      self.close()
      return {n: {'error': why} for n in self.names}
    return got

  def round(self) -> dict:
    """Times one round of this process's contenders."""
    if self.proc.poll() is not None:
      return {n: {'error': 'process ended'} for n in self.names}
    self.proc.stdin.write('round\n')
    self.proc.stdin.flush()
    return self.answer()

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
    self.err.close()


def _module(contender: str) -> tuple[str, str]:
  """(module, peer) that measures a contender; peer '' for this interpreter."""
  if contender.startswith('tf_'):
    return 'tf_contender', 'tf'
  if 'fbgemm' in contender:
    return 'fbgemm_contender', 'fbgemm'
  if contender.startswith('dlrm_'):
    return 'dlrm', ''
  return 'contenders', ''


def process_of(contender: str) -> tuple[str, str, str]:
  """(module, peer, contender): the process that measures a contender, one of
  its own. Beside torch in one process, JAX's single-table step took 1.89
  to 1.95 ms, against 1.40 to 1.44 ms alone (1 thread, cold caches, 3
  rounds, 2026-11-29)."""
  return (*_module(contender), contender)


def _record(cfg: dict, r: int, info: dict, got: dict) -> dict:
  """One (contender, round) of results.json."""
  rec = dict(cfg, round=r, **info)
  rec.pop('plan', None)
  for part in ('train', 'opt'):
    res = got.get(part)
    if res and 'error' in res:
      rec['error'] = res['error']
    elif res:
      rec[part] = res
  if 'error' in got:
    rec['error'] = got['error']
  if 'peak_rss_mb' in got:
    rec['peak_rss_mb'] = got['peak_rss_mb']
  return rec


def _run_group(group: dict, mode: str, pythons: dict, smoke: bool
               ) -> list[dict]:
  """Runs one group's processes round by round; its records."""
  base = _smoke(group['cfg']) if smoke else group['cfg']
  threads = base['threads']
  by_proc: dict = {}
  for c in group['contenders']:
    plan = _STEPS[mode][_kind(c)]
    if smoke:
      plan = (1, 3, 2, 0.0)
    cfg = dict(base, contender=c, pool=16, grad_pool=4,
               plan={'train': plan, 'opt': plan})
    by_proc.setdefault(process_of(c), []).append(cfg)
  # Built one after another, so that no process's compile time counts
  # another's.
  procs, infos = [], {}
  for (m, peer, _), cfgs in by_proc.items():
    procs.append((_Process(m, pythons[peer], cfgs, threads), cfgs))
    infos.update(procs[-1][0].answer())
  records = []
  for r in range(group['rounds']):
    for p, cfgs in (procs if r % 2 == 0 else procs[::-1]):
      got = p.round()
      for cfg in cfgs:
        name = cfg['contender']
        records.append(_record(cfg, r, infos.get(name, {}),
                               got.get(name, {})))
  for p, _ in procs:
    p.close()
  return records


def _check_out(out: str) -> str:
  """`out` as an absolute path; exits if it names a committed results folder."""
  out = os.path.abspath(out)
  if os.path.commonpath([out, RESULTS]) == RESULTS:
    first = os.path.relpath(out, RESULTS).split(os.sep)[0]
    if not first.startswith('tmp'):
      raise SystemExit(
          f'--out {out} is a committed results folder: name another one '
          '(outside the repository, or benchmarks/results/tmp*, which git '
          'ignores)')
  return out


def _peers(args, groups: list[dict]) -> tuple[dict, list[str], list[dict]]:
  """The interpreters, the notes on missing peers, the groups without them."""
  pythons = {'': sys.executable}
  notes = []
  for peer, flag, what in (('tf', args.tf_python, 'TF Addons LazyAdam'),
                           ('fbgemm', args.fbgemm_python, 'FBGEMM')):
    python = peers.python_for(peer, flag)
    why = peers.why_unusable(python)
    if why:
      var = peers.PEERS[peer][0]
      notes.append(f'{what} skipped (${var} or --{peer}-python {why}); '
                   'make it with `python3 benchmarks/peers.py setup DIR`')
      for g in groups:
        g['contenders'] = [c for c in g['contenders']
                           if _module(c)[1] != peer]
    pythons[peer] = python
  return pythons, notes, groups


def _floors(groups: list[dict], t_start: float) -> list[dict]:
  """The memory-traffic floor of every configuration, one process each."""
  floors = []
  for cfg in _floor_plan(groups):
    cfg = dict(cfg, pool=8)
    res = _run_one('floor', cfg, 1, 300)
    floors.append(dict(cfg, **res))
    print(f'[{time.perf_counter() - t_start:6.1f}s] floor {cfg["rows"]:>9} '
          f'x {cfg["row"]:<3} ids {cfg["ids"]:<5} {cfg["dist"]:7} '
          f'{res.get("floor_ms", float("nan")):.3f} ms '
          f'{res.get("error", "")}', flush=True)
  return floors


def _print_records(records: list[dict], t_start: float) -> None:
  for rec in records:
    train = rec.get('train', {}).get('median_ms', float('nan'))
    note = rec.get('error') or rec.get('skipped') or ''
    print(f'[{time.perf_counter() - t_start:6.1f}s] round {rec["round"]} '
          f'{rec["contender"]:27} {rec["rows"]:>9} x {rec["row"]:<3} ids '
          f'{rec["ids"]:<5} {rec["dist"]:7} threads {rec["threads"]}: '
          f'train {train:9.3f} ms {note}', flush=True)


def _parse() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--mode', choices=('quick', 'full'), default='quick')
  parser.add_argument('--out', required=True,
                      help='output folder (created; not a committed one)')
  parser.add_argument('--only', nargs='*', default=None,
                      help='run only these contenders')
  parser.add_argument('--tf-python', default=None, metavar='PATH',
                      help='interpreter with tensorflow-cpu 2.15.1 and '
                      'tensorflow-addons (default $LAZY_OPTAX_TF_PYTHON; '
                      'without one the TF contender is skipped)')
  parser.add_argument('--fbgemm-python', default=None, metavar='PATH',
                      help='interpreter with torch 2.14.1 and fbgemm-gpu-cpu '
                      '1.9.0 (default $LAZY_OPTAX_FBGEMM_PYTHON; without one '
                      'the FBGEMM contenders are skipped)')
  parser.add_argument('--smoke', action='store_true',
                      help='run every path of the mode once at small sizes '
                      '(10,000-row tables, a few steps): a check that the '
                      'harness works, not a measurement')
  parser.add_argument('--huge-pages', action='store_true',
                      help='run every contender (TF and torch included) with '
                      'GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so that large '
                      'tables sit on transparent huge pages')
  return parser.parse_args()


def main() -> None:
  args = _parse()
  if args.huge_pages:
    _EXTRA_ENV.update(HUGE_PAGES_ENV)
  out = _check_out(args.out)
  os.makedirs(out, exist_ok=True)
  groups = _plan(args.mode)
  if args.only:
    for g in groups:
      g['contenders'] = [c for c in g['contenders'] if c in args.only]
  if len(os.sched_getaffinity(0)) < 2:
    groups = [g for g in groups if g['cfg']['threads'] == 1]
  pythons, notes, groups = _peers(args, groups)
  groups = [g for g in groups if g['contenders']]
  for note in notes:
    print('note:', note, flush=True)
  results = {'mode': args.mode, 'started': time.strftime('%Y-%m-%d %H:%M:%S'),
             'cpus': len(os.sched_getaffinity(0)), 'machine': report.machine(),
             'load_before': os.getloadavg(), 'runs': [], 'floors': [],
             'notes': notes, 'smoke': args.smoke,
             'huge_pages': args.huge_pages, 'argv': sys.argv[1:]}
  t_start = time.perf_counter()
  path = os.path.join(out, 'results.json')
  results['floors'] = _floors(
      [dict(g, cfg=_smoke(g['cfg'])) if args.smoke else g for g in groups],
      t_start)
  for group in groups:
    records = _run_group(group, args.mode, pythons, args.smoke)
    _print_records(records, t_start)
    results['runs'] += records
    with open(path, 'w') as f:
      json.dump(results, f, indent=1)
  results['elapsed_s'] = time.perf_counter() - t_start
  results['load_after'] = os.getloadavg()
  with open(path, 'w') as f:
    json.dump(results, f, indent=1)
  report.write(results, out)
  print(report.summary([results]))
  print(report.ratio_lines(results))
  print(f'wrote {out} in {results["elapsed_s"]:.0f} s')


if __name__ == '__main__':
  main()
