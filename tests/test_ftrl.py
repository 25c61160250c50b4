"""ftrl against a float64 model of TensorFlow's ApplyFtrlV2 and Keras' beta."""

import jax.numpy as jnp
from lean_common import assert_checkpoint_resumes
from lean_common import assert_state_shardings_follow_rows
from lean_common import batches
from lean_common import count_of
from lean_common import run_partitioned
from lean_common import run
from lean_common import run_dense
from lean_common import untouched
from lean_reference import Ftrl
from lean_sharded_checks import run_checks
import numpy as np
import optax
import pytest

import lazy_optax

NUM_ROWS, D = 40, 3

CONFIGS = {
    'defaults': {},
    'l1_l2_shrinkage_beta': dict(l1=0.05, l2=0.1, l2_shrinkage=0.2, beta=0.5),
    'power_-0.3': dict(lr_power=-0.3, l1=0.01),
    'fixed_rate': dict(lr_power=0.0, initial_accumulator_value=0.0, l2=0.1),
}


def _tx(lr=0.1, lr_power=-0.5, **kw):
  return lazy_optax.ftrl(lr, learning_rate_power=lr_power, **kw)


def _state(state):
  return (np.asarray(lazy_optax.compat.get_slot(state, 'table', 'accumulator')),
          np.asarray(lazy_optax.compat.get_slot(state, 'table', 'linear')))


@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('config', list(CONFIGS))
def test_matches_float64_model(jit, config):
  kw = CONFIGS[config]
  rng = np.random.default_rng(0)
  table = 0.1 * rng.normal(size=(NUM_ROWS, D))
  data = batches(1, NUM_ROWS, (D,), steps=12, n_ids=16)
  ref = Ftrl(table, lr=0.1, **kw)
  for ids, values in data:
    ref.step(ids, values)
  params, state = run(_tx(0.1, **kw), table, data, jit=jit)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)
  n, z = _state(state)
  np.testing.assert_allclose(n, ref.n, rtol=1e-6)
  np.testing.assert_allclose(z, ref.z, rtol=1e-5, atol=1e-6)
  assert count_of(state) == 12
  rows = untouched(data, NUM_ROWS)
  assert rows.size > 5
  np.testing.assert_array_equal(np.asarray(params['table'])[rows],
                                table.astype(np.float32)[rows])
  init = CONFIGS[config].get('initial_accumulator_value', 0.1)
  np.testing.assert_array_equal(n[rows], np.float32(init))
  assert np.all(z[rows] == 0)


def test_l1_gives_exact_zeros():
  rng = np.random.default_rng(2)
  data = batches(3, NUM_ROWS, (D,), steps=10, n_ids=16)
  params, _ = run(_tx(0.1, l1=1.0), np.zeros((NUM_ROWS, D)), data)
  table = np.asarray(params['table'])
  ref = Ftrl(np.zeros((NUM_ROWS, D)), lr=0.1, l1=1.0)
  for ids, values in data:
    ref.step(ids, values)
  assert np.sum(table == 0) == np.sum(ref.p == 0) > NUM_ROWS * D // 2
  assert np.sum(table != 0) > 0
  del rng


def test_dense_gradient_is_the_dense_rule():
  rng = np.random.default_rng(4)
  table = np.zeros((6, 4))
  grads = [rng.normal(size=(6, 4)) for _ in range(5)]
  kw = CONFIGS['l1_l2_shrinkage_beta']
  ref = Ftrl(table, lr=0.1, **kw)
  for g in grads:
    ref.step(np.arange(6), g)
  params, state = run_dense(_tx(0.1, **kw), table, grads)
  np.testing.assert_allclose(params, ref.p, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(optax.tree_utils.tree_get(state, 'linear'), ref.z,
                             rtol=1e-5, atol=1e-6)


def test_every_row_touched_once_equals_dense():
  rng = np.random.default_rng(5)
  table = jnp.asarray(0.1 * rng.normal(size=(8, 5)), jnp.float32)
  tx = _tx(0.1, l1=0.01, l2_shrinkage=0.1)
  p_l, p_d = table, table
  s_l, s_d = tx.init(table), tx.init(table)
  for _ in range(4):
    perm = rng.permutation(8)
    g = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    u_l, s_l = tx.update(lazy_optax.SparseRows(perm, g[perm], 8), s_l, p_l)
    u_d, s_d = tx.update(g, s_d, p_d)
    p_l = lazy_optax.apply_updates(p_l, u_l)
    p_d = lazy_optax.apply_updates(p_d, u_d)
  np.testing.assert_allclose(p_l, p_d, rtol=1e-6, atol=1e-7)


def test_schedule():
  rng = np.random.default_rng(6)
  table = 0.1 * rng.normal(size=(NUM_ROWS, D))
  data = batches(7, NUM_ROWS, (D,), steps=5, n_ids=8)
  schedule = optax.linear_schedule(0.2, 0.05, 4)
  ref = Ftrl(table, beta=0.3)
  for t, (ids, values) in enumerate(data):
    ref.step(ids, values, lr=float(schedule(t)))
  params, _ = run(lazy_optax.ftrl(schedule, beta=0.3), table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)


def test_dtypes():
  rng = np.random.default_rng(8)
  table = 0.1 * rng.normal(size=(NUM_ROWS, D))
  data = batches(9, NUM_ROWS, (D,), steps=6, n_ids=16)
  ref = Ftrl(table, lr=0.1)
  for ids, values in data:
    ref.step(ids, values)
  params, state = run(_tx(0.1, accumulator_dtype=jnp.float32,
                          linear_dtype=jnp.float32),
                      table, data, dtype=jnp.bfloat16)
  n, z = _state(state)
  assert params['table'].dtype == jnp.bfloat16
  assert n.dtype == np.float32 and z.dtype == np.float32
  np.testing.assert_allclose(np.asarray(params['table'], np.float32), ref.p,
                             atol=1e-2)
  params, state = run(_tx(0.1, accumulator_dtype=jnp.bfloat16,
                          linear_dtype=jnp.bfloat16), table, data)
  n, z = _state(state)
  assert params['table'].dtype == jnp.float32
  assert n.dtype == jnp.bfloat16 and z.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(params['table']), ref.p, atol=1e-2)


def test_in_chain_and_partition():
  rng = np.random.default_rng(10)
  table = 0.1 * rng.normal(size=(NUM_ROWS, D))
  data = batches(11, NUM_ROWS, (D,), steps=6, n_ids=16)
  ref = Ftrl(table, lr=0.1, l1=0.01)
  for ids, values in data:
    ref.step(ids, values)
  chained = lazy_optax.lazy(optax.chain(
      optax.clip_by_global_norm(1e6), lazy_optax.ftrl(0.1, l1=0.01)))
  params, _ = run(chained, table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)

  params, state = run_partitioned(lazy_optax.ftrl(0.1, l1=0.01), table,
                                  data, NUM_ROWS)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)


def test_slots_shardings_and_checkpoint(tmp_path):
  tx = lazy_optax.ftrl(0.1, l1=0.01, l2_shrinkage=0.1)
  params = {'table': jnp.zeros((NUM_ROWS, D))}
  assert lazy_optax.compat.get_slot_names(tx.init(params), params) == [
      'accumulator', 'linear']
  assert_state_shardings_follow_rows(tx, ['accumulator', 'linear'])
  data = batches(12, NUM_ROWS, (D,), steps=6, n_ids=12)
  assert_checkpoint_resumes(tx, data, tmp_path)


def test_sharded_on_8_devices(tmp_path):
  out = run_checks('ftrl', tmp_path)
  assert out['slots'] == ['accumulator', 'linear']


def test_errors():
  tx = lazy_optax.ftrl(0.1)
  params = {'table': jnp.zeros((5, 2))}
  g = {'table': lazy_optax.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 5)}
  with pytest.raises(ValueError, match='needs the current params'):
    tx.update(g, tx.init(params))
  with pytest.raises(ValueError, match='needs the current params'):
    tx.update({'table': jnp.ones((5, 2))}, tx.init(params))
  with pytest.raises(ValueError, match='learning_rate_power must be <= 0'):
    lazy_optax.ftrl(0.1, learning_rate_power=0.5)
  with pytest.raises(ValueError, match='l1 must be >= 0'):
    lazy_optax.ftrl(0.1, l1=-1.0)
  with pytest.raises(ValueError, match='learning_rate must be > 0'):
    lazy_optax.ftrl(0.0)
  with pytest.raises(ValueError, match='table'):
    tx.update({'table': lazy_optax.SparseRows(jnp.array([1]),
                                              jnp.ones((1, 2)), 6)},
              tx.init(params), params)
