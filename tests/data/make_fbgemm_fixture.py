"""Makes `fbgemm_rowwise_adagrad.npz`: FBGEMM's row-wise Adagrad, step by step.

Run it with an interpreter that has FBGEMM (`fbgemm-gpu-cpu` 1.9.0 needs
`torch==2.14.1`; `python3 benchmarks/peers.py setup DIR` makes one), from
the repository root:

    $LAZY_OPTAX_FBGEMM_PYTHON tests/data/make_fbgemm_fixture.py

A float32 table of `rows x row` goes through `steps` train steps of FBGEMM's
CPU table-batched embedding (`SplitTableBatchedEmbeddingBagsCodegen` on the
host, `EmbOptimType.EXACT_ROWWISE_ADAGRAD`, weight decay 0, one row per id):
each step looks up `ids` ids and back-propagates a given gradient row per id,
and FBGEMM updates the table inside `backward`. The ids repeat within a step
(FBGEMM sums duplicates), a quarter of the rows is never looked up, some rows
first appear in a late step, and one row's gradients are tiny (1e-7), so
that `eps` sits where it matters. The file holds the inputs (`table0`, `ids`
`[steps, ids]`, `grads` `[steps, ids, row]`, `learning_rate`, `eps`) and
FBGEMM's outputs after every step (`tables` `[steps, rows, row]`,
`accumulators` `[steps, rows]`), plus the versions that made them.
`tests/test_fbgemm_parity.py` replays the inputs through
`lazy_optax.rowwise_adagrad` and compares.

With `--rowwise-rmsprop-ar` it makes `fbgemm_rowwise_rmsprop_ar.npz` instead:
FBGEMM's `ROWWISE_RMSPROP_AR` (`ar_inputs`, `run_fbgemm_ar`) over many steps,
with duplicates, rows seen every step, rows seen every few steps, rows left
untouched for long stretches, rows first seen late and rows never seen, and
`ar_alpha > 0` so that the shrink matters (it reaches `min_shrinkage` for the
longest gaps). Besides the inputs it holds `ar_alpha`, `ema_beta`,
`min_shrinkage` and FBGEMM's `tables`, `momentum` (its `v`) and `prev_iter`
after every step.

With `--emainplace` it makes `fbgemm_emainplace_rowwise_adagrad.npz`:
FBGEMM's `EMAINPLACE_ROWWISE_ADAGRAD` (`run_fbgemm_emainplace`) on the same
kind of stream as the AR fixture (`ar_inputs`). That optimizer is row-wise
Adagrad plus, at the start of every training forward call `t` (counted from
1) with `t % step_ema == 0` and `t >= step_start`, a blend of the second
half of every row of the table (looked up or not) toward its first half:
`w[:, D/2:] += step_ema_coef * (w[:, :D/2] - w[:, D/2:])`. Besides the
inputs it holds `step_ema`, `step_start`, `step_ema_coef` and FBGEMM's
`tables` and `accumulators` (its `momentum1`) after every step.

Only numpy is imported at module level: pytest imports this file for its
doctests in the main environment, where torch is another version.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, 'fbgemm_rowwise_adagrad.npz')
DEFAULT_AR_OUT = os.path.join(HERE, 'fbgemm_rowwise_rmsprop_ar.npz')


def inputs(seed: int, rows: int, row: int, ids: int, steps: int) -> dict:
  """The table, ids and gradient rows fed to FBGEMM (numpy, float32)."""
  rng = np.random.default_rng(seed)
  table0 = (rng.normal(size=(rows, row)) * 0.1).astype(np.float32)
  touched = rows - rows // 4            # rows >= touched are never looked up
  late = max(1, touched // 8)           # rows [0, late) only from step steps//2
  tiny = touched - 1                    # this row's gradients are 1e-7
  id_steps, grad_steps = [], []
  for s in range(steps):
    low = 0 if s >= steps // 2 else late
    # Half the ids from a few hot rows (many duplicates), half spread out.
    hot = rng.integers(low, low + 4, ids // 2)
    cold = rng.integers(low, touched, ids - ids // 2)
    step_ids = rng.permutation(np.concatenate([hot, cold])).astype(np.int32)
    step_ids[0] = tiny
    g = rng.normal(size=(ids, row)).astype(np.float32)
    g[step_ids == tiny] *= np.float32(1e-7)
    id_steps.append(step_ids)
    grad_steps.append(g)
  return {'table0': table0, 'ids': np.stack(id_steps),
          'grads': np.stack(grad_steps)}


def run_fbgemm(data: dict, learning_rate: float, eps: float) -> dict:
  """FBGEMM's tables and accumulators after each step of `data`."""
  # pylint: disable=g-import-not-at-top
  import fbgemm_gpu
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as ops
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
  import torch


  rows, row = data['table0'].shape
  tbe = train.SplitTableBatchedEmbeddingBagsCodegen(
      [(rows, row, ops.EmbeddingLocation.HOST,
        ops.ComputeDevice.CPU)],
      optimizer=configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
      learning_rate=learning_rate, eps=eps, weight_decay=0.0,
      pooling_mode=ops.PoolingMode.NONE, device='cpu')
  with torch.no_grad():
    tbe.split_embedding_weights()[0].copy_(torch.from_numpy(data['table0']))
  tables, accumulators = [], []
  for step_ids, g in zip(data['ids'], data['grads']):
    indices = torch.from_numpy(step_ids.astype(np.int64))
    offsets = torch.arange(indices.numel() + 1, dtype=torch.int64)
    out = tbe(indices, offsets)                   # [ids, row]
    out.backward(torch.from_numpy(g))             # the table updates here
    tables.append(tbe.split_embedding_weights()[0].detach().numpy().copy())
    accumulators.append(
        tbe.split_optimizer_states()[0][0].detach().numpy().copy())
  return {'tables': np.stack(tables), 'accumulators': np.stack(accumulators),
          'fbgemm_version': np.array(getattr(fbgemm_gpu, '__version__', '?')),
          'torch_version': np.array(torch.__version__)}


def ar_inputs(seed: int, rows: int, row: int, ids: int, steps: int) -> dict:
  """Inputs for ROWWISE_RMSPROP_AR: rows seen at very different rates.

  Rows [0, 4) are hot (every step, many duplicates); rows [4, q) are seen
  with probability 1/2 a step; rows [q, 2q) only at steps that are multiples
  of 7; rows [2q, 3q) at step 0 and again after `steps // 2` steps; rows
  [3q, 3q + q // 2) first at step `steps // 2`; the rest never, with q =
  rows // 4.
  """
  rng = np.random.default_rng(seed)
  q = rows // 4
  table0 = (rng.normal(size=(rows, row)) * 0.1).astype(np.float32)
  id_steps, grad_steps = [], []
  for s in range(steps):
    pool = [np.arange(4, q)[rng.random(q - 4) < 0.5]]
    if s % 7 == 0:
      pool.append(np.arange(q, 2 * q))
    if s in (0, steps // 2 + 1):
      pool.append(np.arange(2 * q, 3 * q))
    if s >= steps // 2:
      pool.append(np.arange(3 * q, 3 * q + q // 2))
    pool = np.concatenate(pool)
    cold = rng.choice(pool, size=min(pool.size, ids // 2), replace=False)
    hot = rng.integers(0, 4, ids - cold.size)
    step_ids = rng.permutation(np.concatenate([hot, cold])).astype(np.int32)
    id_steps.append(step_ids)
    grad_steps.append(rng.normal(size=(ids, row)).astype(np.float32))
  return {'table0': table0, 'ids': np.stack(id_steps),
          'grads': np.stack(grad_steps)}


def _replay_tbe(data: dict, optimizer: str, read_states, **options) -> dict:
  """FBGEMM's host table after each step of `data`, one CPU table trained
  with `optimizer` (an `EmbOptimType` name) and `options`, and what
  `read_states(states, rows)` reads of its optimizer states (a dict of
  arrays) after each step."""
  # pylint: disable=g-import-not-at-top
  import fbgemm_gpu
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as ops
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
  import torch

  rows, row = data['table0'].shape
  tbe = train.SplitTableBatchedEmbeddingBagsCodegen(
      [(rows, row, ops.EmbeddingLocation.HOST, ops.ComputeDevice.CPU)],
      optimizer=getattr(configs.EmbOptimType, optimizer),
      pooling_mode=ops.PoolingMode.NONE, device='cpu', **options)
  assert tbe.training    # (an EMA blend runs in training mode only)
  with torch.no_grad():
    tbe.split_embedding_weights()[0].copy_(torch.from_numpy(data['table0']))
  tables, states = [], []
  for step_ids, g in zip(data['ids'], data['grads']):
    indices = torch.from_numpy(step_ids.astype(np.int64))
    offsets = torch.arange(indices.numel() + 1, dtype=torch.int64)
    tbe(indices, offsets).backward(torch.from_numpy(g))
    tables.append(tbe.split_embedding_weights()[0].detach().numpy().copy())
    states.append(read_states(tbe.split_optimizer_states()[0], rows))
  out = {name: np.stack([s[name] for s in states]) for name in states[0]}
  out.update(tables=np.stack(tables),
             fbgemm_version=np.array(getattr(fbgemm_gpu, '__version__', '?')),
             torch_version=np.array(torch.__version__))
  return out


def _state(states, k: int, rows: int) -> np.ndarray:
  return states[k].detach().numpy().reshape(rows).copy()


def run_fbgemm_ar(data: dict, learning_rate: float, eps: float,
                  ar_alpha: float, ema_beta: float,
                  min_shrinkage: float) -> dict:
  """FBGEMM's ROWWISE_RMSPROP_AR tables, `v` and `prev_iter` after each
  step of `data`."""
  return _replay_tbe(
      data, 'ROWWISE_RMSPROP_AR',
      lambda states, rows: {'momentum': _state(states, 0, rows),
                            'prev_iter': _state(states, 1, rows)},
      learning_rate=learning_rate, eps=eps, ar_alpha=ar_alpha,
      ema_beta=ema_beta, min_shrinkage=min_shrinkage)


def main_ar(args: argparse.Namespace) -> None:
  """Writes the ROWWISE_RMSPROP_AR fixture."""
  data = ar_inputs(args.seed, args.rows, args.row, args.ids, args.steps)
  data.update(run_fbgemm_ar(data, args.learning_rate, args.eps,
                            args.ar_alpha, args.ema_beta, args.min_shrinkage))
  for name in ('learning_rate', 'eps', 'ar_alpha', 'ema_beta',
               'min_shrinkage'):
    data[name] = np.float32(getattr(args, name))
  out = args.out or DEFAULT_AR_OUT
  np.savez_compressed(out, **data)
  print(f'wrote {out}: ROWWISE_RMSPROP_AR, {args.steps} steps of {args.ids} '
        f'ids into {args.rows} x {args.row}; FBGEMM {data["fbgemm_version"]}')


# -- EMAINPLACE_ROWWISE_ADAGRAD ----------------------------------------------

EMAINPLACE_OUT = os.path.join(HERE, 'fbgemm_emainplace_rowwise_adagrad.npz')


def run_fbgemm_emainplace(data: dict, learning_rate: float, eps: float,
                          step_ema: int, step_start: int,
                          step_ema_coef: float) -> dict:
  """FBGEMM's EMAINPLACE_ROWWISE_ADAGRAD tables and `momentum1` after each
  step of `data`."""
  # pylint: disable=g-import-not-at-top
  from fbgemm_gpu.tbe.config import optimizer_config as oc

  return _replay_tbe(
      data, 'EMAINPLACE_ROWWISE_ADAGRAD',
      lambda states, rows: {'accumulators': _state(states, 0, rows)},
      learning_rate=learning_rate, eps=eps,
      emainplace_mode=oc.EmainplaceModeDefinition(
          step_ema=step_ema, step_start=step_start,
          step_ema_coef=step_ema_coef))


def main_emainplace(args: argparse.Namespace) -> None:
  """Writes the EMAINPLACE_ROWWISE_ADAGRAD fixture."""
  data = ar_inputs(args.seed, args.rows, args.row, args.ids, args.steps)
  data.update(run_fbgemm_emainplace(
      data, args.learning_rate, args.eps, args.step_ema, args.step_start,
      args.step_ema_coef))
  data['learning_rate'] = np.float32(args.learning_rate)
  data['eps'] = np.float32(args.eps)
  data['step_ema'] = np.int32(args.step_ema)
  data['step_start'] = np.int32(args.step_start)
  data['step_ema_coef'] = np.float32(args.step_ema_coef)
  out = args.out or EMAINPLACE_OUT
  np.savez_compressed(out, **data)
  print(f'wrote {out}: EMAINPLACE_ROWWISE_ADAGRAD, {args.steps} steps of '
        f'{args.ids} ids into {args.rows} x {args.row}; FBGEMM '
        f'{data["fbgemm_version"]}')


# -- WeightDecayMode.COUNTER (rowwise_adagrad_with_counter) -----------------

COUNTER_OUT = os.path.join(HERE, 'fbgemm_rowwise_adagrad_counter.npz')

# lazy_optax's keyword arguments of each configuration; FBGEMM's
# CounterBasedRegularizationDefinition is built from them.
COUNTER_CONFIGS = {
    'adagradw': dict(weight_decay=0.1, counter_weight_decay_mode='adagradw'),
    'adagradw_halflife-2_iter5': dict(
        weight_decay=0.2, counter_weight_decay_mode='adagradw',
        counter_halflife=-2, adjustment_ub=0.1, adjustment_iter=5),
    'decoupled_halflife8_increase': dict(
        weight_decay=0.1, counter_weight_decay_mode='decoupled',
        counter_halflife=8, learning_rate_mode='tail_id_lr_increase',
        adjustment_ub=0.5, tail_id_threshold=1.0),
    'l2_halflife4_counter_sgd': dict(
        weight_decay=0.05, counter_weight_decay_mode='l2', counter_halflife=4,
        learning_rate_mode='counter_sgd', adjustment_ub=2.0),
    'none_halflife0_decrease_ratio': dict(
        counter_halflife=0, learning_rate_mode='tail_id_lr_decrease',
        adjustment_ub=0.5, tail_id_threshold=0.5,
        tail_id_threshold_is_ratio=True),
    'none_counter_sgd': dict(learning_rate_mode='counter_sgd',
                             adjustment_ub=3.0),
}


def counter_inputs(seed: int, rows: int, row: int, ids: int,
                   steps: int) -> dict:
  """Ids for the counters: duplicates, long absences, rows first seen late.

  Rows `[0, 4)` are hot (every step, duplicated), rows `[4, rows // 4)`
  come back only every 7th step, rows from `rows // 2` first appear in the
  second half, the last eighth of the rows is never looked up.
  """
  rng = np.random.default_rng(seed)
  table0 = (rng.normal(size=(rows, row)) * 0.3).astype(np.float32)
  never = rows - rows // 8
  id_steps = []
  for s in range(steps):
    hot = rng.integers(0, 4, ids // 4)
    pool = np.arange(rows // 4, rows // 2 if s < steps // 2 else never)
    if s % 7 == 3:
      pool = np.concatenate([pool, np.arange(4, rows // 4)])
    cold = rng.choice(pool, ids - ids // 4)
    id_steps.append(rng.permutation(np.concatenate([hot, cold])).astype(
        np.int32))
  grads = rng.normal(size=(steps, ids, row)).astype(np.float32)
  return {'table0': table0, 'ids': np.stack(id_steps), 'grads': grads}


# lazy_optax's counter_weight_decay_mode -> FBGEMM's CounterWeightDecayMode.
_DECAY_MODES = {'none': 'NONE', 'l2': 'L2', 'decoupled': 'DECOUPLE',
                'adagradw': 'ADAGRADW'}


def _counter_definition(kw: dict):
  """FBGEMM's CounterBasedRegularizationDefinition for lazy_optax's args."""
  # pylint: disable=g-import-not-at-top
  from fbgemm_gpu.tbe.config import optimizer_config as oc
  return oc.CounterBasedRegularizationDefinition(
      counter_weight_decay_mode=oc.CounterWeightDecayMode[_DECAY_MODES[
          kw.get('counter_weight_decay_mode', 'none')]],
      counter_halflife=kw.get('counter_halflife', -1),
      adjustment_iter=kw.get('adjustment_iter', -1),
      adjustment_ub=kw.get('adjustment_ub', 1.0),
      learning_rate_mode=oc.LearningRateMode[
          kw.get('learning_rate_mode', 'equal').upper()],
      tail_id_threshold=oc.TailIdThreshold(
          val=kw.get('tail_id_threshold', 0.0),
          is_ratio=kw.get('tail_id_threshold_is_ratio', False)))


def run_fbgemm_counter(data: dict, kw: dict, learning_rate: float,
                       eps: float) -> dict:
  """FBGEMM's tables and (accumulator, last step, counter) after each step."""
  # pylint: disable=g-import-not-at-top
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as ops
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train
  from fbgemm_gpu.tbe.config import optimizer_config as oc
  import torch

  rows, row = data['table0'].shape
  tbe = train.SplitTableBatchedEmbeddingBagsCodegen(
      [(rows, row, ops.EmbeddingLocation.HOST, ops.ComputeDevice.CPU)],
      optimizer=configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
      learning_rate=learning_rate, eps=eps,
      weight_decay=kw.get('weight_decay', 0.0),
      weight_decay_mode=oc.WeightDecayMode.COUNTER,
      counter_based_regularization=_counter_definition(kw),
      pooling_mode=ops.PoolingMode.NONE, device='cpu')
  with torch.no_grad():
    tbe.split_embedding_weights()[0].copy_(torch.from_numpy(data['table0']))
  tables, states = [], []
  for step_ids, g in zip(data['ids'], data['grads']):
    indices = torch.from_numpy(step_ids.astype(np.int64))
    offsets = torch.arange(indices.numel() + 1, dtype=torch.int64)
    tbe(indices, offsets).backward(torch.from_numpy(g))
    tables.append(tbe.split_embedding_weights()[0].detach().numpy().copy())
    states.append(np.stack([x.detach().numpy().copy()
                            for x in tbe.split_optimizer_states()[0]]))
  return {'tables': np.stack(tables), 'states': np.stack(states)}


def make_counter_fixture(out: str, seed: int, rows: int, row: int, ids: int,
                         steps: int, learning_rate: float, eps: float) -> None:
  """One input stream through every `COUNTER_CONFIGS` entry, into `out`.

  Keys: the inputs, `names`, `<name>/tables` `[steps, rows, row]` and
  `<name>/states` `[steps, 3, rows]` (FBGEMM's `momentum1`, `prev_iter`,
  `row_counter`), and the versions.
  """
  # pylint: disable=g-import-not-at-top
  import fbgemm_gpu
  import torch
  data = counter_inputs(seed, rows, row, ids, steps)
  for name, kw in COUNTER_CONFIGS.items():
    got = run_fbgemm_counter(data, kw, learning_rate, eps)
    data[f'{name}/tables'] = got['tables']
    data[f'{name}/states'] = got['states']
  data['names'] = np.array(list(COUNTER_CONFIGS))
  data['learning_rate'] = np.float32(learning_rate)
  data['eps'] = np.float32(eps)
  data['fbgemm_version'] = np.array(getattr(fbgemm_gpu, '__version__', '?'))
  data['torch_version'] = np.array(torch.__version__)
  np.savez_compressed(out, **data)
  print(f'wrote {out}: {len(COUNTER_CONFIGS)} COUNTER configurations, '
        f'{steps} steps of {ids} ids into {rows} x {row}')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=None)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--rows', type=int, default=48)
  parser.add_argument('--row', type=int, default=8,
                      help='floats a row (FBGEMM: a multiple of 4)')
  parser.add_argument('--ids', type=int, default=32)
  parser.add_argument('--steps', type=int, default=6)
  parser.add_argument('--learning-rate', type=float, default=0.05)
  parser.add_argument('--eps', type=float, default=1e-8)
  parser.add_argument('--rowwise-rmsprop-ar', action='store_true',
                      help='make the ROWWISE_RMSPROP_AR fixture instead')
  parser.add_argument('--ar-alpha', type=float, default=1.0)
  parser.add_argument('--ema-beta', type=float, default=0.9)
  parser.add_argument('--min-shrinkage', type=float, default=0.1)
  parser.add_argument('--counter', action='store_true',
                      help='WeightDecayMode.COUNTER configurations instead '
                      f'(default --out {os.path.basename(COUNTER_OUT)})')
  parser.add_argument('--emainplace', action='store_true',
                      help='make the EMAINPLACE_ROWWISE_ADAGRAD fixture '
                      'instead (default --out '
                      f'{os.path.basename(EMAINPLACE_OUT)})')
  parser.add_argument('--step-ema', type=int, default=5)
  parser.add_argument('--step-start', type=int, default=12)
  parser.add_argument('--step-ema-coef', type=float, default=0.3)
  args = parser.parse_args()
  if args.emainplace:
    main_emainplace(args)
    return
  if args.rowwise_rmsprop_ar:
    main_ar(args)
    return
  if args.counter:
    make_counter_fixture(
        args.out or COUNTER_OUT, args.seed, args.rows, args.row, args.ids,
        args.steps, args.learning_rate, args.eps)
    return
  args.out = args.out or DEFAULT_OUT
  data = inputs(args.seed, args.rows, args.row, args.ids, args.steps)
  data.update(run_fbgemm(data, args.learning_rate, args.eps))
  data['learning_rate'] = np.float32(args.learning_rate)
  data['eps'] = np.float32(args.eps)
  np.savez_compressed(args.out, **data)
  print(f'wrote {args.out}: {args.steps} steps of {args.ids} ids into '
        f'{args.rows} x {args.row}; FBGEMM {data["fbgemm_version"]}, torch '
        f'{data["torch_version"]}')


if __name__ == '__main__':
  main()
