"""FBGEMM's CPU table-batched embedding with row-wise Adagrad, in this process.

FBGEMM (`fbgemm-gpu-cpu` 1.9.0, the kernels under TorchRec) needs
`torch==2.14.1`, so this module runs in an interpreter of its own
(`python3 benchmarks/peers.py setup DIR` makes it); `benchmarks/run.py`
starts it from the repository root with `$LAZY_OPTAX_FBGEMM_PYTHON` (or
`--fbgemm-python PATH`), pinned, in a process of its own, its rounds
interleaved with the other processes' rounds (`benchmarks.common.serve`):

    $LAZY_OPTAX_FBGEMM_PYTHON -m benchmarks.harness.fbgemm_contender \\
        '[{"contender": "fbgemm_rowwise_adagrad", "threads": 1, ...}]'

The tables live in one `SplitTableBatchedEmbeddingBagsCodegen` on the host
(`EmbeddingLocation.HOST`, `ComputeDevice.CPU`), float32, with the optimizer
fused into its backward pass: `EmbOptimType.EXACT_ROWWISE_ADAGRAD` (duplicate
ids summed, then `G_r += mean(g_r^2); w_r -= lr * g_r / (sqrt(G_r) + eps)`),
the rule of `lazy_optax.rowwise_adagrad`, with the same learning rate and
`eps`. Each id is a bag of one (`offsets = arange`), so the lookup returns
one row per id, as the other contenders' lookups do.

Contenders (the models and ids of `benchmarks/common.py`):
  fbgemm_rowwise_adagrad       the single table: `loss = mean((table[ids] @ w
                               - 1)^2)`, `w` trained by `torch.optim.Adagrad`
  dlrm_fbgemm_rowwise_adagrad  the 26 DLRM tables in one TBE (one feature
                               per table), the MLP trained by
                               `torch.optim.Adagrad`

The whole train step (lookup, loss, backward with the fused table update,
the dense optimizer's step) is timed; there is no compile step and no
separate optimizer step (FBGEMM updates the tables inside `backward`).
Threads: `taskset` (by `run.py`) and `torch.set_num_threads`.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import ids_digest
from benchmarks.common import init_mlp
from benchmarks.common import init_tables
from benchmarks.common import LR
from benchmarks.common import make_batches
from benchmarks.common import make_dlrm_batches
from benchmarks.common import serve

EPS = 1e-8  # lazy_optax.rowwise_adagrad's default, and FBGEMM's


def make_tbe(tables: list[np.ndarray], learning_rate: float = LR,
             eps: float = EPS, pooled: bool = True):
  """A CPU TBE with EXACT_ROWWISE_ADAGRAD whose tables start as `tables`.

  `pooled`: bags pooled by sum (`PoolingMode.SUM`, output `[bags, sum of
  row sizes]`), else one row per id (`PoolingMode.NONE`, output `[ids,
  row]`, all tables of one row size).
  """
  # pylint: disable=g-import-not-at-top
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as ops
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
  import torch

  tbe = train.SplitTableBatchedEmbeddingBagsCodegen(
      [(t.shape[0], t.shape[1], ops.EmbeddingLocation.HOST,
        ops.ComputeDevice.CPU)
       for t in tables],
      optimizer=configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
      learning_rate=learning_rate, eps=eps, weight_decay=0.0,
      pooling_mode=(ops.PoolingMode.SUM if pooled
                    else ops.PoolingMode.NONE),
      # The ids are valid; lazy_optax's jitted steps do not check them
      # either (out-of-range ids touch no row there).
      bounds_check_mode=ops.BoundsCheckMode.NONE,
      device='cpu')
  with torch.no_grad():
    for view, t in zip(tbe.split_embedding_weights(), tables):
      view.copy_(torch.from_numpy(t))
  return tbe


def tbe_inputs(ids: np.ndarray):
  """(indices, offsets) for a TBE from `[batch]` or `[batch, tables]` ids.

  Each id is a bag of its own; TBE wants the ids feature-major.
  """
  import torch  # pylint: disable=g-import-not-at-top

  flat = np.ascontiguousarray(ids.reshape(ids.shape[0], -1).T).reshape(-1)
  indices = torch.from_numpy(flat.astype(np.int64))
  offsets = torch.arange(flat.size + 1, dtype=torch.int64)
  return indices, offsets


def rowwise_state(tbe) -> list[np.ndarray]:
  """The `[rows]` accumulators `G` of every table, as numpy arrays."""
  return [s[0].detach().numpy().copy() for s in tbe.split_optimizer_states()]


def _single_table(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of the single table in FBGEMM."""
  import torch  # pylint: disable=g-import-not-at-top

  v, d = cfg['rows'], cfg['row']
  np_batches = make_batches(cfg)
  inputs = [tbe_inputs(b) for b in np_batches]
  rng = np.random.default_rng(1)
  table = rng.random((v, d), dtype=np.float32) * np.float32(0.02) - 0.01
  # One row per id, unpooled: 1.5x faster here than bags of one id.
  tbe = make_tbe([table], pooled=False)
  del table
  w = torch.nn.Parameter(torch.ones(d))
  opt = torch.optim.Adagrad([w], lr=LR, eps=EPS)
  info: dict = {'ids_digest': ids_digest(np_batches), 'compile_s': 0.0}

  def run_train(k):
    opt.zero_grad(set_to_none=True)
    rows = tbe(*inputs[k % len(inputs)])
    loss = ((rows @ w - 1.0) ** 2).mean()
    loss.backward()
    opt.step()

  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = time.perf_counter() - t0
  return info, {'train': run_train}


def _dlrm(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of the DLRM-shaped model in FBGEMM."""
  import torch  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(1)
  # Bags of one id per feature, sum-pooled (TorchRec's DLRM layout): the
  # output is `[batch, 26 * row]` already, slightly faster here than
  # unpooled rows rearranged.
  tbe = make_tbe(init_tables(cfg, rng))
  gc.collect()
  layers = []
  for w, b in init_mlp(cfg, rng):
    lin = torch.nn.Linear(w.shape[0], w.shape[1])
    with torch.no_grad():
      lin.weight.copy_(torch.from_numpy(w.T))
      lin.bias.copy_(torch.from_numpy(b))
    layers.append(lin)
  opt = torch.optim.Adagrad([p for lin in layers for p in lin.parameters()],
                            lr=LR, eps=EPS)
  np_batches = make_dlrm_batches(cfg)
  batches = [{'inputs': tbe_inputs(b['ids']),
              'dense': torch.from_numpy(b['dense']),
              'labels': torch.from_numpy(b['labels'])} for b in np_batches]
  info: dict = {'ids_digest': ids_digest([b['ids'] for b in np_batches]),
                'compile_s': 0.0}
  softplus = torch.nn.functional.softplus

  def run_train(k):
    batch = batches[k % len(batches)]
    opt.zero_grad(set_to_none=True)
    rows = tbe(*batch['inputs'])             # [batch, 26 * row]
    x = torch.cat([rows, batch['dense']], 1)
    for lin in layers[:-1]:
      x = torch.relu(lin(x))
    logits = layers[-1](x)[:, 0]
    loss = (softplus(logits) - batch['labels'] * logits).mean()
    loss.backward()
    opt.step()
    return loss

  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = time.perf_counter() - t0
  info['first_loss'] = float(run_train(0))
  return info, {'train': run_train}


def build(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of an FBGEMM contender (`common.serve`'s `build`)."""
  import fbgemm_gpu  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(cfg['threads'])
  if cfg['contender'] == 'dlrm_fbgemm_rowwise_adagrad':
    info, steps = _dlrm(dict(DLRM_DEFAULTS, **cfg))
  elif cfg['contender'] == 'fbgemm_rowwise_adagrad':
    info, steps = _single_table(cfg)
  else:
    raise ValueError(f'unknown FBGEMM contender {cfg["contender"]!r}')
  info['torch_version'] = torch.__version__
  info['fbgemm_version'] = getattr(fbgemm_gpu, '__version__', '?')
  return info, steps


if __name__ == '__main__':
  serve(build)
