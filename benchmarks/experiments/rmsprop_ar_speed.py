"""`rowwise_rmsprop_ar`'s table step against `rowwise_adagrad`'s and FBGEMM's.

    python3 -m benchmarks.experiments.rmsprop_ar_speed
    python3 -m benchmarks.experiments.rmsprop_ar_speed --shapes single \\
        --fbgemm-python "$LAZY_OPTAX_FBGEMM_PYTHON"

Two shapes: `single` is `common.TARGET` (1,000,000 x 64 float32, 4,096 Zipf
ids a step), `dlrm` the 26 DLRM tables of `common.DLRM_DEFAULTS` (Criteo
cardinalities capped at 1,000,000 rows of 16, one Zipf id per table for each
of 2,048 examples). One step is what FBGEMM's fused table step does: look
the ids' rows up, and update the tables with a given gradient row per id
(duplicates summed): `lazy_optax.value_and_grad` of
`sum(lookup(table, ids) * grads)` (its row gradient is `grads`), `tx.update`
and `apply_updates`, jitted with the tables and state donated.
`rowwise_rmsprop_ar(ar_alpha=0.01)` and `rowwise_adagrad` (both on the CPU
kernel) run interleaved step by step in one process; the script prints the
median CPU time per step (`time.process_time`, all threads) and wall time of
each and their ratio. With `--fbgemm-python`, `fbgemm_ar_contender.py` runs
FBGEMM's ROWWISE_RMSPROP_AR and EXACT_ROWWISE_ADAGRAD on the same ids in
that interpreter (1 torch thread) and the ratios to it are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks import peers
from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import init_tables
from benchmarks.common import make_batches
from benchmarks.common import make_dlrm_batches
from benchmarks.common import TARGET


def _workload(shape: str):
  """(list of float32 tables, list of [batch, tables] int32 id batches)."""
  rng = np.random.default_rng(1)
  if shape == 'single':
    cfg = dict(TARGET, pool=8)
    table = rng.random((cfg['rows'], cfg['row']), dtype=np.float32) * 0.02
    return ([table - np.float32(0.01)],
            [b[:, None] for b in make_batches(cfg)])
  cfg = dict(DLRM_DEFAULTS, pool=8)
  return init_tables(cfg, rng), [b['ids'] for b in make_dlrm_batches(cfg)]


def _step(tx):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  def loss(params, ids, grads):  # d loss / d rows = grads
    return sum(jnp.sum(lazy_optax.lookup(params[k], ids[:, i]) * grads[i])
               for i, k in enumerate(sorted(params)))

  def step(params, state, ids, grads):
    looked, g = lazy_optax.value_and_grad(loss)(params, ids, grads)
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state, looked

  return jax.jit(step, donate_argnums=(0, 1))


def compare(shape: str, steps: int) -> dict:
  """Median CPU and wall ms per step of AR and row-wise Adagrad."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  tables, batches = _workload(shape)
  names = [f't{i:02d}' for i in range(len(tables))]
  num_rows = {k: t.shape[0] for k, t in zip(names, tables)}
  rng = np.random.default_rng(2)
  grads = [[jnp.asarray(rng.normal(size=(b.shape[0], t.shape[1])) * 0.1,
                        jnp.float32) for t in tables] for b in batches]
  ids = [jnp.asarray(b) for b in batches]
  txs = {'rowwise_rmsprop_ar': lazy_optax.rowwise_rmsprop_ar(
             1e-3, ar_alpha=0.01),
         'rowwise_adagrad': lazy_optax.rowwise_adagrad(1e-3)}
  runs = {}
  for name, tx in txs.items():
    params = {k: jnp.array(t) for k, t in zip(names, tables)}
    state = tx.init(params)
    choice = lazy_optax.explain_update(
        tx, {k: lazy_optax.SparseRows(ids[0][:, i], grads[0][i], num_rows[k])
             for i, k in enumerate(names)}, state, params)
    assert all(c.impl == 'cpu_kernel' for c in choice.values()), choice
    runs[name] = [_step(tx), params, state]
  del tables
  cpu: dict = {k: [] for k in runs}
  wall: dict = {k: [] for k in runs}
  warmup = 5
  for k in range(steps + warmup):
    order = list(runs) if k % 2 else list(runs)[::-1]
    for name in order:
      box = runs[name]
      j = k % len(ids)
      c0, w0 = time.process_time(), time.perf_counter()
      box[1], box[2], looked = box[0](box[1], box[2], ids[j], grads[j])
      looked.block_until_ready()
      if k >= warmup:
        cpu[name].append(time.process_time() - c0)
        wall[name].append(time.perf_counter() - w0)
  out = {'shape': shape, 'steps': steps}
  for name in runs:
    out[f'{name}_cpu_ms'] = 1e3 * float(np.median(cpu[name]))
    out[f'{name}_wall_ms'] = 1e3 * float(np.median(wall[name]))
  return out


def fbgemm(python: str, shape: str, steps: int) -> dict:
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  proc = subprocess.run(
      [python, '-m', 'benchmarks.experiments.fbgemm_ar_contender',
       json.dumps({'shape': shape, 'steps': steps, 'threads': 1})],
      capture_output=True, text=True, cwd=root, check=False,
      env=dict(os.environ, PYTHONPATH=root))
  if proc.returncode:
    raise RuntimeError(proc.stderr[-2000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--shapes', default='single,dlrm')
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--fbgemm-python', default=peers.python_for('fbgemm'),
                      help='FBGEMM\'s interpreter (default '
                      '$LAZY_OPTAX_FBGEMM_PYTHON)')
  args = parser.parse_args()
  for shape in args.shapes.split(','):
    r = compare(shape, args.steps)
    ar, ada = r['rowwise_rmsprop_ar_cpu_ms'], r['rowwise_adagrad_cpu_ms']
    print(f'{shape}: lazy_optax rowwise_rmsprop_ar CPU {ar:.3f} ms, '
          f'rowwise_adagrad {ada:.3f} ms: {ar / ada:.3f}x (wall '
          f"{r['rowwise_rmsprop_ar_wall_ms']:.3f} vs "
          f"{r['rowwise_adagrad_wall_ms']:.3f} ms)")
    if args.fbgemm_python:
      f = fbgemm(args.fbgemm_python, shape, args.steps)
      f_ar = f['ROWWISE_RMSPROP_AR_cpu_ms']
      f_ada = f['EXACT_ROWWISE_ADAGRAD_cpu_ms']
      print(f'{shape}: FBGEMM {f["fbgemm_version"]} ROWWISE_RMSPROP_AR CPU '
            f'{f_ar:.3f} ms, EXACT_ROWWISE_ADAGRAD {f_ada:.3f} ms; '
            f'lazy_optax / FBGEMM: AR {ar / f_ar:.3f}x, Adagrad '
            f'{ada / f_ada:.3f}x')
    sys.stdout.flush()


if __name__ == '__main__':
  main()
