"""Reading, writing and adding whole rows of a table: XLA or the CPU kernels.

Every row-sparse path of the library moves rows through these three
functions (`lazy(...)`'s gathers and write-backs, `apply_updates`'s
scatter-add). On a table that lives on one device, where the CPU kernels are
loaded, they lower to the kernels on CPU (`jax.lax.platform_dependent`: the
platform is fixed when the step is compiled) and to XLA's gather and scatter
elsewhere; tables on several devices always take XLA's, which its
partitioner splits. Ids outside `[0, num_rows)` read zeros and write nothing
either way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lazy_optax._src import cpu_kernels
from lazy_optax._src import sharding as _sharding
from lazy_optax._src.placement import placement


def on_one_cpu(x: Any) -> bool:
  """Whether the kernels may run on `x`: loaded, one device, CPU or unknown.

  An unknown platform is settled when the step is lowered.
  """
  if not cpu_kernels.loaded():
    return False
  where = placement(x)
  return where.kind == 'one' and where.platform in (None, 'cpu')


def _kernel_ids(ids: Any) -> bool:
  return jnp.dtype(ids.dtype) == jnp.dtype(jnp.int32)


def _xla_gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  return table.at[ids].get(mode='fill', fill_value=0,
                           **_sharding.gather_kwargs(table))


def _xla_put(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  return table.at[ids].set(rows.astype(table.dtype), mode='drop',
                           **_sharding.scatter_kwargs(table))


def _xla_add(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  return table.at[ids].add(rows.astype(table.dtype), mode='drop',
                           **_sharding.scatter_kwargs(table))


def gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]`, zero rows where an id lies outside `[0, num_rows)`.

  `ids` is a vector. Not differentiable through `table` on the kernel's path.
  """
  if table.ndim >= 1 and _kernel_ids(ids) and on_one_cpu(table):
    return jax.lax.platform_dependent(table, ids, cpu=cpu_kernels.gather,
                                      default=_xla_gather)
  return _xla_gather(table, ids)


def put(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  """`table` with rows `ids` set to `rows`; `ids` must be distinct."""
  if table.ndim >= 1 and _kernel_ids(ids) and on_one_cpu(table):
    return jax.lax.platform_dependent(table, ids, rows,
                                      cpu=cpu_kernels.scatter,
                                      default=_xla_put)
  return _xla_put(table, ids, rows)


def add(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  """`table` with `rows` added at `ids` (repeated ids add up)."""
  if (table.ndim >= 1 and _kernel_ids(ids) and on_one_cpu(table)
      and jnp.dtype(table.dtype) in cpu_kernels.STORAGE_DTYPES):
    return jax.lax.platform_dependent(table, ids, rows,
                                      cpu=cpu_kernels.scatter_add,
                                      default=_xla_add)
  return _xla_add(table, ids, rows)


def after(x: jax.Array, *deps: jax.Array) -> jax.Array:
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
  if on_one_cpu(x):
    return jax.lax.platform_dependent(
        x, *deps, cpu=cpu_kernels.after,
        default=lambda x, *d: jax.lax.optimization_barrier((x, d))[0])
  return jax.lax.optimization_barrier((x, deps))[0]
