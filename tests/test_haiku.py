"""lazy_optax.haiku.Embed in a Haiku train step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax

hk = pytest.importorskip('haiku')
import lazy_optax.haiku  # noqa: E402  (where Haiku is installed)

NUM_ROWS, DIM, SEEN = 60, 4, 30   # batches only use rows < SEEN


def _transform(embed, tied=False):
  def forward(ids):
    table = embed(NUM_ROWS, DIM, name='embed')
    h = jnp.tanh(table(ids).mean(1))
    out = hk.Linear(1, name='head')(h)[..., 0]
    if tied:   # tied output layer: logits over the whole table
      return out + jnp.mean(jax.nn.logsumexp(h @ table.embeddings.T, -1))
    return out
  return hk.without_apply_rng(hk.transform(forward))


def _data(seed, batch=8, width=3):
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(NUM_ROWS,)).astype(np.float32)
  while True:
    ids = rng.integers(0, SEEN, (batch, width)).astype(np.int32)
    yield jnp.asarray(ids), jnp.asarray(target[ids].mean(1))


def _loss(f):
  def loss_fn(params, ids, y):
    return jnp.mean((f.apply(params, ids) - y) ** 2)
  return loss_fn


def test_layer_is_a_drop_in_for_hk_embed():
  stock, lazy = _transform(hk.Embed), _transform(lazy_optax.haiku.Embed)
  ids = jnp.array([[1, 2, 3]])
  p_stock = stock.init(jax.random.key(0), ids)
  p_lazy = lazy.init(jax.random.key(0), ids)
  assert jax.tree.map(jnp.shape, p_stock) == jax.tree.map(jnp.shape, p_lazy)
  np.testing.assert_array_equal(lazy.apply(p_stock, ids),
                                stock.apply(p_stock, ids))
  np.testing.assert_array_equal(stock.apply(p_lazy, ids),
                                lazy.apply(p_lazy, ids))
  with pytest.raises(TypeError, match=(
      'lazy_optax.haiku.Embed of table embed/embeddings: row ids must have an '
      'integer dtype')):
    lazy.apply(p_lazy, jnp.ones((1, 3)))


def test_bag_layer_shares_the_embed_parameter():
  def forward(ids):
    bag = lazy_optax.haiku.EmbedBag(NUM_ROWS, DIM, mode='sum', padding_id=0,
                                    name='embed')
    return bag(ids, mask=ids < 3)
  f = hk.without_apply_rng(hk.transform(forward))
  ids = jnp.array([[1, 2, 0, 5]])
  params = f.init(jax.random.key(0), ids)
  p_stock = _transform(hk.Embed).init(jax.random.key(0), ids)
  assert (jax.tree.map(jnp.shape, params) ==
          jax.tree.map(jnp.shape, {'embed': p_stock['embed']}))
  table = params['embed']['embeddings']
  np.testing.assert_allclose(f.apply(params, ids), table[1:2] + table[2:3],
                             rtol=1e-6)


@pytest.mark.parametrize('tied', [False, True])
def test_gradients_match_hk_embed(tied):
  stock = _transform(hk.Embed, tied)
  lazy = _transform(lazy_optax.haiku.Embed, tied)
  ids, y = next(_data(0))
  params = lazy.init(jax.random.key(0), ids[:1])   # init batch of one
  loss, grads = jax.jit(lazy_optax.value_and_grad(_loss(lazy)))(params, ids, y)
  ref_loss, ref = jax.value_and_grad(_loss(stock))(params, ids, y)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  g = grads['embed']['embeddings']
  assert isinstance(g, lazy_optax.SparseRows) != tied
  if not tied:
    g = g.to_dense()
  np.testing.assert_allclose(g, ref['embed']['embeddings'], rtol=1e-5,
                             atol=1e-7)
  np.testing.assert_allclose(grads['head']['w'], ref['head']['w'], rtol=1e-5,
                             atol=1e-7)


def test_one_hot_lookup_style_is_dense_and_correct():
  def forward(ids):
    return lazy_optax.haiku.Embed(NUM_ROWS, DIM, lookup_style='ONE_HOT')(ids)
  f = hk.without_apply_rng(hk.transform(forward))
  ids = jnp.array([2, 5, 2])
  params = f.init(jax.random.key(0), ids)
  loss_fn = lambda p: jnp.sum(f.apply(p, ids) ** 2)
  _, grads = lazy_optax.value_and_grad(loss_fn)(params)
  ref = jax.grad(loss_fn)(params)
  np.testing.assert_allclose(grads['embed']['embeddings'],
                             ref['embed']['embeddings'], rtol=1e-6)
  # The same rule for ids: padding gives no gradient, bad ids read zeros
  # under jit and raise eagerly.
  padded = hk.without_apply_rng(hk.transform(lambda ids: lazy_optax.haiku.Embed(
      NUM_ROWS, DIM, lookup_style='ONE_HOT', padding_id=5)(ids)))
  g = jax.grad(lambda p: jnp.sum(padded.apply(p, ids)))(params)
  table_grad = np.asarray(g['embed']['embeddings'])
  assert not table_grad[5].any()
  np.testing.assert_array_equal(table_grad[2], 2)
  out = jax.jit(padded.apply)(params, jnp.array([NUM_ROWS, -1]))
  np.testing.assert_array_equal(out, 0)
  with pytest.raises(ValueError, match=f'embed/embeddings: id {NUM_ROWS} at'):
    padded.apply(params, jnp.array([NUM_ROWS]))


@pytest.mark.parametrize('partitioned', [False, True])
def test_opt_update_without_params_trains_and_keeps_unseen_rows(partitioned):
  f = _transform(lazy_optax.haiku.Embed)
  data = _data(1)
  params = f.init(jax.random.key(0), next(data)[0])
  before = np.asarray(params['embed']['embeddings']).copy()
  if partitioned:
    opt = optax.partition(
        {'tables': lazy_optax.lazy_adam(0.05), 'rest': optax.adam(0.05)},
        lazy_optax.tree.path_labels(
            lambda n: 'tables' if n.endswith('embeddings') else 'rest'))
  else:
    opt = lazy_optax.lazy_adam(0.05)
  opt_state = opt.init(params)
  loss_fn = _loss(f)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, ids, y):
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params, ids, y)
    updates, opt_state = opt.update(grads, opt_state)   # no params
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(120):
    params, opt_state, loss = step(params, opt_state, *next(data))
    losses.append(float(loss))
  assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10]), losses[::10]
  after = np.asarray(params['embed']['embeddings'])
  np.testing.assert_array_equal(after[SEEN:], before[SEEN:])
  assert not np.array_equal(after[:SEEN], before[:SEEN])
