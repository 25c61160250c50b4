"""Row-wise Adagrad: one accumulator per table row (4 bytes a row).

The rule of FBGEMM's `EXACT_ROWWISE_ADAGRAD` (TorchRec's default for big
embedding tables), for every row `r` a step touches (duplicates summed
first):

    G_r <- G_r + mean_over_row(g_r * g_r)
    w_r <- w_r - lr * g_r / (sqrt(G_r) + eps)

Adagrad keeps one accumulator per *entry*, as large as the table; the
row-wise rule keeps one number per *row*, the mean of the squared gradient
over the row, so the state of a `[num_rows, D]` table is a `[num_rows]`
vector. Weight decay comes in FBGEMM's three modes:

- `'none'`;
- `'l2'`: `wd * w_r` is added to the gradient before it is squared and
  applied (`g_r <- g_r + wd * w_r`), so the decay is scaled by the row's
  adaptive step, as in FBGEMM's L2 mode;
- `'decoupled'`: `w_r <- w_r - lr * wd * w_r` beside the Adagrad step, as in
  FBGEMM's decoupled mode (and `optax.adamw`).

How this differs from FBGEMM: the accumulator may start at a value other
than zero (`initial_accumulator_value`), the learning rate may be an optax
schedule of the global step, and FBGEMM's optional max-norm clipping of rows
is not included (chain a row-norm clip yourself if you need it). A dense
gradient gets the same rule on every row, which FBGEMM does not offer; on a
`SparseRows` gradient only the touched rows of the table and of `G` change
(`lazy(...)`). For a one-dimensional parameter every entry is a row, which
makes the rule ordinary Adagrad with `eps` outside the square root.
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
from lazy_optax._src.numerics import Mask
from lazy_optax._src.numerics import mask_leaves
from lazy_optax._src.numerics import per_row_full
from lazy_optax._src.numerics import row_mean_square

WEIGHT_DECAY_MODES = ('none', 'l2', 'decoupled')


class ScaleByRowwiseAdagradState(NamedTuple):
  """State of `scale_by_rowwise_adagrad` / `rowwise_adagrad`."""
  count: chex.Array  # int32 scalar, the global step
  sum_of_squares: optax.Updates  # [num_rows] per parameter (scalar: scalar)


fused.declare(ScaleByRowwiseAdagradState, fused.RuleFacts(
    'rowwise_adagrad', ('sum_of_squares',), 'LazyOptaxRowwiseAdagrad'))


class RowwiseAdagradKernelHyper(NamedTuple):
  """The rule's hyperparameters, for `new_rows`, `step` and the kernel:
  rows.cc's `ROWWISE_ADAGRAD_FIELDS`, in order."""
  eps: jax.typing.ArrayLike
  l2: jax.typing.ArrayLike  # FBGEMM's L2 mode (0: off)


def _rule(l2: bool) -> fused.RowRule:
  """Row-wise Adagrad as a `RowRule` of a `RowwiseAdagradKernelHyper`.

  `l2` (FBGEMM's L2 mode) adds `hyper.l2 * params` to the gradient, for
  the leaves the mask decays (`hyper.l2` is 0 for the others).
  """

  def decayed(g, params, hyper: RowwiseAdagradKernelHyper):
    dtype = compute_dtype(g.dtype)
    g = g.astype(dtype)
    if not l2:
      return g
    return g + jnp.asarray(hyper.l2, dtype) * (
        jnp.asarray(params).astype(dtype))

  def new_rows(g, rows, params, hyper: RowwiseAdagradKernelHyper):
    acc = rows['sum_of_squares']
    g = decayed(g, params, hyper)
    dtype = compute_dtype(g.dtype, acc.dtype)
    return {'sum_of_squares': acc.astype(dtype) + row_mean_square(
        g.astype(dtype))}

  def step(g, stored, params, hyper: RowwiseAdagradKernelHyper):
    g = decayed(g, params, hyper)
    acc = stored['sum_of_squares']
    dtype = compute_dtype(g.dtype, acc.dtype)
    denom = jnp.sqrt(acc.astype(dtype)) + jnp.asarray(hyper.eps, dtype)
    return g.astype(dtype) / broadcast_rows(denom, g)

  return fused.RowRule('rowwise_adagrad', new_rows, step, ('sum_of_squares',),
                       'LazyOptaxRowwiseAdagrad', lambda hyper: hyper,
                       needs_params=l2)  # the record is the kernel's


def _rowwise_adagrad_rule(
    *,
    eps: float,
    initial_accumulator_value: float,
    accumulator_dtype: Optional[jax.typing.DTypeLike],
    l2_weight_decay: Optional[jax.typing.ArrayLike],
    mask: Optional[Mask],
    impl: str,
) -> optax.GradientTransformationExtraArgs:
  """The row-wise Adagrad rule, dense or fused inside `lazy(...)`.

  `l2_weight_decay` (or None) is FBGEMM's L2 mode: added to the gradient.
  """
  l2 = l2_weight_decay is not None
  rule = _rule(l2)

  def init_fn(params):
    return ScaleByRowwiseAdagradState(
        count=jnp.zeros([], jnp.int32),
        sum_of_squares=jax.tree.map(
            lambda p: per_row_full(p, accumulator_dtype,
                                   initial_accumulator_value), params))

  def update_fn(updates, state, params=None, **extra_args):
    count = optax.safe_increment(state.count)
    decays = None
    if l2:
      if params is None:
        raise ValueError(
            "rowwise_adagrad with weight_decay_mode='l2' adds weight_decay * "
            'params to the gradient, so it needs params: call '
            'tx.update(grads, state, params).')
      decays = mask_leaves(mask, params, jax.tree.structure(updates))

    def leaf_hyper(i: int, hyper: RowwiseAdagradKernelHyper
                   ) -> RowwiseAdagradKernelHyper:
      return hyper if decays is None or decays[i] else hyper._replace(l2=0.0)

    hyper = RowwiseAdagradKernelHyper(
        eps=eps, l2=0.0 if l2_weight_decay is None else l2_weight_decay)
    new_updates, new = fused.apply_rule(
        rule, updates, {'sum_of_squares': state.sum_of_squares},
        params if l2 else None, hyper, impl,
        leaf_hyper=leaf_hyper)
    return new_updates, ScaleByRowwiseAdagradState(count, **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_rowwise_adagrad(
    eps: float = 1e-8,
    initial_accumulator_value: float = 0.0,
    accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Rescales updates by row-wise Adagrad (no learning rate, no decay).

  Each row's gradient is divided by `sqrt(G_r) + eps`, where `G_r`
  accumulates the mean over the row of the squared gradient (FBGEMM's
  `EXACT_ROWWISE_ADAGRAD`; see the module docstring). The bare rule: inside
  `lazy(...)` lazy on `SparseRows` gradients; dense on dense ones. Put a
  whole chain inside `lazy(...)` (or
  use `rowwise_adagrad`): a plain optax transformation next to it would see
  `SparseRows` updates.

  Args:
    eps: added to `sqrt(G_r)` (FBGEMM's default is 1e-8).
    initial_accumulator_value: the starting value of every `G_r` (FBGEMM
      starts at 0; `optax.adagrad` at 0.1).
    accumulator_dtype: dtype of `G` (default float32, float64 for float64
      parameters).
    impl: how the touched rows are updated: `'auto'` (the CPU kernel where
      it applies, see `lazy_optax.kernel_status`), `'generic'`, `'xla'` or
      `'cpu_kernel'`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByRowwiseAdagradState(count, sum_of_squares)`, `sum_of_squares`
    holding a `[num_rows]` vector per parameter.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy(optax.chain(
    ...     lazy_optax.scale_by_rowwise_adagrad(),
    ...     optax.scale_by_learning_rate(0.1)))
    >>> state = tx.init({'table': jnp.zeros((1000, 64))})
    >>> lazy_optax.compat.get_slot(state, 'table', 'sum_of_squares').shape
    (1000,)
  """
  validate.hyperparameters(
      'scale_by_rowwise_adagrad', non_negative=dict(
          eps=eps, initial_accumulator_value=initial_accumulator_value))
  fused.check_impl(impl, 'scale_by_rowwise_adagrad')
  return bare(_rowwise_adagrad_rule(
      eps=eps, initial_accumulator_value=initial_accumulator_value,
      accumulator_dtype=accumulator_dtype, l2_weight_decay=None, mask=None,
      impl=impl), 'scale_by_rowwise_adagrad', impl)


def rowwise_adagrad(
    learning_rate: optax.ScalarOrSchedule,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mode: str = 'none',
    mask: Optional[Mask] = None,
    *,
    initial_accumulator_value: float = 0.0,
    accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Row-wise Adagrad: one accumulator per row, lazy on `SparseRows`.

  For every touched row (duplicates summed first):
  `G_r += mean_over_row(g_r^2); w_r -= lr * g_r / (sqrt(G_r) + eps)`, the
  rule of FBGEMM's `EXACT_ROWWISE_ADAGRAD`; the state is 4 bytes a row in
  float32, against Adam's `8 * D`. Untouched rows of the table and of `G`
  stay bit-for-bit unchanged; dense gradients update every row.

  Args:
    learning_rate: a float or an optax schedule of the global step.
    eps: added to `sqrt(G_r)`.
    weight_decay: the decay rate, used as `weight_decay_mode` says.
    weight_decay_mode: `'none'`, `'l2'` (FBGEMM's L2: `weight_decay * w` is
      added to the gradient, before it is squared into `G`) or
      `'decoupled'` (FBGEMM's decoupled mode: `w -= lr * weight_decay * w`,
      `G` sees the raw gradient). Both decay touched rows only and need
      `params` in `update`.
    mask: as in `optax.adamw`: a tree of bools, or a function of the params
      giving one, saying which parameters decay.
    initial_accumulator_value: the starting value of `G` (FBGEMM: 0).
    accumulator_dtype: dtype of `G` (default float32).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'` (see
      `scale_by_rowwise_adagrad`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state holds a
    `ScaleByRowwiseAdagradState`.

  Raises:
    ValueError: for an unknown `weight_decay_mode`, or a non-zero
      `weight_decay` with `weight_decay_mode='none'`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((1000, 4))}
    >>> tx = lazy_optax.rowwise_adagrad(0.1)
    >>> state = tx.init(params)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([3, 7, 3]),
    ...                                     jnp.ones((3, 4)), 1000)}
    >>> updates, state = tx.update(g, state, params)
    >>> params = lazy_optax.apply_updates(params, updates)
    >>> float(params['table'][3, 0]), float(params['table'][4, 0])
    (-0.1, 0.0)
    >>> state[0].sum_of_squares['table'][jnp.array([3, 4, 7])]
    Array([4., 0., 1.], dtype=float32)
  """
  if weight_decay_mode not in WEIGHT_DECAY_MODES:
    raise ValueError(
        f'rowwise_adagrad: weight_decay_mode must be one of '
        f'{WEIGHT_DECAY_MODES}, got {weight_decay_mode!r}.')
  validate.hyperparameters(
      'rowwise_adagrad', non_negative=dict(
          eps=eps, weight_decay=weight_decay,
          initial_accumulator_value=initial_accumulator_value))
  if weight_decay_mode == 'none' and isinstance(
      weight_decay, (int, float)) and weight_decay != 0:
    raise ValueError(
        f'rowwise_adagrad: weight_decay={weight_decay!r} has no effect with '
        "weight_decay_mode='none': pass weight_decay_mode='l2' (added to the "
        "gradient, FBGEMM's L2 mode) or 'decoupled' (w -= lr * weight_decay "
        "* w, FBGEMM's decoupled mode).")
  fused.check_impl(impl, 'rowwise_adagrad')
  l2 = weight_decay if weight_decay_mode == 'l2' else None
  parts = [_rowwise_adagrad_rule(
      eps=eps, initial_accumulator_value=initial_accumulator_value,
      accumulator_dtype=accumulator_dtype, l2_weight_decay=l2, mask=mask,
      impl=impl)]
  if weight_decay_mode == 'decoupled':
    parts.append(optax.add_decayed_weights(weight_decay, mask))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return lazy(optax.chain(*parts), impl=impl)
