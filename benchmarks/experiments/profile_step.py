"""Where a lazy_adam train step spends its time: compiled HLO, op counts, flags.

    python3 -m benchmarks.experiments.profile_step    # the steps, as measured
    python3 -m benchmarks.experiments.profile_step --variants all  # + XLA_FLAGS
    python3 -m benchmarks.experiments.profile_step --rows 10000 --cap 10000

For the lazy_adam step of the target configuration (`harness/contenders.py`'s
`lazy_sparse`: 1,000,000 x 64 table, 4,096 Zipf ids, jit, donated) and the
26-table DLRM step (`harness/dlrm.py`'s `dlrm_lazy`), this module

- writes the optimized HLO (`jax.jit(f).lower(...).compile().as_text()`) to
  `OUT/<step>.hlo.txt`;
- counts the ops of the compiled module (gather, scatter, sort, fusion, while,
  copy, custom-call, ...), in the entry computation and in all computations;
- reports XLA's cost and memory analyses, the trace and compile times, and
  the median step time;
- with `--variants`, repeats the compile and timing in a fresh process per
  `XLA_FLAGS` variant (XLA reads the flags once, at start-up).

Everything goes to `OUT/profile.json` and `OUT/profile.md` (default
`benchmarks/results/tmp_profile/`, not committed) and to the terminal.
Record findings in benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import DLRM_DEFAULTS
from benchmarks.harness import contenders
from benchmarks.harness import dlrm

RESULTS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'results')

# XLA_FLAGS variants worth trying on the CPU backend (name -> flags).
VARIANTS = {
    'default': '',
    'no_fusion_emitters': '--xla_cpu_use_fusion_emitters=false',
    'fast_math': '--xla_cpu_enable_fast_math=true',
    'no_eigen_threads': '--xla_cpu_multi_thread_eigen=false',
    'no_xnnpack': '--xla_cpu_use_xnnpack=false',
    'region_copy_insertion': '--xla_cpu_copy_insertion_use_region_analysis'
                             '=true',
    'opt_level_1': '--xla_backend_optimization_level=1',
    'cheap_llvm': '--xla_llvm_disable_expensive_passes=true',
}
_OPS = ('gather', 'scatter', 'sort', 'fusion', 'while', 'conditional', 'copy',
        'custom-call', 'dynamic-slice', 'dynamic-update-slice', 'reduce',
        'dot', 'select-and-scatter', 'iota', 'concatenate', 'call')
_OP_RE = re.compile(
    r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(')


def count_ops(hlo: str) -> dict:
  """Op counts of an HLO module text: {'entry': {...}, 'all': {...}}."""
  entry: collections.Counter = collections.Counter()
  everywhere: collections.Counter = collections.Counter()
  fusion_kinds: collections.Counter = collections.Counter()
  in_entry = False
  for line in hlo.splitlines():
    if line.startswith('ENTRY '):
      in_entry = True
      continue
    if in_entry and line.startswith('}'):
      in_entry = False
    m = _OP_RE.match(line)
    if not m:
      continue
    op = m.group(1)
    everywhere[op] += 1
    if in_entry:
      entry[op] += 1
      if op == 'fusion':
        kind = re.search(r'kind=(k\w+)', line)
        fusion_kinds[kind.group(1) if kind else '?'] += 1
  return {'entry': dict(entry), 'all': dict(everywhere),
          'entry_fusion_kinds': dict(fusion_kinds),
          'entry_ops': sum(entry.values()), 'all_ops': sum(everywhere.values())}


def _steps(args) -> dict:
  """name -> (jitted step, params, state, batches) makers."""
  import jax  # pylint: disable=g-import-not-at-top

  def target():
    cfg = {'contender': 'lazy_sparse', 'rows': args.rows, 'row': 64,
           'ids': 4096, 'dist': 'zipf', 'pool': 4}
    s = contenders.jax_setup(cfg)
    params = s.fresh_params()
    step = jax.jit(s.train_step, donate_argnums=s.donate)
    return step, params, s.tx.init(params), s.batches

  def dlrm_step():
    cfg = dict(DLRM_DEFAULTS, contender='dlrm_lazy', cap=args.cap, pool=4)
    return dlrm.jax_setup(cfg)

  def dlrm_concat():
    cfg = dict(DLRM_DEFAULTS, contender='dlrm_lazy_concat', cap=args.cap,
               pool=4)
    return dlrm.jax_setup(cfg)

  return {'lazy_adam_target': target, 'dlrm_26_tables': dlrm_step,
          'dlrm_concatenated': dlrm_concat}


def measure(args, dump: bool) -> dict:
  """Compiles and times every step in this process (one XLA_FLAGS setting)."""
  import jax  # pylint: disable=g-import-not-at-top

  out = {}
  for name, make in _steps(args).items():
    if args.only and name not in args.only:
      continue
    step, params, state, batches = make()
    t0 = time.perf_counter()
    lowered = step.lower(params, state, batches[0])
    trace_s = time.perf_counter() - t0
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    res: dict = {'trace_s': trace_s, 'compile_s': compile_s}
    hlo = compiled.as_text()
    res['ops'] = count_ops(hlo)
    if dump:
      path = os.path.join(args.out, f'{name}.hlo.txt')
      with open(path, 'w') as f:
        f.write(hlo)
      res['hlo_file'] = path
      res['hlo_chars'] = len(hlo)
    try:
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      res['cost'] = {k: float(v) for k, v in (cost or {}).items()
                     if k in ('flops', 'bytes accessed', 'transcendentals')}
    except Exception as e:  # pylint: disable=broad-except
      res['cost'] = {'error': str(e)[:200]}
    mem = compiled.memory_analysis()
    if mem is not None:
      res['temp_mb'] = mem.temp_size_in_bytes / 2**20
    box = [params, state]
    del params, state
    times = []
    for k in range(args.warmup + args.steps):
      t0 = time.perf_counter()
      p, s, loss = compiled(box[0], box[1], batches[k % len(batches)])
      loss.block_until_ready()
      box[0], box[1] = p, s
      if k >= args.warmup:
        times.append(time.perf_counter() - t0)
    res['step_ms'] = {'median': 1e3 * float(np.median(times)),
                      'p10': 1e3 * float(np.percentile(times, 10)),
                      'p90': 1e3 * float(np.percentile(times, 90)),
                      'n': len(times)}
    # A jaxpr effect (a checkify check, a debug callback) sends every call
    # of the jitted step through JAX's Python dispatch path: the time until
    # the call returns (before the step has run) shows it.
    res['effects'] = sorted(type(e).__name__ for e in
                            jax.make_jaxpr(step)(box[0], box[1],
                                                 batches[0]).effects)
    returns = []
    for k in range(args.steps):
      t0 = time.perf_counter()
      p, s, loss = step(box[0], box[1], batches[k % len(batches)])
      returns.append(time.perf_counter() - t0)
      loss.block_until_ready()
      box[0], box[1] = p, s
    res['dispatch_ms'] = 1e3 * float(np.median(returns))
    del box, compiled, lowered
    jax.clear_caches()
    out[name] = res
  return out


def _variant(args, name: str, flags: str) -> dict:
  env = dict(os.environ)
  env.setdefault('JAX_PLATFORMS', 'cpu')
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' ' + flags).strip()
  cmd = [sys.executable, '-m', 'benchmarks.experiments.profile_step', '--child',
         '--rows', str(args.rows), '--cap', str(args.cap), '--steps',
         str(args.steps), '--warmup', str(args.warmup), '--out', args.out]
  if args.only:
    cmd += ['--only', *args.only]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                        timeout=900, check=False)
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
    return {'error': f'{name}: exit {proc.returncode}: ' + ' | '.join(tail)}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _markdown(report: dict) -> str:
  lines = ['# lazy_adam step profile', '',
           f'{report["started"]}, {report["cpus"]} CPUs, load average '
           f'{report["load"][0]:.2f}, jax {report["jax"]}; table rows '
           f'{report["rows"]:,}, DLRM tables capped at {report["cap"]:,}.',
           '']
  for name, res in report['steps'].items():
    ops = res['ops']
    lines += [f'## {name}', '',
              f'- trace {res["trace_s"]:.2f} s, compile (with trace) '
              f'{res["compile_s"]:.2f} s; step {res["step_ms"]["median"]:.3f} '
              f'ms median ({res["step_ms"]["p10"]:.3f} to '
              f'{res["step_ms"]["p90"]:.3f}); XLA temporaries '
              f'{res.get("temp_mb", float("nan")):.2f} MB; cost analysis '
              f'{res.get("cost")}',
              f'- jaxpr effects {res.get("effects")}; a `jax.jit` call returns '
              f'after {res.get("dispatch_ms", float("nan")):.3f} ms (dispatch; '
              'an effect makes it take the Python path)',
              f'- entry computation: {ops["entry_ops"]} ops, fusions by kind '
              f'{ops["entry_fusion_kinds"]}; whole module {ops["all_ops"]} ops',
              '', '| op | in entry | in all computations |',
              '| --- | --- | --- |']
    for op in _OPS:
      e, a = ops['entry'].get(op, 0), ops['all'].get(op, 0)
      if e or a:
        lines.append(f'| {op} | {e} | {a} |')
    lines.append('')
  if report.get('variants'):
    names = list(report['steps'])
    lines += ['## XLA_FLAGS variants (fresh process each)', '',
              '| variant | flags | ' + ' | '.join(
                  f'{n} compile s / step ms' for n in names) + ' |',
              '| --- | --- |' + ' --- |' * len(names)]
    for vname, res in report['variants'].items():
      if 'error' in res:
        lines.append(f'| {vname} | `{VARIANTS[vname]}` | {res["error"]} |')
        continue
      cells = []
      for n in names:
        r = res.get(n)
        cells.append('' if r is None else
                     f'{r["compile_s"]:.2f} / {r["step_ms"]["median"]:.3f}')
      lines.append(f'| {vname} | `{VARIANTS[vname] or "(none)"}` | '
                   + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rows', type=int, default=1_000_000,
                      help='rows of the single table (default 1,000,000)')
  parser.add_argument('--cap', type=int, default=1_000_000,
                      help='row cap of the DLRM tables (default 1,000,000)')
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--warmup', type=int, default=5)
  parser.add_argument('--only', nargs='*', default=None,
                      help='steps to profile: lazy_adam_target, '
                      'dlrm_26_tables, dlrm_concatenated')
  parser.add_argument('--variants', default='',
                      help="comma-separated XLA_FLAGS variants, or 'all': "
                      + ', '.join(VARIANTS))
  parser.add_argument('--out', default=os.path.join(RESULTS, 'tmp_profile'))
  parser.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.makedirs(args.out, exist_ok=True)
  if args.child:
    print(json.dumps(measure(args, dump=False)))
    return
  wanted = (list(VARIANTS) if args.variants == 'all'
            else [v for v in args.variants.split(',') if v])
  unknown = [v for v in wanted if v not in VARIANTS]
  if unknown:
    raise SystemExit(f'unknown variants {unknown}; known: '
                     f'{", ".join(VARIANTS)}')
  import jax  # pylint: disable=g-import-not-at-top

  report = {'started': time.strftime('%Y-%m-%d %H:%M:%S'),
            'cpus': len(os.sched_getaffinity(0)), 'load': os.getloadavg(),
            'jax': jax.__version__, 'rows': args.rows, 'cap': args.cap,
            'xla_flags': os.environ.get('XLA_FLAGS', ''),
            'steps': measure(args, dump=True)}
  if wanted:
    report['variants'] = {}
    for v in wanted:
      print(f'variant {v}: XLA_FLAGS={VARIANTS[v]!r}', flush=True)
      report['variants'][v] = _variant(args, v, VARIANTS[v])
  with open(os.path.join(args.out, 'profile.json'), 'w') as f:
    json.dump(report, f, indent=1)
  text = _markdown(report)
  with open(os.path.join(args.out, 'profile.md'), 'w') as f:
    f.write(text)
  print(text)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
