"""`lazy(optax.X)` against `optax.X` (its rule against optax's formulation in
float64 is in tests/test_conformance.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import optax_adam_rows

import lazy_optax
from lazy_optax import SparseRows

_EVERY_ROW = {
    'adam': lambda: optax.adam(0.05),
    'adamw': lambda: optax.adamw(0.05, weight_decay=0.1),
    'sgd_momentum': lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    'adagrad': lambda: optax.adagrad(0.1),
    'rmsprop': lambda: optax.rmsprop(0.01, momentum=0.5, centered=True),
    'clip_adamw': lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                      optax.adamw(0.05, weight_decay=0.1)),
}


@pytest.mark.parametrize('name', sorted(_EVERY_ROW))
def test_every_row_touched_lazy_equals_optax(name):
  rng = np.random.default_rng(1)
  num_rows = 6
  params = {'table': jnp.asarray(rng.normal(size=(num_rows, 4)), jnp.float32),
            'bias': jnp.asarray(rng.normal(size=(4,)), jnp.float32)}
  lazy_tx, dense_tx = lazy_optax.lazy(_EVERY_ROW[name]()), _EVERY_ROW[name]()
  p_l, p_d = params, params
  s_l, s_d = lazy_tx.init(params), dense_tx.init(params)
  for _ in range(3):
    # Every row at least once, in shuffled order, some rows twice.
    ids = np.concatenate([rng.permutation(num_rows),
                          rng.integers(0, num_rows, 3)])
    values = rng.normal(size=(ids.size, 4))
    dense = np.zeros((num_rows, 4))
    np.add.at(dense, ids, values)
    bias_g = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    u_l, s_l = lazy_tx.update(
        {'table': SparseRows(ids, jnp.asarray(values, jnp.float32), num_rows),
         'bias': bias_g}, s_l, p_l)
    u_d, s_d = dense_tx.update(
        {'table': jnp.asarray(dense, jnp.float32), 'bias': bias_g}, s_d, p_d)
    assert isinstance(u_l['table'], SparseRows)
    p_l = lazy_optax.apply_updates(p_l, u_l)
    p_d = optax.apply_updates(p_d, u_d)
  for a, b in zip(jax.tree.leaves((p_l, s_l)), jax.tree.leaves((p_d, s_d))):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_lazy_clip_by_global_norm_uses_the_summed_gradient_norm():
  # Inside lazy(...), the global norm is that of the deduplicated rows, which
  # equals the norm of the dense gradient (duplicates summed).
  rng = np.random.default_rng(2)
  ids = np.array([3, 1, 3, 3, 7])
  values = rng.normal(size=(5, 2))
  dense = np.zeros((9, 2))
  np.add.at(dense, ids, values)
  tx = lazy_optax.lazy(optax.clip_by_global_norm(0.1))
  updates, _ = tx.update(SparseRows(ids, jnp.asarray(values, jnp.float32), 9),
                         tx.init(jnp.zeros((9, 2))))
  np.testing.assert_allclose(updates.to_dense(),
                             dense * 0.1 / np.linalg.norm(dense), rtol=1e-5)


def _dense_grads_with_zero_rows(rng, num_rows, steps):
  for t in range(steps):
    g = rng.normal(size=(num_rows, 3))
    lo = (t * num_rows) // (2 * steps)
    keep = np.zeros(num_rows, bool)
    keep[rng.integers(lo, lo + num_rows // 3, 5)] = True
    g[~keep] = 0.0
    yield g


@pytest.mark.parametrize('jit', [False, True])
def test_skip_zero_rows_leaves_zero_rows_untouched(jit):
  rng = np.random.default_rng(3)
  num_rows, lr = 30, 0.05
  table = rng.normal(size=(num_rows, 3))
  tx = lazy_optax.lazy(optax.adam(lr), skip_zero_rows=True)
  params = jnp.asarray(table, jnp.float32)
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  p, m, v = table.copy(), np.zeros_like(table), np.zeros_like(table)
  for t, g in enumerate(_dense_grads_with_zero_rows(rng, num_rows, 12), 1):
    rows = np.flatnonzero(np.any(g != 0, axis=1))
    p[rows], m[rows], v[rows] = optax_adam_rows(
        p[rows], m[rows], v[rows], t, g[rows], lr=lr)
    old = (params, state)
    updates, state = update(jnp.asarray(g, jnp.float32), state)
    params = lazy_optax.apply_updates(params, updates)
    # Rows with an all-zero gradient: bit-for-bit unchanged, state included.
    zero = np.all(g == 0, axis=1)
    for new_leaf, old_leaf in zip(jax.tree.leaves((params, state[0].mu,
                                                   state[0].nu)),
                                  jax.tree.leaves((old[0], old[1][0].mu,
                                                   old[1][0].nu))):
      np.testing.assert_array_equal(np.asarray(new_leaf)[zero],
                                    np.asarray(old_leaf)[zero])
  assert int(state[0].count) == 12
  np.testing.assert_allclose(params, p, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state[0].nu, v, rtol=1e-5, atol=1e-9)


def test_skip_zero_rows_around_lazy_adam_is_the_tf_rule():
  from reference import TFLazyAdam
  rng = np.random.default_rng(4)
  table = rng.normal(size=(30, 3))
  ref = TFLazyAdam(table, lr=0.05)
  tx = lazy_optax.lazy(lazy_optax.lazy_adam(0.05), skip_zero_rows=True)
  params = jnp.asarray(table, jnp.float32)
  state = tx.init(params)
  for g in _dense_grads_with_zero_rows(rng, 30, 10):
    rows = np.flatnonzero(np.any(g != 0, axis=1))
    ref.step(rows, g[rows])
    updates, state = tx.update(jnp.asarray(g, jnp.float32), state)
    params = lazy_optax.apply_updates(params, updates)
  np.testing.assert_allclose(params, ref.p, rtol=2e-5, atol=1e-6)


def test_skip_zero_rows_caveat_a_touched_row_with_zero_gradient_is_skipped():
  # Row 1 was looked up but its gradient happens to be exactly zero: dense
  # Adam decays its moments and keeps moving it; skip_zero_rows leaves it.
  params = jnp.ones((3, 2))
  first = jnp.ones((3, 2))
  second = jnp.array([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
  lazy_tx = lazy_optax.lazy(optax.adam(0.1), skip_zero_rows=True)
  dense_tx = optax.adam(0.1)
  out = {}
  for name, tx in (('lazy', lazy_tx), ('dense', dense_tx)):
    p, s = params, tx.init(params)
    for g in (first, second):
      u, s = tx.update(g, s)
      p = optax.apply_updates(p, u)
    out[name] = (p, s[0].mu)
  after_first = 1.0 - 0.1
  np.testing.assert_allclose(out['lazy'][0][1], [after_first] * 2, rtol=1e-6)
  np.testing.assert_allclose(out['lazy'][1][1], [0.1, 0.1], rtol=1e-6)
  np.testing.assert_allclose(out['dense'][1][1], [0.09, 0.09], rtol=1e-6)
  assert np.all(out['dense'][0][1] < after_first)
  np.testing.assert_allclose(out['lazy'][0][0], out['dense'][0][0], rtol=1e-6)
