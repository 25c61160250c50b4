"""Reading, writing and adding whole rows of a table: XLA or the CPU kernels.

`lazy(...)`'s gathers and write-backs (`gather`, `put`) are told the
table's `backend.Backend`: where its `row_kernels` is set (the table lives
on one device, the CPU kernels are loaded, and the `impl=` asked for allows
them) they lower to the kernels on CPU (`jax.lax.platform_dependent`: the
platform is fixed when the step is compiled) and to XLA's gather and
scatter elsewhere; otherwise to XLA's only (without a backend, the
kernels wherever they may run). Outside `lazy(...)` rows move with
XLA's ops: `add` (`apply_updates`) and `after` (`value_and_grad`). Ids
outside `[0, num_rows)` read zeros and write nothing either way.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lazy_optax._src import backend as _backend
from lazy_optax._src import cpu_kernels
from lazy_optax._src import sharding as _sharding


def kernels_for(x: ArrayLike, backend: Optional[_backend.Backend]) -> bool:
  """Whether the row-move kernels run on `x` under `backend`.

  A backend can keep the kernels off; it never sends them where they cannot
  run (loaded, one device, CPU or a platform settled when the step is
  lowered). Without a backend, that alone decides ('auto').
  """
  if backend is not None and not backend.row_kernels:
    return False
  return _backend.row_kernels_allowed(_backend.placement(x))


def _kernel_ids(ids: jax.Array) -> bool:
  return jnp.dtype(ids.dtype) == jnp.dtype(jnp.int32)


# XLA's row moves are traced once per signature and inlined, so a step of
# many tables, or many traces of one step, reuse the trace.
@functools.partial(jax.jit, inline=True)
def _xla_gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  return table.at[ids].get(mode='fill', fill_value=0,
                           **_sharding.gather_kwargs(table))


@functools.partial(jax.jit, inline=True)
def _xla_put(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  return table.at[ids].set(rows.astype(table.dtype), mode='drop',
                           **_sharding.scatter_kwargs(table))


@functools.partial(jax.jit, inline=True)
def _xla_add(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  return table.at[ids].add(rows.astype(table.dtype), mode='drop',
                           **_sharding.scatter_kwargs(table))


def gather(table: jax.Array, ids: jax.Array,
           backend: Optional[_backend.Backend] = None) -> jax.Array:
  """`table[ids]`, zero rows where an id lies outside `[0, num_rows)`.

  `ids` is a vector. Not differentiable through `table` on the kernel's path.
  """
  if table.ndim >= 1 and _kernel_ids(ids) and kernels_for(table, backend):
    return jax.lax.platform_dependent(table, ids, cpu=cpu_kernels.gather,
                                      default=_xla_gather)
  return _xla_gather(table, ids)


def put(table: jax.Array, ids: jax.Array, rows: jax.Array,
        backend: Optional[_backend.Backend] = None) -> jax.Array:
  """`table` with rows `ids` set to `rows`; `ids` must be distinct."""
  if table.ndim >= 1 and _kernel_ids(ids) and kernels_for(table, backend):
    return jax.lax.platform_dependent(table, ids, rows,
                                      cpu=cpu_kernels.scatter,
                                      default=_xla_put)
  return _xla_put(table, ids, rows)


def add(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  """`table` with `rows` added at `ids` (repeated ids add up), by XLA: what
  adds an update outside `lazy(...)` (`apply_updates`)."""
  return _xla_add(table, ids, rows)


def after(x: jax.Array, rows: jax.Array) -> jax.Array:
  """`x`, computed from the rows read: a select whose condition never holds.

  A loss linear in its looked-up rows has a gradient that does not depend on
  them, and then nothing orders the lookup (a read of the table) before the
  table's in-place update: XLA copies the whole donated table every step
  (an `optimization_barrier` does not keep the order: XLA's CPU compiler
  drops it). `after(grad, rows)` keeps `grad` and reads every row first: it
  picks zeros where a row's sign bit, shifted to the lowest bit, exceeds 1,
  which it never does (XLA does not fold it away, so the order holds).
  Under a mesh with Explicit axes, where the rows are split like the batch
  and `grad` may not be, it is an `optimization_barrier` (a select there
  would need one sharding for both).

  Args:
    x: `[N, *row_shape]`, the gradient's values.
    rows: of `x`'s shape, the rows the lookups read.

  Returns:
    `x`, the same bits.
  """
  if _sharding.explicit_mesh(rows) is not None:
    return jax.lax.optimization_barrier((x, rows))[0]
  if jnp.issubdtype(rows.dtype, jnp.complexfloating):
    rows = jnp.real(rows)
  bits = jnp.dtype(rows.dtype).itemsize * 8
  word = jax.lax.bitcast_convert_type(rows, jnp.dtype(f'uint{bits}'))
  never = jax.lax.shift_right_logical(word, jnp.asarray(bits - 1, word.dtype))
  return jnp.where(never > 1, jnp.zeros_like(x), x)
