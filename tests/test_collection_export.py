"""A collection's step compiles to as many sorts, scatters and gathers for
26 tables as for 1: its ops grow with stacks, not tables.

The DLRM-shaped step of benchmarks/harness/dlrm.py (26 tables of one width,
one id per example and table, an MLP, `lazy_adam` on the tables and
`optax.adam` on the MLP), with small tables, exported for `cuda` and `tpu`
as tests/test_export_portable.py does and its ops counted the same way.
Separate tables, for contrast, add ops with every table.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
from test_export_portable import COUNTED
from test_export_portable import op_counts
from test_export_portable import PLATFORMS
from test_export_portable import read_module

import lazy_optax
from lazy_optax import EmbeddingCollection
from lazy_optax import TableSpec

BATCH, WIDTH, DENSE, HIDDEN = 8, 4, 3, 5


def _mlp(n_tables):
  rng = np.random.default_rng(0)
  d = n_tables * WIDTH + DENSE
  return [{'w': jnp.asarray(rng.normal(size=(d, HIDDEN)), jnp.float32),
           'b': jnp.zeros(HIDDEN, jnp.float32)},
          {'w': jnp.asarray(rng.normal(size=(HIDDEN, 1)), jnp.float32),
           'b': jnp.zeros(1, jnp.float32)}]


def _logistic(rows, dense, labels, mlp):
  x = jnp.concatenate([rows, dense], axis=1)
  x = jax.nn.relu(x @ mlp[0]['w'] + mlp[0]['b'])
  logits = (x @ mlp[1]['w'] + mlp[1]['b'])[:, 0]
  return jnp.mean(jax.nn.softplus(logits) - labels * logits)


def _tx(emb_tx):
  return optax.partition({'emb': emb_tx, 'mlp': optax.adam(1e-3)},
                         lazy_optax.tree.path_labels(
                             lambda name: name.split('/')[0]))


def _collection_step(n_tables):
  coll = EmbeddingCollection(
      [TableSpec(f't{i}', 10 + 3 * i, WIDTH) for i in range(n_tables)])
  names = [t.name for t in coll.table_specs]
  tx = _tx(coll.optimizer({'default': lazy_optax.lazy_adam(1e-3)}))

  def step(params, state, ids, dense, labels):
    def loss(p):
      rows = coll.lookup(p['emb'], {n: ids[:, i] for i, n in enumerate(names)})
      return _logistic(jnp.concatenate(list(rows.values()), axis=1), dense,
                       labels, p['mlp'])
    value, grads = lazy_optax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, value

  def init():
    params = {'emb': coll.init(jax.random.key(0)), 'mlp': _mlp(n_tables)}
    return params, tx.init(params)
  return step, init


def _separate_step(n_tables):
  tx = _tx(lazy_optax.lazy_adam(1e-3))

  def step(params, state, ids, dense, labels):
    def loss(p):
      rows = [lazy_optax.lookup(t, ids[:, i]) for i, t in enumerate(p['emb'])]
      return _logistic(jnp.concatenate(rows, axis=1), dense, labels, p['mlp'])
    value, grads = lazy_optax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, value

  def init():
    params = {'emb': [jnp.zeros((10 + 3 * i, WIDTH)) for i in range(n_tables)],
              'mlp': _mlp(n_tables)}
    return params, tx.init(params)
  return step, init


def _counts(make, n_tables):
  # Exported from the shapes alone: making the tables and the optimizer's
  # state would compile an eager program for every table's shape.
  step, init = make(n_tables)
  params, state = jax.eval_shape(init)
  args = (params, state, jnp.zeros((BATCH, n_tables), jnp.int32),
          jnp.zeros((BATCH, DENSE), jnp.float32), jnp.zeros(BATCH))
  exported = jax.export.export(jax.jit(step, donate_argnums=(0, 1)),
                               platforms=list(PLATFORMS))(*args)
  counts = op_counts(read_module(exported.mlir_module()))
  return collections.Counter({op: counts[op] for op in COUNTED})


def test_ops_grow_with_stacks_not_tables():
  one, many = _counts(_collection_step, 1), _counts(_collection_step, 26)
  assert one == many, (one, many)
  assert one['gather'] > 0 and one['scatter'] > 0 and one['sort'] > 0, one
  # Separate tables: more ops for every table (what the collection saves).
  two, four = _counts(_separate_step, 2), _counts(_separate_step, 4)
  assert all(four[op] > two[op] for op in ('gather', 'scatter')), (two, four)
  assert four['scatter'] > many['scatter'], (four, many)
