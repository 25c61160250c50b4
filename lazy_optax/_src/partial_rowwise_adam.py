"""Partial row-wise Adam: `mu` per entry, `nu` one number per row.

The rule of FBGEMM's `PARTIAL_ROWWISE_ADAM`, for every row `r` a step
touches (duplicates summed first), with `t` the global step:

    m_r <- b1 * m_r + (1 - b1) * g_r                    (one per entry)
    v_r <- b2 * v_r + (1 - b2) * mean_over_row(g_r * g_r)   (one per row)
    w_r <- w_r - lr * ( m_r / (1 - b1^t) / (sqrt(v_r / (1 - b2^t)) + eps)
                        + wd * w_r )

The first moment keeps its direction per entry; the second moment, which
only sets the step's scale, is shared by the row. The state of a
`[num_rows, D]` table is `D + 1` numbers a row instead of Adam's `2 * D`.
Bias correction is `optax.adam`'s (`eps` added to `sqrt(v_hat)`), with
`1 - b^t` from the global step, as FBGEMM's `iter`; weight decay is
decoupled, as in FBGEMM (and `optax.adamw`).

How this differs from FBGEMM: `eps_root` (added to `v_hat` inside the square
root, as in `optax.adam`) is available, the learning rate may be an optax
schedule, a dense gradient updates every row (FBGEMM has no dense form), and
on a `SparseRows` gradient rows the batch did not touch keep `m`, `v` and
their weights bit-for-bit (`lazy(...)`), as FBGEMM's sparse update does.
For a one-dimensional parameter (one entry per row) the rule is
`optax.adam`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import fused
from lazy_optax._src import validate
from lazy_optax._src.bare import bare
from lazy_optax._src.lazy import lazy
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import is_zero
from lazy_optax._src.numerics import Mask
from lazy_optax._src.numerics import one_minus_power
from lazy_optax._src.numerics import per_row_full
from lazy_optax._src.numerics import row_mean_square


class ScaleByPartialRowwiseAdamState(NamedTuple):
  """State of `scale_by_partial_rowwise_adam` / `partial_rowwise_adam`."""
  count: chex.Array  # int32 scalar, the global step
  mu: optax.Updates  # one per entry, the parameters' shapes
  nu: optax.Updates  # [num_rows] per parameter (scalar: scalar)


fused.declare(ScaleByPartialRowwiseAdamState, fused.RuleFacts(
    'partial_rowwise_adam', ('mu', 'nu'), 'LazyOptaxPartialRowwiseAdam'))


class PartialRowwiseAdamHyper(NamedTuple):
  """The rule's hyperparameters at one step (`new_rows`, `step`)."""
  b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  eps_root: jax.typing.ArrayLike
  count: chex.Array  # int32 scalar, the new global step


class PartialRowwiseAdamKernelHyper(NamedTuple):
  """The partial row-wise Adam kernel's record: rows.cc's
  `PARTIAL_ROWWISE_ADAM_FIELDS`, in order, made by `_kernel_hyper`."""
  b1: jax.typing.ArrayLike
  one_minus_b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  one_minus_b2: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  eps_root: jax.typing.ArrayLike
  bias_correction1: jax.Array  # 1 - b1^t
  bias_correction2: jax.Array  # 1 - b2^t


def _kernel_hyper(h: PartialRowwiseAdamHyper
                  ) -> PartialRowwiseAdamKernelHyper:
  """The kernel's record: `1 - b` and the corrections computed once."""
  return PartialRowwiseAdamKernelHyper(
      h.b1, 1 - h.b1, h.b2, 1 - h.b2, h.eps, h.eps_root,
      one_minus_power(h.b1, h.count, jnp.float32),
      one_minus_power(h.b2, h.count, jnp.float32))


def _rule() -> fused.RowRule:
  """Partial row-wise Adam as a `RowRule` of a `PartialRowwiseAdamHyper`."""

  def new_rows(g, rows, params, hyper: PartialRowwiseAdamHyper):
    del params
    b1, b2 = hyper.b1, hyper.b2
    dtype = compute_dtype(g.dtype, rows['mu'].dtype, rows['nu'].dtype)
    g = g.astype(dtype)
    return {'mu': b1 * rows['mu'].astype(dtype) + (1 - b1) * g,
            'nu': b2 * rows['nu'].astype(dtype) + (1 - b2) * row_mean_square(
                g)}

  def step(g, stored, params, hyper: PartialRowwiseAdamHyper):
    del g, params
    m, v = stored['mu'], stored['nu']
    dtype = compute_dtype(m.dtype, v.dtype)
    m_hat = m.astype(dtype) / one_minus_power(hyper.b1, hyper.count, dtype)
    v_hat = v.astype(dtype) / one_minus_power(hyper.b2, hyper.count, dtype)
    denom = (jnp.sqrt(v_hat + jnp.asarray(hyper.eps_root, dtype))
             + jnp.asarray(hyper.eps, dtype))
    return m_hat / broadcast_rows(denom, m_hat)

  return fused.RowRule('partial_rowwise_adam', new_rows, step, ('mu', 'nu'),
                       'LazyOptaxPartialRowwiseAdam', _kernel_hyper)


def _partial_rowwise_adam_rule(
    *,
    b1: float,
    b2: float,
    eps: float,
    eps_root: float,
    mu_dtype: Optional[jax.typing.DTypeLike],
    nu_dtype: Optional[jax.typing.DTypeLike],
    impl: str,
) -> optax.GradientTransformationExtraArgs:
  """The rule, dense or fused inside `lazy(...)`."""
  rule = _rule()

  def init_fn(params):
    return ScaleByPartialRowwiseAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=optax.tree_utils.tree_zeros_like(params, dtype=mu_dtype),
        nu=jax.tree.map(lambda p: per_row_full(p, nu_dtype), params))

  def update_fn(updates, state, params=None, **extra_args):
    del params
    count = optax.safe_increment(state.count)
    hyper = PartialRowwiseAdamHyper(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                                    count=count)
    new_updates, new = fused.apply_rule(
        rule, updates, {'mu': state.mu, 'nu': state.nu}, None, hyper, impl)
    return new_updates, ScaleByPartialRowwiseAdamState(count, **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_partial_rowwise_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Rescales updates by partial row-wise Adam (no learning rate).

  `mu` per entry, `nu` one number per row from the mean over the row of the
  squared gradient, bias correction from the global step (FBGEMM's
  `PARTIAL_ROWWISE_ADAM`; see the module docstring). The bare rule: inside
  `lazy(...)` lazy on `SparseRows` gradients; dense on dense ones. Put a
  whole chain inside `lazy(...)` (or
  use `partial_rowwise_adam`).

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the per-row second moment.
    eps: added to `sqrt(v_hat)` (as in `optax.adam` and FBGEMM).
    eps_root: added to `v_hat` inside the square root.
    mu_dtype: dtype of `mu` (default: the parameter's).
    nu_dtype: dtype of `nu` (default float32, float64 for float64
      parameters).
    impl: how the touched rows are updated: `'auto'` (the CPU kernel where
      it applies, see `lazy_optax.kernel_status`), `'generic'`, `'xla'` or
      `'cpu_kernel'`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByPartialRowwiseAdamState(count, mu, nu)`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy(optax.chain(
    ...     lazy_optax.scale_by_partial_rowwise_adam(),
    ...     optax.scale_by_learning_rate(1e-3)))
    >>> state = tx.init({'table': jnp.zeros((1000, 64))})
    >>> (lazy_optax.compat.get_slot(state, 'table', 'm').shape,
    ...  lazy_optax.compat.get_slot(state, 'table', 'v').shape)
    ((1000, 64), (1000,))
  """
  validate.hyperparameters(
      'scale_by_partial_rowwise_adam', beta=dict(b1=b1, b2=b2),
      non_negative=dict(eps=eps, eps_root=eps_root))
  fused.check_impl(impl, 'scale_by_partial_rowwise_adam')
  return bare(_partial_rowwise_adam_rule(
      b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
      nu_dtype=nu_dtype, impl=impl), 'scale_by_partial_rowwise_adam', impl)


def partial_rowwise_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: float = 0.0,
    mask: Optional[Mask] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Partial row-wise Adam(W): half of Adam's state, lazy on `SparseRows`.

  For every touched row (duplicates summed first), with the global step `t`:
  `m = b1*m + (1-b1)*g; v_r = b2*v_r + (1-b2)*mean_over_row(g^2);
  w -= lr * (m/(1-b1^t) / (sqrt(v_r/(1-b2^t)) + eps) + weight_decay * w)`,
  the rule of FBGEMM's `PARTIAL_ROWWISE_ADAM`. Rows a batch did not touch
  keep their weights and both moments; dense gradients update every row.

  Args:
    learning_rate: a float or an optax schedule of the global step.
    b1: decay rate of the first moment.
    b2: decay rate of the per-row second moment.
    eps: added to `sqrt(v_hat)`.
    eps_root: added to `v_hat` inside the square root.
    mu_dtype: dtype of `mu` (default: the parameter's).
    weight_decay: decoupled weight decay rate (touched rows only; needs
      `params` in `update` when non-zero).
    mask: as in `optax.adamw`: which parameters decay.
    nu_dtype: dtype of `nu` (default float32).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'` (see
      `scale_by_partial_rowwise_adam`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state holds a
    `ScaleByPartialRowwiseAdamState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((1000, 4))}
    >>> tx = lazy_optax.partial_rowwise_adam(1e-2)
    >>> state = tx.init(params)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([3, 7, 3]),
    ...                                     jnp.ones((3, 4)), 1000)}
    >>> updates, state = tx.update(g, state, params)
    >>> params = lazy_optax.apply_updates(params, updates)
    >>> round(float(params['table'][3, 0]), 6), float(params['table'][4, 0])
    (-0.01, 0.0)
  """
  validate.hyperparameters(
      'partial_rowwise_adam', beta=dict(b1=b1, b2=b2), non_negative=dict(
          eps=eps, eps_root=eps_root, weight_decay=weight_decay))
  fused.check_impl(impl, 'partial_rowwise_adam')
  parts = [_partial_rowwise_adam_rule(
      b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
      nu_dtype=nu_dtype, impl=impl)]
  if not is_zero(weight_decay):
    parts.append(optax.add_decayed_weights(weight_decay, mask))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return lazy(optax.chain(*parts), impl=impl)
