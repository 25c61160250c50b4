"""The counter rule's step against `rowwise_adagrad`'s, and FBGEMM's.

    python3 -m benchmarks.experiments.counter_step [--fbgemm PYTHON]

The optimizer step alone (`tx.update` + `apply_updates` on a `SparseRows`
gradient, jitted and donated) of both rules, run interleaved step by step in
one process, on the target table (1,000,000 x 64 float32, 4,096 Zipf ids)
and on the DLRM shape's 26 tables (Criteo Kaggle's cardinalities capped at
1,000,000, 16 floats a row, 2,048 Zipf ids per table). The counter rule runs
AdagradW (half-life -1, weight decay), which reads the weights. Reported:
median CPU time per step (`time.process_time`, all threads) and the ratio.

With `--fbgemm` (an interpreter with `fbgemm-gpu-cpu`), FBGEMM's CPU
`EXACT_ROWWISE_ADAGRAD` with `WeightDecayMode.COUNTER` (the same AdagradW
configuration) and without it are timed the same way in a subprocess on the
target table: forward and backward of a `PoolingMode.NONE` lookup, the
update inside the backward, so FBGEMM's number includes its lookup.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import numpy as np

from benchmarks import common
from benchmarks import peers

REPEATS = 30


def _jax_steps(shapes: list[tuple[int, int]], batch: int) -> dict:
  """Median CPU ms of both rules' steps on tables of `shapes`, interleaved."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  ids = [[jnp.asarray(b) for b in common.make_batches(
      {'rows': v, 'ids': batch, 'dist': 'zipf', 'pool': 4, 'seed': t})]
         for t, (v, _) in enumerate(shapes)]
  grads = [jnp.asarray(rng.normal(size=(batch, d)).astype(np.float32))
           for _, d in shapes]
  rules = {
      'rowwise_adagrad': lazy_optax.rowwise_adagrad(0.01),
      'with_counter': lazy_optax.rowwise_adagrad_with_counter(
          0.01, weight_decay=1e-4, counter_weight_decay_mode='adagradw'),
  }
  runs = {}
  for name, tx in rules.items():
    params = [jnp.asarray(rng.random((v, d), dtype=np.float32) * 0.02 - 0.01)
              for v, d in shapes]

    def step(params, state, ids, tx=tx):
      g = [lazy_optax.SparseRows(i, x, p.shape[0])
           for i, x, p in zip(ids, grads, params)]
      updates, state = tx.update(g, state, params)
      return lazy_optax.apply_updates(params, updates), state

    runs[name] = [jax.jit(step, donate_argnums=(0, 1)), params,
                  tx.init(params), []]
  for k in range(REPEATS + 3):
    for run in runs.values():
      step_ids = [b[k % 4] for b in ids]
      start = time.process_time()
      run[1], run[2] = run[0](run[1], run[2], step_ids)
      jax.block_until_ready(run[1])
      if k >= 3:
        run[3].append(time.process_time() - start)
  return {name: 1e3 * float(np.median(run[3])) for name, run in runs.items()}


_FBGEMM = r'''
import sys, time, numpy as np, torch
from fbgemm_gpu import split_embedding_configs as configs
from fbgemm_gpu import split_table_batched_embeddings_ops_common as ops
from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
from fbgemm_gpu.tbe.config import optimizer_config as oc
v, d, n, repeats = (int(x) for x in sys.argv[1:5])
ids = [torch.from_numpy(np.load(sys.argv[5])[k].astype(np.int64))
       for k in range(4)]
def make(counter):
  extra = dict(weight_decay_mode=oc.WeightDecayMode.COUNTER,
               counter_based_regularization=oc.CounterBasedRegularizationDefinition(
                   counter_weight_decay_mode=oc.CounterWeightDecayMode.ADAGRADW),
               weight_decay=1e-4) if counter else {}
  return train.SplitTableBatchedEmbeddingBagsCodegen(
      [(v, d, ops.EmbeddingLocation.HOST, ops.ComputeDevice.CPU)],
      optimizer=configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01,
      eps=1e-8, pooling_mode=ops.PoolingMode.NONE, device='cpu', **extra)
tbes = {'fbgemm': make(False), 'fbgemm_counter': make(True)}
offsets = torch.arange(n + 1, dtype=torch.int64)
rng = np.random.default_rng(0)
grad = torch.from_numpy(rng.normal(size=(n, d)).astype(np.float32))
times = {k: [] for k in tbes}
for k in range(repeats + 3):
  for name, tbe in tbes.items():
    start = time.process_time()
    tbe(ids[k % 4], offsets).backward(grad)
    if k >= 3:
      times[name].append(time.process_time() - start)
for name, t in times.items():
  print(name, 1e3 * float(np.median(t)))
'''


def _fbgemm_steps(python: str, v: int, d: int, n: int, tmp: str) -> dict:
  np.save(tmp, np.stack(common.make_batches(
      {'rows': v, 'ids': n, 'dist': 'zipf', 'pool': 4, 'seed': 0})))
  proc = subprocess.run(
      [python, '-c', _FBGEMM, str(v), str(d), str(n), str(REPEATS), tmp],
      capture_output=True, text=True, check=True,
      env=dict(os.environ, PYTHONPATH=''))
  return {line.split()[0]: float(line.split()[1])
          for line in proc.stdout.splitlines() if line.strip()}


def _show(title: str, ms: dict) -> None:
  base = ms['rowwise_adagrad']
  ratio = ms['with_counter'] / base
  print(f'{title}: ' + ', '.join(f'{k} {v:.2f} ms' for k, v in ms.items())
        + f'; with_counter / rowwise_adagrad = {ratio:.2f}x', flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--fbgemm', default=peers.python_for('fbgemm'),
                      help='an interpreter with fbgemm-gpu-cpu (default '
                      '$LAZY_OPTAX_FBGEMM_PYTHON)')
  parser.add_argument('--skip-26', action='store_true')
  args = parser.parse_args()
  target = common.TARGET
  _show('target 1,000,000 x 64, 4,096 Zipf ids',
        _jax_steps([(target['rows'], target['row'])], target['ids']))
  if not args.skip_26:
    cfg = common.DLRM_DEFAULTS
    _show('26 tables (Criteo Kaggle, capped 1,000,000) x 16, 2,048 ids each',
          _jax_steps([(c, cfg['row']) for c in common.cardinalities(cfg)],
                     cfg['batch']))
  if args.fbgemm:
    with tempfile.TemporaryDirectory() as tmp:
      ms = _fbgemm_steps(args.fbgemm, target['rows'], target['row'],
                         target['ids'], os.path.join(tmp, 'ids.npy'))
    print('FBGEMM CPU, target table (lookup + backward + update): '
          + ', '.join(f'{k} {v:.2f} ms' for k, v in ms.items())
          + f'; counter / plain = {ms["fbgemm_counter"] / ms["fbgemm"]:.2f}x')


if __name__ == '__main__':
  main()
