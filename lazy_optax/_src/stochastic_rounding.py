"""Stochastic rounding of updates added to 16-bit tables.

A bfloat16 weight near 1.0 has 8 bits of precision: adding any update
smaller than 2^-8 and rounding to nearest gives the weight back unchanged,
so a bfloat16 table trained with small learning rates stops learning.
`apply_updates_stochastic` rounds `w + u` up or down at random, without
bias, with bits drawn per row (see its docstring).
"""

from __future__ import annotations

from typing import Optional
import zlib

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import optax

from lazy_optax._src import sharding as _sharding
from lazy_optax._src.apply import apply_updates
from lazy_optax._src.distinct import deduplicate
from lazy_optax._src.labels import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows

_ROUNDED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def rounds_stochastically(dtype: DTypeLike) -> bool:
  """Whether `apply_updates_stochastic` rounds leaves of this dtype."""
  return jnp.dtype(dtype) in _ROUNDED


def stochastic_round(x: jax.Array, dtype: DTypeLike,
                     key: jax.Array) -> jax.Array:
  """Rounds float32 `x` to `dtype` up or down at random, without bias.

  Each entry goes to the neighbour above with probability
  `(x - below) / (above - below)` and to the one below otherwise, so the
  expected result is `x` (entries already representable stay exact). Values
  beyond the largest finite number of `dtype` saturate to it; NaN and
  infinities pass through.

  Args:
    x: a float32 (or wider) array.
    dtype: the target floating dtype (bfloat16 or float16).
    key: a `jax.random` key; the result is a function of `x`, `dtype` and
      `key` only.

  Returns:
    An array of `dtype` with `x`'s shape.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from lazy_optax.precision import stochastic_round
    >>> x = jnp.full((100_000,), 1.0 + 2.0**-10, jnp.float32)  # 1/8 ulp
    >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.astype(jnp.float32).tolist()))  # the two neighbours
    [1.0, 1.0078125]
    >>> p_up = float(jnp.mean(y.astype(jnp.float32) == 1.0078125))
    >>> abs(p_up - 0.125) < 0.005                     # x is 1/8 of the way up
    True
  """
  dtype = jnp.dtype(dtype)
  x = jnp.asarray(x)
  wide = jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(wide)
  # Behind a barrier: XLA may otherwise drop the round trip `x` -> `dtype`
  # -> `wide` of `near` below (excess precision, as XLA:GPU does by
  # default), making `near` equal to `x` and the rounding biased.
  nearest = jax.lax.optimization_barrier(x.astype(dtype))
  near = nearest.astype(wide)
  finite_max = jnp.asarray(jnp.finfo(dtype).max, dtype)
  # The neighbour on the other side of x.
  other = neighbour(nearest, up=near <= x)
  # Past the largest finite value, nearest is an infinity: saturate.
  overflow = jnp.isinf(nearest) & jnp.isfinite(x)
  nearest = jnp.where(overflow, jnp.sign(x).astype(dtype) * finite_max,
                      nearest)
  near = nearest.astype(wide)
  other = jnp.where(overflow, nearest, other)
  far = other.astype(wide)
  gap = far - near
  # Probability of taking `other`: the distance from nearest, over the gap.
  prob = jnp.where(gap != 0, (x - near) / jnp.where(gap != 0, gap, 1), 0)
  u = jax.random.uniform(key, x.shape, wide)
  out = jnp.where(u < prob, other, nearest)
  return jnp.where(jnp.isfinite(x), out, x.astype(dtype))


def neighbour(x: jax.Array, up: jax.Array) -> jax.Array:
  """The next representable value after `x` toward +inf (`up`) or -inf.

  `jnp.nextafter(x, +-inf)` for a 16- or 32-bit float `x`, by integer steps
  of the bit pattern (elementwise integer ops only, which every sharding
  and batching rule handles): moving away from zero adds one to the
  pattern, toward zero subtracts one, and zero steps to the smallest
  subnormal of the direction's sign. An infinity steps back to the largest
  finite value (and stays where it points outward); NaN stays NaN.

  Args:
    x: a float16, bfloat16 or float32 array.
    up: bool, broadcastable to `x`: step toward +inf where True.

  Returns:
    An array like `x`.
  """
  uint = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  bits = jax.lax.bitcast_convert_type(x, uint)
  sign = jnp.asarray(1 << (8 * jnp.dtype(uint).itemsize - 1), uint)
  negative = (bits & sign) != 0
  zero = (bits & ~sign) == 0
  one = jnp.asarray(1, uint)
  away = up != negative   # moving away from zero
  stepped = jnp.where(away, bits + one, bits - one)
  smallest = jnp.where(up, one, sign | one)
  out = jax.lax.bitcast_convert_type(
      jnp.where(zero, smallest, stepped).astype(uint), x.dtype)
  # NaN stays; an infinity has nothing beyond it.
  return jnp.where(jnp.isnan(x) | (jnp.isinf(x) & away), x, out)


def _round_rows(exact: jax.Array, row_ids: jax.Array, key: jax.Array,
                dtype: DTypeLike) -> jax.Array:
  """Rounds `exact[i]` with the bits of row `row_ids[i]`."""
  return jax.vmap(lambda x, r: stochastic_round(
      x, dtype, jax.random.fold_in(key, r)))(exact, row_ids)


def _row_ids(like: jax.Array) -> jax.Array:
  """`arange(like.shape[0])`, split like `like`'s rows on an Explicit mesh.

  `jax.vmap` over the rows of a table with Explicit row sharding needs the
  row ids sharded the same way (Auto axes and one device need nothing).
  """
  ids = jnp.arange(like.shape[0])
  mesh = _sharding.explicit_mesh(like)
  if mesh is None:
    return ids
  spec = jax.typeof(like).sharding.spec
  return jax.sharding.reshard(ids, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(spec[0] if len(spec) else None)))


def _add_rounded(path: jax.tree_util.KeyPath, param: Optional[ArrayLike],
                 update: ArrayLike | SparseRows, key: jax.Array,
                 step: ArrayLike) -> Optional[jax.Array]:
  if param is None:
    return None
  param = jnp.asarray(param)
  name = path_name(path)
  if not rounds_stochastically(param.dtype):
    # Keyed by the path's name, so that apply_updates' messages name it.
    return apply_updates({name: param}, {name: update})[name]
  leaf_key = jax.random.fold_in(
      jax.random.fold_in(key, jnp.asarray(step, jnp.uint32)),
      zlib.crc32(name.encode()) & 0x7FFFFFFF)
  dtype = param.dtype
  if isinstance(update, SparseRows):
    if tuple(param.shape) != update.shape:
      raise ValueError(
          f'Parameter {name} has shape {tuple(param.shape)} but its '
          f'SparseRows update is for shape {update.shape}.')
    unique = deduplicate(update)  # unused slots hold id num_rows: dropped
    values = unique.values.astype(jnp.float32)

    ids = unique.ids
    rows = param.at[ids].get(mode='fill', fill_value=0,
                             **_sharding.gather_kwargs(param))
    new_rows = _round_rows(rows.astype(jnp.float32) + values, ids, leaf_key,
                           dtype)
    return param.at[ids].set(new_rows, mode='drop',
                             **_sharding.scatter_kwargs(param))
  update = jnp.asarray(update)
  if tuple(update.shape) != tuple(param.shape):
    raise ValueError(
        f'Parameter {name} has shape {tuple(param.shape)} but its update has '
        f'shape {tuple(update.shape)}.')
  exact = param.astype(jnp.float32) + update.astype(jnp.float32)
  if param.ndim == 0:
    return stochastic_round(exact, dtype, jax.random.fold_in(leaf_key, 0))
  return _round_rows(exact, _row_ids(exact), leaf_key, dtype)


def apply_updates_stochastic(
    params: optax.Params,
    updates: optax.Updates,
    *,
    key: jax.Array,
    step: ArrayLike,
) -> optax.Params:
  """`apply_updates`, with stochastic rounding into 16-bit parameters.

  For every bfloat16 or float16 parameter, `param + update` is computed in
  float32 and rounded to the parameter's dtype with `stochastic_round`, so
  updates below half a unit in the last place still move the weights on
  average (round to nearest would drop them). A `SparseRows` update is
  deduplicated and only its rows are read, rounded and written (O(batch));
  other rows stay bit-for-bit. Parameters of other dtypes get
  `apply_updates`. Under `jax.jit`, donate the parameters as for
  `apply_updates`.

  The random bits of row `r` of parameter `emb/table` come from
  `fold_in(fold_in(fold_in(key, step), crc32('emb/table')), r)`: the same
  `key`, `step` and rows give the same bits whatever the order of the ids in
  the batch, the mesh or the number of devices. Pass the optimizer's step
  (`lazy_optax.compat.global_step(opt_state)`) so each step draws new bits.

  Args:
    params: a tree of parameters.
    updates: a tree of updates of the same structure (dense arrays or
      `SparseRows`).
    key: a `jax.random` key (the run's seed).
    step: an integer scalar (Python int or array), the training step.

  Returns:
    The updated parameters, with the structure, shapes and dtypes of
    `params`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.ones((4, 8192), jnp.bfloat16)}
    >>> updates = {'table': lazy_optax.SparseRows(
    ...     jnp.array([1]), jnp.full((1, 8192), 1e-3), 4)}  # < half an ulp
    >>> lazy_optax.apply_updates(params, updates)['table'][1].astype(
    ...     jnp.float32).mean()                    # round to nearest: lost
    Array(1., dtype=float32)
    >>> new = lazy_optax.precision.apply_updates_stochastic(
    ...     params, updates, key=jax.random.key(0), step=1)['table']
    >>> round(float(new[1].astype(jnp.float32).mean() - 1), 3)  # kept
    0.001
    >>> bool((new[0] == 1).all())                  # untouched row
    True
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, p, u: _add_rounded(path, p, u, key, step),
      params, updates, is_leaf=lambda x: x is None or is_sparse_rows(x))
