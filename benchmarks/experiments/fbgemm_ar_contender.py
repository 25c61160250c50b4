"""FBGEMM's CPU ROWWISE_RMSPROP_AR and EXACT_ROWWISE_ADAGRAD table steps.

Started by `rmsprop_ar_speed.py` with the Python of FBGEMM's venv (torch and
`fbgemm-gpu-cpu` 1.9.0, no JAX):

    $LAZY_OPTAX_FBGEMM_PYTHON \\
        -m benchmarks.experiments.fbgemm_ar_contender \\
        '{"shape": "single", "steps": 60, "threads": 1}'

For each optimizer a host TBE (`SplitTableBatchedEmbeddingBagsCodegen`,
float32, `BoundsCheckMode.NONE`) holds the tables of `shape`: `single` is
`common.TARGET` (1,000,000 x 64, 4,096 Zipf ids, one row per id,
`PoolingMode.NONE`), `dlrm` the 26 DLRM tables of `common.DLRM_DEFAULTS`
(one Zipf id per table and example, `PoolingMode.SUM`): the faster mode of
each shape here. One step is the lookup and the backward of a fixed random
gradient, in which FBGEMM updates the tables. The two optimizers' steps run
interleaved on the same ids; the script prints one JSON object with the
median CPU time (`time.process_time`) and wall time per step of each.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import init_tables
from benchmarks.common import make_batches
from benchmarks.common import make_dlrm_batches
from benchmarks.common import TARGET

OPTIMIZERS = ('ROWWISE_RMSPROP_AR', 'EXACT_ROWWISE_ADAGRAD')


def _tbe(tables: list[np.ndarray], optimizer: str, pooled: bool):
  # pylint: disable=g-import-not-at-top
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as ops
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
  import torch

  extra = (dict(ar_alpha=0.01, ema_beta=0.99, min_shrinkage=0.1)
           if optimizer == 'ROWWISE_RMSPROP_AR' else dict(weight_decay=0.0))
  tbe = train.SplitTableBatchedEmbeddingBagsCodegen(
      [(t.shape[0], t.shape[1], ops.EmbeddingLocation.HOST,
        ops.ComputeDevice.CPU) for t in tables],
      optimizer=getattr(configs.EmbOptimType, optimizer),
      learning_rate=1e-3, eps=1e-8,
      pooling_mode=ops.PoolingMode.SUM if pooled else ops.PoolingMode.NONE,
      bounds_check_mode=ops.BoundsCheckMode.NONE, device='cpu', **extra)
  with torch.no_grad():
    for view, t in zip(tbe.split_embedding_weights(), tables):
      view.copy_(torch.from_numpy(t))
  return tbe


def _inputs(ids: np.ndarray):
  import torch  # pylint: disable=g-import-not-at-top
  flat = np.ascontiguousarray(ids.reshape(ids.shape[0], -1).T).reshape(-1)
  return (torch.from_numpy(flat.astype(np.int64)),
          torch.arange(flat.size + 1, dtype=torch.int64))


def _workload(shape: str):
  """(tables, id batches, pooled)."""
  rng = np.random.default_rng(1)
  if shape == 'single':
    cfg = dict(TARGET, pool=8)
    table = rng.random((cfg['rows'], cfg['row']), dtype=np.float32) * 0.02
    return [table - np.float32(0.01)], make_batches(cfg), False
  cfg = dict(DLRM_DEFAULTS, pool=8)
  return (init_tables(cfg, rng), [b['ids'] for b in make_dlrm_batches(cfg)],
          True)


def run(cfg: dict) -> dict:
  import fbgemm_gpu  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(cfg.get('threads', 1))
  tables, batches, pooled = _workload(cfg['shape'])
  inputs = [_inputs(b) for b in batches]
  tbes = {name: _tbe(tables, name, pooled) for name in OPTIMIZERS}
  del tables
  grads = []
  rng = np.random.default_rng(2)
  for b in inputs:
    out_shape = tbes[OPTIMIZERS[0]](*b).shape
    grads.append(torch.from_numpy(
        rng.normal(size=tuple(out_shape)).astype(np.float32) * 0.1))
  cpu = {k: [] for k in OPTIMIZERS}
  wall = {k: [] for k in OPTIMIZERS}
  warmup = 5
  for k in range(cfg['steps'] + warmup):
    order = OPTIMIZERS if k % 2 else OPTIMIZERS[::-1]
    for name in order:
      c0, w0 = time.process_time(), time.perf_counter()
      tbes[name](*inputs[k % len(inputs)]).backward(grads[k % len(inputs)])
      if k >= warmup:
        cpu[name].append(time.process_time() - c0)
        wall[name].append(time.perf_counter() - w0)
  return {'shape': cfg['shape'], 'fbgemm_version': fbgemm_gpu.__version__,
          'torch_threads': torch.get_num_threads(),
          **{f'{k}_cpu_ms': 1e3 * float(np.median(v)) for k, v in cpu.items()},
          **{f'{k}_wall_ms': 1e3 * float(np.median(v))
             for k, v in wall.items()}}


if __name__ == '__main__':
  print(json.dumps(run(json.loads(sys.argv[1]))))
