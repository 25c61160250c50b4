"""What `rowwise_adagrad_with_counter` promises beyond the conformance suite.

The rule itself is checked against its float64 model on every
implementation by tests/test_conformance.py (tests/optimizer_cases.py) and
against FBGEMM by tests/test_fbgemm_counter_parity.py. Here: AdagradW's
catch-up decays a rare row as dense training would, `max_counter` follows
the largest counter, `reset_rows` gives fresh `IdTable` slots fresh
counters, bad arguments are refused by name, and
`scale_by_rowwise_adagrad_with_counter` chained with the learning rate
follows the model in every mode linear in it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optimizer_cases
import pytest

import lazy_optax
from lazy_optax import SparseRows

N, D = 10, 4


def _step(tx):
  @jax.jit
  def step(params, state, ids, values):
    g = SparseRows(ids, values, N)
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


@pytest.mark.parametrize('gap', [1, 5, 40])
def test_adagradw_decays_a_returning_row_as_dense_training_would(gap):
  """Row 7 is absent `gap - 1` steps then back with a zero gradient: its
  weights are what `gap` steps of dense decay `(1 - lr * wd)` leave."""
  lr, wd = 0.05, 0.3
  tx = lazy_optax.rowwise_adagrad_with_counter(
      lr, weight_decay=wd, counter_weight_decay_mode='adagradw')
  table = jnp.asarray(np.random.default_rng(0).normal(size=(N, D)),
                      jnp.float32)
  state = tx.init(table)
  step = _step(tx)
  ones = jnp.ones((1, D))
  params, state = step(table, state, jnp.array([7]), ones)
  after_first = np.asarray(params[7], np.float64)
  for _ in range(gap - 1):
    params, state = step(params, state, jnp.array([2]), ones)
  params, state = step(params, state, jnp.array([7]), 0 * ones)
  np.testing.assert_allclose(np.asarray(params[7]),
                             after_first * (1 - lr * wd) ** gap, rtol=3e-6)
  assert int(state.last_step[7]) == gap + 1
  assert float(state.row_counter[7]) == 2.0


def test_max_counter_is_one_plus_the_largest_counter_at_refresh():
  tx = lazy_optax.rowwise_adagrad_with_counter(
      0.1, learning_rate_mode='tail_id_lr_increase', max_counter_update_freq=3)
  params = jnp.zeros((N, D))
  state = tx.init(params)
  step = _step(tx)
  seen = []
  for t in range(1, 8):
    params, state = step(params, state, jnp.array([1, 1, 4]), jnp.ones((3, D)))
    seen.append(float(state.max_counter))
    assert float(state.counter_peak) == t  # row 1: t appearances
  # Refreshed before the step at t = 3 and 6: 1 + the peak after t - 1.
  assert seen == [1, 1, 3, 3, 3, 6, 6]


def test_reset_rows_gives_fresh_slots_fresh_counters():
  tx = lazy_optax.rowwise_adagrad_with_counter(
      0.1, weight_decay=0.1, counter_weight_decay_mode='adagradw')
  params = {'table': jnp.ones((N, D))}
  state = tx.init(params)

  def step(params, state, ids):
    g = {'table': SparseRows(ids, jnp.ones((ids.shape[0], D)), N)}
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for _ in range(3):
    params, state = jax.jit(step)(params, state, jnp.array([2, 3, 5, 5]))
  fresh = lazy_optax.FreshRows(slots=jnp.array([3, N, 5], jnp.int32),
                               ids=jnp.zeros((3, 2), jnp.uint32),
                               capacity=None)
  params, state = jax.jit(lambda p, s: lazy_optax.reset_rows(
      tx, p, s, {'table': fresh}, init=None))(params, state)
  for name in ('sum_of_squares', 'row_counter', 'last_step'):
    leaf = np.asarray(getattr(state, name)['table'])
    assert leaf[3] == 0 and leaf[5] == 0, name
    assert leaf[2] != 0, name  # not a fresh slot: kept
  assert not np.asarray(params['table'])[[3, 5]].any()
  # A reset row starts over: its next step is a first step (gap 1).
  params, state = jax.jit(step)(params, state, jnp.array([3]))
  assert float(state.row_counter['table'][3]) == 1.0
  assert int(state.last_step['table'][3]) == 4


@pytest.mark.parametrize('kwargs, word', [
    (dict(counter_weight_decay_mode='decoupled_global'),
     'counter_weight_decay_mode'),
    (dict(learning_rate_mode='sgd'), 'learning_rate_mode'),
    (dict(weight_decay=0.1), 'weight_decay'),
    (dict(counter_halflife=2.5), 'counter_halflife'),
    (dict(max_counter_update_freq=True), 'max_counter_update_freq'),
    (dict(eps=-1.0), 'eps'),
    (dict(adjustment_ub=-0.5), 'adjustment_ub'),
    (dict(impl='fast'), 'impl'),
])
def test_bad_arguments_are_refused_by_name(kwargs, word):
  with pytest.raises(ValueError, match=word):
    lazy_optax.rowwise_adagrad_with_counter(0.1, **kwargs)


@pytest.mark.parametrize('name', [
    'l2,halflife=3', 'decoupled,halflife=5', 'tail_id_lr_decrease,ratio',
    'counter_sgd,decoupled'])
def test_scale_by_chained_with_the_learning_rate_follows_the_model(name):
  case = optimizer_cases.BY_NAME[f'rowwise_adagrad_with_counter({name})']
  assert case.scale_by is lazy_optax.scale_by_rowwise_adagrad_with_counter
  tx = lazy_optax.lazy(optax.chain(
      case.scale_by(**case.kwargs), optax.scale_by_learning_rate(case.lr)))
  table = optimizer_cases.table_for(case, seed=3)
  data = optimizer_cases.batches(4, optimizer_cases.NUM_ROWS,
                                 (optimizer_cases.D,), steps=8, n_ids=12)
  params, state = optimizer_cases.run(tx, table, data)
  optimizer_cases.assert_matches_model(
      case, params, state, optimizer_cases.run_model(case, table, data))


def test_scale_by_refuses_adagradw_whose_decay_is_not_linear_in_the_rate():
  with pytest.raises(ValueError, match="'adagradw'.*learning_rate"):
    lazy_optax.scale_by_rowwise_adagrad_with_counter(
        weight_decay=0.1, counter_weight_decay_mode='adagradw')


def test_decay_needs_params():
  tx = lazy_optax.rowwise_adagrad_with_counter(
      0.1, weight_decay=0.1, counter_weight_decay_mode='decoupled')
  params = jnp.zeros((N, D))
  with pytest.raises(ValueError, match='params'):
    tx.update(SparseRows(jnp.array([1]), jnp.ones((1, D)), N),
              tx.init(params))


def _kernel_steps(tx, num_rows):
  """The jitted step: update, then add the update to the table."""

  def step(params, state, ids, values):
    g = SparseRows(ids, values, num_rows)
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  return jax.jit(step), None


@pytest.mark.cpu_kernels
def test_l2_mode_reads_the_weights_in_the_kernel():
  """'l2' adds the decay to the gradient whose square the accumulator
  sums: the state reads the weights, so the kernel takes the parameter
  rows and nothing is left for the scatter-add."""
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  tx = lazy_optax.rowwise_adagrad_with_counter(
      0.05, weight_decay=0.3, counter_weight_decay_mode='l2',
      counter_halflife=4)
  table = jnp.asarray(np.random.default_rng(0).normal(size=(N, D)),
                      jnp.float32)
  state = tx.init(table)
  fused, _ = _kernel_steps(tx, N)
  ids, values = jnp.array([1, 4], jnp.int32), jnp.ones((2, D))
  hlo = fused.lower(table, state, ids, values).compile().as_text()
  assert 'LazyOptaxRowwiseAdagradWithCounter' in hlo
  [choice] = lazy_optax.explain_update(tx, SparseRows(ids, values, N),
                                       state, table).values()
  assert choice.impl == 'cpu_kernel', choice
  assert 'scatter-add' not in choice.reason, choice


def test_the_step_lowered_for_a_gpu_calls_no_kernel():
  """The rule's kernel is the CPU's: lowered for a GPU, the step takes
  the rule's XLA path, with no C++ call."""
  tx = lazy_optax.rowwise_adagrad_with_counter(
      0.05, weight_decay=0.3, counter_weight_decay_mode='adagradw')
  table = jnp.asarray(np.random.default_rng(0).normal(size=(N, D)),
                      jnp.float32)
  state = tx.init(table)
  ids, values = jnp.array([1, 4, 1], jnp.int32), jnp.ones((3, D))
  gpu = jax.export.export(_step(tx), platforms=('cuda',))(table, state, ids,
                                                         values)
  text = gpu.mlir_module()
  assert 'lazy_optax_' not in text and 'custom_call' not in text
  assert 'stablehlo.scatter' in text
