"""A refused step keeps the train state (`lazy_optax.perf.make_train_step`).

Every case of docs/semantics.md's error groups (tests/recovery_checks.py),
donated, on one device and with the table split over 8 devices: the step is
refused at trace time with its inputs intact, or raises a `StepError`
whose outputs are the state from before it, and resuming from them equals
a run that never met the bad batch, bit for bit. The step with checks
copies no table, and a step without checks compiles as `jax.jit` alone.
"""

import warnings

import eight_devices
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import recovery_checks

import lazy_optax
from lazy_optax._src import train_step as train_step_lib


def _assert_recovered(results):
  for name in recovery_checks.WHEN_RUN:
    got = results[name]
    assert got.get('raised') == 'DamagedIdsError', (name, got)
    assert got['donated'] and got['kept'] and got['resumed'], (name, got)
    # The first line says what happened and what to write instead.
    assert 'row ids of parameter t were changed' in got['first_line']
    assert 'lazy_optax.tree.add(g1, g2)' in got['first_line']
  got = results['checked_out_of_range']
  assert got.get('raised') == 'CheckError', got
  assert got['kept'] and got['resumed'], got
  assert got['first_line'].startswith('SparseRows for parameter t: id 19')
  for name in (list(recovery_checks.AT_TRACE)
               + list(recovery_checks.AT_TRACE_CHANGES)):
    got = results[name]
    assert got.get('intact') and got['kept'], (name, got)
  assert results['cast_ids']['first_line'].startswith(
      'The row ids of parameter t were cast to bfloat16')
  assert results['zeros_like_params']['first_line'].startswith(
      'Parameter t gets a dense gradient, but lazy_optax.value_and_grad')


def test_refused_steps_keep_the_state_on_one_device():
  results = recovery_checks.run_cases()
  assert results['devices'] == 1
  _assert_recovered(results)


def test_refused_steps_keep_the_state_on_8_devices():
  results = eight_devices.call('recovery_checks', 'run_cases')
  assert results['devices'] == 8
  _assert_recovered(results)


def _table_step(change, rows=8192, dim=32):
  """A donated lazy_adam step on a 1 MiB table (copies of it are seen)."""
  tx = lazy_optax.lazy_adam(0.1)
  params = {'t': jnp.zeros((rows, dim)), 'w': jnp.ones((dim,))}

  def train_step(params, opt_state, ids):
    def loss_fn(p):
      return jnp.sum((lazy_optax.lookup(p['t'], ids) @ p['w'] - 1.0) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(change(grads), opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  return train_step, params, tx.init(params), jnp.arange(64) % rows


def test_a_step_that_can_be_refused_copies_no_table():
  # With a check in the step (tree arithmetic before the update), every row
  # write is gated and the table is not selected with a `where`.
  fn, params, state, ids = _table_step(
      lambda g: lazy_optax.tree.add(g, jax.tree.map(lambda x: x * 0.5, g)))
  step = lazy_optax.perf.make_train_step(fn)
  hlo = step.lower(params, state, ids).compile().as_text()
  tables = [('t', jax.ShapeDtypeStruct((8192, 32), jnp.float32))]
  assert not train_step_lib._table_copies(hlo, tables)
  assert 'select' in hlo   # the dense leaves are kept with a where
  with warnings.catch_warnings():
    warnings.simplefilter('error')   # no warning of a copy or of donation
    out = step(params, state, ids)
  assert np.isfinite(float(out[2]))


def test_a_step_without_checks_compiles_as_jax_jit_alone():
  fn, params, state, ids = _table_step(lambda g: g)
  helper = lazy_optax.perf.make_train_step(fn).lower(params, state, ids)
  plain = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, ids)
  body = lambda lowered: [line for line in lowered.as_text().splitlines()
                          if 'func.func' not in line and 'module' not in line]
  assert body(helper) == body(plain)


def test_a_step_that_does_not_return_its_state_in_place_is_refused_at_trace():
  fn, params, state, ids = _table_step(
      lambda g: jax.tree.map(lambda x: x * 0.5, g))
  swapped = lambda p, s, i: (lambda out: (out[1], out[0], out[2]))(
      fn(p, s, i))
  step = lazy_optax.perf.make_train_step(swapped)
  with pytest.raises(TypeError, match='output 0 has another tree structure'):
    step(params, state, ids)
  assert not params['t'].is_deleted()


def test_a_step_donating_one_state_argument_hands_it_back():
  """Flax-style: `step(state, ids) -> (state, loss)`, argument 0 donated."""
  tx = lazy_optax.lazy_adam(0.1)

  def step(state, ids, scale):
    def loss_fn(p):
      return jnp.sum((lazy_optax.lookup(p['t'], ids) @ p['w'] - 1.0) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(state['params'])
    grads = jax.tree.map(lambda x: x * scale, grads)   # 1e-30 damages ids
    updates, opt = tx.update(grads, state['opt'], state['params'])
    return {'params': lazy_optax.apply_updates(state['params'], updates),
            'opt': opt}, loss

  params = {'t': jnp.ones((8, 2)), 'w': jnp.ones((2,))}
  state = {'params': params, 'opt': tx.init(params)}
  run = lazy_optax.perf.make_train_step(step, donate_argnums=0)
  state, _ = run(state, jnp.array([1, 2]), 1.0)
  before = jax.tree.map(lambda x: np.array(x, copy=True), state)
  with pytest.raises(lazy_optax.checks.DamagedIdsError) as e:
    run(state, jnp.array([3, 4]), 1e-30)
  assert state['params']['t'].is_deleted()   # donated, consumed
  kept, _ = e.value.outputs
  jax.tree.map(np.testing.assert_array_equal, kept, before)
  again, _ = run(kept, jnp.array([3, 4]), 1.0)
  assert not np.array_equal(again['params']['t'], before['params']['t'])
