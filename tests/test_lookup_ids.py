"""One rule for lookup ids, in every entry point, eagerly and under jit.

Ids outside [0, num_rows) (negative ones included) read zero rows and never
produce a gradient row; concrete ones raise ValueError naming the table and
the first bad id; under jit, `lazy_optax.checks.checked` reports them. Padding ids
read their row and never produce a gradient row.
"""

import importlib

import equinox as eqx
from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
import lazy_optax.equinox
import lazy_optax.flax

NUM_ROWS, DIM = 10, 2
BAD = np.array([[1, NUM_ROWS], [-1, 3]], np.int32)   # first bad: 10 at [0 1]


def _entry(name, padding_id=None):
  """(params, apply(params, ids), table path, bag?) for one entry point."""
  # NumPy data put with device_put: no conversion program compiled.
  table = jax.device_put(np.random.default_rng(0).normal(
      size=(NUM_ROWS, DIM)).astype(np.float32))
  bag = name.endswith('bag')
  mode = dict(mode='sum') if bag else {}
  if name in ('lookup', 'lookup_bag'):
    fn = lazy_optax.lookup_bag if bag else lazy_optax.lookup
    return ({'emb': {'table': table}},
            lambda p, ids: fn(p['emb']['table'], ids, padding_id=padding_id,
                              **mode), 'emb/table', bag)
  if name.startswith('linen'):
    cls = lazy_optax.flax.EmbedBag if bag else lazy_optax.flax.Embed

    class Model(nn.Module):
      @nn.compact
      def __call__(self, ids):
        return cls(NUM_ROWS, DIM, padding_id=padding_id, name='emb',
                   **mode)(ids)

    model = Model()
    return ({'emb': {'embedding': table}},
            lambda p, ids: model.apply({'params': p}, ids), 'emb/embedding',
            bag)
  if name.startswith('nnx'):
    cls = lazy_optax.flax.NnxEmbedBag if bag else lazy_optax.flax.NnxEmbed
    graphdef, params = nnx.split(cls(NUM_ROWS, DIM, padding_id=padding_id,
                                     rngs=nnx.Rngs(0), **mode))
    params['embedding'].set_value(table)
    return params, lambda p, ids: nnx.merge(graphdef, p)(ids), 'embedding', bag
  if name.startswith('haiku'):
    hk = pytest.importorskip('haiku')
    haiku_layers = importlib.import_module('lazy_optax.haiku')
    cls = haiku_layers.EmbedBag if bag else haiku_layers.Embed
    f = hk.without_apply_rng(hk.transform(
        lambda ids: cls(NUM_ROWS, DIM, padding_id=padding_id, name='emb',
                        **mode)(ids)))
    return {'emb': {'embeddings': table}}, f.apply, 'emb/embeddings', bag
  assert name.startswith('equinox')
  cls = (lazy_optax.equinox.EmbeddingBag if bag
         else lazy_optax.equinox.Embedding)
  model = cls(weight=table, padding_id=padding_id, **mode)
  params, static = eqx.partition(model, eqx.is_inexact_array)
  return params, lambda p, ids: eqx.combine(p, static)(ids), 'weight', bag


ENTRIES = ['lookup', 'lookup_bag', 'linen', 'linen_bag', 'nnx', 'nnx_bag',
           'haiku', 'haiku_bag', 'equinox', 'equinox_bag']


def _table(params):
  return [x for x in jax.tree.leaves(params)
          if jnp.shape(x) == (NUM_ROWS, DIM)][0]


def _sparse_grad(grads):
  return [g for g in jax.tree.leaves(grads, is_leaf=lazy_optax.tree.is_sparse_rows)
          if isinstance(g, lazy_optax.SparseRows)][0]


def _reference(table, ids, bag, cotangent, padding_id=None):
  """Float64 numpy: rows (or bag sums) and the gradient of sum(out * c)."""
  table = np.asarray(table, np.float64)
  valid = (ids >= 0) & (ids < NUM_ROWS)
  rows = np.where(valid[..., None], table[np.clip(ids, 0, NUM_ROWS - 1)], 0)
  real = valid if padding_id is None else valid & (ids != padding_id)
  if bag:   # padding slots are not part of a bag
    out = np.where(real[..., None], rows, 0).sum(1)
    slot_cotangent = np.broadcast_to(cotangent[:, None], rows.shape)
  else:
    out, slot_cotangent = rows, cotangent
  grad = np.zeros_like(table)
  np.add.at(grad, ids[real], slot_cotangent[real])
  return out, grad


@pytest.mark.parametrize('name', ENTRIES)
def test_eager_out_of_range_ids_raise_naming_the_table_and_first_bad_id(name):
  params, apply, path, _ = _entry(name)
  loss = lambda p, ids: jnp.sum(apply(p, ids))
  pattern = (rf'table {path}: id {NUM_ROWS} at position \[0 1\] is out of range '
             rf'for a table of {NUM_ROWS} rows \(2 ids')
  with pytest.raises(ValueError, match=pattern):
    lazy_optax.value_and_grad(loss)(params, jax.device_put(BAD))
  with pytest.raises(ValueError, match=r'id -1 at position \[0'):
    apply(params, jnp.array([[-1, 2]]) if name.endswith('bag')
          else jnp.array([-1, 2]))
  with pytest.raises(TypeError, match='row ids must have an integer dtype'):
    apply(params, jnp.ones((2, 2)))


@pytest.mark.parametrize('name', ENTRIES)
def test_under_jit_out_of_range_ids_read_zeros_and_give_no_gradient_row(name):
  params, apply, _, bag = _entry(name)
  cotangent = np.random.default_rng(1).normal(
      size=(2, DIM) if bag else BAD.shape + (DIM,)).astype(np.float32)

  @jax.jit
  def grad_fn(params, ids):
    def loss_fn(params):
      out = apply(params, ids)
      return jnp.sum(out * cotangent), out
    return lazy_optax.value_and_grad(loss_fn, has_aux=True)(params)

  (_, out), grads = grad_fn(params, jax.device_put(BAD))
  ref_out, ref_grad = _reference(_table(params), BAD, bag, cotangent)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  g = _sparse_grad(grads)
  np.testing.assert_allclose(g.to_dense(), ref_grad, rtol=1e-6, atol=1e-6)
  # The bad slots name no row (-1 does not wrap onto row 9) and hold zeros;
  # the gradient keeps the bad ids, so that checked mode can report them
  # (it crossed jit's boundary as a pytree: its slots hold distinct ids).
  safe = np.asarray(g.safe_ids())
  np.testing.assert_array_equal(np.sort(safe), [1, 3, NUM_ROWS, NUM_ROWS])
  np.testing.assert_array_equal(np.sort(np.asarray(g.ids)),
                                np.sort(BAD.reshape(-1)))
  np.testing.assert_array_equal(np.asarray(g.values)[safe == NUM_ROWS], 0)
  # Plain jax.grad through the same entry point agrees (dense gradient).
  dense = jax.jit(jax.grad(lambda p: jnp.sum(apply(p, BAD) * cotangent)))(
      params)
  np.testing.assert_allclose(_table(dense), ref_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('name', ENTRIES)
@pytest.mark.parametrize('jit', [False, True])
def test_padding_id_reads_its_row_and_gives_no_gradient_row(name, jit):
  params, apply, _, bag = _entry(name, padding_id=0)
  ids = np.array([[0, 4], [4, 0]], np.int32)
  cotangent = np.random.default_rng(2).normal(
      size=(2, DIM) if bag else ids.shape + (DIM,)).astype(np.float32)

  def grad_fn(params, ids):
    def loss_fn(params):
      out = apply(params, ids)
      return jnp.sum(out * cotangent), out
    return lazy_optax.value_and_grad(loss_fn, has_aux=True)(params)

  (_, out), grads = (jax.jit(grad_fn) if jit else grad_fn)(
      params, jax.device_put(ids))
  ref_out, ref_grad = _reference(_table(params), ids, bag, cotangent,
                                 padding_id=0)
  if not bag:   # the padding row reads as it is
    ref_out = np.asarray(_table(params))[ids]
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  g = _sparse_grad(grads)
  # Row 4 named (once, or twice where the ids are not yet summed); the
  # padding slots name no row.
  np.testing.assert_array_equal(np.unique(np.asarray(g.ids)), [4, NUM_ROWS])
  np.testing.assert_allclose(g.to_dense(), ref_grad, rtol=1e-6, atol=1e-6)
  assert not np.asarray(g.to_dense())[0].any()


@pytest.mark.parametrize('tx', [
    lazy_optax.lazy_adam(0.1),
    lazy_optax.lazy(optax.adamw(0.1, weight_decay=0.5)),
    lazy_optax.lazy(optax.sgd(0.1, momentum=0.9)),
], ids=['lazy_adam', 'lazy_adamw', 'lazy_momentum'])
def test_no_optimizer_ever_updates_the_padding_row(tx):
  rng = np.random.default_rng(3)
  params = {'table': jax.device_put(
      rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32))}
  before = np.asarray(params['table']).copy()
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, ids, mask):
    def loss_fn(p):
      bags = lazy_optax.lookup_bag(p['table'], ids, mask=mask, padding_id=0)
      return jnp.sum((bags - 1.0) ** 2)
    _, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state

  for _ in range(20):
    ids = rng.integers(0, 6, (4, 3)).astype(np.int32)   # rows 6.. never seen
    ids[:, -1] = 0                                        # padding
    mask = rng.random((4, 3)) < 0.8
    ids[~mask] = 9     # masked slots name row 9, which must not move either
    params, opt_state = step(params, opt_state, ids, mask)
  after = np.asarray(params['table'])
  np.testing.assert_array_equal(after[0], before[0])
  np.testing.assert_array_equal(after[6:], before[6:])
  assert not np.array_equal(after[1:6], before[1:6])


def test_checked_mode_reports_out_of_range_lookup_ids_under_jit():
  params = {'emb': {'table': jnp.zeros((NUM_ROWS, DIM))}}

  def step(params, ids):
    def loss_fn(p):
      return jnp.sum(lazy_optax.lookup(p['emb']['table'], ids))
    _, grads = lazy_optax.value_and_grad(loss_fn)(params)
    lazy_optax.checks.check_ids_in_range(grads)
    return grads

  checked = lazy_optax.checks.checked(jax.jit(step))
  checked(params, jnp.array([[1, 2], [3, 9]]))            # in range: no error
  with pytest.raises(lazy_optax.checks.CheckError,
                     match=r'parameter emb/table: id -1 at position 2 .*'
                     r'\(2 ids out of range in all\)'):
    checked(params, jnp.array([[1, 2], [-1, 12]]))
  # Padding and masked slots are not reported.
  def bag_step(p, ids, mask):
    loss_fn = lambda p: jnp.sum(lazy_optax.lookup_bag(
        p['emb']['table'], ids, mask=mask, padding_id=-1))
    _, grads = lazy_optax.value_and_grad(loss_fn)(p)
    lazy_optax.checks.check_ids_in_range(grads)
    return grads

  lazy_optax.checks.checked(jax.jit(bag_step))(
      params, jnp.array([[1, -1], [3, 99]]),
      jnp.array([[True, True], [True, False]]))
  # Plain jit does not check (and reads zeros).
  out = jax.jit(lambda t, i: lazy_optax.lookup(t, i))(
      params['emb']['table'] + 1, jnp.array([NUM_ROWS]))
  np.testing.assert_array_equal(out, 0)


def test_padding_id_must_be_an_int():
  with pytest.raises(TypeError, match='padding_id must be a Python int'):
    lazy_optax.lookup(jnp.zeros((3, 2)), jnp.array([1]), padding_id=1.0)
