"""A model trained through an EmbeddingCollection equals it with separate
tables, for every optimizer of tests/optimizer_cases.py (`CASES`).

The model: three tables of width 3 (learning-rate multipliers 1, 2 and
0.5), five features (single ids of two tables read side by side, a second
feature of single ids on the first table, a bag of sums with padding id 0,
a bag of means with lengths on a table another feature reads too) and
a dense weight trained with `optax.adam`; 3 jitted steps. The reference
looks each feature up with `lookup` / `lookup_bag` on its own table, in the
features' order, with each table's optimizer `case.make(lr * multiplier)`
in an `optax.partition` built here.

* Tables of other multipliers in stacks of their own (the default for
  every label): the params, every state slot and the loss bit for bit, the
  same arithmetic.
* A label declared linear in the learning rate (the rules whose update is
  `lr` times a rule of the gradients: `lazy_adam`, `lazy(optax.adam)`,
  `rowwise_adagrad`): one stack, each table's row updates scaled by its multiplier.
  `lr * (m * u)` is rounded where `(lr * m) * u` was, so each step may move
  a row by one float32 rounding of its update; through the dense weight the
  next gradients differ by as little. Checked within 2 ulps of the row a
  step, the state slots (which do not see the learning rate) within 1e-6.
* Rows no feature touched stay bit for bit, and their state at its start.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optimizer_cases import CASES
import pytest

import lazy_optax
from lazy_optax import EmbeddingCollection
from lazy_optax import FeatureSpec
from lazy_optax import TableSpec

STEPS, BATCH = 3, 4
MULTIPLIERS = {'a': 1.0, 'b': 2.0, 'c': 0.5}
ROWS = {'a': 7, 'b': 6, 'c': 8}
# fa and fc1 (with a padding id) are read as one run (one ids shape, two
# tables); fa2 starts another (table a again); then the bags.
FEATURES = (FeatureSpec('fa', 'a'),
            FeatureSpec('fc1', 'c', padding_id=1),
            FeatureSpec('fa2', 'a'),
            FeatureSpec('fb', 'b', mode='sum', padding_id=0),
            FeatureSpec('fc', 'c', mode='mean'))
# Rules whose update is linear in the learning rate (also
# partial_rowwise_adam and lazy_adam+cowclip), one of each family run with
# multipliers scaled inside one stack.
LINEAR = ('lazy_adam', 'rowwise_adagrad', 'lazy(optax.adam)')


def _collection(linear):
  tables = [TableSpec(n, ROWS[n], 3, lr_multiplier=MULTIPLIERS[n])
            for n in ('a', 'b', 'c')]
  return EmbeddingCollection(tables, FEATURES,
                             linear_in_lr=('default',) if linear else ())


def _batches():
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    fb = rng.integers(0, 4, (BATCH, 3)).astype(np.int32)  # rows 4, 5 unused
    out.append(({'fa': rng.integers(0, 5, BATCH).astype(np.int32),
                 'fc1': rng.integers(1, 4, BATCH).astype(np.int32),
                 'fb': fb,
                 'fa2': rng.integers(2, 5, BATCH).astype(np.int32),
                 'fc': rng.integers(0, 6, (BATCH, 2)).astype(np.int32)},
                {'fc': rng.integers(0, 3, BATCH).astype(np.int32)}))
  return out


def _tables(case):
  rng = np.random.default_rng(1)
  return {n: jnp.asarray(case.table_scale * rng.normal(size=(ROWS[n], 3)),
                         jnp.float32) for n in ('a', 'b', 'c')}


def _loss(rows, w):
  out = 0.0
  for k, r in enumerate(rows.values()):
    out = out + jnp.sum(jnp.tanh(r * w) * (k + 1.0)) + 0.1 * jnp.sum(r ** 2)
  return out


def _separate_rows(tables, ids, lengths):
  return {
      'fa': lazy_optax.lookup(tables['a'], ids['fa']),
      'fc1': lazy_optax.lookup(tables['c'], ids['fc1'], padding_id=1),
      'fa2': lazy_optax.lookup(tables['a'], ids['fa2']),
      'fb': lazy_optax.lookup_bag(tables['b'], ids['fb'], mode='sum',
                                  padding_id=0),
      'fc': lazy_optax.lookup_bag(tables['c'], ids['fc'], mode='mean',
                                  lengths=lengths['fc'])}


def _train(models):
  """Trains every `(tx, params, rows_of)` model on the batches, in one jitted
  step for all (one compilation a case); returns `(params, state, losses)`
  of each."""
  txs = [tx for tx, _, _ in models]
  readers = [rows_of for _, _, rows_of in models]

  @jax.jit
  def step(params, states, ids, lengths):
    out = []
    for tx, rows_of, p, state in zip(txs, readers, params, states):
      def loss(p, rows_of=rows_of):
        return _loss(rows_of(p['emb'], ids, lengths), p['w'])
      value, grads = lazy_optax.value_and_grad(loss)(p)
      updates, state = tx.update(grads, state, p)
      out.append((lazy_optax.apply_updates(p, updates), state, value))
    return tuple(zip(*out))

  # Tuples, as the step returns them: a list would trace and compile the
  # step a second time at the second call (another pytree).
  params = tuple(p for _, p, _ in models)
  states = tuple(tx.init(p) for tx, p, _ in models)
  losses = []
  for ids, lengths in _batches():
    params, states, values = step(params, states, ids, lengths)
    losses.append(values)
  return [(p, s, [v[i] for v in losses])
          for i, (p, s) in enumerate(zip(params, states))]


def _with_dense(emb_tx):
  return optax.partition({'emb': emb_tx, 'w': optax.adam(0.01)},
                         lazy_optax.tree.path_labels(
                             lambda name: name.split('/')[0]))


def _separate(case):
  txs = {n: case.make(case.lr * m) for n, m in MULTIPLIERS.items()}
  emb_tx = optax.partition(txs, lazy_optax.tree.path_labels(
      lambda name: name.split('/')[-1]))
  params = {'emb': _tables(case), 'w': jnp.full(3, 0.7, jnp.float32)}
  return _with_dense(emb_tx), params, _separate_rows


def _collected(case, coll):
  tx = coll.optimizer({'default': lambda m: case.make(case.lr * m)})
  params = {'emb': coll.params_from_tables(_tables(case)),
            'w': jnp.full(3, 0.7, jnp.float32)}
  return (_with_dense(tx), params,
          lambda p, ids, lengths: coll.lookup(p, ids, lengths=lengths))


def _touched():
  seen = {n: set() for n in ROWS}
  for ids, lengths in _batches():
    seen['a'].update(ids['fa'].tolist() + ids['fa2'].tolist())
    seen['b'].update(i for i in ids['fb'].reshape(-1).tolist() if i != 0)
    seen['c'].update(i for i in ids['fc1'].tolist() if i != 1)
    for b, n in enumerate(lengths['fc']):
      seen['c'].update(ids['fc'][b, :n].tolist())
  return seen


def _ulps(x):
  return np.spacing(np.abs(np.asarray(x, np.float32)))


def _compare(case, coll, got, want, exact):
  (params, state, losses), (ref_params, ref_state, ref_losses) = got, want
  tables = coll.tables(params['emb'])
  touched = _touched()
  start = _tables(case)
  for name in ROWS:
    ref = np.asarray(ref_params['emb'][name])
    if exact:
      np.testing.assert_array_equal(tables[name], ref, err_msg=name)
    else:
      np.testing.assert_array_less(np.abs(np.asarray(tables[name]) - ref),
                                   2 * STEPS * _ulps(ref) + 1e-30,
                                   err_msg=name)
    untouched = [r for r in range(ROWS[name]) if r not in touched[name]]
    assert untouched, name
    np.testing.assert_array_equal(np.asarray(tables[name])[untouched],
                                  np.asarray(start[name])[untouched])
    stack = coll.stack_of(name)
    offset, rows = stack.span(name)
    for s in case.slots:
      mine = lazy_optax.compat.get_slot(state, f'emb/{stack.name}', s.name)
      mine = np.asarray(mine)[offset:offset + rows]
      theirs = np.asarray(lazy_optax.compat.get_slot(ref_state, f'emb/{name}',
                                                     s.name))
      if exact:
        np.testing.assert_array_equal(mine, theirs, err_msg=f'{name} {s.name}')
      else:
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7,
                                   err_msg=f'{name} {s.name}')
      np.testing.assert_array_equal(mine[untouched],
                                    np.full_like(mine[untouched], s.initial),
                                    err_msg=f'{name} {s.name} untouched')
  if exact:
    np.testing.assert_array_equal(np.asarray(losses), np.asarray(ref_losses))
    np.testing.assert_array_equal(params['w'], ref_params['w'])


@pytest.mark.parametrize('case', CASES, ids=str)
def test_collection_trains_as_separate_tables(case):
  exact = _collection(linear=False)
  assert len(exact.plan) == 3          # one stack per multiplier
  colls = [exact]
  if case.name in LINEAR:
    colls.append(_collection(linear=True))
    (stack,) = colls[1].plan
    assert stack.lr_multiplier is None
  separate, *runs = _train([_separate(case)]
                           + [_collected(case, c) for c in colls])
  for coll, run in zip(colls, runs):
    _compare(case, coll, run, separate, exact=coll is exact)


def test_shared_stack_bit_for_bit_for_equal_multipliers():
  """Tables a and c of one multiplier in one stack (FTRL, not linear):
  the stack is exact, and so is b in its own."""
  case = next(c for c in CASES if c.name == 'ftrl')
  global MULTIPLIERS  # pylint: disable=global-statement
  saved = MULTIPLIERS
  MULTIPLIERS = {'a': 0.5, 'b': 2.0, 'c': 0.5}
  try:
    coll = _collection(linear=False)
    assert [s.tables for s in coll.plan] == [('a', 'c'), ('b',)]
    separate, run = _train([_separate(case), _collected(case, coll)])
    _compare(case, coll, run, separate, exact=True)
  finally:
    MULTIPLIERS = saved
