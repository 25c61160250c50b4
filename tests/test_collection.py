"""EmbeddingCollection: the plan, init, lookups, neighbours and errors.

* the plan: tables stack by width, dtype, optimizer label and (for labels
  not declared linear in the learning rate) multiplier, at consecutive
  offsets; a forced stack whose tables differ is refused naming them;
* specs are frozen, hashable and compared by value;
* `init`: each table is exactly its initializer's output for its own key,
  whatever its neighbours;
* `lookup` equals `lookup` / `lookup_bag` on the separate tables (single
  ids, bags with lengths, masks, weights, padding), eagerly and under
  `value_and_grad` (one `SparseRows` a stack, equal to the tables');
* ids at -1, rows and rows + 1 of every table of a stack: a `ValueError`
  naming the table where concrete; under `jax.jit` zero rows, nothing
  written, every neighbour row and its state bit for bit; `check_ids`
  under `checked` names the table;
* bad input: unknown table or feature, duplicate names, ids of the wrong
  rank, extras for single ids.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import EmbeddingCollection
from lazy_optax import FeatureSpec
from lazy_optax import TableSpec


def _uniform(key, shape, dtype):
  return jax.random.uniform(key, shape, dtype, -1.0, 1.0)


TABLES = (TableSpec('a', 5, 3, initializer=_uniform),
          TableSpec('b', 4, 3, initializer=_uniform),
          TableSpec('c', 6, 3, initializer=_uniform))
FEATURES = (FeatureSpec('fa', 'a'),
            FeatureSpec('fb', 'b', mode='sum', padding_id=0),
            FeatureSpec('fa2', 'a'),
            FeatureSpec('fc', 'c', mode='mean'))


def _coll(**kw):
  return EmbeddingCollection(TABLES, FEATURES, **kw)


# -- the plan ----------------------------------------------------------------

def test_plan_stacks_by_width_dtype_label_and_multiplier():
  coll = EmbeddingCollection([
      TableSpec('a', 5, 4), TableSpec('b', 7, 4), TableSpec('c', 3, 8),
      TableSpec('d', 2, 4, dtype=jnp.bfloat16), TableSpec('e', 6, 4,
                                                        optimizer='ftrl'),
      TableSpec('f', 9, 4, lr_multiplier=2.0),
      TableSpec('g', 4, 4, optimizer='ftrl', lr_multiplier=0.5)])
  stacks = {s.name: (s.tables, s.offsets, s.rows, s.lr_multiplier)
            for s in coll.plan}
  assert stacks == {
      'default_float32_4': (('a', 'b'), (0, 5), 12, 1.0),
      'default_float32_8': (('c',), (0,), 3, 1.0),
      'default_bfloat16_4': (('d',), (0,), 2, 1.0),
      'ftrl_float32_4': (('e',), (0,), 6, 1.0),
      'default_float32_4_lr2': (('f',), (0,), 9, 2.0),
      'ftrl_float32_4_lr0.5': (('g',), (0,), 4, 0.5)}
  # Declared linear in the learning rate: multipliers share a stack.
  linear = EmbeddingCollection(coll.table_specs, linear_in_lr=('default',))
  assert [(s.name, s.tables, s.lr_multiplier) for s in linear.plan][:1] == [
      ('default_float32_4', ('a', 'b', 'f'), None)]
  assert 'a[0:5], b[5:12], f[12:21]' in str(linear)


def test_forced_stack():
  coll = EmbeddingCollection([TableSpec('a', 5, 4, stack='s'),
                              TableSpec('b', 7, 4),
                              TableSpec('c', 2, 4, stack='s')])
  assert [(s.name, s.tables, s.offsets) for s in coll.plan] == [
      ('s', ('a', 'c'), (0, 5)), ('default_float32_4', ('b',), (0,))]
  with pytest.raises(ValueError, match=r"stack 's': tables 'a' and 'c' "
                     r"cannot share it: their width differ \(4 vs 8\)"):
    EmbeddingCollection([TableSpec('a', 5, 4, stack='s'),
                         TableSpec('c', 2, 8, stack='s')])
  with pytest.raises(ValueError, match="their lr_multiplier differ"):
    EmbeddingCollection([TableSpec('a', 5, 4, stack='s'),
                         TableSpec('c', 2, 4, stack='s', lr_multiplier=3)])


def test_specs_frozen_hashable_by_value():
  assert _coll() == _coll() and hash(_coll()) == hash(_coll())
  assert _coll() != _coll(linear_in_lr=('default',))
  assert TableSpec('a', 5, 3, dtype='float32') == TableSpec('a', 5, 3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    _coll().plan = ()  # type: ignore[misc]
  # Default features: one of single ids per table, named as the table.
  coll = EmbeddingCollection(TABLES)
  assert [(f.name, f.table, f.mode) for f in coll.feature_specs] == [
      ('a', 'a', None), ('b', 'b', None), ('c', 'c', None)]


@pytest.mark.parametrize('make, message', [
    (lambda: EmbeddingCollection(TABLES, [FeatureSpec('x', 'nope')]),
     "FeatureSpec 'x' reads table 'nope', which is not a table"),
    (lambda: EmbeddingCollection(TABLES + (TableSpec('a', 2, 3),)),
     "two tables are named 'a'"),
    (lambda: EmbeddingCollection(TABLES, FEATURES + (FeatureSpec('fa', 'b'),)),
     "two features are named 'fa'"),
    (lambda: TableSpec('a', 0, 3), "TableSpec 'a': rows must be a positive"),
    (lambda: TableSpec('a', 3, 3, dtype=jnp.int32), 'dtype must be floating'),
    (lambda: TableSpec('a', 3, 3, lr_multiplier=0.0), 'lr_multiplier'),
    (lambda: FeatureSpec('x', 'a', mode='median'), 'mode must be one of'),
])
def test_bad_specs(make, message):
  with pytest.raises((ValueError, TypeError), match=message):
    make()


# -- init ----------------------------------------------------------------------

def test_init_gives_each_table_its_initializer_alone():
  key = jax.random.key(3)
  coll = _coll()
  tables = coll.tables(coll.init(key))
  for spec in TABLES:
    alone = _uniform(jax.random.fold_in(key, _crc(spec.name)),
                     (spec.rows, spec.width), spec.dtype)
    np.testing.assert_array_equal(tables[spec.name], alone)
  # Another table before it, another stack layout: the same rows.
  other = EmbeddingCollection((TableSpec('z', 9, 3),) + TABLES[::-1])
  for name, table in other.tables(other.init(key)).items():
    if name != 'z':
      np.testing.assert_array_equal(table, tables[name])
  with pytest.raises(ValueError, match=r"table 'w': its initializer gave "):
    EmbeddingCollection([TableSpec(
        'w', 2, 3, initializer=lambda k, s, d: jnp.zeros((3, 3)))]).init(key)


def _crc(name):
  import zlib  # pylint: disable=g-import-not-at-top
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def test_params_from_tables_round_trip_and_errors():
  coll = _coll()
  params = coll.init(jax.random.key(0))
  again = coll.params_from_tables(coll.tables(params))
  assert jax.tree.structure(again) == jax.tree.structure(params)
  for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(x, y)
  tables = coll.tables(params)
  with pytest.raises(ValueError, match=r"table 'b': got float32\[3, 3\]"):
    coll.params_from_tables(dict(tables, b=tables['b'][:3]))
  with pytest.raises(ValueError, match=r"and \['c'\] are missing"):
    coll.params_from_tables({k: v for k, v in tables.items() if k != 'c'})


# -- lookups -------------------------------------------------------------------

IDS = {'fa': np.array([0, 4, 4, 2], np.int32),
       'fb': np.array([[1, 3], [0, 2], [3, 3], [0, 0]], np.int32),
       'fa2': np.array([1, 2, 4, 4], np.int32),
       'fc': np.array([[5, 0, 1], [2, 2, 0], [1, 0, 0], [3, 4, 5]], np.int32)}
LENGTHS = {'fc': np.array([3, 2, 0, 1], np.int32)}


def _separate(tables, ids, lengths=LENGTHS):
  """The features looked up one by one on separate tables, in order."""
  return {
      'fa': lazy_optax.lookup(tables['a'], ids['fa']),
      'fb': lazy_optax.lookup_bag(tables['b'], ids['fb'], mode='sum',
                                  padding_id=0),
      'fa2': lazy_optax.lookup(tables['a'], ids['fa2']),
      'fc': lazy_optax.lookup_bag(tables['c'], ids['fc'], mode='mean',
                                  lengths=lengths['fc'])}


def _loss(rows):
  return sum(jnp.sum(jnp.tanh(r) * (k + 1.0))
             for k, r in enumerate(rows.values()))


def test_lookup_and_gradient_equal_separate_tables():
  coll = _coll()
  params = coll.init(jax.random.key(1))
  tables = coll.tables(params)
  got = coll.lookup(params, IDS, lengths=LENGTHS)
  want = _separate(tables, IDS)
  assert list(got) == list(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  def loss_coll(p):
    return _loss(coll.lookup(p, IDS, lengths=LENGTHS))

  loss, grads = jax.jit(lazy_optax.value_and_grad(loss_coll))(params)
  sep_loss, sep_grads = jax.jit(lazy_optax.value_and_grad(
      lambda t: _loss(_separate(t, IDS))))(tables)
  assert loss == sep_loss
  (stack,) = coll.plan
  g = grads[stack.name]
  assert isinstance(g, lazy_optax.SparseRows) and g.num_rows == stack.rows
  dense = np.asarray(g.to_dense())
  for name, offset, rows in zip(stack.tables, stack.offsets, stack.table_rows):
    np.testing.assert_array_equal(dense[offset:offset + rows],
                                  sep_grads[name].to_dense(), err_msg=name)


def test_bags_masks_weights_and_max():
  coll = EmbeddingCollection(
      TABLES[:1], [FeatureSpec('w', 'a', mode='sum'),
                   FeatureSpec('m', 'a', mode='max', padding_id=4)])
  params = coll.init(jax.random.key(2))
  table = coll.tables(params)['a']
  ids = np.array([[1, 4, 2], [0, 0, 3]], np.int32)
  mask = np.array([[True, False, True], [True, True, False]])
  weights = np.array([[0.5, 2.0, -1.0], [1.0, 3.0, 1.0]], np.float32)
  got = coll.lookup(params, {'w': ids, 'm': ids}, masks={'w': mask},
                    weights={'w': weights})
  np.testing.assert_array_equal(
      got['w'], lazy_optax.lookup_bag(table, ids, mode='sum', mask=mask,
                                      per_sample_weights=weights))
  np.testing.assert_array_equal(
      got['m'], lazy_optax.lookup_bag(table, ids, mode='max', padding_id=4))


def test_lookup_errors_name_the_feature_and_table():
  coll = _coll()
  params = coll.init(jax.random.key(0))
  with pytest.raises(ValueError, match="no feature 'fz'"):
    coll.lookup(params, {'fz': np.zeros(2, np.int32)})
  with pytest.raises(ValueError, match=r'lookup of table c \(feature fc\): '
                     r'ids must be a padded \[batch, max_len\] array, got '
                     r'shape \(4,\)'):
    coll.lookup(params, {'fc': np.zeros(4, np.int32)})
  with pytest.raises(ValueError, match=r"table a \(feature fa\): \['lengths'\]"
                     ' given for a feature of single ids'):
    coll.lookup(params, {'fa': IDS['fa']}, lengths={'fa': np.ones(4)})
  with pytest.raises(ValueError, match="lengths given for feature 'fc', whose "
                     'ids are not'):
    coll.lookup(params, {'fa': IDS['fa']}, lengths=LENGTHS)
  with pytest.raises(TypeError, match='integer'):
    coll.lookup(params, {'fa': np.zeros(2, np.float32)})
  with pytest.raises(ValueError, match="params have no stack"):
    coll.lookup({'x': params['default_float32_3']}, {'fa': IDS['fa']})


# -- no table reads or writes a neighbour ---------------------------------------

def _edge_ids(rows):
  return [-1, rows, rows + 1]


@pytest.mark.parametrize('table', ['a', 'b', 'c'])
def test_out_of_range_ids_raise_naming_the_table(table):
  coll = EmbeddingCollection(TABLES)   # one feature of single ids a table
  params = coll.init(jax.random.key(0))
  rows = coll.table(table).rows
  for bad in _edge_ids(rows):
    with pytest.raises(ValueError, match=(
        rf'lookup of table {table} \(feature {table}\): id {bad} at position '
        rf'\[1\] is out of range for a table of {rows} rows')):
      coll.lookup(params, {table: np.array([0, bad], np.int32)})


def test_out_of_range_ids_touch_no_neighbour_under_jit():
  """Ids at -1, rows and rows + 1 of every table of the stack: zero rows,
  no gradient row, every row and its Adam state bit for bit."""
  coll = EmbeddingCollection(TABLES)
  (stack,) = coll.plan
  params = coll.init(jax.random.key(0))
  tx = coll.optimizer({'default': lazy_optax.lazy_adam(0.1)})
  state = tx.init(params)
  # One good id a table (a's row 1, ...), then the edges of every table.
  ids = {t.name: np.array([1] + _edge_ids(t.rows), np.int32) for t in TABLES}

  @jax.jit
  def step(params, state, ids):
    def loss(p):
      rows = coll.lookup(p, ids)
      return sum(jnp.sum(r ** 2) for r in rows.values()), rows
    (_, rows), grads = lazy_optax.value_and_grad(loss, has_aux=True)(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, rows, grads

  new, new_state, rows, grads = step(params, state, ids)
  for name, r in rows.items():
    np.testing.assert_array_equal(r[1:], 0.0, err_msg=name)
    assert np.all(np.asarray(r[0]) != 0)
  touched = {offset + 1 for offset in stack.offsets}
  dense = np.asarray(grads[stack.name].to_dense())
  old, now = np.asarray(params[stack.name]), np.asarray(new[stack.name])
  mu = np.asarray(lazy_optax.compat.get_slot(new_state, stack.name, 'm'))
  for row in range(stack.rows):
    if row in touched:
      assert np.all(dense[row] != 0) and np.all(now[row] != old[row]), row
    else:
      np.testing.assert_array_equal(dense[row], 0.0, err_msg=str(row))
      np.testing.assert_array_equal(now[row], old[row], err_msg=str(row))
      np.testing.assert_array_equal(mu[row], 0.0, err_msg=str(row))


def test_checked_mode_names_the_table():
  coll = _coll()
  params = coll.init(jax.random.key(0))

  @jax.jit
  def step(params, ids, lengths):
    coll.check_ids(ids, lengths=lengths)
    return coll.lookup(params, ids, lengths=lengths)

  checked = lazy_optax.checks.checked(step)
  checked(params, IDS, LENGTHS)    # all in range: no error
  bad = dict(IDS, fc=IDS['fc'].copy())
  bad['fc'][3, 0] = 6              # table c has 6 rows; slot is real
  with pytest.raises(lazy_optax.checks.CheckError, match=(
      r'lookup of table c \(feature fc\): id 6 at position 9 is out of range '
      'for a table of 6 rows')) as info:
    checked(params, bad, LENGTHS)
  np.testing.assert_array_equal(info.value.outputs['fc'][3], 0.0)
  # Beyond its bag's length, the slot is not real: not reported.
  bad['fc'][2, 1] = 17
  bad['fc'][3, 0] = 5
  checked(params, bad, LENGTHS)


def test_optimizer_needs_every_label():
  coll = EmbeddingCollection([TableSpec('a', 5, 4, optimizer='sparse')])
  with pytest.raises(ValueError, match=r"no transformation for optimizer "
                     r"labels \['sparse'\]"):
    coll.optimizer({'default': optax.sgd(0.1)})
  coll = EmbeddingCollection([TableSpec('a', 5, 4, lr_multiplier=2.0)])
  with pytest.raises(ValueError, match="lr_multiplier 2 with optimizer label "
                     "'default', which is a transformation: give a factory"):
    coll.optimizer({'default': lazy_optax.ftrl(0.1)})


def test_guide_runs_as_written(capsys):
  """docs/collections.md's code runs, and prints the plan it shows."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  text = (pathlib.Path(__file__).resolve().parent.parent / 'docs' /
          'collections.md').read_text()
  blocks = re.findall(r'```(python|text)\n(.*?)```', text, re.S)
  namespace: dict = {}
  exec(compile(blocks[0][1], 'docs/collections.md', 'exec'), namespace)  # pylint: disable=exec-used
  assert blocks[1][0] == 'text'
  assert capsys.readouterr().out == blocks[1][1]
  start = namespace['coll'].tables(namespace['coll'].init(jax.random.key(0)))
  code = blocks[2][1]
  exec(compile(code, 'docs/collections.md', 'exec'), namespace)  # pylint: disable=exec-used
  now = namespace['coll'].tables(namespace['params']['emb'])
  assert np.isfinite(float(namespace['loss']))
  # Adam's first step moves a touched row by its learning rate: 1e-2 for
  # user, 1e-2 * 0.5 for item (lr_multiplier 0.5, scaled in the stack).
  np.testing.assert_allclose(np.abs(now['user'][3] - start['user'][3]), 1e-2,
                             rtol=1e-3)
  np.testing.assert_allclose(np.abs(now['item'][1] - start['item'][1]), 5e-3,
                             rtol=1e-3)
  np.testing.assert_array_equal(now['user'][4], start['user'][4])
  np.testing.assert_array_equal(np.asarray(now['item'])[[0, 3]],
                                np.asarray(start['item'])[[0, 3]])
  with pytest.raises(ValueError) as info:
    namespace['coll'].lookup(namespace['params']['emb'],
                             {'user': jnp.array([3, 1000])})
  assert str(info.value) == blocks[3][1].strip()


def test_one_run_of_features_with_and_without_padding():
  """Single-id features of one shape and distinct tables are read side by
  side; padding slots of one of them stay inactive, the others real."""
  coll = EmbeddingCollection(TABLES, [FeatureSpec('x', 'a', padding_id=0),
                                      FeatureSpec('y', 'b'),
                                      FeatureSpec('z', 'c', padding_id=2)])
  params = coll.init(jax.random.key(4))
  tables = coll.tables(params)
  ids = {'x': np.array([0, 1, 0, 3], np.int32),
         'y': np.array([0, 0, 2, 3], np.int32),
         'z': np.array([2, 5, 2, 1], np.int32)}

  def separate(t):
    return {'x': lazy_optax.lookup(t['a'], ids['x'], padding_id=0),
            'y': lazy_optax.lookup(t['b'], ids['y']),
            'z': lazy_optax.lookup(t['c'], ids['z'], padding_id=2)}

  _, grads = lazy_optax.value_and_grad(
      lambda p: _loss(coll.lookup(p, ids)))(params)
  _, want = lazy_optax.value_and_grad(lambda t: _loss(separate(t)))(tables)
  (stack,) = coll.plan
  dense = np.asarray(grads[stack.name].to_dense())
  for name, offset, rows in zip(stack.tables, stack.offsets, stack.table_rows):
    np.testing.assert_array_equal(dense[offset:offset + rows],
                                  want[name].to_dense(), err_msg=name)
  assert np.all(dense[0] == 0) and np.all(dense[stack.offsets[1]] != 0)
