"""The row-sparse gradient type `SparseRows` and its deduplication."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import damage
from lazy_optax._src import dedup
from lazy_optax._src import id_code
from lazy_optax._src import row_ops
from lazy_optax._src import sharding as _sharding
from lazy_optax._src import validate


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def index_dtype(num_rows: int) -> Any:
  """int32, unless the table has more rows than int32 can address."""
  if num_rows < np.iinfo(np.int32).max:
    return jnp.int32
  if not jax.config.read('jax_enable_x64'):
    raise ValueError(
        f'num_rows={num_rows} needs 64-bit ids: enable jax_enable_x64.')
  return jnp.int64


def _rows_nonzero(values: jax.Array) -> jax.Array:
  """Per row, whether any entry is not zero (NaN counts as not zero)."""
  n = values.shape[0]
  width = int(np.prod(values.shape[1:], dtype=np.int64))
  return jnp.any(values.reshape(n, width) != 0, axis=1)


def _rows_finite(values: jax.Array) -> jax.Array:
  """Per row, whether every entry is finite."""
  return jnp.all(jnp.isfinite(values.reshape(values.shape[0], -1)), axis=1)


_MISSING = object()


class _SparseRowsType(type):
  """Gives the class a repr that says what to do when JAX prints it.

  JAX's pytree structure errors name the class of the subtree that did not
  match; optax code that maps a gradient tree against a dense one
  (`optax.MultiSteps`, a label function of `optax.partition`, a plain
  transformation after a lazy one) ends there. The repr carries the hint.
  """

  def __repr__(cls) -> str:
    return (
        "<class 'lazy_optax.SparseRows'> (a row-sparse gradient of the "
        'parameter at that key path, which code that pairs it with a dense '
        'tree cannot take: apply updates with lazy_optax.apply_updates '
        '(Equinox: lazy_optax.equinox.apply_updates, not '
        'eqx.apply_updates), give a table that optax.partition routes to a '
        'plain optax optimizer a lazy one (lazy_optax.lazy(...)), use '
        'lazy_optax.wrappers.multi_steps instead of optax.MultiSteps and '
        'lazy_optax.tree.path_labels as the label function of optax.partition, '
        'and put other transformations inside lazy_optax.lazy(...))')


@jax.tree_util.register_pytree_with_keys_class
class SparseRows(metaclass=_SparseRowsType):
  """A row-sparse gradient or update of a `[num_rows, *row_shape]` array.

  Row `ids[i]` of the dense array receives `values[i]`; repeated ids mean
  "sum". This is the JAX counterpart of TensorFlow's `IndexedSlices` and
  of a PyTorch sparse gradient from `nn.Embedding(sparse=True)`. It is
  immutable.

  Construction checks what it can see: `ids` must be an integer vector,
  `values` must have one row per id, and, when the ids are concrete (not
  traced by `jax.jit`), every id must lie in `[0, num_rows)`. Under `jax.jit`
  an out-of-range id (a negative one included) touches no row.

  Arithmetic. A `SparseRows` is a pytree whose leaves are its values and an
  *id code* (`code`), a small float32 form of the ids that tree-wide
  arithmetic cannot move to other rows: scaling a gradient tree by a number
  (`jax.tree.map(lambda g: g * s, grads)`, loss scaling, `optax.scale`,
  clipping) scales the values and leaves the ids as they were, while
  adding, averaging or casting codes (`jax.tree.map(jnp.add, g1, g2)`,
  `lax.psum`, `lax.pmean`) damages them: `lazy(...)`, `apply_updates` and
  `add_to` then raise when the code is concrete, and under `jax.jit` write no
  row from that gradient and warn (the checked mode, `with_id_checks` and
  `checked`, reports it as a `CheckError`). Combine gradients with `g1 + g2`
  (the rows concatenated) or `lazy_optax.tree.add`, across devices with
  `lazy_optax.tree.psum`/`pmean`, and scale with `g * s`.

  Args:
    ids: integer array of shape `[N]`, the row ids (duplicates allowed).
    values: array of shape `[N, *row_shape]`, one row per id.
    num_rows: static Python int, the row count of the dense array.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax import SparseRows
    >>> g = SparseRows(jnp.array([2, 0, 2]), jnp.ones((3, 4)), num_rows=5)
    >>> g.to_dense()[2]
    Array([2., 2., 2., 2.], dtype=float32)
    >>> (g + g).ids              # concatenated, not added
    Array([2, 0, 2, 2, 0, 2], dtype=int32)
    >>> (0.5 * g).to_dense()[2]
    Array([1., 1., 1., 1.], dtype=float32)
  """

  # `_ids` holds the ids of a SparseRows built by this library (the
  # constructor, `from_unique`, values-only arithmetic); `_code` the id code,
  # computed from `_ids` only when the object is flattened. One rebuilt from
  # leaves (`tree_unflatten`, as every tree-wide operation does) has a code
  # and no trusted ids: its ids are read back and checked.
  #
  # `_distinct` says that no two slots name the same row. The pytree leaves
  # (what `jax.tree.map`, optax transformations and `lax` collectives see)
  # always are distinct: flattening sums the values of repeated ids first, so
  # element-wise and norm-based transformations see what dense training
  # sees. `_flat` caches the leaves of a concrete object.
  __slots__ = ('_code', '_ids', '_distinct', '_flat', 'values', 'num_rows')
  _code: Optional[jax.Array]
  _ids: Optional[jax.Array]
  _distinct: bool
  _flat: Optional[tuple[jax.Array, jax.Array]]
  values: jax.Array
  num_rows: int

  # Let numpy arrays defer `ndarray + SparseRows` to `SparseRows.__radd__`.
  __array_ufunc__ = None

  def __init__(self, ids: Any = _MISSING, values: Any = _MISSING,
               num_rows: Any = _MISSING, *, indices: Any = _MISSING):
    if indices is not _MISSING:
      if ids is not _MISSING:
        raise TypeError('SparseRows: pass the row ids once, as ids (indices '
                        'is its deprecated name).')
      warnings.warn(
          'SparseRows(indices=...) is deprecated and will be removed after '
          'lazy_optax 0.2: use SparseRows(ids=...).', DeprecationWarning,
          stacklevel=2)
      ids = indices
    for name, given in (('ids', ids), ('values', values),
                        ('num_rows', num_rows)):
      if given is _MISSING:
        raise TypeError(f'SparseRows() missing required argument: {name!r}.')
    num_rows = validate.num_rows(num_rows)
    ids = ids if _is_tracer(ids) else jnp.asarray(ids)
    values = values if _is_tracer(values) else jnp.asarray(values)
    validate.index_vector(ids, 'SparseRows')
    validate.one_row_per_index(ids.shape[0], values, 'SparseRows')
    if not _is_tracer(ids):
      validate.indices_in_range(ids, num_rows, 'SparseRows')
    self._set(None, ids.astype(index_dtype(num_rows)), values, num_rows,
              distinct=False)

  def _set(self, code: Any, ids: Any, values: Any, num_rows: int, *,
           distinct: bool) -> None:
    object.__setattr__(self, '_code', code)
    object.__setattr__(self, '_ids', ids)
    object.__setattr__(self, '_distinct', distinct)
    object.__setattr__(self, '_flat', None)
    object.__setattr__(self, 'values', values)
    object.__setattr__(self, 'num_rows', num_rows)

  def _with_values(self, values: Any) -> 'SparseRows':
    obj = object.__new__(type(self))
    obj._set(self._code, self._ids, values, self.num_rows,
             distinct=self._distinct)
    return obj

  @classmethod
  def _from_code(cls, code: Any, values: Any, num_rows: int, *,
                 distinct: bool) -> 'SparseRows':
    obj = object.__new__(cls)
    obj._set(code, None, values, num_rows, distinct=distinct)
    return obj

  @property
  def has_trusted_ids(self) -> bool:
    """Whether the ids were given (by the library), not read from a code."""
    return self._ids is not None

  @property
  def is_distinct(self) -> bool:
    """Whether no two slots name the same row (duplicates already summed)."""
    return self._distinct

  @property
  def code(self) -> jax.Array:
    """The id code `[N, C]` (float32): the form the ids take as a leaf."""
    # Not cached on the object: one built outside a trace may be flattened
    # inside one, and must not keep that trace's values.
    if self._code is None and self._ids is not None:
      return id_code.encode(self._ids)
    return self._code  # type: ignore[return-value]  # a placeholder leaf

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
        f'SparseRows is immutable: build a new one instead of setting {name}.')

  # -- pytree protocol ------------------------------------------------------
  def _leaves(self) -> tuple[Any, Any]:
    """`(code, values)` of the distinct rows: duplicates summed first."""
    if self._flat is not None:
      return self._flat
    if self._distinct or not _is_array(self.values):
      return self.code, self.values
    leaves = _distinct_leaves(self)
    if not any(_is_tracer(x) for x in leaves):
      object.__setattr__(self, '_flat', leaves)
    return leaves

  def tree_flatten_with_keys(self):
    code, values = self._leaves()
    return ((jax.tree_util.GetAttrKey('code'), code),
            (jax.tree_util.GetAttrKey('values'), values)), self.num_rows

  def tree_flatten(self):
    return self._leaves(), self.num_rows

  @classmethod
  def tree_unflatten(cls, num_rows, children):
    # No validation here: JAX rebuilds pytrees with arbitrary leaves
    # (tracers, shape structs, None, sentinels) while transforming them.
    # Leaves come from a flattening, which sums repeated ids: distinct.
    return cls._from_code(children[0], children[1], num_rows, distinct=True)

  @classmethod
  def from_unique(cls, ids: jax.Array, values: jax.Array, num_rows: int, *,
                  distinct: bool = False) -> 'SparseRows':
    """Builds a `SparseRows` without checks (ids may hold `num_rows` slots).

    For the library's own outputs, whose unused slots point one past the
    last row on purpose.

    Args:
      ids: integer vector `[N]`.
      values: `[N, *row_shape]`.
      num_rows: the row count of the dense array.
      distinct: whether the caller guarantees that no row id (other than the
        padding id `num_rows`) appears twice.

    Returns:
      A `SparseRows`.
    """
    num_rows = int(num_rows)
    obj = object.__new__(cls)
    obj._set(None, jnp.asarray(ids).astype(index_dtype(num_rows)), values,
             num_rows, distinct=distinct)
    return obj

  @classmethod
  def concatenate(cls, parts: Sequence['SparseRows']) -> 'SparseRows':
    """The rows of several `SparseRows` of one table, in one `SparseRows`.

    Concatenation is how row-sparse gradients add up: the dense arrays they
    stand for are summed, since repeated ids mean "sum".

    Args:
      parts: `SparseRows` with the same `num_rows` and row shape.

    Returns:
      A `SparseRows` holding every part's rows, values in their common dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> from lazy_optax import SparseRows
      >>> a = SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)
      >>> b = SparseRows(jnp.array([3, 1]), jnp.ones((2, 2)), 4)
      >>> SparseRows.concatenate([a, b]).to_dense()[1]
      Array([2., 2.], dtype=float32)
    """
    parts = list(parts)
    if not parts or not all(isinstance(p, SparseRows) for p in parts):
      raise TypeError('SparseRows.concatenate takes a non-empty sequence of '
                      'SparseRows.')
    first = parts[0]
    for p in parts[1:]:
      if p.shape != first.shape:
        raise ValueError(
            'SparseRows.concatenate: the parts stand for arrays of different '
            f'shapes, {first.shape} and {p.shape}; only gradients of one '
            'table can be combined.')
    dtype = jnp.result_type(*(p.values.dtype for p in parts))
    values = jnp.concatenate([p.values.astype(dtype) for p in parts])
    known = [p._ids for p in parts if p._ids is not None]
    if len(known) == len(parts):
      return cls.from_unique(jnp.concatenate(known), values, first.num_rows)
    code = jnp.concatenate([p.code for p in parts])
    return cls._from_code(code, values, first.num_rows, distinct=False)

  # -- array-like description -----------------------------------------------
  @property
  def ids(self) -> jax.Array:
    """The row ids `[N]` (read back from the id code if it was rebuilt)."""
    if self._ids is not None:
      return self._ids
    return id_code.decode(self.code, index_dtype(self.num_rows)).ids

  @property
  def indices(self) -> jax.Array:
    """Alias of `ids` (TensorFlow's `IndexedSlices` name); kept for 0.1."""
    return self.ids

  def decoded(self) -> id_code.Decoded:
    """The ids with, per entry, whether it is intact and whether it is empty.

    Returns:
      An `id_code.Decoded` of `[N]` arrays.
    """
    if self._ids is not None:
      n = self._ids.shape[0]
      return id_code.Decoded(self._ids, jnp.ones((n,), bool),
                             jnp.zeros((n,), bool))
    return id_code.decode(self.code, index_dtype(self.num_rows))

  @property
  def num_ids(self) -> int:
    """How many (index, row) pairs this holds: `N`."""
    return int(self.values.shape[0])

  @property
  def row_shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape[1:])

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the dense array this stands for."""
    return (self.num_rows, *self.row_shape)

  @property
  def dtype(self) -> Any:
    return self.values.dtype

  @property
  def ndim(self) -> int:
    return 1 + len(self.row_shape)

  def __repr__(self) -> str:
    return (f'SparseRows(num_rows={self.num_rows}, ids={self.num_ids},'
            f' row_shape={self.row_shape}, dtype={self.dtype})')

  # -- integrity of the ids -------------------------------------------------
  def check(self, where: str = 'a SparseRows') -> None:
    """Raises if the ids were changed by arithmetic on the gradient tree.

    What can be seen at trace time (a cast or a reshape of the id code,
    values without one row per index) raises always; damaged entries of a
    concrete code raise too. Traced codes are not checked here: their damaged
    entries write no row (see `safe_ids`).

    Args:
      where: what this gradient is, for messages (`'parameter emb/table'`).

    Raises:
      TypeError, ValueError: naming `where` and what to do instead.
    """
    ids_or_code = self._ids if self._ids is not None else self.code
    missing = (_sharding.varying_axes(ids_or_code)
               - _sharding.varying_axes(self.values))
    if missing:
      raise ValueError(validate.reduced_values_message(where,
                                                       sorted(missing)))
    if self._ids is not None:  # built here, not by tree arithmetic
      return
    validate.id_code_structure(self.code, self.values,
                               id_code.code_width(index_dtype(self.num_rows)),
                               where)
    if _is_tracer(self.code) or self.num_ids == 0:
      return
    decoded = id_code.decode(self.code, index_dtype(self.num_rows))
    if _is_tracer(decoded.intact):  # concrete leaves inside a trace
      return
    damaged = ~(np.asarray(decoded.intact) | np.asarray(decoded.empty))
    if not _is_tracer(self.values) and not damaged.any():
      rows_nonzero = jnp.any(self.values.reshape(self.num_ids, -1) != 0,
                             axis=1)
      if not _is_tracer(rows_nonzero):
        damaged = np.asarray(decoded.empty) & np.asarray(rows_nonzero)
    if damaged.any():
      raise ValueError(validate.damaged_ids_message(
          where, int(damaged.sum()), self.num_ids))

  def safe_ids(self, where: str = 'a SparseRows', *,
               report: bool = True) -> jax.Array:
    """Row ids with every id that must touch no row set to `num_rows`.

    Out-of-range ids (negative ones too), empty entries and, when any entry
    of the id code is damaged, every id of this `SparseRows` are
    moved past the end, where a scatter with `mode="drop"` discards them (JAX
    wraps negative ids like numpy before any scatter `mode` applies).
    Under `jax.jit`, damaged ids make the step raise `DamagedIdsError` when
    it runs (or warn, after `lazy_optax.checks.on_damaged_ids('warn')`).

    Args:
      where: what this gradient is, for the message.
      report: whether damage seen under a trace is reported when the step
        runs; the checked mode, which reports it itself, passes False.

    Returns:
      An integer array `[N]`.
    """
    if self._ids is not None:
      ids = self._ids
      keep = (ids >= 0) & (ids < self.num_rows)
      return jnp.where(keep, ids, jnp.asarray(self.num_rows, ids.dtype))
    decoded = id_code.decode(self.code, index_dtype(self.num_rows))
    ids = decoded.ids
    # An entry that reads "no row" while its values are not zero lost its
    # ids (a tiny scale factor flushed the code to zero): damage too.
    emptied = decoded.empty & _rows_nonzero(self.values)
    all_intact = jnp.all((decoded.intact | decoded.empty) & ~emptied)
    if report and _is_tracer(all_intact) and self.num_ids:
      # Rows whose values are not finite are not reported: a loss scale that
      # overflowed unscales them by a factor that also flushes the ids, and
      # the step is one that `apply_if_finite` or jmp skips anyway.
      damaged = (~(decoded.intact | decoded.empty) | emptied) & _rows_finite(
          self.values)
      damage.report_if_damaged(jnp.all(~damaged), jnp.sum(damaged), where,
                               self.num_ids)
    keep = (decoded.intact & all_intact & (ids >= 0) & (ids < self.num_rows))
    return jnp.where(keep, ids, jnp.asarray(self.num_rows, ids.dtype))

  # -- conversions and arithmetic -------------------------------------------
  def to_dense(self) -> jax.Array:
    """The dense `[num_rows, *row_shape]` array (duplicates summed).

    Returns:
      A dense array of shape `self.shape` and dtype `self.dtype`.
    """
    self.check()
    dense = jnp.zeros(self.shape, self.dtype)
    return dense.at[self.safe_ids()].add(self.values, mode='drop')

  def add_to(self, array: Any, where: str = 'a SparseRows') -> jax.Array:
    """Scatter-adds the rows onto `array` (its other rows are not touched).

    Args:
      array: dense array of shape `self.shape`.
      where: what this update is, for messages.

    Returns:
      `array` with `values` added to rows `ids`, in `array`'s dtype.
    """
    array = jnp.asarray(array)
    self.check(where)
    validate.same_shape(tuple(array.shape), self.shape, where)
    return row_ops.add(array, self.safe_ids(where),
                       self.values.astype(array.dtype))

  def astype(self, dtype: Any) -> 'SparseRows':
    """The same rows with values cast to `dtype` (the ids unchanged)."""
    return self._with_values(self.values.astype(dtype))

  def _scaled(self, factor: Any) -> 'SparseRows':
    if isinstance(factor, SparseRows) or jnp.ndim(factor) != 0:
      return NotImplemented
    return self._with_values(self.values * factor)

  def __mul__(self, factor):
    return self._scaled(factor)

  __rmul__ = __mul__

  def __truediv__(self, divisor):
    if isinstance(divisor, SparseRows) or jnp.ndim(divisor) != 0:
      return NotImplemented
    return self._with_values(self.values / divisor)

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


class UniqueRows(NamedTuple):
  """Deduplicated rows: `ids[k]` unique or `num_rows` (an unused slot)."""
  ids: jax.Array
  values: jax.Array


def deduplicate(grad: SparseRows,
                where: Optional[str] = None) -> UniqueRows:
  """Sums the values of repeated ids into one slot per distinct id.

  The result keeps static shapes: as many slots as there were ids. Slots left
  over hold id `num_rows` (one past the last row) and zero values, so that a
  scatter with `mode="drop"` ignores them; out-of-range and damaged ids land
  there too.

  Args:
    grad: a `SparseRows`.
    where: what `grad` is, for messages (`'parameter emb/table'`).

  Returns:
    A `UniqueRows` with `ids` of shape `[N]` and `values` of shape
    `[N, *row_shape]`.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax import SparseRows
    >>> from lazy_optax.tree import deduplicate
    >>> u = deduplicate(SparseRows(jnp.array([3, 1, 3]), jnp.ones((3, 1)), 5))
    >>> u.ids, u.values[:, 0]
    (Array([1, 3, 5], dtype=int32), Array([1., 2., 0.], dtype=float32))
  """
  where = where or 'a SparseRows'
  ids, values = dedup.unique_rows(*prepare(grad, where))
  return UniqueRows(ids, values)


def prepare(grad: SparseRows, where: str) -> tuple[jax.Array, jax.Array, int]:
  """A `SparseRows`'s `(safe ids, values, num_rows)`, checked.

  Under an Explicit mesh the global batch is gathered first (see sharding).

  Args:
    grad: a `SparseRows`.
    where: what `grad` is, for messages.

  Returns:
    `(ids, values, num_rows)` with every id that must touch no row set to
    `num_rows`.
  """
  grad.check(where)
  ids = _sharding.replicate_if_explicit(grad.safe_ids(where))
  if ids.shape[0] == 0:
    return ids, grad.values, grad.num_rows
  values = _sharding.replicate_if_explicit(grad.values)
  return ids, values, grad.num_rows


def distinct_rows(grad: SparseRows, where: str) -> tuple[jax.Array, jax.Array]:
  """A `SparseRows`'s distinct ids and summed values, checked.

  Rows known to be distinct are not sorted again: the library's own updates,
  and the leaves of a flattened `SparseRows` (flattening sums repeated ids
  and leaves the row ids increasing) as long as their row ids still increase
  (tree arithmetic that concatenated or permuted leaves falls back to
  `unique_rows`, under `lax.cond`). Unused slots hold zeros either way.

  Args:
    grad: a `SparseRows`.
    where: what `grad` is, for messages.

  Returns:
    `(ids, values)` as `unique_rows` returns them.
  """
  ids, values, num_rows = prepare(grad, where)
  if not grad.is_distinct or ids.shape[0] == 0:
    return dedup.unique_rows(ids, values, num_rows)

  def as_they_are(ids, values):
    keep = (ids < num_rows).reshape(ids.shape + (1,) * (values.ndim - 1))
    return ids, jnp.where(keep, values, jnp.zeros_like(values))

  if grad.has_trusted_ids:
    return as_they_are(ids, values)
  return jax.lax.cond(dedup.increasing(ids, num_rows), as_they_are,
                      lambda i, v: dedup.unique_rows(i, v, num_rows), ids,
                      values)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _with_out_of_range(unique_ids: jax.Array, ids: jax.Array,
                       outside: jax.Array, num_rows: int) -> jax.Array:
  """`unique_ids` whose unused slots also hold the out-of-range ids.

  They touch no row either way; kept, the checked mode can still report them.
  There are at least as many unused slots as out-of-range ids.
  """
  n = ids.shape[0]
  unused = unique_ids == num_rows
  unused_rank = jnp.cumsum(unused.astype(jnp.int32)) - 1
  kth_unused = jnp.zeros((n,), jnp.int32).at[
      jnp.where(unused, unused_rank, n)].set(jnp.arange(n, dtype=jnp.int32),
                                             mode='drop')
  outside_rank = jnp.cumsum(outside.astype(jnp.int32)) - 1
  target = jnp.where(outside, kth_unused[outside_rank], n)
  return unique_ids.at[target].set(ids, mode='drop')


@functools.partial(jax.jit, static_argnums=2)
def _distinct_from_ids(ids: jax.Array, values: jax.Array,
                       num_rows: int) -> tuple[jax.Array, jax.Array]:
  ids = _sharding.replicate_if_explicit(ids)
  values = _sharding.replicate_if_explicit(values)
  outside = (ids < 0) | (ids > num_rows)
  safe = jnp.where(outside, jnp.asarray(num_rows, ids.dtype), ids)
  unique_ids, summed = dedup.unique_rows(safe, values, num_rows)
  unique_ids = _with_out_of_range(unique_ids, ids, outside, num_rows)
  return id_code.encode(unique_ids), summed


@functools.partial(jax.jit, static_argnums=2)
def _distinct_from_code(code: jax.Array, values: jax.Array,
                        num_rows: int) -> tuple[jax.Array, jax.Array]:
  # A damaged code is passed on as it is, so that its consumer still sees
  # (and reports) the damage rather than a code that names no row.
  decoded = id_code.decode(code, index_dtype(num_rows))
  emptied = decoded.empty & _rows_nonzero(values)
  ok = jnp.all((decoded.intact | decoded.empty) & ~emptied)
  ids = decoded.ids
  outside = decoded.intact & ((ids < 0) | (ids > num_rows))
  keep = decoded.intact & ~outside
  safe = jnp.where(keep, ids, jnp.asarray(num_rows, ids.dtype))
  unique_ids, summed = dedup.unique_rows(safe, values, num_rows)
  unique_ids = _with_out_of_range(unique_ids, ids, outside, num_rows)
  return (jnp.where(ok, id_code.encode(unique_ids), code),
          jnp.where(ok, summed, values))


def _distinct_leaves(x: SparseRows) -> tuple[Any, Any]:
  """The pytree leaves of `x`: its distinct rows, repeated ids summed."""
  # pylint: disable=protected-access
  if x.num_ids == 0:
    return x.code, x.values
  if x._ids is not None:
    return _distinct_from_ids(x._ids, x.values, x.num_rows)
  code = x.code
  width = id_code.code_width(index_dtype(x.num_rows))
  if (not _is_array(code) or jnp.result_type(code) != jnp.float32
      or jnp.shape(code) != (x.num_ids, width)):
    return code, x.values  # a cast or reshape, reported where consumed
  return _distinct_from_code(code, x.values, x.num_rows)
