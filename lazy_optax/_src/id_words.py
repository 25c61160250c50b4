"""Raw ids up to 2**63 - 1 as two uint32 words, without `jax_enable_x64`.

An id table takes raw ids from an unbounded space (user ids, item ids,
hashed crosses). JAX without x64 has no 64-bit integers, so inside `jax.jit`
an id travels as `uint32[..., 2]`: the high word, then the low word.
`split_ids` makes these words from NumPy int64 (or Python ints) outside of
jit; int32 ids are widened on the fly. Valid ids lie in `[0, 2**63 - 1]`, so
a valid high word is below `2**31`; a negative int32 id widens (sign
extended) to a high word of `0xFFFFFFFF` and is therefore invalid too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The words of an empty slot: not a valid id (its high word is >= 2**31).
EMPTY_WORD = 0xFFFFFFFF
MAX_ID = 2 ** 63 - 1
_HIGH_LIMIT = 2 ** 31


def _is_tracer(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def _dtype_of(ids: Any) -> np.dtype:
  return np.dtype(getattr(ids, 'dtype', None) or np.asarray(ids).dtype)


def split_ids(ids: Any) -> Any:
  """Raw ids as `uint32[..., 2]` words (high, low), for use inside `jax.jit`.

  JAX without `jax_enable_x64` has no 64-bit integers: a NumPy int64 array
  given to a jitted function would be cut to int32. `split_ids` turns ids in
  `[0, 2**63 - 1]` into two uint32 words that `IdTable.assign`,
  `IdTable.find` and `reset_rows` take inside jit. NumPy input (or Python
  ints) gives a NumPy array, made on the host; a JAX integer array gives a
  JAX array (int64 ones exist only under x64).

  Args:
    ids: integer ids of any shape: a NumPy array (int64, uint64, int32...),
      a Python int or list, or a JAX integer array.

  Returns:
    `uint32` words of shape `ids.shape + (2,)`: `[..., 0]` the high 32 bits,
    `[..., 1]` the low 32 bits.

  Raises:
    TypeError: the ids are not integers (floats, booleans).
    ValueError: a concrete id is negative or above `2**63 - 1`.

  Example:
    >>> import numpy as np
    >>> import lazy_optax
    >>> lazy_optax.split_ids(np.array([5, 2**40 + 7], np.int64))
    array([[  0,   5],
           [256,   7]], dtype=uint32)
  """
  where = 'split_ids'
  if isinstance(ids, (jax.Array, jax.core.Tracer)):
    _check_integer(_dtype_of(ids), where)
    if not _is_tracer(ids):
      _check_range_host(np.asarray(ids), where)
    return _split_jax(ids)
  if isinstance(ids, (bool, np.bool_)):
    raise TypeError(f'{where}: ids must be integers, got a boolean.')
  host = np.asarray(ids)
  if host.dtype == object:
    try:
      host = host.astype(np.uint64)
    except (OverflowError, TypeError) as e:
      raise ValueError(
          f'{where}: ids must be integers in [0, 2**63 - 1]; got values '
          'outside 64 bits.') from e
  _check_integer(host.dtype, where)
  _check_range_host(host, where)
  wide = host.astype(np.uint64)
  return np.stack([(wide >> np.uint64(32)).astype(np.uint32),
                   (wide & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=-1)


def _check_integer(dtype: np.dtype, where: str) -> None:
  if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
    raise TypeError(
        f'{where}: raw ids must have an integer dtype, got {dtype}. Float ids '
        'lose digits above 2**24 (float32) or 2**53 (float64): keep ids as '
        'integers (NumPy int64, or lazy_optax.split_ids words inside jit).')


def _check_range_host(host: np.ndarray, where: str) -> None:
  if host.size == 0:
    return
  if np.issubdtype(host.dtype, np.signedinteger):
    bad = host < 0
    if bad.any():
      first = int(np.flatnonzero(bad.reshape(-1))[0])
      raise ValueError(
          f'{where}: raw ids must lie in [0, 2**63 - 1], got '
          f'{int(host.reshape(-1)[first])} at flat position {first} '
          f'({int(bad.sum())} negative ids).')
  elif host.dtype.itemsize == 8:
    bad = host > np.uint64(MAX_ID)
    if bad.any():
      first = int(np.flatnonzero(bad.reshape(-1))[0])
      raise ValueError(
          f'{where}: raw ids must lie in [0, 2**63 - 1], got '
          f'{int(host.reshape(-1)[first])} at flat position {first}.')


def _split_jax(ids: jax.Array) -> jax.Array:
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


def to_words(raw_ids: Any, where: str) -> tuple[jax.Array, tuple[int, ...]]:
  """Any accepted raw-id input as JAX words `[N, 2]`, and the ids' shape.

  Accepted: JAX or NumPy integer arrays of ids (int32 inside jit; int64 on
  the host or under x64), `uint32[..., 2]` words from `split_ids`, Python
  ints. Concrete ids are checked (negative or too large: `ValueError`);
  traced ones that are invalid (negative int32, a high word >= 2**31) get
  no slot.

  Args:
    raw_ids: the ids.
    where: who got them, for messages.

  Returns:
    `(words, shape)`: uint32 `[N, 2]` and the shape of the ids.
  """
  if isinstance(raw_ids, (bool, np.bool_)):
    raise TypeError(f'{where}: raw ids must be integers, got a boolean.')
  if not isinstance(raw_ids, (jax.Array, jax.core.Tracer, np.ndarray)):
    raw_ids = np.asarray(raw_ids)
    if raw_ids.dtype == object:
      raise ValueError(
          f'{where}: raw ids must be integers in [0, 2**63 - 1]; got values '
          'outside 64 bits.')
  dtype = _dtype_of(raw_ids)
  _check_integer(dtype, where)
  if dtype == np.uint32:
    shape = tuple(raw_ids.shape)
    if not shape or shape[-1] != 2:
      raise ValueError(
          f'{where}: uint32 ids are read as words from lazy_optax.split_ids '
          f'and need a last dimension of 2 (high, low); got shape {shape}. '
          'Give plain ids as int32 (or int64 outside jit).')
    if not _is_tracer(raw_ids):
      host = np.asarray(raw_ids)
      bad = host[..., 0] >= _HIGH_LIMIT
      if bad.any():
        first = int(np.flatnonzero(bad.reshape(-1))[0])
        raise ValueError(
            f'{where}: id words with a high word >= 2**31 are not ids in '
            f'[0, 2**63 - 1] (first at flat position {first}).')
    words = raw_ids if _is_tracer(raw_ids) else jnp.asarray(raw_ids)
    return words.reshape(-1, 2), shape[:-1]
  if isinstance(raw_ids, np.ndarray):
    words = jnp.asarray(split_ids(raw_ids))
  else:
    if not _is_tracer(raw_ids):
      _check_range_host(np.asarray(raw_ids), where)
    words = _split_jax(raw_ids)
  shape = tuple(words.shape[:-1])
  return words.reshape(-1, 2), shape


def join_words(words: Any) -> np.ndarray:
  """Words `[..., 2]` back to NumPy int64 ids (on the host)."""
  host = np.asarray(words).astype(np.uint64)
  return ((host[..., 0] << np.uint64(32)) | host[..., 1]).astype(np.int64)


def valid_words(words: jax.Array) -> jax.Array:
  """Which rows of `words [N, 2]` are ids in `[0, 2**63 - 1]`."""
  return words[:, 0] < jnp.uint32(_HIGH_LIMIT)
