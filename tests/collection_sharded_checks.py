"""An EmbeddingCollection's stack row-sharded over 8 simulated CPU devices.

Run by tests/test_collection_more.py in the 8-device process of
tests/eight_devices.py (XLA_FLAGS must name the device count before jax is
imported):

    eight_devices.call('collection_sharded_checks', 'run')

or as a script: `python3 tests/collection_sharded_checks.py`.

Three tables (13, 11 and 8 rows of width 3, one stack of 32 rows) read by
single ids, a second feature on one table and a bag of sums with padding;
3 jitted steps of `lazy_adam` and of `rowwise_adagrad`, the stack and its
per-row state sharded by rows over a mesh of 8 devices ('rows'), the ids
replicated. Each step equals the same step on one device, shardings kept
from step to step: tables and state within 2e-6 relative
(tests/sharded_checks.py's bound for one table; `rowwise_adagrad` differs
by ulps for a lone table too; see docs/collections.md for `lazy_adam`), untouched rows and their state bit for
bit.
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      ' --xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import lazy_optax  # pylint: disable=g-import-not-at-top

ROWS = {'a': 13, 'b': 11, 'c': 8}
STEPS, BATCH = 3, 8
RULES = {'lazy_adam': lambda: lazy_optax.lazy_adam(0.05),
         'rowwise_adagrad': lambda: lazy_optax.rowwise_adagrad(0.1)}


def _collection():
  return lazy_optax.EmbeddingCollection(
      [lazy_optax.TableSpec(n, r, 3) for n, r in ROWS.items()],
      [lazy_optax.FeatureSpec('fa', 'a'), lazy_optax.FeatureSpec('fb', 'b'),
       lazy_optax.FeatureSpec('fa2', 'a'),
       lazy_optax.FeatureSpec('fc', 'c', mode='sum', padding_id=0)])


def _batches():
  rng = np.random.default_rng(0)
  return [{'fa': rng.integers(0, 12, BATCH).astype(np.int32),
           'fb': rng.integers(0, 11, BATCH).astype(np.int32),
           'fa2': rng.integers(0, 6, BATCH).astype(np.int32),
           'fc': rng.integers(0, 7, (BATCH, 2)).astype(np.int32)}
          for _ in range(STEPS)]


def _step(coll, tx):
  w = jnp.asarray([0.7, -1.3, 0.4], jnp.float32)

  def loss(params, ids):
    rows = coll.lookup(params, ids)
    return sum(jnp.sum(jnp.tanh(r * w)) * (k + 1.0)
               for k, r in enumerate(rows.values()))

  def step(params, state, ids):
    _, grads = lazy_optax.value_and_grad(loss)(params, ids)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return jax.jit(step)


def _shardings(tree):
  return [str(x.sharding.spec) for x in jax.tree.leaves(tree)]


def check_rule(name, mesh):
  """One rule: 3 sharded steps against 3 one-device steps."""
  coll = _collection()
  tx = coll.optimizer({'default': RULES[name]()})
  params = coll.init(jax.random.key(0))
  (stack,) = coll.plan
  step = _step(coll, tx)
  one = (params, tx.init(params))
  rows = NamedSharding(mesh, P('rows'))
  sharded_params = {stack.name: jax.device_put(params[stack.name], rows)}
  sharded = (sharded_params,
             lazy_optax.sharding.init_sharded(tx, sharded_params))
  before = _shardings(sharded)
  replicated = NamedSharding(mesh, P())
  for ids in _batches():
    one = step(*one, ids)
    sharded = step(*sharded, jax.device_put(ids, replicated))
    assert _shardings(sharded) == before, (before, _shardings(sharded))
  assert sharded[0][stack.name].sharding.spec[0] == 'rows'
  assert len(sharded[0][stack.name].sharding.device_set) == 8
  moved, differing = 0, 0
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(sharded)):
    differing += int(np.sum(np.asarray(a) != np.asarray(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6,
                               atol=1e-7)
  n_rows = sum(stack.table_rows)
  untouched = np.ones(n_rows, bool)
  for ids in _batches():
    for f in coll.feature_specs:
      offset = stack.offsets[stack.tables.index(f.table)]
      real = ids[f.name][ids[f.name] != (f.padding_id if f.padding_id
                                         is not None else -1)]
      untouched[offset + real] = False
  assert untouched.sum() >= 4, untouched
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(sharded)):
    if np.ndim(a) and np.shape(a)[0] == n_rows:
      np.testing.assert_array_equal(np.asarray(a)[untouched],
                                    np.asarray(b)[untouched])
  np.testing.assert_array_equal(
      np.asarray(sharded[0][stack.name])[untouched],
      np.asarray(params[stack.name])[untouched])
  for name_, table in coll.tables(sharded[0]).items():
    moved += int(np.sum(np.any(np.asarray(table) != np.asarray(
        coll.tables(params)[name_]), axis=1)))
  return {'rows_moved': moved, 'state_shardings': before,
          'differing_entries': differing}


def run():
  """Both rules on an Auto mesh of 8 devices; a dict of results."""
  assert len(jax.devices()) == 8, jax.devices()
  mesh = jax.make_mesh((8,), ('rows',), axis_types=(AxisType.Auto,))
  return {name: check_rule(name, mesh) for name in RULES}


if __name__ == '__main__':
  print(json.dumps(run()))
