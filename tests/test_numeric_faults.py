"""A bad batch must not silently corrupt a table: NaN, Inf, overflow."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import SparseRows
from reference import TFLazyAdam, optax_adam_rows

INT32_MAX = np.iinfo(np.int32).max
NUM_ROWS = 12


def _table(seed):
  return np.random.default_rng(seed).normal(size=(NUM_ROWS, 3))


def _optimizers():
  return {
      'lazy_adam': lambda: lazy_optax.lazy_adam(0.1),
      'lazy_adamw': lambda: lazy_optax.lazy_adamw(0.1, weight_decay=0.1),
      'amsgrad': lambda: lazy_optax.lazy_adam(0.1, amsgrad=True),
      'lazy(adam)': lambda: lazy_optax.lazy(optax.adam(0.1)),
      'lazy(sgd+momentum)': lambda: lazy_optax.lazy(
          optax.sgd(0.1, momentum=0.9)),
      'lazy(rmsprop)': lambda: lazy_optax.lazy(optax.rmsprop(0.1)),
  }


def _row_state_leaves(state, num_rows=NUM_ROWS):
  return [np.asarray(x) for x in jax.tree.leaves(state)
          if np.ndim(x) >= 1 and np.shape(x)[0] == num_rows]


def _stepper(tx):
  """One jitted train step for `tx` (compiled once per batch shape)."""
  @jax.jit
  def step(params, state, ids, values):
    g = {'t': SparseRows(ids, values, NUM_ROWS)}
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  return lambda params, state, ids, values: step(
      params, state, jnp.asarray(ids, jnp.int32), jnp.asarray(values))


# -- a NaN or an Inf in one row -----------------------------------------------

@pytest.mark.parametrize('name', list(_optimizers()))
def test_non_finite_gradient_row_changes_that_row_only(name):
  table = _table(1)
  tx = _optimizers()[name]()
  step = _stepper(tx)
  params = {'t': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  # A clean step first, so the state rows hold something.
  params, state = step(params, state, [0, 2, 5, 7, 9, 11], np.ones((6, 3)))
  before_p, before_s = np.asarray(params['t']), _row_state_leaves(state)
  ids = [2, 5, 9, 5, 11, 6]
  values = np.full((6, 3), 0.5, np.float32)
  values[1, 1] = np.nan   # row 5, which is twice in the batch
  values[2, 0] = np.inf   # row 9
  values[4, 2] = -np.inf  # row 11
  params, state = step(params, state, ids, values)
  after_p, after_s = np.asarray(params['t']), _row_state_leaves(state)
  untouched = [r for r in range(NUM_ROWS) if r not in ids]
  for old, new in zip([before_p, *before_s], [after_p, *after_s]):
    np.testing.assert_array_equal(new[untouched], old[untouched])
  # The clean touched rows moved and stayed finite; the faulty rows hold
  # their fault.
  for r in (2, 6):
    assert np.all(np.isfinite(after_p[r]))
    assert not np.array_equal(after_p[r], before_p[r])
  for r in (5, 9, 11):
    assert not np.all(np.isfinite(after_p[r]))


def test_non_finite_row_leaves_clean_rows_on_the_float64_rule():
  table = _table(2)
  ref = TFLazyAdam(table, lr=0.1)
  tx = lazy_optax.lazy_adam(0.1)
  step = _stepper(tx)
  params = {'t': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  rng = np.random.default_rng(3)
  for t in range(4):
    ids = rng.integers(0, NUM_ROWS, 6)
    values = rng.normal(size=(6, 3))
    if t == 2:
      values[0, 0] = np.nan
    ref.step(ids, values)
    params, state = step(params, state, ids, values.astype(np.float32))
  clean = np.all(np.isfinite(ref.p), axis=1)
  assert 0 < clean.sum() < NUM_ROWS
  np.testing.assert_allclose(np.asarray(params['t'])[clean], ref.p[clean],
                             rtol=2e-5, atol=1e-6)
  np.testing.assert_array_equal(np.isfinite(np.asarray(params['t'])),
                                np.isfinite(ref.p))


@pytest.mark.parametrize('name', ['lazy_adam', 'amsgrad', 'lazy(adam)',
                                  'lazy(sgd+momentum)'])
def test_apply_if_finite_skips_the_whole_step(name):
  table = _table(4)
  tx = optax.apply_if_finite(_optimizers()[name](), max_consecutive_errors=3)
  step = _stepper(tx)
  params = {'t': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  params, state = step(params, state, [1, 3, 3, 8], np.ones((4, 3)))
  before_p = np.asarray(params['t'])
  before_s = [np.asarray(x) for x in jax.tree.leaves(state.inner_state)]
  for k, bad in enumerate([np.nan, np.inf, -np.inf]):
    values = np.ones((4, 3), np.float32)
    values[2, 0] = bad
    params, state = step(params, state, [1, 4, 6, 1], values)
    np.testing.assert_array_equal(params['t'], before_p)
    for old, new in zip(before_s, jax.tree.leaves(state.inner_state)):
      np.testing.assert_array_equal(new, old)
    assert int(state.notfinite_count) == k + 1
    assert not bool(state.last_finite)
  # The next finite step goes through and advances the count once.
  params, state = step(params, state, [4, 4, 4, 4], np.ones((4, 3)))
  assert not np.array_equal(np.asarray(params['t'])[4], before_p[4])
  assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 3
  counts = [int(c) for _, c in
            optax.tree_utils.tree_get_all_with_path(state.inner_state, 'count')]
  assert counts in ([], [2])


# -- the step count saturates -------------------------------------------------

@pytest.mark.parametrize('name', ['lazy_adam', 'lazy(adam)'])
def test_count_saturates_at_int32_max(name):
  table = _table(5)
  tx = _optimizers()[name]()
  params = {'t': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  state = optax.tree_utils.tree_set(
      state, count=jnp.asarray(INT32_MAX - 1, jnp.int32))
  step = _stepper(tx)
  p64 = table.copy()
  m, v = np.zeros_like(p64), np.zeros_like(p64)
  for _ in range(3):
    params, state = step(params, state, [3], np.ones((1, 3)))
    count = optax.tree_utils.tree_get(state, 'count')
    assert count.dtype == jnp.int32
    assert int(count) == INT32_MAX
    # At t = 2**31 - 1 both bias corrections are 1: plain moment ratios.
    row, m[3], v[3] = optax_adam_rows(p64[3], m[3], v[3], float(INT32_MAX),
                                      np.ones(3), lr=0.1, eps=1e-8)
    if name == 'lazy(adam)':
      p64[3] = row
    else:
      p64[3] = p64[3] - 0.1 * m[3] / (np.sqrt(v[3]) + 1e-8)
  assert np.all(np.isfinite(np.asarray(params['t'])))
  np.testing.assert_allclose(params['t'], p64, rtol=1e-5, atol=1e-6)


# -- very large and very small gradients --------------------------------------

@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_extreme_gradients_give_finite_updates_like_optax_adam(dtype):
  table = _table(6)
  params = {'t': jnp.asarray(table, dtype)}
  signs = np.array([[1.0], [-1.0]])
  ids = jnp.array([2, 7])
  dense = optax.adam(0.1)
  d_update = jax.jit(dense.update)
  # Densified and added in jitted programs (eagerly, decoding the ids is
  # many small ops).
  to_dense = jax.jit(SparseRows.to_dense)
  apply = jax.jit(lazy_optax.apply_updates)
  for name, tx in [('lazy_adam', lazy_optax.lazy_adam(0.1)),
                   ('amsgrad', lazy_optax.lazy_adam(0.1, amsgrad=True)),
                   ('lazy(adam)', lazy_optax.lazy(optax.adam(0.1)))]:
    update = jax.jit(tx.update)
    for magnitude in (1e30, 1e-30):
      values = jnp.asarray(np.full((2, 3), magnitude) * signs, dtype)
      g_sparse = {'t': SparseRows(ids, values, NUM_ROWS)}
      g_dense = {'t': to_dense(g_sparse['t'])}
      state, d_state = tx.init(params), dense.init(params)
      for _ in range(3):
        u, state = update(g_sparse, state, params)
        du, d_state = d_update(g_dense, d_state, params)
        rows = np.asarray(u['t'].values, np.float32)
        assert np.all(np.isfinite(rows)), (name, magnitude)
        # Adam's step is bounded by lr (times its bias correction) and
        # opposes the gradient's sign.
        assert np.all(np.abs(rows) <= 0.1 * 1.01), (name, magnitude)
        assert np.all(rows * signs <= 0), (name, magnitude)
        if name == 'lazy(adam)':
          np.testing.assert_array_equal(
              rows, np.asarray(du['t'], np.float32)[[2, 7]])
        new = apply(params, u)['t']
        assert new.dtype == dtype
        assert np.all(np.isfinite(np.asarray(new, np.float32)))
      if magnitude < 1:
        # Tiny gradients are not lost: the last step follows the float64 rule.
        g64 = np.full((2, 3), magnitude) * signs
        np.testing.assert_allclose(
            rows, _last_step_reference(name, g64),
            rtol=2e-2 if dtype == jnp.bfloat16 else 1e-4)
      else:
        # After an overflowing gradient (nu is inf, as in optax.adam) an
        # ordinary one still gives a finite update.
        g = {'t': SparseRows(ids, jnp.ones((2, 3), dtype), NUM_ROWS)}
        u, _ = update(g, state, params)
        assert np.all(np.isfinite(np.asarray(u['t'].values, np.float32)))


def _last_step_reference(name, g):
  """The third update of a constant gradient `g`, in float64."""
  if name == 'lazy(adam)':
    p, m, v = np.zeros_like(g), np.zeros_like(g), np.zeros_like(g)
    for t in range(1, 4):
      new_p, m, v = optax_adam_rows(p, m, v, t, g, lr=0.1)
      step, p = new_p - p, new_p
    return step
  ref = TFLazyAdam(np.zeros_like(g), lr=0.1)
  for _ in range(3):
    before = ref.p.copy()
    ref.step(np.arange(g.shape[0]), g)
  return ref.p - before
