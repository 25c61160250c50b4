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
(`safe_ids`, which also reports damage seen under `jax.jit`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import damage
from lazy_optax._src import validate

CODE_DTYPE = jnp.float32
UNIT = 2.0 ** -60
_PART_BITS = 16
_CHECKS = 2
_TOLERANCE = 0.25   # how far from a whole number a scaled part may drift


def index_dtype(num_rows: int) -> Any:
  """int32, unless the table has more rows than int32 can address."""
  if num_rows < np.iinfo(np.int32).max:
    return jnp.int32
  if not jax.config.read('jax_enable_x64'):
    raise ValueError(
        f'num_rows={num_rows} needs 64-bit ids: enable jax_enable_x64.')
  return jnp.int64


def num_parts(id_dtype: Any) -> int:
  """How many 16-bit parts hold an id of `id_dtype` (2 for int32)."""
  return 4 if jnp.dtype(id_dtype).itemsize == 8 else 2


def code_width(id_dtype: Any) -> int:
  """Columns of the id code for ids of `id_dtype`: unit, parts, checks."""
  return 1 + num_parts(id_dtype) + _CHECKS


def _unsigned(ids: jax.Array) -> jax.Array:
  wide = jnp.dtype(ids.dtype).itemsize == 8
  return jax.lax.bitcast_convert_type(ids, jnp.uint64 if wide else jnp.uint32)


def _mix32(x: jax.Array) -> jax.Array:
  """A 32-bit avalanche mix (the murmur3 finalizer) of a uint32 array."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _checks(parts: list[jax.Array]) -> list[jax.Array]:
  """Two 16-bit check values in [1, 65535] from the id's parts (uint32)."""
  h = jnp.uint32(0x9E3779B9)
  for p in parts:
    h = _mix32(h ^ p)
  low, high = h & 0xFFFF, h >> 16
  return [jnp.maximum(low, 1), jnp.maximum(high, 1)]


def _split(ids: jax.Array) -> list[jax.Array]:
  """The id's 16-bit parts, most significant first, as uint32."""
  u = _unsigned(ids)
  n = num_parts(ids.dtype)
  mask = (1 << _PART_BITS) - 1
  return [((u >> (_PART_BITS * (n - 1 - k))) & mask).astype(jnp.uint32)
          for k in range(n)]


def encode(ids: jax.Array) -> jax.Array:
  """The id code of integer ids.

  Args:
    ids: integer array of shape `[N]` (int32, or int64 under x64).

  Returns:
    A float32 array of shape `[N, code_width(ids.dtype)]`.
  """
  parts = _split(ids)
  columns = [jnp.ones(ids.shape, jnp.uint32)] + parts + _checks(parts)
  whole = jnp.stack(columns, axis=-1).astype(CODE_DTYPE)
  return whole * jnp.asarray(UNIT, CODE_DTYPE)


class Decoded(NamedTuple):
  """What an id code says.

  Attributes:
    ids: the ids read back (meaningless where `intact` is False).
    intact: whether each entry is a valid code (possibly scaled).
    empty: whether each entry is all zeros (names no row, is not damage).
  """
  ids: jax.Array
  intact: jax.Array
  empty: jax.Array


def decode(code: jax.Array, id_dtype: Any) -> Decoded:
  """Reads ids back from an id code and says which entries are intact.

  Args:
    code: float array `[N, code_width(id_dtype)]`, an id code possibly
      scaled by a number.
    id_dtype: the integer dtype of the ids.

  Returns:
    A `Decoded` of three `[N]` arrays.
  """
  code = code.astype(CODE_DTYPE)
  unit = code[:, 0]
  empty = jnp.all(code == 0, axis=1)
  safe_unit = jnp.where(unit == 0, jnp.ones_like(unit), unit)
  ratios = code[:, 1:] / safe_unit[:, None]
  whole = jnp.round(ratios)
  n = num_parts(id_dtype)
  close = jnp.all(jnp.abs(ratios - whole) <= _TOLERANCE, axis=1)
  fits = jnp.all((whole >= 0) & (whole < (1 << _PART_BITS)), axis=1)
  # Clipped so that the float -> uint32 casts below are defined everywhere.
  parts32 = jnp.clip(whole, 0, (1 << _PART_BITS) - 1).astype(jnp.uint32)
  parts = [parts32[:, k] for k in range(n)]
  expected = jnp.stack(_checks(parts), axis=-1)
  checks_match = jnp.all(parts32[:, n:] == expected, axis=1)
  intact = (unit != 0) & jnp.isfinite(unit) & close & fits & checks_match
  wide = jnp.dtype(id_dtype).itemsize == 8
  udtype = jnp.uint64 if wide else jnp.uint32
  value = jnp.zeros(code.shape[:1], udtype)
  for p in parts:
    value = (value << _PART_BITS) | p.astype(udtype)
  ids = jax.lax.bitcast_convert_type(value, jnp.dtype(id_dtype))
  return Decoded(ids, intact, empty)



# -- what the consumers of a code do with it ---------------------------------

def _rows_nonzero(values: jax.Array) -> jax.Array:
  return jnp.any(values.reshape(values.shape[0], -1) != 0, axis=1)


def damaged(decoded: Decoded, values: jax.Array) -> jax.Array:
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


def check(code: Any, values: Any, num_rows: int, where: str) -> None:
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
  hurt = damaged(decode(code, index_dtype(num_rows)), values)
  if isinstance(hurt, jax.core.Tracer):  # concrete leaves inside a trace
    return
  if np.any(hurt):
    raise ValueError(validate.damaged_ids_message(
        where, int(np.sum(hurt)), values.shape[0]))


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
  decoded = decode(code, index_dtype(num_rows))
  hurt = damaged(decoded, values)
  if report and isinstance(hurt, jax.core.Tracer) and values.shape[0]:
    finite = jnp.all(jnp.isfinite(values.reshape(values.shape[0], -1)),
                     axis=1)
    reported = hurt & finite
    zero = damage.report_if_damaged(~jnp.any(reported), jnp.sum(reported),
                                    where, values.shape[0])
    hurt = hurt | (zero != 0)  # ties the step's outputs to the report
  ids = decoded.ids
  keep = decoded.intact & ~jnp.any(hurt) & (ids >= 0) & (ids < num_rows)
  return jnp.where(keep, ids, jnp.asarray(num_rows, ids.dtype))
