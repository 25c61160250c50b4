"""Deduplication of row ids: distinct ids and their summed values, in `N` slots.

Where the table's `backend.Backend` allows the row kernels (one CPU device,
the kernels loaded, `impl=` not 'xla' or 'generic'), `unique_rows` is the C++
kernel (`cpu_kernels.dedup`: a hash table, the distinct ids radix-sorted, sums
in float32). Otherwise XLA does it, and both of its ways of finding each id's
slot rest on a one-operand sort (on XLA CPU several times faster than
sorting positions along, as `argsort` does):

* **packed keys**, for batches of at most 2,048 ids whose `(num_rows + 1) <<
  bits` fits 32 bits (`bits` those of a position; every table up to 2**21
  rows at 2,048 ids): sort `id << bits | position` as one uint32; the sorted
  keys give the sorted ids and where each came from, a running count of run
  starts numbers the distinct ids, which go to the front slots in ascending
  order, and one small scatter sends each slot back to the ids' positions.
  No loop. On the 26-table DLRM step this was 10 to 14% faster than binary
  search, on 1 and 2 threads;
* **binary search**, for the rest: sort the ids alone; slot `k` stands for
  the run of equal ids that starts at `k` in the sorted ids, and each id
  finds its run's first slot with `searchsorted(method='scan')`, a `while`
  loop of `log2(N)` trips. At 4,096 ids of 64 floats packed keys were no
  faster on 1 thread and 15 to 25% slower on 2, hence the cut at 2,048.

Other ways measured slower (benchmarks/HISTORY.md): a two-operand sort,
`searchsorted` with `method='sort'` or `'compare_all'`, and one sort for all
tables of a model at once.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.typing import DTypeLike

from lazy_optax._src import backend as _backend
from lazy_optax._src import cpu_kernels
from lazy_optax._src import row_ops


def _accumulation_dtype(dtype: DTypeLike) -> DTypeLike:
  # Sum bfloat16/float16 duplicates in float32 and round once at the end:
  # a hot id repeated hundreds of times would lose most of its gradient to
  # rounding in a 16-bit running sum.
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return jnp.float32
  return dtype


# XLA's way of finding slots (`unique_rows(method=...)`): 'auto' (packed
# keys for batches of at most `PACKED_MAX_IDS` ids when they fit 32 bits,
# binary search otherwise), 'packed' (packed keys where they fit) or
# 'search'. Whether the kernel runs instead is the backend's decision.
METHODS = ('auto', 'packed', 'search')
PACKED_MAX_IDS = 2048


def position_bits(n: int) -> int:
  """Bits that hold a position in `[0, n)` (at least 1)."""
  return max(1, (n - 1).bit_length())


def packs(num_rows: int, n: int, id_dtype: DTypeLike) -> bool:
  """Whether ids in `[0, num_rows]` and positions `< n` pack into uint32."""
  return (jnp.dtype(id_dtype).itemsize == 4
          and (num_rows + 1) << position_bits(n) <= 2 ** 32)


def _use_packed(num_rows: int, n: int, id_dtype: DTypeLike,
                method: str) -> bool:
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}.')
  if method == 'search' or not packs(num_rows, n, id_dtype):
    return False
  return method == 'packed' or n <= PACKED_MAX_IDS


def _slots_packed(ids: jax.Array, num_rows: int | jax.Array,
                  keep_outside: bool = False) -> tuple[jax.Array, jax.Array]:
  # One sort of `id << bits | position` gives the sorted ids and, in the low
  # bits, where each came from; a running count of run starts numbers the
  # distinct ids (their slots, from the front), and one small scatter sends
  # each slot back to the positions of its ids. To keep the out-of-range
  # ids (below 0 or above num_rows), they sort as num_rows (after the named
  # ids, in batch order: the position is the low bits), each a run of its
  # own holding its id, and `num_rows` (no row) as num_rows + 1. The row
  # count may be an array (`unique_rows_keeping_outside_stacked`).
  n = ids.shape[0]
  bits = position_bits(n)
  code = ids
  if keep_outside:
    code = jnp.where((ids < 0) | (ids > num_rows), num_rows,
                     jnp.where(ids == num_rows, num_rows + 1, ids))
  key = (code.astype(jnp.uint32) << bits) | lax.iota(jnp.uint32, n)
  key = jnp.sort(key)
  sorted_ids = (key >> bits).astype(ids.dtype)
  position = (key & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)
  starts = jnp.concatenate(
      [jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
  held = sorted_ids
  if keep_outside:
    alone = sorted_ids == num_rows
    starts = starts | alone
    held = jnp.where(alone, ids[position], jnp.minimum(sorted_ids, num_rows))
  rank = jnp.cumsum(starts.astype(jnp.int32)) - 1
  fill = jnp.asarray(num_rows, ids.dtype)
  unique_ids = jnp.full((n,), fill).at[jnp.where(starts, rank, n)].set(
      held, mode='drop', unique_indices=True)
  slot = jnp.zeros((n,), jnp.int32).at[position].set(
      rank, unique_indices=True)
  return unique_ids, slot


def _slots_search(ids: jax.Array, num_rows: int | jax.Array,
                  search: str = 'scan') -> tuple[jax.Array, jax.Array]:
  # Slot k stands for the run of equal ids that starts at k in the sorted
  # ids; each id finds its run's first slot by binary search.
  sorted_ids = jnp.sort(ids)
  starts = jnp.concatenate(
      [jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
  fill = jnp.asarray(num_rows, ids.dtype)
  unique_ids = jnp.where(starts, sorted_ids, fill)
  slot = jnp.searchsorted(sorted_ids, ids, side='left', method=search)
  return unique_ids, slot


def keeps_outside(num_rows: int, n: int, id_dtype: DTypeLike) -> bool:
  """Whether `unique_rows_keeping_outside` takes `n` ids of this table:
  packed keys (one code more than `unique_rows`'s: `num_rows + 1`)."""
  return _use_packed(num_rows + 1, n, id_dtype, 'auto')


@functools.partial(jax.jit, inline=True)
def unique_rows_keeping_outside(ids: jax.Array, values: jax.Array,
                                num_rows: int | jax.Array
                                ) -> tuple[jax.Array, jax.Array]:
  """XLA's `unique_rows` of raw ids, out-of-range ids kept: the distinct
  named ids ascending with their summed values, then each out-of-range id
  (below 0 or above `num_rows`) in a slot of its own in batch order, then
  `num_rows`; zeros in every slot but the named ones. One sort of packed
  keys (`keeps_outside` says where they fit), no conditional: keeping the
  out-of-range ids under a `lax.cond` after the deduplication compiled the
  26-table DLRM step 1.37x slower than `optax.adam`'s on XLA's CPU.
  The row count may be an array (data: one program for every table size).
  """
  unique_ids, slot = _slots_packed(ids, num_rows, keep_outside=True)
  return _summed_into_slots(values, unique_ids, slot, num_rows)


@functools.partial(jax.jit, static_argnums=2)
def unique_rows_keeping_outside_stacked(
    ids: jax.Array, values: jax.Array, num_rows: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
  """`unique_rows_keeping_outside` of several tables at once, in one program.

  The tables' ids share a shape and dtype, and so do their values; each row
  count must pass `keeps_outside`. The row counts enter as data, so XLA
  compiles each of the program's kernels once for all the tables rather
  than once a table (the 26-table DLRM step compiled in 5.0 s against
  7.3 s with a deduplication a table, on 1 thread).

  Args:
    ids: integer `[T, N]`, table `t`'s raw ids in row `t`.
    values: `[T, N, *row_shape]`.
    num_rows: the `T` tables' row counts.

  Returns:
    `(ids, values)` of the same shapes and dtypes: row `t` is
    `unique_rows_keeping_outside(ids[t], values[t], num_rows[t])`.
  """
  counts = jnp.asarray(num_rows, ids.dtype)
  return jax.vmap(unique_rows_keeping_outside)(ids, values, counts)


@functools.partial(jax.jit, inline=True, static_argnums=3)
def _xla_unique_rows(ids: jax.Array, values: jax.Array, num_rows: jax.Array,
                     packed: bool) -> tuple[jax.Array, jax.Array]:
  # Traced once per signature (the row count is data: tables of any size
  # share it) and inlined.
  slots = _slots_packed if packed else _slots_search
  unique_ids, slot = slots(ids, num_rows)
  return _summed_into_slots(values, unique_ids, slot, num_rows)


def _summed_into_slots(values: jax.Array, unique_ids: jax.Array,
                       slot: jax.Array, num_rows: int | jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
  n = slot.shape[0]
  wide = _accumulation_dtype(values.dtype)
  summed = jax.ops.segment_sum(
      values.astype(wide), slot, num_segments=n).astype(values.dtype)
  # Values of out-of-range ids summed into the sentinel's slot, or kept in
  # slots of their own: zero them.
  keep = ((unique_ids >= 0) & (unique_ids < num_rows)).reshape(
      (n,) + (1,) * (summed.ndim - 1))
  return unique_ids, jnp.where(keep, summed, jnp.zeros_like(summed))


def unique_rows(ids: jax.Array, values: jax.Array, num_rows: int,
                backend: Optional[_backend.Backend] = None, *,
                method: str = 'auto') -> tuple[jax.Array, jax.Array]:
  """Sums the values of repeated ids into one slot per distinct id.

  Where `backend` allows the row kernels, a hash table in C++ does it
  (`cpu_kernels.dedup`, the same slots and sums); otherwise XLA's sort.

  Args:
    ids: integer vector `[N]` whose entries lie in `[0, num_rows]`; an entry
      `num_rows` touches no row (an out-of-range, damaged or empty id).
    values: `[N, *row_shape]`.
    num_rows: the table's row count.
    backend: the table's `Backend` (None: the kernel wherever it may run).
    method: XLA's way of finding slots, one of `METHODS` (for A/B
      measurements; the kernel, where it runs, ignores it).

  Returns:
    `(unique_ids, summed_values)` of shapes `[N]` and `[N, *row_shape]`:
    slot `k` holds a distinct id and the sum of its values, or id `num_rows`
    and zeros (an unused slot).
  """
  if ids.shape[0] == 0:
    return ids, values
  packed = _use_packed(num_rows, ids.shape[0], ids.dtype, method)
  rows = jnp.asarray(num_rows, ids.dtype)
  if (jnp.dtype(ids.dtype) == jnp.dtype(jnp.int32)
      and jnp.dtype(values.dtype) in cpu_kernels.STORAGE_DTYPES
      and row_ops.kernels_for(values, backend)):

    def on_cpu(ids, values):
      return cpu_kernels.dedup(ids, values, num_rows)

    return jax.lax.platform_dependent(
        ids, values, cpu=on_cpu,
        default=lambda i, v: _xla_unique_rows(i, v, rows, packed))
  return _xla_unique_rows(ids, values, rows, packed)


@functools.partial(jax.jit, inline=True, static_argnums=1)
def increasing(ids: jax.Array, num_rows: int) -> jax.Array:
  """Whether every row id in `[0, num_rows)` exceeds all row ids before it.

  Ids outside that range (unused slots) are ignored. Increasing ids are
  distinct, whatever else the array holds.
  """
  named = (ids >= 0) & (ids < num_rows)
  running = lax.cummax(jnp.where(named, ids, -1), axis=0)
  before = jnp.concatenate([jnp.full((1,), -1, ids.dtype), running[:-1]])
  return jnp.all(~named | (ids > before))
