"""Every composition docs/semantics.md lists: equal to dense training, or loud.

Each test runs the composition on row-sparse gradients with repeated ids and
compares the parameters with the same composition on the dense gradients
(`to_dense`, duplicates summed), or with the float64 model of the rule; or it
checks the error that the table in docs/semantics.md promises (at trace
time, or, for damaged ids under `jax.jit`, when the step runs: an exception
out of the step, a `CheckError` in checked mode).
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference

import lazy_optax
from lazy_optax import SparseRows

# JAX re-raises the callback's DamagedIdsError as its runtime error (a
# ValueError under vmap); the text holds the message either way.
STOPPED_STEP_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
V, D = 12, 3


def _batches(steps=3, n=7, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    ids = rng.integers(0, V // 2, size=n)       # many repeated ids
    ids[:3] = ids[0]                            # a hot id in three slots
    values = rng.normal(size=(n, D)).astype(np.float32) * 3
    out.append((jnp.asarray(ids, jnp.int32), jnp.asarray(values)))
  return out


def _table():
  return jnp.asarray(np.random.default_rng(1).normal(size=(V, D)), jnp.float32)


def _run_sparse(tx, batches, jit):
  params = {'t': _table()}
  state = tx.init(params)

  def step(params, state, g):
    updates, state = tx.update({'t': g}, state, params)
    return lazy_optax.apply_updates(params, updates), state

  if jit:
    step = jax.jit(step)
  for ids, values in batches:
    params, state = step(params, state, SparseRows(ids, values, V))
  return np.asarray(params['t'])


def _run_dense(tx, batches):
  """Dense training on the duplicate-summed gradients, each step one jitted
  program (eager, each operation was a program of its own)."""
  params = {'t': _table()}
  state = tx.init(params)

  @jax.jit
  def step(params, state, ids, values):
    g = {'t': SparseRows(ids, values, V).to_dense()}
    updates, state = tx.update(g, state, params)
    return optax.apply_updates(params, updates), state

  for ids, values in batches:
    params, state = step(params, state, ids, values)
  return np.asarray(params['t'])


# Dense training with each transform of EQUAL_BEFORE_LAZY on _batches(): the
# reference of both the eager and the jitted case, run once per process.
_DENSE_BEFORE_SGD = {}


def _dense_before_sgd(name):
  if name not in _DENSE_BEFORE_SGD:
    dense = optax.chain(EQUAL_BEFORE_LAZY[name](), optax.sgd(1.0))
    _DENSE_BEFORE_SGD[name] = _run_dense(dense, _batches())
  return _DENSE_BEFORE_SGD[name]


# -- group 1: equal to dense training ------------------------------------------

EQUAL_BEFORE_LAZY = {
    'clip_by_global_norm': lambda: optax.clip_by_global_norm(1.0),
    'clip': lambda: optax.clip(0.5),
    'scale': lambda: optax.scale(0.3),
    'normalize_by_update_norm': lambda: optax.normalize_by_update_norm(0.7),
    'zero_nans': optax.zero_nans,
    'jmp_style_unscale': lambda: optax.stateless(
        lambda u, p=None: jax.tree.map(lambda x: x / 1024.0, u)),
}


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
@pytest.mark.parametrize('name', sorted(EQUAL_BEFORE_LAZY))
def test_transform_before_lazy_equals_dense(name, jit):
  """A stateless transform outside lazy(...) sees what dense training sees:
  the duplicate-summed rows (the leaves of a SparseRows hold distinct ids)."""
  make = EQUAL_BEFORE_LAZY[name]
  lazy = optax.chain(make(), lazy_optax.lazy(optax.sgd(1.0)))
  np.testing.assert_allclose(_run_sparse(lazy, _batches(), jit),
                             _dense_before_sgd(name), rtol=1e-6, atol=1e-6)


def test_clip_before_lazy_as_first_reported():
  """ids [1, 1, 1, 1, 2], rows of ones: dense norm sqrt(17), not sqrt(5)."""
  ids, values = jnp.array([1, 1, 1, 1, 2]), jnp.ones((5, 1))
  params = {'t': jnp.zeros((4, 1))}
  for clip, row1 in ((optax.clip_by_global_norm(1.0), -4 / np.sqrt(17)),
                     (optax.clip(0.5), -0.5)):
    tx = optax.chain(clip, lazy_optax.lazy(optax.sgd(1.0)))

    # One program per clip (eager, each operation of a step on these new
    # shapes compiled a program of its own); the eager path is the
    # [*-eager] cases of test_transform_before_lazy_equals_dense.
    @jax.jit
    def step(params, state, ids, values, tx=tx):
      g = SparseRows(ids, values, 4)
      updates, _ = tx.update({'t': g}, state, params)
      return lazy_optax.apply_updates(params, updates)

    new = step(params, tx.init(params), ids, values)['t'][:, 0]
    np.testing.assert_allclose(new[1], row1, rtol=1e-6)


def test_zero_nans_before_lazy_matches_dense_with_a_nan():
  # Seven ids, as in _batches, so that the steps of the other tests run
  # (not new programs for three ids): four zero rows more on id 5 leave
  # its sum, and the dense gradient, as they were.
  ids = jnp.array([2, 2, 5, 5, 5, 5, 5])
  values = jnp.array([[1., np.nan, 1.], [1., 1., 1.], [2., 2., 2.]]
                     + [[0., 0., 0.]] * 4)
  tx = optax.chain(optax.zero_nans(), lazy_optax.lazy(optax.sgd(1.0)))
  dense = optax.chain(optax.zero_nans(), optax.sgd(1.0))
  np.testing.assert_allclose(_run_sparse(tx, [(ids, values)], True),
                             _run_dense(dense, [(ids, values)]))


def test_zero_nans_state_keeps_its_structure_only_inside_lazy():
  """docs/semantics.md: `zero_nans` before a lazy transformation records a
  row-sparse `found_nan` for a table after the first step (a structure that
  `init` did not give); inside `lazy(...)` the state keeps `init`'s."""
  params = {'t': jnp.zeros((V, D)), 'w': jnp.zeros(3)}
  grads = {'t': lazy_optax.SparseRows(jnp.array([1, 2]), jnp.ones((2, D)),
                                      V),
           'w': jnp.ones(3)}
  outside = optax.chain(optax.zero_nans(), lazy_optax.lazy_adam(0.1))
  inside = lazy_optax.lazy(optax.chain(optax.zero_nans(),
                                       lazy_optax.lazy_adam(0.1)))
  after = {}
  for tx, keeps in ((outside, False), (inside, True)):
    state = tx.init(params)
    _, after[keeps] = jax.eval_shape(tx.update, grads, state, params)
    assert (jax.tree.structure(after[keeps])
            == jax.tree.structure(state)) is keeps
  assert isinstance(after[False][0].found_nan['t'], lazy_optax.SparseRows)


def test_clip_before_lazy_adam_equals_float64_rule():
  batches = _batches(steps=4)
  got = _run_sparse(optax.chain(optax.clip_by_global_norm(0.5),
                                lazy_optax.lazy_adam(0.1)), batches, True)
  ref = reference.TFLazyAdam(_table(), lr=0.1)
  for ids, values in batches:
    summed = np.zeros((V, D))
    np.add.at(summed, np.asarray(ids), np.asarray(values, np.float64))
    scale = min(1.0, 0.5 / np.linalg.norm(summed))
    ref.step(np.asarray(ids), np.asarray(values, np.float64) * scale)
  np.testing.assert_allclose(got, ref.p, rtol=2e-5, atol=2e-6)


def test_apply_if_finite_around_clip_and_lazy_adam_equals_dense_adam_rows():
  """apply_if_finite skips a step with an inf; the others are applied."""
  batches = _batches(steps=3)
  ids, values = batches[1]
  batches[1] = (ids, values.at[0, 0].set(jnp.inf))
  tx = optax.apply_if_finite(optax.chain(optax.clip_by_global_norm(1.0),
                                         lazy_optax.lazy(optax.sgd(1.0))), 5)
  dense = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  np.testing.assert_allclose(_run_sparse(tx, batches, True),
                             _run_dense(dense, [batches[0], batches[2]]),
                             rtol=1e-6, atol=1e-6)


def test_masked_table_equals_dense():
  mask = {'t': True}
  tx = optax.masked(lazy_optax.lazy(optax.sgd(0.5)), mask)
  np.testing.assert_allclose(
      _run_sparse(tx, _batches(), True),
      _run_dense(optax.masked(optax.sgd(0.5), mask), _batches()), rtol=1e-6)


@pytest.mark.parametrize('scale', [2.0 ** -66, 1e-19, 1e-6, 1e6, 3e30])
def test_scaling_the_tree_keeps_the_rows(scale):
  """Any factor of magnitude >= 2**-66 keeps the rows (docs/semantics.md)."""
  ids, values = _batches(steps=1)[0]

  @jax.jit
  def scaled(g):
    return jax.tree.map(lambda x: x * scale, g)

  g = scaled(SparseRows(ids, values, V))
  np.testing.assert_allclose(
      g.to_dense(), SparseRows(ids, values, V).to_dense() * np.float32(scale),
      rtol=1e-6)


# -- group 2: an error at trace time that says what to write instead -------

def _first_step(tx):
  params = {'t': _table()}
  ids, values = _batches(steps=1)[0]
  return jax.jit(tx.update)({'t': SparseRows(ids, values, V)},
                            tx.init(params), params)


@pytest.mark.parametrize('make', [
    optax.scale_by_adam,
    lambda: optax.add_decayed_weights(1e-4),
    lambda: optax.MultiSteps(optax.sgd(0.1), 2),
], ids=['scale_by_adam', 'add_decayed_weights', 'MultiSteps'])
def test_transform_pairing_sparse_with_dense_raises_with_advice(make):
  tx = make()
  if not isinstance(tx, optax.MultiSteps):
    tx = optax.chain(tx, lazy_optax.lazy(optax.sgd(1.0)))
  with pytest.raises(ValueError, match=r"(?s)key path.*\['t'\].*lazy_optax"):
    _first_step(tx)


def test_partition_sending_a_table_to_a_plain_optimizer_names_it():
  tx = optax.partition({'lazy': lazy_optax.lazy_adam(0.1),
                        'dense': optax.adam(0.1)}, {'t': 'dense'})
  with pytest.raises(ValueError, match=r"(?s)\['t'\].*lazy_optax.lazy\(\.\.\.\)"):
    _first_step(tx)


def test_equinox_apply_updates_names_the_lazy_optax_one():
  eqx = pytest.importorskip('equinox')
  g = SparseRows(jnp.array([1]), jnp.ones((1, D)), V)
  with pytest.raises(ValueError,
                     match='lazy_optax.equinox.apply_updates'):
    eqx.apply_updates({'t': _table()}, {'t': g})


@pytest.mark.parametrize('ids_per_step', [{}, {'other': 3}],
                         ids=['empty', 'another_table'])
def test_multi_steps_without_the_table_in_ids_per_step_raises(ids_per_step):
  params = {'t': _table(), 'other': jnp.zeros((5, 2))}
  tx = lazy_optax.wrappers.multi_steps(lazy_optax.lazy_adam(0.1), 2,
                              ids_per_step=ids_per_step)
  other = (SparseRows(jnp.array([1, 2, 3]), jnp.ones((3, 2)), 5)
           if ids_per_step else jnp.zeros((5, 2)))
  grads = {'t': SparseRows(jnp.array([1, 1]), jnp.ones((2, D)), V),
           'other': other}
  with pytest.raises(ValueError, match=r"ids_per_step.*'t': <ids per step>"):
    jax.jit(tx.update)(grads, tx.init(params), params)


def test_multi_steps_moves_only_rows_of_the_window():
  """With the table named, rows absent from a window never move."""
  params = {'t': _table()}
  tx = lazy_optax.wrappers.multi_steps(lazy_optax.lazy_adam(0.1), 2,
                              ids_per_step={'t': 7})
  state = tx.init(params)
  touched = set()

  @jax.jit  # the whole step: eager, each operation was a program of its own
  def step(params, state, ids, values):
    updates, state = tx.update({'t': SparseRows(ids, values, V)}, state,
                               params)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values in _batches(steps=4):
    touched |= set(np.asarray(ids).tolist())
    params, state = step(params, state, ids, values)
  moved = set(np.flatnonzero(np.any(np.asarray(params['t']) != np.asarray(
      _table()), axis=1)).tolist())
  assert moved == touched


_MULTI_STEPS_RULES = {
    'lazy_adam': lambda: lazy_optax.lazy_adam(0.1, impl='xla'),
    'lazy(optax.adam)': lambda: lazy_optax.lazy(optax.adam(0.1), impl='xla'),
    'adam_with_counter': lambda: lazy_optax.adam_with_counter(
        0.1, weight_decay=0.3, decay_skipped_steps=True, impl='xla'),
    'rowwise_adagrad': lambda: lazy_optax.rowwise_adagrad(0.1, impl='xla'),
    'ftrl': lambda: lazy_optax.ftrl(0.1, impl='xla'),
    'chain(clip_by_global_norm, lazy_adam)': lambda: optax.chain(
        optax.clip_by_global_norm(0.5), lazy_optax.lazy_adam(0.1, impl='xla')),
}


@pytest.mark.parametrize('name', sorted(_MULTI_STEPS_RULES))
def test_multi_steps_on_xla_path_is_the_rule_once_a_window(name):
  """XLA's path runs the rule at every step, branch-free: the steps that do
  not end a window leave the parameters and the rule's state (its count
  included) exactly as they were, and the one that does equals the rule,
  run on its own, on the window's mean gradient."""
  k, n = 3, 7
  tx = lazy_optax.wrappers.multi_steps(_MULTI_STEPS_RULES[name](), k,
                                       ids_per_step={'t': n})
  rule = _MULTI_STEPS_RULES[name]()
  params = {'t': _table(), 'w': jnp.arange(4.0)}
  ref_params, state, ref_state = params, tx.init(params), rule.init(params)

  @jax.jit
  def step(params, state, ids, values, w):
    updates, state = tx.update({'t': SparseRows(ids, values, V), 'w': w},
                               state, params)
    return lazy_optax.apply_updates(params, updates), state

  @jax.jit
  def rule_step(params, state, ids, values, w):
    updates, state = rule.update({'t': SparseRows(ids, values, V), 'w': w},
                                 state, params)
    return lazy_optax.apply_updates(params, updates), state

  batches = _batches(steps=2 * k, n=n, seed=3)
  rng = np.random.default_rng(4)
  dense = [rng.normal(size=(4,)).astype(np.float32) for _ in batches]
  for i, ((ids, values), w) in enumerate(zip(batches, dense)):
    old = (params, state.inner_state)
    new, state = step(params, state, ids, values, w)
    if i % k != k - 1:
      for a, b in zip(jax.tree.leaves(old),
                      jax.tree.leaves((new, state.inner_state))):
        np.testing.assert_array_equal(a, b)
    else:
      window = range(i - k + 1, i + 1)
      ref_params, ref_state = rule_step(
          ref_params, ref_state,
          np.concatenate([batches[j][0] for j in window]),
          np.concatenate([batches[j][1] for j in window]) / k,
          sum(dense[j] for j in window) / k)
      for a, b in zip(jax.tree.leaves((ref_params, ref_state)),
                      jax.tree.leaves((new, state.inner_state))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    params = new
  assert int(state.gradient_step) == 2


def _dense_trace(decay):
  """A transformation that is not lazy: it densifies a table's gradient and
  keeps a dense trace of it, which decays at every update."""
  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(grads, trace, params=None):
    del params
    dense = jax.tree.map(
        lambda g: g.to_dense() if isinstance(g, SparseRows) else g, grads,
        is_leaf=lazy_optax.tree.is_sparse_rows)
    trace = jax.tree.map(lambda t, g: decay * t + g, trace, dense)
    return jax.tree.map(lambda t: -t, trace), trace

  return optax.GradientTransformation(init, update)


def test_multi_steps_keeps_a_dense_state_of_a_table_between_windows():
  """A rule whose state of a table is dense (not lazy) would decay it at
  every step if run branch-free: multi_steps skips it on the steps that do
  not end a window, and the trace is that of the window means."""
  k, n, decay = 2, 7, 0.5
  tx = lazy_optax.wrappers.multi_steps(_dense_trace(decay), k,
                                       ids_per_step={'t': n})
  params = {'t': _table()}
  state = tx.init(params)
  step = jax.jit(tx.update)
  batches = _batches(steps=3 * k, n=n, seed=5)
  trace = np.zeros((V, D))
  for i, (ids, values) in enumerate(batches):
    updates, state = step({'t': SparseRows(ids, values, V)}, state, params)
    if i % k == k - 1:
      mean = np.zeros((V, D))
      for j in range(i - k + 1, i + 1):
        np.add.at(mean, np.asarray(batches[j][0]),
                  np.asarray(batches[j][1], np.float64))
      trace = decay * trace + mean / k
    np.testing.assert_allclose(state.inner_state['t'], trace, rtol=1e-6,
                               atol=1e-6)


# -- group 3 (formerly "reported"): an error when the step runs -------------

def _raw_reduce(reduce):
  """Two devices' gradients combined leaf by leaf with a raw collective."""

  def change(g):
    stacked = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), g)
    reduced = jax.vmap(lambda h: reduce(h, 'd'), axis_name='d')(stacked)
    return jax.tree.map(lambda x: x[0], reduced)

  return change


_DAMAGING = {
    'scale_1e-30': lambda g: jax.tree.map(lambda x: x * 1e-30, g),
    'scale_2^-70': lambda g: jax.tree.map(lambda x: x * 2.0 ** -70, g),
    'tree_add': lambda g: jax.tree.map(jnp.add, g, SparseRows(
        jnp.arange(7) % V, jnp.ones((7, D)), V)),
    'optax_tree_add': lambda g: optax.tree.add(g, SparseRows(
        jnp.arange(7) % V, jnp.ones((7, D)), V)),
    'add_noise': lambda g: optax.add_noise(0.1, 0.5, 0).update(
        g, optax.add_noise(0.1, 0.5, 0).init(g))[0],
    'centralize': lambda g: optax.centralize().update(
        g, optax.centralize().init(g))[0],
    'raw_psum': _raw_reduce(jax.lax.psum),
    'raw_pmean': _raw_reduce(jax.lax.pmean),
}
_STOPPED = r'DamagedIdsError: The row ids of parameter t were changed'


def _plain_step(change, tx):
  def step(params, state, g):
    updates, state = tx.update({'t': change(g)}, state, params)
    return lazy_optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize('name', sorted(_DAMAGING))
def test_damaged_ids_stop_the_jitted_step(name):
  change = _DAMAGING[name]
  ids, values = _batches(steps=1)[0]
  g = SparseRows(ids, values, V)
  tx = lazy_optax.lazy(optax.sgd(1.0))
  params = {'t': _table()}
  # Default: an exception out of the jitted, donated step.
  step = jax.jit(_plain_step(change, tx), donate_argnums=(0, 1))
  with pytest.raises(STOPPED_STEP_ERRORS, match=_STOPPED) as stopped:
    jax.block_until_ready(step(params, tx.init(params), g))
  # The text says that the donated state is gone, and the recoverable way.
  assert 'JAX deletes donated inputs' in str(stopped.value)
  assert 'lazy_optax.perf.make_train_step' in str(stopped.value)
  # Checked mode: a CheckError carrying outputs in which no row moved.
  checked_tx = lazy_optax.checks.with_id_checks(tx)
  params = {'t': _table()}
  with pytest.raises(lazy_optax.checks.CheckError,
                     match='row ids of parameter t') as info:
    lazy_optax.checks.checked(jax.jit(_plain_step(change, checked_tx)))(
        params, checked_tx.init(params), g)
  np.testing.assert_array_equal(info.value.outputs[0]['t'], _table())


def test_vmapped_step_raises_only_for_damaged_ids():
  # Under vmap the error branch runs for every member (the cond becomes a
  # select): intact ids must not raise, damaged ones must.
  tx = lazy_optax.lazy(optax.sgd(1.0))

  def step(params, g, other):
    g = jax.tree.map(lambda x: x * 0.5, g)
    g = jax.tree.map(jnp.add, g, other)
    updates, _ = tx.update({'t': g}, tx.init(params), params)
    return lazy_optax.apply_updates(params, updates)

  params = {'t': jnp.zeros((2, V, D))}
  # The gradients built in one program each (eager, every operation of the
  # vmapped constructor was a program of its own).
  rows = jax.jit(jax.vmap(lambda i: SparseRows(i, jnp.ones((2, D)), V)))
  g = rows(jnp.array([[1, 2], [3, 3]]))
  zero = jax.jit(lambda g: jax.tree.map(jnp.zeros_like, g))(g)
  run = jax.jit(jax.vmap(step))
  out = np.asarray(run(params, g, zero)['t'][:, :5, 0])
  np.testing.assert_array_equal(out, [[0, -0.5, -0.5, 0, 0],
                                      [0, 0, 0, -1, 0]])
  other = rows(jnp.array([[5, 6], [7, 8]]))
  with pytest.raises(STOPPED_STEP_ERRORS, match=_STOPPED):
    jax.block_until_ready(run(params, g, other))


def test_warn_mode_is_an_explicit_opt_in():
  change = _DAMAGING['tree_add']
  ids, values = _batches(steps=1)[0]
  tx = lazy_optax.lazy(optax.sgd(1.0))
  params = {'t': _table()}
  old = lazy_optax.checks.on_damaged_ids('warn')
  try:
    step = jax.jit(_plain_step(change, tx))
    with pytest.warns(RuntimeWarning, match='row ids of parameter t'):
      new = jax.block_until_ready(
          step(params, tx.init(params), SparseRows(ids, values, V)))
  finally:
    assert lazy_optax.checks.on_damaged_ids(old) == 'warn'
  np.testing.assert_array_equal(new[0]['t'], _table())
  with pytest.raises(ValueError, match="mode must be one of"):
    lazy_optax.checks.on_damaged_ids('ignore')


# -- keyword deprecation and hyperparameters ---------------------------------

def test_indices_keyword_is_deprecated_and_still_works():
  with pytest.warns(DeprecationWarning, match='SparseRows\\(ids=...\\)'):
    g = SparseRows(indices=jnp.array([3, 1]), values=jnp.ones((2, 1)),
                   num_rows=5)
  np.testing.assert_array_equal(g.ids, [1, 3])   # distinct, ascending
  with pytest.raises(TypeError, match='once'):
    SparseRows(jnp.array([1]), jnp.ones((1, 1)), 5, indices=jnp.array([1]))
  with pytest.raises(TypeError, match="'num_rows'"):
    SparseRows(jnp.array([1]), jnp.ones((1, 1)))


def test_traced_and_scheduled_hyperparameters_pass():
  tx = optax.inject_hyperparams(lazy_optax.lazy_adam)(
      learning_rate=optax.linear_schedule(0.1, 0.0, 10), b1=0.9)
  params = {'t': _table()}
  state = tx.init(params)
  g = {'t': SparseRows(jnp.array([1]), jnp.ones((1, D)), V)}
  updates, _ = jax.jit(tx.update)(g, state, params)
  assert np.all(np.isfinite(updates['t'].values))


def test_leaves_concatenated_by_a_tree_map_are_summed_again():
  """Flattened rows are distinct; rows joined leaf by leaf may repeat ids and
  are summed again before the scatter (never written twice)."""
  (ids1, v1), (ids2, v2) = _batches(steps=2)

  @jax.jit
  def joined(g1, g2):
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), g1, g2)

  g = joined(SparseRows(ids1, v1, V), SparseRows(ids2, v2, V))
  both = [(jnp.concatenate([ids1, ids2]), jnp.concatenate([v1, v2]))]
  tx = lazy_optax.lazy(optax.sgd(1.0))
  params = {'t': _table()}

  @jax.jit  # the whole step: eager, each operation was a program of its own
  def step(params, state, g):
    updates, _ = tx.update({'t': g}, state, params)
    return lazy_optax.apply_updates(params, updates)

  # Dense sgd(1.0) on the duplicate-summed rows, in numpy.
  (ids, values), = both
  want = np.asarray(_table()).copy()
  np.subtract.at(want, np.asarray(ids), np.asarray(values))
  np.testing.assert_allclose(step(params, tx.init(params), g)['t'], want,
                             rtol=1e-6)
