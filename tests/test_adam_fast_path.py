"""lazy_adam's fused row updates equal the generic path of lazy(...).

The fused paths: XLA's row update with the step computed from the moments
read back (`impl='xla'`), and the CPU kernel (`impl='cpu_kernel'`).

Up to rounding: XLA may contract `b1 * m + (1 - b1) * g` into a fused
multiply-add in one program and not in the other, a last-bit difference that
a bfloat16 moment can round up to one bfloat16 step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax


def _tx(kind, lr, impl, **kw):
  if kind == 'scale_by':
    return lazy_optax.scale_by_lazy_adam(impl=impl, **kw)
  if kind == 'adamw':
    return lazy_optax.lazy_adamw(
        lr, weight_decay=0.01,
        mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p), impl=impl,
        **kw)
  return lazy_optax.lazy_adam(lr, impl=impl, **kw)


@pytest.mark.parametrize('impl', ['xla', 'cpu_kernel'])
@pytest.mark.parametrize('kind', ['adam', 'adamw', 'scale_by'])
@pytest.mark.parametrize('kw', [
    {}, {'amsgrad': True}, {'mu_dtype': jnp.bfloat16},
    {'eps': 0.0, 'eps_root': 1e-12}])
def test_fast_path_equals_plain_lazy(impl, kind, kw):
  lr = optax.linear_schedule(1e-2, 1e-3, 5)
  num_rows = 12
  rng = np.random.default_rng(0)
  params = {'table': jnp.asarray(rng.normal(size=(num_rows, 3)), jnp.float32),
            'w': jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
  fast, plain = _tx(kind, lr, impl, **kw), _tx(kind, lr, 'generic', **kw)
  p_fast = p_plain = params
  s_fast, s_plain = fast.init(params), plain.init(params)

  @functools.partial(jax.jit, static_argnums=5)
  def step(p, s, ids, values, gw, use_fast):
    tx = fast if use_fast else plain
    g = {'table': lazy_optax.SparseRows(ids, values, num_rows), 'w': gw}
    u, s = tx.update(g, s, p)
    return lazy_optax.apply_updates(p, u), s, u

  for t in range(4):
    ids = rng.integers(-2, num_rows + 2, 9)  # duplicates, out-of-range ids
    ids[:3] = ids[0]
    ids = jnp.asarray(ids, jnp.int32)
    values = jnp.asarray(rng.normal(size=(9, 3)), jnp.float32)
    gw = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    p_fast, s_fast, u_fast = step(p_fast, s_fast, ids, values, gw, True)
    p_plain, s_plain, u_plain = step(p_plain, s_plain, ids, values, gw, False)
    # Updates compared densified (the same rows, whatever the slot order).
    dense = functools.partial(jax.tree.map, lambda x: x.to_dense() if
                              lazy_optax.tree.is_sparse_rows(x) else x,
                              is_leaf=lazy_optax.tree.is_sparse_rows)
    for a, b in zip(jax.tree.leaves((p_fast, s_fast, dense(u_fast))),
                    jax.tree.leaves((p_plain, s_plain, dense(u_plain)))):
      assert a.dtype == b.dtype and a.shape == b.shape
      # float32: a few ulps of the O(1) values that cancel into a small one
      # (the CPU kernel and XLA contract multiply-adds differently).
      tol = 1e-2 if a.dtype == jnp.bfloat16 else 2e-6
      atol = 1e-5 if a.dtype == jnp.bfloat16 else 5e-7
      np.testing.assert_allclose(np.asarray(a, np.float32),
                                 np.asarray(b, np.float32), rtol=tol,
                                 atol=atol, err_msg=str(t))
  assert (jax.tree.structure(s_fast) == jax.tree.structure(s_plain))
