"""Row-wise RMSprop with adaptive regularization (FBGEMM's ROWWISE_RMSPROP_AR).

The rule of Li and Lyu, "Adaptive Regularization for Large-Scale Sparse
Feature Embedding Models" (ICLR 2026), as FBGEMM's `ROWWISE_RMSPROP_AR`
computes it. Rare ids overfit in one epoch: their rows are trained on few
samples, and plain weight decay shrinks only the rows a step touches, so a
rare row escapes it between visits. The rule shrinks a row when it is
touched by an amount that grows with the steps since its last update, as if
the decay had run while the row was absent, and scales the step by a
row-wise RMS of the gradient. Per touched row (duplicates summed first, `g`
the summed row gradient, `t` the global step counted from 1):

    v_r <- ema_beta * v_r + (1 - ema_beta) * mean_over_row(g_r * g_r)
    I_r = t - prev_iter_r          (1 for a row never updated)
    lambda_r = clip(lr * ar_alpha * I_r, 0, 1)
    w_r <- max(min_shrinkage, 1 - lambda_r) * w_r - lr * g_r / (sqrt(v_r) + eps)
    prev_iter_r <- t

The state is two numbers a row: `v` (the field `nu`, float32, FBGEMM's
`momentum1`) and `prev_iter` (int32, 0 for a row never updated; int32
whatever the table's dtype, so step counts stay exact, where FBGEMM keeps a
float32 that stops counting exactly past 2**24 steps). With `ar_alpha=0`
the rule is plain row-wise RMSprop. The update returned is `w_new - w` (the
rule reads the weights), so `update` needs `params`. On a `SparseRows`
gradient only the touched rows change; a dense gradient touches every row
at every step (so `I` is 1 from the second step on).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import fused
from lazy_optax._src import validate
from lazy_optax._src.lazy import lazy
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import per_row_full
from lazy_optax._src.numerics import row_mean_square


class ScaleByRowwiseRmspropArState(NamedTuple):
  """State of `rowwise_rmsprop_ar`."""
  count: chex.Array  # int32 scalar, the global step (updates done)
  nu: optax.Updates  # [num_rows] per parameter: v, the EMA of mean(g^2)
  prev_iter: optax.Updates  # int32 [num_rows]: the step of the last update


fused.declare(ScaleByRowwiseRmspropArState, fused.RuleFacts(
    'rowwise_rmsprop_ar',
    ('nu', 'prev_iter'), 'LazyOptaxRowwiseRmspropAr', ('prev_iter',)))


class RowwiseRmspropArKernelHyper(NamedTuple):
  """The rule's hyperparameters, for `new_rows`, `step` and the kernel:
  rows.cc's `ROWWISE_RMSPROP_AR_FIELDS`, in order (`step` is its int32
  field)."""
  lr: jax.typing.ArrayLike
  ar_alpha: jax.typing.ArrayLike
  ema_beta: jax.typing.ArrayLike
  one_minus_beta: jax.typing.ArrayLike  # 1 - ema_beta
  min_shrinkage: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  step: jax.typing.ArrayLike  # int32: the global step of this update, from 1


def _gap(prev_iter: jax.Array, step: jax.typing.ArrayLike) -> jax.Array:
  """Steps since a row's last update, this one included (1 if never)."""
  return jnp.where(prev_iter == 0, 1, jnp.asarray(step, jnp.int32) - prev_iter)


def _rule() -> fused.RowRule:
  """The rule as a `RowRule` of a `RowwiseRmspropArKernelHyper`."""

  def new_rows(g, rows, params, hyper: RowwiseRmspropArKernelHyper):
    del params
    v = rows['nu']
    dtype = compute_dtype(g.dtype, v.dtype)
    ms = row_mean_square(g.astype(dtype))
    new_v = (jnp.asarray(hyper.ema_beta, dtype) * v.astype(dtype)
             + jnp.asarray(hyper.one_minus_beta, dtype) * ms)
    prev = rows['prev_iter']
    return {'nu': new_v,
            'prev_iter': jnp.full(prev.shape, hyper.step, prev.dtype)}

  def step(g, stored, params, hyper: RowwiseRmspropArKernelHyper, rows):
    v = stored['nu']
    w = jnp.asarray(params)
    dtype = compute_dtype(g.dtype, w.dtype, v.dtype)
    lr = jnp.asarray(hyper.lr, dtype)
    gap = _gap(rows['prev_iter'], hyper.step).astype(dtype)
    lam = jnp.clip(lr * jnp.asarray(hyper.ar_alpha, dtype) * gap, 0, 1)
    keep = jnp.maximum(jnp.asarray(hyper.min_shrinkage, dtype), 1 - lam) - 1
    scale = lr / (jnp.sqrt(v.astype(dtype)) + jnp.asarray(hyper.eps, dtype))
    wd = w.astype(dtype)
    return (broadcast_rows(keep, wd) * wd
            - broadcast_rows(scale, wd) * g.astype(dtype))

  # The rule's record is the kernel's.
  return fused.RowRule('rowwise_rmsprop_ar', new_rows, step,
                       ('nu', 'prev_iter'), 'LazyOptaxRowwiseRmspropAr',
                       lambda hyper: hyper, needs_params=True,
                       step_reads_old_rows=True, int_tables=('prev_iter',))


def _rowwise_rmsprop_ar_rule(
    *,
    learning_rate: optax.ScalarOrSchedule,
    ema_beta: float,
    ar_alpha: float,
    min_shrinkage: float,
    eps: float,
    accumulator_dtype: Optional[jax.typing.DTypeLike],
    impl: str,
) -> optax.GradientTransformationExtraArgs:
  """The rule, dense or fused inside `lazy(...)`."""
  rule = _rule()

  def init_fn(params):
    return ScaleByRowwiseRmspropArState(
        count=jnp.zeros([], jnp.int32),
        nu=jax.tree.map(lambda p: per_row_full(p, accumulator_dtype), params),
        prev_iter=jax.tree.map(lambda p: per_row_full(p, jnp.int32), params))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          'rowwise_rmsprop_ar shrinks the weights it updates (its update is '
          'w_new - w), so it needs params: call tx.update(grads, state, '
          'params).')
    lr = (learning_rate(state.count) if callable(learning_rate)
          else learning_rate)
    count = optax.safe_increment(state.count)
    hyper = RowwiseRmspropArKernelHyper(
        lr=lr, ar_alpha=ar_alpha, ema_beta=ema_beta,
        one_minus_beta=1 - ema_beta, min_shrinkage=min_shrinkage, eps=eps,
        step=count)
    new_updates, new = fused.apply_rule(
        rule, updates, {'nu': state.nu, 'prev_iter': state.prev_iter}, params,
        hyper, impl)
    return new_updates, ScaleByRowwiseRmspropArState(count, **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def rowwise_rmsprop_ar(
    learning_rate: optax.ScalarOrSchedule,
    *,
    ema_beta: float = 0.99,
    ar_alpha: float = 0.0,
    min_shrinkage: float = 0.1,
    eps: float = 1e-8,
    accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Row-wise RMSprop with adaptive regularization, lazy on `SparseRows`.

  FBGEMM's `ROWWISE_RMSPROP_AR` (Li and Lyu, ICLR 2026), with FBGEMM's
  argument names and defaults. Per touched row (see the module docstring):
  `v = ema_beta v + (1 - ema_beta) mean(g^2)`, then the row shrinks by
  `max(min_shrinkage, 1 - clip(lr ar_alpha I, 0, 1))`, `I` the steps since
  its last update, and moves by `-lr g / (sqrt(v) + eps)`. Use it for
  embedding tables with a long tail of rare ids that overfit in one epoch;
  `ar_alpha=0` is plain row-wise RMSprop. The state is 8 bytes a row. The
  learning rate enters the shrink nonlinearly (`lr * ar_alpha * I`,
  clipped), so there is no rate-free `scale_by_rowwise_rmsprop_ar` to chain
  a learning rate after: use `rowwise_rmsprop_ar` inside chains.

  Args:
    learning_rate: a float or an optax schedule of the global step (it
      scales both the step and the shrink, as in FBGEMM).
    ema_beta: decay of the row's mean squared gradient, in [0, 1).
    ar_alpha: strength of the adaptive regularization, `>= 0` (0: none).
    min_shrinkage: the least factor a row keeps when it shrinks, in [0, 1].
    eps: added to `sqrt(v)` (outside the root, as FBGEMM).
    accumulator_dtype: dtype of `v` (the state's `nu`, default float32);
      `prev_iter` is int32.
    impl: how the touched rows are updated: `'auto'`, `'generic'`, `'xla'`
      or `'cpu_kernel'` (see `lazy_optax.explain_update`).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByRowwiseRmspropArState(count, nu, prev_iter)` (`nu` holds `v`,
    the slot `'v'` of `lazy_optax.compat.get_slot`); its `update` needs
    `params`.

  Raises:
    ValueError: naming an argument out of its range.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.ones((10, 2))}
    >>> tx = lazy_optax.rowwise_rmsprop_ar(0.25, ar_alpha=2.0, ema_beta=0.0)
    >>> state = tx.init(params)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([7]),
    ...                                     jnp.ones((1, 2)), 10)}
    >>> updates, state = tx.update(g, state, params)
    >>> lazy_optax.apply_updates(params, updates)['table'][7]  # 0.5 - 0.25
    Array([0.25, 0.25], dtype=float32)
    >>> state.prev_iter['table'][jnp.array([6, 7])]
    Array([0, 1], dtype=int32)
  """
  fn = 'rowwise_rmsprop_ar'
  validate.hyperparameters(
      fn, beta=dict(ema_beta=ema_beta),
      non_negative=dict(ar_alpha=ar_alpha, min_shrinkage=min_shrinkage,
                        eps=eps))
  if isinstance(min_shrinkage, (int, float)) and min_shrinkage > 1:
    raise ValueError(
        f'{fn}: min_shrinkage must be in [0, 1], got {min_shrinkage!r}.')
  fused.check_impl(impl, fn)
  return lazy(_rowwise_rmsprop_ar_rule(
      learning_rate=learning_rate, ema_beta=ema_beta, ar_alpha=ar_alpha,
      min_shrinkage=min_shrinkage, eps=eps,
      accumulator_dtype=accumulator_dtype, impl=impl), impl=impl)
