"""The row-sparse gradient type `SparseRows` and its deduplication."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import sharding as _sharding


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _index_dtype(num_rows: int):
  """int32, unless the table has more rows than int32 can address."""
  if num_rows < np.iinfo(np.int32).max:
    return jnp.int32
  if not jax.config.jax_enable_x64:
    raise ValueError(
        f'num_rows={num_rows} needs 64-bit indices: enable jax_enable_x64.')
  return jnp.int64


@jax.tree_util.register_pytree_node_class
class SparseRows:
  """A row-sparse gradient or update of a `[num_rows, *row_shape]` array.

  Row `indices[i]` of the dense array receives `values[i]`; repeated indices
  mean "sum". This is the JAX counterpart of TensorFlow's `IndexedSlices` and
  of a PyTorch sparse gradient from `nn.Embedding(sparse=True)`.

  Construction checks what it can see: `indices` must be an integer vector,
  `values` must have one row per index, and, when the indices are concrete
  (not traced by `jax.jit`), every id must lie in `[0, num_rows)`. Under
  `jax.jit` an out-of-range id (a negative one included) touches no row.

  Args:
    indices: integer array of shape `[N]`, the row ids (duplicates allowed).
    values: array of shape `[N, *row_shape]`, one row per id.
    num_rows: static Python int, the row count of the dense array.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax import SparseRows
    >>> g = SparseRows(jnp.array([2, 0, 2]), jnp.ones((3, 4)), num_rows=5)
    >>> g.to_dense()[2]
    Array([2., 2., 2., 2.], dtype=float32)
  """

  # Let numpy arrays defer `ndarray + SparseRows` to `SparseRows.__radd__`.
  __array_ufunc__ = None

  def __init__(self, indices: Any, values: Any, num_rows: int):
    if isinstance(num_rows, bool) or not isinstance(
        num_rows, (int, np.integer)):
      raise TypeError(
          f'SparseRows: num_rows must be a static Python int, got {num_rows!r}.')
    num_rows = int(num_rows)
    if num_rows < 0:
      raise ValueError(f'SparseRows: num_rows must be >= 0, got {num_rows}.')
    indices = indices if _is_tracer(indices) else jnp.asarray(indices)
    values = values if _is_tracer(values) else jnp.asarray(values)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
      raise TypeError(
          'SparseRows: indices must have an integer dtype, got '
          f'{indices.dtype}.')
    if indices.ndim != 1:
      raise ValueError(
          'SparseRows: indices must be a vector of shape [N], got shape '
          f'{indices.shape}.')
    if values.ndim < 1 or values.shape[0] != indices.shape[0]:
      raise ValueError(
          'SparseRows: values must have one row per index: indices has shape '
          f'{indices.shape}, values has shape {values.shape}.')
    if not _is_tracer(indices) and indices.size:
      host = np.asarray(indices)
      bad = np.flatnonzero((host < 0) | (host >= num_rows))
      if bad.size:
        raise ValueError(
            f'SparseRows: id {int(host[bad[0]])} at position {int(bad[0])} is '
            f'out of range for a table of {num_rows} rows ({bad.size} ids '
            'out of range in all).')
    self.indices = indices.astype(_index_dtype(num_rows))
    self.values = values
    self.num_rows = num_rows

  # -- pytree protocol ------------------------------------------------------
  def tree_flatten(self):
    return (self.indices, self.values), self.num_rows

  @classmethod
  def tree_unflatten(cls, num_rows, children):
    # No validation here: JAX rebuilds pytrees with arbitrary leaves
    # (tracers, shape structs, None, sentinels) while transforming them.
    obj = object.__new__(cls)
    obj.indices, obj.values = children
    obj.num_rows = num_rows
    return obj

  # -- array-like description -----------------------------------------------
  @property
  def row_shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape[1:])

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the dense array this stands for."""
    return (self.num_rows, *self.row_shape)

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def ndim(self) -> int:
    return 1 + len(self.row_shape)

  def __repr__(self) -> str:
    return (f'SparseRows(num_rows={self.num_rows}, ids={self.indices.shape[0]},'
            f' row_shape={self.row_shape}, dtype={self.dtype})')

  # -- conversions and arithmetic -------------------------------------------
  def safe_indices(self) -> jax.Array:
    """Ids with every out-of-range id (negative ones too) set to `num_rows`.

    JAX wraps negative indices like numpy before any scatter `mode` applies,
    so they are moved past the end, where `mode="drop"` discards them.
    """
    ids = self.indices
    valid = (ids >= 0) & (ids < self.num_rows)
    return jnp.where(valid, ids, jnp.asarray(self.num_rows, ids.dtype))

  def to_dense(self) -> jax.Array:
    """The dense `[num_rows, *row_shape]` array (duplicates summed).

    Returns:
      A dense array of shape `self.shape` and dtype `self.dtype`.
    """
    dense = jnp.zeros(self.shape, self.dtype)
    return dense.at[self.safe_indices()].add(self.values, mode='drop')

  def add_to(self, array: jax.Array) -> jax.Array:
    """Scatter-adds the rows onto `array` (its other rows are not touched).

    Args:
      array: dense array of shape `self.shape`.

    Returns:
      `array` with `values` added to rows `indices`, in `array`'s dtype.
    """
    array = jnp.asarray(array)
    if not jnp.issubdtype(self.indices.dtype, jnp.integer):
      raise TypeError(
          f'This SparseRows has indices of dtype {self.indices.dtype}: a plain '
          'optax transformation placed after a lazy one treated the ids as '
          'numbers. Put the whole chain inside lazy_optax.lazy(...).')
    if tuple(array.shape) != self.shape:
      raise ValueError(
          f'SparseRows of dense shape {self.shape} cannot be added to an '
          f'array of shape {tuple(array.shape)}.')
    values = self.values.astype(array.dtype)
    return array.at[self.safe_indices()].add(
        values, mode='drop', **_sharding.scatter_kwargs(array))

  @classmethod
  def from_unique(cls, ids: jax.Array, values: jax.Array,
                  num_rows: int) -> 'SparseRows':
    """Builds a `SparseRows` without checks (ids may hold `num_rows` slots).

    For the library's own outputs, whose unused slots point one past the
    last row on purpose.
    """
    return cls.tree_unflatten(int(num_rows), (ids, values))

  def __radd__(self, other):
    return self.add_to(other)

  def __add__(self, other):
    if isinstance(other, SparseRows):
      return NotImplemented
    return self.add_to(other)


def is_sparse_rows(x: Any) -> bool:
  """Whether `x` is a `SparseRows` (use as `is_leaf` in `jax.tree.map`)."""
  return isinstance(x, SparseRows)


class UniqueRows(NamedTuple):
  """Deduplicated rows: `ids[k]` unique or `num_rows` (an unused slot)."""
  ids: jax.Array
  values: jax.Array


def deduplicate(grad: SparseRows) -> UniqueRows:
  """Sums the values of repeated ids into one slot per distinct id.

  The result keeps static shapes: as many slots as there were ids. Slots left
  over hold id `num_rows` (one past the last row) and zero values, so that a
  scatter with `mode="drop"` ignores them; out-of-range ids land there too.

  Args:
    grad: a `SparseRows`.

  Returns:
    A `UniqueRows` with `ids` of shape `[N]` and `values` of shape
    `[N, *row_shape]`.
  """
  # Under an Explicit mesh the global batch is gathered first (see sharding).
  ids = _sharding.replicate_if_explicit(grad.safe_indices())
  n = ids.shape[0]
  if n == 0:
    return UniqueRows(ids, grad.values)
  # Sort the ids alone (on CPU a one-operand sort is several times faster
  # than sorting positions along, as argsort does); slot k of the result
  # stands for the run of equal ids that starts at k in the sorted ids, and
  # each id finds its run's first slot by binary search.
  sorted_ids = jnp.sort(ids)
  starts = jnp.concatenate(
      [jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
  fill = jnp.asarray(grad.num_rows, ids.dtype)
  unique_ids = jnp.where(starts, sorted_ids, fill)
  slot = jnp.searchsorted(sorted_ids, ids, side='left', method='scan')
  raw = _sharding.replicate_if_explicit(grad.values)
  # Sum bfloat16/float16 duplicates in float32 and round once at the end:
  # a hot id repeated hundreds of times would lose most of its gradient to
  # rounding in a 16-bit running sum.
  wide = (jnp.float32 if jnp.issubdtype(raw.dtype, jnp.floating)
          and jnp.finfo(raw.dtype).bits < 32 else raw.dtype)
  values = jax.ops.segment_sum(
      raw.astype(wide), slot, num_segments=n).astype(raw.dtype)
  # Values of out-of-range ids summed into the sentinel's slot: zero them.
  keep = (unique_ids < grad.num_rows).reshape((n,) + (1,) * (values.ndim - 1))
  values = jnp.where(keep, values, jnp.zeros_like(values))
  return UniqueRows(unique_ids, values)
