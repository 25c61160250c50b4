"""Lazy transformations inside optax combinators, jit, scan and Flax."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import TFLazyAdam

import lazy_optax
from lazy_optax import SparseRows

V, D = 24, 3


def _batches(seed, steps, n_ids=8, num_rows=V):
  """Ids with duplicates; the id range drifts so early rows go absent."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    lo = (t * num_rows) // (2 * steps)
    ids = rng.integers(lo, lo + num_rows // 2, n_ids).astype(np.int32)
    ids[: n_ids // 4] = ids[-1]
    out.append((ids, rng.normal(size=(n_ids, D)), rng.normal(size=(D,))))
  return out


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {'emb': {'table': jnp.asarray(rng.normal(size=(V, D)), jnp.float32)},
          'w': jnp.asarray(rng.normal(size=(D,)), jnp.float32)}


def _grads(ids, values, w_grad):
  return {'emb': {'table': SparseRows(jnp.asarray(ids),
                                      jnp.asarray(values, jnp.float32), V)},
          'w': jnp.asarray(w_grad, jnp.float32)}


def _train(tx, batches, params=None, jit=False, apply=None):
  params = _params() if params is None else params
  apply = apply or lazy_optax.apply_updates
  state = tx.init(params)

  def step(params, state, ids, values, w_grad):
    updates, state = tx.update(_grads(ids, values, w_grad), state, params)
    return apply(params, updates), state

  if jit:
    step = jax.jit(step)
  for batch in batches:
    params, state = step(params, state, *batch)
  return params, state


def _tf_ref(batches, lr=0.01, **kw):
  ref = TFLazyAdam(_params()['emb']['table'], lr=lr, **kw)
  for ids, values, _ in batches:
    ref.step(ids, values)
  return ref


def _dense_w(tx, batches):
  """An independent run of a plain optax optimizer on the dense leaf."""
  w = _params()['w']
  state = tx.init(w)
  for _, _, g in batches:
    u, state = tx.update(jnp.asarray(g, jnp.float32), state, w)
    w = optax.apply_updates(w, u)
  return w


def _close_table(params, ref):
  np.testing.assert_allclose(params['emb']['table'], ref.p, rtol=2e-5,
                             atol=2e-6)


# -- combinators -------------------------------------------------------------


def test_chain_of_two_lazy_transforms():
  batches = _batches(1, 6)
  tx = optax.chain(lazy_optax.lazy(lazy_optax.scale_by_lazy_adam()),
                   lazy_optax.lazy(optax.scale_by_learning_rate(0.01)))
  params, _ = _train(tx, batches, jit=True)
  _close_table(params, _tf_ref(batches))


@pytest.mark.parametrize('apply', [lazy_optax.apply_updates,
                                   optax.apply_updates])
def test_plain_optax_scale_after_a_lazy_transform_scales_the_rows(apply):
  # optax.scale reaches the id code too; scaling leaves the ids as they were.
  batches = _batches(2, 4)
  tx = optax.chain(lazy_optax.lazy_adam(0.01), optax.scale(0.5))
  params, _ = _train(tx, batches, apply=apply)
  _close_table(params, _tf_ref(batches, lr=0.005))


@pytest.mark.parametrize('callable_labels', [False, True])
def test_partition_lazy_tables_plain_adamw_for_the_rest(callable_labels):
  batches = _batches(3, 10)
  if callable_labels:
    labels = lazy_optax.tree.path_labels(
        lambda name: 'lazy' if name.startswith('emb/') else 'dense')
  else:
    labels = {'emb': {'table': 'lazy'}, 'w': 'dense'}
  dense = optax.adamw(0.02, weight_decay=0.1)
  tx = optax.partition({'lazy': lazy_optax.lazy_adam(0.01), 'dense': dense},
                       labels)
  params, state = _train(tx, batches, jit=True)
  _close_table(params, _tf_ref(batches))
  np.testing.assert_allclose(params['w'], _dense_w(dense, batches),
                             rtol=1e-6, atol=1e-7)
  # The lazy group's state only holds rows the batches touched.
  mu = optax.tree_utils.tree_get(state.inner_states['lazy'], 'mu')
  mu = mu['emb']['table']
  touched = sorted({int(i) for ids, _, _ in batches for i in ids})
  untouched = np.setdiff1d(np.arange(V), touched)
  assert untouched.size and np.all(np.asarray(mu)[untouched] == 0)


def test_path_labels_sees_sparse_rows_as_one_leaf():
  names = []
  labels = lazy_optax.tree.path_labels(lambda n: names.append(n) or n)
  out = labels(_grads(*_batches(4, 1)[0]))
  assert names == ['emb/table', 'w']
  assert out == {'emb': {'table': 'emb/table'}, 'w': 'w'}


def test_inject_hyperparams_same_results_as_unwrapped():
  batches = _batches(5, 10)
  injected = optax.inject_hyperparams(lazy_optax.lazy_adam)(learning_rate=0.01)
  p_inj, s_inj = _train(injected, batches, jit=True)
  p_raw, _ = _train(lazy_optax.lazy_adam(0.01), batches, jit=True)
  np.testing.assert_allclose(p_inj['emb']['table'], p_raw['emb']['table'],
                             rtol=1e-6, atol=1e-7)
  _close_table(p_inj, _tf_ref(batches))
  assert float(s_inj.hyperparams['learning_rate']) == pytest.approx(0.01)


def test_inject_hyperparams_learning_rate_can_be_changed_in_the_state():
  batches = _batches(6, 6)
  tx = optax.inject_hyperparams(lazy_optax.lazy_adam)(learning_rate=0.01)
  params = _params()
  state = tx.init(params)
  ref = TFLazyAdam(params['emb']['table'], lr=0.01)
  for t, (ids, values, w_grad) in enumerate(batches):
    lr = 0.01 if t < 3 else 0.003
    state.hyperparams['learning_rate'] = jnp.asarray(lr)
    ref.lr = lr
    ref.step(ids, values)
    updates, state = tx.update(_grads(ids, values, w_grad), state, params)
    params = lazy_optax.apply_updates(params, updates)
  _close_table(params, ref)


def test_learning_rate_schedule():
  batches = _batches(7, 12)
  schedule = optax.exponential_decay(0.05, transition_steps=2, decay_rate=0.7)
  params, _ = _train(lazy_optax.lazy_adam(schedule), batches, jit=True)
  ref = TFLazyAdam(_params()['emb']['table'])
  for t, (ids, values, _) in enumerate(batches):
    ref.lr = 0.05 * 0.7 ** (t / 2)   # the schedule sees count 0 first
    ref.step(ids, values)
  _close_table(params, ref)


def test_masked_lazy_transform():
  batches = _batches(8, 6)
  tx = optax.masked(lazy_optax.lazy_adam(0.01), {'emb': {'table': True},
                                                 'w': False})
  params, _ = _train(tx, batches, jit=True)
  _close_table(params, _tf_ref(batches))
  # Masked-out leaves pass their gradient through, as optax.masked does.
  w = _params()['w'] + sum(jnp.asarray(g, jnp.float32) for _, _, g in batches)
  np.testing.assert_allclose(params['w'], w, rtol=1e-6)


def test_masked_out_table_gets_its_raw_sparse_gradient():
  batches = _batches(9, 3)
  tx = optax.masked(lazy_optax.lazy_adam(0.01), {'emb': {'table': False},
                                                 'w': True})
  params, _ = _train(tx, batches)
  table = np.array(_params()['emb']['table'], np.float64)
  for ids, values, _ in batches:
    np.add.at(table, ids, values)
  np.testing.assert_allclose(params['emb']['table'], table, rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize('jit', [False, True])
def test_apply_if_finite_skips_a_nan_step_and_applies_a_finite_one(jit):
  batches = _batches(10, 2)
  tx = optax.apply_if_finite(lazy_optax.lazy_adam(0.01), max_consecutive_errors=5)
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  ids, values, w_grad = batches[0]
  bad = np.array(values)
  bad[2, 1] = np.nan
  updates, new_state = update(_grads(ids, bad, w_grad), state, params)
  new_params = lazy_optax.apply_updates(params, updates)
  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(new_state.inner_state),
                  jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(a, b)
  assert int(new_state.notfinite_count) == 1
  assert not bool(new_state.last_finite)
  # The finite steps that follow are TensorFlow's Adam rule (epsilon hat) from a clean state.
  state = new_state
  for ids, values, w_grad in batches:
    updates, state = update(_grads(ids, values, w_grad), state, params)
    params = lazy_optax.apply_updates(params, updates)
  assert int(state.notfinite_count) == 0
  _close_table(params, _tf_ref(batches))


def test_optax_multisteps_with_sparse_rows_says_what_to_use():
  tx = optax.MultiSteps(lazy_optax.lazy_adam(0.01), every_k_schedule=2)
  with pytest.raises(ValueError, match=r'lazy_optax\.wrappers\.multi_steps instead of '
                     r'optax\.MultiSteps'):
    _train(tx, _batches(11, 1))


def _densify(tree):
  return jax.tree.map(
      lambda g: g.to_dense() if lazy_optax.tree.is_sparse_rows(g) else g, tree,
      is_leaf=lazy_optax.tree.is_sparse_rows)


@pytest.mark.parametrize('how', ['multi_steps', 'dense_recipe'])
def test_accumulating_k_steps_matches_adam_on_the_mean_gradient(how):
  """multi_steps keeps O(k x batch) buffers; the older recipe densifies and
  skips zero rows. Both equal optax's Adam on the rows of the mean gradient."""
  batches = _batches(12, 6)
  k = 3
  if how == 'multi_steps':
    tx = lazy_optax.wrappers.multi_steps(lazy_optax.lazy(optax.adam(0.05)), every_k=k,
                                ids_per_step={'emb/table': 8})
    prepare = lambda g: g
  else:
    inner = lazy_optax.lazy(optax.adam(0.05), skip_zero_rows=True)
    tx = optax.MultiSteps(inner, every_k_schedule=k)
    prepare = _densify
  params = _params()
  state = tx.init(params)
  if how == 'multi_steps':  # the table's buffer: k x 8 ids, not V rows
    assert state.acc['emb']['table'].values.shape == (k * 8, D)

  @jax.jit  # with apply_updates: eager, each of its operations on the
  def step(params, state, grads):  # k x 8 rows was a program of its own
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values, w_grad in batches:
    params, state = step(params, state, prepare(_grads(ids, values, w_grad)))
  # float64 reference: optax's Adam on the rows whose mean gradient over the
  # k mini-batches is non-zero; all other rows and their moments stay put.
  p = np.array(_params()['emb']['table'], np.float64)
  m, v = np.zeros_like(p), np.zeros_like(p)
  for t in range(len(batches) // k):
    g = np.zeros_like(p)
    for ids, values, _ in batches[t * k:(t + 1) * k]:
      np.add.at(g, ids, values)
    g /= k
    rows = np.any(g != 0, axis=1)
    m[rows] = 0.9 * m[rows] + 0.1 * g[rows]
    v[rows] = 0.999 * v[rows] + 0.001 * g[rows] ** 2
    m_hat, v_hat = m[rows] / (1 - 0.9 ** (t + 1)), v[rows] / (1 - 0.999 ** (t + 1))
    p[rows] -= 0.05 * m_hat / (np.sqrt(v_hat) + 1e-8)
  assert not np.all(rows)
  np.testing.assert_allclose(params['emb']['table'], p, rtol=2e-5, atol=2e-6)


# -- jit, scan, donation, tracing ---------------------------------------------


def test_scan_training_loop_matches_python_loop_and_reference():
  batches = _batches(13, 10)
  tx = lazy_optax.lazy_adam(0.01)
  ids = jnp.stack([jnp.asarray(b[0]) for b in batches])
  values = jnp.stack([jnp.asarray(b[1], jnp.float32) for b in batches])
  w_grads = jnp.stack([jnp.asarray(b[2], jnp.float32) for b in batches])

  @jax.jit
  def train(params, state):
    def body(carry, batch):
      params, state = carry
      updates, state = tx.update(_grads(*batch), state, params)
      return (lazy_optax.apply_updates(params, updates), state), None
    return jax.lax.scan(body, (params, state), (ids, values, w_grads))[0]

  params = _params()
  params, state = train(params, tx.init(params))
  _close_table(params, _tf_ref(batches))
  loop_params, loop_state = _train(tx, batches)
  np.testing.assert_allclose(params['emb']['table'],
                             loop_params['emb']['table'], rtol=1e-6, atol=1e-7)
  assert int(optax.tree_utils.tree_get(state, 'count')) == len(batches)


def test_update_without_params_where_the_rule_needs_none():
  batches = _batches(15, 3)
  for tx in (lazy_optax.lazy_adam(0.01),
             lazy_optax.lazy(optax.sgd(0.1, momentum=0.9))):
    with_p, _ = _train(tx, batches)
    params = _params()
    state = tx.init(params)
    for batch in batches:
      updates, state = tx.update(_grads(*batch), state)   # no params
      params = lazy_optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(with_p)):
      np.testing.assert_array_equal(a, b)


def test_weight_decay_needs_params_and_says_so():
  tx = lazy_optax.lazy_adamw(0.01)
  params = _params()
  with pytest.raises(ValueError, match='params'):
    tx.update(_grads(*_batches(16, 1)[0]), tx.init(params))


# -- applying updates ----------------------------------------------------------


def test_optax_apply_updates_equals_lazy_optax_apply_updates():
  batches = _batches(17, 6)
  tx = lazy_optax.lazy_adam(0.01)
  p_opt, _ = _train(tx, batches, jit=True, apply=optax.apply_updates)
  p_lo, _ = _train(tx, batches, jit=True)
  for a, b in zip(jax.tree.leaves(p_opt), jax.tree.leaves(p_lo)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  _close_table(p_opt, _tf_ref(batches))


def test_flax_train_state_apply_gradients():
  from flax.training import train_state
  batches = _batches(18, 6)
  ts = train_state.TrainState.create(apply_fn=None, params=_params(),
                                     tx=lazy_optax.lazy_adam(0.01))
  apply_grads = jax.jit(lambda ts, b: ts.apply_gradients(grads=_grads(*b)))
  for batch in batches:
    ts = apply_grads(ts, batch)
  _close_table(ts.params, _tf_ref(batches))
  assert int(ts.step) == len(batches)


def test_flax_train_state_with_plain_optax_after_lazy():
  from flax.training import train_state
  batches = _batches(19, 3)
  ts = train_state.TrainState.create(
      apply_fn=None, params=_params(),
      tx=optax.chain(lazy_optax.lazy_adam(0.01), optax.scale(2.0)))
  for batch in batches:
    ts = ts.apply_gradients(grads=_grads(*batch))
  _close_table(ts.params, _tf_ref(batches, lr=0.02))
  # A plain transformation that pairs the updates with the params cannot
  # take a SparseRows: it fails loudly, saying what to do.
  ts = train_state.TrainState.create(
      apply_fn=None, params=_params(),
      tx=optax.chain(lazy_optax.lazy_adam(0.01),
                     optax.add_decayed_weights(1e-2)))
  with pytest.raises(ValueError, match=r'lazy_optax\.lazy\(\.\.\.\)'):
    ts.apply_gradients(grads=_grads(*batches[0]))


def test_nnx_optimizer_update():
  from flax import nnx

  class Model(nnx.Module):

    def __init__(self):
      params = _params()
      self.table = nnx.Param(params['emb']['table'])
      self.w = nnx.Param(params['w'])

  batches = _batches(20, 6)
  model = Model()
  labels = lazy_optax.tree.path_labels(lambda n: 'lazy' if n == 'table' else 'dense')
  dense = optax.sgd(0.1)
  opt = nnx.Optimizer(model, optax.partition(
      {'lazy': lazy_optax.lazy_adam(0.01), 'dense': dense}, labels),
                      wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, ids, values, w_grad):
    grads = nnx.state(model, nnx.Param)
    grads['table'] = nnx.Param(SparseRows(ids, values, V))
    grads['w'] = nnx.Param(w_grad)
    opt.update(model, grads)

  for ids, values, w_grad in batches:
    step(model, opt, jnp.asarray(ids), jnp.asarray(values, jnp.float32),
         jnp.asarray(w_grad, jnp.float32))
  np.testing.assert_allclose(model.table[...], _tf_ref(batches).p,
                             rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(model.w[...], _dense_w(dense, batches),
                             rtol=1e-6, atol=1e-7)
