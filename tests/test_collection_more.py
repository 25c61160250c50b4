"""An EmbeddingCollection equals separate tables under the wrappers and
around the steps: `wrappers.multi_steps`, bfloat16 tables with nearest and
stochastic rounding, orbax checkpoints (also into another plan), and an
`IdTable` per hashed feature.

The model: tables a (7 rows), b (6) and c (5), width 3, in one stack; a
feature of single ids on a, one on b and a bag of sums on c (padding id 0);
a loss through a fixed weight. The separate model looks each feature up on
its own table with `lookup` / `lookup_bag` and trains the dict of tables
with the same optimizer, built independently of the collection.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax
from lazy_optax import EmbeddingCollection
from lazy_optax import FeatureSpec
from lazy_optax import TableSpec

ROWS = {'a': 7, 'b': 6, 'c': 5}
BATCH, LR = 4, 0.05
FEATURES = (FeatureSpec('fa', 'a'), FeatureSpec('fb', 'b'),
            FeatureSpec('fc', 'c', mode='sum', padding_id=0))
W = jnp.asarray([0.7, -1.3, 0.4], jnp.float32)


def _collection(dtype='float32', **specs):
  return EmbeddingCollection(
      [TableSpec(n, ROWS[n], 3, dtype=dtype, **specs.get(n, {}))
       for n in ROWS], FEATURES)


def _batches(steps, seed=0):
  """Rows 5 and 6 of a, 4 and 5 of b, 4 of c are never read."""
  rng = np.random.default_rng(seed)
  return [{'fa': rng.integers(0, 5, BATCH).astype(np.int32),
           'fb': rng.integers(0, 4, BATCH).astype(np.int32),
           'fc': rng.integers(0, 4, (BATCH, 2)).astype(np.int32)}
          for _ in range(steps)]


UNTOUCHED = {'a': [5, 6], 'b': [4, 5], 'c': [4]}


def _tables(dtype=jnp.float32):
  rng = np.random.default_rng(1)
  return {n: jnp.asarray(rng.normal(size=(r, 3)), dtype)
          for n, r in ROWS.items()}


def _loss(rows):
  out = 0.0
  for k, r in enumerate(rows.values()):
    out = out + jnp.sum(jnp.tanh(r.astype(jnp.float32) * W) * (k + 1.0))
  return out


def _separate_rows(tables, ids):
  return {'fa': lazy_optax.lookup(tables['a'], ids['fa']),
          'fb': lazy_optax.lookup(tables['b'], ids['fb']),
          'fc': lazy_optax.lookup_bag(tables['c'], ids['fc'], mode='sum',
                                      padding_id=0)}


def _train(models, batches, apply=None):
  """Trains each `(tx, params, rows_of)` model on `batches` in one jitted
  step for all; returns `[(params, state, losses)]`."""
  txs = [tx for tx, _, _ in models]
  readers = [rows_of for _, _, rows_of in models]
  apply = apply or (lambda p, u, t: lazy_optax.apply_updates(p, u))

  @jax.jit
  def step(params, states, ids, t):
    out = []
    for tx, rows_of, p, state in zip(txs, readers, params, states):
      value, grads = lazy_optax.value_and_grad(
          lambda p, rows_of=rows_of: _loss(rows_of(p, ids)))(p)
      updates, state = tx.update(grads, state, p)
      out.append((apply(p, updates, t), state, value))
    return tuple(zip(*out))

  # Tuples, as the step returns them: a list would trace and compile the
  # step a second time at the second call (another pytree).
  params = tuple(p for _, p, _ in models)
  states = tuple(tx.init(p) for tx, p, _ in models)
  losses = []
  for t, ids in enumerate(batches):
    params, states, values = step(params, states, ids, t)
    losses.append(values)
  return [(p, s, [v[i] for v in losses])
          for i, (p, s) in enumerate(zip(params, states))]


def _equal_trees(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _moments(state):
  """The `[rows, 3]` leaves of a state, by table: a table's state rows."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    name = lazy_optax.tree.path_name(path)
    if jnp.ndim(leaf) == 2:
      out[name] = np.asarray(leaf)
  return out


def _equal_moments(stack, coll_state, sep_state):
  """The stack's `mu` and `nu` rows, sliced per table, equal the separate
  tables' bit for bit; untouched rows' moments are zero."""
  coll_m = _moments(coll_state)
  sep_m = _moments(sep_state)
  assert len(coll_m) == 2 and len(sep_m) == 6, (coll_m.keys(), sep_m.keys())
  for kind in ('mu', 'nu'):
    (stacked,) = [v for n, v in coll_m.items() if kind in n]
    for name, offset, rows in zip(stack.tables, stack.offsets,
                                  stack.table_rows):
      (mine,) = [v for n, v in sep_m.items() if kind in n and
                 n.endswith(name)]
      np.testing.assert_array_equal(stacked[offset:offset + rows], mine)
      assert not mine[UNTOUCHED[name]].any()


# -- 1. wrappers.multi_steps ------------------------------------------------
def test_multi_steps_equals_separate_tables():
  """multi_steps(every_k=2) over the collection's optimizer (one row buffer
  for the stack: 4 + 4 + 8 ids a step) equals it over separate tables (a
  buffer per table), bit for bit: the tables, every moment row, the losses;
  untouched rows keep their values and zero moments."""
  coll = _collection()
  (stack,) = coll.plan
  k = 2
  coll_tx = lazy_optax.wrappers.multi_steps(
      coll.optimizer({'default': lazy_optax.lazy_adam(LR)}), every_k=k,
      ids_per_step={stack.name: 4 + 4 + 8})
  sep_tx = lazy_optax.wrappers.multi_steps(
      lazy_optax.lazy_adam(LR), every_k=k,
      ids_per_step={'a': 4, 'b': 4, 'c': 8})
  (cp, cs, closs), (sp, ss, sloss) = _train(
      [(coll_tx, coll.params_from_tables(_tables()), coll.lookup),
       (sep_tx, _tables(), _separate_rows)], _batches(2 * k))
  _equal_trees(coll.tables(cp), sp)
  np.testing.assert_array_equal(np.asarray(closs), np.asarray(sloss))
  assert int(cs.gradient_step) == int(ss.gradient_step) == 2
  _equal_moments(stack, cs.inner_state, ss.inner_state)
  for name, rows in UNTOUCHED.items():
    np.testing.assert_array_equal(np.asarray(sp[name])[rows],
                                  np.asarray(_tables()[name])[rows])


# -- 2. bfloat16 tables, nearest and stochastic rounding ---------------------
BF16 = jnp.bfloat16
KEY = jax.random.key(7)


def _bf16_models():
  coll = _collection('bfloat16')
  tx = lazy_optax.lazy_adam(LR)
  return coll, [(coll.optimizer({'default': tx}),
                 coll.params_from_tables(_tables(BF16)), coll.lookup),
                (tx, _tables(BF16), _separate_rows)]


def _untouched_kept(tables):
  for name, rows in UNTOUCHED.items():
    np.testing.assert_array_equal(np.asarray(tables[name])[rows],
                                  np.asarray(_tables(BF16)[name])[rows])


def test_bf16_nearest_rounding_equals_separate_tables():
  """bfloat16 tables rounded to nearest: bit for bit, 3 steps (tables,
  moments, losses; untouched rows)."""
  coll, models = _bf16_models()
  (stack,) = coll.plan
  assert stack.dtype == BF16
  (cp, cs, closs), (sp, ss, sloss) = _train(models, _batches(3))
  assert sp['a'].dtype == BF16
  _equal_trees(coll.tables(cp), sp)
  np.testing.assert_array_equal(np.asarray(closs), np.asarray(sloss))
  _equal_moments(stack, cs, ss)
  _untouched_kept(sp)


def _stochastic(p, u, t):
  return lazy_optax.precision.apply_updates_stochastic(p, u, key=KEY, step=t)


def test_bf16_stochastic_rounding_against_separate_tables():
  """Stochastic rounding draws row `r`'s bits from the key, the step, the
  parameter's path and `r`: a stack's table rows are other rows of another
  path than the separate tables', so the two runs draw other bits and
  cannot match bit for bit. What does: from the same params, one step's
  float32 targets `p + u` are equal bit for bit (the updates are, as the
  nearest run shows); every rounded value of both runs is one of the two
  bfloat16 neighbours of its target, rounded up about as often as the
  targets' fractions say (5 standard deviations); untouched rows stay bit
  for bit over 3 steps, and the losses agree to bfloat16's noise."""
  coll, models = _bf16_models()
  (stack,) = coll.plan
  ids = _batches(1)[0]

  @jax.jit
  def one_step(params):
    out = []
    for tx, p, rows_of in models:
      _, grads = lazy_optax.value_and_grad(lambda p, rows_of=rows_of: _loss(
          rows_of(p, ids)))(p)
      updates, _ = tx.update(grads, tx.init(p), p)
      wide = jax.tree.map(lambda x: x.astype(jnp.float32), p)
      out.append((lazy_optax.apply_updates(wide, updates),
                  _stochastic(p, updates, 0)))
    return out

  (c_wide, c_new), (s_wide, s_new) = one_step([m[1] for m in models])
  c_wide = dict(zip(stack.tables, _slices(stack, c_wide)))
  _equal_trees(c_wide, s_wide)
  ups, fracs = [], []
  for new in (coll.tables(c_new), s_new):
    away = 0  # entries not rounded to nearest: none if rounding were nearest
    for name in ROWS:
      target = np.asarray(s_wide[name])
      down, up = _neighbours(target)
      got = np.asarray(new[name], np.float64)
      assert np.all((got == down) | (got == up)), name
      between = up > down
      away += np.sum(got != np.asarray(target.astype(np.dtype(BF16)),
                                       np.float64))
      ups.append((got == up)[between])
      fracs.append(((target - down) / np.where(between, up - down, 1))[
          between])
    assert away > 0
  ups, fracs = np.concatenate(ups), np.concatenate(fracs)
  assert ups.size > 30  # both runs: every touched entry between neighbours
  sd = np.sqrt(np.sum(fracs * (1 - fracs)))
  assert abs(ups.sum() - fracs.sum()) < 5 * sd + 1, (ups.sum(), fracs.sum())
  _untouched_kept(coll.tables(c_new))
  _untouched_kept(s_new)

def _slices(stack, params):
  (array,) = params.values()
  return [array[o:o + r] for o, r in zip(stack.offsets, stack.table_rows)]


def _neighbours(target):
  """The bfloat16 values at or below and at or above float32 `target`, in
  float64 (numpy's bfloat16: no device op)."""
  bf16 = np.dtype(BF16)
  near = target.astype(bf16)
  below = np.nextafter(near, np.full_like(near, -np.inf))
  above = np.nextafter(near, np.full_like(near, np.inf))
  wide = near.astype(np.float64)
  down = np.where(wide > target, below.astype(np.float64), wide)
  up = np.where(wide < target, above.astype(np.float64), wide)
  return down, up


# -- 3. row-sharded over 8 devices ------------------------------------------
def test_row_sharded_stack_equals_one_device():
  """tests/collection_sharded_checks.py in the 8-device process: a stack
  row-sharded over 8 devices, 3 steps of lazy_adam and rowwise_adagrad
  against one device: within 2e-6, untouched rows and state bit for bit."""
  import eight_devices  # pylint: disable=g-import-not-at-top
  out = eight_devices.call('collection_sharded_checks', 'run')
  assert set(out) == {'lazy_adam', 'rowwise_adagrad'}
  for result in out.values():
    assert result['rows_moved'] >= 20
    assert result['state_shardings'][0] == "P('rows',)"


# -- 4. orbax checkpoints, also into another plan ----------------------------
def _ckpt(path, tree, target=None):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as ckptr:
    if target is None:
      ckptr.save(path, tree)
      return None
    return ckptr.restore(path, target)


def _stepper(coll, tx):
  @jax.jit
  def step(params, state, ids):
    _, grads = lazy_optax.value_and_grad(
        lambda p: _loss(coll.lookup(p, ids)))(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


def test_orbax_resume_and_regroup(tmp_path):
  """Saved after 2 of 4 steps and restored: the stacked params and state
  continue bit for bit the run that never stopped. The per-table views
  (`tables`, `state_tables`) saved and restored into a collection whose
  plan moved table b to a stack of its own (`TableSpec(stack='solo')`)
  continue bit for bit too: each table's rows and state rows, and the
  count every stack shares."""
  transforms = {'default': lazy_optax.lazy_adam(LR)}
  coll = _collection()
  tx = coll.optimizer(transforms)
  step = _stepper(coll, tx)
  batches = _batches(4, seed=3)
  params = coll.init(jax.random.key(0))
  state = tx.init(params)
  for ids in batches[:2]:
    params, state = step(params, state, ids)
  _ckpt(tmp_path / 'stacked', {'params': params, 'state': state})
  _ckpt(tmp_path / 'tables', {'tables': coll.tables(params),
                              'state': coll.state_tables(state, transforms)})
  restored = _ckpt(tmp_path / 'stacked', None, jax.tree.map(
      jnp.zeros_like, {'params': params, 'state': state}))
  rp, rs = restored['params'], restored['state']
  for ids in batches[2:]:
    params, state = step(params, state, ids)   # never stopped
    rp, rs = step(rp, rs, ids)
  _equal_trees((rp, rs), (params, state))

  # Another plan: b alone in stack 'solo'.
  moved = _collection(b={'stack': 'solo'})
  assert [s.tables for s in moved.plan] == [('a', 'c'), ('b',)]
  moved_tx = moved.optimizer(transforms)
  fresh = moved.init(jax.random.key(1))
  target = {'tables': jax.tree.map(jnp.zeros_like, moved.tables(fresh)),
            'state': jax.tree.map(jnp.zeros_like, moved.state_tables(
                moved_tx.init(fresh), transforms))}
  views = _ckpt(tmp_path / 'tables', None, target)
  mp = moved.params_from_tables(views['tables'])
  ms = moved.state_from_tables(views['state'], transforms)
  moved_step = _stepper(moved, moved_tx)
  for ids in batches[2:]:
    mp, ms = moved_step(mp, ms, ids)
  _equal_trees(moved.tables(mp), coll.tables(params))
  _equal_trees(moved.state_tables(ms, transforms),
               coll.state_tables(state, transforms))


# -- 5. an IdTable per hashed feature ---------------------------------------
def _hashed_collection():
  """a and c hashed (padding id: the capacity, IdTable's "no row"), b not."""
  return EmbeddingCollection(
      [TableSpec(n, ROWS[n], 3) for n in ROWS],
      [FeatureSpec('fa', 'a', padding_id=ROWS['a']), FeatureSpec('fb', 'b'),
       FeatureSpec('fc', 'c', padding_id=ROWS['c'])])


RAW_A = ([10, 11, 12, 10], [11, 13, 14, 10], [20, 21, 22, 23])
RAW_C = ([100, 101, 102, 100], [101, 102, 100, 100], [100, 101, 102, 101])


def test_id_table_per_hashed_feature():
  """One IdTable per hashed table; its slots, fed as the feature's ids, land
  in the table's rows of the stack. At step 2 ids 20 to 23 take four slots
  of a (two free, two evicted from trained ids; c sees no new id):
  `fresh_rows` + `reset_rows` reset those rows of a and their moments, and no other row of the stack (b, c, a's
  other rows: values and moments bit for bit); with `init=None` the reset
  stack is bit for bit the separate tables reset with their own FreshRows.
  `export_changes` per table: its slots index `coll.tables(params)[name]`."""
  coll = _hashed_collection()
  (stack,) = coll.plan
  id_tables = {n: lazy_optax.IdTable(capacity=ROWS[n], probe=ROWS[n],
                                     admission='always') for n in 'ac'}
  tx = coll.optimizer({'default': lazy_optax.lazy_adam(LR)})
  init = jax.nn.initializers.normal(0.5)
  key = jax.random.key(3)

  @jax.jit
  def step(params, state, id_states, words, fb, t):
    slots, fresh = {}, {}
    for n in 'ac':
      slots[n], id_states[n], fresh[n] = id_tables[n].assign(
          id_states[n], words[n], step=t)
    moved = coll.fresh_rows(fresh)
    params, state = lazy_optax.reset_rows(tx, params, state, moved,
                                          init=init, key=key)
    reset = (params, state, moved, fresh)
    ids = {'fa': slots['a'], 'fb': fb, 'fc': slots['c']}
    _, grads = lazy_optax.value_and_grad(
        lambda p: _loss(coll.lookup(p, ids)))(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, id_states, reset

  params = coll.init(jax.random.key(0))
  state = tx.init(params)
  id_states = {n: t.init() for n, t in id_tables.items()}
  fbs = _batches(3)
  for t in range(3):
    words = {'a': lazy_optax.split_ids(np.asarray(RAW_A[t], np.int64)),
             'c': lazy_optax.split_ids(np.asarray(RAW_C[t], np.int64))}
    before = (params, state)
    params, state, id_states, reset = step(params, state, id_states, words,
                                           fbs[t]['fb'], jnp.int32(t))
  rp, rs, moved, fresh = reset   # step 2's reset, before its update
  a_off, _ = stack.span('a')
  new_a = sorted(int(s) for s in np.asarray(fresh['a'].slots) if s < 7)
  assert len(new_a) == 4 and not (np.asarray(fresh['c'].slots) < 5).any()
  changed = np.zeros(stack.rows, bool)
  changed[[a_off + s for s in new_a]] = True
  np.testing.assert_array_equal(
      np.sort(np.asarray(moved[stack.name].slots)[
          np.asarray(moved[stack.name].slots) < stack.rows]),
      np.flatnonzero(changed))
  old_p, old_s = before[0][stack.name], before[1]
  new_p = np.asarray(rp[stack.name])
  np.testing.assert_array_equal(new_p[~changed], np.asarray(old_p)[~changed])
  assert (new_p[changed] != np.asarray(old_p)[changed]).all()
  for (_, old), (_, new) in zip(_moments(old_s).items(),
                                _moments(rs).items()):
    np.testing.assert_array_equal(new[~changed], old[~changed])
    assert not new[changed].any() and old[changed].any(axis=1).sum() == 2
  # init=None: the stack reset equals each table reset on its own.
  zp, zs = lazy_optax.reset_rows(tx, *before, moved, init=None)
  sep_tx = lazy_optax.lazy_adam(LR)
  tables = coll.tables(before[0])
  sep_state = coll.state_tables(before[1], {'default': sep_tx})
  sep_p, sep_s = lazy_optax.reset_rows(
      coll.table_optimizer({'default': sep_tx}), tables, sep_state,
      {n: fresh[n] for n in 'ac'}, init=None)
  _equal_trees(coll.tables(zp), sep_p)
  _equal_trees(coll.state_tables(zs, {'default': sep_tx}), sep_s)
  # export_changes per table: ids and slots in the table's own rows.
  ids_a, slots_a, evicted = id_tables['a'].export_changes(id_states['a'], 2)
  assert sorted(ids_a.tolist()) == [20, 21, 22, 23] and evicted.size == 2
  assert sorted(slots_a.tolist()) == new_a
  served = np.asarray(coll.tables(params)['a'])[slots_a]
  np.testing.assert_array_equal(
      served, np.asarray(params[stack.name])[a_off + slots_a])


def test_fresh_rows_refuses_another_capacity_and_names_the_path():
  coll = _hashed_collection()
  wrong = lazy_optax.IdTable(capacity=6, probe=6, admission='always')
  _, _, fresh = wrong.assign(wrong.init(), np.array([5]), step=0)
  with pytest.raises(ValueError, match=r"table 'a' has 7 rows.*capacity 6"):
    coll.fresh_rows({'a': fresh})
  # The params' path in a model names the stack's path.
  right = lazy_optax.IdTable(capacity=7, probe=7, admission='always')
  _, _, fresh = right.assign(right.init(), np.array([5, 6]), step=0)
  out = coll.fresh_rows({'a': fresh}, prefix='emb')
  assert list(out) == ['emb/' + coll.plan[0].name]
  assert out['emb/' + coll.plan[0].name].capacity == coll.plan[0].rows
