"""Dtypes: float32, bfloat16 tables with float32 moments, float64 under x64."""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import SparseRows

_BF16 = ml_dtypes.bfloat16


def _batches(seed, steps, num_rows=20, n_ids=8, dim=3):
  rng = np.random.default_rng(seed)
  for t in range(steps):
    lo = (t * num_rows) // (2 * steps)       # rows seen early go absent
    ids = rng.integers(lo, lo + num_rows // 2, n_ids)
    ids[:2] = ids[-1]
    yield ids.astype(np.int32), rng.normal(size=(n_ids, dim))


def _structs(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree,
                      is_leaf=lazy_optax.tree.is_sparse_rows)


def _optax_adam_f32_moments():
  return optax.adam(0.01, mu_dtype=jnp.float32)


@pytest.mark.parametrize('make_tx, dense_equivalent, dtype', [
    (lambda: lazy_optax.lazy_adam(0.01), None, jnp.float32),
    (lambda: lazy_optax.lazy_adam(0.01), None, jnp.bfloat16),
    (lambda: lazy_optax.lazy_adam(0.01, mu_dtype=jnp.float32,
                                  nu_dtype=jnp.float32, amsgrad=True), None,
     jnp.bfloat16),
    (lambda: lazy_optax.lazy(_optax_adam_f32_moments()),
     _optax_adam_f32_moments, jnp.bfloat16),
])
def test_state_and_update_dtypes_are_stable(make_tx, dense_equivalent, dtype):
  tx = make_tx()
  params = {'table': jnp.ones((20, 3), dtype), 'b': jnp.ones((3,), dtype)}
  state = tx.init(params)
  ids, values = next(_batches(0, 1))
  grads = {'table': SparseRows(ids, jnp.asarray(values, dtype), 20),
           'b': jnp.ones((3,), dtype)}
  updates, new_state = jax.jit(tx.update)(grads, state, params)
  assert _structs(new_state) == _structs(state)
  # lazy_adam's updates have the gradient's dtype; a wrapped optax rule gives
  # whatever dtype that rule gives on a dense gradient.
  expected = dtype
  if dense_equivalent is not None:
    dense_tx = dense_equivalent()
    expected = jax.eval_shape(
        dense_tx.update, params, dense_tx.init(params))[0]['table'].dtype
  assert updates['table'].values.dtype == expected
  assert updates['table'].ids.dtype == jnp.int32
  assert updates['table'].values.shape == (len(ids), 3)
  assert updates['b'].dtype == expected
  new_params = lazy_optax.apply_updates(params, updates)
  assert _structs(new_params) == _structs(params)

  # The state's types survive a lax.cond against "do nothing" (what
  # optax.apply_if_finite and gradient-skipping loops need).
  @jax.jit
  def maybe_update(pred, params, state, grads):
    def do(args):
      params, state, grads = args
      u, s = tx.update(grads, state, params)
      return lazy_optax.apply_updates(params, u), s
    return jax.lax.cond(pred, do, lambda args: args[:2],
                        (params, state, grads))

  for pred in (True, False):
    p, s = maybe_update(pred, params, state, grads)
    assert _structs(s) == _structs(state)
    assert _structs(p) == _structs(params)
  np.testing.assert_array_equal(p['table'], params['table'])  # pred False


def test_float32_table_matches_float64_model():
  from reference import TFLazyAdam
  rng = np.random.default_rng(1)
  table = rng.normal(size=(20, 3))
  ref = TFLazyAdam(table, lr=0.05)
  tx = lazy_optax.lazy_adam(0.05)
  params = jnp.asarray(table, jnp.float32)
  state = tx.init(params)
  for ids, values in _batches(2, 15):
    ref.step(ids, values)
    u, state = tx.update(SparseRows(ids, jnp.asarray(values, jnp.float32), 20),
                         state)
    params = lazy_optax.apply_updates(params, u)
  assert params.dtype == jnp.float32
  np.testing.assert_allclose(params, ref.p, rtol=2e-5, atol=1e-6)


def test_bfloat16_duplicates_are_summed_in_float32():
  # 1,000 copies of one id: a bfloat16 running sum stalls once the sum's
  # ulp exceeds twice each value (at 256 for 1.0); the sum must be 1000.
  tx = lazy_optax.lazy(optax.sgd(1.0))
  params = jnp.zeros((4, 2), jnp.bfloat16)
  ids = np.full(1000, 2, np.int32)
  u, _ = tx.update(SparseRows(ids, jnp.ones((1000, 2), jnp.bfloat16), 4),
                   tx.init(params))
  assert u.values.dtype == jnp.bfloat16
  np.testing.assert_array_equal(lazy_optax.apply_updates(params, u)[2],
                                [-1000, -1000])


