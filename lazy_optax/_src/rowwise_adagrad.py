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

from typing import Any, Callable, NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import validate
from lazy_optax._src.lazy import lazy
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.numerics import compute_dtype

WEIGHT_DECAY_MODES = ('none', 'l2', 'decoupled')


class ScaleByRowwiseAdagradState(NamedTuple):
  """State of `scale_by_rowwise_adagrad` / `rowwise_adagrad`."""
  count: chex.Array  # int32 scalar, the global step
  sum_of_squares: optax.Updates  # [num_rows] per parameter (scalar: scalar)


def row_shape_zeros(p: Any, dtype: Optional[Any], value: float = 0.0) -> Any:
  """A `[num_rows]` array (a scalar for a scalar `p`) filled with `value`.

  The dtype defaults to float32 (float64 for a float64 parameter): one
  number per row costs little, and a 16-bit accumulator of squares loses
  small increments.
  """
  shape = jnp.shape(p)[:1]
  if dtype is None:
    dtype = compute_dtype(jnp.asarray(p).dtype)
  return jnp.full(shape, value, dtype)


def row_mean_square(g: jax.Array) -> jax.Array:
  """Mean of `g * g` over each row: `[num_rows, ...]` -> `[num_rows]`.

  A one-dimensional `g` has one entry per row, a scalar is its own row.
  """
  if g.ndim <= 1:
    return g * g
  return jnp.mean(g * g, axis=tuple(range(1, g.ndim)))


def is_zero(x: Any) -> bool:
  """Whether `x` is a Python number equal to 0 (never true for arrays).

  Hyperparameters may arrive as arrays (`optax.inject_hyperparams`), even
  traced ones, so only Python numbers decide the structure of a rule.
  """
  return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def _mask_leaves(mask: Any, params: Any, treedef: Any) -> list[Any]:
  if mask is None:
    return [True] * treedef.num_leaves
  mask_tree = mask(params) if callable(mask) else mask
  return treedef.flatten_up_to(mask_tree)


def _rowwise_adagrad_rule(
    *,
    eps: float,
    initial_accumulator_value: float,
    accumulator_dtype: Optional[Any],
    l2_weight_decay: Any,
    mask: Optional[Union[Any, Callable[[Any], Any]]],
) -> optax.GradientTransformation:
  """The row-wise Adagrad rule on dense arrays (every row given is touched).

  `l2_weight_decay` (or None) is FBGEMM's L2 mode: added to the gradient.
  """

  def init_fn(params):
    return ScaleByRowwiseAdagradState(
        count=jnp.zeros([], jnp.int32),
        sum_of_squares=jax.tree.map(
            lambda p: row_shape_zeros(p, accumulator_dtype,
                                      initial_accumulator_value), params))

  def update_fn(updates, state, params=None):
    count = optax.safe_increment(state.count)
    treedef = jax.tree.structure(updates)
    grads = treedef.flatten_up_to(updates)
    accumulators = treedef.flatten_up_to(state.sum_of_squares)
    param_leaves = [None] * len(grads)
    decays = [False] * len(grads)
    if l2_weight_decay is not None:
      if params is None:
        raise ValueError(
            "rowwise_adagrad with weight_decay_mode='l2' adds weight_decay * "
            'params to the gradient, so it needs params: call '
            'tx.update(grads, state, params).')
      param_leaves = treedef.flatten_up_to(params)
      decays = _mask_leaves(mask, params, treedef)

    out, new_acc = [], []
    for g, acc, p, decay in zip(grads, accumulators, param_leaves, decays):
      dtype = compute_dtype(g.dtype, acc.dtype)
      gd = g.astype(dtype)
      if l2_weight_decay is not None and decay:
        gd = gd + jnp.asarray(l2_weight_decay, dtype) * (
            jnp.asarray(p).astype(dtype))
      acc_new = acc.astype(dtype) + row_mean_square(gd)
      denom = jnp.sqrt(acc_new) + jnp.asarray(eps, dtype)
      step = gd / broadcast_rows(denom, gd)
      out.append(step.astype(g.dtype))
      new_acc.append(acc_new.astype(acc.dtype))
    return treedef.unflatten(out), ScaleByRowwiseAdagradState(
        count, treedef.unflatten(new_acc))

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_rowwise_adagrad(
    eps: float = 1e-8,
    initial_accumulator_value: float = 0.0,
    accumulator_dtype: Optional[Any] = None,
) -> optax.GradientTransformationExtraArgs:
  """Rescales updates by row-wise Adagrad (no learning rate, no decay).

  Each row's gradient is divided by `sqrt(G_r) + eps`, where `G_r`
  accumulates the mean over the row of the squared gradient (FBGEMM's
  `EXACT_ROWWISE_ADAGRAD`; see the module docstring). Lazy on `SparseRows`
  gradients, dense on dense ones. Put a whole chain inside `lazy(...)` (or
  use `rowwise_adagrad`): a plain optax transformation next to it would see
  `SparseRows` updates.

  Args:
    eps: added to `sqrt(G_r)` (FBGEMM's default is 1e-8).
    initial_accumulator_value: the starting value of every `G_r` (FBGEMM
      starts at 0; `optax.adagrad` at 0.1).
    accumulator_dtype: dtype of `G` (default float32, float64 for float64
      parameters).

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
  return lazy(_rowwise_adagrad_rule(
      eps=eps, initial_accumulator_value=initial_accumulator_value,
      accumulator_dtype=accumulator_dtype, l2_weight_decay=None, mask=None))


def rowwise_adagrad(
    learning_rate: optax.ScalarOrSchedule,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mode: str = 'none',
    mask: Optional[Union[Any, Callable[[Any], Any]]] = None,
    *,
    initial_accumulator_value: float = 0.0,
    accumulator_dtype: Optional[Any] = None,
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
  l2 = weight_decay if weight_decay_mode == 'l2' else None
  parts = [_rowwise_adagrad_rule(
      eps=eps, initial_accumulator_value=initial_accumulator_value,
      accumulator_dtype=accumulator_dtype, l2_weight_decay=l2, mask=mask)]
  if weight_decay_mode == 'decoupled':
    parts.append(optax.add_decayed_weights(weight_decay, mask))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return lazy(optax.chain(*parts))
