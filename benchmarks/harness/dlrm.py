"""A DLRM-shaped model: 26 embedding tables and an MLP, JAX and torch.

Run by `benchmarks/run.py` once per thread count, pinned, with every JAX
and torch contender (from the repository root), which it builds and then
times step by step in turn, one round for each `round` line on stdin
(`benchmarks.common.serve`):

    python3 -m benchmarks.harness.dlrm '[{"contender": "dlrm_lazy", ...}]'

The model and its batches are `benchmarks/common.py`'s. The tables have
the Criteo Kaggle (Display Advertising Challenge) categorical cardinalities,
capped at `cap` rows (1,000,000: 5,569,296 rows in all), and
`row` (16) floats a row. A batch is `batch` (2,048) examples, each with one
Zipf-distributed id per table (hot ids spread over each table), 13 dense
features and a 0/1 label. The model concatenates the 26 looked-up rows and
the dense features, then `mlp` hidden ReLU layers (one of 64) and a logit;
the loss is the mean logistic loss. The whole train step is timed;
`first_loss` is the loss of the second step, the same for every contender
up to rounding (the same model, data and initial values).

Contenders:
  dlrm_lazy          lazy_optax.lazy_adam, 26 tables, `lazy_optax.lookup` +
                     `lazy_optax.value_and_grad`, jit, donated
  dlrm_lazy_concat   the same with the 26 tables concatenated into one
                     (ids offset by table), one lookup
  dlrm_torch_sparse  torch: 26 `nn.Embedding(sparse=True)` with
                     `optim.SparseAdam`, the MLP with `optim.Adam`
  dlrm_optax_dense   optax.adam, dense gradients (`jax.value_and_grad`),
                     jit, donated
  dlrm_rowwise_adagrad  lazy_optax.rowwise_adagrad on every parameter (the
                     tables lazily), otherwise as dlrm_lazy: the rule that
                     `fbgemm_contender.py` measures in FBGEMM
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks.common import cardinalities
from benchmarks.common import CRITEO_KAGGLE
from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import ids_digest
from benchmarks.common import init_mlp
from benchmarks.common import init_tables
from benchmarks.common import lazy_step_bytes
from benchmarks.common import LR
from benchmarks.common import make_dlrm_batches
from benchmarks.common import mlp_shapes
from benchmarks.common import serve

DEFAULTS = DLRM_DEFAULTS
CONTENDERS = ('dlrm_lazy', 'dlrm_lazy_concat', 'dlrm_torch_sparse',
              'dlrm_optax_dense')


def traffic(cfg: dict, batches: list[dict[str, np.ndarray]]) -> dict:
  """The bytes a lazy Adam step must move (`contenders.lazy_step_bytes`)."""
  dense_bytes = 4 * sum(i * o + o for i, o in mlp_shapes(cfg))
  total: dict = {}
  for t in range(len(CRITEO_KAGGLE)):
    part = lazy_step_bytes([b['ids'][:, t] for b in batches], 4 * cfg['row'])
    for k, val in part.items():
      total[k] = total.get(k, 0.0) + val
  dense = lazy_step_bytes([np.zeros(0, np.int32)], 0, dense_bytes)
  for k in ('bytes_read', 'bytes_written', 'bytes'):
    total[k] += dense[k]
  total['dense_param_bytes'] = dense_bytes
  return total


# -- JAX ----------------------------------------------------------------------


def jax_setup(cfg: dict):
  """The jitted (donated) train step, params, state and batches of a JAX
  contender: `(step, params, state, batches)`, `step(params, state, batch)`
  returning `(params, state, loss)`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import optax

  import lazy_optax

  name = cfg['contender']
  cards = cardinalities(cfg)
  offsets = np.concatenate([[0], np.cumsum(cards)[:-1]]).astype(np.int32)
  rng = np.random.default_rng(1)
  tables = init_tables(cfg, rng)
  mlp = [{'w': jnp.asarray(w), 'b': jnp.asarray(b)}
         for w, b in init_mlp(cfg, rng)]
  concat = name == 'dlrm_lazy_concat'
  if concat:
    params = {'table': jnp.asarray(np.concatenate(tables)), 'mlp': mlp}
  else:
    params = {'tables': [jnp.asarray(t) for t in tables], 'mlp': mlp}
  del tables
  batches = [{k: jnp.asarray(v) for k, v in b.items()}
             for b in make_dlrm_batches(cfg)]
  offsets_j = jnp.asarray(offsets)
  batch_size = cfg['batch']

  if name == 'dlrm_optax_dense':
    tx = optax.adam(LR)

    def take(table, ids):
      return table[ids]
  elif name in ('dlrm_lazy', 'dlrm_lazy_concat', 'dlrm_rowwise_adagrad'):
    tx = (lazy_optax.rowwise_adagrad(LR) if name == 'dlrm_rowwise_adagrad'
          else lazy_optax.lazy_adam(LR))
    take = lazy_optax.lookup
  else:
    raise ValueError(f'unknown JAX contender {name!r}')

  def loss_fn(p, ids, dense, labels):
    if concat:
      rows = take(p['table'], ids + offsets_j).reshape(batch_size, -1)
    else:
      rows = jnp.concatenate(
          [take(t, ids[:, i]) for i, t in enumerate(p['tables'])], axis=1)
    x = jnp.concatenate([rows, dense], axis=1)
    for layer in p['mlp'][:-1]:
      x = jax.nn.relu(x @ layer['w'] + layer['b'])
    logits = (x @ p['mlp'][-1]['w'] + p['mlp'][-1]['b'])[:, 0]
    return jnp.mean(jax.nn.softplus(logits) - labels * logits)

  grad_fn = (jax.value_and_grad(loss_fn) if name == 'dlrm_optax_dense'
             else lazy_optax.value_and_grad(loss_fn))

  def train_step(p, state, batch):
    loss, grads = grad_fn(p, batch['ids'], batch['dense'], batch['labels'])
    updates, state = tx.update(grads, state, p)
    return lazy_optax.apply_updates(p, updates), state, loss

  state = tx.init(params)
  step = jax.jit(train_step, donate_argnums=(0, 1))
  return step, params, state, batches


def _jax_contender(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of a JAX contender (`common.serve`'s `build`)."""
  import jax  # pylint: disable=g-import-not-at-top

  step, params, state, batches = jax_setup(cfg)
  np_batches = [{k: np.asarray(v) for k, v in b.items()} for b in batches]
  info: dict = {'ids_digest': ids_digest([b['ids'] for b in np_batches])}
  if cfg['contender'] in ('dlrm_lazy', 'dlrm_lazy_concat'):  # Adam's traffic
    info['traffic'] = traffic(cfg, np_batches)
  t0 = time.perf_counter()
  lowered = step.lower(params, state, batches[0])
  info['trace_s'] = time.perf_counter() - t0
  compiled = lowered.compile()
  info['compile_s'] = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  if mem is not None:
    info['xla_temp_mb'] = mem.temp_size_in_bytes / 2**20
  box = [params, state]
  del params, state

  def run_train(k):
    p, s, loss = compiled(box[0], box[1], batches[k % len(batches)])
    loss.block_until_ready()
    box[0], box[1] = p, s
    return loss

  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = time.perf_counter() - t0
  info['first_loss'] = float(jax.device_get(run_train(0)))
  return info, {'train': run_train}


# -- torch --------------------------------------------------------------------


def torch_train_step(cfg: dict, device: str = 'cpu'):
  """torch's DLRM (sparse `nn.Embedding`s, `SparseAdam` + `Adam`) on
  `device`: `(run_train, np_batches)`, `run_train(k)` one step on batch `k`
  that returns its loss once the step is done."""
  import torch  # pylint: disable=g-import-not-at-top

  dev = torch.device(device)
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)
  rng = np.random.default_rng(1)
  embs = []
  for t in init_tables(cfg, rng):
    emb = torch.nn.Embedding(t.shape[0], t.shape[1], sparse=True).to(dev)
    with torch.no_grad():
      emb.weight.copy_(torch.from_numpy(t))
    embs.append(emb)
  layers = []
  for w, b in init_mlp(cfg, rng):
    lin = torch.nn.Linear(w.shape[0], w.shape[1]).to(dev)
    with torch.no_grad():
      lin.weight.copy_(torch.from_numpy(w.T))
      lin.bias.copy_(torch.from_numpy(b))
    layers.append(lin)
  opts = [torch.optim.SparseAdam([e.weight for e in embs], lr=LR),
          torch.optim.Adam([p for lin in layers for p in lin.parameters()],
                           lr=LR)]
  np_batches = make_dlrm_batches(cfg)
  batches = [{'ids': torch.from_numpy(b['ids'].astype(np.int64)).to(dev),
              'dense': torch.from_numpy(b['dense']).to(dev),
              'labels': torch.from_numpy(b['labels']).to(dev)}
             for b in np_batches]
  softplus = torch.nn.functional.softplus

  def run_train(k):
    batch = batches[k % len(batches)]
    for o in opts:
      o.zero_grad(set_to_none=True)
    rows = torch.cat([e(batch['ids'][:, i]) for i, e in enumerate(embs)], 1)
    x = torch.cat([rows, batch['dense']], 1)
    for lin in layers[:-1]:
      x = torch.relu(lin(x))
    logits = layers[-1](x)[:, 0]
    loss = (softplus(logits) - batch['labels'] * logits).mean()
    loss.backward()
    for o in opts:
      o.step()
    sync()
    return loss

  return run_train, np_batches


def _torch_contender(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of the torch contender (`common.serve`'s `build`)."""
  import torch  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(cfg['threads'])
  run_train, np_batches = torch_train_step(cfg)
  info: dict = {'ids_digest': ids_digest([b['ids'] for b in np_batches]),
                'compile_s': 0.0}
  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = time.perf_counter() - t0
  info['first_loss'] = float(run_train(0))
  return info, {'train': run_train}


def build(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of any contender of this module (`common.serve`)."""
  cfg = dict(DEFAULTS, **cfg)
  if cfg['contender'].startswith('dlrm_torch'):
    return _torch_contender(cfg)
  return _jax_contender(cfg)


if __name__ == '__main__':
  serve(build)
