"""Train and optimizer steps on the default JAX device (a GPU), side by side.

    python3 -m benchmarks.experiments.gpu_steps [--quick] [--out FILE]

The CPU harness (`benchmarks/run.py`) pins each contender to cores; on a GPU
every step is XLA's (the C++ row kernels are CPU only), so this script runs
everything in one process on `jax.devices()[0]`, with torch on `cuda` when
torch sees one. Every time is the median wall time of a step that ends with
`block_until_ready` (torch: `torch.cuda.synchronize()`), interleaved step by
step between the contenders of one comparison, so a slow minute of the
machine lands on all of them.

1. **Single table** (`common.TARGET`: 4,096 Zipf ids a step, a `[rows, 64]`
   float32 table and a `[64]` weight, `loss = mean((rows @ w - 1)^2)`) at
   1,000,000 and 10,000,000 rows: `lazy_adam`, `rowwise_adagrad`,
   `optax.adam` (dense), torch `SparseAdam`, torch dense `Adam`.
2. **DLRM** (26 Criteo-shaped tables capped at 1,000,000 x 16, batch 2,048,
   an MLP; `benchmarks/harness/dlrm.py`): `lazy_adam` (26 tables, and the
   tables concatenated into one), `rowwise_adagrad`, `optax.adam`, torch
   `SparseAdam`.
3. **Rules** on the 1,000,000 x 64 table, the optimizer step alone (a
   row-sparse gradient built in the step, donated): each of the row-wise
   rules against `rowwise_adagrad`.

Prints one table per part and a JSON line of everything at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

# torch shares the GPU with JAX here: JAX's default preallocation (75% of the
# card) left torch out of memory on an 80 GB card at 10,000,000 rows.
os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.45')

from benchmarks import common  # pylint: disable=g-import-not-at-top
from benchmarks.harness import contenders
from benchmarks.harness import dlrm


def _median_ms(samples: list[float]) -> float:
  return float(np.median(samples) * 1e3)


def interleaved(steps: dict, n: int, warmup: int) -> dict:
  """Median ms of each `steps[name](k)` (which must block), run in turn."""
  for k in range(warmup):
    for run in steps.values():
      run(k)
  times: dict = {name: [] for name in steps}
  for k in range(n):
    for name, run in steps.items():
      t0 = time.perf_counter()
      run(warmup + k)
      times[name].append(time.perf_counter() - t0)
  return {name: _median_ms(t) for name, t in times.items()}


def jax_train(cfg: dict):
  """A blocking `run(k)` of a `contenders.py` JAX contender, and its compile
  time in seconds."""
  import jax  # pylint: disable=g-import-not-at-top

  setup = contenders.jax_setup(cfg)
  params = setup.fresh_params()
  state = setup.tx.init(params)
  t0 = time.perf_counter()
  step = jax.jit(setup.train_step, donate_argnums=setup.donate).lower(
      params, state, setup.batches[0]).compile()
  compile_s = time.perf_counter() - t0
  box = [params, state]

  def run(k):
    p, s, loss = step(box[0], box[1], setup.batches[k % len(setup.batches)])
    loss.block_until_ready()
    box[0], box[1] = p, s
  return run, compile_s


def torch_train(cfg: dict, sparse: bool, device: str = 'cuda'):
  """A blocking `run(k)` of torch's Embedding + (Sparse)Adam on `device`
  (`contenders.py`'s model)."""
  import torch  # pylint: disable=g-import-not-at-top

  cfg = dict(cfg, contender='torch_sparse' if sparse else 'torch_dense')
  batches = [torch.from_numpy(b.astype(np.int64)).to(device)
             for b in common.make_batches(cfg)]
  model = contenders.torch_model(cfg, np.random.default_rng(1), device)
  return contenders.torch_train(model, batches, device)


def torch_cuda() -> bool:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return torch.cuda.is_available()


def single_table(rows: int, args: argparse.Namespace) -> dict:
  cfg = dict(common.TARGET, rows=rows, pool=args.pool, seed=0)
  runs, compile_s = {}, {}
  for name in ('lazy_sparse', 'rowwise_adagrad', 'optax_dense'):
    runs[name], compile_s[name] = jax_train(dict(cfg, contender=name))
  if torch_cuda():
    runs['torch_sparse'] = torch_train(cfg, sparse=True)
    runs['torch_dense'] = torch_train(cfg, sparse=False)
  elif args.torch_cpu:
    runs['torch_sparse_cpu'] = torch_train(cfg, True, 'cpu')
  ms = interleaved(runs, args.steps, args.warmup)
  return {'step_ms': ms, 'compile_s': compile_s}


def dlrm_model(args: argparse.Namespace) -> dict:
  cfg = dict(dlrm.DEFAULTS, pool=args.pool, seed=0)
  runs, compile_s = {}, {}
  for name in ('dlrm_lazy', 'dlrm_lazy_concat', 'dlrm_rowwise_adagrad',
               'dlrm_optax_dense'):
    step, params, state, batches = dlrm.jax_setup(dict(cfg, contender=name))
    t0 = time.perf_counter()
    step = step.lower(params, state, batches[0]).compile()
    compile_s[name] = time.perf_counter() - t0
    box = [params, state]

    def run(k, step=step, box=box, batches=batches):
      p, s, loss = step(box[0], box[1], batches[k % len(batches)])
      loss.block_until_ready()
      box[0], box[1] = p, s
    runs[name] = run
  if torch_cuda():
    runs['dlrm_torch_sparse'] = dlrm.torch_train_step(cfg, 'cuda')[0]
  elif args.torch_cpu:
    runs['dlrm_torch_sparse_cpu'] = dlrm.torch_train_step(cfg)[0]
  ms = interleaved(runs, args.steps, args.warmup)
  return {'step_ms': ms, 'compile_s': compile_s}


def rules(args: argparse.Namespace) -> dict:
  """The optimizer step alone of each row-wise rule, on one table."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  v, d = common.TARGET['rows'], common.TARGET['row']
  lr = 1e-3
  txs = {
      'rowwise_adagrad': (lazy_optax.rowwise_adagrad(lr), False),
      'lazy_adam': (lazy_optax.lazy_adam(lr), False),
      'rowwise_rmsprop_ar': (lazy_optax.rowwise_rmsprop_ar(
          lr, ar_alpha=0.01), False),
      'rowwise_adagrad_with_counter': (
          lazy_optax.rowwise_adagrad_with_counter(
              lr, weight_decay=1e-4, counter_weight_decay_mode='adagradw'),
          False),
      'rowwise_adagrad+max_norm': (lazy_optax.lazy(optax.chain(
          lazy_optax.scale_by_rowwise_adagrad(),
          optax.scale_by_learning_rate(lr),
          lazy_optax.row_max_norm(1.0))), False),
      'lazy_adam_cowclip': (lazy_optax.lazy_adam_cowclip(lr), True),
  }
  ids = [jnp.asarray(b) for b in common.make_batches(
      dict(common.TARGET, pool=args.pool, seed=0))]
  rng = np.random.default_rng(2)
  values = jnp.asarray(rng.normal(size=(ids[0].shape[0], d)) * 0.1,
                       jnp.float32)
  runs = {}
  for name, (tx, counts) in txs.items():
    def step(params, state, ids, tx=tx, counts=counts):
      grads = {'table': lazy_optax.SparseRows(ids, values, v)}
      extra = ({'counts': {'table': lazy_optax.id_counts(ids, v)}}
               if counts else {})
      updates, state = tx.update(grads, state, params, **extra)
      return lazy_optax.apply_updates(params, updates), state
    params = {'table': jnp.asarray(
        rng.random((v, d), dtype=np.float32) * 0.02 - 0.01)}
    state = tx.init(params)
    step = jax.jit(step, donate_argnums=(0, 1))
    box = [params, state]

    def run(k, step=step, box=box):
      box[0], box[1] = step(box[0], box[1], ids[k % len(ids)])
      jax.block_until_ready(box[0])
    runs[name] = run
  ms = interleaved(runs, args.steps, args.warmup)
  base = ms['rowwise_adagrad']
  return {'step_ms': ms, 'ratio_to_rowwise_adagrad':
          {k: t / base for k, t in ms.items()}}


def _print_table(title: str, ms: dict, base: str) -> None:
  print(f'\n{title}')
  for name, t in ms.items():
    print(f'  {name:32s} {t:9.3f} ms  {t / ms[base]:6.2f}x {base}')


def main() -> None:
  import jax  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='small tables and few steps: a smoke run')
  parser.add_argument('--steps', type=int, default=100)
  parser.add_argument('--warmup', type=int, default=10)
  parser.add_argument('--pool', type=int, default=32,
                      help='distinct id batches cycled through')
  parser.add_argument('--parts', default='single,dlrm,rules')
  parser.add_argument('--out', default='')
  parser.add_argument('--torch-cpu', action='store_true',
                      help='without a cuda device, run torch on the CPU '
                      '(a smoke run of its code)')
  args = parser.parse_args()
  sizes = (1_000_000, 10_000_000)
  if args.quick:
    args.steps, args.warmup, args.pool = 5, 2, 4
    common.TARGET['rows'] = 100_000
    sizes = (100_000,)
    dlrm.DEFAULTS['cap'] = 10_000
  parts = set(args.parts.split(','))
  out: dict = {'device': str(jax.devices()[0]),
               'device_kind': jax.devices()[0].device_kind,
               'jax': jax.__version__, 'torch_cuda': torch_cuda()}
  print(json.dumps(out), flush=True)
  if 'single' in parts:
    for rows in sizes:
      r = single_table(rows, args)
      out[f'single_{rows}'] = r
      _print_table(f'single table {rows:,} x 64, train step (compile s: '
                   f'{json.dumps(r["compile_s"])})', r['step_ms'],
                   'lazy_sparse')
  if 'dlrm' in parts:
    r = dlrm_model(args)
    out['dlrm'] = r
    _print_table(f'DLRM 26 tables, train step (compile s: '
                 f'{json.dumps(r["compile_s"])})', r['step_ms'], 'dlrm_lazy')
  if 'rules' in parts:
    r = rules(args)
    out['rules'] = r
    _print_table('rules, optimizer step alone, 1,000,000 x 64', r['step_ms'],
                 'rowwise_adagrad')
  print(json.dumps(out))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  main()
