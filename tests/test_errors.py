"""Wrong use fails at once, with a message naming the problem and the path.

Sections: ids; gradients that do not fit their parameter; optimizer states
that do not fit the parameters; optimizer arguments (one check and one
wording for every optimizer); what an update needs; sharding.
"""

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
  # Positions are slots of the gradient, whose repeated ids were summed when
  # it was built: the distinct ids 1, 2 in slots 0, 1, then 7 and -3.
  assert 'id 7 at position 2' in message
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


# -- gradients that do not fit the parameter, without params ------------------


def test_shape_mismatch_without_params_is_still_an_error():
  tx = lazy_optax.lazy_adam(0.1)
  state = tx.init(_params())
  for bad in (SparseRows(jnp.array([1]), jnp.ones((1, 4)), 5),
              SparseRows(jnp.array([1]), jnp.ones((1, 3)), 6)):
    grads = _grads()
    grads['emb']['table'] = bad
    with pytest.raises(ValueError, match=PATH):
      tx.update(grads, state)


@pytest.mark.parametrize('make_tx', [lambda: lazy_optax.lazy_adam(0.1),
                                     lambda: lazy_optax.lazy(optax.adam(0.1))])
def test_integer_dense_gradient_names_the_parameter(make_tx):
  tx = make_tx()
  params = _params()
  grads = _grads()
  grads['emb']['table'] = jnp.ones((5, 3), jnp.int32)
  with pytest.raises(TypeError, match=PATH + r'.*int32'):
    tx.update(grads, tx.init(params), params)


# -- state that cannot be updated row by row -----------------------------------


def test_factored_adafactor_table_names_the_state_leaf():
  tx = lazy_optax.lazy(optax.adafactor(0.1, min_dim_size_to_factor=2))
  params = _params()
  with pytest.raises(ValueError, match=r'v_row/' + PATH + r'.*row shape'):
    tx.update(_grads((1, 2)), tx.init(params), params)


def test_unfactored_adafactor_table_is_fine():
  tx = lazy_optax.lazy(optax.adafactor(0.1))   # D < 128: not factored
  params = _params()
  u, _ = tx.update(_grads((1, 2)), tx.init(params), params)
  new = lazy_optax.apply_updates(params, u)['emb']['table']
  changed = np.flatnonzero(np.any(new != params['emb']['table'], axis=1))
  np.testing.assert_array_equal(changed, [1, 2])


def _custom(init_leaf, update_leaf):
  def init_fn(params):
    return jax.tree.map(init_leaf, params)

  def update_fn(updates, state, params=None):
    del params
    return updates, jax.tree.map(update_leaf, state, updates)

  return optax.GradientTransformation(init_fn, update_fn)


def test_transposed_state_copy_names_the_state_leaf():
  tx = lazy_optax.lazy(_custom(lambda p: jnp.zeros(p.shape[::-1]),
                               lambda s, g: s + g.T))
  params = _params()
  with pytest.raises(ValueError, match=PATH + r'.*one entry per row'):
    tx.update(_grads((1,)), tx.init(params), params)


def test_column_statistic_state_names_the_state_leaf():
  tx = lazy_optax.lazy(_custom(lambda p: jnp.zeros(p.shape[1:]),
                               lambda s, g: s + jnp.sum(g, axis=0)))
  params = _params()
  with pytest.raises(ValueError, match=PATH + r'.*statistic across rows'):
    tx.update(_grads((1,)), tx.init(params), params)


# -- optimizer arguments: one check and one wording for every optimizer --------

OPTIMIZERS = {
    'lazy_adam': lambda **kw: lazy_optax.lazy_adam(0.1, **kw),
    'lazy_adamw': lambda **kw: lazy_optax.lazy_adamw(0.1, **kw),
    'scale_by_lazy_adam': lazy_optax.scale_by_lazy_adam,
    'adam_with_counter': lambda **kw: lazy_optax.adam_with_counter(0.1, **kw),
    'scale_by_adam_with_counter': lazy_optax.scale_by_adam_with_counter,
    'partial_rowwise_adam': lambda **kw: lazy_optax.partial_rowwise_adam(
        0.1, **kw),
    'scale_by_partial_rowwise_adam': lazy_optax.scale_by_partial_rowwise_adam,
}
BAD = [('b1', 1.5, r'b1 must be in \[0, 1\), got 1.5'),
       ('b2', -0.1, r'b2 must be in \[0, 1\), got -0.1'),
       ('b2', 1.0, r'b2 must be in \[0, 1\), got 1.0'),
       ('eps', -1.0, r'eps must be >= 0, got -1.0')]


@pytest.mark.parametrize('arg,value,message', BAD,
                         ids=[f'{b[0]}={b[1]}' for b in BAD])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_adam_family_checks_hyperparameters_alike(name, arg, value, message):
  with pytest.raises(ValueError, match=f'^{name}: {message}.$'):
    OPTIMIZERS[name](**{arg: value})


@pytest.mark.parametrize('make,message', [
    (lambda: lazy_optax.rowwise_adagrad(0.1, eps=-1.),
     r'^rowwise_adagrad: eps must be >= 0, got -1.0.$'),
    (lambda: lazy_optax.scale_by_rowwise_adagrad(
        initial_accumulator_value=-1.),
     r'^scale_by_rowwise_adagrad: initial_accumulator_value must be >= 0'),
    (lambda: lazy_optax.rowwise_adagrad(0.1, weight_decay_mode='L2'),
     'weight_decay_mode must be one of'),
    (lambda: lazy_optax.rowwise_adagrad(0.1, weight_decay=0.1),
     "weight_decay_mode='none'"),
    (lambda: lazy_optax.partial_rowwise_adam(0.1, weight_decay=-0.1),
     'weight_decay must be >= 0'),
    (lambda: lazy_optax.ftrl(0.1, learning_rate_power=0.5),
     r'^ftrl: learning_rate_power must be <= 0, got 0.5.$'),
    (lambda: lazy_optax.ftrl(0.1, l1=-1.),
     r'^ftrl: l1 must be >= 0, got -1.0.$'),
    (lambda: lazy_optax.ftrl(0.0), r'^ftrl: learning_rate must be > 0'),
    (lambda: lazy_optax.lazy_adamw(0.1, weight_decay=-1.),
     r'^lazy_adamw: weight_decay must be >= 0'),
    (lambda: lazy_optax.adam_with_counter(0.1, bias_correction='per-row'),
     'bias_correction'),
    (lambda: lazy_optax.adam_with_counter(0.1, decay_skipped_steps=True),
     'weight_decay'),
])
def test_optimizer_arguments_are_checked(make, message):
  with pytest.raises(ValueError, match=message):
    make()


# -- what an update needs ------------------------------------------------------

_TABLE = {'table': jnp.zeros((5, 2))}


def _one_row(num_rows=5, width=2):
  return {'table': SparseRows(jnp.array([1]), jnp.ones((1, width)), num_rows)}


@pytest.mark.parametrize('tx, match', [
    (lazy_optax.rowwise_adagrad(0.1, weight_decay=0.1,
                                weight_decay_mode='l2'), 'needs params'),
    (lazy_optax.adam_with_counter(0.1, weight_decay=0.1), 'needs params'),
    (lazy_optax.ftrl(0.1), 'needs the current params'),
], ids=['rowwise_adagrad(l2)', 'adam_with_counter(weight_decay)', 'ftrl'])
def test_rules_that_read_the_weights_need_params(tx, match):
  with pytest.raises(ValueError, match=match):
    tx.update(_one_row(), tx.init(_TABLE))


def test_ftrl_needs_params_for_dense_gradients_too():
  tx = lazy_optax.ftrl(0.1)
  with pytest.raises(ValueError, match='needs the current params'):
    tx.update({'table': jnp.ones((5, 2))}, tx.init(_TABLE))


@pytest.mark.parametrize('tx, grads', [
    (lazy_optax.rowwise_adagrad(0.1, weight_decay=0.1, weight_decay_mode='l2'),
     _one_row(width=3)),
    (lazy_optax.ftrl(0.1), _one_row(num_rows=6)),
], ids=['rowwise_adagrad-row_shape', 'ftrl-num_rows'])
def test_lean_optimizers_name_the_parameter(tx, grads):
  with pytest.raises(ValueError, match='table'):
    tx.update(grads, tx.init(_TABLE), _TABLE)


def test_partial_rowwise_adam_names_the_nested_parameter():
  tx = lazy_optax.partial_rowwise_adam(0.1)
  params = {'emb': {'table': jnp.zeros((5, 2))}}
  with pytest.raises(ValueError, match='emb'):
    tx.update({'emb': {'table': SparseRows(
        jnp.array([1]), jnp.ones((1, 2)), 6)}}, tx.init(params), params)


# -- sharding ------------------------------------------------------------------


def test_state_shardings_errors():
  tx = lazy_optax.lazy_adam(1e-3)
  with pytest.raises(ValueError, match='no NamedSharding'):
    lazy_optax.sharding.state_shardings(
        tx, {'t': jnp.zeros((4, 2))},
        {'t': jax.sharding.SingleDeviceSharding(jax.devices()[0])})
  with pytest.raises(ValueError, match='tree structure of params'):
    lazy_optax.sharding.state_shardings(tx, {'t': jnp.zeros((4, 2))},
                                        {'u': None})
  with pytest.raises(ValueError, match='has no sharding'):
    lazy_optax.sharding.state_shardings(tx, {'t': np.zeros((4, 2))})


# -- the first line says what happened and what to do ------------------------

def _first_line(fn, error=Exception):
  with pytest.raises(error) as info:
    jax.block_until_ready(fn())
  return str(info.value).splitlines()[0]


def test_the_first_line_of_each_error_names_what_happened_and_the_fix():
  damaged = jax.tree.map(jnp.add, _grads((1, 3)), _grads((2, 4)))

  def helper_step(change, tx):
    def step(params, state):
      updates, state = tx.update(change(_grads((1, 3))), state, params)
      return lazy_optax.apply_updates(params, updates), state
    params = _params()
    return lambda: lazy_optax.perf.make_train_step(step)(params,
                                                         tx.init(params))

  tree_add = lambda g: jax.tree.map(jnp.add, g, _grads((2, 4)))
  checked = lazy_optax.checks.with_id_checks(lazy_optax.lazy_adam(0.1))
  out_of_range = lambda g: _grads((1, 7))
  lines = {
      # eager
      'eager damaged ids': _first_line(lambda: _update(damaged), ValueError),
      'eager out of range': _first_line(lambda: _grads((1, 9)), ValueError),
      # at trace time
      'cast ids': _first_line(lambda: jax.jit(_update)(jax.tree.map(
          lambda x: x.astype(jnp.float16), _grads())), TypeError),
      # from the step helper
      'helper damaged ids': _first_line(
          helper_step(tree_add, lazy_optax.lazy_adam(0.1)),
          lazy_optax.checks.DamagedIdsError),
      'helper checked mode': _first_line(
          helper_step(out_of_range, checked), lazy_optax.checks.CheckError),
  }
  fixes = {
      'eager damaged ids': 'combine gradient trees with '
                           'lazy_optax.tree.add(g1, g2)',
      'eager out of range': 'map ids into the table before the lookup',
      'cast ids': 'cast the values only, jax.tree.map(lambda g: '
                  'g.astype(dtype), grads, '
                  'is_leaf=lazy_optax.tree.is_sparse_rows)',
      'helper damaged ids': 'combine gradient trees with '
                            'lazy_optax.tree.add(g1, g2)',
      'helper checked mode': 'map ids into the table before the lookup',
  }
  for case, line in lines.items():
    assert 'emb/table' in line or 'SparseRows' in line, (case, line)
    assert fixes[case] in line, (case, line)
