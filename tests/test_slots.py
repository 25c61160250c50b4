"""get_slot, get_slot_names and global_step on lazy_optax and optax states."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from reference import TFLazyAdam

NUM_ROWS = 12


def _params():
  rng = np.random.default_rng(0)
  return {'encoder': {'embedding': jnp.asarray(rng.normal(size=(NUM_ROWS, 3)),
                                               jnp.float32)},
          'head': {'w': jnp.asarray(rng.normal(size=(3,)), jnp.float32)}}


def _batches(steps=4):
  rng = np.random.default_rng(1)
  for _ in range(steps):
    ids = rng.integers(0, NUM_ROWS, 5).astype(np.int32)
    yield ids, rng.normal(size=(5, 3)), rng.normal(size=(3,))


def _train(tx, params, steps=4):
  state = tx.init(params)
  for ids, values, g_w in _batches(steps):
    grads = {'encoder': {'embedding': lazy_optax.SparseRows(
        ids, jnp.asarray(values, jnp.float32), NUM_ROWS)},
             'head': {'w': jnp.asarray(g_w, jnp.float32)}}
    updates, state = tx.update(grads, state, params)
    params = lazy_optax.apply_updates(params, updates)
  return params, state


def _reference_moments(params, amsgrad=False):
  ref = TFLazyAdam(params['encoder']['embedding'], lr=0.01,
                      amsgrad=amsgrad)
  for ids, values, _ in _batches():
    ref.step(ids, values)
  return ref


@pytest.mark.parametrize('wrap', ['plain', 'chain', 'inject', 'partition'])
def test_adam_slots_match_the_float64_model(wrap):
  params = _params()
  if wrap == 'plain':
    tx = lazy_optax.lazy_adam(0.01)
  elif wrap == 'chain':
    tx = optax.chain(lazy_optax.compat.clipnorm(1e6), lazy_optax.lazy_adam(0.01))
  elif wrap == 'inject':
    tx = optax.inject_hyperparams(lazy_optax.lazy_adam)(learning_rate=0.01)
  else:
    tx = optax.partition(
        {'lazy': lazy_optax.lazy_adam(0.01),
         'dense': optax.sgd(0.1, momentum=0.9)},
        lazy_optax.tree.path_labels(
            lambda name: 'lazy' if 'embedding' in name else 'dense'))
  _, state = _train(tx, params)
  ref = _reference_moments(params)
  for tf_name, optax_name, expected, atol in (
      ('m', 'mu', ref.m, 1e-7), ('v', 'nu', ref.v, 1e-9)):
    for name in (tf_name, optax_name):
      got = lazy_optax.compat.get_slot(state, 'encoder/embedding', name)
      np.testing.assert_allclose(got, expected, rtol=2e-5, atol=atol)
  assert int(lazy_optax.compat.global_step(state)) == 4


def test_slots_of_dense_optax_inside_partition_and_tuple_paths():
  params = _params()
  tx = lazy_optax.compat.per_pattern_lr(optax.adam, 0.01, [('embedding', 0.1)])
  _, state = _train(tx, params)
  # The dense head: compare with optax.adam run alone on its gradients.
  alone = optax.adam(0.01)
  s = alone.init(params['head']['w'])
  for _, _, g_w in _batches():
    _, s = alone.update(jnp.asarray(g_w, jnp.float32), s)
  np.testing.assert_allclose(lazy_optax.compat.get_slot(state, 'head/w', 'm'),
                             s[0].mu, rtol=1e-6)
  np.testing.assert_allclose(lazy_optax.compat.get_slot(state, ('head', 'w'), 'nu'),
                             s[0].nu, rtol=1e-6)
  assert lazy_optax.compat.get_slot_names(state, params) == ['m', 'v']


def test_amsgrad_vhat_slot():
  params = _params()
  _, state = _train(lazy_optax.lazy_adam(0.01, amsgrad=True), params)
  ref = _reference_moments(params, amsgrad=True)
  np.testing.assert_allclose(
      lazy_optax.compat.get_slot(state, 'encoder/embedding', 'vhat'), ref.v_max,
      rtol=2e-5, atol=1e-9)
  assert lazy_optax.compat.get_slot_names(state, params) == ['m', 'v', 'vhat']


def test_slot_names_of_other_optimizers():
  params = _params()
  state = lazy_optax.lazy(optax.sgd(0.1, momentum=0.9)).init(params)
  assert lazy_optax.compat.get_slot_names(state, params) == ['trace']
  state = optax.partition(
      {'a': optax.adagrad(0.1), 'b': lazy_optax.lazy_adam(0.1)},
      {'encoder': 'b', 'head': 'a'}).init(params)
  assert lazy_optax.compat.get_slot_names(state, params) == ['m', 'sum_of_squares',
                                                      'v']
  # Adagrad's accumulator exists for the head only.
  assert lazy_optax.compat.get_slot(state, 'head/w', 'sum_of_squares').shape == (3,)
  with pytest.raises(KeyError, match='encoder/embedding'):
    lazy_optax.compat.get_slot(state, 'encoder/embedding', 'sum_of_squares')


def test_global_step_with_schedules_and_inject_hyperparams():
  params = _params()
  sched = optax.exponential_decay(0.01, 10, 0.5)
  tx = optax.inject_hyperparams(lazy_optax.lazy_adam)(learning_rate=sched)
  _, state = _train(tx, params, steps=3)
  assert int(lazy_optax.compat.global_step(state)) == 3
  # Several counts live in this state; a plain tree_get would be ambiguous.
  counts = optax.tree_utils.tree_get_all_with_path(state, 'count')
  assert len(counts) >= 2


def test_slot_errors_name_the_problem():
  params = _params()
  state = lazy_optax.lazy_adam(0.1).init(params)
  with pytest.raises(KeyError, match="no slot 'trace'"):
    lazy_optax.compat.get_slot(state, 'encoder/embedding', 'trace')
  with pytest.raises(KeyError, match='encoder/embeding.*encoder/embedding'):
    lazy_optax.compat.get_slot(state, 'encoder/embeding', 'm')
  two = optax.chain(lazy_optax.lazy_adam(0.1), lazy_optax.lazy_adam(0.1))
  with pytest.raises(ValueError, match="2 slots 'm'"):
    lazy_optax.compat.get_slot(two.init(params), 'head/w', 'm')
  with pytest.raises(KeyError, match='no scalar `count`'):
    lazy_optax.compat.global_step(optax.sgd(0.1).init(params))
