"""The C++ `IdTable.assign` against XLA's: keep or cut by measurement.

    taskset -c 0 python3 -m benchmarks.experiments.keep_or_cut
    taskset -c 0 python3 -m benchmarks.experiments.keep_or_cut --only assign

Each pair is two compiled, donated train steps run in one process, step by
step one after the other (the order alternating from step to step, so that
a change of load hits both), in rounds: per round the median CPU time per step
(`time.process_time`, every thread) of each, then over the rounds the median
of those medians, their spread (min to max) and the ratio of each round.
XLA runs on `--threads` threads (`XLA_FLAGS`, set before JAX is imported;
pin the process to as many cores with `taskset`). The CPU kernels must be
loaded (`python3 -m lazy_optax.build_kernels`).

- `assign`: the hashed step (`IdTable.assign` + `reset_rows` + `lookup` +
  `value_and_grad` + `lazy_adam` + `apply_updates`, `hashed_table`'s
  `hashed_train_step`) with `IdTable`'s C++ `assign`, against the same step
  traced with that kernel refused (`id_kernels.usable` patched to False
  while tracing: XLA's `assign`, what GPU and TPU run). Capacity 1,000,000
  x 64 floats, 4,096 Zipf ids a step (exponent 1.05) from 10**7, the table
  filled for `--fill` steps first; both runs start from the same state and
  must end with equal id states.
- `adagradw` and `max_norm` (AdagradW's split kernel with its fused add in
  `apply_updates`, and row max-norm's fused add, against the same rules
  without them) measured 1.00x and 1.04x; both paths were then removed.
  Their pairs are in this script as of commit a37810b
  (`git show a37810b:benchmarks/experiments/keep_or_cut.py`).
- `gradient` (the gradient side's C++ row moves: the single-table step,
  `TARGET`'s 1,000,000 x 64 with 4,096 Zipf ids and `lazy_adam(1e-3)`,
  its gradient from `value_and_grad(..., impl='auto')` against
  `impl='xla'`) measured 1.056x; the gradient side then moved to XLA's ops
  alone. The pair is in this script as of commit 8f4076c.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import time

import numpy as np

from benchmarks.common import TARGET
from benchmarks.experiments.hashed_table import hashed_train_step
from benchmarks.experiments.hashed_table import zipf_stream

PAIRS = ('assign',)


@contextlib.contextmanager
def patched(module_name: str, name: str, value):
  """`module.name = value` inside the block."""
  module = importlib.import_module(module_name)
  old = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, old)


def interleave(runs: dict, rounds: int, steps: int) -> dict:
  """Per-round median CPU ms of each run, step by step in alternating order."""
  names = list(runs)
  out = {name: [] for name in names}
  for _ in range(rounds):
    samples = {name: [] for name in names}
    for k in range(steps):
      for name in (names if k % 2 == 0 else names[::-1]):
        t0 = time.process_time()
        runs[name]()
        samples[name].append(time.process_time() - t0)
    for name in names:
      out[name].append(float(np.median(samples[name])) * 1e3)
  return out


def report(title: str, times: dict, base: str, other: str) -> dict:
  """Prints the medians, spreads and per-round ratios `other / base`."""
  ratios = [o / b for b, o in zip(times[base], times[other])]
  print(title)
  for name in (base, other):
    t = times[name]
    print(f'  {name:34s} median {np.median(t):7.3f} ms  spread '
          f'{min(t):.3f} - {max(t):.3f} ms')
  print(f'  {other} / {base}: median {np.median(ratios):.3f}x, spread '
        f'{min(ratios):.3f} - {max(ratios):.3f}x over {len(ratios)} rounds')
  return {'times': times, 'ratios': ratios}


def compile_step(step, donate, *args):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.jit(step, donate_argnums=donate).lower(*args).compile()


def targets(compiled) -> set:
  """The lazy_optax FFI targets a compiled step calls."""
  import re  # pylint: disable=g-import-not-at-top
  return set(re.findall(r'lazy_optax_(LazyOptax\w+)', compiled.as_text()))


def assign_pair(args) -> dict:
  """The hashed step with the C++ `assign` and with XLA's."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  cap, dim = TARGET['rows'], TARGET['row']
  total = args.fill + args.rounds * args.steps + 1
  words = lazy_optax.split_ids(zipf_stream(10 ** 7, TARGET['ids'], total,
                                           1.05, 0))
  table = lazy_optax.IdTable(capacity=cap, probe=16, eviction_log=0)
  tx = lazy_optax.lazy_adam(1e-3)
  step = hashed_train_step(table, tx, jax.nn.initializers.normal(0.01),
                           jax.random.key(0))
  fill = jax.jit(lambda s, w, k: table.assign(s, w, step=k)[1],
                 donate_argnums=0)
  ids = table.init()
  for k in range(args.fill):
    ids = fill(ids, words[k], jnp.int32(k))

  def start():
    params = {'table': jax.random.normal(jax.random.key(1), (cap, dim))
                       * 0.01, 'w': jnp.ones((dim,), jnp.float32)}
    return [params, tx.init(params), jax.tree.map(jnp.copy, ids)]

  example = (*start(), jnp.asarray(words[0]), jnp.int32(0))
  compiled = {'C++ assign': compile_step(step, (0, 1, 2), *example)}
  # The jit caches hold the kernel's trace of `assign`: trace afresh.
  jax.clear_caches()
  with patched('lazy_optax._src.id_kernels', 'usable', lambda *a: False):
    compiled['XLA assign'] = compile_step(step, (0, 1, 2), *example)
  del example
  for name, c in compiled.items():
    print(f'  {name}: calls {sorted(targets(c))}')
  assert 'LazyOptaxIdAssign' in targets(compiled['C++ assign'])
  assert 'LazyOptaxIdAssign' not in targets(compiled['XLA assign'])
  runs, boxes = {}, {}
  for name, c in compiled.items():
    box = boxes[name] = start() + [args.fill]

    def run(c=c, box=box):
      k = box[3]
      out = c(box[0], box[1], box[2], jnp.asarray(words[k]), jnp.int32(k))
      jax.block_until_ready(out)
      box[0], box[1], box[2] = out[:3]
      box[3] = k + 1
    runs[name] = run
  times = interleave(runs, args.rounds, args.steps)
  a, b = (boxes[n][2] for n in compiled)
  same = all(bool(jnp.array_equal(x, y)) for x, y in zip(
      jax.tree.leaves(a), jax.tree.leaves(b)))
  print(f'  id states equal after {args.rounds * args.steps} steps: {same}')
  return report(f'assign: the hashed step ({args.threads} thread(s))',
                times, 'C++ assign', 'XLA assign')


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--threads', type=int, default=1)
  parser.add_argument('--rounds', type=int, default=9)
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--fill', type=int, default=1000,
                      help='assign steps before the hashed step is timed')
  parser.add_argument('--only', choices=PAIRS, action='append')
  args = parser.parse_args(argv)
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_multi_thread_eigen='
      + ('true' if args.threads > 1 else 'false')
      + f' intra_op_parallelism_threads={args.threads}').strip()

  import lazy_optax  # pylint: disable=g-import-not-at-top

  status = lazy_optax.kernel_status()
  print(f'kernels: {status}')
  print(f'{args.threads} thread(s); {args.rounds} rounds of {args.steps} '
        f'steps; load average before: {os.getloadavg()}')
  out = {}
  for pair in args.only or PAIRS:
    out[pair] = assign_pair(args)
  print(f'load average after: {os.getloadavg()}')
  return out


if __name__ == '__main__':
  main()
