"""XLA's deduplication variants in the single-table train step, on any device.

    python3 -m benchmarks.experiments.dedup_variants_gpu [--quick]

`dedup.py` picks XLA's way of finding each id's slot from CPU measurements:
packed keys (one sort, no loop) for batches of at most
`dedup.PACKED_MAX_IDS` ids, else binary search (`searchsorted(method=
'scan')`, a `while` loop of log2(N) trips). On a GPU a loop trip is a launch
or more, so the cut may belong elsewhere. This times the train step of
`gpu_steps` (`lazy_adam`, 4,096 Zipf ids; on a CPU run it with
`LAZY_OPTAX_CPU_KERNELS=0`, or the kernel dedups) under each variant, steps
interleaved in one process:

- `auto`: as shipped;
- `packed`: packed keys at any batch size where the keys fit 32 bits (the
  1,000,000-row table at 4,096 ids; a 10,000,000-row table falls back to
  binary search);
- `search_sort` / `search_compare_all`: binary search replaced by
  `searchsorted(method='sort')` / `'compare_all'` (no loop).

Each variant is traced and compiled while its setting holds; the steps then
run in turn. Prints the medians and each variant's ratio to `auto`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json

import jax

from benchmarks import common
from benchmarks.experiments import gpu_steps
from lazy_optax._src import dedup


@contextlib.contextmanager
def variant(name: str):
  """Sets `dedup`'s module attributes for `name` while the step compiles."""
  saved = dedup.PACKED_MAX_IDS, dedup._slots_search  # pylint: disable=protected-access
  if name == 'packed':
    dedup.PACKED_MAX_IDS = 1 << 30
  elif name.startswith('search_'):
    dedup.PACKED_MAX_IDS = 0
    dedup._slots_search = functools.partial(  # pylint: disable=protected-access
        saved[1], search=name[len('search_'):])
  try:
    yield
  finally:
    dedup.PACKED_MAX_IDS, dedup._slots_search = saved  # pylint: disable=protected-access


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--steps', type=int, default=100)
  parser.add_argument('--warmup', type=int, default=10)
  args = parser.parse_args()
  sizes = (1_000_000, 10_000_000)
  pool = 32
  if args.quick:
    sizes, args.steps, args.warmup, pool = (100_000,), 5, 2, 4
  out = {'device': str(jax.devices()[0]), 'jax': jax.__version__}
  for rows in sizes:
    cfg = dict(common.TARGET, rows=rows, pool=pool, seed=0,
               contender='lazy_sparse')
    runs, compile_s = {}, {}
    for name in ('auto', 'packed', 'search_sort', 'search_compare_all'):
      with variant(name):
        runs[name], compile_s[name] = gpu_steps.jax_train(cfg)
    ms = gpu_steps.interleaved(runs, args.steps, args.warmup)
    out[f'rows_{rows}'] = {'step_ms': ms, 'compile_s': compile_s}
    print(f'\nlazy_adam train step, {rows:,} x 64, XLA path')
    for name, t in ms.items():
      print(f'  {name:20s} {t:8.3f} ms  {t / ms["auto"]:5.2f}x auto')
  print(json.dumps(out))


if __name__ == '__main__':
  main()
