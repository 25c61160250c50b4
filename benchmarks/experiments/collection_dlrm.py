"""The DLRM-shaped step through an EmbeddingCollection, against the others.

    python3 -m benchmarks.experiments.collection_dlrm [--cap ROWS]
        [--rounds N] [--threads 1,2]

The model, batches and tables of benchmarks/harness/dlrm.py (26 tables of
16 floats, Criteo Kaggle cardinalities capped at `--cap` rows, 2,048
examples a batch, one id per table and example, an MLP), four steps, each
jitted and donated:

  collection  `lazy_optax.EmbeddingCollection` of the 26 tables (one
              stack), `collection.lookup` of 26 features, the collection's
              optimizer (`lazy_adam`) in an `optax.partition` with
              `lazy_adam` on the MLP
  concat      the tables concatenated by hand, ids offset by hand, one
              `lookup` (harness contender dlrm_lazy_concat)
  separate    26 tables, 26 `lookup`s (dlrm_lazy)
  dense       `optax.adam` with dense gradients (dlrm_optax_dense)

For each thread count a worker process, pinned with `taskset` to that many
cores, builds all four (timing the trace and compilation of each), then
runs them in turn, blocks of steps per round, so that each sees the same
machine; it reports the median step time of each. The driver prints the
times and the ratios (collection / concat, collection / separate, dense /
collection, and the compile times against dense `optax.adam`'s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import cardinalities
from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import init_mlp
from benchmarks.common import init_tables
from benchmarks.common import LR
from benchmarks.common import make_dlrm_batches

NAMES = ('collection', 'concat', 'separate', 'dense')
_HARNESS = {'concat': 'dlrm_lazy_concat', 'separate': 'dlrm_lazy',
            'dense': 'dlrm_optax_dense'}


def collection_setup(cfg: dict):
  """The collection's step, params, state and batches (as `jax_setup`)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import optax

  import lazy_optax

  cards = cardinalities(cfg)
  rng = np.random.default_rng(1)
  tables = init_tables(cfg, rng)        # the harness's tables, the same rng
  mlp = [{'w': jnp.asarray(w), 'b': jnp.asarray(b)}
         for w, b in init_mlp(cfg, rng)]
  coll = lazy_optax.EmbeddingCollection(
      [lazy_optax.TableSpec(f'c{t}', c, cfg['row'])
       for t, c in enumerate(cards)])
  names = [t.name for t in coll.table_specs]
  params = {'emb': coll.params_from_tables(dict(zip(names, tables))),
            'mlp': mlp}
  del tables
  tx = optax.partition(
      {'emb': coll.optimizer({'default': lazy_optax.lazy_adam(LR)}),
       'mlp': lazy_optax.lazy_adam(LR)},
      lazy_optax.tree.path_labels(lambda name: name.split('/')[0]))
  batches = [{k: jnp.asarray(v) for k, v in b.items()}
             for b in make_dlrm_batches(cfg)]

  def loss_fn(p, ids, dense, labels):
    rows = coll.lookup(p['emb'], {n: ids[:, i] for i, n in enumerate(names)})
    x = jnp.concatenate(list(rows.values()) + [dense], axis=1)
    for layer in p['mlp'][:-1]:
      x = jax.nn.relu(x @ layer['w'] + layer['b'])
    logits = (x @ p['mlp'][-1]['w'] + p['mlp'][-1]['b'])[:, 0]
    return jnp.mean(jax.nn.softplus(logits) - labels * logits)

  def train_step(p, state, batch):
    loss, grads = lazy_optax.value_and_grad(loss_fn)(
        p, batch['ids'], batch['dense'], batch['labels'])
    updates, state = tx.update(grads, state, p)
    return lazy_optax.apply_updates(p, updates), state, loss

  state = tx.init(params)
  return jax.jit(train_step, donate_argnums=(0, 1)), params, state, batches


def _setup(name: str, cfg: dict):
  if name == 'collection':
    return collection_setup(cfg)
  from benchmarks.harness.dlrm import jax_setup  # pylint: disable=g-import-not-at-top
  return jax_setup(dict(cfg, contender=_HARNESS[name]))


def worker(cfg: dict, rounds: int) -> dict:
  """Builds the four steps, then times them interleaved: medians in ms."""
  import jax  # pylint: disable=g-import-not-at-top

  runs, result = {}, {'compile_s': {}, 'loss': {}}
  for name in NAMES:
    step, params, state, batches = _setup(name, cfg)
    t0 = time.perf_counter()
    compiled = step.lower(params, state, batches[0]).compile()
    result['compile_s'][name] = time.perf_counter() - t0
    runs[name] = [compiled, params, state, batches, 0]
    del params, state
  samples: dict[str, list[float]] = {n: [] for n in NAMES}
  cpu: dict[str, list[float]] = {n: [] for n in NAMES}
  for r in range(rounds + 1):          # round 0 warms up
    for name in NAMES:
      run = runs[name]
      for _ in range(2 if name == 'dense' else 8):
        compiled, params, state, batches, k = run
        t0, c0 = time.perf_counter(), time.process_time()
        params, state, loss = compiled(params, state, batches[k % len(batches)])
        loss.block_until_ready()
        if r:
          samples[name].append(time.perf_counter() - t0)
          cpu[name].append(time.process_time() - c0)
        run[1:] = [params, state, batches, k + 1]
        result['loss'][name] = float(jax.device_get(loss))
  result['median_ms'] = {n: 1e3 * float(np.median(s))
                         for n, s in samples.items()}
  result['cpu_ms'] = {n: 1e3 * float(np.median(s)) for n, s in cpu.items()}
  return result


def _pinned(threads: int) -> list[str]:
  if shutil.which('taskset') is None:
    return []
  cpus = sorted(os.sched_getaffinity(0))[:threads]
  return ['taskset', '-c', ','.join(map(str, cpus))]


def _report(threads: int, res: dict) -> None:
  t, c, u = res['median_ms'], res['compile_s'], res['cpu_ms']
  print(f'\n{threads} thread(s): median step wall ms, CPU ms; compile s')
  for name in NAMES:
    print(f'  {name:11} {t[name]:9.2f} ms {u[name]:9.2f} ms  {c[name]:6.2f} s'
          f'   loss {res["loss"][name]:.5f}')
  print(f'  collection / concat    CPU {u["collection"] / u["concat"]:.3f}x')
  print(f'  collection / concat    step {t["collection"] / t["concat"]:.3f}x'
        f'   compile {c["collection"] / c["concat"]:.2f}x')
  print(f'  collection / separate  step {t["collection"] / t["separate"]:.3f}x'
        f'   compile {c["collection"] / c["separate"]:.2f}x')
  print(f'  collection / dense     step {t["collection"] / t["dense"]:.3f}x'
        f'   compile {c["collection"] / c["dense"]:.2f}x'
        f'   (concat compile / dense {c["concat"] / c["dense"]:.2f}x)')


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--cap', type=int, default=DLRM_DEFAULTS['cap'])
  parser.add_argument('--rounds', type=int, default=6)
  parser.add_argument('--threads', default='1,2')
  parser.add_argument('--worker', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  cfg = dict(DLRM_DEFAULTS, cap=args.cap, pool=8)
  if args.worker:
    print(json.dumps(worker(cfg, args.rounds)))
    return
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  for threads in map(int, args.threads.split(',')):
    env['OMP_NUM_THREADS'] = str(threads)
    cmd = _pinned(threads) + [
        sys.executable, '-m', 'benchmarks.experiments.collection_dlrm',
        '--cap', str(args.cap), '--rounds', str(args.rounds), '--worker',
        str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                         check=False)
    if out.returncode:
      print(f'{threads} thread(s): worker failed\n{out.stderr[-2000:]}')
      continue
    _report(threads, json.loads(out.stdout.strip().splitlines()[-1]))


if __name__ == '__main__':
  main()
