"""partial_rowwise_adam against a float64 model of FBGEMM's rule."""

import jax.numpy as jnp
from lean_common import assert_checkpoint_resumes
from lean_common import assert_state_shardings_follow_rows
from lean_common import batches
from lean_common import count_of
from lean_common import run_partitioned
from lean_common import run
from lean_common import run_dense
from lean_common import untouched
from lean_reference import PartialRowwiseAdam
from lean_sharded_checks import run_checks
import numpy as np
import optax
import pytest

import lazy_optax

NUM_ROWS, D = 40, 3


def _slots(state):
  return (np.asarray(lazy_optax.compat.get_slot(state, 'table', 'mu')),
          np.asarray(lazy_optax.compat.get_slot(state, 'table', 'nu')))


@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('weight_decay', [0.0, 0.1])
def test_matches_float64_model(jit, weight_decay):
  rng = np.random.default_rng(0)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(1, NUM_ROWS, (D,), steps=15, n_ids=16)
  ref = PartialRowwiseAdam(table, lr=0.05, weight_decay=weight_decay)
  for ids, values in data:
    ref.step(ids, values)
  tx = lazy_optax.partial_rowwise_adam(0.05, weight_decay=weight_decay)
  params, state = run(tx, table, data, jit=jit)
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)
  mu, nu = _slots(state)
  assert mu.shape == (NUM_ROWS, D) and nu.shape == (NUM_ROWS,)
  np.testing.assert_allclose(mu, ref.m, rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(nu, ref.v, rtol=2e-5, atol=1e-9)
  assert count_of(state) == 15
  rows = untouched(data, NUM_ROWS)
  assert rows.size > 5
  np.testing.assert_array_equal(np.asarray(params['table'])[rows],
                                table.astype(np.float32)[rows])
  assert np.all(mu[rows] == 0) and np.all(nu[rows] == 0)


def test_dense_gradient_is_the_dense_rule():
  rng = np.random.default_rng(2)
  table = rng.normal(size=(6, 4))
  grads = [rng.normal(size=(6, 4)) for _ in range(5)]
  ref = PartialRowwiseAdam(table, lr=0.05, weight_decay=0.1)
  for g in grads:
    ref.step(np.arange(6), g)
  params, state = run_dense(
      lazy_optax.partial_rowwise_adam(0.05, weight_decay=0.1), table, grads)
  np.testing.assert_allclose(params, ref.p, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(state[0].nu, ref.v, rtol=2e-5)


def test_one_entry_rows_are_optax_adamw():
  # With one entry per row the row mean of g^2 is g^2: optax.adamw exactly.
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(20, 1)), jnp.float32)
  data = batches(4, 20, (1,), steps=8, n_ids=6)
  ours, _ = run(lazy_optax.partial_rowwise_adam(0.05, weight_decay=0.1),
                np.asarray(table), data)
  theirs, _ = run(lazy_optax.lazy(optax.adamw(0.05, weight_decay=0.1)),
                  np.asarray(table), data)
  # optax takes b^t in float32, this rule 1 - b^t from 1 - b: a few 1e-6.
  np.testing.assert_allclose(ours['table'], theirs['table'], rtol=2e-5,
                             atol=1e-6)


def test_dtypes():
  rng = np.random.default_rng(5)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(6, NUM_ROWS, (D,), steps=6, n_ids=16)
  ref = PartialRowwiseAdam(table, lr=0.05)
  for ids, values in data:
    ref.step(ids, values)
  params, state = run(lazy_optax.partial_rowwise_adam(0.05), table, data,
                      dtype=jnp.bfloat16)
  mu, nu = _slots(state)
  assert params['table'].dtype == jnp.bfloat16
  assert mu.dtype == jnp.bfloat16 and nu.dtype == np.float32
  np.testing.assert_allclose(np.asarray(params['table'], np.float32), ref.p,
                             atol=3e-2)
  params, state = run(
      lazy_optax.partial_rowwise_adam(0.05, mu_dtype=jnp.bfloat16,
                                      nu_dtype=jnp.bfloat16), table, data)
  mu, nu = _slots(state)
  assert params['table'].dtype == jnp.float32
  assert mu.dtype == jnp.bfloat16 and nu.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(params['table']), ref.p, atol=1e-2)


def test_in_chain_and_partition():
  rng = np.random.default_rng(7)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(8, NUM_ROWS, (D,), steps=6, n_ids=16)
  ref = PartialRowwiseAdam(table, lr=0.05)
  for ids, values in data:
    ref.step(ids, values)
  chained = lazy_optax.lazy(optax.chain(
      optax.clip_by_global_norm(1e6),
      lazy_optax.scale_by_partial_rowwise_adam(),
      optax.scale_by_learning_rate(0.05)))
  params, _ = run(chained, table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)

  params, state = run_partitioned(lazy_optax.partial_rowwise_adam(0.05), table,
                                  data, NUM_ROWS)
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)


def test_inject_hyperparams():
  rng = np.random.default_rng(9)
  table = rng.normal(size=(NUM_ROWS, D))
  data = batches(10, NUM_ROWS, (D,), steps=4, n_ids=8)
  ref = PartialRowwiseAdam(table, lr=0.05)
  for ids, values in data:
    ref.step(ids, values)
  tx = optax.inject_hyperparams(lazy_optax.partial_rowwise_adam)(
      learning_rate=0.05)
  params, _ = run(tx, table, data)
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)


def test_slots_shardings_and_checkpoint(tmp_path):
  tx = lazy_optax.partial_rowwise_adam(0.05, weight_decay=0.01)
  params = {'table': jnp.zeros((NUM_ROWS, D))}
  assert lazy_optax.compat.get_slot_names(tx.init(params), params) == ['m', 'v']
  assert_state_shardings_follow_rows(tx, ['m', 'v'])
  data = batches(11, NUM_ROWS, (D,), steps=6, n_ids=12)
  assert_checkpoint_resumes(tx, data, tmp_path)


def test_sharded_on_8_devices(tmp_path):
  out = run_checks('partial_rowwise_adam', tmp_path)
  assert out['slots'] == ['mu', 'nu']


def test_errors():
  with pytest.raises(ValueError, match='b2 must be in'):
    lazy_optax.partial_rowwise_adam(0.1, b2=1.0)
  with pytest.raises(ValueError, match='weight_decay must be >= 0'):
    lazy_optax.partial_rowwise_adam(0.1, weight_decay=-0.1)
  tx = lazy_optax.partial_rowwise_adam(0.1)
  params = {'emb': {'table': jnp.zeros((5, 2))}}
  with pytest.raises(ValueError, match='emb'):
    tx.update({'emb': {'table': lazy_optax.SparseRows(
        jnp.array([1]), jnp.ones((1, 2)), 6)}}, tx.init(params), params)
