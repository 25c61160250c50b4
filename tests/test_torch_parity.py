"""`lazy_adam` against `torch.optim.SparseAdam` on `nn.Embedding(sparse=True)`.

How the two rules map onto each other. torch's `SparseAdam.step` (see
`torch.optim._functional.sparse_adam`) coalesces the sparse gradient (sums
duplicate ids), then for the touched rows only:

    m <- m + (1 - b1) * (g - m)          # = b1 * m + (1 - b1) * g
    v <- v + (1 - b2) * (g * g - v)      # = b2 * v + (1 - b2) * g * g
    step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)
    p <- p - step_size * m / (sqrt(v) + eps)

with `t` the parameter's step, which advances on every `step()` whether or
not a given row was touched. That is `lazy_adam`'s rule term for term:
"epsilon hat" (eps added to `sqrt(v)`, bias correction in the step size),
a global step, duplicates summed first, untouched rows left alone. The only
differences are float32 rounding order (`m + (1-b1)(g-m)` against
`b1 m + (1-b1) g`; torch's `b^t` in float64 against `1 - b^t` from
`expm1`/`log1p` in float32), so the two agree to float32 accuracy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import SparseRows
from reference import TFLazyAdam

# Every test here runs on one pytest-xdist worker, with test_bags.py's torch
# tests: torch is imported by them (about 3 CPU s), not at collection by
# every worker.
pytestmark = pytest.mark.xdist_group('torch')


def _torch():
  """The torch module, imported on first use."""
  import torch  # pylint: disable=import-outside-toplevel
  return torch

_NUM_ROWS, _DIM, _STEPS, _IDS = 64, 4, 40, 24


def _batches(seed):
  rng = np.random.default_rng(seed)
  for t in range(_STEPS):
    lo = (t * _NUM_ROWS) // (2 * _STEPS)     # rows seen early go absent
    ids = rng.integers(lo, lo + _NUM_ROWS // 3, _IDS)
    ids[: _IDS // 3] = ids[-1]               # heavy duplicates
    yield ids, rng.normal(size=(_IDS, _DIM))


def _run_torch(table, batches, dtype, lr, eps):
  torch = _torch()
  dtype = getattr(torch, dtype)
  emb = torch.nn.Embedding(_NUM_ROWS, _DIM, sparse=True).to(dtype)
  with torch.no_grad():
    emb.weight.copy_(torch.as_tensor(table, dtype=dtype))
  opt = torch.optim.SparseAdam(emb.parameters(), lr=lr, eps=eps)
  for ids, values in batches:
    opt.zero_grad()
    out = emb(torch.as_tensor(ids))
    (out * torch.as_tensor(values, dtype=dtype)).sum().backward()
    grad = emb.weight.grad
    assert grad.is_sparse and not grad.is_coalesced()  # duplicates inside
    opt.step()
  state = opt.state[emb.weight]
  return (emb.weight.detach().numpy(), state['exp_avg'].numpy(),
          state['exp_avg_sq'].numpy())


def _run_lazy(table, batches, lr, eps):
  tx = lazy_optax.lazy_adam(lr, eps=eps)
  params = jnp.asarray(table, jnp.float32)
  state = tx.init(params)

  @jax.jit
  def step(params, state, ids, values):
    updates, state = tx.update(SparseRows(ids, values, _NUM_ROWS), state)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values in batches:
    params, state = step(params, state, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(values, jnp.float32))
  return (np.asarray(params), np.asarray(optax.tree_utils.tree_get(state, 'mu')),
          np.asarray(optax.tree_utils.tree_get(state, 'nu')))


def _max_rel_err(a, b, floor):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), floor)))


@pytest.mark.parametrize('eps', [1e-8, 1e-3])
def test_lazy_adam_matches_torch_sparse_adam(eps):
  lr = 0.01
  table = np.random.default_rng(100).normal(size=(_NUM_ROWS, _DIM))
  batches = list(_batches(0))
  torch_p, torch_m, torch_v = _run_torch(table, batches, 'float32', lr, eps)
  lazy_p, lazy_m, lazy_v = _run_lazy(table, batches, lr, eps)
  err_p = _max_rel_err(lazy_p, torch_p, 1e-2)
  err_m = _max_rel_err(lazy_m, torch_m, 1e-3)
  err_v = _max_rel_err(lazy_v, torch_v, 1e-4)
  print(f'\nlazy_adam vs torch SparseAdam (eps={eps}), max relative error: '
        f'params {err_p:.2e}, exp_avg {err_m:.2e}, exp_avg_sq {err_v:.2e}')
  # float32 on both sides over 40 steps: a few float32 ulps per step.
  assert err_p < 2e-5 and err_m < 2e-5 and err_v < 2e-5
  # Rows never touched are bit-for-bit the initial table on both sides.
  never = np.flatnonzero(np.all(torch_v == 0, axis=1))
  assert never.size
  np.testing.assert_array_equal(lazy_p[never], table[never].astype(np.float32))
  np.testing.assert_array_equal(torch_p[never], lazy_p[never])


def test_torch_sparse_adam_in_float64_is_the_tf_rule():
  """Checks the mapping above: torch in float64 against the numpy model."""
  lr, eps = 0.01, 1e-8
  table = np.random.default_rng(101).normal(size=(_NUM_ROWS, _DIM))
  batches = list(_batches(1))
  torch_p, torch_m, torch_v = _run_torch(table, batches, 'float64', lr, eps)
  ref = TFLazyAdam(table, lr=lr, eps=eps)
  for ids, values in batches:
    ref.step(ids, values)
  np.testing.assert_allclose(torch_p, ref.p, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(torch_m, ref.m, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(torch_v, ref.v, rtol=1e-12, atol=1e-15)
