"""The single-table contenders of JAX and torch, interleaved in this process.

Run by `benchmarks/run.py` once per (configuration, thread count), pinned
to the cores it may use, with every JAX and torch contender of that
configuration (from the repository root):

    python3 -m benchmarks.harness.contenders '[{"contender": "lazy_sparse",
        ...}, {"contender": "torch_sparse", ...}]'

It builds them all, then times them step by step in turn, one round for
each `round` line on stdin (`benchmarks.common.serve`).

The model is the smallest one that exercises a train step of an embedding
table: `loss = mean((table[ids] @ w - 1)^2)`, with a `[num_rows, row]` table
and a `[row]` dense weight. The lazy_optax contenders take the documented
step (`lazy_optax.lookup` inside `lazy_optax.value_and_grad`). The whole
train step (lookup, backward, update) and the optimizer step alone (update
and apply, on a gradient prepared beforehand) are timed separately.

JAX contenders: `lazy_sparse` (`lazy_adam`), `lazy_sparse_nodonate`,
`lazy_dense_skip`, `optax_dense` and `rowwise_adagrad`
(`lazy_optax.rowwise_adagrad` on the table and the weight, the rule that
`fbgemm_contender.py` measures in FBGEMM); torch contenders: `torch_sparse`,
`torch_dense`.
"""

from __future__ import annotations

import time
import types

import numpy as np

from benchmarks.common import ids_digest
from benchmarks.common import lazy_step_bytes
from benchmarks.common import LR
from benchmarks.common import make_batches
from benchmarks.common import serve

# -- JAX contenders -----------------------------------------------------------


def jax_setup(cfg: dict) -> types.SimpleNamespace:
  """The JAX pieces of a contender: its train step (not yet jitted), optimizer
  step, `tx`, a `fresh_params()` maker, the id batches, and what to donate.

  `profile_step.py` uses it too, so that it profiles the measured step.
  """
  import jax
  import jax.numpy as jnp
  import optax

  import lazy_optax

  name = cfg['contender']
  v, d = cfg['rows'], cfg['row']
  np_batches = make_batches(cfg)
  batches = [jnp.asarray(b) for b in np_batches]
  rng = np.random.default_rng(1)

  def fresh_params():
    table = jnp.asarray(
        rng.random((v, d), dtype=np.float32) * np.float32(0.02) - 0.01)
    return {'table': table, 'w': jnp.ones((d,), jnp.float32)}

  def loss_fn(rows, w):
    return jnp.mean((rows @ w - 1.0) ** 2)

  sparse = name in ('lazy_sparse', 'lazy_sparse_nodonate', 'rowwise_adagrad')
  if name == 'rowwise_adagrad':
    tx = lazy_optax.rowwise_adagrad(LR)
  elif sparse:
    tx = lazy_optax.lazy_adam(LR)
  elif name == 'lazy_dense_skip':
    tx = lazy_optax.lazy(optax.adam(LR), skip_zero_rows=True)
  elif name == 'optax_dense':
    tx = optax.adam(LR)
  else:
    raise ValueError(f'unknown JAX contender {name!r}')
  donate = (0, 1) if name != 'lazy_sparse_nodonate' else ()

  def train_step(params, state, ids):
    if sparse:
      # The documented step: the rows looked up inside
      # lazy_optax.value_and_grad, which gives the table a SparseRows
      # gradient (its lookups read the table with the CPU kernels' row
      # gather where they run).
      loss, grads = lazy_optax.value_and_grad(
          lambda p: loss_fn(lazy_optax.lookup(p['table'], ids), p['w']))(
              params)
    else:
      loss, grads = jax.value_and_grad(
          lambda p: loss_fn(p['table'][ids], p['w']))(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, loss

  def opt_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  return types.SimpleNamespace(
      train_step=train_step, opt_step=opt_step, tx=tx,
      fresh_params=fresh_params, batches=batches, np_batches=np_batches,
      donate=donate, sparse=sparse)


def _jax_contender(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of a JAX contender (`common.serve`'s `build`)."""
  import jax
  import jax.numpy as jnp

  import lazy_optax

  setup = jax_setup(cfg)
  d = cfg['row']
  batches, sparse = setup.batches, setup.sparse
  info: dict = {'ids_digest': ids_digest(setup.np_batches)}
  if sparse and cfg['contender'] != 'rowwise_adagrad':  # Adam's traffic
    info['traffic'] = lazy_step_bytes(setup.np_batches, 4 * d,
                                      dense_bytes=4 * d)
  params = setup.fresh_params()
  box = [params, setup.tx.init(params)]
  del params
  t0 = time.perf_counter()
  train = jax.jit(setup.train_step, donate_argnums=setup.donate).lower(
      box[0], box[1], batches[0]).compile()
  info['compile_s'] = time.perf_counter() - t0
  mem = train.memory_analysis()
  if mem is not None:
    info['xla_temp_mb'] = mem.temp_size_in_bytes / 2**20

  def run_train(k):
    p, s, loss = train(box[0], box[1], batches[k % len(batches)])
    loss.block_until_ready()
    box[0], box[1] = p, s

  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = time.perf_counter() - t0
  steps = {'train': run_train}
  if not cfg.get('opt', True):
    return info, steps

  # The optimizer step alone, on gradients prepared beforehand, updating
  # the same params and state.
  g_rng = np.random.default_rng(2)
  grads_pool = []
  for b in batches[:cfg['grad_pool']]:
    vals = jnp.asarray(g_rng.normal(size=(b.shape[0], d)).astype(np.float32))
    g = lazy_optax.SparseRows(b, vals, num_rows=cfg['rows'])
    if not sparse:
      g = jax.jit(lambda s: s.to_dense())(g)
    grads_pool.append({'table': g, 'w': jnp.ones((d,), jnp.float32)})
  t0 = time.perf_counter()
  opt = jax.jit(setup.opt_step, donate_argnums=setup.donate).lower(
      box[0], box[1], grads_pool[0]).compile()
  info['opt_compile_s'] = time.perf_counter() - t0

  def run_opt(k):
    p, s = opt(box[0], box[1], grads_pool[k % len(grads_pool)])
    jax.block_until_ready(p)
    box[0], box[1] = p, s

  steps['opt'] = run_opt
  return info, steps


# -- torch contenders ---------------------------------------------------------


def torch_model(cfg: dict, rng: np.random.Generator, device: str = 'cpu'):
  """`(emb, w, opts)`: torch's model of a contender on `device`, its
  embedding sparse with `SparseAdam` (`torch_sparse`) or dense with `Adam`."""
  import torch  # pylint: disable=g-import-not-at-top

  v, d = cfg['rows'], cfg['row']
  sparse = cfg['contender'] == 'torch_sparse'
  emb = torch.nn.Embedding(v, d, sparse=sparse).to(device)
  with torch.no_grad():
    emb.weight.copy_(torch.from_numpy(
        rng.random((v, d), dtype=np.float32) * np.float32(0.02) - 0.01))
  w = torch.nn.Parameter(torch.ones(d, device=device))
  if sparse:
    opts = [torch.optim.SparseAdam([emb.weight], lr=LR),
            torch.optim.Adam([w], lr=LR)]
  else:
    opts = [torch.optim.Adam([emb.weight, w], lr=LR)]
  return emb, w, opts


def torch_train(model: tuple, batches: list, device: str = 'cpu'):
  """`run_train(k)`: one train step of `model` on `batches[k]`, returning
  when it is done."""
  import torch  # pylint: disable=g-import-not-at-top

  emb, w, opts = model
  sync = torch.cuda.synchronize if device == 'cuda' else (lambda: None)

  def run_train(k):
    for o in opts:
      o.zero_grad(set_to_none=True)
    loss = ((emb(batches[k % len(batches)]) @ w - 1.0) ** 2).mean()
    loss.backward()
    for o in opts:
      o.step()
    sync()
  return run_train


def _torch_contender(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of a torch contender (`common.serve`'s `build`)."""
  import torch  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(cfg['threads'])
  v, d = cfg['rows'], cfg['row']
  sparse = cfg['contender'] == 'torch_sparse'
  np_batches = make_batches(cfg)
  batches = [torch.from_numpy(b.astype(np.int64)) for b in np_batches]
  info: dict = {'ids_digest': ids_digest(np_batches), 'compile_s': 0.0}
  emb, w, opts = model = torch_model(cfg, np.random.default_rng(1))
  run_train = torch_train(model, batches)
  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = time.perf_counter() - t0
  steps = {'train': run_train}
  if not cfg.get('opt', True):
    return info, steps

  g_rng = np.random.default_rng(2)
  grads_pool = []
  for b in batches[:cfg['grad_pool']]:
    vals = torch.from_numpy(g_rng.normal(size=(b.shape[0], d)).astype(
        np.float32))
    g = torch.sparse_coo_tensor(b[None], vals, (v, d))  # uncoalesced
    grads_pool.append(g if sparse else g.to_dense())
  w_grad = torch.ones(d)

  def run_opt(k):
    emb.weight.grad = grads_pool[k % len(grads_pool)]
    w.grad = w_grad
    for o in opts:
      o.step()

  steps['opt'] = run_opt
  return info, steps


def build(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of any contender of this module (`common.serve`)."""
  if cfg['contender'].startswith('torch'):
    return _torch_contender(cfg)
  return _jax_contender(cfg)


if __name__ == '__main__':
  serve(build)
