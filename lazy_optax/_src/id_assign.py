"""The steps of `IdTable.assign`, each a small pure function of arrays.

`id_pipeline.assign_xla` runs them in the order of `id_table`'s docstring:
1 `probe_windows`, 2 `expire`, 3 `admit`, 4 `id_claims.claim_rounds` (which
reads windows with `window`, `first`, `pick`, `decayed` and `estimate`), 5
`representatives`, `renew_counts`, `move_wheel`, `log_evictions` and
`add_events`. Everything here is batch-sized.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, TYPE_CHECKING

import jax
from jax import lax
import jax.numpy as jnp

from lazy_optax._src import branching
from lazy_optax._src import id_hashing
from lazy_optax._src import id_words

if TYPE_CHECKING:
  from lazy_optax._src.id_table import IdCounters
  from lazy_optax._src.id_table import IdTable

COUNT_LIMIT = 2 ** 30


def add64(count: jax.Array, n: jax.Array) -> jax.Array:
  """`count` (uint32 [high, low]) plus a non-negative int32 `n`."""
  low = count[1] + n.astype(jnp.uint32)
  carry = (low < count[1]).astype(jnp.uint32)
  return jnp.stack([count[0] + carry, low])


def after(index: jax.Array, read: jax.Array, fill: int) -> jax.Array:
  """`index`, made to depend on `read` (int32 values that are never max).

  A scatter into a donated array whose indices do not depend on an earlier
  gather from it makes XLA copy the whole array first (nothing orders the
  gather before the in-place write); measured here on every such pair. This
  keeps the indices as they are and adds the dependency.
  """
  return jnp.where(read != jnp.iinfo(jnp.int32).max, index, fill)


def window(array: jax.Array, homes: jax.Array, probe: int) -> jax.Array:
  """`array[homes[i] : homes[i] + probe]` for each i: `[N, probe, ...]`."""
  rest = array.shape[1:]
  dims = lax.GatherDimensionNumbers(
      offset_dims=tuple(range(1, 2 + len(rest))), collapsed_slice_dims=(),
      start_index_map=(0,))
  return lax.gather(array, homes[:, None], dims, (probe, *rest),
                    mode='clip')


def first(mask: jax.Array) -> jax.Array:
  """The first True column of each row of `mask [N, P]`, or P (int32).

  Two plain reductions: on XLA CPU `argmin`/`argmax` (a variadic reduce)
  measured several times slower.
  """
  probe = mask.shape[1]
  return jnp.min(jnp.where(mask, lax.iota(jnp.int32, probe)[None, :], probe),
                 axis=1)


def pick(values: jax.Array, j: jax.Array) -> jax.Array:
  """`values[i, j[i]]` for `values [N, P]` (zero where `j[i]` is P)."""
  hit = lax.iota(jnp.int32, values.shape[1])[None, :] == j[:, None]
  if values.dtype == jnp.bool_:
    return jnp.any(hit & values, axis=1)
  return jnp.sum(jnp.where(hit, values, jnp.zeros((), values.dtype)), axis=1,
                 dtype=values.dtype)


def count(mask: jax.Array) -> jax.Array:
  """The number of True entries of `mask`, int32 (under x64 too)."""
  return jnp.sum(mask, dtype=jnp.int32)


def decayed(counts: jax.Array, seen: jax.Array, now: jax.Array,
            period: int) -> jax.Array:
  """`'lfu'` counts halved once per `period` boundary since `seen`.

  `max(seen, 0)` and `period` are non-negative, so the per-slot quotient is
  a plain (truncating) division: the floor division's sign fix-ups would
  cost several operations per window entry for the same values.
  """
  halvings = jnp.floor_divide(now, period) - lax.div(
      jnp.maximum(seen, 0), jnp.asarray(period, seen.dtype))
  return counts >> jnp.clip(halvings, 0, 31)


def alive_in(table: IdTable, window_words: jax.Array, window_seen: jax.Array,
             now: jax.Array) -> jax.Array:
  """Which slots hold a live id: occupied, and seen within `ttl` of `now`."""
  occupied = window_words[..., 0] != jnp.uint32(id_words.EMPTY_WORD)
  if table.ttl is None:
    return occupied
  return occupied & (window_seen >= now - table.ttl)


def probe_size(table: IdTable) -> int:
  """The table's probe window, in slots (`IdTable` resolves None)."""
  assert table.probe is not None
  return table.probe


def home_slots(table: IdTable, words: jax.Array) -> jax.Array:
  """The first slot of each id's probe window: int32 `[N]`.

  Windows do not wrap around: they start in `[0, capacity - probe]`, so
  each is one contiguous slice of the state (a slice gather reads it
  several times faster than `probe` separate indices).
  """
  homes = id_hashing.home_slots(
      words, table.capacity - probe_size(table) + 1, table.seed)
  return homes.astype(jnp.int32)


class Windows(NamedTuple):
  """Each id's probe window as read before the step, and its hit.

  Attributes:
    homes: int32 `[N]`, the first slot of each window.
    words: uint32 `[N, probe, 2]`, the id words held by the window's slots.
    seen: int32 `[N, probe]`, their last-seen steps.
    alive: bool `[N, probe]`, which of them hold a live id.
    hit_j: int32 `[N]`, the window position of the id (`probe`: absent).
    found: bool `[N]`, the id is valid and live in its window.
    hit_slot: int32 `[N]`, `homes + hit_j`.
    hit_seen: int32 `[N]`, the hit slot's last-seen step (0 when absent).
    counts: int32 `[N, probe]`, the slots' `'lfu'` counts (None when not
      read: other policies, and `find`).
  """
  homes: jax.Array
  words: jax.Array
  seen: jax.Array
  alive: jax.Array
  hit_j: jax.Array
  found: jax.Array
  hit_slot: jax.Array
  hit_seen: jax.Array
  counts: Optional[jax.Array] = None


def probe_windows(table: IdTable, ids: jax.Array, last_seen: jax.Array,
                  words: jax.Array, now: jax.Array,
                  counts: Optional[jax.Array] = None) -> Windows:
  """Step 1: read each id's window (one slice gather) and find its hit.

  Args:
    table: the `IdTable`.
    ids: the state's `uint32[capacity, 2]` id words.
    last_seen: the state's `int32[capacity]` last-seen steps.
    words: the batch's `uint32[N, 2]` id words.
    now: the step.
    counts: the state's `'lfu'` counts, to read with the windows (one slice
      gather serves the victims' scores and the hits' counts), or None.

  Returns:
    The `Windows`.
  """
  homes, probe = home_slots(table, words), probe_size(table)
  win_words = window(ids, homes, probe)                    # [n, P, 2]
  win_seen = window(last_seen, homes, probe)               # [n, P]
  alive = alive_in(table, win_words, win_seen, now)
  match = alive & (win_words[..., 0] == words[:, None, 0]) & (
      win_words[..., 1] == words[:, None, 1])
  hit_j = first(match)                       # probe (a live id is there once)
  found = id_words.valid_words(words) & (hit_j < probe)
  win_counts = None if counts is None else window(counts, homes, probe)
  return Windows(homes, win_words, win_seen, alive, hit_j, found,
                 homes + hit_j, pick(win_seen, hit_j), win_counts)


def expire(table: IdTable, wheel: Optional[jax.Array], live: jax.Array,
           prev: jax.Array, now: jax.Array
           ) -> tuple[Optional[jax.Array], jax.Array, jax.Array]:
  """Step 2: under `ttl`, ids last seen before `now - ttl` expire now.

  The wheel counts live ids per last-seen step modulo `ttl + 1`; the entries
  of the steps that fall out of the `ttl` horizon are the expired ids.

  Args:
    table: the `IdTable`.
    wheel: the state's wheel (None without `ttl`).
    live: the state's live count.
    prev: the state's step (-1 before any).
    now: the step.

  Returns:
    `(wheel, expired, live)`: the cleared wheel, the number of ids that
    expired, and the live count without them.
  """
  if table.ttl is None:
    return wheel, jnp.zeros((), jnp.int32), live
  assert wheel is not None
  w = table.ttl + 1
  k = lax.iota(jnp.int32, w)
  at_step = prev - jnp.mod(prev - k, w)
  expiring = (at_step < now - table.ttl) & (prev >= 0)
  expired = jnp.sum(jnp.where(expiring, wheel, 0))
  return jnp.where(expiring, 0, wheel), expired, live - expired


def estimate(table: IdTable, sketch: jax.Array, words: jax.Array,
             wanted: Optional[jax.Array] = None) -> jax.Array:
  """The sketch's count of each id (the minimum over its rows): int32 `[N]`.

  With `wanted` (bool `[N]`), only those ids are read (0 for the others):
  each count is `depth` random reads of a large array, and most of a
  batch's ids (its hits) need none.
  """
  depth, width = sketch.shape
  cols = id_hashing.sketch_columns(words, depth, width, table.seed)
  if wanted is not None:
    cols = jnp.where(wanted[None, :], cols, width)
  rows = jnp.broadcast_to(lax.iota(jnp.int32, depth)[:, None], cols.shape)
  return jnp.min(sketch.at[rows, cols].get(mode='fill', fill_value=0),
                 axis=0)


def halve_skipping(sketch: jax.Array, halvings: jax.Array) -> jax.Array:
  """The sketch halved `halvings` times, a pass over it only when that is
  not zero (the CPU's version)."""
  return lax.cond(halvings > 0, functools.partial(halve_branch_free,
                                                  halvings=halvings),
                  lambda s: s, sketch)


def halve_branch_free(sketch: jax.Array, halvings: jax.Array) -> jax.Array:
  """The sketch halved `halvings` times (a shift by zero keeps it)."""
  return sketch >> jnp.clip(halvings, 0, 31)


def admit(table: IdTable, sketch: Optional[jax.Array], words: jax.Array,
          valid: jax.Array, need: jax.Array, prev: jax.Array, now: jax.Array
          ) -> tuple[Optional[jax.Array], jax.Array, Optional[jax.Array]]:
  """Step 3: the sketch counts lookups; ids seen `admit_after` times get in.

  Under `admission='frequency'` the sketch counts every lookup and is
  halved at each `lfu_period` boundary (one pass over the sketch then);
  under `'always'` it counts lookups of ids without a row, never decaying.

  Args:
    table: the `IdTable`.
    sketch: the state's count-min sketch (None when the table has none).
    words: the batch's `uint32[N, 2]` id words.
    valid: bool `[N]`, valid ids.
    need: bool `[N]`, valid ids that hold no row.
    prev: the state's step (-1 before any).
    now: the step.

  Returns:
    `(sketch, admitted, counts)`: the updated sketch; bool `[N]`, the ids of
    `need` seen at least `admit_after` times; and int32 `[N]`, the count in
    the sketch of each id of `need` (0 for the others, which claim no slot;
    None without a sketch).
  """
  if sketch is None:
    return sketch, need, None
  all_lookups = table.admission == 'frequency'
  if all_lookups:
    halvings = jnp.where(prev >= 0, jnp.floor_divide(
        now, table.lfu_period) - jnp.floor_divide(prev, table.lfu_period), 0)
    sketch = branching.per_platform(halve_skipping, halve_branch_free,
                                    sketch, halvings)
  depth, width = sketch.shape
  cols = id_hashing.sketch_columns(words, depth, width, table.seed)
  cols = jnp.where((valid if all_lookups else need)[None, :], cols, width)
  rows = jnp.broadcast_to(lax.iota(jnp.int32, depth)[:, None], cols.shape)
  # Each lookup counted, capped: a cell looked up k times gets
  # min(cell + k, COUNT_LIMIT). An add then a min, both scatters of the
  # batch's cells (not a pass over the sketch). Both combine repeated
  # cells associatively, as XLA's deterministic GPU scatter requires: a
  # scatter that applies `min(cell + 1, limit)` once per update counted
  # a cell looked up 12 times as 1 there (`--xla_gpu_deterministic_ops`).
  sketch = sketch.at[rows, cols].add(1, mode='drop')
  sketch = sketch.at[rows, cols].min(COUNT_LIMIT, mode='drop')
  seen = estimate(table, sketch, words, need)
  if table.admit_after == 1:
    return sketch, need, seen
  return sketch, need & (seen >= table.admit_after), seen


def representatives(claims: jax.Array, slot: jax.Array, capacity: int
                    ) -> tuple[jax.Array, jax.Array]:
  """One position per slot (the last one), for what is counted per id.

  Args:
    claims: the claim scratch (all zero).
    slot: int32 `[N]`, each position's slot (`capacity`: none).
    capacity: the table's capacity.

  Returns:
    `(claims, rep)`: the scratch, zero again, and bool `[N]`: the position
    represents its slot.
  """
  key = (lax.iota(jnp.int32, slot.shape[0]) + 1).astype(jnp.uint32)
  claims = claims.at[slot].max(key, mode='drop')
  rep = (slot < capacity) & (
      claims.at[slot].get(mode='fill', fill_value=0) == key)
  claims = claims.at[jnp.where(rep, slot, capacity)].set(jnp.uint32(0),
                                                         mode='drop')
  return claims, rep


def renew_counts(table: IdTable, counts: Optional[jax.Array], win: Windows,
                 slot: jax.Array, rep: jax.Array, now: jax.Array
                 ) -> Optional[jax.Array]:
  """`'lfu'`: a hit's decayed count plus one (once a step); new owners 1."""
  if table.eviction != 'lfu':
    return counts
  assert counts is not None
  c = table.capacity
  # The hit slot's count, from the window read in step 1 (0 where absent).
  hit_count = (pick(win.counts, win.hit_j) if win.counts is not None
               else counts.at[win.hit_slot].get(mode='clip'))
  renewed = jnp.where(
      win.hit_seen < now,
      decayed(hit_count, win.hit_seen, now, table.lfu_period) + 1,
      hit_count)
  value = jnp.where(win.found, jnp.minimum(renewed, COUNT_LIMIT), 1)
  return counts.at[jnp.where(rep, slot, c)].set(value, mode='drop')


def move_wheel(table: IdTable, wheel: Optional[jax.Array], win: Windows,
               hit: jax.Array, inserted: jax.Array, old_alive: jax.Array,
               old_seen: jax.Array, now: jax.Array) -> Optional[jax.Array]:
  """`ttl`: move re-seen ids to this step's wheel entry, drop evicted ones."""
  if table.ttl is None:
    return wheel
  assert wheel is not None
  w = table.ttl + 1
  moved = hit & (win.hit_seen < now)
  evicted_live = inserted & old_alive
  wheel = wheel.at[jnp.where(moved, jnp.mod(win.hit_seen, w), w)].add(
      -1, mode='drop')
  wheel = wheel.at[jnp.where(evicted_live, jnp.mod(old_seen, w), w)].add(
      -1, mode='drop')
  return wheel.at[jnp.mod(now, w)].add(count(moved | inserted))


class Log(NamedTuple):
  """The eviction log's part of the state (`log_ids`, `log_steps` None
  when the log has no entries)."""
  log_ids: Optional[jax.Array]
  log_steps: Optional[jax.Array]
  log_next: jax.Array
  log_lost: jax.Array


def log_evictions(log: Log, record: jax.Array, old_words: jax.Array,
                  evict_step: jax.Array) -> Log:
  """Write the ids that lost their row into the ring (the latest kept).

  Args:
    log: the state's log.
    record: bool `[N]`, positions whose slot's old owner lost its row.
    old_words: uint32 `[N, 2]`, those owners' id words.
    evict_step: int32 `[N]`, the step each lost its row.

  Returns:
    The new `Log`; `log_lost` rises to the latest eviction step that is not
    (or no longer) in the ring.
  """
  log_lost = log.log_lost
  if log.log_ids is None or log.log_steps is None:
    return log._replace(log_lost=jnp.maximum(log_lost, jnp.max(
        jnp.where(record, evict_step, -1), initial=-1)))
  size = log.log_steps.shape[0]
  total = count(record)
  rank = jnp.cumsum(record.astype(jnp.int32)) - 1
  kept = record & (rank >= total - size)
  entry = jnp.mod(log.log_next + rank, size)
  target = jnp.where(kept, entry, size)
  overwritten = log.log_steps.at[target].get(mode='fill', fill_value=-1)
  target = after(target, overwritten, size)
  log_lost = jnp.maximum(log_lost, jnp.max(
      jnp.where(kept, overwritten, -1), initial=-1))
  log_lost = jnp.maximum(log_lost, jnp.max(
      jnp.where(record & ~kept, evict_step, -1), initial=-1))
  return Log(log.log_ids.at[target].set(old_words, mode='drop'),
             log.log_steps.at[target].set(evict_step, mode='drop'),
             jnp.mod(log.log_next + total, size), log_lost)


def add_events(counters: IdCounters, events: dict[str, jax.Array]
               ) -> IdCounters:
  """The `IdCounters` `counters` plus this step's `events` (name -> int32)."""
  return type(counters)(*(add64(old, events[name]) for name, old in zip(
      counters._fields, counters)))
