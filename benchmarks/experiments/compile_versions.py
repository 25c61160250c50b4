"""Trace and compile times of the DLRM-shaped step, several versions side by side.

    python3 -m benchmarks.experiments.compile_versions ROOT [ROOT ...]
        [--rounds 3] [--cap 1000000]

Each root is a directory that holds a `lazy_optax` package (a checkout, or
`git archive <commit> lazy_optax | tar -x -C DIR`). For every round and every
root in turn, a fresh process pinned to one thread builds the DLRM-shaped
train steps of `benchmarks/harness/dlrm.py` (26 tables: `lazy_adam` on the
separate tables, on the tables concatenated into one, and `optax.adam` with
dense gradients) and times `jax.jit(...).trace` and `.lower(...).compile()`
of each. The driver prints the median seconds per root and contender, each
lazy step's compile time over `optax.adam`'s in the same process, and each
root's times over the first root's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

_CONTENDERS = ('dlrm_lazy', 'dlrm_lazy_concat', 'dlrm_optax_dense')

_WORKER = r'''
import json, os, sys, time
os.environ['XLA_FLAGS'] = ('--xla_cpu_multi_thread_eigen=false '
                           'intra_op_parallelism_threads=1')
import lazy_optax
assert os.path.realpath(lazy_optax.__file__).startswith(
    os.path.realpath(sys.argv[1])), lazy_optax.__file__
from benchmarks.common import DLRM_DEFAULTS
from benchmarks.harness import dlrm
out = {}
for name in json.loads(sys.argv[3]):
  cfg = dict(DLRM_DEFAULTS, contender=name, cap=int(sys.argv[2]), pool=2)
  step, params, state, batches = dlrm.jax_setup(cfg)
  t0 = time.perf_counter()
  traced = step.trace(params, state, batches[0])
  t1 = time.perf_counter()
  traced.lower().compile()
  t2 = time.perf_counter()
  out[name] = {'trace_s': t1 - t0, 'compile_s': t2 - t1}
  del step, params, state, batches
print('@@' + json.dumps(out), flush=True)
'''


def _run(root: str, cap: int) -> dict:
  here = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, here]))
  proc = subprocess.run(
      [sys.executable, '-c', _WORKER, root, str(cap),
       json.dumps(_CONTENDERS)], env=env, capture_output=True, text=True,
      check=False, cwd=root)
  for line in proc.stdout.splitlines():
    if line.startswith('@@'):
      return json.loads(line[2:])
  raise RuntimeError(f'{root}: {proc.stderr[-2000:]}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('roots', nargs='+')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--cap', type=int, default=1_000_000)
  args = parser.parse_args()
  runs: dict[str, list[dict]] = {r: [] for r in args.roots}
  for k in range(args.rounds):
    for root in args.roots:
      runs[root].append(_run(root, args.cap))
      print(f'round {k + 1}, {root}: {json.dumps(runs[root][-1])}',
            flush=True)
  medians = {
      root: {c: {t: float(np.median([r[c][t] for r in rs]))
                 for t in ('trace_s', 'compile_s')} for c in _CONTENDERS}
      for root, rs in runs.items()}
  first = args.roots[0]
  print('\nmedian seconds (trace, compile); compile / optax.adam in the same '
        f'process; compile / {first}')
  for root, m in medians.items():
    for c in _CONTENDERS:
      ratios = [r[c]['compile_s'] / r['dlrm_optax_dense']['compile_s']
                for r in runs[root]]
      print(f'{root:>24} {c:>18}  trace {m[c]["trace_s"]:6.2f}  compile '
            f'{m[c]["compile_s"]:6.2f}  / optax.adam '
            f'{min(ratios):.2f}x to {max(ratios):.2f}x  / first '
            f'{m[c]["compile_s"] / medians[first][c]["compile_s"]:.2f}x')


if __name__ == '__main__':
  main()
