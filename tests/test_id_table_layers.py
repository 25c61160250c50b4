"""HashEmbed layers (Flax linen and nnx, Haiku, Equinox) on IdTable slots.

Each layer reads `lookup(table, slots)` with slot `capacity` as "no row"
(zeros, no gradient row, also outside jit); a train step with `assign`,
`reset_rows` and the framework's optimizer plumbing updates exactly the
rows of the assigned slots; the bag layers equal `lookup_bag` with the
unassigned slots left out.
"""

import importlib

import equinox as eqx
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax._src import reset_rows as reset_module
import lazy_optax.equinox
import lazy_optax.flax

CAP, D = 16, 3
TABLE = lazy_optax.IdTable(capacity=CAP, probe=4, admit_after=2,
                           sketch_width=64)
INIT = jax.nn.initializers.normal(0.5)
KEY = jax.random.key(3)
# Ids seen once are not admitted yet (admit_after=2): they get slot CAP.
IDS = np.array([[2 ** 40 + 1, 5], [5, 2 ** 40 + 1], [99, 2 ** 40 + 1]])


def _slots():
  slots, state, fresh = TABLE.assign(TABLE.init(), IDS, step=0)
  assert int(slots[2, 0]) == CAP and (np.asarray(slots) < CAP).sum() == 5
  return slots, state, fresh


def _check_step(table_before, table_after, grad, slots):
  assert isinstance(grad, lazy_optax.SparseRows)
  named = np.asarray(grad.ids)[np.asarray(grad.ids) < CAP]
  assert set(named.tolist()) == set(np.asarray(slots)[
      np.asarray(slots) < CAP].tolist())
  moved = np.flatnonzero(np.any(np.asarray(table_before)
                                != np.asarray(table_after), axis=1))
  assert set(moved.tolist()) == set(named.tolist())


def test_linen_hash_embed_trains_the_assigned_rows():
  slots, _, fresh = _slots()
  model = lazy_optax.flax.HashEmbed(TABLE, D)
  params = model.init(jax.random.key(0), slots)['params']
  tx = lazy_optax.lazy_adam(0.1)
  opt_state = tx.init(params)
  params, opt_state = lazy_optax.reset_rows(
      tx, params, opt_state, {'embedding': fresh}, init=INIT, key=KEY)
  rows = model.apply({'params': params}, slots)
  np.testing.assert_array_equal(rows, lazy_optax.lookup(
      params['embedding'], slots, padding_id=CAP))
  assert not np.asarray(rows[2, 0]).any()

  def loss_fn(p):
    return jnp.sum(model.apply({'params': p}, slots) ** 2)

  _, grads = lazy_optax.value_and_grad(loss_fn)(params)
  updates, _ = tx.update(grads, opt_state, params)
  new = lazy_optax.apply_updates(params, updates)
  _check_step(params['embedding'], new['embedding'], grads['embedding'],
              slots)

  bag = lazy_optax.flax.HashEmbedBag(TABLE, D, mode='mean')
  pooled = bag.apply({'params': params}, slots)
  np.testing.assert_allclose(pooled, lazy_optax.lookup_bag(
      params['embedding'], slots, padding_id=CAP), rtol=1e-6)
  np.testing.assert_array_equal(pooled[2], params['embedding'][slots[2, 1]])
  with pytest.raises(TypeError, match='lazy_optax.IdTable'):
    lazy_optax.flax.HashEmbed(CAP, D).init(jax.random.key(0), slots)


def test_nnx_hash_embed_trains_the_assigned_rows():
  slots, _, fresh = _slots()
  model = lazy_optax.flax.NnxHashEmbed(TABLE, D, rngs=nnx.Rngs(0))
  tx = lazy_optax.lazy_adam(0.1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  lazy_optax.flax.nnx_reset_rows(model, optimizer, {'embedding': fresh},
                                 init=INIT, key=KEY)
  row = reset_module.fresh_rows(
      INIT, KEY, fresh.ids, (D,), jnp.float32, 'embedding')
  first = int(np.flatnonzero(np.asarray(fresh.slots) < CAP)[0])
  np.testing.assert_array_equal(
      model.embedding[...][int(fresh.slots[first])], row[first])
  before = np.asarray(model.embedding[...])

  def loss_fn(m):
    return jnp.sum(m(slots) ** 2)

  _, grads = lazy_optax.flax.nnx_value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  _check_step(before, model.embedding[...],
              grads['embedding'].get_value(), slots)
  bag = lazy_optax.flax.NnxHashEmbedBag(TABLE, D, mode='sum',
                                        rngs=nnx.Rngs(1))
  np.testing.assert_allclose(bag(slots), lazy_optax.lookup_bag(
      bag.embedding[...], slots, mode='sum', padding_id=CAP), rtol=1e-6)


def test_haiku_hash_embed_trains_the_assigned_rows():
  hk = pytest.importorskip('haiku')
  haiku_layers = importlib.import_module('lazy_optax.haiku')
  slots, _, fresh = _slots()
  f = hk.without_apply_rng(hk.transform(
      lambda s: haiku_layers.HashEmbed(TABLE, D, name='items')(s)))
  params = f.init(jax.random.key(0), slots)
  tx = lazy_optax.lazy_adam(0.1)
  opt_state = tx.init(params)
  params, opt_state = lazy_optax.reset_rows(
      tx, params, opt_state, {'items/embeddings': fresh}, init=INIT, key=KEY)
  table = params['items']['embeddings']
  np.testing.assert_array_equal(f.apply(params, slots), lazy_optax.lookup(
      table, slots, padding_id=CAP))
  _, grads = lazy_optax.value_and_grad(
      lambda p: jnp.sum(f.apply(p, slots) ** 2))(params)
  updates, _ = tx.update(grads, opt_state)          # Haiku: no params
  new = optax.apply_updates(params, updates)
  _check_step(table, new['items']['embeddings'],
              grads['items']['embeddings'], slots)
  g = hk.without_apply_rng(hk.transform(
      lambda s: haiku_layers.HashEmbedBag(TABLE, D, mode='max',
                                          name='items')(s)))
  np.testing.assert_array_equal(g.apply(params, slots), lazy_optax.lookup_bag(
      table, slots, mode='max', padding_id=CAP))


def test_equinox_hash_embedding_trains_the_assigned_rows():
  slots, _, fresh = _slots()
  model = lazy_optax.equinox.HashEmbedding(TABLE, D, key=jax.random.key(0))
  tx = lazy_optax.lazy_adam(0.1)
  params = eqx.filter(model, eqx.is_array)
  opt_state = tx.init(params)
  params, opt_state = lazy_optax.reset_rows(
      tx, params, opt_state, {'weight': fresh}, init=INIT, key=KEY)
  model = eqx.combine(params, model)
  np.testing.assert_array_equal(model(slots), lazy_optax.lookup(
      model.weight, slots, padding_id=CAP))
  _, grads = lazy_optax.equinox.filter_value_and_grad(
      lambda m, s: (m(s) ** 2).sum())(model, slots)
  updates, _ = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
  new = lazy_optax.equinox.apply_updates(model, updates)
  _check_step(model.weight, new.weight, grads.weight, slots)
  bag = lazy_optax.equinox.HashEmbeddingBag(TABLE, weight=model.weight)
  np.testing.assert_allclose(bag(slots), lazy_optax.lookup_bag(
      model.weight, slots, padding_id=CAP), rtol=1e-6)
  assert bag.table is TABLE
