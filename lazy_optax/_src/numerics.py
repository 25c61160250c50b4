"""Small numeric helpers shared by the optimizers."""

from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np
import optax

# `optax.adamw`'s `mask`: a tree of bools like the parameters, or a function
# of the parameters giving one.
Mask = Union[chex.ArrayTree, Callable[[optax.Params], chex.ArrayTree]]


def broadcast_rows(per_row: jax.Array, like: jax.Array) -> jax.Array:
  """A per-row array `[N]` reshaped to broadcast against `like` `[N, ...]`."""
  return per_row.reshape(per_row.shape + (1,) * (like.ndim - per_row.ndim))


def compute_dtype(*dtypes: DTypeLike) -> np.dtype:
  """The dtype to compute in: at least float32, wider if an input is."""
  return jnp.promote_types(jnp.float32, jnp.result_type(*dtypes))


def one_minus_power(decay: ArrayLike, count: jax.Array,
                    dtype: DTypeLike) -> jax.Array:
  """`1 - decay**count`, computed from `1 - decay` to keep its precision.

  `1 - float32(0.999)` is 1.3e-5 off `0.001`; taking `1 - decay` in Python
  (float64) and `-expm1(t * log1p(-(1 - decay)))` in `dtype` keeps the bias
  correction within a few ulps of the float64 value.

  Args:
    decay: a Python float or a scalar array, the decay rate.
    count: the step count (integer, any shape).
    dtype: floating dtype of the result.

  Returns:
    An array of `dtype` with `count`'s shape.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax._src.numerics import one_minus_power
    >>> one_minus_power(0.5, jnp.array(2), jnp.float32)
    Array(0.75, dtype=float32)
  """
  return one_minus_power_of(complement(decay, dtype), count, jnp.dtype(dtype))


def complement(decay: ArrayLike, dtype: DTypeLike) -> ArrayLike:
  """`1 - decay` in `dtype`, taken in Python's float64 for a number (a
  NumPy scalar: no array is made in a trace), in `dtype` for an array."""
  if isinstance(decay, (int, float)):
    return np.asarray(1 - decay, dtype)
  return jnp.asarray(1 - decay, dtype)


@functools.partial(jax.jit, inline=True, static_argnums=2)
def one_minus_power_of(one_minus_decay: jax.typing.ArrayLike,
                       count: jax.Array, dtype: np.dtype) -> jax.Array:
  """`one_minus_power` of `complement(decay, dtype)` (traced once per
  signature, inlined where it is called)."""
  t = jnp.asarray(count).astype(dtype)
  return -jnp.expm1(t * jnp.log1p(-jnp.asarray(one_minus_decay)))


def power(decay: ArrayLike, count: jax.Array, dtype: DTypeLike) -> jax.Array:
  """`decay**count` from the same `1 - decay` as `one_minus_power`."""
  one_minus_decay = jnp.asarray(1 - decay, dtype)
  return jnp.exp(jnp.asarray(count).astype(dtype)
                 * jnp.log1p(-one_minus_decay))


def row_norms(x: jax.Array) -> jax.Array:
  """The L2 norm of each row of `x` (`[N, ...]` -> `[N]`; `[N]`: `|x|`)."""
  if x.ndim <= 1:
    return jnp.abs(x)
  return jnp.sqrt(jnp.sum(x * x, axis=tuple(range(1, x.ndim))))


def row_mean_square(g: jax.Array) -> jax.Array:
  """Mean of `g * g` over each row: `[num_rows, ...]` -> `[num_rows]`.

  A one-dimensional `g` has one entry per row, a scalar is its own row.
  """
  if g.ndim <= 1:
    return g * g
  return jnp.mean(g * g, axis=tuple(range(1, g.ndim)))


def per_row_full(p: ArrayLike, dtype: Optional[DTypeLike],
                 value: float = 0.0) -> jax.Array:
  """A `[num_rows]` array (a scalar for a scalar `p`) filled with `value`.

  The dtype defaults to float32 (float64 for a float64 parameter): one
  number per row costs little, and a 16-bit accumulator of squares loses
  small increments.
  """
  if dtype is None:
    dtype = compute_dtype(jnp.asarray(p).dtype)
  return jnp.full(jnp.shape(p)[:1], value, dtype)


def is_zero(x: object) -> bool:
  """Whether `x` is a Python number equal to 0 (never true for arrays).

  Hyperparameters may arrive as arrays (`optax.inject_hyperparams`), even
  traced ones, so only Python numbers decide the structure of a rule.
  """
  return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0


def mask_leaves(mask: Optional[Mask], params: optax.Params,
                treedef: jax.tree_util.PyTreeDef) -> list[bool]:
  """`optax.adamw`'s `mask` (a tree of bools, a callable or None), flattened
  along `treedef`: one bool per leaf."""
  if mask is None:
    return [True] * treedef.num_leaves
  return treedef.flatten_up_to(mask(params) if callable(mask) else mask)
