"""lazy_optax.value_and_grad and lookup against jax.grad of plain gathers."""

import functools
import re

from flax import nnx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
import lazy_optax.flax


def _params(rng, num_rows=12, dim=3):
  return {
      'table': jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32),
      'out': jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32),
      'w': jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
  }


_HIGHEST = jax.lax.Precision.HIGHEST


def _model(take):
  """A small loss, written once for any gather function `take`."""

  def loss_fn(params, ids, ctx):
    u = take(params['table'], ids)                      # [B, K, D]
    v = take(params['out'], ctx)                        # [B, D]
    first = take(params['table'], ids[:, 0])            # the table again
    # At full float32 precision, forward and backward: a GPU's default
    # matmul (TF32) rounds to ~1e-3, differently in the two programs.
    score = (jnp.einsum('bkd,bd->b', u, v, precision=_HIGHEST)
             + jnp.dot(first, params['w'], precision=_HIGHEST))
    return jnp.mean(jnp.tanh(score) ** 2) + 0.1 * jnp.sum(v ** 2)

  return loss_fn


_plain = _model(lambda table, ids: jnp.take(table, ids, axis=0))
_lazy = _model(lazy_optax.lookup)
# The references, jitted: one program each, not a program per operation.
_plain_value_and_grad = jax.jit(jax.value_and_grad(_plain))


def _batch(rng, num_rows=12):
  ids = rng.integers(0, num_rows // 2, (5, 3)).astype(np.int32)
  ids[1, :] = ids[0, 0]  # duplicates
  ctx = rng.integers(0, num_rows, (5,)).astype(np.int32)
  return jnp.asarray(ids), jnp.asarray(ctx)


@pytest.mark.parametrize('jit', [False, True])
def test_sparse_gradients_equal_dense_ones(jit):
  rng = np.random.default_rng(0)
  params = _params(rng)
  ids, ctx = _batch(rng)
  f = lazy_optax.value_and_grad(_lazy)
  if jit:
    f = jax.jit(f)
  loss, grads = f(params, ids, ctx)
  ref_loss, ref = _plain_value_and_grad(params, ids, ctx)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  for name in ('table', 'out'):
    assert isinstance(grads[name], lazy_optax.SparseRows), name
    assert grads[name].num_rows == 12
    np.testing.assert_allclose(grads[name].to_dense(), ref[name], rtol=1e-5,
                               atol=1e-7)
  # ids: 15 + 5 for the table (two lookups), 5 for the output table.
  assert grads['table'].ids.shape == (20,)
  assert grads['out'].ids.shape == (5,)
  np.testing.assert_allclose(grads['w'], ref['w'], rtol=1e-5, atol=1e-7)


def test_plain_jax_grad_through_lookup_stays_dense_and_correct():
  rng = np.random.default_rng(1)
  params = _params(rng)
  ids, ctx = _batch(rng)
  grads = jax.grad(_lazy)(params, ids, ctx)
  ref = _plain_value_and_grad(params, ids, ctx)[1]
  assert np.abs(np.asarray(grads['table'])).sum() > 0
  for name in params:
    np.testing.assert_allclose(grads[name], ref[name], rtol=1e-6)


def test_table_also_used_densely_gets_the_full_dense_gradient():
  rng = np.random.default_rng(2)
  params = _params(rng)
  ids, ctx = _batch(rng)

  def tied(take):
    base = _model(take)
    def loss_fn(params, ids, ctx):
      logits = take(params['out'], ctx) @ params['table'].T   # tied output
      return base(params, ids, ctx) + jnp.mean(jax.nn.logsumexp(logits, -1))
    return loss_fn

  loss, grads = jax.jit(lazy_optax.value_and_grad(tied(lazy_optax.lookup)))(
      params, ids, ctx)
  ref_loss, ref = jax.jit(jax.value_and_grad(
      tied(lambda t, i: jnp.take(t, i, axis=0))))(params, ids, ctx)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  assert not isinstance(grads['table'], lazy_optax.SparseRows)
  np.testing.assert_allclose(grads['table'], ref['table'], rtol=1e-5,
                             atol=1e-7)
  assert isinstance(grads['out'], lazy_optax.SparseRows)
  np.testing.assert_allclose(grads['out'].to_dense(), ref['out'], rtol=1e-5,
                             atol=1e-7)


def test_has_aux_and_row_dtype():
  params = {'table': jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)}

  def loss_fn(params, ids):
    rows = lazy_optax.lookup(params['table'], ids, dtype=jnp.bfloat16)
    assert rows.dtype == jnp.bfloat16
    loss = jnp.sum(rows.astype(jnp.float32) * jnp.array([1.0, 2.0]))
    return loss, rows.shape

  (loss, shape), grads = lazy_optax.value_and_grad(loss_fn, has_aux=True)(
      params, jnp.array([3, 1]))
  assert shape == (2, 2)
  assert float(loss) == 6 + 7 * 2 + 2 + 3 * 2
  g = grads['table']
  assert g.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(g.ids), [1, 3])  # ascending
  np.testing.assert_array_equal(
      g.to_dense(), [[0, 0], [1, 2], [0, 0], [1, 2]])


def test_named_tables():
  rng = np.random.default_rng(3)
  params = _params(rng)
  ids, ctx = _batch(rng)
  _, grads = lazy_optax.value_and_grad(_lazy, tables=('out',))(
      params, ids, ctx)
  assert isinstance(grads['out'], lazy_optax.SparseRows)
  # A name matches the whole path or its last parts, not a partial key.
  nested = {'emb': params}
  _, g = lazy_optax.value_and_grad(
      lambda p, *a: _lazy(p['emb'], *a), tables=['emb/out', 'table'])(
          nested, ids, ctx)
  assert isinstance(g['emb']['out'], lazy_optax.SparseRows)
  assert isinstance(g['emb']['table'], lazy_optax.SparseRows)
  with pytest.raises(ValueError, match="named 'ut'"):
    lazy_optax.value_and_grad(lambda p, *a: _lazy(p['emb'], *a),
                              tables=['ut'])(nested, ids, ctx)
  ref = _plain_value_and_grad(params, ids, ctx)[1]
  assert not isinstance(grads['table'], lazy_optax.SparseRows)
  np.testing.assert_allclose(grads['table'], ref['table'], rtol=1e-5,
                             atol=1e-7)
  with pytest.raises(ValueError, match="named 'nope'"):
    lazy_optax.value_and_grad(_lazy, tables=('nope',))(params, ids, ctx)
  with pytest.raises(ValueError, match='never looked it up'):
    lazy_optax.value_and_grad(_plain, tables=('table',))(params, ids, ctx)

  def tied(params, ids, ctx):
    return _lazy(params, ids, ctx) + jnp.sum(params['table'] ** 2)

  with pytest.raises(ValueError, match='table.*outside lookups'):
    lazy_optax.value_and_grad(tied, tables=('table',))(params, ids, ctx)


def test_bad_input_errors():
  table = jnp.zeros((4, 2))
  with pytest.raises(TypeError, match='row ids must have an integer dtype'):
    lazy_optax.lookup(table, jnp.array([0.5]))
  with pytest.raises(ValueError, match='at least one dimension'):
    lazy_optax.lookup(jnp.float32(1.0), jnp.array([0]))
  with pytest.raises(TypeError, match='must be callable'):
    lazy_optax.value_and_grad(3)
  with pytest.raises(TypeError, match='pair'):
    lazy_optax.value_and_grad(lambda p: jnp.sum(p['t']), has_aux=True)(
        {'t': table})
  # Concrete ids past the end of the table are refused.
  with pytest.raises(ValueError, match='out of range'):
    lazy_optax.value_and_grad(
        lambda p: jnp.sum(lazy_optax.lookup(p['t'], jnp.array([4]))))(
            {'t': table})


def test_compiled_memory_does_not_grow_with_the_table():
  # The loss is not linear in the rows: when the rows' gradient does not
  # depend on the gathered rows, XLA on CPU copies the donated table before
  # scattering into it (the gather is then not ordered before the scatter).
  def temp_bytes(num_rows):
    params = {'table': jax.ShapeDtypeStruct((num_rows, 16), jnp.float32),
              'w': jax.ShapeDtypeStruct((16,), jnp.float32)}
    tx = lazy_optax.lazy_adam(1e-3)
    state = jax.eval_shape(tx.init, params)

    def step(params, state, ids):
      def loss_fn(p):
        return jnp.mean(jnp.tanh(lazy_optax.lookup(p['table'], ids) @ p['w']))
      _, grads = lazy_optax.value_and_grad(loss_fn)(params)
      updates, state = tx.update(grads, state, params)
      return lazy_optax.apply_updates(params, updates), state

    ids = jax.ShapeDtypeStruct((64,), jnp.int32)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        params, state, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(1_000), temp_bytes(100_000)
  assert large == small, (small, large)


def test_plain_jax_train_step_trains_and_leaves_other_rows():
  rng = np.random.default_rng(4)
  num_rows, dim = 50, 4
  target = jnp.asarray(rng.normal(size=(num_rows,)), jnp.float32)
  params = {'table': jnp.asarray(rng.normal(size=(num_rows, dim)) * 0.1,
                                 jnp.float32),
            'w': jnp.ones((dim,), jnp.float32)}
  before = np.asarray(params['table']).copy()
  tx = optax.partition(
      {'rows': lazy_optax.lazy_adam(0.05), 'rest': optax.adamw(0.05)},
      lazy_optax.tree.path_labels(lambda n: 'rows' if n == 'table' else 'rest'))
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, ids):
    def loss_fn(p):
      pred = lazy_optax.lookup(p['table'], ids) @ p['w']
      return jnp.mean((pred - target[ids]) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(150):
    ids = jnp.asarray(rng.integers(0, 30, (16,)), jnp.int32)  # rows < 30
    params, opt_state, loss = step(params, opt_state, ids)
    losses.append(float(loss))
  assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:10])
  np.testing.assert_array_equal(np.asarray(params['table'])[30:], before[30:])
  assert not np.array_equal(np.asarray(params['table'])[:30], before[:30])


class _Remat(nn.Module):
  @nn.compact
  def __call__(self, ids):
    return jnp.sum(lazy_optax.flax.Embed(10, 2, name='emb')(ids) ** 2)


class _NnxModel(nnx.Module):
  def __init__(self):
    self.emb = lazy_optax.flax.NnxEmbed(10, 2, rngs=nnx.Rngs(0))


# Every form of a lookup inside a transformation: the table reaches the
# lookup by closure (the same object) or as an argument (a new tracer).
_FORMS = {
    'scan': lambda t, ids, look: jax.lax.scan(
        lambda c, i: (c + look(t, i), None), 0.0, ids)[0],
    'scan_carry': lambda t, ids, look: jax.lax.scan(
        lambda c, i: ((c[0] + look(c[1], i), c[1]), None), (0.0, t),
        ids)[0][0],
    'vmap': lambda t, ids, look: jnp.sum(jax.vmap(lambda i: look(t, i))(ids)),
    'vmap_argument': lambda t, ids, look: jnp.sum(jax.vmap(
        look, in_axes=(None, 0))(t, ids)),
    'checkpoint': lambda t, ids, look: jax.checkpoint(
        lambda i: look(t, i))(ids),
    'checkpoint_closure_only': lambda t, ids, look: jax.checkpoint(
        lambda: look(t, ids))(),
    'checkpoint_argument': lambda t, ids, look: jax.checkpoint(look)(t, ids),
    'jit_closure': lambda t, ids, look: jax.jit(lambda i: look(t, i))(ids),
    'jit_argument': lambda t, ids, look: jax.jit(look)(t, ids),
    'cast': lambda t, ids, look: look(t.astype(jnp.bfloat16), ids),
    'linen_remat': lambda t, ids, look: nn.remat(_Remat)().apply(
        {'params': {'emb': {'embedding': t}}}, ids),
}


@pytest.mark.parametrize('form', sorted(_FORMS))
@pytest.mark.parametrize('jit', [False, True])
def test_lookups_under_inner_transformations_are_refused(form, jit):
  params = {'t': jnp.arange(20.0).reshape(10, 2)}
  ids = jnp.array([[1, 2], [3, 4]])
  look = lambda t, i: jnp.sum(lazy_optax.lookup(t, i).astype(jnp.float32)
                              ** 2)
  loss_fn = lambda p, ids: _FORMS[form](p['t'], ids, look)
  f = lazy_optax.value_and_grad(loss_fn)
  with pytest.raises(ValueError, match='top level of the loss'):
    (jax.jit(f) if jit else f)(params, ids)
  # jax.grad still gives the dense gradient through the same lookups.
  dense = jax.grad(loss_fn)(params, ids)['t']
  ref = np.zeros((10, 2))
  np.add.at(ref, np.asarray(ids).reshape(-1),
            2 * np.asarray(params['t'])[np.asarray(ids).reshape(-1)])
  np.testing.assert_allclose(dense, ref, rtol=1e-2)


def test_nnx_remat_is_refused():
  model = _NnxModel()

  def loss_fn(model, ids):
    return nnx.remat(lambda m, i: jnp.sum(m.emb(i) ** 2))(model, ids)

  with pytest.raises(ValueError, match='top level of the loss'):
    lazy_optax.flax.nnx_value_and_grad(loss_fn)(model, jnp.array([1, 2]))


def test_tables_argument_leaves_a_transformed_table_dense():
  """The way out named in the error: the other tables stay row-sparse."""
  params = {'t': jnp.arange(20.0).reshape(10, 2), 'u': jnp.ones((6, 2))}
  ids = jnp.array([1, 2, 2])

  def loss_fn(p, ids):
    inner = jax.checkpoint(lambda t, i: jnp.sum(lazy_optax.lookup(t, i) ** 2))
    return inner(p['t'], ids) + jnp.sum(lazy_optax.lookup(p['u'], ids) ** 3)

  _, grads = jax.jit(lazy_optax.value_and_grad(loss_fn, tables=['u']))(
      params, ids)
  ref = jax.jit(jax.grad(loss_fn))(params, ids)
  np.testing.assert_allclose(grads['t'], ref['t'], rtol=1e-6)
  assert isinstance(grads['u'], lazy_optax.SparseRows)
  np.testing.assert_allclose(grads['u'].to_dense(), ref['u'], rtol=1e-6)


def test_traced_tables_that_are_not_parameters_may_be_looked_up_anywhere():
  params = {'t': jnp.ones((10, 2))}
  ids = jnp.array([[1, 2], [3, 4]])

  @jax.jit
  def grad_fn(params, frozen, ids):
    def loss_fn(p):
      inside = jax.lax.scan(lambda c, i: (
          c + jnp.sum(lazy_optax.lookup(frozen, i)), None), 0.0, ids)[0]
      return inside * jnp.sum(lazy_optax.lookup(p['t'], ids))
    return lazy_optax.value_and_grad(loss_fn)(params)

  loss, grads = grad_fn(params, jnp.full((10, 2), 2.0), ids)
  assert float(loss) == 16 * 8
  assert isinstance(grads['t'], lazy_optax.SparseRows)
  np.testing.assert_allclose(grads["t"].values, 16.0)


def test_a_jitted_step_is_traced_once():
  """Counted with a trace counter: value_and_grad adds no retracing."""
  traces = []
  params = {'t': jnp.zeros((10, 2)), 'w': jnp.ones(2)}
  tx = lazy_optax.lazy_adam(0.1)
  opt_state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, ids):
    traces.append(1)
    def loss_fn(p):
      return jnp.sum(lazy_optax.lookup(p['t'], ids) @ p['w'])
    _, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state

  for k in range(4):
    params, opt_state = step(params, opt_state, jnp.array([k, k + 1]))
  assert len(traces) == 1


def test_tables_alike_are_deduplicated_in_one_program():
  # Three tables of different sizes looked up with one [B] column each (a
  # DLRM's features): their gradients are deduplicated together (one sort
  # in the program, not three) and equal jax.grad's dense ones.
  rng = np.random.default_rng(4)
  sizes = (9, 40, 17)
  params = {f't{k}': jnp.asarray(rng.normal(size=(r, 4)), jnp.float32)
            for k, r in enumerate(sizes)}
  ids = jnp.asarray(np.stack([rng.integers(0, r, 16) for r in sizes], 1),
                    jnp.int32)

  def loss_fn(take, params, ids):
    rows = [take(params[f't{k}'], ids[:, k]) for k in range(len(sizes))]
    return jnp.sum(jnp.tanh(rows[0] * rows[1] + rows[2]) ** 2)

  step = jax.jit(lazy_optax.value_and_grad(
      functools.partial(loss_fn, lazy_optax.lookup)))
  compiled = step.lower(params, ids).compile().as_text()
  assert len(re.findall(r'= \S+ sort\(', compiled)) == 1
  _, grads = step(params, ids)
  _, ref = jax.value_and_grad(functools.partial(
      loss_fn, lambda t, i: jnp.take(t, i, axis=0)))(params, ids)
  for name in params:
    assert isinstance(grads[name], lazy_optax.SparseRows), name
    np.testing.assert_allclose(grads[name].to_dense(), ref[name], rtol=1e-5,
                               atol=1e-6)
