"""lazy_optax.equinox layers in Equinox train steps."""

import warnings

import equinox as eqx
import fork_server
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
import lazy_optax.equinox

_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')

NUM_ROWS, DIM, SEEN = 60, 4, 30   # batches only use rows < SEEN


class Model(eqx.Module):
  """Mean of the embeddings of each example's ids, then a small MLP."""
  embed: eqx.nn.Embedding
  head: eqx.nn.MLP     # holds non-array leaves: its activation functions
  scale: float         # a Python number leaf

  def __init__(self, embed_cls, key):
    k1, k2 = jax.random.split(key)
    self.embed = embed_cls(NUM_ROWS, DIM, key=k1)
    self.head = eqx.nn.MLP(DIM, 'scalar', 8, 1, activation=jnp.tanh, key=k2)
    self.scale = 0.5

  def __call__(self, ids):
    if isinstance(self.embed, lazy_optax.equinox.Embedding):
      rows = self.embed(ids)                        # the whole batch at once
    else:
      rows = jax.vmap(jax.vmap(self.embed))(ids)    # eqx.nn.Embedding
    return jax.vmap(self.head)(jnp.tanh(rows.mean(1))) * self.scale


def _data(seed, batch=8, width=3):
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(NUM_ROWS,)).astype(np.float32)
  while True:
    ids = rng.integers(0, SEEN, (batch, width)).astype(np.int32)
    yield jnp.asarray(ids), jnp.asarray(target[ids].mean(1))


def _loss(model, ids, y):
  return jnp.mean((model(ids) - y) ** 2)


def test_embedding_is_a_drop_in_with_interchangeable_checkpoints(tmp_path):
  stock = eqx.nn.Embedding(NUM_ROWS, DIM, key=jax.random.key(0))
  lazy = lazy_optax.equinox.Embedding(NUM_ROWS, DIM, key=jax.random.key(1))
  assert (stock.num_embeddings, stock.embedding_size) == (
      lazy.num_embeddings, lazy.embedding_size)
  eqx.tree_serialise_leaves(tmp_path / 'stock.eqx', stock)
  eqx.tree_serialise_leaves(tmp_path / 'lazy.eqx', lazy)
  from_stock = eqx.tree_deserialise_leaves(tmp_path / 'stock.eqx', lazy)
  from_lazy = eqx.tree_deserialise_leaves(tmp_path / 'lazy.eqx', stock)
  np.testing.assert_array_equal(from_stock.weight, stock.weight)
  np.testing.assert_array_equal(from_lazy.weight, lazy.weight)
  ids = jnp.array([[3, 7], [0, 59]])
  np.testing.assert_array_equal(from_stock(ids),
                                jax.vmap(jax.vmap(stock))(ids))
  np.testing.assert_array_equal(from_stock(jnp.int32(7)), stock(jnp.int32(7)))
  bag = lazy_optax.equinox.EmbeddingBag(weight=stock.weight, mode='sum')
  np.testing.assert_allclose(bag(ids), stock.weight[ids].sum(1), rtol=1e-6)
  with pytest.raises(TypeError, match='integer dtype'):
    lazy(jnp.ones(3))


def test_gradients_match_eqx_filter_value_and_grad():
  stock = Model(eqx.nn.Embedding, jax.random.key(0))
  lazy = Model(lazy_optax.equinox.Embedding, jax.random.key(0))
  ids, y = next(_data(0))
  loss, grads = eqx.filter_jit(
      lazy_optax.equinox.filter_value_and_grad(_loss))(lazy, ids, y)
  # The references in one program each (eagerly, every operation of the
  # model and its gradient was a program of its own).
  ref_loss, ref = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(
      stock, ids, y)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  g = grads.embed.weight
  assert isinstance(g, lazy_optax.SparseRows)
  assert g.ids.shape == (ids.size,)
  np.testing.assert_allclose(g.to_dense(), ref.embed.weight, rtol=1e-5,
                             atol=1e-7)
  for got, want in zip(jax.tree.leaves(grads.head), jax.tree.leaves(ref.head)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  # Non-array leaves get None, as in Equinox.
  assert grads.scale is None
  assert grads.head.activation is None
  # Plain eqx.filter_grad through the lazy layer is the dense gradient.
  dense = eqx.filter_jit(eqx.filter_grad(_loss))(lazy, ids, y)
  np.testing.assert_allclose(dense.embed.weight, ref.embed.weight, rtol=1e-6)


@pytest.mark.parametrize('optimizer', ['lazy_adam', 'partition'])
def test_donated_filter_jit_step_trains_and_keeps_unseen_rows(optimizer):
  model = Model(lazy_optax.equinox.Embedding, jax.random.key(0))
  before = np.asarray(model.embed.weight).copy()
  if optimizer == 'lazy_adam':
    tx = lazy_optax.lazy_adam(0.05)
  else:
    tx = optax.partition(
        {'tables': lazy_optax.lazy_adam(0.05), 'rest': optax.adamw(0.05)},
        lazy_optax.tree.path_labels(
            lambda name: 'tables' if name == 'embed/weight' else 'rest'))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  traces = []

  # The batch comes first, so that donating all but the first argument
  # donates the model and the optimizer state, and nothing unusable.
  @eqx.filter_jit(donate='all-except-first')
  def step(batch, model, opt_state):
    traces.append(1)
    loss, grads = lazy_optax.equinox.filter_value_and_grad(_loss)(
        model, *batch)
    updates, opt_state = tx.update(grads, opt_state,
                                   eqx.filter(model, eqx.is_array))
    return lazy_optax.equinox.apply_updates(model, updates), opt_state, loss

  data = _data(1)
  losses = []
  for _ in range(120):
    model, opt_state, loss = step(next(data), model, opt_state)
    losses.append(float(loss))
  assert len(traces) == 1
  assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10]), losses[::10]
  after = np.asarray(model.embed.weight)
  np.testing.assert_array_equal(after[SEEN:], before[SEEN:])
  assert not np.array_equal(after[:SEEN], before[:SEEN])
  assert model.head.activation is jnp.tanh and model.scale == 0.5


def test_the_step_donates_the_table():
  model = Model(lazy_optax.equinox.Embedding, jax.random.key(0))
  tx = lazy_optax.lazy_adam(0.05)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  def step(batch, model, opt_state):
    _, grads = lazy_optax.equinox.filter_value_and_grad(_loss)(model, *batch)
    updates, opt_state = tx.update(grads, opt_state,
                                   eqx.filter(model, eqx.is_array))
    return lazy_optax.equinox.apply_updates(model, updates), opt_state

  batch = next(_data(2))
  with pytest.warns(UserWarning, match='not donated'):
    assert not lazy_optax.perf.warn_if_not_donated(eqx.filter_jit(step), batch,
                                              model, opt_state)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert lazy_optax.perf.warn_if_not_donated(
        eqx.filter_jit(step, donate='all-except-first'), batch, model,
        opt_state)


def test_equinox_is_optional():
  code = ('import sys; import lazy_optax; '
          "assert 'equinox' not in sys.modules; "
          "sys.modules['equinox'] = None\n"
          'try:\n  import lazy_optax.equinox\n'
          'except ImportError as e:\n  print(e)')
  # Run as `python -c code` runs it, in a forked child of a process that
  # imported jax and lazy_optax once, never equinox (tests/fork_server.py;
  # the preloaded modules of tests/test_kernel_cache.py's, so one server
  # serves both).
  (out,) = fork_server.run_scripts([code], {}, preloaded=_PRELOADED)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'lazy_optax.equinox needs Equinox: pip install equinox' in out.stdout
