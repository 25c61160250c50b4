"""The row-sparse gradient type `SparseRows`."""

from __future__ import annotations

from typing import overload, Sequence
import warnings

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from lazy_optax._src import damage
from lazy_optax._src import distinct as _distinct
from lazy_optax._src import id_code
from lazy_optax._src import row_ops
from lazy_optax._src import validate
from lazy_optax._src.distinct import distinct_rows  # noqa: F401  (lazy.py)
from lazy_optax._src.id_code import index_dtype


@jax.tree_util.register_pytree_with_keys_class
class SparseRows(metaclass=validate.SparseRowsClass):
  """A row-sparse gradient or update of a `[num_rows, *row_shape]` array.

  Row `ids[i]` of the dense array receives `values[i]` (TensorFlow's
  `IndexedSlices`). Repeated ids are summed when it is built: of its `N`
  slots, the front ones hold the distinct ids ascending, the rest id
  `num_rows` (no row) and zeros. Concrete ids must lie in `[0, num_rows)`;
  under `jax.jit` an out-of-range id touches no row. It does its work with
  XLA's ops: what moves a table's rows in C++ is `lazy(...)`'s decision,
  made where it updates the table (docs/design.md).

  Its pytree leaves are an *id code* (`id_code.py`) and the values: scaling
  keeps the code, other tree arithmetic (`jax.tree.map(jnp.add, g1, g2)`)
  damages it and stops the step that consumes it (docs/semantics.md).
  Combine gradients with `g1 + g2` or `lazy_optax.tree.add`, across devices
  with `lazy_optax.tree.psum`.

  Args:
    ids: integer array of shape `[N]`, the row ids (duplicates allowed).
    values: array of shape `[N, *row_shape]`, one row per id.
    num_rows: static Python int, the row count of the dense array.
    impl: deprecated, no effect (it chose the C++ deduplication here, and
      for the step through the gradient's tree structure; `lazy(...,
      impl=)` decides the tables'). Goes in lazy_optax 0.3.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax import SparseRows
    >>> g = SparseRows(jnp.array([2, 0, 2]), jnp.ones((3, 4)), num_rows=5)
    >>> g.ids, g.values[:, 0]    # duplicates summed, N slots kept
    (Array([0, 2, 5], dtype=int32), Array([1., 2., 0.], dtype=float32))
    >>> (g + g).to_dense()[2]    # rows concatenated, then summed
    Array([4., 4., 4., 4.], dtype=float32)
    >>> (0.5 * g).to_dense()[2]
    Array([1., 1., 1., 1.], dtype=float32)
  """

  __slots__ = ('_ids', 'values', 'num_rows')
  _ids: id_code.RowIds
  values: jax.Array
  num_rows: int

  __array_ufunc__ = None  # numpy defers `ndarray + SparseRows` to __radd__

  @overload
  def __init__(self, ids: ArrayLike, values: ArrayLike, num_rows: int, *,
               impl: str = 'auto') -> None: ...

  @overload  # `indices`: the deprecated name of `ids`
  def __init__(self, *, values: ArrayLike, num_rows: int, indices: ArrayLike,
               impl: str = 'auto') -> None: ...

  # `validate.MISSING` marks an argument not given: `validate` checks them.
  def __init__(self, ids: object = validate.MISSING,
               values: object = validate.MISSING,
               num_rows: object = validate.MISSING, *,
               indices: object = validate.MISSING, impl: str = 'auto'):
    checked, rows, size = validate.sparse_rows_arguments(
        ids, values, num_rows, indices, impl)
    kept, summed = _distinct.from_ids(checked.astype(index_dtype(size)), rows,
                                      size)
    self._fill(id_code.RowIds(given=kept), summed, size)

  def _fill(self, ids: id_code.RowIds, values: jax.Array,
            num_rows: int) -> None:
    for name, value in zip(self.__slots__, (ids, values, num_rows)):
      object.__setattr__(self, name, value)

  @classmethod
  def _made(cls, ids: id_code.RowIds, values: jax.Array,
            num_rows: int) -> SparseRows:
    obj = object.__new__(cls)
    obj._fill(ids, values, num_rows)
    return obj

  def _with_values(self, values: jax.Array) -> SparseRows:
    return self._made(self._ids, values, self.num_rows)

  @classmethod
  def from_unique(cls, ids: jax.Array, values: jax.Array, num_rows: int, *,
                  distinct: bool = False,
                  impl: str = 'auto') -> SparseRows:
    """A `SparseRows` of the library's own: no range checks (ids may hold
    `num_rows`, no row); repeated ids are summed, unless `distinct`.

    Args:
      ids: integer vector `[N]`.
      values: `[N, *row_shape]`.
      num_rows: the row count of the dense array.
      distinct: whether `(ids, values)` are a deduplication's output (no row
        id twice, zeros in the slots that name no row).
      impl: deprecated, no effect (see `SparseRows`).

    Returns:
      A `SparseRows`.
    """
    validate.ignored_impl(impl, 'SparseRows.from_unique',
                          validate.GRADIENT_MOVES, stacklevel=3)
    num_rows = int(num_rows)
    ids = jnp.asarray(ids).astype(index_dtype(num_rows))
    if not distinct:
      ids, values = _distinct.from_ids(ids, values, num_rows)
    return cls._made(id_code.RowIds(given=ids), values, num_rows)

  @classmethod
  def concatenate(cls, parts: Sequence[SparseRows]) -> SparseRows:
    """The sum of `SparseRows` of one table: their rows, in one `SparseRows`.

    Args:
      parts: `SparseRows` with the same `num_rows` and row shape.

    Returns:
      A `SparseRows` of as many slots as the parts hold together, values in
      their common dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from lazy_optax import SparseRows
      >>> a = SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)
      >>> b = SparseRows(jnp.array([3, 1]), jnp.ones((2, 2)), 4)
      >>> SparseRows.concatenate([a, b]).to_dense()[1]
      Array([2., 2.], dtype=float32)
    """
    parts = list(parts)
    validate.parts_of_one_table(
        [p.shape if isinstance(p, SparseRows) else None for p in parts])
    first = parts[0]
    dtype = jnp.result_type(*(p.values.dtype for p in parts))
    values = jnp.concatenate([p.values.astype(dtype) for p in parts])
    if all(p.has_trusted_ids for p in parts):
      return cls.from_unique(jnp.concatenate([p.ids for p in parts]), values,
                             first.num_rows)
    code, values = _distinct.from_code(
        jnp.concatenate([p.code for p in parts]), values, first.num_rows)
    return cls._made(id_code.RowIds(leaf=code), values, first.num_rows)

  has_trusted_ids = property(
      lambda self: self._ids.given is not None,
      doc='Whether the ids were given (by the library), not read from a code.')

  @property
  def impl(self) -> str:
    """Deprecated: `'xla'`, how its rows move (goes in lazy_optax 0.3)."""
    warnings.warn('SparseRows.impl is deprecated: a SparseRows moves its rows '
                  "with XLA's ops ('xla'); lazy(..., impl=) decides the "
                  "tables'. It goes in lazy_optax 0.3.", DeprecationWarning,
                  stacklevel=2)
    return 'xla'

  code = property(
      lambda self: self._ids.code(),
      doc='The id code `[N, C]` (float32): the form the ids take as a leaf.')
  ids = property(
      lambda self: self.decoded().ids,
      doc='The row ids `[N]` (read back from the id code if it was rebuilt).')
  indices = property(
      lambda self: self.ids,
      doc="Alias of `ids` (TensorFlow's `IndexedSlices` name); kept for 0.1.")

  def decoded(self) -> id_code.Decoded:
    """The ids, and per entry whether it is intact and whether it is empty."""
    return self._ids.decoded(self.num_rows)

  def __setattr__(self, name: str, value: object) -> None:
    raise AttributeError(
        f'SparseRows is immutable: build a new one instead of setting {name}.')

  # -- pytree protocol: leaves (code, values), aux num_rows ----------------
  # Everything it carries is a leaf or aux data, compared as it is; nothing
  # in it says how a step will move its rows (`lazy(...)` decides that).
  def tree_flatten_with_keys(self):
    keys = map(jax.tree_util.GetAttrKey, ('code', 'values'))
    return tuple(zip(keys, (self.code, self.values))), self.num_rows

  def tree_flatten(self):
    return (self.code, self.values), self.num_rows

  @classmethod
  def tree_unflatten(cls, aux, children):
    # No validation: JAX rebuilds pytrees with arbitrary leaves.
    return cls._made(id_code.RowIds(leaf=children[0]), children[1], aux)

  num_ids = property(lambda self: int(self.values.shape[0]),
                     doc='How many slots (id, row) this holds: `N`.')
  row_shape = property(lambda self: tuple(self.values.shape[1:]))
  shape = property(lambda self: (self.num_rows, *self.row_shape),
                   doc='Shape of the dense array this stands for.')
  dtype = property(lambda self: self.values.dtype)
  ndim = property(lambda self: 1 + len(self.row_shape))

  def __repr__(self) -> str:
    return (f'SparseRows(num_rows={self.num_rows}, ids={self.num_ids},'
            f' row_shape={self.row_shape}, dtype={self.dtype})')

  # -- integrity of the ids (id_code owns the rules) -----------------------
  def check(self, where: str = 'a SparseRows') -> None:
    """Raises on what tree arithmetic did to the ids, where visible now
    (values summed across devices, a cast or damaged concrete code).

    Args:
      where: what this gradient is, for messages (`'parameter emb/table'`).
    """
    self._ids.check(self.values, self.num_rows, where)

  def safe_ids(self, where: str = 'a SparseRows', *,
               report: bool = True) -> jax.Array:
    """The ids `[N]`, each that must touch no row set to `num_rows`.

    Args:
      where: what this gradient is, for the message.
      report: whether damage seen under a trace stops the step when it runs
        (the checked mode, which reports it itself, passes False).

    Returns:
      An integer array `[N]`.
    """
    return self._ids.safe_ids(self.values, self.num_rows, where, report)

  def to_dense(self) -> jax.Array:
    """The dense array of shape `self.shape` and dtype `self.dtype`.

    Returns:
      The sum of the rows, as a dense array.
    """
    self.check()
    dense = jnp.zeros(self.shape, self.dtype)
    return dense.at[self.safe_ids()].add(self.values, mode='drop')

  def add_to(self, array: ArrayLike,
             where: str = 'a SparseRows') -> jax.Array:
    """`array` (of `self.shape`) with the rows added, in its dtype.

    Args:
      array: dense array of shape `self.shape`; its other rows stay.
      where: what this update is, for messages.

    Returns:
      An array like `array`.
    """
    array = jnp.asarray(array)
    self.check(where)
    validate.same_shape(tuple(array.shape), self.shape, where)
    ids, seen = damage.gate(self.safe_ids(where), self.num_rows)
    added = row_ops.add(array, ids, self.values.astype(array.dtype))
    return damage.note(added, array, seen)

  def astype(self, dtype: DTypeLike) -> SparseRows:
    """The same rows with values cast to `dtype` (the ids unchanged)."""
    return self._with_values(self.values.astype(dtype))

  def _scaled(self, factor: ArrayLike | SparseRows,
              divide: bool = False) -> SparseRows:
    if isinstance(factor, SparseRows) or jnp.ndim(factor) != 0:
      return NotImplemented
    return self._with_values(self.values / factor if divide
                             else self.values * factor)

  __mul__ = __rmul__ = _scaled

  def __truediv__(self, divisor):
    return self._scaled(divisor, divide=True)

  def __neg__(self):
    return self._with_values(-self.values)

  def __add__(self, other):
    if isinstance(other, SparseRows):
      return SparseRows.concatenate([self, other])
    return self.add_to(other)

  __radd__ = add_to


def is_sparse_rows(x: object) -> bool:
  """Whether `x` is a `SparseRows` (use as `is_leaf` in `jax.tree.map`)."""
  return isinstance(x, SparseRows)
