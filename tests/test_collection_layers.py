"""The EmbeddingCollection layers of Flax linen and nnx, Haiku and Equinox.

Each layer's jitted train step with the collection's per-stack optimizer
equals the functional API's step (`coll.lookup` under
`lazy_optax.value_and_grad`) bit for bit, params and optimizer state, over
two steps of a collection with two stacks, a shared table, bags with
lengths and padding, and a table with its own learning-rate multiplier
inside a stack, and bags of one shape from two tables of a stack read side
by side; each stack's gradient is one `SparseRows`; untouched rows stay bit
for bit, touched ones move. `tables()` gives the tables by name; a
table's start does not depend on the plan; a wrong collection is refused.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax
from lazy_optax import EmbeddingCollection
from lazy_optax import FeatureSpec
from lazy_optax import TableSpec
import lazy_optax.equinox

nn = pytest.importorskip('flax.linen')
nnx = pytest.importorskip('flax.nnx')
hk = pytest.importorskip('haiku')
import lazy_optax.flax  # noqa: E402  (where Flax is installed)
import lazy_optax.haiku  # noqa: E402  (where Haiku is installed)

B = 4


def _uniform(key, shape, dtype):
  return jax.random.uniform(key, shape, dtype, -1.0, 1.0)


COLL = EmbeddingCollection(
    [TableSpec('a', 9, 3, initializer=_uniform),
     TableSpec('b', 6, 3, initializer=_uniform),
     TableSpec('c', 7, 2, initializer=_uniform),
     TableSpec('d', 5, 3, initializer=_uniform, lr_multiplier=4.0)],
    [FeatureSpec('fa', 'a'),
     FeatureSpec('fb', 'b', mode='sum', padding_id=0),
     # Same ids shape as fb, another table of its stack: read side by side.
     FeatureSpec('fd2', 'd', mode='mean'),
     FeatureSpec('fa2', 'a'),            # shares table a
     FeatureSpec('fc', 'c', mode='mean'),
     FeatureSpec('fd', 'd')],
    linear_in_lr=('default',))
TX = COLL.optimizer({'default': lazy_optax.lazy_adam(0.05)})
TARGET = {'fa': 0.3, 'fb': -0.2, 'fd2': 0.2, 'fa2': 0.1, 'fc': 0.5,
          'fd': -0.4}


def _batch(seed):
  rng = np.random.default_rng(seed)
  ids = {'fa': rng.integers(0, 5, B), 'fb': rng.integers(0, 4, (B, 3)),
         'fa2': rng.integers(0, 5, (B, 2)), 'fc': rng.integers(0, 4, (B, 2)),
         'fd': rng.integers(0, 3, B), 'fd2': rng.integers(0, 4, (B, 3))}
  ids = {k: jnp.asarray(v, jnp.int32) for k, v in ids.items()}
  lengths = {'fb': jnp.array([3, 1, 2, 0]), 'fc': jnp.array([2, 1, 1, 2]),
             'fd2': jnp.array([1, 3, 2, 1])}
  return ids, lengths


BATCHES = [_batch(0), _batch(1)]


def _loss(out):
  return sum(jnp.sum((jnp.sin(out[f]) - t) ** 2) for f, t in TARGET.items())


def _touched():
  """`{table: rows some real slot read}` over both batches."""
  rows = {t: set() for t in 'abcd'}
  for ids, lengths in BATCHES:
    ids = {k: np.asarray(v) for k, v in ids.items()}
    rows['a'] |= set(ids['fa'].ravel()) | set(ids['fa2'].ravel())
    rows['d'] |= set(ids['fd'].ravel())
    for f, t in (('fb', 'b'), ('fc', 'c'), ('fd2', 'd')):
      for bag, n in zip(ids[f], np.asarray(lengths[f])):
        rows[t] |= {i for i in bag[:n] if not (f == 'fb' and i == 0)}
  return rows


@jax.jit
def _functional_step(params, opt_state, ids, lengths):
  loss, grads = lazy_optax.value_and_grad(
      lambda p: _loss(COLL.lookup(p, ids, lengths=lengths)))(params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return lazy_optax.apply_updates(params, updates), opt_state, grads


def _reference(stacks):
  """Two functional steps from `stacks`: (stacks, opt_state leaves)."""
  params, opt_state = stacks, TX.init(stacks)
  for ids, lengths in BATCHES:
    params, opt_state, grads = _functional_step(params, opt_state, ids,
                                                lengths)
    _assert_sparse(grads)
  return params, jax.tree.leaves(opt_state)


def _assert_sparse(grads):
  stacks = [s.name for s in COLL.plan]
  leaves = jax.tree_util.tree_leaves_with_path(
      grads, is_leaf=lazy_optax.tree.is_sparse_rows)
  assert len(leaves) == len(stacks) == 2, leaves
  for path, g in leaves:
    assert isinstance(g, lazy_optax.SparseRows), path
    assert lazy_optax.tree.path_name(path).split('/')[-1] in stacks, path


def _assert_trained_as_functional(start, stacks, state_leaves):
  """`stacks` and the state equal the functional steps from `start`."""
  want, want_state = _reference(start)
  for s in COLL.plan:
    np.testing.assert_array_equal(stacks[s.name], want[s.name],
                                  err_msg=s.name)
  assert len(state_leaves) == len(want_state)
  for got, ref in zip(state_leaves, want_state):
    np.testing.assert_array_equal(got, ref)
  before = jax.tree.map(np.asarray, COLL.tables(start))
  after = jax.tree.map(np.asarray, COLL.tables(stacks))
  for name, rows in _touched().items():
    untouched = sorted(set(range(COLL.table(name).rows)) - rows)
    assert untouched and rows, name
    np.testing.assert_array_equal(after[name][untouched],
                                  before[name][untouched], err_msg=name)
    moved = np.asarray(after[name][sorted(rows)] != before[name][sorted(rows)])
    assert moved.all(axis=1).all(), name


def _state_arrays(opt_state):
  return [np.asarray(x) for x in jax.tree.leaves(opt_state)]


def test_linen_step_equals_the_functional_step():
  model = lazy_optax.flax.EmbedCollection(COLL)
  params = model.init(jax.random.key(0), *BATCHES[0][:1],
                      lengths=BATCHES[0][1])['params']
  assert sorted(params) == sorted(s.name for s in COLL.plan)
  start = jax.tree.map(np.asarray, params)

  @jax.jit
  def step(params, opt_state, ids, lengths):
    loss, grads = lazy_optax.value_and_grad(
        lambda p: _loss(model.apply({'params': p}, ids, lengths=lengths)))(
            params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, grads

  opt_state = TX.init(params)
  for ids, lengths in BATCHES:
    params, opt_state, grads = step(params, opt_state, ids, lengths)
    _assert_sparse(grads)
  _assert_trained_as_functional(start, params, _state_arrays(opt_state))
  tables = model.apply({'params': params}, method='tables')
  assert jax.tree.map(np.asarray, tables).keys() == {'a', 'b', 'c', 'd'}
  for name, table in COLL.tables(params).items():
    np.testing.assert_array_equal(tables[name], table)


def test_nnx_step_equals_the_functional_step():
  model = lazy_optax.flax.NnxEmbedCollection(COLL, rngs=nnx.Rngs(0))
  start = {name: np.asarray(p[...]) for name, p in model.stacks.items()}
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, ids, lengths):
    loss, grads = lazy_optax.flax.nnx_value_and_grad(
        lambda m: _loss(m(ids, lengths=lengths)))(model)
    optimizer.update(model, grads)
    return grads

  for ids, lengths in BATCHES:
    grads = step(model, optimizer, ids, lengths)
    _assert_sparse(grads)
  stacks = {name: p[...] for name, p in model.stacks.items()}
  _assert_trained_as_functional(start, stacks,
                                _state_arrays(optimizer.opt_state))
  for name, table in COLL.tables(stacks).items():
    np.testing.assert_array_equal(model.tables()[name], table)


def test_haiku_step_equals_the_functional_step():
  f = hk.without_apply_rng(hk.transform(
      lambda ids, lengths: lazy_optax.haiku.EmbedCollection(COLL)(
          ids, lengths=lengths)))
  tables_of = hk.without_apply_rng(hk.transform(
      lambda: lazy_optax.haiku.EmbedCollection(COLL).tables()))
  params = f.init(jax.random.key(0), *BATCHES[0])
  assert list(params) == ['embed_collection']
  start = jax.tree.map(np.asarray, params['embed_collection'])

  @jax.jit
  def step(params, opt_state, ids, lengths):
    loss, grads = lazy_optax.value_and_grad(
        lambda p: _loss(f.apply(p, ids, lengths)))(params)
    updates, opt_state = TX.update(grads, opt_state)   # Haiku's: no params
    return lazy_optax.apply_updates(params, updates), opt_state, grads

  opt_state = TX.init(params)
  for ids, lengths in BATCHES:
    params, opt_state, grads = step(params, opt_state, ids, lengths)
    _assert_sparse(grads)
  stacks = params['embed_collection']
  _assert_trained_as_functional(start, stacks, _state_arrays(opt_state))
  tables = tables_of.apply(params)
  for name, table in COLL.tables(stacks).items():
    np.testing.assert_array_equal(tables[name], table)


def test_equinox_step_equals_the_functional_step():
  model = lazy_optax.equinox.EmbeddingCollection(COLL, key=jax.random.key(0))
  # Built from a key, the stacks are exactly collection.init(key).
  for name, stack in COLL.init(jax.random.key(0)).items():
    np.testing.assert_array_equal(model.stacks[name], stack)
  start = jax.tree.map(np.asarray, model.stacks)

  @eqx.filter_jit
  def step(model, opt_state, ids, lengths):
    loss, grads = lazy_optax.equinox.filter_value_and_grad(
        lambda m: _loss(m(ids, lengths=lengths)))(model)
    updates, opt_state = TX.update(grads, opt_state,
                                   eqx.filter(model, eqx.is_array))
    return lazy_optax.equinox.apply_updates(model, updates), opt_state, grads

  opt_state = TX.init(eqx.filter(model, eqx.is_array))
  for ids, lengths in BATCHES:
    model, opt_state, grads = step(model, opt_state, ids, lengths)
    _assert_sparse(grads)
  _assert_trained_as_functional(start, model.stacks, _state_arrays(opt_state))
  for name, table in COLL.tables(model.stacks).items():
    np.testing.assert_array_equal(model.tables()[name], table)


def test_a_tables_start_does_not_depend_on_the_plan():
  # Table 'a' alone, and among neighbours in a stack at another offset: the
  # same rows from the same key, in every framework.
  alone = EmbeddingCollection([COLL.table('a')])
  ids = {'a': jnp.array([1])}
  for coll in (alone, COLL):
    assert coll.stack_of('a').tables[0] == 'a'
  crowded = EmbeddingCollection([COLL.table('b'), COLL.table('a')])
  assert crowded.stack_of('a').offsets == (0, 6)

  def linen(coll):
    model = lazy_optax.flax.EmbedCollection(coll)
    params = model.init(jax.random.key(3), ids)
    return model.apply(params, method='tables')['a']

  def haiku(coll):
    t = hk.transform(lambda: lazy_optax.haiku.EmbedCollection(coll).tables())
    return t.apply(t.init(jax.random.key(3)), None)['a']

  def nnx_(coll):
    model = lazy_optax.flax.NnxEmbedCollection(coll, rngs=nnx.Rngs(3))
    return model.tables()['a']

  def equinox(coll):
    model = lazy_optax.equinox.EmbeddingCollection(coll,
                                                   key=jax.random.key(3))
    return model.tables()['a']

  for make in (linen, haiku, nnx_, equinox):
    np.testing.assert_array_equal(make(alone), make(crowded),
                                  err_msg=make.__name__)


def test_a_wrong_collection_or_stacks_are_refused():
  with pytest.raises(TypeError, match='EmbedCollection: collection must be'):
    lazy_optax.flax.EmbedCollection([TableSpec('a', 3, 2)]).init(
        jax.random.key(0), {'a': jnp.array([0])})
  with pytest.raises(TypeError, match='NnxEmbedCollection: collection must'):
    lazy_optax.flax.NnxEmbedCollection('a', rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match='haiku.EmbedCollection: collection'):
    hk.transform(lambda: lazy_optax.haiku.EmbedCollection(None)).init(
        jax.random.key(0))
  with pytest.raises(TypeError, match='equinox.EmbeddingCollection: coll'):
    lazy_optax.equinox.EmbeddingCollection(COLL.table_specs,
                                           key=jax.random.key(0))
  eqx_coll = lazy_optax.equinox.EmbeddingCollection
  with pytest.raises(ValueError, match='either key or stacks'):
    eqx_coll(COLL)
  stacks = COLL.init(jax.random.key(0))
  name = COLL.plan[0].name
  with pytest.raises(ValueError, match=f'stack {name!r} is float32'):
    eqx_coll(COLL, stacks={**stacks, name: stacks[name][1:]})
  with pytest.raises(ValueError, match='stacks must be'):
    eqx_coll(COLL, stacks={name: stacks[name]})
  # A Flax param of another shape than the plan's is refused by Flax.
  model = lazy_optax.flax.EmbedCollection(COLL)
  with pytest.raises(Exception, match='shape'):
    model.apply({'params': {**stacks, name: stacks[name][1:]}},
                {'fa': jnp.array([0])})
