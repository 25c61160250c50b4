"""Reading, writing and adding whole rows of a table: XLA or the CPU kernels.

Every row-sparse path of the library moves rows through these three
functions (`lazy(...)`'s gathers and write-backs, `apply_updates`'s
scatter-add), each told the table's `backend.Backend`: where its
`row_kernels` is set (the table lives on one device, the CPU kernels are
loaded, and the `impl=` asked for allows them) they lower to the kernels on
CPU (`jax.lax.platform_dependent`: the platform is fixed when the step is
compiled) and to XLA's gather and scatter elsewhere; otherwise to XLA's
only. Without a backend they take `backend.for_array(table)` (`'auto'`).
Ids outside `[0, num_rows)` read zeros and write nothing either way.
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


def add(table: jax.Array, ids: jax.Array, rows: jax.Array,
        backend: Optional[_backend.Backend] = None) -> jax.Array:
  """`table` with `rows` added at `ids` (repeated ids add up)."""
  if (table.ndim >= 1 and _kernel_ids(ids) and kernels_for(table, backend)
      and jnp.dtype(table.dtype) in cpu_kernels.STORAGE_DTYPES):
    return jax.lax.platform_dependent(table, ids, rows,
                                      cpu=cpu_kernels.scatter_add,
                                      default=_xla_add)
  return _xla_add(table, ids, rows)


def after(x: jax.Array, *deps: jax.Array,
          backend: Optional[_backend.Backend] = None) -> jax.Array:
  """`x`, ordered after the computation of `deps` (no copy, no arithmetic).

  A loss linear in its looked-up rows has a gradient that does not depend on
  them, and then nothing orders the lookup (a read of the table) before the
  table's in-place update: XLA copies the whole donated table every step.
  Passing the gradient through `after(grad, rows)` restores the order. On
  one CPU device it is a call XLA cannot see through; elsewhere an
  `optimization_barrier`, which XLA may drop (`warn_if_not_donated` then
  reports the copy).
  """
  if not deps:
    return x
  if kernels_for(x, backend):
    return jax.lax.platform_dependent(
        x, *deps, cpu=cpu_kernels.after,
        default=lambda x, *d: jax.lax.optimization_barrier((x, d))[0])
  return jax.lax.optimization_barrier((x, deps))[0]
