"""Markdown tables, target ratios and PNG plots from a `results.json`.

    python3 -m benchmarks.harness.report OUT/results.json
    python3 -m benchmarks.harness.report RUN1/results.json RUN2/results.json ...

`benchmarks/run.py` calls `write` at the end of a run and prints `summary`,
the tables docs/performance.md shows. Given one file, this module redraws
its report; given several, it prints those tables and every ratio with the
range seen across the runs (what the docs publish).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import sys

import numpy as np

from benchmarks.common import TARGET

LABELS = {
    'lazy_sparse': 'lazy_optax lazy_adam, SparseRows (jit, donated)',
    'tf_lazy_adam': 'TF Addons LazyAdam (tf.function)',
    'lazy_sparse_nodonate': 'lazy_optax lazy_adam, SparseRows, NOT donated',
    'lazy_dense_skip': 'lazy_optax lazy(adam, skip_zero_rows), dense grad',
    'optax_dense': 'optax.adam, dense grad (jit, donated)',
    'torch_sparse': 'torch SparseAdam, Embedding(sparse=True)',
    'torch_dense': 'torch Adam, dense Embedding',
    'rowwise_adagrad': 'lazy_optax rowwise_adagrad, SparseRows (jit, donated)',
    'fbgemm_rowwise_adagrad': 'FBGEMM CPU TBE, EXACT_ROWWISE_ADAGRAD',
}
ORDER = tuple(LABELS)
DLRM_LABELS = {
    'dlrm_lazy': 'lazy_optax lazy_adam, 26 tables (lookup, value_and_grad)',
    'dlrm_lazy_concat': 'lazy_optax lazy_adam, 26 tables concatenated into 1',
    'dlrm_torch_sparse': 'torch SparseAdam, 26 Embedding(sparse=True)',
    'dlrm_optax_dense': 'optax.adam, dense grads (jit, donated)',
    'dlrm_rowwise_adagrad': 'lazy_optax rowwise_adagrad, 26 tables',
    'dlrm_fbgemm_rowwise_adagrad': 'FBGEMM CPU TBE (26 tables), '
                                   'EXACT_ROWWISE_ADAGRAD; torch Adagrad MLP',
}
LAZY = ('lazy_sparse', 'dlrm_lazy', 'dlrm_lazy_concat')

# The rows of docs/performance.md's tables: (label, contender, the contender
# its ratio divides by, or None for no ratio).
SUMMARY_TARGET = (
    ('`lazy_optax.lazy_adam`, jit, donated', 'lazy_sparse', None),
    ('TF Addons `LazyAdam` (`tf.function`, `IndexedSlices`)', 'tf_lazy_adam',
     'lazy_sparse'),
    ('torch `SparseAdam`, `nn.Embedding(sparse=True)`', 'torch_sparse',
     'lazy_sparse'),
    ('`optax.adam`, dense gradient, jit, donated', 'optax_dense',
     'lazy_sparse'),
    ('`lazy_adam` NOT donated', 'lazy_sparse_nodonate', 'lazy_sparse'),
    ('`lazy(optax.adam, skip_zero_rows=True)`, dense gradient',
     'lazy_dense_skip', 'lazy_sparse'),
    ('torch `Adam`, dense `nn.Embedding`', 'torch_dense', 'lazy_sparse'),
    ('`lazy_optax.rowwise_adagrad`', 'rowwise_adagrad', None),
    ('FBGEMM CPU row-wise Adagrad (`EXACT_ROWWISE_ADAGRAD`)',
     'fbgemm_rowwise_adagrad', 'rowwise_adagrad'),
)
SUMMARY_DLRM = (
    ('`lazy_adam`, 26 tables', 'dlrm_lazy', None),
    ('`lazy_adam`, the 26 tables concatenated into one', 'dlrm_lazy_concat',
     None),
    ('torch `SparseAdam` (+ `Adam` for the MLP)', 'dlrm_torch_sparse',
     'dlrm_lazy'),
    ('`optax.adam`, dense gradients', 'dlrm_optax_dense', 'dlrm_lazy'),
    ('`rowwise_adagrad`, 26 tables (the MLP too)', 'dlrm_rowwise_adagrad',
     None),
    ('FBGEMM, the 26 tables in one TBE, the MLP with `torch.optim.Adagrad`',
     'dlrm_fbgemm_rowwise_adagrad', 'dlrm_rowwise_adagrad'),
)


def machine() -> str:
  """This machine in a few words: CPU model, cores, memory, OS."""
  cpu = platform.processor() or platform.machine()
  mem = ''
  try:
    with open('/proc/cpuinfo') as f:
      names = [ln.split(':', 1)[1].strip() for ln in f
               if ln.startswith('model name')]
    cpu = names[0] if names else cpu
    with open('/proc/meminfo') as f:
      kb = int(f.readline().split()[1])
    mem = f', {kb / 2**20:.0f} GiB'
  except (OSError, ValueError, IndexError):
    pass
  return (f'{cpu}, {os.cpu_count()} cores{mem}, {platform.system()} '
          f'{platform.release()}')


def _span(values: list[float], fmt: str) -> str:
  """'v' for one value (or equal ones), else 'lo to hi'; `fmt` 'ms' gives
  three significant digits, whole numbers from 1,000 on."""

  def text(v):
    if fmt == 'ms':
      return f'{v:,.0f}' if v >= 1000 else f'{v:.3g}'
    return format(v, fmt)

  lo, hi = text(min(values)), text(max(values))
  return lo if lo == hi else f'{lo} to {hi}'


def _cell(runs: list[dict], contender: str, base: str | None, sweep: str,
          threads: int) -> str:
  """One table cell: the step time over `runs`, and its ratio to `base`."""
  times, ratios_ = [], []
  for res in runs:
    t = _train(res, contender, threads=threads, sweep=sweep)
    b = _train(res, base, threads=threads, sweep=sweep) if base else None
    if t is not None:
      times.append(t)
      if b:
        ratios_.append(t / b)
  if not times:
    return ''
  text = f'{_span(times, "ms")} ms'
  if ratios_:
    text += f' ({_span(ratios_, ".2f")}x)'
  return text


def _summary_table(runs: list[dict], rows: tuple, sweep: str) -> list[str]:
  lines = ['| train step, median | 1 thread | 2 threads |',
           '| --- | --- | --- |']
  for label, c, base in rows:
    cells = [_cell(runs, c, base, sweep, t) for t in (1, 2)]
    if any(cells):
      lines.append(f'| {label} | {cells[0]} | {cells[1]} |')
  return lines if len(lines) > 2 else []


def summary(runs: list[dict]) -> str:
  """docs/performance.md's tables from one run, or ranges over several.

  Args:
    runs: the contents of one or more `results.json`.

  Returns:
    Markdown: the single-table and the DLRM tables, a step time and, in
    parentheses, its ratio to lazy_optax's (computed within each run),
    each as 'lo to hi' over the runs.
  """
  smoke = ' (SMOKE: small tables, not a measurement)' if any(
      r.get('smoke') for r in runs) else ''
  after = [r.get('load_after', [math.nan])[0] for r in runs]
  head = (f'{len(runs)} run(s) of `benchmarks/run.py --mode '
          f'{runs[0]["mode"]}`{smoke}, started '
          f'{", ".join(r["started"] for r in runs)}, on '
          f'{runs[0].get("machine", "an unnamed machine")}; load average '
          f'before {_span([r["load_before"][0] for r in runs], ".1f")}, '
          f'after {_span(after, ".1f")}.')
  lines = [head, '', '**A 1,000,000 x 64 float32 table, 4,096 Zipf ids a '
           'step**', '', *_summary_table(runs, SUMMARY_TARGET, 'target'),
           '', '**A DLRM-shaped model** (26 tables)', '',
           *_summary_table(runs, SUMMARY_DLRM, 'dlrm')]
  comp = [(_dlrm_compile(r, 'dlrm_lazy'), _dlrm_compile(r, 'dlrm_optax_dense'))
          for r in runs]
  comp = [(a, b) for a, b in comp if a and b]
  if comp:
    lines.append(
        f'| first-call compile: `lazy_adam` / `optax.adam` (1 thread) | '
        f'{_span([a for a, _ in comp], ".2f")} s / '
        f'{_span([b for _, b in comp], ".2f")} s '
        f'({_span([a / b for a, b in comp], ".2f")}x) | |')
  return '\n'.join(lines)


def ratio_spans(runs: list[dict]) -> str:
  """Every ratio of `ratios` with its range over `runs`, and its goal."""
  seen: dict = {}
  for res in runs:
    for what, value, goal in ratios(res):
      what = re.sub(r' \([0-9.e+-]+( s)? / [0-9.e+-]+ m?s,?[^)]*\)', '',
                    what)
      seen.setdefault((what, goal), []).append(value)
  lines = [f'Every ratio over {len(runs)} run(s), lowest to highest (goal):',
           '']
  for (what, goal), values in seen.items():
    got = [v for v in values if v is not None]
    span = _span(got, '.2f') + 'x' if got else 'n/a'
    lines.append(f'- {what}: {span} ({goal})')
  return '\n'.join(lines)


def _key(r: dict) -> tuple:
  return (r['rows'], r['row'], r['ids'], r['dist'])


def _target_key(results: dict) -> tuple:
  """The target configuration of a run (smaller in `--smoke` runs)."""
  for r in results['runs']:
    if r.get('sweep') == 'target':
      return _key(r)
  return _key(TARGET)


def _median_over_rounds(runs: list[dict], part: str) -> dict | None:
  """Median over rounds of each round's median (and of its p10, p90)."""
  got = [r[part] for r in runs if isinstance(r.get(part), dict)]
  if not got:
    return None
  return {k: float(np.median([g[k] for g in got]))
          for k in ('median_ms', 'p10_ms', 'p90_ms')}


def _select(results: dict, **want) -> list[dict]:
  return [r for r in results['runs']
          if all(r.get(k) == v for k, v in want.items())]


def _floor(results: dict, key: tuple) -> float | None:
  for f in results.get('floors', []):
    if _key(f) == key and 'floor_ms' in f:
      return f['floor_ms']
  return None


def _fmt(stats: dict | None) -> str:
  if not stats:
    return 'n/a'
  return (f'{stats["median_ms"]:.3g} ({stats["p10_ms"]:.3g} to '
          f'{stats["p90_ms"]:.3g})')


def _train(results: dict, contender: str, **cfg) -> float | None:
  runs = _select(results, contender=contender, **cfg)
  stats = _median_over_rounds(runs, 'train')
  return stats['median_ms'] if stats else None


def _dlrm_train(results: dict, contender: str, threads: int) -> float | None:
  return _train(results, contender, threads=threads, sweep='dlrm')


def _dlrm_compile(results: dict, contender: str, threads: int = 1
                  ) -> float | None:
  got = [r['compile_s'] for r in _select(results, contender=contender,
                                         threads=threads, sweep='dlrm')
         if r.get('compile_s')]
  return float(np.median(got)) if got else None


def _div(a: float | None, b: float | None) -> float | None:
  return None if a is None or b is None or b == 0 else a / b


def ratios(results: dict) -> list[tuple[str, float | None, str]]:
  """(what, value, goal) for every target that the run covers."""
  out = []
  floor = _floor(results, _target_key(results))
  for threads in (1, 2):
    cfg = dict(threads=threads, sweep='target')
    lazy = _train(results, 'lazy_sparse', **cfg)
    if lazy is None:
      continue

    def ratio(other, lazy=lazy, cfg=cfg):
      t = _train(results, other, **cfg)
      return None if t is None else t / lazy

    out.append((f'{threads} thread(s): TF Addons LazyAdam train step / '
                'lazy_adam', ratio('tf_lazy_adam'), '>= 2'))
    out.append((f'{threads} thread(s): torch SparseAdam train step / '
                'lazy_adam', ratio('torch_sparse'), '>= 3.5'))
    out.append((f'{threads} thread(s): optax.adam train step / lazy_adam',
                ratio('optax_dense'), '>= 50'))
    out.append((f'{threads} thread(s): lazy_adam / memory-traffic floor',
                None if floor is None else lazy / floor, '<= 2'))
    out.append((f'{threads} thread(s): NOT donated / donated lazy_adam',
                ratio('lazy_sparse_nodonate'), '(cost of no donation)'))
    out.append((f'{threads} thread(s): torch dense Adam / lazy_adam',
                ratio('torch_dense'), '(info)'))
    out.append((f'{threads} thread(s): lazy skip_zero_rows (dense grad) / '
                'lazy_adam', ratio('lazy_dense_skip'), '(info)'))
    out.append((f'{threads} thread(s): rowwise_adagrad / lazy_adam',
                ratio('rowwise_adagrad'), '<= 0.6'))
  for threads in (1, 2):
    lazy = _dlrm_train(results, 'dlrm_lazy', threads)
    if lazy is None:
      continue
    out.append((f'DLRM {threads} thread(s): torch SparseAdam / 26-table '
                'lazy_adam', _div(_dlrm_train(results, 'dlrm_torch_sparse',
                                              threads), lazy), '>= 2.5'))
    out.append((f'DLRM {threads} thread(s): 26-table / concatenated '
                'lazy_adam', _div(lazy, _dlrm_train(
                    results, 'dlrm_lazy_concat', threads)), '<= 1.2'))
    out.append((f'DLRM {threads} thread(s): optax.adam / 26-table lazy_adam',
                _div(_dlrm_train(results, 'dlrm_optax_dense', threads), lazy),
                '(info)'))
    out.append((f'DLRM {threads} thread(s): rowwise_adagrad / lazy_adam',
                _div(_dlrm_train(results, 'dlrm_rowwise_adagrad', threads),
                     lazy), '<= 0.6'))
  out += fbgemm_ratios(results)
  for c, what in (('lazy_sparse', 'lazy_adam 1,000,000 x 64'),
                  ('dlrm_lazy', 'DLRM 26-table lazy_adam'),
                  ('dlrm_lazy_concat', 'DLRM concatenated lazy_adam')):
    if c == 'lazy_sparse':
      t1, t2 = (_train(results, c, **dict(threads=t, sweep='target'))
                for t in (1, 2))
    else:
      t1, t2 = (_dlrm_train(results, c, t) for t in (1, 2))
    if t1 is not None and t2 is not None:
      out.append((f'{what}: 2 threads / 1 thread', t2 / t1, '<= 1'))
  c_lazy = _dlrm_compile(results, 'dlrm_lazy')
  c_dense = _dlrm_compile(results, 'dlrm_optax_dense')
  if c_lazy and c_dense:
    out.append((f'DLRM compile time: 26-table lazy_adam / optax.adam '
                f'({c_lazy:.2f} s / {c_dense:.2f} s, 1 thread)',
                c_lazy / c_dense, '<= 1.3'))
  small = _train(results, 'lazy_sparse', rows=10_000, row=64, ids=4096,
                 dist='zipf', threads=1, sweep='rows')
  big = _train(results, 'lazy_sparse', rows=4_000_000, row=64, ids=4096,
               dist='zipf', threads=1, sweep='rows')
  if small and big:
    out.append(('1 thread: lazy_adam at 4,000,000 rows / at 10,000 rows',
                big / small, '<= 1.5'))
  # Informational ratios whose contender did not run are left out.
  return [r for r in out if r[1] is not None or not r[2].startswith('(')]


def fbgemm_ratios(results: dict) -> list[tuple[str, float | None, str]]:
  """FBGEMM's row-wise Adagrad step over `rowwise_adagrad`'s, where both ran."""
  out = []
  for threads in (1, 2):
    for what, fbgemm, lazy, cfg, goal in (
        ('1,000,000 x 64', 'fbgemm_rowwise_adagrad', 'rowwise_adagrad',
         dict(threads=threads, sweep='target'), '>= 6'),
        ('DLRM 26 tables', 'dlrm_fbgemm_rowwise_adagrad',
         'dlrm_rowwise_adagrad', dict(threads=threads, sweep='dlrm'),
         '>= 4')):
      a, b = _train(results, fbgemm, **cfg), _train(results, lazy, **cfg)
      if a is not None and b is not None:
        out.append((f'{what}, {threads} thread(s): FBGEMM row-wise Adagrad '
                    f'/ rowwise_adagrad ({a:.3g} / {b:.3g} ms)', a / b, goal))
  return out


def _met(value: float | None, goal: str) -> str:
  """'met', 'missed' or '' for a goal such as '>= 1.3' or '<= 1.2'."""
  parts = goal.split()
  if value is None or len(parts) != 2 or parts[0] not in ('>=', '<='):
    return ''
  try:
    bound = float(parts[1])
  except ValueError:
    return ''
  ok = value >= bound if parts[0] == '>=' else value <= bound
  return 'met' if ok else 'MISSED'


def ratio_lines(results: dict) -> str:
  """The ratios as aligned text lines, for the terminal."""
  rows = ratios(results)
  if not rows:
    return 'no ratios: the run measured no lazy_optax target'
  width = max(len(w) for w, _, _ in rows)
  lines = ['ratios measured in this run (interleaved, side by side):']
  for what, value, goal in rows:
    val = 'n/a' if value is None else f'{value:.2f}x'
    lines.append(f'  {what:<{width}}  {val:>8}  goal {goal:<8} '
                 f'{_met(value, goal)}')
  if results.get('load_before'):
    lines.append(f'  (load average before {results["load_before"][0]:.2f}, '
                 f'after {results.get("load_after", [math.nan])[0]:.2f})')
  return '\n'.join(lines)


def _floor_for(results: dict, run: dict) -> dict | None:
  f = run.get('floor', run)
  for fl in results.get('floors', []):
    if _key(fl) == _key(f) and 'floor_ms' in fl:
      return fl
  return None


def _bandwidth_table(results: dict) -> list[str]:
  """Effective bandwidth of each lazy step against the machine's."""
  lines = ['| lazy step | threads | bytes a step (MB) | step ms | effective '
           'GB/s | machine random-row GB/s | effective / machine |',
           '| --- | --- | --- | --- | --- | --- | --- |']
  for c in LAZY:
    for threads in (1, 2):
      sweep = 'target' if c == 'lazy_sparse' else 'dlrm'
      runs = [r for r in _select(results, contender=c, threads=threads,
                                 sweep=sweep)
              if 'train' in r and 'traffic' in r]
      if not runs:
        continue
      ms = _median_over_rounds(runs, 'train')['median_ms']
      nbytes = runs[0]['traffic']['bytes']
      eff = nbytes / (ms * 1e-3) / 1e9
      fl = _floor_for(results, runs[0])
      machine = (None if fl is None else
                 (fl['bytes_read'] + fl['bytes_written']) / fl['floor_ms']
                 / 1e6)
      label = LABELS.get(c) or DLRM_LABELS[c]
      lines.append(
          f'| {label} | {threads} | {nbytes / 1e6:.2f} | {ms:.3g} | '
          f'{eff:.2f} | {"n/a" if machine is None else f"{machine:.2f}"} | '
          f'{"n/a" if machine is None else f"{eff / machine:.2f}"} |')
  return lines if len(lines) > 2 else []


def _dlrm_table(results: dict) -> list[str]:
  lines = ['| contender | threads | train step ms, median (p10 to p90) | '
           'compile s (trace s) | XLA temp MB | RSS MB added at setup | '
           'loss, step 2 |',
           '| --- | --- | --- | --- | --- | --- | --- |']
  for c, label in DLRM_LABELS.items():
    for threads in (1, 2):
      runs = _select(results, contender=c, threads=threads, sweep='dlrm')
      if not runs:
        continue
      if not any('train' in r for r in runs):
        note = runs[0].get('skipped') or runs[0].get('error')
        lines.append(f'| {label} | {threads} | {note} | | | | |')
        continue
      runs = [r for r in runs if 'train' in r]
      comp = np.median([r.get('compile_s', 0.0) for r in runs])
      trace = [r['trace_s'] for r in runs if 'trace_s' in r]
      temp = [r['xla_temp_mb'] for r in runs if 'xla_temp_mb' in r]
      comp_txt = (f'{comp:.2f} ({np.median(trace):.2f})' if trace
                  else '(eager)')
      lines.append(
          f'| {label} | {threads} | '
          f'{_fmt(_median_over_rounds(runs, "train"))} | {comp_txt} | '
          f'{f"{np.median(temp):.1f}" if temp else ""} | '
          f'{max(r.get("rss_added_mb", math.nan) for r in runs):.0f} | '
          f'{runs[-1].get("first_loss", math.nan):.4f} |')
  return lines if len(lines) > 2 else []


def _digest_notes(results: dict) -> list[str]:
  """Warns where contenders of one configuration saw different ids."""
  seen: dict = {}
  for r in results['runs']:
    if 'ids_digest' in r:
      key = (r.get('sweep'), r['rows'], r['row'], r['ids'], r['dist'])
      seen.setdefault(key, set()).add(r['ids_digest'])
  return [f'WARNING: contenders of {k} saw different id batches ({v})'
          for k, v in seen.items() if len(v) > 1]


def _target_table(results: dict, threads: int) -> list[str]:
  lines = [
      f'| contender ({threads} thread{"s" if threads > 1 else ""}) | '
      'train step ms, median (p10 to p90) | optimizer step alone ms | '
      'compile s | RSS MB added at setup |',
      '| --- | --- | --- | --- | --- |']
  cfg = dict(threads=threads, sweep='target')
  for c in ORDER:
    runs = [r for r in _select(results, contender=c, **cfg)
            if 'train' in r or 'skipped' in r or 'error' in r]
    if not runs:
      continue
    if 'train' not in runs[0]:
      note = runs[0].get('skipped') or runs[0].get('error')
      lines.append(f'| {LABELS[c]} | {note} | | | |')
      continue
    compile_s = np.median([r['compile_s'] for r in runs if 'compile_s' in r])
    rss = max(r.get('rss_added_mb', math.nan) for r in runs)
    compile_txt = f'{compile_s:.2f}' if compile_s else '(eager)'
    lines.append(
        f'| {LABELS[c]} | {_fmt(_median_over_rounds(runs, "train"))} | '
        f'{_fmt(_median_over_rounds(runs, "opt"))} | {compile_txt} | '
        f'{rss:.0f} |')
  return lines


_SWEEPS = (('rows', 'table rows'), ('ids', 'ids per batch'),
           ('row', 'floats per row'))


def _sweep_points(results: dict, sweep: str, key: str, dist: str,
                  contender: str) -> list[tuple[int, dict]]:
  pts = {}
  for r in results['runs']:
    if (r['contender'] != contender or r['dist'] != dist
        or r['threads'] != 1 or 'train' not in r):
      continue
    others = {k: v for k, v in TARGET.items() if k not in (key, 'dist')}
    if any(r[k] != v for k, v in others.items()):
      continue
    if r['sweep'] not in (sweep, 'target') and not (
        sweep != 'rows' and r['sweep'] == 'rows'):
      continue
    pts.setdefault(r[key], []).append(r)
  return sorted((x, _median_over_rounds(rs, 'train')) for x, rs in pts.items())


def _sweep_tables(results: dict) -> list[str]:
  lines = []
  for dist in ('zipf', 'uniform'):
    for sweep, title in _SWEEPS:
      cols = [c for c in ORDER
              if _sweep_points(results, sweep, sweep, dist, c)]
      xs = sorted({x for c in cols
                   for x, _ in _sweep_points(results, sweep, sweep, dist, c)})
      if len(xs) < 2:
        continue
      lines += ['', f'Train step ms (median), {dist} ids, against {title} '
                '(others as the target configuration; 1 thread):', '',
                f'| {title} | ' + ' | '.join(cols) + ' |',
                '| --- |' + ' --- |' * len(cols)]
      for x in xs:
        cells = []
        for c in cols:
          d = dict(_sweep_points(results, sweep, sweep, dist, c))
          cells.append(f'{d[x]["median_ms"]:.3g}' if x in d else '')
        lines.append(f'| {x:,} | ' + ' | '.join(cells) + ' |')
  return lines


def _plots(results: dict, out: str) -> list[str]:
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return []
  written = []
  # Target configuration: bars per contender, 1 and 2 threads.
  fig, ax = plt.subplots(figsize=(9, 4.5))
  width = 0.38
  for j, threads in enumerate((1, 2)):
    cfg = dict(threads=threads, sweep='target')
    vals, errs = [], [[], []]
    for c in ORDER:
      s = _median_over_rounds(_select(results, contender=c, **cfg), 'train')
      vals.append(s['median_ms'] if s else math.nan)
      errs[0].append(s['median_ms'] - s['p10_ms'] if s else 0)
      errs[1].append(s['p90_ms'] - s['median_ms'] if s else 0)
    if all(math.isnan(v) for v in vals):
      continue
    ax.bar(np.arange(len(ORDER)) + (j - 0.5) * width, vals, width,
           yerr=errs, capsize=3, label=f'{threads} thread(s)')
  floor = _floor(results, _target_key(results))
  if floor:
    ax.axhline(floor, color='k', ls=':', lw=1,
               label=f'memory-traffic floor {floor:.2f} ms')
  ax.set_yscale('log')
  ax.set_xticks(np.arange(len(ORDER)))
  ax.set_xticklabels([c.replace('_', '\n') for c in ORDER], fontsize=8)
  ax.set_ylabel('train step, ms (median, p10 to p90)')
  ax.set_title('1,000,000 x 64 float32 table, 4,096 Zipf ids per step')
  ax.legend(fontsize=8)
  fig.tight_layout()
  name = 'target.png'
  fig.savefig(os.path.join(out, name), dpi=110)
  plt.close(fig)
  written.append(name)
  # Sweeps.
  have = [(s, t) for s, t in _SWEEPS
          if len(_sweep_points(results, s, s, 'zipf', 'lazy_sparse')) > 1]
  if have:
    fig, axes = plt.subplots(len(have), 2, figsize=(11, 3.6 * len(have)),
                             squeeze=False)
    for i, (sweep, title) in enumerate(have):
      for j, dist in enumerate(('zipf', 'uniform')):
        ax = axes[i][j]
        for c in ORDER:
          pts = _sweep_points(results, sweep, sweep, dist, c)
          if len(pts) < 2:
            continue
          xs = [x for x, _ in pts]
          med = np.array([s['median_ms'] for _, s in pts])
          lo = med - np.array([s['p10_ms'] for _, s in pts])
          hi = np.array([s['p90_ms'] for _, s in pts]) - med
          ax.errorbar(xs, med, yerr=[lo, hi], marker='o', ms=3, capsize=2,
                      label=c)
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xlabel(title)
        ax.set_ylabel('train step ms')
        ax.set_title(f'{dist} ids, 1 thread', fontsize=9)
        ax.grid(True, which='both', alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    name = 'sweeps.png'
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    written.append(name)
  return written


def write(results: dict, out: str) -> str:
  """Writes `results.md` and the plots into `out`; returns the Markdown."""
  smoke = (', SMOKE RUN: small tables, a few steps, not a measurement'
           if results.get('smoke') else '')
  huge = (', every contender with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 '
          '(transparent huge pages)' if results.get('huge_pages') else '')
  lines = [f'# lazy_optax benchmark ({results["mode"]} mode{smoke}{huge})',
           '',
           f'Started {results["started"]} on '
           f'{results.get("machine", "an unnamed machine")}, '
           f'{results["cpus"]} CPUs usable, load '
           f'average before {results["load_before"][0]:.2f}, after '
           f'{results.get("load_after", [math.nan])[0]:.2f}; '
           f'{results.get("elapsed_s", math.nan):.0f} s in all.', '',
           '## Targets', '',
           'Whole train steps; target configuration 1,000,000 x 64 float32, '
           '4,096 Zipf ids; DLRM: 26 Criteo Kaggle tables (capped at '
           '1,000,000 rows) x 16, batch 2,048, MLP. Every timed step starts '
           'with cold caches: before it, its process writes twice the '
           "CPU's largest cache, at least 64 MiB (`common.cache_flusher`).",
           '',
           '| ratio | measured | goal | |', '| --- | --- | --- | --- |']
  for what, value, goal in ratios(results):
    lines.append(f'| {what} | '
                 f'{"n/a" if value is None else f"{value:.2f}"} | {goal} | '
                 f'{_met(value, goal)} |')
  for note in results.get('notes', []) + _digest_notes(results):
    lines += ['', f'Note: {note}.']
  floor = next((f for f in results.get('floors', [])
                if _key(f) == _target_key(results) and 'floor_ms' in f), None)
  if floor:
    lines += ['', f'Memory-traffic floor: {floor["floor_ms"]:.3f} ms '
              f'({floor["bytes_read"] / 1e6:.2f} MB of rows read at '
              f'{floor["gather_gb_s"]:.2f} GB/s, '
              f'{floor["bytes_written"] / 1e6:.2f} MB written at '
              f'{floor["scatter_gb_s"]:.2f} GB/s; '
              f'{floor["unique_rows"]:.0f} distinct rows a batch).']
  for threads in (1, 2):
    table = _target_table(results, threads)
    if len(table) > 2:
      lines += ['', *table]
  dlrm_lines = _dlrm_table(results)
  if dlrm_lines:
    first = next(r for r in results['runs'] if r.get('sweep') == 'dlrm')
    mlp = '-'.join(map(str, [26 * first['row'] + first['dense'],
                             *first['mlp'], 1]))
    lines += ['', f'## DLRM-shaped model (26 tables, {first["rows"]:,} rows '
              f'x {first["row"]}, batch {first["batch"]:,}, MLP {mlp})', '',
              *dlrm_lines]
  bw = _bandwidth_table(results)
  if bw:
    lines += ['', '## Effective bandwidth of the lazy steps', '',
              'Bytes that a lazy Adam step cannot avoid moving (ids; looked-up '
              'and gradient rows, one per id; touched rows of the parameter, '
              '`mu` and `nu`, read and written; dense parameters, their '
              'gradient and moments), divided by the median step time, next '
              "to this machine's random-row bandwidth measured by `floor.py` "
              '(numpy/torch gathers and scatters, 1 thread; 256-byte rows for '
              'the single table, 64-byte rows for the DLRM tables).', '', *bw]
  lines += _sweep_tables(results)
  plots = _plots(results, out)
  if plots:
    lines += [''] + [f'![{p}]({p})' for p in plots]
  text = '\n'.join(lines) + '\n'
  with open(os.path.join(out, 'results.md'), 'w') as f:
    f.write(text)
  return text


def main() -> None:
  paths = sys.argv[1:]
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append(json.load(f))
  if len(runs) == 1:
    write(runs[0], os.path.dirname(os.path.abspath(paths[0])))
  print(summary(runs) + '\n')
  print(ratio_spans(runs))


if __name__ == '__main__':
  main()
