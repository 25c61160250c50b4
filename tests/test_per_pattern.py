"""per_pattern_lr equals separate optimizers run on each group."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax

ROWS = 10


def _params():
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return {'encoder': {'embedding': f(ROWS, 2), 'bias': f(2)},
          'decoder': {'embedding': f(ROWS, 2), 'bias': f(2)},
          'head': {'w': f(2, 2)}}


def _grads(params, step):
  rng = np.random.default_rng(100 + step)

  def grad(path, p):
    name = lazy_optax.tree.path_name(path)
    if name.endswith('embedding'):
      ids = rng.integers(0, ROWS, 4).astype(np.int32)
      return lazy_optax.SparseRows(
          ids, jnp.asarray(rng.normal(size=(4, 2)), jnp.float32), ROWS)
    return jnp.asarray(rng.normal(size=p.shape), jnp.float32)

  return jax.tree_util.tree_map_with_path(grad, params)


def _train(tx, params, steps=4, only=None):
  """Trains; with `only`, a sub-dict of keys (path -> leaf) is trained."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for t in range(steps):
    grads = _grads(_params(), t)
    if only is not None:
      grads = only(grads)
    params, state = step(params, state, grads)
  return params


def _pick(names):
  """Selects leaves by path into a flat dict {path: leaf}."""
  def select(tree):
    flat = jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lazy_optax.tree.is_sparse_rows)
    return {lazy_optax.tree.path_name(p): x for p, x in flat
            if lazy_optax.tree.path_name(p) in names}
  return select


@pytest.mark.parametrize('optimizer', [
    lazy_optax.lazy_adam,
    functools.partial(lazy_optax.lazy_adamw, b2=0.99, weight_decay=0.1),
    functools.partial(optax.adamw, b1=0.8, weight_decay=0.1),
])
def test_equals_separate_optimizers_per_group(optimizer):
  sched = optax.linear_schedule(0.05, 0.01, 4)
  groups = [
      (['^encoder/embedding$', 'decoder/emb'], 0.1),  # two lazy tables
      ('bias', sched),                                # dense, a schedule
      ('encoder', 1e3),   # matches encoder/bias too, but the group above wins
  ]
  tx = lazy_optax.compat.per_pattern_lr(optimizer, 0.02, groups, require_match=False)
  trained = _train(tx, _params())
  got = _pick({'encoder/embedding', 'decoder/embedding', 'encoder/bias',
               'decoder/bias', 'head/w'})(trained)

  # Separate optimizers, each on its group alone; plain optax runs lazily.
  def separate(lr, names):
    tx = optimizer(lr)
    if optimizer.__class__ is functools.partial and (
        optimizer.func is optax.adamw):
      tx = lazy_optax.lazy(tx)
    select = _pick(names)
    return _train(tx, select(_params()), only=select)

  expected = {}
  expected.update(separate(0.1, {'encoder/embedding', 'decoder/embedding'}))
  expected.update(separate(sched, {'encoder/bias', 'decoder/bias'}))
  expected.update(separate(0.02, {'head/w'}))
  assert sorted(got) == sorted(expected)
  for name in got:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-6,
                               atol=1e-7, err_msg=name)
  # The groups really got different rates: the 1e3 group matched nothing.
  assert not np.allclose(got['head/w'], _params()['head']['w'])


def test_keras_spelling_is_refused_with_its_one_line_conversion():
  params = _params()
  keras = [{'patterns': ['embedding'], 'lr': 0.1},
           {'patterns': ['head'], 'lr': 0.5}]
  for wrong in (keras, {'embedding': 0.1, 'head': 0.5}):
    with pytest.raises(TypeError, match=r"\(g\['patterns'\], g\['lr'\]\)"):
      lazy_optax.compat.per_pattern_lr(lazy_optax.lazy_adam, 1e-3, wrong)
  converted = [(g['patterns'], g['lr']) for g in keras]
  pairs = [(['embedding'], 0.1), ('head', 0.5)]
  results = [
      _train(lazy_optax.compat.per_pattern_lr(lazy_optax.lazy_adam, 1e-3, g), params)
      for g in (pairs, converted)]
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(results[0]['head']['w'], params['head']['w'])


def test_untouched_rows_stay_put():
  params = _params()
  tx = lazy_optax.compat.per_pattern_lr(optax.adam, 0.1, [('embedding', 0.5)])
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  grads['encoder']['embedding'] = lazy_optax.SparseRows(
      jnp.array([3]), jnp.ones((1, 2)), ROWS)
  grads['decoder']['embedding'] = lazy_optax.SparseRows(
      jnp.array([4]), jnp.ones((1, 2)), ROWS)
  updates, _ = tx.update(grads, state, params)
  new = lazy_optax.apply_updates(params, updates)
  table, old = new['encoder']['embedding'], params['encoder']['embedding']
  np.testing.assert_array_equal(np.delete(table, 3, 0), np.delete(old, 3, 0))
  # optax.adam's first step is lr * sign(g): the group's rate, 0.5.
  np.testing.assert_allclose(table[3], old[3] - 0.5, rtol=1e-5)


def test_per_pattern_lr_errors_name_the_problem():
  params = _params()
  with pytest.raises(ValueError, match=r"'\[unclosed' is not a valid"):
    lazy_optax.compat.per_pattern_lr(optax.adam, 0.1, [('[unclosed', 0.1)])
  tx = lazy_optax.compat.per_pattern_lr(optax.adam, 0.1, [('embeding', 0.1)])
  with pytest.raises(ValueError, match='matches no parameter.*encoder/bias'):
    tx.init(params)
  lazy_optax.compat.per_pattern_lr(optax.adam, 0.1, [('embeding', 0.1)],
                            require_match=False).init(params)
  with pytest.raises(TypeError, match='learning rate'):
    lazy_optax.compat.per_pattern_lr(optax.adam, 0.1, [('bias', 'fast')])
  with pytest.raises(TypeError, match=r'must be a \(patterns, lr\) pair'):
    lazy_optax.compat.per_pattern_lr(optax.adam, 0.1, [{'pattern': 'x', 'lr': 1.}])
