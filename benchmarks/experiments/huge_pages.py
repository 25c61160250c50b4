"""`lazy_optax.perf.advise_huge_pages`: one train step on 4 KiB and huge pages.

    taskset -c 0 python3 -m benchmarks.experiments.huge_pages     # 1 thread
    taskset -c 0,1 python3 -m benchmarks.experiments.huge_pages   # 2 threads
    python3 -m benchmarks.experiments.huge_pages --dlrm   # 26 tables too

One process, one compiled step, two sets of params and optimizer state: one
left as XLA allocated it, one passed through `advise_huge_pages` after
`init`. Rounds of steps alternate between the two (interleaved A/B), and the
script prints the median step time of each and their ratio, with the
process's `AnonHugePages` before and after. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import LR
from benchmarks.harness import contenders
from benchmarks.harness import dlrm


def _huge_mib() -> float:
  with open('/proc/self/smaps_rollup') as f:
    for line in f:
      if line.startswith('AnonHugePages:'):
        return int(line.split()[1]) / 1024
  return float('nan')


def _ab(name, compiled, make, batches, rounds, steps):
  import jax

  import lazy_optax

  boxes = {}
  before = _huge_mib()
  for label in ('4 KiB pages', 'huge pages'):
    params, state = make()
    if label == 'huge pages':
      advised = lazy_optax.perf.advise_huge_pages((params, state))
    boxes[label] = [params, state]
  after = _huge_mib()
  times = {k: [] for k in boxes}

  def run(box, k):
    p, s, loss = compiled(box[0], box[1], batches[k % len(batches)])
    jax.block_until_ready(loss)
    box[0], box[1] = p, s

  for box in boxes.values():
    for k in range(20):
      run(box, k)
  for _ in range(rounds):
    for label, box in boxes.items():
      samples = []
      for k in range(steps):
        t0 = time.perf_counter()
        run(box, k)
        samples.append(time.perf_counter() - t0)
      times[label].append(np.median(samples) * 1e3)
  small = float(np.median(times['4 KiB pages']))
  huge = float(np.median(times['huge pages']))
  print(f'{name}: {small:.3f} ms on 4 KiB pages, {huge:.3f} ms on huge pages '
        f'(ratio {small / huge:.2f}x; {rounds} interleaved rounds of {steps} '
        f'steps); advised {advised / 2**20:.0f} MiB, AnonHugePages '
        f'{before:.0f} -> {after:.0f} MiB', flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--steps', type=int, default=150)
  parser.add_argument('--dlrm', action='store_true',
                      help='also the 26-table DLRM-shaped step')
  args = parser.parse_args()
  import jax

  import lazy_optax

  print(f'{len(os.sched_getaffinity(0))} CPUs', flush=True)
  cfg = {'contender': 'lazy_sparse', 'rows': 1_000_000, 'row': 64,
         'ids': 4096, 'dist': 'zipf', 'pool': 16, 'seed': 0}
  setup = contenders.jax_setup(cfg)

  def make():
    params = setup.fresh_params()
    return params, setup.tx.init(params)

  params, state = make()
  compiled = jax.jit(setup.train_step, donate_argnums=(0, 1)).lower(
      params, state, setup.batches[0]).compile()
  del params, state
  _ab('lazy_adam 1,000,000 x 64, 4,096 Zipf ids', compiled, make,
      setup.batches, args.rounds, args.steps)
  if args.dlrm:
    dcfg = dict(DLRM_DEFAULTS, contender='dlrm_lazy', pool=8, seed=0)
    step, params, state, batches = dlrm.jax_setup(dcfg)
    host = jax.tree.map(np.asarray, params)
    compiled = step.lower(params, state, batches[0]).compile()
    del params, state
    tx = lazy_optax.lazy_adam(LR)

    def make_dlrm():
      p = jax.tree.map(jax.numpy.asarray, host)
      return p, tx.init(p)

    _ab('DLRM 26 tables x 16, batch 2,048', compiled, make_dlrm, batches,
        args.rounds, max(20, args.steps // 5))


if __name__ == '__main__':
  main()
