"""Arithmetic on gradient trees that hold `SparseRows`.

`jax.tree.map(jnp.add, g1, g2)` or `lax.psum(grads, axis)` would reach the
row ids of a `SparseRows` (and be refused where the gradient is used). These
functions do what those meant: a dense leaf is added, scaled or reduced as
usual, while `SparseRows` leaves of one table are combined by concatenating
their rows (repeated ids mean "sum") and scaled in their values only.
"""

from __future__ import annotations

from typing import Hashable, Optional

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import optax

from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows


def _add_leaves(
    *leaves: Optional[jax.Array | SparseRows]
) -> Optional[jax.Array | SparseRows]:
  if any(leaf is None for leaf in leaves):
    if not all(leaf is None for leaf in leaves):
      raise ValueError(
          'lazy_optax.tree.add: a leaf is None in some trees only.')
    return None
  sparse = [x for x in leaves if isinstance(x, SparseRows)]
  dense = [x for x in leaves
           if x is not None and not isinstance(x, SparseRows)]
  if not dense:
    return SparseRows.concatenate(sparse)
  total = dense[0]
  for x in dense[1:]:
    total = total + x
  for part in sparse:
    total = part.add_to(total)
  return total


def add(*trees: optax.Updates) -> optax.Updates:
  """Adds gradient trees; `SparseRows` leaves are concatenated, not summed.

  The row-sparse counterpart of `optax.tree.add` for accumulating gradients
  of several microbatches or steps: dense leaves are added, the `SparseRows`
  of one table are concatenated (their dense arrays add up, since repeated
  ids mean "sum"), and a dense leaf plus a `SparseRows` is a dense leaf.
  Memory grows with the number of ids, not with the table. Start an
  accumulation from the first gradients, not from
  `jax.tree.map(jnp.zeros_like, params)`: that makes a table's gradient
  dense, which `lazy(...)` refuses for a table that `value_and_grad` gave a
  `SparseRows`.

  Args:
    *trees: gradient trees of the same structure (a leaf may be a dense array
      in one tree and a `SparseRows` in another).

  Returns:
    The tree of sums.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> g1 = {'t': lazy_optax.SparseRows(jnp.array([1, 2]), jnp.ones((2, 1)),
    ...                                  10), 'b': jnp.ones(2)}
    >>> g2 = {'t': lazy_optax.SparseRows(jnp.array([3, 4]), jnp.ones((2, 1)),
    ...                                  10), 'b': jnp.ones(2)}
    >>> total = lazy_optax.tree.add(g1, g2)
    >>> total['t'].ids, total['b']
    (Array([1, 2, 3, 4], dtype=int32), Array([2., 2.], dtype=float32))
  """
  if not trees:
    raise TypeError('lazy_optax.tree.add takes at least one tree.')
  return jax.tree.map(_add_leaves, *trees,
                      is_leaf=lambda x: x is None or is_sparse_rows(x))


def scale(tree: optax.Updates, factor: ArrayLike) -> optax.Updates:
  """Multiplies every gradient by a number; `SparseRows` in their values only.

  For averaging accumulated gradients, loss scaling (`scale(grads,
  1 / loss_scale)`) and learning-rate-like factors.

  Args:
    tree: a gradient tree.
    factor: a scalar (Python number or 0-d array).

  Returns:
    The scaled tree, with the same row ids.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> g = {'t': lazy_optax.SparseRows(jnp.array([1, 2]), jnp.ones((2, 1)), 4)}
    >>> lazy_optax.tree.scale(g, 0.5)['t'].values[:, 0]
    Array([0.5, 0.5], dtype=float32)
  """
  if jnp.ndim(factor) != 0:
    raise ValueError(
        'lazy_optax.tree.scale: factor must be a scalar, got shape '
        f'{jnp.shape(factor)}.')

  return jax.tree.map(lambda x: None if x is None else x * factor, tree,
                      is_leaf=lambda x: x is None or is_sparse_rows(x))


def _gather_rows(x: SparseRows, axis_name: Hashable,
                 divide: bool) -> SparseRows:
  # Every device writes its rows into its own block of a zero buffer and the
  # buffers are summed: the result is the all-gather of the rows, replicated
  # (so `shard_map` can return it with `out_specs=P()`), and adding zeros
  # leaves the id code exact.
  x.check('a SparseRows gradient combined across devices')
  size = jax.lax.psum(1, axis_name)
  start = jax.lax.axis_index(axis_name) * x.num_ids

  def gathered(leaf):
    buffer = jnp.zeros((size * x.num_ids,) + leaf.shape[1:], leaf.dtype)
    return jax.lax.psum(
        jax.lax.dynamic_update_slice_in_dim(buffer, leaf, start, 0),
        axis_name)

  if x.has_trusted_ids:
    out = SparseRows.from_unique(gathered(x.ids), gathered(x.values),
                                 x.num_rows)
  else:
    # Ids read from a code: gather the code itself (its leaves), so that
    # damage it carries stays visible where the result is consumed.
    out = jax.tree.map(gathered, x)
  return out / size if divide else out


def _reduce(tree: optax.Updates, axis_name: Hashable,
            mean: bool) -> optax.Updates:
  def one(x):
    if x is None:
      return None
    if isinstance(x, SparseRows):
      return _gather_rows(x, axis_name, divide=mean)
    return (jax.lax.pmean if mean else jax.lax.psum)(x, axis_name)

  return jax.tree.map(one, tree,
                      is_leaf=lambda x: x is None or is_sparse_rows(x))


def psum(tree: optax.Updates, axis_name: Hashable) -> optax.Updates:
  """`lax.psum` of a gradient tree over a named axis, `SparseRows` included.

  For data parallelism inside `jax.shard_map` or `jax.pmap`: dense leaves are
  summed with `lax.psum`; each `SparseRows` is gathered from every device
  (ids and values), so the result holds all devices' rows,
  which sum where ids repeat. The traffic is batch-sized, never table-sized.

  Args:
    tree: a gradient tree, inside a function mapped over `axis_name`.
    axis_name: the named axis (or tuple of axes) to reduce over.

  Returns:
    The reduced tree; a `SparseRows` holds `axis size x N` rows.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> def per_device(ids):
    ...   g = lazy_optax.SparseRows(ids, jnp.ones((1, 1)), 4)
    ...   return lazy_optax.tree.psum(g, 'd').to_dense()[:, 0]
    >>> jax.vmap(per_device, axis_name='d')(jnp.array([[1], [3]]))[0]
    Array([0., 1., 0., 1.], dtype=float32)
  """
  return _reduce(tree, axis_name, mean=False)


def pmean(tree: optax.Updates, axis_name: Hashable) -> optax.Updates:
  """`lax.pmean` of a gradient tree over a named axis, `SparseRows` included.

  Like `psum`, with every value divided by the axis size: dense leaves
  through `lax.pmean`, `SparseRows` values after gathering. The ids are never
  divided.

  Args:
    tree: a gradient tree, inside a function mapped over `axis_name`.
    axis_name: the named axis (or tuple of axes) to average over.

  Returns:
    The averaged tree.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> def per_device(ids):
    ...   g = lazy_optax.SparseRows(ids, jnp.ones((1, 1)), 4)
    ...   return lazy_optax.tree.pmean(g, 'd').to_dense()[:, 0]
    >>> jax.vmap(per_device, axis_name='d')(jnp.array([[1], [1]]))[0]
    Array([0., 1., 0., 0.], dtype=float32)
  """
  return _reduce(tree, axis_name, mean=True)
