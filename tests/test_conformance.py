"""What every optimizer must do, checked on each against its float64 model.

The optimizers and their models are listed in tests/optimizer_cases.py:
`IMPL_CASES` (every configuration of `RULE_CASES` on its implementations:
'generic', 'xla', 'cpu_kernel') for the rule and the fused row updates,
`CASES` (one per optimizer) for the rule in its default implementation,
eager and jitted, and the other properties:

* every implementation: the one asked for runs (`explain_update`, the
  compiled program), trains as the model and as 'generic' does, in float32
  and 16-bit tables and states, untouched rows bit for bit;
* the rule: trained with heavy duplicates and rows that go absent, the table
  and every state slot equal the float64 model, jitted or not; rows never
  touched stay bit for bit as they started, in the table and every slot;
* duplicates are summed before the update; out-of-range ids touch nothing;
* a dense gradient gets the dense rule; every row touched once equals dense;
* 16-bit tables and states, and dtypes that stay put under `jax.jit` and
  `lax.cond`;
* a donated step compiles once and updates the tables in place;
* inside `optax.chain` (and as its `scale_by_...` form) and
  `optax.partition`; with a schedule and `optax.inject_hyperparams`;
* slots, state shardings that follow the rows, orbax checkpoints that resume
  bit for bit; 8 simulated devices (tests/sharded_checks.py, one subprocess
  for all optimizers).
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optimizer_cases import assert_checkpoint_resumes
from optimizer_cases import assert_matches_model
from optimizer_cases import assert_state_shardings_follow_rows
from optimizer_cases import batches
from optimizer_cases import BY_NAME
from optimizer_cases import CASES
from optimizer_cases import count_of
from optimizer_cases import D
from optimizer_cases import IMPL_CASES
from optimizer_cases import NUM_ROWS
from optimizer_cases import RULE_CASES
from optimizer_cases import run
from optimizer_cases import run_model
from optimizer_cases import run_partitioned
from optimizer_cases import slot
from optimizer_cases import sparse_step
from optimizer_cases import table_for
from optimizer_cases import untouched
import pytest
from sharded_checks import run_checks

import lazy_optax
from lazy_optax import SparseRows

each_case = pytest.mark.parametrize('case', CASES, ids=str)


def _initial(case, name, dtype):
  return np.asarray(next(s.initial for s in case.slots if s.name == name),
                    dtype)


# -- the rule ----------------------------------------------------------------

# The tests of one configuration with batches of 16 ids of D values, eager
# or jitted (test_rule_matches_float64_model,
# test_empty_batches_change_nothing_but_the_count and
# test_donated_step_compiles_once_and_updates_in_place on tables of NUM_ROWS
# rows, test_every_row_touched_once_equals_dense on 16 rows) run on one
# worker (a group per configuration): the library's eager operations on those
# shapes compile once, and the jitted runs share one optimizer object and its
# donated step, traced once for batches of 16 ids.
def _by_rule(cases):
  return [pytest.param(case, id=case.name,
                       marks=pytest.mark.xdist_group(f'rule {case.name}'))
          for case in cases]


_RULE_STEPS = {}


def _rule_step(case):
  """The configuration's shared optimizer, its jitted, donated step, and the
  batch shapes of the step's traces (one entry per trace)."""
  if case.name not in _RULE_STEPS:
    tx = case.make()
    plain = sparse_step(tx, NUM_ROWS)
    traces = []

    def step(params, state, ids, values):
      traces.append(ids.shape)
      return plain(params, state, ids, values)

    _RULE_STEPS[case.name] = (tx, jax.jit(step, donate_argnums=(0, 1)),
                              traces)
  return _RULE_STEPS[case.name]


def _run_rule(case, table, data, jit):
  """`run(case.make(), table, data, jit=jit)`, jitted with the shared step."""
  if not jit:
    return run(case.make(), table, data, jit=False)
  tx, step, _ = _rule_step(case)
  params = {'table': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  for batch in data:
    params, state = step(params, state, *jax.device_put(batch))
  return params, state


_EAGER_STEPS = 6


# Each optimizer's case, jitted (with 'auto', its default implementation)
# and eager. Each other configuration of an optimizer differs from its case
# in the rule's arithmetic alone: checked on each implementation, with the
# same assertions (test_each_implementation_matches_the_model_and_generic).
@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('case', _by_rule(CASES))
def test_rule_matches_float64_model(case, jit):
  table = table_for(case)
  # Eagerly, the case's first steps: each step is some hundred operations
  # dispatched one by one, and what an eager step does differently from a
  # jitted one (concrete ids, read with NumPy) does not depend on the step;
  # the rule's arithmetic over all the case's steps is the jitted run's.
  steps = case.steps if jit else min(case.steps, _EAGER_STEPS)
  data = batches(1, NUM_ROWS, (D,), steps=steps, n_ids=16)
  model = run_model(case, table, data)
  params, state = _run_rule(case, table, data, jit)
  assert_matches_model(case, params, state, model)
  assert count_of(state) == steps
  _assert_untouched_rows_as_they_started(case, params, state, table, data)


def _assert_untouched_rows_as_they_started(case, params, state, table, data):
  """Absent rows: table and every slot bit for bit as they started."""
  rows = untouched(data, NUM_ROWS)
  assert rows.size > 5
  np.testing.assert_array_equal(np.asarray(params['table'])[rows],
                                table.astype(np.float32)[rows])
  for s in case.slots:
    got = np.asarray(slot(state, s.name))
    np.testing.assert_array_equal(got[rows], _initial(case, s.name, got.dtype),
                                  err_msg=s.name)


# -- every implementation ---------------------------------------------------

def _with_out_of_range(data, num_rows, row_shape):
  """`data` and a batch whose ids fall outside the table on both sides.

  The batch has as many ids as the others (padded with more ids outside
  the table), so a step compiled for `data` runs it too.
  """
  rng = np.random.default_rng(5)
  ids = [-2, 3, num_rows, 3, num_rows + 5, -1, 7, 1]
  n = len(data[0][0])
  ids += [num_rows + 1 + k if k % 2 else -3 - k for k in range(n - len(ids))]
  return data + [(np.array(ids, np.int32),
                  rng.normal(size=(n, *row_shape)).astype(np.float32))]


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _run_compiled(tx, table, data, dtype=jnp.float32):
  """`run(tx, table, data, dtype=dtype)`, its step compiled once, ahead of
  time, for the batches' one shape; returns (params, state, HLO text, the
  shapes and dtypes of the initial params and state)."""
  params = {'table': jnp.asarray(table, dtype)}
  state = tx.init(params)
  initial = _shapes((params, state))  # before donation deletes them
  args = jax.device_put(data[0])
  step = jax.jit(sparse_step(tx, table.shape[0]), donate_argnums=(0, 1))
  compiled = step.lower(params, state, *args).compile()
  for ids, values in data:
    params, state = compiled(params, state, *jax.device_put((ids, values)))
  return params, state, compiled.as_text(), initial


def _assert_implementation_runs(case, tx, initial, data, program):
  """`explain_update` (on the initial params and state's shapes) and the
  compiled step (HLO text `program`) say `case.impl` runs."""
  params, state = initial
  ids, values = data[0]
  grads = {'table': SparseRows(*jax.device_put((ids, values)), NUM_ROWS)}
  choice = lazy_optax.explain_update(tx, grads, state, params)['table']
  assert choice.impl == case.impl, choice
  name = ''.join(w.capitalize() for w in choice.rule.split('_'))
  rule_kernel = 'lazy_optax_LazyOptax' + name
  assert (rule_kernel in program) == (case.impl == 'cpu_kernel'), (
      rule_kernel, choice)


# The 'generic' run of one configuration on one data set, which every
# implementation of that configuration is compared with: computed once per
# process (each pytest worker has its own).
_GENERIC = {}


def _configuration(case):
  """The configuration's name without its implementation: `X` of `X[xla]`."""
  return case.name[:case.name.rindex('[')]


def _generic_key(key):
  """`key` and the default device: the cpu_kernel cases run on the CPU where
  the default backend is another (tests/conftest.py)."""
  return key, str(jax.config.jax_default_device)


def _generic_run(key, make_generic, table, data, dtype=jnp.float32):
  key = _generic_key(key)
  if key not in _GENERIC:
    _GENERIC[key] = _run_compiled(make_generic(), table, data, dtype)[:2]
  return _GENERIC[key]


def _sharing_generic(cases_and_keys):
  """Parameters (case, ...) whose tests of one configuration share its
  'generic' run: kept on one worker (a group per configuration, of two or
  three tests), where the run is computed once."""
  return [pytest.param(*values, id=ident,
                       marks=pytest.mark.xdist_group(f'generic {group}'))
          for values, ident, group in cases_and_keys]


@pytest.mark.parametrize('case', _sharing_generic(
    ((case,), case.name, _configuration(case)) for case in IMPL_CASES))
def test_each_implementation_matches_the_model_and_generic(case):
  table = table_for(case)
  data = _with_out_of_range(
      batches(1, NUM_ROWS, (D,), steps=case.steps, n_ids=16), NUM_ROWS, (D,))
  tx = case.make()
  params, state, program, initial = _run_compiled(tx, table, data)
  # explain_update sees the initial state (its shapes and dtypes).
  _assert_implementation_runs(case, tx, initial, data, program)
  assert_matches_model(case, params, state, run_model(case, table, data))
  assert count_of(state) == len(data)
  _assert_untouched_rows_as_they_started(case, params, state, table, data)
  # One key for every implementation of this configuration (`X[xla]`,
  # `X[cpu_kernel]` and `X[generic]` all compare with X's 'generic' run).
  key = (_configuration(case),)
  if case.impl == 'generic':  # this very run is the configuration's generic
    _GENERIC.setdefault(_generic_key(key), (params, state))
  generic = _generic_run(key, dataclasses.replace(case, impl='generic').make,
                         table, data)
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves(generic)):
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                               atol=1e-6)


_IMPL_DTYPE_CASES = [(case, i) for case in IMPL_CASES
                     if case.impl != 'generic' and case.name.startswith(
                         tuple(f'{c.name}[' for c in CASES))
                     for i in range(len(case.dtypes))]


@pytest.mark.parametrize('case, i', _sharing_generic(
    ((c, i), f'{c.name}-{i}', f'{_configuration(c)}-{i}')
    for c, i in _IMPL_DTYPE_CASES))
def test_each_implementation_of_16bit_tables_and_states_equals_generic(case,
                                                                       i):
  # Rows of shape (2, 3); float32 state of bfloat16 tables and bfloat16
  # state of float32 tables.
  config = case.dtypes[i]
  rng = np.random.default_rng(7)
  table = case.table_scale * rng.normal(size=(NUM_ROWS, 2, 3))
  data = _with_out_of_range(batches(3, NUM_ROWS, (2, 3), steps=6, n_ids=12),
                            NUM_ROWS, (2, 3))

  def make(impl):
    return case.fn(case.lr, **{**case.kwargs, **config.kwargs, 'impl': impl})

  tx = make(case.impl)
  params, state, program, initial = _run_compiled(tx, table, data,
                                                  config.table)
  _assert_implementation_runs(case, tx, initial, data, program)
  generic = _generic_run((_configuration(case), i), lambda: make('generic'),
                         table, data, config.table)
  rows = untouched(data, NUM_ROWS)
  assert rows.size
  for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves(generic)):
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.ndim and a.shape[0] == NUM_ROWS:
      np.testing.assert_array_equal(a32[rows], b32[rows])
    # Contracted multiply-adds may move a 16-bit value by one step.
    np.testing.assert_allclose(a32, b32, rtol=2e-2, atol=1e-2)
  assert params['table'].dtype == config.table
  for name, dtype in config.slot_dtypes.items():
    assert slot(state, name).dtype == dtype, name
  np.testing.assert_array_equal(
      np.asarray(params['table'], np.float32)[rows],
      np.asarray(jnp.asarray(table, config.table), np.float32)[rows])
  np.testing.assert_allclose(np.asarray(params['table'], np.float32),
                             run_model(case, table, data).p, atol=config.atol)


# One optimizer object and its jitted step per configuration, shared by
# test_duplicates_are_summed_before_the_update and
# test_out_of_range_ids_under_jit_touch_nothing (tables of ten rows, batches
# of six ids): the step is traced and compiled once for both (kept on one
# worker, a group per configuration).
_TEN_ROWS = {}


def _ten_rows_run(name, make_tx, table, data):
  """`run(tx, table, data)` with the configuration's shared `tx` and step."""
  if name not in _TEN_ROWS:
    tx = make_tx()
    _TEN_ROWS[name] = tx, jax.jit(sparse_step(tx, 10), donate_argnums=(0, 1))
  tx, step = _TEN_ROWS[name]
  params = {'table': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  for batch in data:
    params, state = step(params, state, *jax.device_put(batch))
  return params, state


def _ten_rows_group(name):
  return pytest.mark.xdist_group(f'ten rows {name}')


@pytest.mark.parametrize('case', [
    pytest.param(case, id=case.name, marks=_ten_rows_group(case.name))
    for case in CASES])
def test_duplicates_are_summed_before_the_update(case):
  table = table_for(case, seed=2, num_rows=10)
  rng = np.random.default_rng(3)
  g = rng.normal(size=(6, D)).astype(np.float32)
  repeated = [(np.array([3, 7, 3, 3, 7, 3], np.int32), g)]
  # Rows 3 and 7 once each, padded to the repeated batch's six ids with ids
  # outside the table (which touch nothing): both runs share one step, the
  # program of test_out_of_range_ids_under_jit_touch_nothing's first run.
  summed = [(np.array([3, 7, 10, -1, 12, -4], np.int32),
             np.stack([g[0] + g[2] + g[3] + g[5], g[1] + g[4], g[1], g[0],
                       g[2], g[3]]))]
  p_rep, s_rep = _ten_rows_run(case.name, case.make, table, repeated)
  p_sum, s_sum = _ten_rows_run(case.name, case.make, table, summed)
  np.testing.assert_allclose(p_rep['table'], p_sum['table'], rtol=1e-6,
                             atol=1e-7)
  for a, b in zip(jax.tree.leaves(s_rep), jax.tree.leaves(s_sum)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-7)
  model = run_model(case, table, repeated)
  assert_matches_model(case, p_rep, s_rep, model)


_OUT_OF_RANGE = [(case.name, case.make) for case in CASES] + [
    ('lazy(chain(clip_by_global_norm(1), adam))',
     lambda: lazy_optax.lazy(optax.chain(optax.clip_by_global_norm(1.0),
                                         optax.adam(0.1))))]


@pytest.mark.parametrize('name, make_tx', [
    pytest.param(name, make_tx, id=name, marks=_ten_rows_group(name))
    for name, make_tx in _OUT_OF_RANGE])
def test_out_of_range_ids_under_jit_touch_nothing(name, make_tx):
  # Rows of D values, batches of six ids: the program of
  # test_duplicates_are_summed_before_the_update's runs.
  table = 0.1 * np.arange(10 * D, dtype=np.float32).reshape(10, D)
  # Huge values on out-of-range ids (negative ones would wrap in plain JAX
  # indexing, and would dominate a global norm); only row 3 is in range.
  ids = np.array([3, -1, 10, -10, 3, 15], np.int32)
  values = np.full((6, D), 1e6, np.float32)
  values[[0, 4]] = 0.5
  params, state = _ten_rows_run(name, make_tx, table, [(ids, values)])
  moved = np.flatnonzero(np.any(np.asarray(params['table']) != table, axis=1))
  assert moved.tolist() == [3]
  # Exactly the step with the in-range ids alone.
  ok_params, ok_state = _ten_rows_run(name, make_tx, table,
                                      [(ids[[0, 4]], values[[0, 4]])])
  for a, b in zip(jax.tree.leaves((params, state)),
                  jax.tree.leaves((ok_params, ok_state))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  case = BY_NAME.get(name)
  if case is None:
    return
  others = np.array([i for i in range(10) if i != 3])
  for s in case.slots:
    got = np.asarray(slot(state, s.name))
    np.testing.assert_array_equal(got[others],
                                  _initial(case, s.name, got.dtype),
                                  err_msg=s.name)
    assert np.any(got[3] != _initial(case, s.name, got.dtype)), s.name
  # The model drops them too.
  assert_matches_model(case, params, state,
                       run_model(case, table, [(ids, values)]))


@pytest.mark.parametrize('jit', [False, True])
@pytest.mark.parametrize('case', _by_rule(CASES))
def test_empty_batches_change_nothing_but_the_count(case, jit):
  # The table and non-empty batches have the shapes of
  # test_rule_matches_float64_model's (NUM_ROWS rows, 16 ids): eagerly, the
  # library's operations on them are the ones compiled there already.
  table = table_for(case, seed=11)
  rng = np.random.default_rng(12)
  data = [(np.resize(np.asarray(ids, np.int32), len(ids) and 16),
           rng.normal(size=(len(ids) and 16, D)).astype(np.float32))
          # Both non-empty batches: rows 4 and 1, rows 6 and 1, each id
          # repeated (one jitted program for both).
          for ids in ([], [4, 4, 1], [], [6, 1, 6], [])]
  # Jitted: the rule test's step (donated), and a second program for the
  # empty batches.
  if jit:
    tx, step, _ = _rule_step(case)
  else:
    tx = case.make()
    step = sparse_step(tx, NUM_ROWS)
  params = {'table': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  for t, (ids, values) in enumerate(data, start=1):
    if t == 1:  # the update of an empty batch is still row-sparse
      u, _ = tx.update({'table': SparseRows(ids, values, NUM_ROWS)}, state,
                       params)
      assert isinstance(u['table'], SparseRows) and u['table'].num_ids == 0
    # Copies: the jitted step consumes (donates) its inputs.
    old_params, old_state = jax.tree.map(np.array, (params, state))
    new_params, new_state = step(params, state,
                                 *jax.device_put((ids, values)))
    if not len(ids):
      np.testing.assert_array_equal(new_params['table'], old_params['table'])
      for s in case.slots:
        np.testing.assert_array_equal(slot(new_state, s.name),
                                      slot(old_state, s.name),
                                      err_msg=s.name)
    assert count_of(new_state) == t
    params, state = new_params, new_state
  # An empty batch counts as a step (the bias correction sees it).
  assert_matches_model(case, params, state, run_model(case, table, data))


@each_case
def test_rows_of_any_shape(case):
  rng = np.random.default_rng(1)
  table = case.table_scale * rng.normal(size=(NUM_ROWS, 2, 3))
  data = batches(2, NUM_ROWS, (2, 3), steps=6, n_ids=12)
  model = run_model(case, table, data)
  params, state = run(case.make(), table, data)
  assert_matches_model(case, params, state, model)
  rows = untouched(data, NUM_ROWS)
  assert rows.size
  np.testing.assert_array_equal(np.asarray(params['table'])[rows],
                                table.astype(np.float32)[rows])
  touched = np.setdiff1d(np.arange(NUM_ROWS), rows)
  for s in case.slots:  # every touched row's state moved
    got = np.asarray(slot(state, s.name))
    moved = np.any((got != _initial(case, s.name, got.dtype)).reshape(
        NUM_ROWS, -1), axis=1)
    assert moved[touched].all(), s.name


# On each optimizer (CASES): a dense gradient, and a row-sparse one naming
# every row, take the path of dense leaves, whose arithmetic is the rule's
# Python code that 'generic' runs; each other configuration's arithmetic is
# checked there (test_each_implementation_matches_the_model_and_generic, on
# every implementation, against the model).
@each_case
def test_dense_gradient_is_the_dense_rule(case):
  rng = np.random.default_rng(2)
  table = case.table_scale * rng.normal(size=(6, 4))
  grads = [rng.normal(size=(6, 4)) for _ in range(5)]
  grads[1][2] = 0  # a zero row is still a row of a dense gradient
  model = case.reference(table)
  for g in grads:
    model.step(np.arange(6), g)
  tx = case.make()
  params = {'table': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: _apply(tx, p, s, {'table': g}))
  for g in grads:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
  assert_matches_model(case, params, state, model)


def _apply(tx, params, state, grads):
  updates, state = tx.update(grads, state, params)
  return lazy_optax.apply_updates(params, updates), state


@pytest.mark.parametrize('case', _by_rule(CASES))
def test_every_row_touched_once_equals_dense(case):
  # Eager, on 16 rows of D values, each named once by a batch of 16 ids
  # (the operations on the batch's rows have the shapes of
  # test_rule_matches_float64_model's eager ones); data built in NumPy.
  rng = np.random.default_rng(3)
  table = jax.device_put(
      (case.table_scale * rng.normal(size=(16, D))).astype(np.float32))
  tx = case.make()
  p_l, p_d = table, table
  s_l, s_d = tx.init(table), tx.init(table)
  for _ in range(4):
    perm = rng.permutation(16).astype(np.int32)
    g = rng.normal(size=(16, D)).astype(np.float32)
    u_l, s_l = tx.update(SparseRows(*jax.device_put((perm, g[perm])), 16),
                         s_l, p_l)
    u_d, s_d = tx.update(jax.device_put(g), s_d, p_d)
    p_l = lazy_optax.apply_updates(p_l, u_l)
    p_d = lazy_optax.apply_updates(p_d, u_d)
  np.testing.assert_allclose(p_l, p_d, rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(s_l), jax.tree.leaves(s_d)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-7)


# -- dtypes ------------------------------------------------------------------

# An optimizer that offers implementations is checked in 16 bits on each of
# them, against 'generic' and the model (the implementations' 16-bit test
# above); here, in its default one, an optimizer that offers none.
_DTYPE_CASES = [(case, i) for case in CASES if not case.impls
                for i in range(len(case.dtypes))]


@pytest.mark.parametrize('case, i', _DTYPE_CASES,
                         ids=[f'{c.name}-{i}' for c, i in _DTYPE_CASES])
def test_16bit_tables_and_states(case, i):
  config = case.dtypes[i]
  # Rows of shape (2, 3) and batches of 12 ids, as in the implementations'
  # 16-bit test above.
  table = case.table_scale * np.random.default_rng(4).normal(
      size=(NUM_ROWS, 2, 3))
  data = batches(5, NUM_ROWS, (2, 3), steps=6, n_ids=12)
  model = run_model(case, table, data)
  tx = case.fn(case.lr, **{**case.kwargs, **config.kwargs})
  params, state = run(tx, table, data, dtype=config.table)
  assert params['table'].dtype == config.table
  for name, dtype in config.slot_dtypes.items():
    assert slot(state, name).dtype == dtype, name
  np.testing.assert_allclose(np.asarray(params['table'], np.float32), model.p,
                             atol=config.atol)


def _structs(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree,
                      is_leaf=lazy_optax.tree.is_sparse_rows)


# Every optimizer with bfloat16 parameters, where a dtype can drift (a
# float32 hyperparameter or moment promoting a bfloat16 row); float32
# parameters, where the same code runs with nothing to promote, for a rule
# with a kernel, one with int32 tables and an optax rule.
_STABLE_IN_FLOAT32 = ('lazy_adam', 'adam_with_counter', 'lazy(optax.adam)')
_STABLE = [(case.name, case.make, dtype) for case in CASES
           for dtype in (jnp.float32, jnp.bfloat16)
           if dtype == jnp.bfloat16 or case.name in _STABLE_IN_FLOAT32] + [
               ('lazy_adam(amsgrad, f32 moments)',
                lambda: lazy_optax.lazy_adam(0.01, mu_dtype=jnp.float32,
                                             nu_dtype=jnp.float32,
                                             amsgrad=True), jnp.bfloat16),
               ('lazy(optax.adam(mu_dtype=f32))',
                lambda: lazy_optax.lazy(optax.adam(0.01,
                                                   mu_dtype=jnp.float32)),
                jnp.bfloat16)]


@pytest.mark.parametrize(
    'name, make_tx, dtype', _STABLE,
    ids=[f'{n}-{jnp.dtype(d).name}' for n, _, d in _STABLE])
def test_state_and_update_dtypes_are_stable(name, make_tx, dtype):
  del name
  tx = make_tx()
  params = {'table': jnp.ones((20, 3), dtype), 'b': jnp.ones((3,), dtype)}
  state = tx.init(params)
  ids, values = batches(0, 20, (3,), steps=1, n_ids=8)[0]
  grads = {'table': SparseRows(ids, jnp.asarray(values, dtype), 20),
           'b': jnp.ones((3,), dtype)}

  # One program: the jitted update, its application, and the same update
  # inside a lax.cond against "do nothing" (what optax.apply_if_finite and
  # gradient-skipping loops need), for either branch.
  @jax.jit
  def steps(pred, params, state, grads):
    updates, new_state = tx.update(grads, state, params)

    def do(args):
      params, state, grads = args
      u, s = tx.update(grads, state, params)
      return lazy_optax.apply_updates(params, u), s
    maybe = jax.lax.cond(pred, do, lambda args: args[:2],
                         (params, state, grads))
    return (updates, new_state, lazy_optax.apply_updates(params, updates),
            maybe)

  updates, new_state, new_params, _ = steps(True, params, state, grads)
  assert _structs(new_state) == _structs(state)
  # A SparseRows update has the dtype the dense update of the same rule has.
  expected = jax.eval_shape(tx.update, params, state, params)[0]
  assert updates['table'].values.dtype == expected['table'].dtype
  assert updates['table'].ids.dtype == jnp.int32
  assert updates['table'].values.shape == (len(ids), 3)
  assert updates['b'].dtype == expected['b'].dtype
  assert _structs(new_params) == _structs(params)

  # The state's types survive the lax.cond.
  for pred in (True, False):
    p, s = steps(pred, params, state, grads)[3]
    assert _structs(s) == _structs(state)
    assert _structs(p) == _structs(params)
  np.testing.assert_array_equal(p['table'], params['table'])  # pred False


def test_bfloat16_duplicates_are_summed_in_float32():
  # 1,000 copies of one id: a bfloat16 running sum stalls once the sum's
  # ulp exceeds twice each value (at 256 for 1.0); the sum must be 1000.
  tx = lazy_optax.lazy(optax.sgd(1.0))
  params = jnp.zeros((4, 2), jnp.bfloat16)
  ids = np.full(1000, 2, np.int32)
  u, _ = tx.update(SparseRows(ids, jnp.ones((1000, 2), jnp.bfloat16), 4),
                   tx.init(params))
  assert u.values.dtype == jnp.bfloat16
  np.testing.assert_array_equal(lazy_optax.apply_updates(params, u)[2],
                                [-1000, -1000])


# -- donation ----------------------------------------------------------------

@pytest.mark.parametrize('case', _by_rule(CASES))
def test_donated_step_compiles_once_and_updates_in_place(case):
  # The configuration's shared step (test_rule_matches_float64_model's):
  # however many runs of batches of 16 ids it served, it was traced once for
  # them.
  tx, step, traces = _rule_step(case)
  table = table_for(case, seed=14)
  data = batches(14, NUM_ROWS, (D,), steps=5, n_ids=16)
  params = {'table': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)
  for ids, values in data:
    old = [params['table']] + [slot(state, s.name) for s in case.slots]
    params, state = step(params, state, *jax.device_put((ids, values)))
    # Donated buffers were consumed (updated in place, not copied).
    assert all(x.is_deleted() for x in old)
  assert traces.count((16,)) == 1, traces
  assert_matches_model(case, params, state, run_model(case, table, data))


# -- composition -------------------------------------------------------------

@each_case
def test_in_chain_and_partition(case):
  table = table_for(case, seed=6)
  data = batches(7, NUM_ROWS, (D,), steps=6, n_ids=16)
  model = run_model(case, table, data)
  params, state = run(case.chained(), table, data)
  assert_matches_model(case, params, state, model)
  params, state = run_partitioned(case.make(), table, data, NUM_ROWS)
  assert_matches_model(case, params, state, model)


@each_case
def test_schedule_and_inject_hyperparams(case):
  table = table_for(case, seed=8)
  data = batches(9, NUM_ROWS, (D,), steps=5, n_ids=8)
  schedule = optax.linear_schedule(2 * case.lr, case.lr / 2, 4)
  model = case.reference(table)
  for t, (ids, values) in enumerate(data):
    model.lr = float(schedule(t))
    model.step(ids, values)
  params, state = run(case.make(schedule), table, data)
  assert_matches_model(case, params, state, model)

  kwargs = dict(case.kwargs)
  if case.impl is not None:
    kwargs['impl'] = case.impl
  injected = optax.inject_hyperparams(case.fn)(learning_rate=case.lr,
                                               **kwargs)
  params, state = run(injected, table, data)
  assert_matches_model(case, params, state, run_model(case, table, data))


# -- state, checkpoints, devices ---------------------------------------------

@each_case
def test_slots_and_state_shardings(case):
  tx = case.make()
  params = {'table': jnp.zeros((NUM_ROWS, D))}
  assert lazy_optax.compat.get_slot_names(tx.init(params), params) == list(
      case.slot_names)
  for s in case.slots:
    assert slot(tx.init(params), s.name).shape[0] == NUM_ROWS
  assert_state_shardings_follow_rows(tx, [s.name for s in case.slots])


_CHECKPOINTED = [(case.name, case.make) for case in CASES] + [
    ('lazy_adam(amsgrad)', lambda: lazy_optax.lazy_adam(0.05, amsgrad=True)),
    ('lazy_adamw', lambda: lazy_optax.lazy_adamw(0.05, weight_decay=0.1)),
    ('lazy(chain(clip, inject_hyperparams(adam)(schedule)))',
     lambda: lazy_optax.lazy(optax.chain(
         optax.clip_by_global_norm(1.0),
         optax.inject_hyperparams(optax.adam)(
             learning_rate=optax.linear_schedule(0.1, 0.01, 6))))),
]


@pytest.mark.parametrize('name, make_tx', _CHECKPOINTED,
                         ids=[n for n, _ in _CHECKPOINTED])
def test_checkpoint_resumes_bit_for_bit(name, make_tx, tmp_path):
  del name
  data = batches(10, NUM_ROWS, (D,), steps=6, n_ids=12)
  resumed = assert_checkpoint_resumes(make_tx(), data, tmp_path)
  assert count_of(resumed[1]) == 6
  counts = [c for _, c in optax.tree_utils.tree_get_all_with_path(
      resumed[1], 'count')]
  assert counts and all(int(c) == 6 for c in counts)


@pytest.fixture(scope='module')
def eight_devices(tmp_path_factory):
  return run_checks('conformance', tmp_path_factory.mktemp('sharded'))


@pytest.mark.xdist_group('eight_devices')   # one subprocess for all cases
@pytest.mark.parametrize('axis_type', ['Auto', 'Explicit'])
@each_case
def test_sharded_on_8_devices(case, axis_type, eight_devices):
  out = eight_devices[f'{case.name} {axis_type}']
  assert 'error' not in out, out.get('error')
  assert out['slots'] == [s.name for s in case.slots]
  assert out['steps'] == 6
  if axis_type == 'Auto':
    assert out['resumed_after'] == 3


# Rules whose learning rate enters the update nonlinearly (FTRL's proximal
# step, rowwise_rmsprop_ar's shrink `lr * ar_alpha * I`): no `scale_by_`
# form without it.
_NO_SCALE_BY = {'ftrl', 'rowwise_rmsprop_ar'}


def _public_of_rule_modules():
  """The top level's functions defined in a rule module of a case."""
  modules = {f'lazy_optax._src.{m}' for case in RULE_CASES
             for m in case.rule_modules}
  return [f for f in map(functools.partial(getattr, lazy_optax),
                         lazy_optax.__all__)
          if inspect.isfunction(f) and f.__module__ in modules]


def test_every_optimizer_of_the_top_level_is_a_case():
  # Read from lazy_optax.__all__: every optimizer `X(learning_rate, ...)`
  # of a rule module is the optimizer of a case, every `scale_by_X` the
  # scale_by of one, and each case of one rule has its scale_by_ form.
  public = _public_of_rule_modules()
  optimizers = {f.__name__ for f in public
                if next(iter(inspect.signature(f).parameters)) ==
                'learning_rate'}
  assert {'lazy_adam', 'lazy_adamw', 'ftrl',
          'rowwise_adagrad_with_counter'} <= optimizers
  assert optimizers <= {case.fn.__name__ for case in RULE_CASES}
  scale_bys = {f.__name__ for f in public
               if f.__name__.startswith('scale_by_')}
  assert scale_bys == {case.scale_by.__name__ for case in RULE_CASES
                       if case.scale_by is not None}
  for case in CASES:
    if len(case.rule_modules) == 1 and case.name not in _NO_SCALE_BY:
      assert case.scale_by is not None, case.name
      assert case.scale_by.__module__.endswith(case.rule_modules[0])
