"""lazy_optax.lookup_bag and the bag layers against torch.nn.EmbeddingBag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax

NUM_ROWS, DIM = 20, 3
# The tests that compare with torch run on one pytest-xdist worker: torch is
# imported by them (about 3 CPU s), not at collection by every worker.
TORCH = pytest.mark.xdist_group('torch')


def _torch():
  """The torch module, imported on first use."""
  import torch
  return torch


def _batch(seed, batch=6, max_len=5):
  """Padded ids, a mask of real slots (bag 2 empty), weights, garbage pads."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, NUM_ROWS, (batch, max_len)).astype(np.int32)
  lengths = rng.integers(1, max_len + 1, (batch,)).astype(np.int32)
  lengths[2] = 0                      # an empty bag
  ids[0, :2] = ids[0, 2]              # duplicates inside a bag
  mask = np.arange(max_len)[None, :] < lengths[:, None]
  ids[~mask] = rng.choice([-1, NUM_ROWS, 10**6], size=(~mask).sum())
  weights = rng.uniform(0.5, 2.0, (batch, max_len)).astype(np.float32)
  return ids, lengths, mask, weights


def _torch_bag_rows(table, ids, mask, mode):
  """torch.nn.EmbeddingBag over a table of any row count."""
  torch = _torch()
  bag = torch.nn.EmbeddingBag(table.shape[0], table.shape[1], mode=mode)
  with torch.no_grad():
    bag.weight.copy_(torch.tensor(np.asarray(table)))
  flat = torch.tensor(ids[mask], dtype=torch.int64)
  offsets = torch.tensor(np.concatenate([[0], np.cumsum(mask.sum(1))[:-1]]),
                         dtype=torch.int64)
  return bag(flat, offsets), bag.weight


def _torch_bag(table, ids, mask, mode, weights=None, padding_id=None):
  """torch.nn.EmbeddingBag on the real slots (1-D input with offsets)."""
  torch = _torch()
  bag = torch.nn.EmbeddingBag(NUM_ROWS, DIM, mode=mode,
                              padding_idx=padding_id)
  with torch.no_grad():
    bag.weight.copy_(torch.tensor(np.asarray(table)))
  flat = torch.tensor(ids[mask], dtype=torch.int64)
  offsets = torch.tensor(np.concatenate([[0], np.cumsum(mask.sum(1))[:-1]]),
                         dtype=torch.int64)
  w = None if weights is None else torch.tensor(weights[mask])
  out = bag(flat, offsets, per_sample_weights=w)
  return out, bag.weight


# Every mode with a mask; `lengths` only becomes the same mask
# (`j < lengths[b]`) before the mode is applied, so it runs with padding ids
# inside the bags, under each mode once (not again for each case above).
_MASKED = [('sum', False, False), ('sum', True, False), ('mean', False, False),
           ('max', False, False), ('sum', True, True), ('mean', False, True),
           ('max', False, True)]
_WITH_LENGTHS = [('sum', True, True), ('mean', False, True),
                 ('max', False, True)]


@TORCH
@pytest.mark.parametrize('mode,weighted,padding,how', [
    *[(*case, 'mask') for case in _MASKED],
    *[(*case, 'lengths') for case in _WITH_LENGTHS]])
def test_outputs_and_gradients_match_torch_embedding_bag(mode, weighted,
                                                         padding, how):
  ids, lengths, mask, weights = _batch(0)
  padding_id = 4 if padding else None
  if padding:
    ids[1, 0] = ids[3, 0] = padding_id   # padding slots inside real bags
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32)
  cotangent = rng.normal(size=(ids.shape[0], DIM)).astype(np.float32)
  kwargs = dict(mode=mode, padding_id=padding_id,
                per_sample_weights=jnp.asarray(weights) if weighted else None)
  kwargs['mask' if how == 'mask' else 'lengths'] = jnp.asarray(
      mask if how == 'mask' else lengths)

  def loss_fn(params, ids):
    out = lazy_optax.lookup_bag(params['table'], ids, **kwargs)
    return jnp.sum(out * cotangent), out

  (_, out), grads = jax.jit(lazy_optax.value_and_grad(loss_fn, has_aux=True))(
      {'table': table}, jnp.asarray(ids))
  ref_out, ref_weight = _torch_bag(table, ids, mask, mode,
                                   weights if weighted else None, padding_id)
  (ref_out * _torch().tensor(cotangent)).sum().backward()
  np.testing.assert_allclose(out, ref_out.detach().numpy(), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(out)[2], 0)   # empty bag: zeros
  assert np.isfinite(np.asarray(out)).all()
  g = grads['table']
  assert isinstance(g, lazy_optax.SparseRows)
  np.testing.assert_allclose(g.to_dense(), ref_weight.grad.numpy(),
                             rtol=1e-5, atol=1e-6)
  # Only the real ids hold rows, each once (the gradient crossed jit's
  # boundary as a pytree, so its repeated ids are summed): masked and padding
  # slots point past the end with zero values.
  real = mask & (ids != padding_id) if padding else mask
  named = np.asarray(g.ids)
  np.testing.assert_array_equal(np.sort(named[named < NUM_ROWS]),
                                np.unique(ids[real]))
  np.testing.assert_array_equal(np.asarray(g.values)[named == NUM_ROWS], 0)


def test_weighted_mean_is_tensorflows_and_matches_float64_numpy():
  ids, lengths, mask, weights = _batch(2)
  table = np.random.default_rng(3).normal(size=(NUM_ROWS, DIM))
  # Jitted: one program, not one per operation (the eager path runs in
  # test_bag_layers_match_torch and test_bag_arguments_are_checked).
  out = jax.jit(lambda *a: lazy_optax.lookup_bag(
      a[0], a[1], lengths=a[2], mode='mean', per_sample_weights=a[3]))(
          jnp.asarray(table, jnp.float32), jnp.asarray(ids),
          jnp.asarray(lengths), jnp.asarray(weights))
  ref = np.zeros((ids.shape[0], DIM))
  for b in range(ids.shape[0]):
    w = weights[b][mask[b]].astype(np.float64)
    if w.size:
      ref[b] = (w[:, None] * table[ids[b][mask[b]]]).sum(0) / w.sum()
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_plain_jax_grad_through_a_bag_equals_the_dense_formulation():
  ids, _, mask, weights = _batch(4)
  table = jnp.asarray(np.random.default_rng(5).normal(size=(NUM_ROWS, DIM)),
                      jnp.float32)
  ids_j, mask_j, w_j = jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(weights)

  def lazy_loss(t):
    return jnp.sum(jnp.sin(lazy_optax.lookup_bag(
        t, ids_j, mask=mask_j, mode='sum', per_sample_weights=w_j)))

  def dense_loss(t):   # the same bag written with one-hot matrices
    onehot = jax.nn.one_hot(jnp.where(mask_j, ids_j, -1), NUM_ROWS)
    # At full float32 precision: a GPU's default matmul (TF32) would round
    # the reference to about 1e-3.
    return jnp.sum(jnp.sin(jnp.einsum('bl,blv,vd->bd', w_j, onehot, t,
                                      precision=jax.lax.Precision.HIGHEST)))

  # The reference in one program (eager, each operation was a program).
  np.testing.assert_allclose(jax.grad(lazy_loss)(table),
                             jax.jit(jax.grad(dense_loss))(table), rtol=1e-5,
                             atol=1e-6)


def test_bag_arguments_are_checked():
  table = jnp.zeros((5, 2))
  ids = jnp.array([[1, 2]])
  with pytest.raises(ValueError, match=r'\[batch, max_len\]'):
    lazy_optax.lookup_bag(table, jnp.array([1, 2]))
  with pytest.raises(ValueError, match='mode must be one of'):
    lazy_optax.lookup_bag(table, ids, mode='sqrtn')
  with pytest.raises(ValueError, match='not both'):
    lazy_optax.lookup_bag(table, ids, mask=jnp.ones((1, 2), bool),
                          lengths=jnp.array([1]))
  with pytest.raises(ValueError, match='mask must be a boolean'):
    lazy_optax.lookup_bag(table, ids, mask=jnp.ones((1, 2)))
  with pytest.raises(ValueError, match='lengths must have shape'):
    lazy_optax.lookup_bag(table, ids, lengths=jnp.array([1, 2]))
  with pytest.raises(ValueError, match="not 'max'"):
    lazy_optax.lookup_bag(table, ids, mode='max',
                          per_sample_weights=jnp.ones((1, 2)))
  with pytest.raises(ValueError, match='per_sample_weights must be'):
    lazy_optax.lookup_bag(table, ids, per_sample_weights=jnp.ones((2, 1)))
  with pytest.raises(TypeError, match='row ids must have an integer dtype'):
    lazy_optax.lookup_bag(table, jnp.ones((1, 2)))
  # Masked slots may hold anything; real slots may not.
  out = lazy_optax.lookup_bag(table, jnp.array([[1, 99]]),
                              lengths=jnp.array([1]))
  assert out.shape == (1, 2)
  with pytest.raises(ValueError, match='id 99 at position'):
    lazy_optax.lookup_bag(table, jnp.array([[1, 99]]))
  # Lengths that are no length of a bag of 2 slots.
  for bad, first in (([3], 'lengths\\[0\\] = 3'), ([1, -1], 'lengths\\[1\\] = -1')):
    with pytest.raises(ValueError, match=first + r'.*\[0, 2\]'):
      lazy_optax.lookup_bag(table, jnp.ones((len(bad), 2), jnp.int32),
                            lengths=jnp.array(bad))


@TORCH
def test_max_mode_tie_gives_the_gradient_to_the_first_maximum_like_torch():
  table = np.array([[1., 5.], [1., 2.], [0., 5.], [3., 0.]], np.float32)
  ids = np.array([[0, 1, 2], [3, 3, 1]])          # ties in both bags
  mask = np.ones(ids.shape, bool)
  cotangent = np.array([[1., 2.], [3., 4.]], np.float32)
  ref_out, ref_weight = _torch_bag_rows(table, ids, mask, 'max')
  (ref_out * _torch().tensor(cotangent)).sum().backward()

  def loss_fn(params, ids):
    out = lazy_optax.lookup_bag(params['table'], ids, mode='max')
    return jnp.sum(out * cotangent)

  @jax.jit  # with to_dense: eager, on these shapes, a program per operation
  def dense_grad(params, ids):
    return lazy_optax.value_and_grad(loss_fn)(params, ids)[1][
        'table'].to_dense()

  np.testing.assert_allclose(dense_grad({'table': jnp.asarray(table)},
                                        jnp.asarray(ids)),
                             ref_weight.grad.numpy())


def _layers(layer):
  """build(mode) -> (params, apply(params, ids, **kw), grad) of `layer`,
  importing only its library (skipped where that is absent)."""
  if layer in ('linen', 'nnx'):
    nnx = pytest.importorskip('flax.nnx')
    import lazy_optax.flax
  elif layer == 'haiku':
    hk = pytest.importorskip('haiku')
    import lazy_optax.haiku
  else:
    eqx = pytest.importorskip('equinox')
    import lazy_optax.equinox

  def linen(mode):
    model = lazy_optax.flax.EmbedBag(NUM_ROWS, DIM, mode=mode, name='bag')
    params = model.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    return params['params'], lambda p, ids, **kw: model.apply(
        {'params': p}, ids, **kw), lambda g: g['embedding']

  def nnx_layer(mode):
    model = lazy_optax.flax.NnxEmbedBag(NUM_ROWS, DIM, mode=mode,
                                        rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    return params, lambda p, ids, **kw: nnx.merge(graphdef, p)(ids, **kw), (
        lambda g: g['embedding'].get_value())

  def haiku(mode):
    f = hk.without_apply_rng(hk.transform(
        lambda ids, **kw: lazy_optax.haiku.EmbedBag(NUM_ROWS, DIM, mode=mode,
                                                    name='bag')(ids, **kw)))
    return (f.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32)), f.apply,
            lambda g: g['bag']['embeddings'])

  def equinox(mode):
    model = lazy_optax.equinox.EmbeddingBag(NUM_ROWS, DIM, mode=mode,
                                            key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return params, lambda p, ids, **kw: eqx.combine(p, static)(ids, **kw), (
        lambda g: g.weight)

  return {'linen': linen, 'nnx': nnx_layer, 'haiku': haiku,
          'equinox': equinox}[layer]


# Each layer with two modes (a layer that ignored its `mode` would fail one
# of them), each mode with two or three layers: the modes themselves are
# test_outputs_and_gradients_match_torch_embedding_bag's.
@TORCH
@pytest.mark.parametrize('layer,mode', [
    ('linen', 'sum'), ('linen', 'max'), ('nnx', 'mean'), ('nnx', 'max'),
    ('haiku', 'sum'), ('haiku', 'mean'), ('equinox', 'max'),
    ('equinox', 'sum')])
def test_bag_layers_match_torch(layer, mode):
  ids, lengths, mask, _ = _batch(6)
  params, apply, table_grad = _layers(layer)(mode)
  table = [leaf for leaf in jax.tree.leaves(params)
           if jnp.shape(leaf) == (NUM_ROWS, DIM)][0]
  cotangent = np.random.default_rng(7).normal(
      size=(ids.shape[0], DIM)).astype(np.float32)

  @jax.jit
  def grad_fn(params, ids, lengths):
    def loss_fn(params):
      return jnp.sum(apply(params, ids, lengths=lengths) * cotangent)
    return lazy_optax.value_and_grad(loss_fn)(params)

  _, grads = grad_fn(params, jnp.asarray(ids), jnp.asarray(lengths))
  ref_out, ref_weight = _torch_bag(table, ids, mask, mode)
  (ref_out * _torch().tensor(cotangent)).sum().backward()
  np.testing.assert_allclose(apply(params, jnp.asarray(ids),
                                   lengths=jnp.asarray(lengths)),
                             ref_out.detach().numpy(), rtol=1e-5, atol=1e-6)
  g = table_grad(grads)
  assert isinstance(g, lazy_optax.SparseRows)
  np.testing.assert_allclose(g.to_dense(), ref_weight.grad.numpy(),
                             rtol=1e-5, atol=1e-6)

