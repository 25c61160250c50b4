"""The integer hashes of the id table: home slots, sketch rows, per-id keys.

Everything here is a few rounds of 32-bit integer mixing (the murmur3
finalizer's structure with better constants), cheap on every backend and the
same on all of them:

* `home_slots`: where an id's probe window starts;
* `sketch_columns`: the count-min sketch's column of an id in each row;
* `id_keys`: a PRNG key per raw id, derived from a user key, for the
  fresh rows of `reset_rows` ("the same id always starts from the same
  row"). The keys are of a counter-based PRNG defined here with
  `jax.extend.random.define_prng_impl`, whose random bits are two mixing
  rounds per 32-bit word: a `[4096, 64]` block of `jax.random.uniform` rows
  costs about a tenth of threefry's. Any `jax.nn.initializers` function
  takes these keys.
"""

from __future__ import annotations

import math

import jax
from jax.extend import random as jax_random
import jax.numpy as jnp

from lazy_optax._src import id_words

_GOLDEN = 0x9E3779B9
_SALT_HOME = 0x243F6A88
_SALT_SKETCH = 0x85A308D3
_SALT_KEY0 = 0x13198A2E
_SALT_KEY1 = 0x03707344
_SALT_SPLIT = 0xA4093822
_SALT_FOLD = 0x299F31D0


def mix32(x: jax.Array) -> jax.Array:
  """A 32-bit avalanche mix of a uint32 array (a bijection)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _u32(value: int) -> jax.Array:
  return jnp.uint32(value & 0xFFFFFFFF)


def hash_words(words: jax.Array, salt: int) -> jax.Array:
  """A uint32 hash of id words `[..., 2]` (a bijection of the low word)."""
  high, low = words[..., 0], words[..., 1]
  return mix32(low ^ mix32(high ^ _u32(salt)))


def home_slots(words: jax.Array, capacity: int, seed: int) -> jax.Array:
  """The first slot of each id's probe window, in `[0, capacity)` (uint32)."""
  return hash_words(words, _SALT_HOME ^ seed) % jnp.uint32(capacity)


def sketch_columns(words: jax.Array, depth: int, width: int,
                   seed: int) -> jax.Array:
  """Each id's column in each of the sketch's `depth` rows: `[depth, N]`."""
  base = hash_words(words, _SALT_SKETCH ^ seed)
  rows = [mix32(base ^ _u32((d + 1) * _GOLDEN)) % jnp.uint32(width)
          for d in range(depth)]
  return jnp.stack(rows).astype(jnp.int32)


# -- a counter-based PRNG for per-id keys --------------------------------------

def _bits(key: jax.Array, counter: jax.Array) -> jax.Array:
  return mix32(mix32(counter ^ key[..., 0]) + key[..., 1])


def _seed(seed: jax.Array) -> jax.Array:
  first = hash_words(id_words.split_jax(jnp.asarray(seed)), _SALT_KEY0)
  return jnp.stack([first, mix32(first ^ _u32(_SALT_KEY1))])


def _split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  n = math.prod(shape)
  counter = jax.lax.iota(jnp.uint32, 2 * n) ^ _u32(_SALT_SPLIT)
  words = _bits(key, counter).reshape(n, 2)
  return words.reshape(*shape, 2)


def _fold_in(key: jax.Array, data: jax.typing.ArrayLike) -> jax.Array:
  data = jnp.asarray(data).astype(jnp.uint32)
  first = mix32(key[0] ^ mix32(data ^ _u32(_SALT_FOLD)))
  return jnp.stack([first, mix32(key[1] ^ first)])


def _random_bits(key: jax.Array, bit_width: int,
                 shape: tuple[int, ...]) -> jax.Array:
  n = math.prod(shape)
  if bit_width == 64:
    words = _bits(key, jax.lax.iota(jnp.uint32, 2 * n)).reshape(n, 2)
    wide = (words[:, 0].astype(jnp.uint64) << 32) | words[:, 1].astype(
        jnp.uint64)
    return wide.reshape(shape)
  words = _bits(key, jax.lax.iota(jnp.uint32, n)).reshape(shape)
  if bit_width == 32:
    return words
  dtype = {8: jnp.uint8, 16: jnp.uint16}[bit_width]
  return (words >> (32 - bit_width)).astype(dtype)


ID_PRNG_IMPL = jax_random.define_prng_impl(
    key_shape=(2,), seed=_seed, split=_split, random_bits=_random_bits,
    fold_in=_fold_in, name='lazy_optax_id_hash', tag='lzid')


def key_words(key: jax.typing.ArrayLike) -> jax.Array:
  """A user PRNG key (typed or raw) as two uint32 words."""
  if isinstance(key, (jax.Array, jax.core.Tracer)) and jnp.issubdtype(
      key.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(key)
  else:
    data = jnp.asarray(key)
    if not jnp.issubdtype(data.dtype, jnp.integer):
      raise TypeError(
          'reset_rows: key must be a jax.random key (jax.random.key(0)), got '
          f'an array of dtype {data.dtype}.')
  data = data.reshape(-1).astype(jnp.uint32)
  if data.shape[0] == 0:
    raise ValueError('reset_rows: key holds no data.')
  first, second = _u32(_SALT_KEY0), _u32(_SALT_KEY1)
  for k in range(data.shape[0]):
    first = mix32(first ^ data[k])
    second = mix32(second + data[k] + first)
  return jnp.stack([first, second])


def id_keys(key: jax.typing.ArrayLike, words: jax.Array) -> jax.Array:
  """One key per id (of `ID_PRNG_IMPL`), a function of the key and the id.

  Args:
    key: a `jax.random` key (the same for every step).
    words: id words `[N, 2]`.

  Returns:
    `N` typed PRNG keys.
  """
  base = key_words(key)
  first = mix32(words[:, 1] ^ mix32(words[:, 0] ^ base[0]))
  second = mix32(first ^ mix32(words[:, 0] + base[1]))
  data = jnp.stack([first, second], axis=-1)
  return jax.random.wrap_key_data(data, impl=ID_PRNG_IMPL)
