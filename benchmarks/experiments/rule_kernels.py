"""This revision's rule kernels against a baseline revision's, in one process.

    python3 -m benchmarks.experiments.rule_kernels              # vs HEAD
    python3 -m benchmarks.experiments.rule_kernels --baseline fbb2c7d

The baseline's `rows.cc` (`git show REV:lazy_optax/_src/cpu_kernels/rows.cc`)
is built with the flags of `build.py` and its rule targets are registered as
`baseline_<target>`. For the target configuration (`common.TARGET`:
1,000,000 x 64 float32 table, 4,096 Zipf ids) the documented train step of
`lazy_adam` and of `rowwise_adagrad` (`harness/contenders.py`'s `jax_setup`)
is compiled twice: as this revision traces it, and with the rule kernel's
call swapped for the baseline's (each revision's own calling convention; the
rest of the step is the same code). The two are run interleaved, step by
step, from the same table; the script prints the median CPU time per step
(`time.process_time`, all threads) and wall time of each, their ratio, and
whether the two runs' tables and states are bit for bit equal; and the
Adam and row-wise Adagrad kernel calls alone, interleaved (`--calls`). Before
that,
every rule kernel of both revisions is called on the same random operands,
for each combination of float32 and bfloat16 state tables, and the tables
and update rows compared bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import TARGET
from benchmarks.harness import contenders

# The baseline's calling convention, per target: the operands read before
# the tables ('params' or nothing); its results are the tables, then the
# update rows.
_BASELINE_READS = {'LazyOptaxAdam': 0, 'LazyOptaxAmsgrad': 0,
                   'LazyOptaxRowwiseAdagrad': 1,
                   'LazyOptaxPartialRowwiseAdam': 0, 'LazyOptaxFtrl': 1}
# Whether the baseline binds the hyperparameter record as uint32 words (the
# revisions with int32 fields) rather than float32 values.
_BASELINE_WORDS = {'hyper': False}


def build_baseline(rev: str, folder: str) -> str:
  import jax  # pylint: disable=g-import-not-at-top

  from lazy_optax._src.cpu_kernels import build  # pylint: disable=g-import-not-at-top
  root = subprocess.run(['git', 'rev-parse', '--show-toplevel'],
                        capture_output=True, text=True, check=True).stdout
  source = subprocess.run(
      ['git', 'show', f'{rev}:lazy_optax/_src/cpu_kernels/rows.cc'],
      capture_output=True, text=True, check=True, cwd=root.strip()).stdout
  _BASELINE_WORDS['hyper'] = 'ffi::Buffer<ffi::U32> hyper' in source
  src = os.path.join(folder, 'rows.cc')
  with open(src, 'w', encoding='utf-8') as f:
    f.write(source)
  lib = os.path.join(folder, 'baseline.so')
  subprocess.run([build.compiler(), *build.FLAGS, *build.NATIVE_FLAGS,
                  '-I', jax.ffi.include_dir(), src, '-o', lib], check=True)
  return lib


def register_baseline(lib_path: str) -> None:
  import ctypes  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  lib = ctypes.cdll.LoadLibrary(lib_path)
  for name in _BASELINE_READS:
    jax.ffi.register_ffi_target(f'baseline_{name}',
                                jax.ffi.pycapsule(getattr(lib, name)),
                                platform='cpu')


def baseline_rule(target, ids, grads, hyper, params, tables):
  """`cpu_kernels.rule`, calling the baseline's kernel its own way."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  reads = (params.astype(jnp.float32),) if _BASELINE_READS[target] else ()
  first = 3 + len(reads)
  call = jax.ffi.ffi_call(
      f'baseline_{target}',
      tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tables)
      + (jax.ShapeDtypeStruct(grads.shape, jnp.float32),),
      input_output_aliases={first + k: k for k in range(len(tables))},
      vmap_method='sequential')
  hyper = hyper.astype(jnp.float32)
  if _BASELINE_WORDS['hyper']:
    hyper = jax.lax.bitcast_convert_type(hyper, jnp.uint32)
  out = call(ids.astype(jnp.int32), grads.astype(jnp.float32), hyper, *reads,
             *tables)
  return tuple(out[:-1]), out[-1]


# Per target: the state tables' widths (True: one value per row) and the
# hyperparameters (valid values, in the record's order).
_RULES = {
    'LazyOptaxAdam': ((False, False), (0.9, 0.1, 0.999, 0.001, 1e-8, 0.0,
                                       0.3)),
    'LazyOptaxAmsgrad': ((False, False, False),
                         (0.9, 0.1, 0.999, 0.001, 1e-8, 1e-9, 0.3)),
    'LazyOptaxRowwiseAdagrad': ((True,), (1e-8, 0.1)),
    'LazyOptaxPartialRowwiseAdam': ((False, True), (0.9, 0.1, 0.999, 0.001,
                                                    1e-8, 0.0, 0.27, 0.003)),
    'LazyOptaxFtrl': ((False, False), (0.1, 0.5, 0.01, 0.1, 0.05, 0.3)),
}


def _call_rule(call, target, ids, g, h, p, tables):
  return call(target, ids, g, h, p, tables)


def check_bits() -> list[str]:
  """Every rule kernel, both revisions, every storage combination: the
  targets whose results differ in any bit (or in NaN-ness)."""
  import itertools  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from lazy_optax._src import cpu_kernels  # pylint: disable=g-import-not-at-top
  assert cpu_kernels.ensure_loaded().loaded
  rng = np.random.default_rng(0)
  rows, n, w = 300, 64, 24
  ids = jnp.asarray(np.concatenate([rng.choice(rows, n - 2, replace=False),
                                    [-1, rows]]), jnp.int32)
  g = jnp.asarray(rng.normal(size=(n, w)), jnp.float32)
  p = jnp.asarray(rng.normal(size=(n, w)), jnp.float32)
  differ = []
  for target, (per_row, hyper) in _RULES.items():
    h = jnp.asarray(hyper, jnp.float32)
    for dtypes in itertools.product((jnp.float32, jnp.bfloat16),
                                    repeat=len(per_row)):
      if target == 'LazyOptaxAmsgrad' and dtypes[1] != dtypes[2]:
        continue  # nu_max has nu's dtype (the baseline refuses others)
      out = []
      for call in (baseline_rule, cpu_kernels.rule):
        t_rng = np.random.default_rng(1)
        tables = tuple(
            jnp.asarray(np.abs(t_rng.normal(size=(rows,) if r else (rows, w))),
                        d) for r, d in zip(per_row, dtypes))
        run = jax.jit(functools.partial(_call_rule, call, target))
        new, u = run(ids, g, h, p, tables)
        out.append([np.asarray(x) for x in (*new, u)])
      for a, b in zip(*out):
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        if not (np.array_equal(a.reshape(-1).view(np.uint8),
                               b.reshape(-1).view(np.uint8))
                or np.array_equal(np.isnan(a32), np.isnan(b32))
                and np.array_equal(a32[~np.isnan(a32)], b32[~np.isnan(b32)])):
          differ.append(f'{target}{[jnp.dtype(d).name for d in dtypes]}')
          break
  return differ


def compare(contender: str, steps: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import cpu_kernels  # pylint: disable=g-import-not-at-top

  cfg = dict(TARGET, contender=contender, pool=8)
  setup = contenders.jax_setup(cfg)
  start = setup.fresh_params()
  assert lazy_optax.kernel_status()['cpu_kernel'].available

  def compiled(swap: bool):
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), start)
    state = setup.tx.init(params)
    own = cpu_kernels.rule
    if swap:
      cpu_kernels.rule = baseline_rule
    try:
      # A new function per compile: jax.jit caches traces by function.
      step = jax.jit(lambda *a: setup.train_step(*a),
                     donate_argnums=setup.donate).lower(
          params, state, setup.batches[0]).compile()
    finally:
      cpu_kernels.rule = own
    hlo = step.as_text()
    assert ('baseline_LazyOptax' in hlo) == swap
    return step, [params, state]

  runs = {'baseline': compiled(True), 'this': compiled(False)}
  cpu: dict = {k: [] for k in runs}
  wall: dict = {k: [] for k in runs}
  for k in range(steps):
    for name in (('baseline', 'this') if k % 2 else ('this', 'baseline')):
      step, box = runs[name]
      c0, w0 = time.process_time(), time.perf_counter()
      box[0], box[1], loss = step(box[0], box[1],
                                  setup.batches[k % len(setup.batches)])
      loss.block_until_ready()
      cpu[name].append(time.process_time() - c0)
      wall[name].append(time.perf_counter() - w0)
  a = jax.tree.leaves(runs['baseline'][1])
  b = jax.tree.leaves(runs['this'][1])
  equal = all(np.array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                             np.asarray(y).reshape(-1).view(np.uint8))
              for x, y in zip(a, b))
  med = {k: (1e3 * float(np.median(cpu[k])), 1e3 * float(np.median(wall[k])))
         for k in runs}
  return {'contender': contender, 'steps': steps, 'bit_equal': equal,
          'baseline_cpu_ms': med['baseline'][0], 'this_cpu_ms': med['this'][0],
          'baseline_wall_ms': med['baseline'][1],
          'this_wall_ms': med['this'][1],
          'cpu_ratio': med['this'][0] / med['baseline'][0],
          'wall_ratio': med['this'][1] / med['baseline'][1]}


def kernel_calls(calls: int) -> list[str]:
  """The Adam and row-wise Adagrad kernel calls alone, interleaved: 1,000,000
  x 64 float32 tables, 4,096 distinct ids, donated (median CPU time)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from lazy_optax._src import cpu_kernels  # pylint: disable=g-import-not-at-top
  assert cpu_kernels.ensure_loaded().loaded
  rng = np.random.default_rng(0)
  rows, width, n = TARGET['rows'], TARGET['row'], TARGET['ids']
  ids = jnp.asarray(np.sort(rng.choice(rows, n, replace=False)), jnp.int32)
  g = jnp.asarray(rng.normal(size=(n, width)), jnp.float32)
  lines = []
  for target in ('LazyOptaxAdam', 'LazyOptaxRowwiseAdagrad'):
    per_row, hyper = _RULES[target]
    h = jnp.asarray(hyper, jnp.float32)
    runs = {}
    for name, call in (('baseline', baseline_rule),
                       ('this', cpu_kernels.rule)):
      step = jax.jit(functools.partial(_call_rule, call, target),
                     donate_argnums=(4,))
      tables = tuple(jnp.zeros((rows,) if r else (rows, width), jnp.float32)
                     for r in per_row)
      runs[name] = [step, tables]
    cpu: dict = {k: [] for k in runs}
    for k in range(calls):
      for name in (('baseline', 'this') if k % 2 else ('this', 'baseline')):
        step, tables = runs[name]
        c0 = time.process_time()
        new, u = step(ids, g, h, g, tables)
        u.block_until_ready()
        cpu[name].append(time.process_time() - c0)
        runs[name][1] = new
    b, t = (1e3 * float(np.median(cpu[k][calls // 10:])) for k in runs)
    lines.append(f'{target} kernel call: CPU {b:.4f} -> {t:.4f} ms '
                 f'({t / b:.3f}x)')
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--baseline', default='HEAD')
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--contenders', default='lazy_sparse,rowwise_adagrad')
  parser.add_argument('--calls', type=int, default=600,
                      help='kernel calls alone, per revision (0: none)')
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    register_baseline(build_baseline(args.baseline, folder))
    differ = check_bits()
    print('every rule kernel, float32 and bfloat16 tables: '
          + (f'DIFFER {differ}' if differ else 'bit for bit equal'))
    if args.calls:
      print('\n'.join(kernel_calls(args.calls)))
    for contender in args.contenders.split(','):
      r = compare(contender, args.steps)
      print(f"{r['contender']:16s} CPU {r['baseline_cpu_ms']:.3f} -> "
            f"{r['this_cpu_ms']:.3f} ms ({r['cpu_ratio']:.3f}x), wall "
            f"{r['baseline_wall_ms']:.3f} -> {r['this_wall_ms']:.3f} ms "
            f"({r['wall_ratio']:.3f}x), bit for bit equal: {r['bit_equal']}")
      sys.stdout.flush()


if __name__ == '__main__':
  main()
