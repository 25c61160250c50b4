"""Row ids in a form that tree-wide arithmetic cannot silently move.

A `SparseRows` is a pytree, so `jax.tree.map`, `lax.psum`, loss scaling and
optax transformations reach its ids as well as its values. Plain integer ids
would be added (`[1, 2] + [3, 4] -> [4, 6]`), multiplied or averaged into
other rows without a word. Instead a `SparseRows` carries its ids as an *id
code*: a float32 array of shape `[N, C]` whose row `i` is `unit * (1, parts of
id_i, two check hashes of id_i)` with `unit = 2**-60`:

* every column is a multiple of the same unit, so scaling the code by any
  number (loss scaling, averaging, clipping, a learning rate) scales all
  columns alike and the id reads back unchanged: such arithmetic is harmless;
* entries are tiny (at most `2**-44`): they add nothing measurable to a global
  norm (`optax.clip_by_global_norm`, `optax.tree.norm`);
* anything else (adding or averaging two different codes, `psum`, `pmean`,
  a cast to a narrow float) leaves parts that are not whole numbers or check
  hashes that do not match the parts: the entry is *damaged*, and the step
  that consumes it is stopped;
* an all-zero row (from `optax.tree.zeros_like`, as `optax.apply_if_finite`
  makes when it rejects a step) is *empty*: it names no row.

This module is the one owner of the code: it encodes, decodes, says which
entries are damaged (`damaged`, `check`) and which ids a consumer may write
(`safe_ids`, which also reports damage seen under `jax.jit`), and holds a
`SparseRows`'s ids in either form (`RowIds`). The arithmetic is written once
over an array module: NumPy for concrete arrays (no XLA program to compile
or dispatch), `jax.numpy` for tracers and arrays split over devices; both
give the same bits (entries below float32's smallest normal number read as
zero, as XLA's CPU flushes them).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Generic, NamedTuple, Optional, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import damage
from lazy_optax._src import sharding as _sharding
from lazy_optax._src import validate

CODE_DTYPE = np.float32
UNIT = 2.0 ** -60
_PART_BITS = 16
_CHECKS = 2
_TOLERANCE = 0.25   # how far from a whole number a scaled part may drift
_TINY = float(np.finfo(np.float32).tiny)
# An array of the array module `xp` it goes with: NumPy on the host, else JAX.
XpArray = TypeVar('XpArray', np.ndarray, jax.Array)


def index_dtype(num_rows: int) -> jax.typing.DTypeLike:
  """int32, unless the table has more rows than int32 can address."""
  if num_rows < np.iinfo(np.int32).max:
    return jnp.int32
  if not jax.config.read('jax_enable_x64'):
    raise ValueError(
        f'num_rows={num_rows} needs 64-bit ids: enable jax_enable_x64.')
  return jnp.int64


def num_parts(id_dtype: jax.typing.DTypeLike) -> int:
  """How many 16-bit parts hold an id of `id_dtype` (2 for int32)."""
  return 4 if jnp.dtype(id_dtype).itemsize == 8 else 2


def code_width(id_dtype: jax.typing.DTypeLike) -> int:
  """Columns of the id code for ids of `id_dtype`: unit, parts, checks."""
  return 1 + num_parts(id_dtype) + _CHECKS


def _bitcast(x: XpArray, dtype: jax.typing.DTypeLike) -> XpArray:
  """`x`'s bits as `dtype` (of the same size; for JAX arrays `view` is
  `lax.bitcast_convert_type`)."""
  return x.view(dtype)


def _unsigned(ids: XpArray, xp: ModuleType) -> XpArray:
  wide = np.dtype(ids.dtype).itemsize == 8
  return _bitcast(ids, xp.uint64 if wide else xp.uint32)


def _mix32(x: XpArray, xp: ModuleType) -> XpArray:
  """A 32-bit avalanche mix (the murmur3 finalizer) of a uint32 array."""
  x = x ^ (x >> 16)
  x = x * xp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * xp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _checks(parts: list[XpArray], xp: ModuleType) -> list[XpArray]:
  """Two 16-bit check values in [1, 65535] from the id's parts (uint32)."""
  h = xp.uint32(0x9E3779B9)
  for p in parts:
    h = _mix32(h ^ p, xp)
  low, high = h & 0xFFFF, h >> 16
  return [xp.maximum(low, 1), xp.maximum(high, 1)]


def _split(ids: XpArray, xp: ModuleType) -> list[XpArray]:
  """The id's 16-bit parts, most significant first, as uint32."""
  u = _unsigned(ids, xp)
  n = num_parts(ids.dtype)
  mask = (1 << _PART_BITS) - 1
  return [((u >> (_PART_BITS * (n - 1 - k))) & mask).astype(xp.uint32)
          for k in range(n)]


def _on_host(x: object) -> Optional[np.ndarray]:
  """`x` as a NumPy array where reading it runs no XLA program, else None.

  A tracer is never read; neither is an array split over devices (its code
  stays split alike, as XLA computes it) nor one on an accelerator (reading
  it would wait for the device and copy to the host, every step).
  """
  if isinstance(x, np.ndarray):
    return x
  if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
      and x.is_fully_addressable and x.sharding.is_fully_replicated
      and all(d.platform == 'cpu' for d in x.devices())):
    return np.asarray(x)
  return None


def _placed(host: jax.typing.ArrayLike, like: object) -> jax.Array:
  """`host` where `like` is (committed to its devices only if `like` is)."""
  if isinstance(like, jax.Array) and like.committed:
    return jax.device_put(host, like.sharding)
  return jax.device_put(host)  # (jnp.asarray would compile a copy)


def _encode(ids: XpArray, xp: ModuleType) -> XpArray:
  parts = _split(ids, xp)
  columns = [xp.ones(ids.shape, xp.uint32)] + parts + _checks(parts, xp)
  whole = xp.stack(columns, axis=-1).astype(CODE_DTYPE)
  return whole * xp.asarray(UNIT, CODE_DTYPE)


@functools.partial(jax.jit, inline=True)
def _encode_traced(ids: jax.Array) -> jax.Array:
  """`_encode` with `jax.numpy`, traced once per shape and dtype and
  inlined (a step that reads codes of one shape many times, or many traces
  of a step, reuse the trace)."""
  return _encode(ids, jnp)


def encode(ids: jax.Array) -> jax.Array:
  """The id code of integer ids.

  Concrete ids are encoded with NumPy (no XLA program to compile or run),
  traced ones with `jax.numpy`: the same bits.

  Args:
    ids: integer array of shape `[N]` (int32, or int64 under x64).

  Returns:
    A float32 array of shape `[N, code_width(ids.dtype)]`.

  Example:
    >>> import jax.numpy as jnp
    >>> code = encode(jnp.array([7, 0], jnp.int32))
    >>> code.shape, decode(code, jnp.int32).ids
    ((2, 5), Array([7, 0], dtype=int32))
  """
  host = _on_host(ids)
  if host is None:
    return _encode_traced(ids)
  return _placed(_encode(host, np), ids)


class Decoded(NamedTuple, Generic[XpArray]):
  """What an id code says.

  Attributes:
    ids: the ids read back (meaningless where `intact` is False).
    intact: whether each entry is a valid code (possibly scaled).
    empty: whether each entry is all zeros (names no row, is not damage).
  """
  ids: XpArray
  intact: XpArray
  empty: XpArray


def _decode(code: XpArray, id_dtype: jax.typing.DTypeLike, xp: ModuleType
            ) -> Decoded[XpArray]:
  code = code.astype(CODE_DTYPE)
  # Subnormal entries read as zero on every backend (XLA's CPU flushes them).
  code = xp.where(xp.abs(code) < _TINY, xp.zeros_like(code), code)
  unit = code[:, 0]
  empty = xp.all(code == 0, axis=1)
  safe_unit = xp.where(unit == 0, xp.ones_like(unit), unit)
  ratios = code[:, 1:] / safe_unit[:, None]
  whole = xp.round(ratios)
  n = num_parts(id_dtype)
  close = xp.all(xp.abs(ratios - whole) <= _TOLERANCE, axis=1)
  fits = xp.all((whole >= 0) & (whole < (1 << _PART_BITS)), axis=1)
  # NaN read as 0 and clipped, so that the casts to uint32 are defined.
  whole = xp.where(xp.isnan(whole), xp.zeros_like(whole), whole)
  parts32 = xp.clip(whole, 0, (1 << _PART_BITS) - 1).astype(xp.uint32)
  parts = [parts32[:, k] for k in range(n)]
  expected = xp.stack(_checks(parts, xp), axis=-1)
  checks_match = xp.all(parts32[:, n:] == expected, axis=1)
  intact = (unit != 0) & xp.isfinite(unit) & close & fits & checks_match
  return Decoded(_join(parts, id_dtype, xp), intact, empty)


def _join(parts: list[XpArray], id_dtype: jax.typing.DTypeLike,
          xp: ModuleType) -> XpArray:
  """The ids of `id_dtype` whose 16-bit parts are `parts` (`_split`'s)."""
  udtype = xp.uint64 if np.dtype(id_dtype).itemsize == 8 else xp.uint32
  value = xp.zeros(parts[0].shape, udtype)
  for p in parts:
    value = (value << _PART_BITS) | p.astype(udtype)
  return _bitcast(value, np.dtype(id_dtype))


def decode(code: jax.Array, id_dtype: jax.typing.DTypeLike
           ) -> Decoded[jax.Array]:
  """Reads ids back from an id code and says which entries are intact.

  A concrete code is read with NumPy, a traced one with `jax.numpy`: the
  same bits.

  Args:
    code: float array `[N, code_width(id_dtype)]`, an id code possibly
      scaled by a number.
    id_dtype: the integer dtype of the ids.

  Returns:
    A `Decoded` of three `[N]` arrays.

  Example:
    >>> import jax.numpy as jnp
    >>> d = decode(3.0 * encode(jnp.array([5], jnp.int32)), jnp.int32)
    >>> d.ids, d.intact.tolist(), d.empty.tolist()
    (Array([5], dtype=int32), [True], [False])
  """
  read = _decode_on_host(code, id_dtype)
  if read is None:
    return _decode_traced(code, jnp.dtype(id_dtype))
  return Decoded(*(_placed(x, code) for x in read))


@functools.partial(jax.jit, inline=True, static_argnums=1)
def _decode_traced(code: jax.Array, id_dtype: np.dtype) -> Decoded[jax.Array]:
  """`_decode` with `jax.numpy`, traced once per shape and dtype, inlined."""
  return _decode(code, id_dtype, jnp)


def _decode_on_host(code: jax.Array, id_dtype: jax.typing.DTypeLike
                    ) -> Decoded[np.ndarray] | None:
  """`decode` with NumPy, of a code readable on the host (else None)."""
  host = _on_host(code)
  if host is None:
    return None
  with np.errstate(all='ignore'):  # inf and NaN are damage, read as such
    return _decode(host, id_dtype, np)


# -- what the consumers of a code do with it ---------------------------------

def _rows_nonzero(values: jax.Array) -> jax.Array:
  return jnp.any(values.reshape(values.shape[0], -1) != 0, axis=1)


def damaged(decoded: Decoded[jax.Array], values: jax.Array) -> jax.Array:
  """Per entry, whether the code was damaged by arithmetic.

  An entry that is not intact, or that reads "no row" while its values are
  not zero (a tiny scale factor flushed the code to zero), is damaged.

  Args:
    decoded: what `decode` read.
    values: the rows `[N, *row_shape]` that go with the code.

  Returns:
    A bool array `[N]`.
  """
  return (~(decoded.intact | decoded.empty)
          | (decoded.empty & _rows_nonzero(values)))


def _damaged_on_host(code: jax.Array, values: jax.Array, num_rows: int
                     ) -> tuple[Decoded[np.ndarray], np.ndarray] | None:
  """`(decoded, damaged)` in NumPy for concrete leaves, else None.

  The values are read (on their device) only where an entry is empty.
  """
  read = _decode_on_host(code, index_dtype(num_rows))
  if read is None or isinstance(values, jax.core.Tracer):
    return None
  hurt = ~(read.intact | read.empty)
  if read.empty.any():
    nonzero = _rows_nonzero(values)
    if isinstance(nonzero, jax.core.Tracer):  # concrete leaves in a trace
      return None
    hurt = hurt | (read.empty & np.asarray(nonzero))
  return read, hurt


def check_varying(ids_or_code: jax.Array, values: jax.Array,
                  where: str) -> None:
  """Refuses values that do not vary over mesh axes the ids vary over.

  Such values were summed across devices already (autodiff of a replicated
  input inside `shard_map`) while the ids stayed per device.
  """
  missing = (_sharding.varying_axes(ids_or_code)
             - _sharding.varying_axes(values))
  if missing:
    raise ValueError(validate.reduced_values_message(where, sorted(missing)))


def check(code: jax.Array, values: jax.Array, num_rows: int,
          where: str) -> None:
  """Raises on damage to a code that is visible now.

  A cast or a reshape of the code raises always (trace time), damaged
  entries of a concrete code too; traced codes are left to `safe_ids`.

  Args:
    code: the id code (a leaf, possibly changed by tree arithmetic).
    values: the rows that go with it.
    num_rows: the table's row count.
    where: what the gradient is, for messages.
  """
  validate.id_code_structure(code, values, code_width(index_dtype(num_rows)),
                             where)
  if any(isinstance(x, jax.core.Tracer) for x in (code, values)):
    return
  if values.shape[0] == 0:
    return
  on_host = _damaged_on_host(code, values, num_rows)
  if on_host is None:  # concrete leaves inside a trace, or split over devices
    hurt = damaged(decode(code, index_dtype(num_rows)), values)
    if isinstance(hurt, jax.core.Tracer):
      return
    count = int(np.sum(hurt))
  else:
    count = int(np.sum(on_host[1]))
  if count:
    raise ValueError(validate.damaged_ids_message(
        where, count, values.shape[0]))


def safe_ids(code: jax.Array, values: jax.Array, num_rows: int, where: str,
             report: bool) -> jax.Array:
  """The ids of a code, every one that must touch no row set to `num_rows`.

  Out-of-range and empty entries, and every entry when any is damaged, name
  no row. Under a trace, damage is reported when the step runs, if `report`
  (`damage.report_if_damaged`; rows whose values are not finite are not
  reported: a loss scale that overflowed unscales them by a factor that also
  flushes the code, and `apply_if_finite` or jmp skips such a step anyway).

  Args:
    code: the id code `[N, C]`.
    values: the rows `[N, *row_shape]`.
    num_rows: the table's row count.
    where: what the gradient is, for messages.
    report: whether to report damage seen under a trace.

  Returns:
    An integer array `[N]`.
  """
  on_host = _damaged_on_host(code, values, num_rows)
  if on_host is not None:
    return _placed(_kept(*on_host, num_rows, np), code)
  id_dtype = jnp.dtype(index_dtype(num_rows))
  decoded, hurt, reported = _inspect(code, values, id_dtype)
  if report and isinstance(hurt, jax.core.Tracer) and values.shape[0]:
    zero = damage.report_if_damaged(reported == 0, reported, where,
                                    values.shape[0])
    hurt = hurt | (zero != 0)  # ties the step's outputs to the report
  return _kept_traced(decoded, hurt, jnp.asarray(num_rows, id_dtype))


# Traced once per signature and inlined; the row count enters as data, so
# tables of every size share the trace.
@functools.partial(jax.jit, inline=True, static_argnums=2)
def _inspect(code: jax.Array, values: jax.Array, id_dtype: np.dtype
             ) -> tuple[Decoded[jax.Array], jax.Array, jax.Array]:
  """What `safe_ids` reads of a code with `jax.numpy`: the decoded code,
  its damaged entries and how many of them have finite values (the damage
  to report)."""
  decoded = _decode(code, id_dtype, jnp)
  hurt = damaged(decoded, values)
  finite = jnp.all(jnp.isfinite(values.reshape(values.shape[0], -1)), axis=1)
  return decoded, hurt, jnp.sum(hurt & finite, dtype=jnp.int32)


@functools.partial(jax.jit, inline=True)
def _kept_traced(read: Decoded[jax.Array], hurt: jax.Array,
                 num_rows: jax.Array) -> jax.Array:
  return _kept(read, hurt, num_rows, jnp)


def _kept(read: Decoded[XpArray], hurt: XpArray, num_rows: int | XpArray,
          xp: ModuleType) -> XpArray:
  """The intact in-range ids, `num_rows` elsewhere and everywhere if hurt."""
  ids = read.ids
  keep = read.intact & ~xp.any(hurt) & (ids >= 0) & (ids < num_rows)
  return xp.where(keep, ids, xp.asarray(num_rows, ids.dtype))


class RowIds:
  """The ids of a `SparseRows`, in one of two forms (fixed once made).

  `given`: distinct ids that the library built (trusted, never checked);
  `leaf`: an id code rebuilt from pytree leaves (checked where it is
  consumed). The code of concrete given ids is encoded once, with NumPy,
  when it is made; traced ones are encoded at each read, in the trace that
  reads them. Nothing changes on read.
  """

  __slots__ = ('given', 'leaf', '_encoded')
  given: Optional[jax.Array]
  leaf: Optional[jax.Array]
  _encoded: Optional[jax.Array]

  def __init__(self, given: Optional[jax.Array] = None,
               leaf: Optional[jax.Array] = None):
    code = None
    if given is not None and not isinstance(given, jax.core.Tracer):
      code = encode(given)  # once, when made: reading changes nothing
    for name, value in zip(self.__slots__, (given, leaf, code)):
      object.__setattr__(self, name, value)

  def __setattr__(self, name: str, value: object) -> None:
    raise AttributeError(f'RowIds is immutable (setting {name}).')

  def code(self) -> Optional[jax.Array]:
    """The id code `[N, C]`: the form the ids take as a pytree leaf."""
    if self.given is None:
      return self.leaf
    if self._encoded is None or self._encoded.is_deleted():  # (donated)
      return encode(self.given)  # traced: in the trace that reads it
    return self._encoded

  def _leaf_code(self) -> jax.Array:
    """The code rebuilt from leaves, where it is consumed (an array)."""
    assert self.given is None and self.leaf is not None
    return self.leaf

  def decoded(self, num_rows: int) -> Decoded[jax.Array]:
    """The ids, and per entry whether it is intact and whether it is empty."""
    if self.given is None:
      return decode(self._leaf_code(), index_dtype(num_rows))
    n = self.given.shape[0]
    return Decoded(self.given, jnp.ones((n,), bool), jnp.zeros((n,), bool))

  def check(self, values: jax.Array, num_rows: int, where: str) -> None:
    """`check_varying`, and `check` of a code rebuilt from leaves."""
    if self.given is not None:
      check_varying(self.given, values, where)
      return
    check_varying(self._leaf_code(), values, where)
    check(self._leaf_code(), values, num_rows, where)

  def safe_ids(self, values: jax.Array, num_rows: int, where: str,
               report: bool) -> jax.Array:
    """`safe_ids` of a code rebuilt from leaves; the given ids in range."""
    if self.given is None:
      return safe_ids(self._leaf_code(), values, num_rows, where, report)
    return _in_range(self.given, jnp.asarray(num_rows, self.given.dtype))


@functools.partial(jax.jit, inline=True)
def _in_range(ids: jax.Array, num_rows: jax.Array) -> jax.Array:
  """`ids`, each outside `[0, num_rows)` set to `num_rows` (a row count
  of the ids' dtype, as data: one trace for tables of every size)."""
  return jnp.where((ids >= 0) & (ids < num_rows), ids, num_rows)
