"""lazy_optax.flax layers in Flax linen and nnx train steps."""

import functools

from flax import nnx
from flax import serialization
import flax.linen as nn
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
import lazy_optax.flax

NUM_ROWS, DIM, SEEN = 60, 4, 30   # batches only use rows < SEEN


class Linen(nn.Module):
  """Mean of the embeddings of each example's ids, then a linear head."""
  embed: type = nn.Embed
  tied: bool = False

  @nn.compact
  def __call__(self, ids):
    table = self.embed(NUM_ROWS, DIM, name='embed')
    h = nn.tanh(table(ids).mean(1))
    out = nn.Dense(1, name='head')(h)[..., 0]
    if self.tied:   # tied output layer: logits over the whole table
      return out, table.attend(h)
    return out


def _data(seed, batch=8, width=3):
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(NUM_ROWS,)).astype(np.float32)
  while True:
    ids = rng.integers(0, SEEN, (batch, width)).astype(np.int32)
    yield jnp.asarray(ids), jnp.asarray(target[ids].mean(1))


def _linen_loss(model):
  def loss_fn(params, ids, y):
    pred = model.apply({'params': params}, ids)
    return jnp.mean((pred - y) ** 2)
  return loss_fn


def _untouched_unchanged(before, after):
  np.testing.assert_array_equal(np.asarray(after)[SEEN:], before[SEEN:])
  assert not np.array_equal(np.asarray(after)[:SEEN], before[:SEEN])


def test_linen_layer_is_a_drop_in_for_flax_embed():
  ids = jnp.array([[1, 2, 3]])
  stock, lazy = Linen(nn.Embed), Linen(lazy_optax.flax.Embed)
  p_stock = stock.init(jax.random.key(0), ids)['params']
  p_lazy = lazy.init(jax.random.key(1), ids)['params']
  assert (jax.tree.map(jnp.shape, p_stock) == jax.tree.map(jnp.shape, p_lazy))
  # Checkpoints load either way, and both layers compute the same outputs.
  from_stock = serialization.from_bytes(p_lazy,
                                        serialization.to_bytes(p_stock))
  from_lazy = serialization.from_bytes(p_stock,
                                       serialization.to_bytes(p_lazy))
  np.testing.assert_array_equal(
      lazy.apply({'params': from_stock}, ids),
      stock.apply({'params': p_stock}, ids))
  np.testing.assert_array_equal(
      stock.apply({'params': from_lazy}, ids),
      lazy.apply({'params': p_lazy}, ids))
  with pytest.raises(TypeError, match=(
      r'lazy_optax.flax.Embed of table embed/embedding: row ids must have an '
      'integer dtype')):
    lazy.apply({'params': p_lazy}, jnp.ones((1, 3)))


def test_bag_layers_share_the_embed_parameters():
  ids = jnp.array([[1, 2, 0]])
  linen_bag = lazy_optax.flax.EmbedBag(NUM_ROWS, DIM, mode='sum',
                                       padding_id=0)
  p_bag = linen_bag.init(jax.random.key(0), ids)['params']
  p_embed = nn.Embed(NUM_ROWS, DIM).init(jax.random.key(0), ids)['params']
  assert jax.tree.map(jnp.shape, p_bag) == jax.tree.map(jnp.shape, p_embed)
  table = p_bag['embedding']
  np.testing.assert_allclose(linen_bag.apply({'params': p_bag}, ids),
                             table[1:2] + table[2:3], rtol=1e-6)
  nnx_bag = lazy_optax.flax.NnxEmbedBag(NUM_ROWS, DIM, mode='max',
                                        rngs=nnx.Rngs(0))
  stock = nnx.Embed(NUM_ROWS, DIM, rngs=nnx.Rngs(1))
  nnx.update(nnx_bag, nnx.state(stock, nnx.Param))
  np.testing.assert_array_equal(
      nnx_bag(ids, lengths=jnp.array([2])),
      jnp.maximum(stock(ids)[:, 0], stock(ids)[:, 1]))


def test_linen_sparse_gradient_equals_dense_gradient():
  stock, lazy = Linen(nn.Embed), Linen(lazy_optax.flax.Embed)
  # Initialised with a batch of one, trained on batches of eight.
  params = lazy.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))['params']
  ids, y = next(_data(0))
  loss, grads = jax.jit(lazy_optax.value_and_grad(_linen_loss(lazy)))(
      params, ids, y)
  ref_loss, ref = jax.value_and_grad(_linen_loss(stock))(params, ids, y)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  g = grads['embed']['embedding']
  assert isinstance(g, lazy_optax.SparseRows)
  assert g.ids.shape == (ids.size,)
  np.testing.assert_allclose(g.to_dense(), ref['embed']['embedding'],
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grads['head']['kernel'], ref['head']['kernel'],
                             rtol=1e-5, atol=1e-7)
  # Plain jax.grad through the lazy layer is the ordinary dense gradient.
  dense = jax.grad(_linen_loss(lazy))(params, ids, y)
  np.testing.assert_allclose(dense['embed']['embedding'],
                             ref['embed']['embedding'], rtol=1e-6)


def test_linen_tied_attend_gives_a_dense_gradient_with_both_parts():
  def loss_of(model):
    def loss_fn(params, ids, y):
      pred, logits = model.apply({'params': params}, ids)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 0])
      return jnp.mean((pred - y) ** 2) + jnp.mean(ce)
    return loss_fn

  stock = Linen(nn.Embed, tied=True)
  lazy = Linen(lazy_optax.flax.Embed, tied=True)
  ids, y = next(_data(1))
  params = lazy.init(jax.random.key(0), ids)['params']
  _, grads = lazy_optax.value_and_grad(loss_of(lazy))(params, ids, y)
  ref = jax.grad(loss_of(stock))(params, ids, y)
  g = grads['embed']['embedding']
  assert not isinstance(g, lazy_optax.SparseRows)
  np.testing.assert_allclose(g, ref['embed']['embedding'], rtol=1e-5,
                             atol=1e-7)


def _label(name):
  return 'tables' if name.endswith('embedding') else 'rest'


def test_linen_train_state_with_partition_trains_and_keeps_unseen_rows():
  model = Linen(lazy_optax.flax.Embed)
  data = _data(2)
  params = model.init(jax.random.key(0), next(data)[0])['params']
  before = np.asarray(params['embed']['embedding']).copy()
  tx = optax.partition(
      {'tables': lazy_optax.lazy_adam(0.05), 'rest': optax.adamw(0.05)},
      lazy_optax.tree.path_labels(_label))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  loss_fn = _linen_loss(model)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, ids, y):
    loss, grads = lazy_optax.value_and_grad(loss_fn)(state.params, ids, y)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(120):
    state, loss = step(state, *next(data))
    losses.append(float(loss))
  assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10]), losses[::10]
  _untouched_unchanged(before, state.params['embed']['embedding'])


def test_linen_unchanged_model_with_skip_zero_rows():
  """A model left as it is (nn.Embed, jax.grad) with the row-lazy option."""
  model = Linen(nn.Embed)
  data = _data(3)
  params = model.init(jax.random.key(0), next(data)[0])['params']
  before = np.asarray(params['embed']['embedding']).copy()
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=lazy_optax.lazy(optax.adam(0.05), skip_zero_rows=True))
  loss_fn = _linen_loss(model)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, ids, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, ids, y)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for _ in range(120):
    state, loss = step(state, *next(data))
    losses.append(float(loss))
  assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10]), losses[::10]
  _untouched_unchanged(before, state.params['embed']['embedding'])


class Nnx(nnx.Module):

  def __init__(self, embed, rngs):
    self.embed = embed(NUM_ROWS, DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, 1, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, ids):
    h = self.drop(jnp.tanh(self.embed(ids).mean(1)))
    return self.head(h)[..., 0]


def _nnx_loss(model, ids, y):
  return jnp.mean((model(ids) - y) ** 2)


def test_nnx_layer_is_a_drop_in_and_gradients_match():
  stock = Nnx(nnx.Embed, nnx.Rngs(0))
  lazy = Nnx(lazy_optax.flax.NnxEmbed, nnx.Rngs(1))
  assert (jax.tree.map(jnp.shape, nnx.state(stock, nnx.Param)) ==
          jax.tree.map(jnp.shape, nnx.state(lazy, nnx.Param)))
  nnx.update(lazy, nnx.state(stock, nnx.Param))   # load the stock weights
  stock.eval()
  lazy.eval()
  ids, y = next(_data(4))
  np.testing.assert_array_equal(lazy(ids), stock(ids))
  loss, grads = lazy_optax.flax.nnx_value_and_grad(_nnx_loss)(lazy, ids, y)
  ref_loss, ref = nnx.value_and_grad(_nnx_loss)(stock, ids, y)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  g = grads['embed']['embedding'].get_value()
  assert isinstance(g, lazy_optax.SparseRows)
  np.testing.assert_allclose(
      g.to_dense(), ref['embed']['embedding'].get_value(), rtol=1e-5,
      atol=1e-7)
  np.testing.assert_allclose(
      grads['head']['kernel'].get_value(), ref['head']['kernel'].get_value(),
      rtol=1e-5, atol=1e-7)
  dense = nnx.grad(_nnx_loss)(lazy, ids, y)   # plain nnx.grad stays dense
  np.testing.assert_allclose(dense['embed']['embedding'].get_value(),
                             ref['embed']['embedding'].get_value(), rtol=1e-6)


def test_nnx_rng_state_is_written_back():
  model = Nnx(lazy_optax.flax.NnxEmbed, nnx.Rngs(0))
  ids, y = next(_data(5))
  grad_fn = lazy_optax.flax.nnx_value_and_grad(_nnx_loss)
  first, _ = grad_fn(model, ids, y)
  second, _ = grad_fn(model, ids, y)   # a new dropout mask
  assert float(first) != float(second)


def test_nnx_optimizer_trains_under_jit_and_keeps_unseen_rows():
  model = Nnx(lazy_optax.flax.NnxEmbed, nnx.Rngs(0))
  before = np.asarray(model.embed.embedding[...]).copy()
  tx = optax.partition(
      {'tables': lazy_optax.lazy_adam(0.05), 'rest': optax.adamw(0.05)},
      lazy_optax.tree.path_labels(_label))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  @functools.partial(jax.jit, donate_argnums=0)
  def step(state, ids, y):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = lazy_optax.flax.nnx_value_and_grad(_nnx_loss)(model, ids, y)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  data = _data(6)
  losses = []
  for _ in range(120):
    state, loss = step(state, *next(data))
    losses.append(float(loss))
  assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10]), losses[::10]
  model, _ = nnx.merge(graphdef, state)
  _untouched_unchanged(before, model.embed.embedding[...])


def test_nnx_value_and_grad_checks_its_model():
  with pytest.raises(TypeError, match='nnx.Module'):
    lazy_optax.flax.nnx_value_and_grad(_nnx_loss)({'a': 1}, None, None)


def test_nnx_out_sharding_lookup_follows_the_same_id_rule():
  mesh = jax.make_mesh((1,), ('x',),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    lazy = lazy_optax.flax.NnxEmbed(NUM_ROWS, DIM, padding_id=0,
                                    rngs=nnx.Rngs(0))
    stock = nnx.Embed(NUM_ROWS, DIM, rngs=nnx.Rngs(0))
    spec = jax.sharding.PartitionSpec()
    ids = jnp.array([1, 0, 3])
    np.testing.assert_array_equal(lazy(ids, out_sharding=spec), stock(ids))
    out = jax.jit(lambda i: lazy(i, out_sharding=spec))(jnp.array([NUM_ROWS,
                                                                   -1]))
    np.testing.assert_array_equal(out, 0)
    with pytest.raises(ValueError, match=f'id {NUM_ROWS} at position'):
      lazy(jnp.array([1, NUM_ROWS]), out_sharding=spec)
    grads = nnx.grad(lambda m: jnp.sum(m(ids, out_sharding=spec)))(lazy)
    dense = np.asarray(grads['embedding'].get_value())
    assert not dense[0].any()                       # the padding row
    np.testing.assert_array_equal(dense[[1, 3]], 1)
