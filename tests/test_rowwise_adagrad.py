"""rowwise_adagrad against a float64 model of FBGEMM's EXACT_ROWWISE_ADAGRAD."""

import jax.numpy as jnp
from lean_common import assert_checkpoint_resumes
from lean_common import assert_state_shardings_follow_rows
from lean_common import batches
from lean_common import count_of
from lean_common import run_partitioned
from lean_common import run
from lean_common import run_dense
from lean_common import untouched
from lean_reference import RowwiseAdagrad
from lean_sharded_checks import run_checks
import numpy as np
import optax
import pytest

import lazy_optax

NUM_ROWS, D = 40, 3


def _acc(state):
  return np.asarray(lazy_optax.compat.get_slot(state, 'table', 'sum_of_squares'))


@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('mode', ['none', 'l2', 'decoupled'])
def test_matches_float64_model(jit, mode):
  rng = np.random.default_rng(0)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(1, NUM_ROWS, (D,), steps=12, n_ids=16)
  wd = 0.0 if mode == 'none' else 0.3
  ref = RowwiseAdagrad(table, lr=0.1, weight_decay=wd, mode=mode)
  for ids, values in data:
    ref.step(ids, values)
  tx = lazy_optax.rowwise_adagrad(0.1, weight_decay=wd, weight_decay_mode=mode)
  params, state = run(tx, table, data, jit=jit)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(_acc(state), ref.g2, rtol=1e-5, atol=1e-7)
  assert _acc(state).shape == (NUM_ROWS,)
  assert count_of(state) == 12
  # Absent rows: table and accumulator bit-for-bit.
  rows = untouched(data, NUM_ROWS)
  assert rows.size > 5
  np.testing.assert_array_equal(np.asarray(params['table'])[rows],
                                table.astype(np.float32)[rows])
  assert np.all(_acc(state)[rows] == 0)


def test_dense_gradient_is_the_dense_rule():
  rng = np.random.default_rng(2)
  table = rng.normal(size=(6, 4))
  grads = [rng.normal(size=(6, 4)) for _ in range(5)]
  grads[1][2] = 0  # a zero row: G unchanged, the row does not move
  ref = RowwiseAdagrad(table, lr=0.1, weight_decay=0.1, mode='l2')
  for g in grads:
    ref.step(np.arange(6), g)
  tx = lazy_optax.rowwise_adagrad(0.1, weight_decay=0.1, weight_decay_mode='l2')
  params, state = run_dense(tx, table, grads)
  np.testing.assert_allclose(params, ref.p, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(state[0].sum_of_squares, ref.g2, rtol=1e-5)


def test_every_row_touched_once_equals_dense():
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
  tx = lazy_optax.rowwise_adagrad(0.1)
  p_l, p_d = table, table
  s_l, s_d = tx.init(table), tx.init(table)
  for _ in range(4):
    perm = rng.permutation(8)
    g = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    u_l, s_l = tx.update(lazy_optax.SparseRows(perm, g[perm], 8), s_l)
    u_d, s_d = tx.update(g, s_d)
    p_l = lazy_optax.apply_updates(p_l, u_l)
    p_d = lazy_optax.apply_updates(p_d, u_d)
  np.testing.assert_allclose(p_l, p_d, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(s_l[0].sum_of_squares, s_d[0].sum_of_squares,
                             rtol=1e-6)


def test_out_of_range_ids_under_jit_touch_nothing():
  table = np.ones((10, 2), np.float32)
  tx = lazy_optax.rowwise_adagrad(0.1)
  ids = np.array([3, -1, 10, 3], np.int32)
  values = np.ones((4, 2), np.float32)
  params, state = run(tx, table, [(ids, values)], jit=True)
  moved = np.flatnonzero(np.any(np.asarray(params['table']) != 1, axis=1))
  assert moved.tolist() == [3]
  np.testing.assert_allclose(_acc(state), [0, 0, 0, 4, 0, 0, 0, 0, 0, 0])


def test_dtypes():
  rng = np.random.default_rng(4)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(5, NUM_ROWS, (D,), steps=6, n_ids=16)
  ref = RowwiseAdagrad(table, lr=0.1)
  for ids, values in data:
    ref.step(ids, values)
  # bfloat16 table, float32 gradients: float32 accumulator by default.
  params, state = run(lazy_optax.rowwise_adagrad(0.1), table, data,
                      dtype=jnp.bfloat16)
  assert params['table'].dtype == jnp.bfloat16
  assert _acc(state).dtype == np.float32
  np.testing.assert_allclose(np.asarray(params['table'], np.float32), ref.p,
                             atol=3e-2)
  # A bfloat16 accumulator when asked for.
  params, state = run(
      lazy_optax.rowwise_adagrad(0.1, accumulator_dtype=jnp.bfloat16), table,
      data)
  assert params['table'].dtype == jnp.float32
  assert lazy_optax.compat.get_slot(state, 'table', 'sum_of_squares').dtype == (
      jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(params['table']), ref.p, atol=2e-2)
  # Scalar and vector parameters: each entry is a row.
  tx = lazy_optax.rowwise_adagrad(0.1)
  p = {'s': jnp.float32(1.0), 'v': jnp.ones(3)}
  s = tx.init(p)
  assert s[0].sum_of_squares['s'].shape == ()
  assert s[0].sum_of_squares['v'].shape == (3,)
  u, s = tx.update({'s': jnp.float32(2.0), 'v': jnp.array([1.0, 0.0, -3.0])},
                   s, p)
  np.testing.assert_allclose(u['v'], [-0.1, 0.0, 0.1], rtol=1e-6)
  np.testing.assert_allclose(s[0].sum_of_squares['v'], [1.0, 0.0, 9.0])


def test_in_chain_and_partition():
  rng = np.random.default_rng(6)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(7, NUM_ROWS, (D,), steps=6, n_ids=16)
  ref = RowwiseAdagrad(table, lr=0.1)
  for ids, values in data:
    ref.step(ids, values)
  chained = lazy_optax.lazy(optax.chain(
      optax.clip_by_global_norm(1e6),
      lazy_optax.scale_by_rowwise_adagrad(),
      optax.scale_by_learning_rate(0.1)))
  params, _ = run(chained, table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)

  params, state = run_partitioned(lazy_optax.rowwise_adagrad(0.1), table,
                                  data, NUM_ROWS)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)
  assert lazy_optax.compat.get_slot(state, 'table', 'sum_of_squares').shape == (
      NUM_ROWS,)


def test_schedule_and_inject_hyperparams():
  rng = np.random.default_rng(8)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(9, NUM_ROWS, (D,), steps=5, n_ids=8)
  schedule = optax.linear_schedule(0.2, 0.05, 4)
  ref = RowwiseAdagrad(table)
  for t, (ids, values) in enumerate(data):
    ref.step(ids, values, lr=float(schedule(t)))
  params, _ = run(lazy_optax.rowwise_adagrad(schedule), table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)
  injected = optax.inject_hyperparams(lazy_optax.rowwise_adagrad)(
      learning_rate=0.1)
  ref = RowwiseAdagrad(table, lr=0.1)
  for ids, values in data:
    ref.step(ids, values)
  params, _ = run(injected, table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)


def test_slots_shardings_and_checkpoint(tmp_path):
  tx = lazy_optax.rowwise_adagrad(0.1, weight_decay=0.01,
                                  weight_decay_mode='decoupled')
  state = tx.init({'table': jnp.zeros((NUM_ROWS, D))})
  assert 'sum_of_squares' in lazy_optax.compat.get_slot_names(
      state, {'table': jnp.zeros((NUM_ROWS, D))})
  assert_state_shardings_follow_rows(tx, ['sum_of_squares'])
  data = batches(10, NUM_ROWS, (D,), steps=6, n_ids=12)
  resumed = assert_checkpoint_resumes(tx, data, tmp_path)
  assert count_of(resumed[1]) == 6


def test_sharded_on_8_devices(tmp_path):
  out = run_checks('rowwise_adagrad', tmp_path)
  assert out['slots'] == ['sum_of_squares']


def test_errors():
  with pytest.raises(ValueError, match='weight_decay_mode must be one of'):
    lazy_optax.rowwise_adagrad(0.1, weight_decay_mode='L2')
  with pytest.raises(ValueError, match="weight_decay_mode='none'"):
    lazy_optax.rowwise_adagrad(0.1, weight_decay=0.1)
  with pytest.raises(ValueError, match='eps must be >= 0'):
    lazy_optax.rowwise_adagrad(0.1, eps=-1.0)
  tx = lazy_optax.rowwise_adagrad(0.1, weight_decay=0.1,
                                  weight_decay_mode='l2')
  params = {'table': jnp.zeros((5, 2))}
  g = {'table': lazy_optax.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 5)}
  with pytest.raises(ValueError, match='needs params'):
    tx.update(g, tx.init(params))
  with pytest.raises(ValueError, match='table'):  # names the parameter
    tx.update({'table': lazy_optax.SparseRows(jnp.array([1]),
                                              jnp.ones((1, 3)), 5)},
              tx.init(params), params)
