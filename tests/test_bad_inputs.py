"""Wrong use fails at once, with a message naming the problem and the path."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import SparseRows

PATH = 'emb/table'


def _params():
  return {'emb': {'table': jnp.arange(15.0).reshape(5, 3)},
          'w': jnp.ones((3,))}


def _grads(ids=(1, 3), values=None, num_rows=5):
  ids = jnp.asarray(ids, jnp.int32)
  if values is None:
    values = jnp.ones((ids.shape[0], 3))
  return {'emb': {'table': SparseRows(ids, values, num_rows)},
          'w': jnp.full((3,), 0.5)}


def _raw(ids, values, num_rows=5):
  """A SparseRows rebuilt from leaves, as a jax.tree.map would, with its id
  code reshaped like `ids`."""
  code = SparseRows(jnp.asarray(ids).reshape(-1), jnp.zeros((jnp.size(ids), 3)),
                    num_rows).code
  code = code.reshape(jnp.shape(ids) + code.shape[-1:])
  return jax.tree.unflatten(
      jax.tree.structure(SparseRows(jnp.zeros((0,), jnp.int32),
                                    jnp.zeros((0, 3)), num_rows)),
      [code, values])


def _update(grads, tx=None, params=None, state=None):
  tx = tx or lazy_optax.lazy_adam(0.1)
  params = _params() if params is None else params
  state = tx.init(params) if state is None else state
  return tx.update(grads, state, params)


# -- ids ----------------------------------------------------------------------

@pytest.mark.parametrize('ids, first, pos', [([1, 5, 2, 9], 5, 1),
                                             ([0, 4, -1], -1, 2)])
def test_out_of_range_ids_eager_name_the_first_bad_id(ids, first, pos):
  with pytest.raises(ValueError, match=rf'id {first} at position {pos} is '
                     r'out of range for a table of 5 rows'):
    SparseRows(jnp.array(ids), jnp.ones((len(ids), 3)), 5)


def test_checked_mode_reports_out_of_range_ids_under_jit():
  params = _params()
  tx = lazy_optax.checks.with_id_checks(lazy_optax.lazy_adam(0.1))
  state = tx.init(params)

  @jax.jit
  def step(params, state, ids):
    updates, state = tx.update(_grads(ids), state, params)
    return lazy_optax.apply_updates(params, updates), state

  run = lazy_optax.checks.checked(step)
  good_params, _ = run(params, state, jnp.array([1, 4], jnp.int32))
  assert not np.array_equal(good_params['emb']['table'][1],
                            params['emb']['table'][1])
  with pytest.raises(lazy_optax.checks.CheckError) as info:
    run(params, state, jnp.array([2, 7, 1, -3], jnp.int32))
  message = str(info.value)
  assert 'parameter emb/table' in message
  assert 'id 7 at position 1' in message
  assert '2 ids out of range' in message
  # The outputs travel with the error: the good ids were applied, the bad
  # ones touched nothing.
  out_params, _ = info.value.outputs
  table = np.asarray(out_params['emb']['table'])
  before = np.asarray(params['emb']['table'])
  assert not np.array_equal(table[[1, 2]], before[[1, 2]])
  np.testing.assert_array_equal(table[[0, 3, 4]], before[[0, 3, 4]])


def test_check_ids_in_range_outside_jit_raises_at_once():
  grads = {'t': SparseRows.from_unique(jnp.array([0, 5]), jnp.ones((2, 1)), 4)}
  with pytest.raises(ValueError, match=r"parameter t: id 5 at position 1"):
    lazy_optax.checks.check_ids_in_range(grads)
  # Id num_rows is the slot that names no row (padding, unused slots).
  lazy_optax.checks.check_ids_in_range(
      {'t': SparseRows.from_unique(jnp.array([0, 4]), jnp.ones((2, 1)), 4)})


def test_float_ids():
  with pytest.raises(TypeError, match='integer dtype'):
    SparseRows(jnp.array([1.0, 2.0]), jnp.ones((2, 3)), 5)
  # A cast of the whole gradient tree reaches the id code: refused at trace
  # time, naming the path.
  grads = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads())
  with pytest.raises(TypeError, match=rf'row ids of parameter {PATH} were '
                     'cast to bfloat16'):
    _update(grads)


def test_ids_of_rank_other_than_one():
  with pytest.raises(ValueError, match=r'vector of shape \[N\]'):
    SparseRows(jnp.array([[1, 2]]), jnp.ones((2, 3)), 5)
  with pytest.raises(ValueError, match=r'vector of shape \[N\]'):
    SparseRows(jnp.array(1), jnp.ones((1, 3)), 5)
  grads = _grads()
  grads['emb']['table'] = _raw(jnp.array([[1, 2]]), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match=rf'row ids of parameter {PATH} were '
                     r'reshaped to \(1, 2, 5\)'):
    _update(grads)


def test_values_leading_size_differs_from_ids():
  with pytest.raises(ValueError, match='one row per id'):
    SparseRows(jnp.array([1, 2]), jnp.ones((3, 3)), 5)
  grads = _grads()
  grads['emb']['table'] = _raw(jnp.array([1, 2]), jnp.ones((3, 3)))
  with pytest.raises(ValueError, match=rf'parameter {PATH}: values must have '
                     r'one row per id: 2 ids but values of shape \(3, 3\)'):
    _update(grads)


def test_row_shape_mismatch():
  with pytest.raises(ValueError, match=rf'{PATH} has rows of shape \(3,\) but'
                     r' .* rows of shape \(4,\)'):
    _update(_grads(values=jnp.ones((2, 4))))
  with pytest.raises(ValueError, match=rf'{PATH} has rows of shape \(3,\)'):
    _update(_grads(values=jnp.ones((2, 3, 1))))


def test_dtype_mismatches():
  with pytest.raises(TypeError, match=rf'{PATH} .* dtype int32'):
    _update(_grads(values=jnp.ones((2, 3), jnp.int32)))
  params = _params()
  params['emb']['table'] = params['emb']['table'].astype(jnp.int32)
  with pytest.raises(TypeError, match=rf'Parameter {PATH} has dtype int32'):
    _update(_grads(), tx=lazy_optax.lazy(optax.sgd(0.1)), params=params)
  with pytest.raises(TypeError, match=rf'{PATH} .* complex'):
    _update(_grads(values=jnp.ones((2, 3), jnp.complex64)),
            tx=lazy_optax.lazy(optax.sgd(0.1)))


def test_num_rows_mismatch():
  with pytest.raises(ValueError, match=rf'{PATH} has 5 rows but .* '
                     'num_rows=6'):
    _update(_grads(num_rows=6))


@pytest.mark.parametrize('num_rows', [5.0, True, None])
def test_num_rows_must_be_a_static_int(num_rows):
  with pytest.raises(TypeError, match='num_rows must be a static Python int'):
    SparseRows(jnp.array([1]), jnp.ones((1, 3)), num_rows)


def test_sparse_rows_for_a_scalar_parameter():
  params = {'emb': {'table': jnp.zeros((5, 3))}, 'w': jnp.zeros(())}
  grads = _grads()
  grads['w'] = SparseRows(jnp.array([0]), jnp.ones((1,)), 1)
  with pytest.raises(ValueError, match=r"Parameter w has shape \(\): "
                     'a SparseRows gradient needs a parameter of at least'):
    _update(grads, params=params)


def test_params_and_grads_of_different_structure():
  grads = _grads()
  del grads['w']
  with pytest.raises(ValueError, match=r"different tree structures: .*only "
                     r"in the parameters, first w"):
    _update(grads)
  params = {'emb': _params()['emb'], 'bias': jnp.ones((3,))}
  with pytest.raises(ValueError, match=r"only in the gradients, first "
                     r"w.*only in the parameters, first bias"):
    _update(_grads(), params=params)


@pytest.mark.parametrize('other', [
    lambda: optax.sgd(0.1, momentum=0.9),
    lambda: lazy_optax.lazy_adam(0.1, amsgrad=True),
])
def test_state_from_another_optimizer(other):
  state = other().init(_params())
  with pytest.raises(ValueError, match=r'another optimizer.*only in the '
                     r'given state, first 0/'):
    _update(_grads(), state=state)


def test_state_for_other_parameters_names_the_leaf():
  params = _params()
  params['emb']['table'] = jnp.zeros((6, 3))
  state = lazy_optax.lazy_adam(0.1).init(params)
  with pytest.raises(ValueError, match=r"leaf 0/mu/emb/table "
                     r'has shape \(6, 3\)'):
    _update(_grads(), state=state)


def test_lazy_takes_a_gradient_transformation():
  with pytest.raises(TypeError, match='GradientTransformation'):
    lazy_optax.lazy(optax.adam)


def test_apply_updates_shape_mismatch_names_the_path():
  update = {'emb': {'table': SparseRows(jnp.array([1]), jnp.ones((1, 3)), 6)},
            'w': jnp.ones((3,))}
  with pytest.raises(ValueError, match=rf'Parameter {PATH} has shape '
                     r'\(5, 3\) but its SparseRows is for shape '
                     r'\(6, 3\)'):
    lazy_optax.apply_updates(_params(), update)
