"""Low-precision tables with float32 moments, float64 under x64, and memory."""

import textwrap

import fork_server
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from reference import TFLazyAdam

NUM_ROWS, D, LR = 30, 4, 0.1


def _batches(seed, steps=4, n_ids=10):
  """Distinct ids but for one pair (a pair's sum rounds once in any dtype)."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = rng.choice(NUM_ROWS, n_ids, replace=False).astype(np.int32)
    ids[2] = ids[0]
    yield ids, rng.normal(size=(n_ids, D))


def _summed_in(dtype, ids, values):
  """Duplicates summed exactly, then rounded to the gradient's dtype."""
  unique = np.unique(ids)
  summed = np.stack([values[ids == i].sum(0) for i in unique])
  return unique, summed.astype(dtype).astype(np.float64)


def _step_fn(tx):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, updates
  return jax.jit(step, donate_argnums=(0, 1))


def _dtypes(tree):
  return [x.dtype for x in jax.tree.leaves(tree)]


class _RoundedTFAdam(TFLazyAdam):
  """The float64 model with the table stored in a low-precision dtype."""

  def __init__(self, table, dtype, **kw):
    super().__init__(table, **kw)
    self.dtype = dtype

  def step(self, ids, values):
    rows = super().step(ids, values)
    self.p = self.p.astype(self.dtype).astype(np.float64)
    return rows


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_low_precision_table_with_float32_moments(dtype):
  rng = np.random.default_rng(0)
  table = np.asarray(rng.uniform(0.5, 2.0, (NUM_ROWS, D)), dtype)
  tx = lazy_optax.lazy_adam(LR, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  params = {'table': jnp.asarray(table)}
  state = tx.init(params)
  state_dtypes = _dtypes(state)
  mu = optax.tree_utils.tree_get(state, 'mu')['table']
  nu = optax.tree_utils.tree_get(state, 'nu')['table']
  assert (mu.dtype, nu.dtype) == (jnp.float32, jnp.float32)

  ref = _RoundedTFAdam(table.astype(np.float64), dtype, lr=LR)
  step = _step_fn(tx)
  for ids, values in _batches(1):
    values = np.asarray(values, dtype)  # gradients arrive in the table dtype
    params, state, updates = step(params, state, ids, values)
    ref.step(*_summed_in(dtype, ids, values.astype(np.float64)))
    assert params['table'].dtype == dtype
    assert updates['table'].values.dtype == dtype
    assert _dtypes(state) == state_dtypes

  mu = optax.tree_utils.tree_get(state, 'mu')['table']
  nu = optax.tree_utils.tree_get(state, 'nu')['table']
  # Moments see the exact low-precision gradients and are kept in float32.
  np.testing.assert_allclose(mu, ref.m, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(nu, ref.v, rtol=1e-6, atol=1e-8)
  # The table moves by up to ~4 * LR; it agrees to about an ulp of its dtype.
  ulp = float(jnp.finfo(dtype).eps)
  got = np.asarray(params['table'], np.float64)
  np.testing.assert_allclose(got, ref.p, rtol=2 * ulp, atol=ulp)
  assert np.abs(got - table.astype(np.float64)).max() > 10 * ulp


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16])
def test_low_precision_dtypes_stable_in_optax_formulation(dtype):
  dense_tx = optax.adam(LR, mu_dtype=jnp.float32)
  tx = lazy_optax.lazy(dense_tx)
  params = {'table': jnp.ones((NUM_ROWS, D), dtype)}
  state = tx.init(params)
  expected = _dtypes(state)
  assert optax.tree_utils.tree_get(state, 'mu')['table'].dtype == jnp.float32
  # Updates have the dtype that optax.adam gives a dense gradient.
  dense_updates, _ = jax.jit(dense_tx.update)(  # one program, not op by op
      {'table': jnp.ones((NUM_ROWS, D), dtype)}, dense_tx.init(params))
  step = _step_fn(tx)
  for ids, values in _batches(2):
    params, state, updates = step(params, state, ids,
                                  np.asarray(values, dtype))
    assert _dtypes(state) == expected
    assert params['table'].dtype == dtype
    assert updates['table'].values.dtype == dense_updates['table'].dtype


def test_default_moment_dtype_follows_table():
  tx = lazy_optax.lazy_adam(LR)
  params = {'table': jnp.ones((NUM_ROWS, D), jnp.bfloat16)}
  state = tx.init(params)
  assert set(_dtypes(optax.tree_utils.tree_get(state, 'mu'))) == {
      jnp.dtype(jnp.bfloat16)}
  step = _step_fn(tx)
  for ids, values in _batches(3, steps=2):
    params, state, _ = step(params, state, ids,
                            np.asarray(values, jnp.bfloat16))
  assert _dtypes(state) == _dtypes(tx.init(params))
  tx = lazy_optax.lazy_adam(LR, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  state = tx.init(params)
  for name in ('mu', 'nu'):
    assert optax.tree_utils.tree_get(state, name)['table'].dtype == jnp.float32


# Run in a process forked from one that imported jax and lazy_optax and
# computed nothing (tests/fork_server.py): x64 is switched on before the
# first array, as JAX_ENABLE_X64=1 at start-up does.
_X64_SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update('jax_enable_x64', True)
    assert jax.config.jax_enable_x64
    import lazy_optax
    from reference import TFLazyAdam  # tests/ is on PYTHONPATH (conftest.py)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(30, 4))
    tx = lazy_optax.lazy_adam(0.1)
    def step(params, state, ids, values):
      g = {'t64': lazy_optax.SparseRows(ids, values, 30),
           't32': lazy_optax.SparseRows(ids, values.astype(jnp.float32), 30)}
      updates, state = tx.update(g, state, params)
      return lazy_optax.apply_updates(params, updates), state, updates
    step = jax.jit(step, donate_argnums=(0, 1))
    params = {'t64': jnp.asarray(table), 't32': jnp.asarray(table, jnp.float32)}
    state = tx.init(params)
    dtypes = [x.dtype for x in jax.tree.leaves(state)]
    ref = TFLazyAdam(table, lr=0.1)
    for _ in range(5):
      ids = rng.integers(0, 30, 12)
      values = rng.normal(size=(12, 4))
      params, state, updates = step(params, state, ids, values)
      ref.step(ids, values)
      assert [x.dtype for x in jax.tree.leaves(state)] == dtypes
      assert updates['t64'].values.dtype == jnp.float64
      assert updates['t32'].values.dtype == jnp.float32
    assert params['t64'].dtype == jnp.float64
    assert params['t32'].dtype == jnp.float32
    np.testing.assert_allclose(params['t64'], ref.p, rtol=1e-12, atol=1e-14)
    mu = state[0].mu['t64']
    assert mu.dtype == jnp.float64
    np.testing.assert_allclose(mu, ref.m, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(params['t32'], ref.p, rtol=2e-5, atol=1e-6)
    print('ok')
''')


# What the server imports before forking (the other tests' fork servers of
# one device import the same: one server per pytest process serves them all).
_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')


def test_float64_under_x64():
  (proc,) = fork_server.run_scripts([_X64_SCRIPT], {'JAX_ENABLE_X64': '1'},
                                    preloaded=_PRELOADED)
  assert proc.returncode == 0 and proc.stdout.strip() == 'ok', (
      proc.stdout[-2000:] + proc.stderr[-4000:])


def _compiled_step(num_rows, n_ids, row_size=64):
  tx = lazy_optax.lazy_adam(1e-3)
  params = {'table': jax.ShapeDtypeStruct((num_rows, row_size), jnp.float32)}
  state = jax.eval_shape(tx.init, params)

  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  ids = jax.ShapeDtypeStruct((n_ids,), jnp.int32)
  values = jax.ShapeDtypeStruct((n_ids, row_size), jnp.float32)
  return jax.jit(step, donate_argnums=(0, 1)).lower(
      params, state, ids, values).compile().memory_analysis()


def test_compiled_temporaries_grow_with_batch_not_table():
  small, big = 50_000, 400_000
  mem = {(v, n): _compiled_step(v, n) for v in (small, big)
         for n in (256, 2048)}
  for n in (256, 2048):
    assert (mem[(small, n)].temp_size_in_bytes
            == mem[(big, n)].temp_size_in_bytes)
  batch_bytes = 2048 * 64 * 4
  assert (mem[(small, 2048)].temp_size_in_bytes
          > 4 * mem[(small, 256)].temp_size_in_bytes)
  # A few row blocks of the batch, far from one table (400,000 x 64 x 4 B).
  assert mem[(big, 2048)].temp_size_in_bytes < 16 * batch_bytes
  assert mem[(big, 2048)].temp_size_in_bytes < big * 64 * 4 // 10
  # Table, mu and nu are updated in place: their buffers alias the outputs.
  for v in (small, big):
    assert mem[(v, 256)].alias_size_in_bytes >= 3 * v * 64 * 4
