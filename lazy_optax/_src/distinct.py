"""Distinct rows: where a `SparseRows` sums its repeated ids, and reads them.

A `SparseRows` sums the values of repeated ids when it is built (`from_ids`),
in as many slots as there were ids: the distinct ids ascending in the front
slots, id `num_rows` (no row) with zero values in the rest. Out-of-range ids
touch no row either; they are kept in unused slots so that the checked mode
can still name them. So its pytree leaves are distinct rows as they are, and
what reads them (`distinct_rows`, for `lazy(...)`) does no work, except for
rows read back from an id code that tree arithmetic may have reordered.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, TYPE_CHECKING

import jax
import jax.numpy as jnp

from lazy_optax._src import backend as _backend
from lazy_optax._src import branching
from lazy_optax._src import dedup
from lazy_optax._src import id_code
from lazy_optax._src import sharding as _sharding

if TYPE_CHECKING:
  from lazy_optax._src.sparse_rows import SparseRows


def _with_out_of_range(unique_ids: jax.Array, ids: jax.Array,
                       outside: jax.Array, num_rows: int) -> jax.Array:
  """`unique_ids` whose unused slots also hold the out-of-range ids.

  There are at least as many unused slots as out-of-range ids.
  """
  n = ids.shape[0]
  # The unused slots are the last ones (the named ids come first): the
  # r-th out-of-range id goes to the r-th of them.
  named = jnp.sum(unique_ids != num_rows, dtype=jnp.int32)
  outside_rank = jnp.cumsum(outside.astype(jnp.int32)) - 1
  target = jnp.where(outside, named + outside_rank, n)
  return unique_ids.at[target].set(ids, mode='drop')


def from_ids(ids: jax.Array, values: jax.Array,
             num_rows: int) -> tuple[jax.Array, jax.Array]:
  """Distinct ids and summed values of `(ids, values)`, in `N` slots, with
  XLA's ops (outside `lazy(...)`'s decision); compiled once per signature
  (once for every table size where the ids fit `dedup.keeps_outside`).

  Args:
    ids: integer vector `[N]`, any values (out-of-range ones touch no row).
    values: `[N, *row_shape]`.
    num_rows: the table's row count.

  Returns:
    `(ids, values)` of the same shapes and dtypes.
  """
  # Refused before the sums below hide it.
  id_code.check_varying(ids, values, 'SparseRows')
  if ids.shape[0] == 0:
    return ids, values
  ids = _sharding.replicate_if_explicit(ids)
  values = _sharding.replicate_if_explicit(values)
  if dedup.keeps_outside(num_rows, ids.shape[0], ids.dtype):
    return dedup.unique_rows_keeping_outside(
        ids, values, jnp.asarray(num_rows, ids.dtype))
  return _from_ids_sorted(ids, values, num_rows)


@functools.partial(jax.jit, static_argnums=2)
def _from_ids_sorted(ids: jax.Array, values: jax.Array, num_rows: int
                     ) -> tuple[jax.Array, jax.Array]:
  outside = (ids < 0) | (ids > num_rows)
  safe = jnp.where(outside, jnp.asarray(num_rows, ids.dtype), ids)
  unique_ids, summed = dedup.unique_rows(safe, values, num_rows,
                                         _backend.OUTSIDE_LAZY)
  unique_ids = branching.per_platform(
      functools.partial(keep_out_of_range_skipping, num_rows=num_rows),
      functools.partial(keep_out_of_range_branch_free, num_rows=num_rows),
      unique_ids, ids, outside)
  return unique_ids, summed


def from_ids_of_tables(parts: Sequence[tuple[jax.Array, jax.Array, int]]
                       ) -> list[tuple[jax.Array, jax.Array]]:
  """`from_ids` of several tables' rows: those alike in one program.

  Tables whose ids share a shape and dtype, whose values do too, and whose
  ids fit packed keys (`dedup.keeps_outside`), outside Explicit meshes and
  `shard_map`, are deduplicated together
  (`dedup.unique_rows_keeping_outside_stacked`); the others one by one. The
  results are those of `from_ids`, bit for bit.

  Args:
    parts: `(ids, values, num_rows)` of each table, as for `from_ids`.

  Returns:
    `from_ids(*part)` of each part, in order.
  """
  groups: dict[tuple, list[int]] = {}
  for k, (ids, values, num_rows) in enumerate(parts):
    if _stackable(ids, values, num_rows):
      key = (ids.shape, ids.dtype, values.shape, values.dtype)
      groups.setdefault(key, []).append(k)
  out: list[Optional[tuple[jax.Array, jax.Array]]] = [None] * len(parts)
  for members in groups.values():
    if len(members) < 2:
      continue
    ids, values = dedup.unique_rows_keeping_outside_stacked(
        jnp.stack([parts[k][0] for k in members]),
        jnp.stack([parts[k][1] for k in members]),
        tuple(parts[k][2] for k in members))
    for t, k in enumerate(members):
      out[k] = (ids[t], values[t])
  return [done if done is not None else from_ids(*part)
          for done, part in zip(out, parts)]


def _stackable(ids: jax.Array, values: jax.Array, num_rows: int) -> bool:
  if not ids.shape[0] or not dedup.keeps_outside(num_rows, ids.shape[0],
                                                 ids.dtype):
    return False
  return not any(_sharding.explicit_mesh(x) or _sharding.varying_axes(x)
                 for x in (ids, values))


def keep_out_of_range_skipping(unique_ids: jax.Array, ids: jax.Array,
                               outside: jax.Array, num_rows: int
                               ) -> jax.Array:
  """`_with_out_of_range` under `lax.cond`: only a batch with out-of-range
  ids pays for keeping them (the CPU's version)."""
  return jax.lax.cond(
      jnp.any(outside),
      lambda u: _with_out_of_range(u, ids, outside, num_rows),
      lambda u: u, unique_ids)


def keep_out_of_range_branch_free(unique_ids: jax.Array, ids: jax.Array,
                                  outside: jax.Array, num_rows: int
                                  ) -> jax.Array:
  """`_with_out_of_range` always: without out-of-range ids its writes all
  drop, so it gives `keep_out_of_range_skipping`'s bits without a
  conditional (the version for GPU and TPU)."""
  return _with_out_of_range(unique_ids, ids, outside, num_rows)


@functools.partial(jax.jit, static_argnums=2)
def from_code(code: jax.Array, values: jax.Array,
              num_rows: int) -> tuple[jax.Array, jax.Array]:
  """`from_ids` for rows held as an id code (a damaged code passes as it is).

  Args:
    code: the id code `[N, C]`.
    values: `[N, *row_shape]`.
    num_rows: the table's row count.

  Returns:
    `(code, values)`: of the distinct rows when every entry is intact, else
    as given, so that the consumer still sees (and reports) the damage.
  """
  decoded = id_code.decode(code, id_code.index_dtype(num_rows))
  ok = ~jnp.any(id_code.damaged(decoded, values))
  ids = jnp.where(decoded.intact, decoded.ids,
                  jnp.asarray(num_rows, decoded.ids.dtype))
  unique_ids, summed = from_ids(ids, values, num_rows)
  return (jnp.where(ok, id_code.encode(unique_ids), code),
          jnp.where(ok, summed, values))


class UniqueRows(NamedTuple):
  """Deduplicated rows: `ids[k]` unique or `num_rows` (an unused slot)."""
  ids: jax.Array
  values: jax.Array


def prepare(grad: SparseRows, where: str) -> tuple[jax.Array, jax.Array, int]:
  """A `SparseRows`'s `(safe ids, values, num_rows)`, checked.

  Under an Explicit mesh the global batch is gathered first (see sharding).

  Args:
    grad: a `SparseRows`.
    where: what `grad` is, for messages.

  Returns:
    `(ids, values, num_rows)` with every id that must touch no row set to
    `num_rows`.
  """
  grad.check(where)
  ids = _sharding.replicate_if_explicit(grad.safe_ids(where))
  if ids.shape[0] == 0:
    return ids, grad.values, grad.num_rows
  values = _sharding.replicate_if_explicit(grad.values)
  return ids, values, grad.num_rows


def distinct_rows(grad: SparseRows, where: str,
                  backend: Optional[_backend.Backend] = None
                  ) -> tuple[jax.Array, jax.Array]:
  """A `SparseRows`'s distinct ids and summed values, checked.

  Its rows are distinct already; only rows read back from an id code are
  tested (their ids must still increase: tree arithmetic that concatenated
  or permuted the leaves falls back to `dedup.unique_rows` under `lax.cond`).

  Args:
    grad: a `SparseRows`.
    where: what `grad` is, for messages.
    backend: the table's `Backend`, for the fallback's deduplication (None:
      XLA's, as outside `lazy(...)`).

  Returns:
    `(ids, values)`: ids `[N]` distinct or `num_rows`, values zero in the
    slots that name no row.
  """
  ids, values, num_rows = prepare(grad, where)
  if ids.shape[0] == 0:
    return ids, values

  def as_they_are(ids, values):
    keep = (ids < num_rows).reshape(ids.shape + (1,) * (values.ndim - 1))
    return ids, jnp.where(keep, values, jnp.zeros_like(values))

  if grad.has_trusted_ids:  # built here: distinct, unused slots hold zeros
    return ids, values
  return jax.lax.cond(dedup.increasing(ids, num_rows), as_they_are,
                      lambda i, v: dedup.unique_rows(
                          i, v, num_rows, backend or _backend.OUTSIDE_LAZY),
                      ids, values)


def deduplicate(grad: SparseRows, where: str | None = None) -> UniqueRows:
  """Sums the values of repeated ids into one slot per distinct id.

  The result keeps static shapes: as many slots as there were ids. Slots left
  over hold id `num_rows` (one past the last row) and zero values, so that a
  scatter with `mode="drop"` ignores them; out-of-range and damaged ids land
  there too.

  Args:
    grad: a `SparseRows`.
    where: what `grad` is, for messages (`'parameter emb/table'`).

  Returns:
    A `UniqueRows` with `ids` of shape `[N]` and `values` of shape
    `[N, *row_shape]`.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax import SparseRows
    >>> from lazy_optax.tree import deduplicate
    >>> u = deduplicate(SparseRows(jnp.array([3, 1, 3]), jnp.ones((3, 1)), 5))
    >>> u.ids, u.values[:, 0]
    (Array([1, 3, 5], dtype=int32), Array([1., 2., 0.], dtype=float32))
  """
  return UniqueRows(*distinct_rows(grad, where or 'a SparseRows'))
