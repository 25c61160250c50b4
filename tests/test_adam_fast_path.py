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
from optimizer_cases import BY_NAME
import pytest
from reference import off_the_cpu

import lazy_optax


_NUM_ROWS = 12
_LR = optax.linear_schedule(1e-2, 1e-3, 5)


# lazy_adam's forms, from the registry of optimizers (tests/optimizer_cases.py).
_ADAM = BY_NAME['lazy_adam']
_ADAMW = BY_NAME['lazy_adamw']


def _tx(kind, lr, impl, **kw):
  if kind == 'scale_by':
    return lazy_optax.lazy(_ADAM.scale_by(impl=impl, **kw), impl=impl)
  if kind == 'adamw':
    return _ADAMW.fn(
        lr, weight_decay=0.01,
        mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p), impl=impl,
        **kw)
  return _ADAM.fn(lr, impl=impl, **kw)


def _data():
  """The parameters and 4 batches: duplicates and out-of-range ids."""
  rng = np.random.default_rng(0)
  params = {'table': jnp.asarray(rng.normal(size=(_NUM_ROWS, 3)), jnp.float32),
            'w': jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
  data = []
  for _ in range(4):
    ids = rng.integers(-2, _NUM_ROWS + 2, 9)
    ids[:3] = ids[0]
    data.append((jnp.asarray(ids, jnp.int32),
                 jnp.asarray(rng.normal(size=(9, 3)), jnp.float32),
                 jnp.asarray(rng.normal(size=(3,)), jnp.float32)))
  return params, data


def _run(tx, params, data):
  """Per step: the parameters, the state and the update densified."""
  # Updates compared densified (the same rows, whatever the slot order),
  # in the step's program.
  dense = functools.partial(jax.tree.map, lambda x: x.to_dense() if
                            lazy_optax.tree.is_sparse_rows(x) else x,
                            is_leaf=lazy_optax.tree.is_sparse_rows)

  @jax.jit
  def step(p, s, ids, values, gw):
    g = {'table': lazy_optax.SparseRows(ids, values, _NUM_ROWS), 'w': gw}
    u, s = tx.update(g, s, p)
    return lazy_optax.apply_updates(p, u), s, dense(u)

  p, s, out = params, tx.init(params), []
  for ids, values, gw in data:
    p, s, u = step(p, s, ids, values, gw)
    out.append((p, s, u))
  return out


# The generic path's run, the reference of both fused impls: computed once
# per (kind, kw) in each process, not once per impl.
_PLAIN = {}


def _plain_run(kind, kw, params, data):
  # Keyed by the default device too: a cpu_kernel case runs on the CPU
  # where the default backend is another (tests/conftest.py).
  key = (kind, tuple(sorted((k, str(v)) for k, v in kw.items())),
         str(jax.config.jax_default_device))
  if key not in _PLAIN:
    _PLAIN[key] = _run(_tx(kind, _LR, 'generic', **kw), params, data)
  return _PLAIN[key]


def _bfloat16_step_apart(x, kw):
  """Whether float32 leaves may be a bfloat16 step apart: a bfloat16 first
  moment on another platform than the CPU.

  There XLA may keep a moment's float32 value where the program rounds it
  to bfloat16 and reads it back (excess precision), and sums the duplicate
  ids' rows in another order: the moment, then the update and the
  parameters derived from it, differ by up to a bfloat16 step in one of the
  two programs (measured on a GPU: 8e-3 relative, 3.6e-5 absolute on the
  parameters). On the CPU the float32 leaves stay within a few ulps.
  """
  return (kw.get('mu_dtype') == jnp.bfloat16 and x.dtype == jnp.float32
          and off_the_cpu(x))


# Each form of lazy_adam with its defaults, and each option of the rule
# (AMSGrad, a bfloat16 first moment, eps_root) on lazy_adam: an option is
# the same arithmetic in every form (the fused paths share one rule and one
# kernel; the forms differ in the weight decay, its mask and the learning
# rate, checked with the defaults).
_OPTIONS = [{}, {'amsgrad': True}, {'mu_dtype': jnp.bfloat16},
            {'eps': 0.0, 'eps_root': 1e-12}]


@pytest.mark.parametrize('impl', ['xla', 'cpu_kernel'])
@pytest.mark.parametrize('kind, kw', [
    (kind, kw) for kind in ('adam', 'adamw', 'scale_by') for kw in _OPTIONS
    if kind == 'adam' or not kw])
def test_fast_path_equals_plain_lazy(impl, kind, kw):
  params, data = _data()
  fast = _run(_tx(kind, _LR, impl, **kw), params, data)
  plain = _plain_run(kind, kw, params, data)
  for t, (got, want) in enumerate(zip(fast, plain)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert a.dtype == b.dtype and a.shape == b.shape
      # float32: a few ulps of the O(1) values that cancel into a small one
      # (the CPU kernel and XLA contract multiply-adds differently).
      tol = 1e-2 if a.dtype == jnp.bfloat16 else 2e-6
      atol = 1e-5 if a.dtype == jnp.bfloat16 else 5e-7
      if _bfloat16_step_apart(a, kw):
        # A bfloat16 step of the update: the learning rate's (1e-2) scale,
        # or the update's own O(1) scale when no learning rate applies
        # (measured on a GPU: 1.6e-3 where the plain path's update was 0).
        tol, atol = 1e-2, (1e-2 if kind == 'scale_by' else 1e-4)
      np.testing.assert_allclose(np.asarray(a, np.float32),
                                 np.asarray(b, np.float32), rtol=tol,
                                 atol=atol, err_msg=str(t))
  assert (jax.tree.structure(fast[-1][1]) == jax.tree.structure(plain[-1][1]))
