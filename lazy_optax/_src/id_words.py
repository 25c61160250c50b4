"""Raw ids up to 2**63 - 1 as two uint32 words, without `jax_enable_x64`.

An id table takes raw ids from an unbounded space (user ids, item ids,
hashed crosses). JAX without x64 has no 64-bit integers, so inside `jax.jit`
an id travels as `uint32[..., 2]`: the high word, then the low word.
`split_ids` makes these words from NumPy int64 (or Python ints) outside of
jit. Valid ids lie in `[0, 2**63 - 1]`, so a valid high word is below
`2**31`; a negative int32 id widens (sign extended) to a high word of
`0xFFFFFFFF` and is therefore invalid too.

Without x64, `jax.jit` cuts NumPy int64 arguments to int32 silently, so a
traced int32 array may be 64-bit ids that lost their high bits: `to_words`,
the one place that decides which raw ids are acceptable, refuses such ids
at trace time unless the caller says they are 32-bit (`ids_are_32bit`).
"""

from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

# The words of an empty slot: not a valid id (its high word is >= 2**31).
EMPTY_WORD = 0xFFFFFFFF
MAX_ID = 2 ** 63 - 1
_HIGH_LIMIT = 2 ** 31


def _is_tracer(x: object) -> bool:
  return isinstance(x, jax.core.Tracer)


def _dtype_of(ids: object) -> np.dtype:
  return np.dtype(getattr(ids, 'dtype', None) or np.asarray(ids).dtype)


def split_ids(ids: Union[jax.typing.ArrayLike, Sequence[int]], *,
              ids_are_32bit: bool = False) -> Union[np.ndarray, jax.Array]:
  """Raw ids as `uint32[..., 2]` words (high, low), for use inside `jax.jit`.

  JAX without `jax_enable_x64` has no 64-bit integers: a NumPy int64 array
  given to a jitted function would be cut to int32. `split_ids` turns ids in
  `[0, 2**63 - 1]` into two uint32 words that `IdTable.assign` and
  `IdTable.find` take inside jit. Call it outside jit, on the host: NumPy
  input (or Python ints) gives a NumPy array. A concrete JAX integer array
  gives a JAX array. Traced ids are taken only when they cannot have lost
  bits: 64-bit ones (under x64), or with `ids_are_32bit=True`.

  Args:
    ids: integer ids of any shape: a NumPy array (int64, uint64, int32...),
      a Python int or list, or a JAX integer array.
    ids_are_32bit: the caller's promise that every id lies in
      `[0, 2**31 - 1]`, which lets traced int32 ids through (checked where
      the ids are concrete).

  Returns:
    `uint32` words of shape `ids.shape + (2,)`: `[..., 0]` the high 32 bits,
    `[..., 1]` the low 32 bits.

  Raises:
    TypeError: the ids are not integers (floats, booleans), or are traced
      ids of fewer than 64 bits without `ids_are_32bit=True`.
    ValueError: a concrete id is negative or above `2**63 - 1` (or above
      `2**31 - 1` with `ids_are_32bit=True`).

  Example:
    >>> import numpy as np
    >>> import lazy_optax
    >>> lazy_optax.split_ids(np.array([5, 2**40 + 7], np.int64))
    array([[  0,   5],
           [256,   7]], dtype=uint32)
  """
  where, name = 'split_ids', 'ids'
  _check_flag(ids_are_32bit, where)
  _check_not_bool(ids, where, name)
  if isinstance(ids, (jax.Array, jax.core.Tracer)):
    _check_ids(ids, _dtype_of(ids), where, name, ids_are_32bit)
    return split_jax(ids)
  host = np.asarray(ids)
  if host.dtype == object:
    try:
      host = host.astype(np.uint64)
    except (OverflowError, TypeError) as e:
      raise ValueError(
          f'{where}: {name} must be integers in [0, 2**63 - 1]; got values '
          'outside 64 bits.') from e
  _check_ids(host, host.dtype, where, name, ids_are_32bit)
  return _split_host(host)


def _check_ids(ids: Union[jax.Array, np.ndarray], dtype: np.dtype,
               where: str, name: str, ids_are_32bit: bool) -> None:
  """Refuses ids that are not integers, may have lost bits, or lie outside."""
  _check_integer(dtype, where, name)
  if _is_tracer(ids):
    if dtype.itemsize < 8 and not ids_are_32bit:
      _refuse_narrow_tracer(dtype, where, name)
    return
  host = np.asarray(ids)
  _check_range_host(host, where, name)
  if ids_are_32bit:
    _check_fits_32bit(host, where, name)


def _split_host(host: np.ndarray) -> np.ndarray:
  """Checked NumPy integer ids as words, without loss."""
  wide = host.astype(np.uint64)
  return np.stack([(wide >> np.uint64(32)).astype(np.uint32),
                   (wide & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=-1)


def _check_flag(ids_are_32bit: object, where: str) -> None:
  if not isinstance(ids_are_32bit, bool):
    raise TypeError(f'{where}: ids_are_32bit must be a bool, got '
                    f'{ids_are_32bit!r}.')


def _check_not_bool(ids: object, where: str, name: str) -> None:
  if isinstance(ids, (bool, np.bool_)) or _dtype_of(ids) == np.bool_:
    raise TypeError(
        f'{where}: {name} must be integers, got booleans (dtype bool). A '
        'mask is not a list of ids: give the ids themselves (NumPy int64, or '
        'lazy_optax.split_ids words inside jit).')


def _check_integer(dtype: np.dtype, where: str, name: str) -> None:
  if not np.issubdtype(dtype, np.integer):
    raise TypeError(
        f'{where}: {name} must have an integer dtype, got {dtype}. Float ids '
        'lose digits above 2**24 (float32) or 2**53 (float64): keep ids as '
        'integers (NumPy int64, or lazy_optax.split_ids words inside jit).')


def _check_range_host(host: np.ndarray, where: str, name: str) -> None:
  if host.size == 0:
    return
  if np.issubdtype(host.dtype, np.signedinteger):
    bad = host < 0
    if bad.any():
      first = int(np.flatnonzero(bad.reshape(-1))[0])
      raise ValueError(
          f'{where}: {name} must lie in [0, 2**63 - 1], got '
          f'{int(host.reshape(-1)[first])} at flat position {first} '
          f'({int(bad.sum())} negative ids).')
  elif host.dtype.itemsize == 8:
    bad = host > np.uint64(MAX_ID)
    if bad.any():
      first = int(np.flatnonzero(bad.reshape(-1))[0])
      raise ValueError(
          f'{where}: {name} must lie in [0, 2**63 - 1], got '
          f'{int(host.reshape(-1)[first])} at flat position {first}.')


def _refuse_narrow_tracer(dtype: np.dtype, where: str, name: str) -> None:
  """A traced id array of fewer than 64 bits may have lost its high bits."""
  raise TypeError(
      f'{where}: traced {dtype} {name} may be 64-bit ids cut to 32 bits at '
      'the jax.jit boundary (without jax_enable_x64, JAX turns a NumPy int64 '
      'argument into int32 silently, so 3 and 2**32 + 3 arrive as the same id '
      'and would share a row). Call lazy_optax.split_ids(ids) outside jit and '
      'pass its uint32[..., 2] words, or pass ids_are_32bit=True if every id '
      'is known to lie in [0, 2**31 - 1].')


def _check_fits_32bit(host: np.ndarray, where: str, name: str) -> None:
  """Concrete ids given with `ids_are_32bit=True` must lie below 2**31."""
  if host.size == 0:
    return
  bad = (host < 0) | (host >= _HIGH_LIMIT)
  if bad.any():
    first = int(np.flatnonzero(bad.reshape(-1))[0])
    raise ValueError(
        f'{where}: ids_are_32bit=True, but {name} holds '
        f'{int(host.reshape(-1)[first])} at flat position {first}, outside '
        '[0, 2**31 - 1]: under jit it would be cut to 32 bits. Give '
        'lazy_optax.split_ids words instead.')


def split_jax(ids: jax.Array) -> jax.Array:
  dtype = jnp.dtype(ids.dtype)
  if dtype.itemsize == 8:
    wide = jax.lax.bitcast_convert_type(ids, jnp.uint64) if (
        jnp.issubdtype(dtype, jnp.signedinteger)) else ids
    high = (wide >> 32).astype(jnp.uint32)
    low = (wide & 0xFFFFFFFF).astype(jnp.uint32)
  else:
    signed = jnp.issubdtype(dtype, jnp.signedinteger)
    low = (jax.lax.bitcast_convert_type(ids.astype(jnp.int32), jnp.uint32)
           if signed else ids.astype(jnp.uint32))
    if signed:
      # Sign extension: a negative id gets the invalid high word 0xFFFFFFFF.
      high = jnp.where(ids < 0, jnp.uint32(EMPTY_WORD), jnp.uint32(0))
    else:
      high = jnp.zeros(ids.shape, jnp.uint32)
  return jnp.stack([high, low], axis=-1)


def _words_in(raw_ids: Union[jax.Array, np.ndarray], where: str
              ) -> tuple[jax.Array, tuple[int, ...]]:
  """`uint32[..., 2]` words as JAX words `[N, 2]` (concrete ones checked)."""
  shape = tuple(raw_ids.shape)
  if not shape or shape[-1] != 2:
    raise ValueError(
        f'{where}: uint32 ids are read as words from lazy_optax.split_ids '
        f'and need a last dimension of 2 (high, low); got shape {shape}. '
        'Give plain ids as NumPy int64 (outside jit) or as split_ids words.')
  if not _is_tracer(raw_ids):
    host = np.asarray(raw_ids)
    bad = host[..., 0] >= _HIGH_LIMIT
    if bad.any():
      first = int(np.flatnonzero(bad.reshape(-1))[0])
      raise ValueError(
          f'{where}: id words with a high word >= 2**31 are not ids in '
          f'[0, 2**63 - 1] (first at flat position {first}).')
  return jnp.asarray(raw_ids).reshape(-1, 2), shape[:-1]


def to_words(raw_ids: object, where: str, *, ids_are_32bit: bool = False
             ) -> tuple[jax.Array, tuple[int, ...]]:
  """Any accepted raw-id input as JAX words `[N, 2]`, and the ids' shape.

  The one place that decides whether raw ids are acceptable. Accepted:

  * `uint32[..., 2]` words from `split_ids` (traced or not): they carry all
    64 bits.
  * Concrete ids (NumPy arrays of any integer dtype, Python ints, concrete
    JAX arrays): converted on the host without loss and checked (negative
    or above `2**63 - 1`: `ValueError`).
  * Traced 64-bit ids (under `jax_enable_x64`, where jit keeps them).
  * Traced ids of fewer bits only with `ids_are_32bit=True`: without x64 a
    traced int32 array may be an int64 array cut at the jit boundary, so it
    is refused (`TypeError`) at trace time (under x64 too: one rule, and
    nothing in the trace says where the int32 came from). Traced negative
    ids get no slot.

  Args:
    raw_ids: the ids.
    where: who got them, for messages.
    ids_are_32bit: the caller's promise that every id lies in
      `[0, 2**31 - 1]` (checked where the ids are concrete).

  Returns:
    `(words, shape)`: uint32 `[N, 2]` and the shape of the ids.

  Raises:
    TypeError: floats, booleans, or traced ids that may have lost bits.
    ValueError: concrete ids out of range, or malformed words.
  """
  name = 'raw_ids'
  _check_flag(ids_are_32bit, where)
  _check_not_bool(raw_ids, where, name)
  if not isinstance(raw_ids, (jax.Array, jax.core.Tracer, np.ndarray)):
    raw_ids = np.asarray(raw_ids)
    if raw_ids.dtype == object:
      raise ValueError(
          f'{where}: {name} must be integers in [0, 2**63 - 1]; got values '
          'outside 64 bits.')
  dtype = _dtype_of(raw_ids)
  _check_integer(dtype, where, name)
  if dtype == np.uint32:
    return _words_in(raw_ids, where)
  _check_ids(raw_ids, dtype, where, name, ids_are_32bit)
  # Concrete ids are split on the host, before any cast to JAX's int32.
  words = (split_jax(raw_ids) if isinstance(raw_ids, jax.core.Tracer)
           else jnp.asarray(_split_host(np.asarray(raw_ids))))
  shape = tuple(words.shape[:-1])
  return words.reshape(-1, 2), shape


def join_words(words: jax.typing.ArrayLike) -> np.ndarray:
  """Words `[..., 2]` back to NumPy int64 ids (on the host)."""
  host = np.asarray(words).astype(np.uint64)
  return ((host[..., 0] << np.uint64(32)) | host[..., 1]).astype(np.int64)


def valid_words(words: jax.Array) -> jax.Array:
  """Which rows of `words [N, 2]` are ids in `[0, 2**63 - 1]`."""
  return words[:, 0] < jnp.uint32(_HIGH_LIMIT)
