"""A/B of the deduplication methods inside whole train steps, interleaved.

    python3 -m benchmarks.experiments.dedup_methods          # both steps
    taskset -c 0 python3 -m benchmarks.experiments.dedup_methods \
        --step dlrm_lazy
    python3 -m benchmarks.experiments.dedup_methods --methods search,packed

XLA's deduplication finds each id's slot with 'packed' keys (one uint32 sort
of `id << bits | position`, no loop), 'search' (sort +
`searchsorted(method='scan')`) or 'auto' (packed up to
`dedup.PACKED_MAX_IDS` = 2,048 ids, the library's default); this script
switches that limit, and hides the C++ kernels (as the tests do) so that
XLA's deduplication runs at all. For each method the step (the target's
`lazy_sparse`: 1,000,000 x 64, 4,096 Zipf ids; or `harness/dlrm.py`'s
26-table `dlrm_lazy`) is traced and compiled once, then all methods are
timed in turn, round after round, so that the two sides of each comparison
are measured seconds apart. Prints trace and compile times and the median
and minimum step times.
Pin with `taskset` for one thread.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import DLRM_DEFAULTS
from benchmarks.harness import contenders
from benchmarks.harness import dlrm


def _setup(step_name: str):
  import jax  # pylint: disable=g-import-not-at-top

  if step_name == 'target':
    s = contenders.jax_setup({'contender': 'lazy_sparse', 'rows': 1_000_000,
                              'row': 64, 'ids': 4096, 'dist': 'zipf',
                              'pool': 8})
    params = s.fresh_params()
    return (jax.jit(s.train_step, donate_argnums=(0, 1)), params,
            s.tx.init(params), s.batches)
  return dlrm.jax_setup(dict(DLRM_DEFAULTS, contender=step_name, pool=8))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--step', nargs='*', default=['target', 'dlrm_lazy'])
  parser.add_argument('--methods', default='search,packed')
  parser.add_argument('--rounds', type=int, default=8)
  args = parser.parse_args()
  from lazy_optax._src import cpu_kernels  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import dedup  # pylint: disable=g-import-not-at-top

  default_max = dedup.PACKED_MAX_IDS
  limits = {'packed': 2**31, 'search': 0, 'auto': default_max}
  cpu_kernels.loaded = lambda: False  # XLA's deduplication, every method

  print(f'load average {os.getloadavg()[0]:.2f}, '
        f'{len(os.sched_getaffinity(0))} CPU(s)')
  for step_name in args.step:
    methods = args.methods.split(',')
    box = {}
    batches = None
    for m in methods:
      dedup.PACKED_MAX_IDS = limits[m]
      step, params, state, batches = _setup(step_name)
      t0 = time.perf_counter()
      lowered = step.lower(params, state, batches[0])
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      print(f'{step_name} {m}: trace {t1 - t0:.2f} s, compile {t2 - t1:.2f} s',
            flush=True)
      box[m] = [compiled, params, state]
    dedup.PACKED_MAX_IDS = default_max
    reps = 200 if step_name == 'target' else 40
    times: dict = {m: [] for m in methods}
    for _ in range(args.rounds):
      for m in methods:
        compiled, params, state = box[m]
        for r in range(reps + 5):
          if r == 5:
            t = time.perf_counter()
          params, state, loss = compiled(params, state, batches[r % 8])
        loss.block_until_ready()
        times[m].append((time.perf_counter() - t) / reps * 1e3)
        box[m][1:] = [params, state]
    for m, x in times.items():
      print(f'{step_name} {m:8s} median {np.median(x):.3f} ms, '
            f'min {min(x):.3f} ms')


if __name__ == '__main__':
  main()
