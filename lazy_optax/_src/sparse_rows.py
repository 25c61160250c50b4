"""The row-sparse gradient type `SparseRows`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from lazy_optax._src import backend as backend_lib
from lazy_optax._src import distinct as _distinct
from lazy_optax._src import id_code
from lazy_optax._src import row_ops
from lazy_optax._src import validate

# Also read from here: (lazy, stochastic_rounding, row_reads).
from lazy_optax._src.distinct import deduplicate  # noqa: F401
from lazy_optax._src.distinct import distinct_rows  # noqa: F401
from lazy_optax._src.id_code import index_dtype

_MISSING = object()


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


class _SparseRowsType(type):
  """A class repr with a hint, for JAX's pytree structure errors to print."""

  def __repr__(cls) -> str:
    return validate.SPARSE_ROWS_CLASS_HINT


class FusedAdd(NamedTuple):
  """How an update made by `lazy(...)` adds itself to its parameter table.

  A rule whose update is a function of the parameter rows (row max-norm)
  can be applied where the rows are added, reading each row once: `add`
  gives `table + update` for the table the rows were computed from, equal
  to the scatter-add of `values`.
  """
  table: Any  # the parameter table the update was computed from
  # (table, safe ids, values, the table's row-move backend) -> new table
  add: Callable[[jax.Array, jax.Array, jax.Array,
                 Optional[backend_lib.Backend]], jax.Array]


@jax.tree_util.register_pytree_with_keys_class
class SparseRows(metaclass=_SparseRowsType):
  """A row-sparse gradient or update of a `[num_rows, *row_shape]` array.

  Row `ids[i]` of the dense array receives `values[i]` (TensorFlow's
  `IndexedSlices`, torch's sparse gradients). Repeated ids mean "sum", and
  are summed when it is built: of its `N` slots, the front ones hold the
  distinct ids ascending, the rest id `num_rows` (no row) and zeros.

  Construction checks that `ids` is an integer vector with one row of
  `values` per id, and concrete ids that they lie in `[0, num_rows)`; under
  `jax.jit` an out-of-range id (a negative one included) touches no row.

  Its pytree leaves are the values and an *id code* (`id_code.py`) that
  scaling keeps and other tree arithmetic (`jax.tree.map(jnp.add, g1, g2)`,
  `lax.psum`) damages, which stops the step that consumes it
  (docs/semantics.md). Combine gradients with `g1 + g2` or
  `lazy_optax.tree.add`, across devices with `lazy_optax.tree.psum`.

  Args:
    ids: integer array of shape `[N]`, the row ids (duplicates allowed).
    values: array of shape `[N, *row_shape]`, one row per id.
    num_rows: static Python int, the row count of the dense array.
    impl: how the repeated ids are summed: `'auto'` (the C++ kernel on one
      CPU device where the kernels are loaded, else XLA), `'xla'` or
      `'generic'` (XLA only, no C++ call; what `lazy(..., impl='xla')`
      steps build their gradients with).

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

  # Exactly one of `_ids` (distinct ids, of one built by the library) and
  # `_code` (the id code of one rebuilt from leaves by tree arithmetic, read
  # back and checked where it is consumed) is set. `_backend` is the table's
  # `Backend` of an update that `lazy(...)` made, for the scatter-add that
  # applies it (its `row_kernels` travels in the aux data: `RowMoves`).
  # `_fused` (an update that `lazy(...)` made, as it made it: scaling, tree
  # arithmetic and pytree round trips drop it) adds the update to the table
  # its rows were computed from in one pass (`FusedAdd`).
  __slots__ = ('_ids', '_code', 'values', 'num_rows', '_backend', '_fused')
  _ids: Optional[jax.Array]
  _code: Optional[jax.Array]
  values: jax.Array
  num_rows: int
  _backend: Optional[backend_lib.Backend]
  _fused: Optional['FusedAdd']

  __array_ufunc__ = None  # numpy defers `ndarray + SparseRows` to __radd__

  def __init__(self, ids: Any = _MISSING, values: Any = _MISSING,
               num_rows: Any = _MISSING, *, indices: Any = _MISSING,
               impl: str = 'auto'):
    ids = validate.ids_argument(ids, indices, values, num_rows, _MISSING)
    num_rows = validate.num_rows(num_rows)
    given, ids = ids, ids if _is_tracer(ids) else jnp.asarray(ids)  # 64 bits
    values = values if _is_tracer(values) else jnp.asarray(values)
    validate.index_vector(ids, 'SparseRows')
    validate.one_row_per_index(ids.shape[0], values, 'SparseRows')
    if not _is_tracer(ids):
      validate.indices_in_range(given, num_rows, 'SparseRows')  # before a cast
    validate.impl_argument(impl, 'SparseRows')
    ids, values = _distinct.from_ids(ids.astype(index_dtype(num_rows)), values,
                                    num_rows, impl)
    self._fill(ids, None, values, num_rows)

  def _fill(self, ids: Any, code: Any, values: Any, num_rows: int,
            backend: Optional[backend_lib.Backend] = None,
            fused: Optional['FusedAdd'] = None) -> None:
    for name, value in zip(self.__slots__,
                           (ids, code, values, num_rows, backend, fused)):
      object.__setattr__(self, name, value)

  @classmethod
  def _made(cls, *fields: Any) -> 'SparseRows':
    obj = object.__new__(cls)
    obj._fill(*fields)
    return obj

  def _with_values(self, values: Any) -> 'SparseRows':
    return self._made(self._ids, self._code, values, self.num_rows,
                      self._backend)

  def with_fused_add(self, fused: 'FusedAdd') -> 'SparseRows':
    """The same update, added to `fused.table` by `fused.add` (one pass).

    Args:
      fused: how these rows add themselves to the table they were computed
        from; `add_to` uses it for that very array, `values` elsewhere.

    Returns:
      A `SparseRows` with the same ids and values.
    """
    return self._made(self._ids, self._code, self.values, self.num_rows,
                      self._backend, fused)

  @classmethod
  def from_unique(cls, ids: jax.Array, values: jax.Array, num_rows: int, *,
                  distinct: bool = False,
                  backend: Optional[backend_lib.Backend] = None,
                  impl: str = 'auto') -> 'SparseRows':
    """A `SparseRows` of the library's own: no range checks (ids may hold
    `num_rows`, no row); repeated ids are summed, unless `distinct`.

    Args:
      ids: integer vector `[N]`.
      values: `[N, *row_shape]`.
      num_rows: the row count of the dense array.
      distinct: whether `(ids, values)` are a deduplication's output (no row
        id twice, zeros in the slots that name no row).
      backend: the table's `Backend` (an update made by `lazy(...)`): its
        scatter-add follows it.
      impl: for the deduplication when not `distinct` (see `SparseRows`).

    Returns:
      A `SparseRows`.
    """
    num_rows = int(num_rows)
    ids = jnp.asarray(ids).astype(index_dtype(num_rows))
    if not distinct:
      ids, values = _distinct.from_ids(ids, values, num_rows, impl)
    return cls._made(ids, None, values, num_rows, backend)

  @classmethod
  def concatenate(cls, parts: Sequence['SparseRows']) -> 'SparseRows':
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
    return cls._made(None, code, values, first.num_rows)

  @property
  def has_trusted_ids(self) -> bool:
    """Whether the ids were given (by the library), not read from a code."""
    return self._ids is not None

  @property
  def code(self) -> jax.Array:
    """The id code `[N, C]` (float32): the form the ids take as a leaf."""
    if self._ids is not None:
      return id_code.encode(self._ids)
    return self._code  # type: ignore[return-value]  # a placeholder leaf

  @property
  def ids(self) -> jax.Array:
    """The row ids `[N]` (read back from the id code if it was rebuilt)."""
    return self.decoded().ids

  @property
  def indices(self) -> jax.Array:
    """Alias of `ids` (TensorFlow's `IndexedSlices` name); kept for 0.1."""
    return self.ids

  def decoded(self) -> id_code.Decoded:
    """The ids, and per entry whether it is intact and whether it is empty."""
    if self._ids is not None:
      n = self._ids.shape[0]
      return id_code.Decoded(self._ids, jnp.ones((n,), bool),
                             jnp.zeros((n,), bool))
    return id_code.decode(self.code, index_dtype(self.num_rows))

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
        f'SparseRows is immutable: build a new one instead of setting {name}.')

  # -- pytree protocol: leaves (code, values) ---------------------------------
  def _aux(self) -> tuple[int, backend_lib.RowMoves]:
    return self.num_rows, backend_lib.RowMoves(
        None if self._backend is None else self._backend.row_kernels)

  def tree_flatten_with_keys(self):
    key = jax.tree_util.GetAttrKey
    return ((key('code'), self.code), (key('values'), self.values)), \
        self._aux()

  def tree_flatten(self):
    return (self.code, self.values), self._aux()

  @classmethod
  def tree_unflatten(cls, aux, children):
    # No validation: JAX rebuilds pytrees with arbitrary leaves.
    num_rows, moves = aux
    return cls._made(None, children[0], children[1], num_rows,
                     moves.backend())

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
    _distinct.check_varying(self.code if self._ids is None else self._ids,
                            self.values, where)
    if self._ids is None:
      id_code.check(self.code, self.values, self.num_rows, where)

  def safe_ids(self, where: str = 'a SparseRows', *,
               report: bool = True) -> jax.Array:
    """The ids `[N]`, each that must touch no row set to `num_rows`.

    Args:
      where: what this gradient is, for the message.
      report: whether damage seen under a trace stops the step when it runs
        (the checked mode, which reports it itself, passes False).
    """
    if self._ids is None:
      return id_code.safe_ids(self.code, self.values, self.num_rows, where,
                              report)
    keep = (self._ids >= 0) & (self._ids < self.num_rows)
    return jnp.where(keep, self._ids,
                     jnp.asarray(self.num_rows, self._ids.dtype))

  def to_dense(self) -> jax.Array:
    """The dense array of shape `self.shape` and dtype `self.dtype`."""
    self.check()
    dense = jnp.zeros(self.shape, self.dtype)
    return dense.at[self.safe_ids()].add(self.values, mode='drop')

  def add_to(self, array: Any, where: str = 'a SparseRows') -> jax.Array:
    """`array` (of `self.shape`) with the rows added, in its dtype.

    Args:
      array: dense array of shape `self.shape`; its other rows stay.
      where: what this update is, for messages.
    """
    array = jnp.asarray(array)
    self.check(where)
    validate.same_shape(tuple(array.shape), self.shape, where)
    ids = self.safe_ids(where)
    if self._fused is not None and array is self._fused.table:
      return self._fused.add(array, ids, self.values, self._backend)
    return row_ops.add(array, ids, self.values.astype(array.dtype),
                       self._backend)

  def astype(self, dtype: Any) -> 'SparseRows':
    """The same rows with values cast to `dtype` (the ids unchanged)."""
    return self._with_values(self.values.astype(dtype))

  def _scaled(self, factor: Any, divide: bool = False) -> Any:
    if isinstance(factor, SparseRows) or jnp.ndim(factor) != 0:
      return NotImplemented
    return self._with_values(self.values / factor if divide
                             else self.values * factor)

  __mul__ = __rmul__ = _scaled

  def __truediv__(self, divisor):
    return self._scaled(divisor, divide=True)

  def __neg__(self):
    return self._with_values(-self.values)

  def __radd__(self, other):
    return self.add_to(other)

  def __add__(self, other):
    if isinstance(other, SparseRows):
      return SparseRows.concatenate([self, other])
    return self.add_to(other)


def is_sparse_rows(x: Any) -> bool:
  """Whether `x` is a `SparseRows` (use as `is_leaf` in `jax.tree.map`)."""
  return isinstance(x, SparseRows)
