"""CowClip: each id's gradient row clipped by its count and its weight norm.

The rule of Zheng et al., "CowClip: Reducing CTR Prediction Model Training
Time from 12 hours to 10 minutes on 1 GPU" (AAAI 2023), and of its
reference code (bytedance/LargeBatchCTR, `clip.py`): for every row `r` of an
embedding table that the batch touches, with `g_r` its gradient (the
occurrences of id `r` summed) and `c_r` the number of occurrences,

    t_r = c_r * max(coef * ||w_r||, lower_bound)
    g_r <- g_r * min(1, t_r / ||g_r||)

An id seen often may move further, but never by more than `coef` times its
own norm per occurrence; this is what keeps Adam stable on CTR models at
batch sizes of 10^5. The clip equals `c_r` times the per-occurrence mean
gradient `g_r / c_r` clipped to `max(coef * ||w_r||, lower_bound)`, which is
how it is computed (the row's arithmetic then needs no count).

The counts are gone from a `SparseRows` gradient (it sums repeated ids when
it is built), so they come beside it, through optax's extra arguments:
`tx.update(grads, state, params, counts=counts)`, with `counts` a tree like
the gradients holding `id_counts(ids, num_rows)` (a `SparseRows` of ones
over the same batch ids: it sums to the same distinct ids) for each table
and None for leaves not to clip. Inside `lazy(...)` the counts must name
the gradient's ids, which is checked: at trace time their number, when the
step runs their values. The state is empty (0 bytes per row).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazy_optax._src import fused
from lazy_optax._src import row_context
from lazy_optax._src import validate
from lazy_optax._src.distinct import distinct_rows
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import row_norms
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows


class CowClipHyper(NamedTuple):
  """CowClip's hyperparameters, as `step` reads them."""
  coef: jax.typing.ArrayLike
  lower_bound: jax.typing.ArrayLike


def _rule() -> fused.RowRule:
  """CowClip of the per-occurrence gradient, as a `RowRule` without state."""

  def step(g, params, hyper: CowClipHyper):
    dtype = compute_dtype(g.dtype)
    g = g.astype(dtype)
    w_norm = row_norms(jnp.asarray(params).astype(dtype))
    t = jnp.maximum(jnp.asarray(hyper.coef, dtype) * w_norm,
                    jnp.asarray(hyper.lower_bound, dtype))
    norm = row_norms(g)
    over = norm > t
    scale = jnp.where(over, t / jnp.where(over, norm, 1), 1)
    return g * broadcast_rows(scale, g)

  return fused.stateless_rule('cowclip', step)


def id_counts(ids: jax.typing.ArrayLike, num_rows: int) -> SparseRows:
  """The number of occurrences of each id: the `counts` that CowClip reads.

  Args:
    ids: the batch's ids for one table, any shape (every id a lookup read,
      in any order; the ids `value_and_grad` saw for the table).
    num_rows: the table's row count.

  Returns:
    A `SparseRows` of ones over `ids` (it sums to the count of each id);
    ids outside `[0, num_rows)` (padding) count nowhere.

  Example:
    >>> import jax.numpy as jnp, lazy_optax
    >>> counts = lazy_optax.id_counts(jnp.array([[3, 1], [3, 3]]), 5)
    >>> counts.to_dense()
    Array([0., 1., 0., 3., 0.], dtype=float32)
  """
  ids = jnp.asarray(ids).reshape(-1)
  # Like `value_and_grad`'s gradients, ids outside the table (padding) are
  # kept and name no row.
  named = (ids >= 0) & (ids < num_rows)
  return SparseRows.from_unique(ids, named.astype(jnp.float32), num_rows)


def _report_mismatch(differ: np.ndarray, wheres: tuple[str, ...]) -> np.ndarray:
  differ = np.asarray(differ).reshape(-1, len(wheres)).sum(axis=0)
  if differ.any():
    named = ', '.join(f'{w} ({int(n)} slots differ)'
                      for w, n in zip(wheres, differ) if n)
    raise ValueError(
        f'cowclip: counts for {named} name other ids than its gradient: '
        'build them with lazy_optax.id_counts from the same batch ids the '
        'loss looked up.')
  return np.zeros((), np.int32)


def _check_same_ids(differ: list[jax.Array],
                    wheres: tuple[str, ...]) -> jax.Array:
  """An int32 zero; when the step runs, raises if any table's counts name
  other ids than its gradient (one check for the whole update)."""
  per_table = jnp.stack(differ)

  def report(n):
    return jax.pure_callback(
        lambda m: _report_mismatch(m, wheres),
        jax.ShapeDtypeStruct((), jnp.int32), n, vmap_method='expand_dims')

  return jax.lax.cond(jnp.sum(per_table) == 0,
                      lambda n: jnp.zeros((), jnp.int32), report, per_table)


def _first_entry(values: jax.Array) -> jax.Array:
  """One number per row: `[N]` as it is, `[N, 1, ...]` its first entry."""
  return values[(slice(None),) + (0,) * (values.ndim - 1)]


class _Counts(NamedTuple):
  """A leaf's counts, one number per row of its gradient, and (inside
  `lazy`) how many of their slots name other ids than the gradient's."""
  per_row: jax.Array
  differ: Optional[jax.Array]


def _row_counts(counts: SparseRows, g: jax.Array, where: str,
                table: Optional[row_context.TableIds]) -> _Counts:
  """`counts` as one number per row of `g` (lazy's row block or dense)."""
  num_rows = table.num_rows if table is not None else jnp.shape(g)[0]
  if counts.num_rows != num_rows:
    raise ValueError(f'cowclip: counts for {where} say num_rows='
                     f'{counts.num_rows}, the parameter has {num_rows} rows.')
  if table is None:
    return _Counts(_first_entry(counts.to_dense()), None)
  count_ids, values = distinct_rows(counts, f'the counts for {where}')
  if count_ids.shape != table.ids.shape:
    raise ValueError(
        f'cowclip: counts for {where} hold {count_ids.shape[0]} ids, its '
        f'gradient {table.ids.shape[0]}: build them with lazy_optax.id_counts '
        'from the same batch ids the loss looked up.')
  ids = table.ids  # count the slots where it and its counts differ
  named = ((ids >= 0) & (ids < num_rows)) | (
      (count_ids >= 0) & (count_ids < num_rows))
  return _Counts(_first_entry(values),
                 jnp.sum((ids != count_ids) & named).astype(jnp.int32))


def _leaf_counts(g: jax.Array, c: Optional[SparseRows], where: str,
                 table: Optional[row_context.TableIds]) -> Optional[_Counts]:
  """The checked counts of one leaf, or None for a leaf not to clip."""
  if c is None:
    return None
  if not isinstance(c, SparseRows):
    raise TypeError(f'cowclip: counts for {where} must be a '
                    f'SparseRows (lazy_optax.id_counts) or None, got '
                    f'{type(c).__name__}.')
  if isinstance(g, SparseRows):
    raise ValueError(f'cowclip: the gradient of {where} is a '
                     'SparseRows: use cowclip inside lazy(...).')
  return _row_counts(c, g, where, table)


def _clip_leaf(rule: fused.RowRule, g: jax.Array, p: jax.Array,
               count: jax.Array, hyper: CowClipHyper) -> jax.Array:
  """The clipped gradient rows `g`, `count` occurrences each."""
  per_occurrence = g / broadcast_rows(jnp.maximum(count, 1), g).astype(
      g.dtype)
  u = fused.apply_stateless(rule, per_occurrence, p, hyper)
  return u * broadcast_rows(count, u).astype(u.dtype)


def _clip_tree(rule: fused.RowRule, updates: optax.Updates,
               params: optax.Params, counts: optax.Updates,
               hyper: CowClipHyper,
               rows: Optional[row_context.Rows]) -> optax.Updates:
  """Every leaf with counts clipped, after one check of all their ids."""
  flat, treedef_ = jax.tree_util.tree_flatten_with_path(
      updates, is_leaf=is_sparse_rows)
  treedef: Any = treedef_  # jaxlib's PyTreeDef is untyped for mypy
  try:
    p_leaves = treedef.flatten_up_to(params)
    c_leaves = treedef.flatten_up_to(counts)
    t_leaves = (treedef.flatten_up_to(rows.ids)
                if rows is not None and rows.ids is not None
                else [None] * len(p_leaves))
  except (ValueError, TypeError) as e:
    raise ValueError('cowclip: params and counts must have the structure '
                     f'of the gradients ({e}).') from e
  wheres = [f'parameter {jax.tree_util.keystr(path)}' for path, _ in flat]
  leaf_counts = [_leaf_counts(g, c, where, t)
                 for (_, g), c, t, where in zip(flat, c_leaves, t_leaves,
                                                wheres)]
  checked = [(k, lc.differ) for k, lc in enumerate(leaf_counts)
             if lc is not None and lc.differ is not None]
  zero = (_check_same_ids([d for _, d in checked],
                          tuple(wheres[k] for k, _ in checked))
          if checked else 0)
  out = [g if lc is None else
         _clip_leaf(rule, g, p, lc.per_row + zero, hyper)
         for (_, g), p, lc in zip(flat, p_leaves, leaf_counts)]
  return treedef.unflatten(out)


def cowclip(
    coef: float = 1.0,
    lower_bound: float = 1e-5,
    *,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """CowClip: clips each touched row's gradient by its count and weight norm.

  Row `r`'s gradient is clipped to norm `c_r * max(coef * ||w_r||,
  lower_bound)`, `c_r` the occurrences of id `r` in the batch (see the
  module docstring). Place it first, inside `lazy(...)`, before any
  optimizer: `lazy(optax.chain(cowclip(), scale_by_lazy_adam(),
  optax.scale_by_learning_rate(lr)))`, or use `lazy_adam_cowclip`. Inside
  `lazy` it reads only the batch's rows of the parameters, and XLA
  computes the clip on them.

  Args:
    coef: the ratio `r` of the paper: how far a row may move, per
      occurrence, relative to its norm.
    lower_bound: the paper's `zeta`: the smallest clip norm per occurrence
      (rows near zero, fresh ones, still learn).
    impl: deprecated, no effect (XLA computes the clip on the rows; the
      tables' implementation is `lazy(..., impl=)`'s).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update` takes
    `params` and `counts=`: a tree like the gradients with
    `id_counts(ids, num_rows)` for each table to clip and None elsewhere
    (those leaves pass unchanged). State: `optax.EmptyState()`.

  Example:
    >>> import jax.numpy as jnp, optax, lazy_optax
    >>> params = {'table': jnp.ones((5, 2))}
    >>> ids = jnp.array([1, 1, 2])
    >>> grads = {'table': lazy_optax.SparseRows(ids, jnp.full((3, 2), 9.),
    ...                                         5)}
    >>> tx = lazy_optax.lazy(lazy_optax.cowclip(coef=0.5))
    >>> u, _ = tx.update(grads, tx.init(params), params,
    ...                  counts={'table': lazy_optax.id_counts(ids, 5)})
    >>> u['table'].to_dense()[1:3].round(4)  # both rows clipped
    Array([[1. , 1. ],
           [0.5, 0.5]], dtype=float32)
  """
  validate.hyperparameters('cowclip',
                           non_negative=dict(coef=coef,
                                             lower_bound=lower_bound))
  fused.unused_impl(impl, 'cowclip')
  rule = _rule()
  hyper = CowClipHyper(coef=coef, lower_bound=lower_bound)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, counts=None, **extra_args):
    rows = row_context.rows_of(extra_args)
    if params is None:
      raise ValueError('cowclip needs params (it reads the row norms): '
                       'call update(grads, state, params, counts=...).')
    if counts is None:
      raise ValueError(
          'cowclip needs counts=: a tree like the gradients with '
          'lazy_optax.id_counts(ids, num_rows) for each table (None for '
          'leaves not to clip), passed as update(grads, state, params, '
          'counts=counts).')
    return (_clip_tree(rule, updates, params, counts, hyper, rows),
            state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

