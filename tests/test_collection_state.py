"""Each table is still a table: params and optimizer state by table name.

A run trained with separate tables (`table_optimizer`, `lookup` /
`lookup_bag` per table) resumes in the collection (`params_from_tables`,
`state_from_tables`) and back again (`tables`, `state_tables`): bit for
bit the run that never left separate tables, for optimizers with moments
(`lazy_adam`), accumulators (`ftrl`) and per-row counters
(`adam_with_counter`). A stack's tables that disagree on a shared state
leaf (a step count) are refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
from optimizer_cases import BY_NAME
import pytest
from test_collection_training import _batches
from test_collection_training import _loss
from test_collection_training import _separate_rows
from test_collection_training import FEATURES
from test_collection_training import ROWS

import lazy_optax
from lazy_optax import EmbeddingCollection
from lazy_optax import TableSpec

MULTIPLIERS = {'a': 1.0, 'b': 2.0, 'c': 1.0}   # stacks {a, c} and {b}


def _collection():
  return EmbeddingCollection(
      [TableSpec(n, ROWS[n], 3, lr_multiplier=MULTIPLIERS[n])
       for n in ('a', 'b', 'c')], FEATURES)


def _stepper(tx, rows_of):
  @jax.jit
  def step(params, state, ids, lengths):
    def loss(p):
      return _loss(rows_of(p, ids, lengths), jnp.ones(3))
    _, grads = lazy_optax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


@pytest.mark.parametrize('name', ['lazy_adam', 'ftrl', 'adam_with_counter'])
def test_resume_in_collection_and_back_bit_for_bit(name):
  case = BY_NAME[name]
  coll = _collection()
  assert [s.tables for s in coll.plan] == [('a', 'c'), ('b',)]
  transforms = {'default': lambda m: case.make(case.lr * m)}
  table_tx = coll.table_optimizer(transforms)
  separate = _stepper(table_tx, _separate_rows)
  stacked = _stepper(coll.optimizer(transforms),
                     lambda p, ids, lengths: coll.lookup(p, ids,
                                                         lengths=lengths))
  rng = np.random.default_rng(4)
  start = {n: jnp.asarray(case.table_scale * rng.normal(size=(ROWS[n], 3)),
                          jnp.float32) for n in ROWS}
  batches = _batches() * 2           # 6 steps

  params, state = start, table_tx.init(start)
  for ids, lengths in batches:
    params, state = separate(params, state, ids, lengths)
  straight = params, state

  params, state = start, table_tx.init(start)
  for ids, lengths in batches[:2]:
    params, state = separate(params, state, ids, lengths)
  params = coll.params_from_tables(params)
  state = coll.state_from_tables(state, transforms)
  assert (jax.tree.structure(state) == jax.tree.structure(
      coll.optimizer(transforms).init(params)))
  for ids, lengths in batches[2:4]:
    params, state = stacked(params, state, ids, lengths)
  params = coll.tables(params)
  state = coll.state_tables(state, transforms)
  for ids, lengths in batches[4:]:
    params, state = separate(params, state, ids, lengths)

  assert jax.tree.structure((params, state)) == jax.tree.structure(straight)
  for got, want in zip(jax.tree.leaves((params, state)),
                       jax.tree.leaves(straight)):
    np.testing.assert_array_equal(got, want)


def test_state_from_tables_refuses_tables_not_trained_together():
  coll = _collection()
  case = BY_NAME['lazy_adam']
  transforms = {'default': lambda m: case.make(case.lr * m)}
  table_tx = coll.table_optimizer(transforms)
  tables = coll.tables(coll.init(jax.random.key(0)))
  state = table_tx.init(tables)
  step = _stepper(table_tx, _separate_rows)
  ids, lengths = _batches()[0]
  _, later = step(tables, state, ids, lengths)
  # Table c's state from one step later than a's: counts 0 and 1.
  mixed = state._replace(inner_states=dict(
      state.inner_states, c=later.inner_states['c']))
  with pytest.raises(ValueError, match="tables 'a' and 'c' hold different "
                     'values of a state leaf their stack shares'):
    coll.state_from_tables(mixed, transforms)
  with pytest.raises(ValueError, match="the state has no part 'b'"):
    coll.state_from_tables(state._replace(inner_states={
        k: v for k, v in state.inner_states.items() if k != 'b'}), transforms)
