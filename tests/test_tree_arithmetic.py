"""Gradient-tree arithmetic (accumulation, psum, loss scaling) and row ids.

First the cases that used to move updates to rows nobody named, each now
refused eagerly and, under jit, writing no row; then the supported ways, each
against an independent float64 reference.
"""

import functools

import eight_devices
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import TFLazyAdam

import lazy_optax
from lazy_optax import SparseRows

# JAX re-raises the callback's DamagedIdsError as its runtime error (a
# ValueError under vmap); the text holds the message either way.
STOPPED_STEP_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
V, D = 10, 2
DAMAGED = r'row ids of parameter t were changed by arithmetic'


# Test data made in numpy and put on the device (eager jnp operations, and
# jnp.asarray itself, each compile a program per shape).
def _params():
  t = np.arange(V * D, dtype=np.float32).reshape(V, D) / np.float32(10)
  return {'t': jax.device_put(t),
          'w': jax.device_put(np.ones((D,), np.float32))}


def _grads(ids, scale=1.0):
  if not isinstance(ids, jax.Array):   # a list; traced ids stay as they are
    ids = jax.device_put(np.asarray(ids, np.int32))
  values = np.float32(scale) * (
      1 + np.arange(ids.shape[0] * D, dtype=np.float32)).reshape(-1, D)
  return {'t': SparseRows(ids, jax.device_put(values), V),
          'w': jax.device_put(np.full((D,), 0.5, np.float32))}


def _ref(steps, lr=0.1):
  """The float64 rule on the table, fed (ids, values) per step."""
  ref = TFLazyAdam(_params()['t'], lr=lr)
  for ids, values in steps:
    ref.step(ids, values)
  return ref


def _rows_of(g):
  return np.asarray(g['t'].ids), np.asarray(g['t'].values)


def _step(tx, grads, params=None, state=None):
  params = _params() if params is None else params
  state = tx.init(params) if state is None else state
  updates, state = tx.update(grads, state, params)
  return lazy_optax.apply_updates(params, updates), state


# -- the silent cases, reproduced: now refused -------------------------------

@pytest.mark.parametrize('combine', [
    lambda g1, g2: jax.tree.map(jnp.add, g1, g2),
    lambda g1, g2: optax.tree_utils.tree_add(g1, g2),
    lambda g1, g2: jax.tree.map(jnp.subtract, g1, g2),
    lambda g1, g2: jax.tree.map(lambda a, b: (a + b) / 2, g1, g2),
], ids=['tree_map_add', 'optax_tree_add', 'subtract', 'mean'])
def test_tree_arithmetic_on_two_batches_is_refused_eagerly(combine):
  bad = combine(_grads([1, 2]), _grads([3, 4]))
  tx = lazy_optax.lazy_adam(0.1)
  # The first line says what to write instead.
  with pytest.raises(ValueError, match=DAMAGED + r'[^\n]*: combine gradient '
                     r'trees with lazy_optax\.tree\.add\(g1, g2\)'):
    _step(tx, bad)
  with pytest.raises(ValueError, match=DAMAGED):
    lazy_optax.apply_updates(_params(), bad)
  with pytest.raises(ValueError, match=r'row ids of a SparseRows were changed'):
    bad['t'].add_to(_params()['t'])


def test_under_jit_damaged_ids_stop_the_step():
  tx = lazy_optax.lazy_adam(0.1)
  params = _params()

  def step(params, state, ids1, ids2):
    grads = jax.tree.map(jnp.add, _grads(ids1), _grads(ids2))
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  ids = (jnp.array([1, 2]), jnp.array([3, 4]))
  with pytest.raises(STOPPED_STEP_ERRORS,
                     match='DamagedIdsError: The ' + DAMAGED):
    jax.block_until_ready(jax.jit(step)(params, tx.init(params), *ids))
  old = lazy_optax.checks.on_damaged_ids('warn')
  try:
    with pytest.warns(RuntimeWarning, match=DAMAGED):
      new_params, new_state = jax.block_until_ready(
          jax.jit(step)(params, tx.init(params), *ids))
  finally:
    lazy_optax.checks.on_damaged_ids(old)
  # Warn-only: no row of the table nor of its state was written, and the
  # dense leaf took its step.
  np.testing.assert_array_equal(new_params['t'], params['t'])
  for name in ('mu', 'nu'):
    assert not np.any(optax.tree_utils.tree_get(new_state, name)['t'])
  assert not np.array_equal(new_params['w'], params['w'])


def test_checked_mode_reports_damaged_ids_under_jit():
  tx = lazy_optax.checks.with_id_checks(lazy_optax.lazy_adam(0.1))
  params = _params()

  @jax.jit
  def step(params, state, ids1, ids2):
    grads = jax.tree.map(jnp.add, _grads(ids1), _grads(ids2))
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  with pytest.raises(lazy_optax.checks.CheckError,
                     match=DAMAGED + r' on the gradient tree \(2 of 2 ids '
                     r'damaged\)') as info:
    lazy_optax.checks.checked(step)(params, tx.init(params), jnp.array([1, 2]),
                                    jnp.array([3, 4]))
  np.testing.assert_array_equal(info.value.outputs[0]['t'], params['t'])


def test_casts_and_reshapes_of_the_ids_fail_at_trace_time():
  for cast in (jnp.bfloat16, jnp.float16, jnp.int32):
    grads = jax.tree.map(lambda x, c=cast: x.astype(c), _grads([1, 2]))
    with pytest.raises(TypeError, match=r'row ids of parameter t were cast'):
      jax.jit(lambda g: _step(lazy_optax.lazy_adam(0.1), g))(grads)


# -- scaling by a number: values only -----------------------------------------

@pytest.mark.parametrize('scale', [
    lambda g: jax.tree.map(lambda x: x * 2, g),        # an integer
    lambda g: jax.tree.map(lambda x: x * 2.0, g),
    lambda g: lazy_optax.tree.scale(g, 2.0),
    lambda g: optax.tree.scale(2.0, g),
], ids=['tree_map_int', 'tree_map_float', 'tree_scale', 'optax_tree_scale'])
@pytest.mark.parametrize('jit', [False, True])
def test_scaling_gradients_by_a_number_scales_values_only(scale, jit):
  grads = _grads([1, 2, 2])
  scaled = (jax.jit(scale) if jit else scale)(grads)
  ids, values = _rows_of(grads)
  # The same rows (summed where a tree map saw its duplicate-summed leaves),
  # with the same dense meaning, doubled.
  np.testing.assert_allclose(scaled['t'].to_dense(),
                             2 * grads['t'].to_dense())
  named = np.asarray(scaled['t'].ids)
  np.testing.assert_array_equal(np.unique(named[named < V]), [1, 2])
  params, _ = _step(lazy_optax.lazy_adam(0.1), scaled)
  np.testing.assert_allclose(params['t'], _ref([(ids, 2 * values)]).p,
                             rtol=1e-5)


# -- accumulation ----------------------------------------------------------------

def test_sparse_rows_plus_sparse_rows_concatenates_and_sums():
  g1, g2 = _grads([1, 2])['t'], _grads([3, 2], scale=2.0)['t']
  total = g1 + g2
  # Four slots: the distinct ids ascending, then one that names no row.
  np.testing.assert_array_equal(total.ids, [1, 2, 3, V])
  np.testing.assert_array_equal(total.values[3], np.zeros(D))
  np.testing.assert_allclose(total.to_dense(),
                             np.asarray(g1.to_dense()) + g2.to_dense())
  with pytest.raises(ValueError, match='different shapes'):
    _ = g1 + SparseRows(jnp.array([1]), jnp.ones((1, D)), V + 1)


def test_tree_add_of_microbatches_equals_one_step_on_the_whole_batch():
  g1, g2, g3 = _grads([1, 2]), _grads([3, 4, 1]), _grads([9], scale=3.0)
  total = lazy_optax.tree.add(g1, g2, g3)
  np.testing.assert_allclose(total['w'], 1.5)
  ids = np.concatenate([_rows_of(g)[0] for g in (g1, g2, g3)])
  values = np.concatenate([_rows_of(g)[1] for g in (g1, g2, g3)])
  params, _ = _step(lazy_optax.lazy_adam(0.1), total)
  np.testing.assert_allclose(params['t'], _ref([(ids, values)]).p, rtol=1e-5)
  # A dense leaf plus a SparseRows leaf is dense.
  mixed = lazy_optax.tree.add({'t': jnp.ones((V, D))}, {'t': g1['t']})
  np.testing.assert_allclose(mixed['t'], 1 + np.asarray(g1['t'].to_dense()))


def test_multi_steps_equals_the_rule_on_the_mean_gradient():
  k = 3
  tx = lazy_optax.wrappers.multi_steps(lazy_optax.lazy_adam(0.1), every_k=k,
                              ids_per_step={'t': 2})
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  micro = [[1, 2], [2, 7], [4, 4], [0, 9], [9, 9], [3, 1]]
  for i, ids in enumerate(micro):
    updates, state = update(_grads(ids), state, params)
    new = lazy_optax.apply_updates(params, updates)
    if i % k != k - 1:  # no update until the k-th microbatch
      np.testing.assert_array_equal(new['t'], params['t'])
    params = new
  ref = _ref([
      (np.concatenate([_rows_of(_grads(i))[0] for i in micro[s:s + k]]),
       np.concatenate([_rows_of(_grads(i))[1] for i in micro[s:s + k]]) / k)
      for s in (0, k)])
  np.testing.assert_allclose(params['t'], ref.p, rtol=1e-5)
  assert int(state.gradient_step) == 2
  with pytest.raises(ValueError, match=r'2 ids per step for parameter t, got '
                     r'a SparseRows of 3 ids'):
    tx.update(_grads([1, 2, 3]), tx.init(params), params)
  with pytest.raises(ValueError, match=r"names \['nope'\]"):
    lazy_optax.wrappers.multi_steps(lazy_optax.lazy_adam(0.1), 2, {'nope': 2}).init(
        params)


# -- loss scaling ---------------------------------------------------------------

def _loss(params, ids):
  rows = lazy_optax.lookup(params['t'], ids)
  return jnp.sum((rows @ params['w'] - 1.0) ** 2)


def test_jmp_dynamic_loss_scaling_unscales_values_only():
  jmp = pytest.importorskip('jmp')
  tx = lazy_optax.lazy_adam(0.1)
  ids = jnp.array([1, 5, 5, 2])

  @jax.jit
  def step(params, state, scale):
    loss_fn = lambda p: scale.scale(_loss(p, ids))
    _, grads = lazy_optax.value_and_grad(loss_fn)(params)
    grads = scale.unscale(grads)
    finite = jmp.all_finite(grads)
    updates, new_state = tx.update(grads, state, params)
    new_params = lazy_optax.apply_updates(params, updates)
    params, state = jmp.select_tree(finite, (new_params, new_state),
                                    (params, state))
    return params, state, scale.adjust(finite)

  params = _params()
  scale = jmp.DynamicLossScale(jnp.float32(2.0 ** 15))
  got, _, _ = step(params, tx.init(params), scale)
  # The reference, the same step without a loss scale, in one program.
  want = jax.jit(lambda p: _step(
      tx, lazy_optax.value_and_grad(_loss)(p, ids)[1], p)[0])(params)
  np.testing.assert_allclose(got['t'], want['t'], rtol=1e-6)
  # A loss scale that overflows gives non-finite gradients: step skipped.
  huge = jmp.DynamicLossScale(jnp.float32(3e38))
  skipped, _, adjusted = step(params, tx.init(params), huge)
  np.testing.assert_array_equal(skipped['t'], params['t'])
  assert float(adjusted.loss_scale) < 3e38


# -- plain optax before and after a lazy transformation -----------------------

def test_clip_by_global_norm_before_lazy_adam_clips_the_values():
  tx = optax.chain(optax.clip_by_global_norm(1.0), lazy_optax.lazy_adam(0.1))
  grads = _grads([1, 2, 2])
  ids, values = _rows_of(grads)
  norm = np.sqrt(np.sum(values.astype(np.float64) ** 2) + 2 * 0.5 ** 2)
  params, _ = jax.jit(lambda g: _step(tx, g))(grads)
  np.testing.assert_allclose(params['t'], _ref([(ids, values / norm)]).p,
                             rtol=1e-5)


@pytest.mark.parametrize('plain, expected', [
    (optax.scale(0.5), lambda u: 0.5 * u),
    (optax.clip(0.05), lambda u: np.clip(u, -0.05, 0.05)),
    (optax.zero_nans(), lambda u: u),
])
def test_plain_optax_after_a_lazy_one_acts_on_the_values(plain, expected):
  grads = _grads([1, 2, 2])
  ref_updates, _ = lazy_optax.lazy_adam(0.1).update(
      grads, lazy_optax.lazy_adam(0.1).init(_params()), _params())
  tx = optax.chain(lazy_optax.lazy_adam(0.1), plain)
  updates, _ = jax.jit(tx.update)(grads, tx.init(_params()), _params())
  np.testing.assert_array_equal(updates['t'].ids, ref_updates['t'].ids)
  np.testing.assert_allclose(updates['t'].values,
                             expected(np.asarray(ref_updates['t'].values)),
                             rtol=1e-6)


def test_plain_optax_that_pairs_updates_with_params_says_what_to_do():
  tx = optax.chain(lazy_optax.lazy_adam(0.1), optax.add_decayed_weights(0.1))
  with pytest.raises(ValueError, match=r'put other transformations inside '
                     r'lazy_optax\.lazy'):
    _step(tx, _grads([1]))


def test_partition_label_function_over_gradient_leaves_says_what_to_use():
  tx = optax.partition(
      {'a': lazy_optax.lazy_adam(0.1), 'b': optax.adam(0.1)},
      lambda tree: jax.tree.map(lambda x: 'a' if x.ndim == 2 else 'b', tree))
  with pytest.raises(ValueError, match=r'lazy_optax\.tree\.path_labels'):
    _step(tx, _grads([1]))


def test_apply_if_finite_rejected_step_writes_nothing():
  tx = optax.apply_if_finite(lazy_optax.lazy_adam(0.1), 3)
  grads = _grads([1, 0])
  grads['w'] = jnp.array([jnp.nan, 1.0])
  for run in (lambda g: _step(tx, g), jax.jit(lambda g: _step(tx, g))):
    params, _ = run(grads)
    np.testing.assert_array_equal(params['t'], _params()['t'])


# -- data parallelism on 8 simulated devices ---------------------------------

def test_tree_psum_and_pmean_across_8_devices_match_one_device():
  # data_parallel_checks.main, in the 8-device process (it raises on a
  # failed check).
  _, printed = eight_devices.call('data_parallel_checks', 'main',
                                  with_stdout=True)
  assert 'data parallel checks passed' in printed


# -- through the framework layers ---------------------------------------------

def test_haiku_step_with_loss_scaling_and_apply_if_finite():
  hk = pytest.importorskip('haiku')
  jmp = pytest.importorskip('jmp')
  import lazy_optax.haiku  # noqa: F401  (the optional module)

  def forward(ids):
    return jnp.sum(lazy_optax.haiku.Embed(V, D, name='emb')(ids), axis=-1)

  f = hk.without_apply_rng(hk.transform(forward))
  ids = jnp.array([1, 4, 4, 7])
  params = f.init(jax.random.key(0), ids)
  tx = optax.apply_if_finite(lazy_optax.lazy_adam(0.1), 5)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, scale, target):
    loss = lambda p: scale.scale(jnp.sum((f.apply(p, ids) - target) ** 2))
    _, grads = lazy_optax.value_and_grad(loss)(params)
    updates, state = tx.update(scale.unscale(grads), state)
    return optax.apply_updates(params, updates), state

  table = params['emb']['embeddings']
  state = tx.init(params)
  before = np.asarray(table)
  params, state = step(params, state, jmp.StaticLossScale(jnp.float32(128.)),
                       jnp.float32(1.0))
  after = np.asarray(params['emb']['embeddings'])
  moved = np.flatnonzero(np.any(after != before, axis=1))
  np.testing.assert_array_equal(moved, [1, 4, 7])
  # A non-finite loss scale is a skipped step: nothing moves.
  params2, state = step(params, state, jmp.StaticLossScale(jnp.float32(
      np.inf)), jnp.float32(1.0))
  np.testing.assert_array_equal(params2['emb']['embeddings'], after)
  assert int(state.notfinite_count) == 1


def test_flax_train_state_with_clipping_before_lazy_adam():
  pytest.importorskip('flax')
  import flax.linen as nn
  from flax.training import train_state

  import lazy_optax.flax  # noqa: F401  (the optional module)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return jnp.sum(lazy_optax.flax.Embed(V, D)(ids), axis=-1)

  model = Model()
  ids = jnp.array([2, 3, 3])
  variables = model.init(jax.random.key(0), ids)
  ts = train_state.TrainState.create(
      apply_fn=model.apply, params=variables['params'],
      tx=optax.chain(optax.clip_by_global_norm(1e-3),
                     lazy_optax.lazy_adam(0.1)))
  loss = lambda p: jnp.sum((ts.apply_fn({'params': p}, ids) - 5.0) ** 2)
  _, grads = lazy_optax.value_and_grad(loss)(ts.params)
  new = jax.jit(lambda ts, g: ts.apply_gradients(grads=g))(ts, grads)
  before = np.asarray(ts.params['Embed_0']['embedding'])
  after = np.asarray(new.params['Embed_0']['embedding'])
  np.testing.assert_array_equal(
      np.flatnonzero(np.any(after != before, axis=1)), [2, 3])
  # Adam's first step moves each touched entry by about lr, clipped or not.
  np.testing.assert_allclose(np.abs(after - before)[[2, 3]], 0.1, rtol=1e-3)


# -- advice that works: the fixes the messages name, run on a dict ------------

def _lookup_loss(p, ids):
  return jnp.sum((lazy_optax.lookup(p['t'], ids) @ p['w'] - 1.0) ** 2)


def test_zeros_like_params_accumulation_is_refused_with_the_fix():
  """The issue's loop: two microbatches accumulated into zeros_like(params)
  turned the table's update dense (every row moved); now refused at trace
  time, and the fix its first line names trains only the touched rows."""
  tx = lazy_optax.lazy_adam(0.1)
  ids1, ids2 = np.array([1, 2, 2]), np.array([2, 5])

  def step(accumulate):
    def run(params, state, ids1, ids2):
      _, g1 = lazy_optax.value_and_grad(_lookup_loss)(params, ids1)
      _, g2 = lazy_optax.value_and_grad(_lookup_loss)(params, ids2)
      updates, state = tx.update(accumulate(params, g1, g2), state, params)
      return lazy_optax.apply_updates(params, updates), state
    return jax.jit(run)

  zeros_like = step(lambda p, g1, g2: jax.tree.map(
      lambda a, b, c: a + b + c, jax.tree.map(jnp.zeros_like, p), g1, g2,
      is_leaf=lazy_optax.tree.is_sparse_rows))
  params = _params()
  with pytest.raises(ValueError) as e:
    zeros_like(params, tx.init(params), ids1, ids2)
  first = str(e.value).splitlines()[0]
  assert first.startswith('Parameter t gets a dense gradient, but '
                          'lazy_optax.value_and_grad gave it a SparseRows')
  assert 'lazy_optax.tree.add(g1, g2) starting from the first' in first
  # explain_update says which rule the dense gradient gets.
  dense = {'t': jnp.zeros((V, D)), 'w': jnp.zeros((D,))}
  choice = lazy_optax.explain_update(tx, dense, tx.init(params), params)
  assert choice['t'].impl == 'dense' and 'every row' in choice['t'].reason
  # The fix, on the dict: only rows 1, 2 and 5 move, as the float64 rule.
  fixed = step(lambda p, g1, g2: lazy_optax.tree.add(g1, g2))
  new, _ = fixed(params, tx.init(params), ids1, ids2)
  w, t = np.ones(D), np.asarray(params['t'], np.float64)
  ids = np.concatenate([ids1, ids2])
  rows = 2 * (t[ids] @ w - 1.0)[:, None] * w[None, :]
  want = _ref([(ids, rows)]).p
  np.testing.assert_allclose(new['t'], want, rtol=1e-6)
  moved = np.flatnonzero(np.any(np.asarray(new['t']) != params['t'], 1))
  np.testing.assert_array_equal(moved, [1, 2, 5])


def test_every_fix_the_messages_name_runs_on_a_dict():
  """Each code the error messages suggest, taken from their text and run on
  a dict of gradients, gives what it promises."""
  g1, g2 = _grads([1, 2]), _grads([3, 2], scale=0.5)
  bad = jax.tree.map(jnp.add, g1, g2)
  with pytest.raises(ValueError) as damaged:
    _step(lazy_optax.lazy_adam(0.1), bad)
  cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), g1)
  with pytest.raises(TypeError) as cast_error:
    _step(lazy_optax.lazy_adam(0.1), cast)
  text = str(damaged.value) + str(cast_error.value)
  fixes = ['lazy_optax.tree.add(g1, g2)', 'lazy_optax.tree.scale(grads, s)',
           'lazy_optax.tree.psum(grads, axis)',
           'lazy_optax.tree.pmean(grads, axis)',
           'jax.tree.map(lambda g: g.astype(dtype), grads, '
           'is_leaf=lazy_optax.tree.is_sparse_rows)']
  for code in fixes:
    assert code in text, code
  env = {'jax': jax, 'jnp': jnp, 'lazy_optax': lazy_optax, 'g1': g1,
         'g2': g2, 'grads': g1, 's': 0.5, 'dtype': jnp.bfloat16}
  dense = lambda g: np.asarray(g['t'].to_dense(), np.float64)
  added = eval(fixes[0], env)   # pylint: disable=eval-used
  np.testing.assert_allclose(dense(added), dense(g1) + dense(g2))
  np.testing.assert_allclose(added['w'], 1.0)
  scaled = eval(fixes[1], env)   # pylint: disable=eval-used
  np.testing.assert_allclose(dense(scaled), 0.5 * dense(g1))
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), g1, g2)
  for code, factor in ((fixes[2], 1.0), (fixes[3], 0.5)):
    reduce = lambda g, code=code: eval(   # pylint: disable=eval-used
        code, dict(env, grads=g, axis='d'))
    out = jax.vmap(reduce, axis_name='d')(stacked)
    first = jax.tree.map(lambda x: x[0], out)
    np.testing.assert_allclose(dense(first),
                               factor * (dense(g1) + dense(g2)), rtol=1e-6)
  cast = eval(fixes[4], env)   # pylint: disable=eval-used
  assert cast['t'].dtype == jnp.bfloat16 and cast['w'].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(cast['t'].ids),
                                np.asarray(g1['t'].ids))
  # Each also trains: test_the_documented_ways_run_on_a_dict runs them.


def test_the_documented_ways_run_on_a_dict():
  """docs/semantics.md's table of supported ways: every code of its "write"
  column (those it marks as for one SparseRows aside) runs on a dict of
  gradients, inside a jitted lazy step where it yields gradients."""
  import pathlib   # pylint: disable=g-import-not-at-top
  import re   # pylint: disable=g-import-not-at-top
  text = (pathlib.Path(__file__).resolve().parent.parent / 'docs' /
          'semantics.md').read_text()
  table = text[text.index('| to | write | instead of |'):]
  table = table[:table.index('\n\n')]
  rows = [line.split(' | ')[1] for line in table.splitlines()[2:]]
  codes = [c for row in rows for c in re.findall(r'`([^`]+)`', row)]
  # Codes for one SparseRows, names, and the start of the next statement.
  aside = {'g1 + g2', 'g * s', 'g.astype', 'SparseRows', 'jmp', 'unscale',
           "'emb/table'", 'acc = g1'}
  assert 'acc = g1' in codes
  codes = [c for c in codes if c not in aside]
  assert len(codes) == 8, codes
  tx = lazy_optax.lazy_adam(0.1)

  def run(code, g1, g2):
    env = {'jax': jax, 'jnp': jnp, 'lazy_optax': lazy_optax, 'g1': g1,
           'g2': g2, 'g': g2, 'grads': g1, 's': 0.5, 'tx': tx, 'k': 2,
           'B': 2}
    if code.startswith('acc = '):   # after acc = g1
      exec('acc = g1\n' + code, env)   # pylint: disable=exec-used
      return env['acc']
    return eval(code, env)   # pylint: disable=eval-used

  for code in codes:
    if code.startswith('lazy_optax.wrappers.'):   # a transformation
      multi = run(code, None, None)
      state = multi.init(_params())
      for ids in ([1, 2], [3, 2]):
        _, state = jax.jit(multi.update)(_grads(ids), state, _params())
      continue
    if 'psum' in code or 'pmean' in code:
      def grads_of(g1, g2, code=code):
        stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), g1, g2)
        out = jax.vmap(lambda g: run(code, g, g), axis_name='batch')(stacked)
        return jax.tree.map(lambda x: x[0], out)
    else:
      grads_of = functools.partial(run, code)

    def train(g1, g2, grads_of=grads_of, code=code):
      grads = grads_of(g1, g2)
      assert isinstance(grads['t'], SparseRows), code
      return _step(tx, grads)   # trains without an error

    params, _ = jax.jit(train)(_grads([1, 2]), _grads([3, 2]))
    assert np.all(np.isfinite(params['t'])), code
