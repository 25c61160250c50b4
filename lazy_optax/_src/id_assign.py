"""The steps of `IdTable.assign`, each a small pure function of arrays.

`IdTable._assign` runs them in the order of its docstring:

1. `probe_windows`: each id's window of slots, and the live ids found there;
2. `expire`: the `ttl` wheel's ids that expire at this step;
3. `admit`: the sketch's count of each missing id, and which are admitted;
4. `claim_rounds`: admitted ids claim slots, the smallest id winning
   (`run_rounds` of `claim_round`, each `choose_slots`, `guard`, `resolve`);
5. accounting: `representatives` (one position per slot), `renew_counts`
   (`'lfu'`), `move_wheel` (`ttl`), `log_evictions` (for `export_changes`)
   and `add_events` (the counters).

`table` is the (static, frozen) `IdTable` whose fields configure a step.
Everything here is batch-sized: no loop over ids, no table-sized array.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp

from lazy_optax._src import branching
from lazy_optax._src import id_hashing
from lazy_optax._src import id_words

BIG_STEP = 2 ** 31 - 1
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
  """The number of True entries of `mask`, int32."""
  return jnp.sum(mask.astype(jnp.int32))


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


def alive_in(table: Any, window_words: jax.Array, window_seen: jax.Array,
             now: jax.Array) -> jax.Array:
  """Which slots hold a live id: occupied, and seen within `ttl` of `now`."""
  occupied = window_words[..., 0] != jnp.uint32(id_words.EMPTY_WORD)
  if table.ttl is None:
    return occupied
  return occupied & (window_seen >= now - table.ttl)


def home_slots(table: Any, words: jax.Array) -> jax.Array:
  """The first slot of each id's probe window: int32 `[N]`.

  Windows do not wrap around: they start in `[0, capacity - probe]`, so
  each is one contiguous slice of the state (a slice gather reads it
  several times faster than `probe` separate indices).
  """
  return id_hashing.home_slots(words, table.capacity - table.probe + 1,
                               table.seed).astype(jnp.int32)


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


def probe_windows(table: Any, ids: jax.Array, last_seen: jax.Array,
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
  homes = home_slots(table, words)
  win_words = window(ids, homes, table.probe)              # [n, P, 2]
  win_seen = window(last_seen, homes, table.probe)         # [n, P]
  alive = alive_in(table, win_words, win_seen, now)
  match = alive & (win_words[..., 0] == words[:, None, 0]) & (
      win_words[..., 1] == words[:, None, 1])
  hit_j = first(match)                       # probe (a live id is there once)
  found = id_words.valid_words(words) & (hit_j < table.probe)
  win_counts = None if counts is None else window(counts, homes, table.probe)
  return Windows(homes, win_words, win_seen, alive, hit_j, found,
                 homes + hit_j, pick(win_seen, hit_j), win_counts)


def expire(table: Any, wheel: Optional[jax.Array], live: jax.Array,
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


def estimate(table: Any, sketch: jax.Array, words: jax.Array,
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


def _count_once(cell: jax.typing.ArrayLike) -> jax.Array:
  """One more lookup in a sketch cell, capped at `COUNT_LIMIT`."""
  return jnp.minimum(cell + 1, COUNT_LIMIT)


def admit(table: Any, sketch: Optional[jax.Array], words: jax.Array,
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
  # One scatter counts each lookup, capped (a cell looked up k times gets
  # min(cell + k, COUNT_LIMIT), as an add then a min would give): each
  # cell is a cache miss on a large sketch, read and written once.
  sketch = sketch.at[rows, cols].apply(_count_once, mode='drop')
  seen = estimate(table, sketch, words, need)
  if table.admit_after == 1:
    return sketch, need, seen
  return sketch, need & (seen >= table.admit_after), seen


class Claims(NamedTuple):
  """The outcome of the claim rounds.

  Attributes:
    ids: the state's id words, with the winners written.
    last_seen: the state's last-seen steps, winners (and hits) at `now`.
    claims: the claim scratch (all zero again).
    placed: int32 `[N]`, the slot each id won (`capacity`: none).
    placed_j: int32 `[N]`, its position in the id's window.
    pending: bool `[N]`, ids that lost every round.
    no_room: bool `[N]`, ids left without a slot (stuck or lost).
    blocked: bool `[N]`, ids refused by a full window under `'none'`.
    declined: bool `[N]`, ids refused a live id's slot by the frequency
      guard (`admission='frequency'`).
  """
  ids: jax.Array
  last_seen: jax.Array
  claims: jax.Array
  placed: jax.Array
  placed_j: jax.Array
  pending: jax.Array
  no_room: jax.Array
  blocked: jax.Array
  declined: jax.Array


def guards(table: Any) -> bool:
  """Whether a newcomer must be seen more often than its victim."""
  return table.admission == 'frequency' and table.eviction != 'none'


class Claimants(NamedTuple):
  """The per-id arrays a claim round reads (all `[N, ...]` rows).

  The fields are declared in the order in which the compacted round gathers
  them.

  Attributes:
    frequency: int32 `[N]`, each id's count in the sketch (None unless
      `guards(table)`).
    free: bool `[N, probe]`, the window's slots that hold no live id.
    hi: uint32 `[N]`, the complement of the id's high word.
    homes: int32 `[N]`, the first slot of each window.
    lo: uint32 `[N]`, the complement of the id's low word.
    score: int32 `[N, probe]`, the slots' decayed `'lfu'` counts, -1 where
      free (None for other policies).
    seen: int32 `[N, probe]`, the slots' last-seen steps.
    words: uint32 `[N, 2]`, the id words.
  """
  frequency: Optional[jax.Array]
  free: jax.Array
  hi: jax.Array
  homes: jax.Array
  lo: jax.Array
  score: Optional[jax.Array]
  seen: jax.Array
  words: jax.Array


class ClaimTables(NamedTuple):
  """The state arrays a claim round writes: id words, last-seen steps and
  the claim scratch."""
  ids: jax.Array
  last_seen: jax.Array
  claims: jax.Array


class RoundResult(NamedTuple):
  """What one claim round decided for each of its ids (`[N]` each).

  Attributes:
    won: bool, the id won its slot.
    target: int32, the slot it claimed (`capacity`: none).
    j: int32, that slot's position in the id's window.
    stuck: bool, a pending id whose window had no slot to claim.
    blocked: bool, a stuck id refused by a full window under `'none'`.
    declined: bool, an id refused a live id's slot by the frequency guard.
  """
  won: jax.Array
  target: jax.Array
  j: jax.Array
  stuck: jax.Array
  blocked: jax.Array
  declined: jax.Array


class RoundCarry(NamedTuple):
  """What the claim rounds carry from one round to the next.

  Attributes:
    tables: the `ClaimTables`, winners written.
    placed: int32 `[N]`, the slot each id won (`capacity`: none yet).
    placed_j: int32 `[N]`, its position in the id's window.
    pending: bool `[N]`, ids still to claim a slot.
    stuck: bool `[N]`, ids that found no slot to claim in some round.
    blocked: bool `[N]`, ids refused by a full window under `'none'`.
    declined: bool `[N]`, ids declined by the frequency guard.
  """
  tables: ClaimTables
  placed: jax.Array
  placed_j: jax.Array
  pending: jax.Array
  stuck: jax.Array
  blocked: jax.Array
  declined: jax.Array


class RoundInputs(NamedTuple):
  """What every claim round reads and none writes.

  Attributes:
    who: the `Claimants`, the whole batch.
    position: int32 `[N]`, each id's position in the batch.
    sketch: the sketch after this step's counts (None without one).
    now: the step.
  """
  who: Claimants
  position: jax.Array
  sketch: Optional[jax.Array]
  now: jax.Array


def claimants(table: Any, counts: Optional[jax.Array],
              seen: Optional[jax.Array], words: jax.Array, win: Windows,
              now: jax.Array) -> Claimants:
  """The batch's per-id arrays for the claim rounds (see `claim_rounds`)."""
  free = ~win.alive
  hi, lo = ~words[:, 0], ~words[:, 1]
  score = None
  if table.eviction == 'lfu':
    assert counts is not None
    win_counts = win.counts if win.counts is not None else window(
        counts, win.homes, table.probe)
    score = jnp.where(
        free, -1, decayed(win_counts, win.seen, now, table.lfu_period))
  frequency = None
  if guards(table):
    assert seen is not None
    frequency = seen
  return Claimants(frequency=frequency, free=free, hi=hi, homes=win.homes,
                   lo=lo, score=score, seen=win.seen, words=words)


def choose_slots(table: Any, who: Claimants, last_seen: jax.Array,
                 pending: jax.Array, now: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each pending id's pick in its window among slots not seen at `now`.

  Free first (under `'lfu'`: the lowest score first), then the least
  recently seen, ties to the earlier slot.

  Returns:
    `(untouched, has, j)`: bool `[N, probe]`, the window's slots not seen
    at `now`; bool `[N]`, the pending ids with a pick; int32 `[N]`, the
    pick's position in the window (`probe`: none).
  """
  seen_now = window(last_seen, who.homes, table.probe)
  untouched = seen_now < now
  eligible = untouched
  if table.eviction == 'none':
    eligible = untouched & who.free
  if table.eviction == 'lfu':
    assert who.score is not None
    best = jnp.min(jnp.where(eligible, who.score, BIG_STEP), axis=1)
    eligible = eligible & (who.score == best[:, None])
  # Free slots are older than live ones (empty: EMPTY_STEP; expired:
  # before now - ttl), so the least recently seen comes first.
  oldest = jnp.where(eligible, who.seen, BIG_STEP)
  least = jnp.min(oldest, axis=1)
  has = pending & (least < BIG_STEP)
  j = first(oldest == least[:, None])
  return untouched, has, j


def guard(table: Any, ids: jax.Array, who: Claimants,
          sketch: Optional[jax.Array], has: jax.Array, j: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
  """The frequency guard: a pick that holds a live id (a victim) is kept
  only when the sketch counts the newcomer more often than the victim.

  Returns:
    `(has, declined)`: the picks kept, and the ids declined (bool `[N]`,
    all False unless `guards(table)`).
  """
  if not guards(table):
    return has, jnp.zeros_like(has)
  assert sketch is not None and who.frequency is not None
  # The victim's count, read from the slot's owner (untouched at this
  # step, so the owner the window was read with).
  victim = has & ~pick(who.free, j)
  owner = ids.at[jnp.where(victim, who.homes + j, table.capacity)].get(
      mode='fill', fill_value=id_words.EMPTY_WORD)
  declined = victim & ~(who.frequency > estimate(
      table, sketch, owner, victim))
  return has & ~declined, declined


def resolve(claims: jax.Array, target: jax.Array, has: jax.Array,
            hi: jax.Array, lo: jax.Array, capacity: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Several ids claiming one slot: the smallest id wins.

  The largest complement of its high word, then of its low word, through
  a scatter-max into the claim scratch, which is cleared where it was
  written.

  Returns:
    `(claims, won, winner)`: the scratch (zero again), bool `[N]` the
    winners, int32 `[N]` their slots (`capacity` for the others).
  """
  claims = claims.at[target].max(hi, mode='drop')
  won_high = has & (claims.at[target].get(mode='fill', fill_value=0)
                    == hi)
  second = jnp.where(won_high, target, capacity)
  claims = claims.at[second].set(jnp.uint32(0), mode='drop')
  claims = claims.at[second].max(lo, mode='drop')
  won = won_high & (claims.at[second].get(mode='fill', fill_value=0)
                    == lo)
  winner = jnp.where(won, target, capacity)
  claims = claims.at[winner].set(jnp.uint32(0), mode='drop')
  return claims, won, winner


def claim_round(table: Any, who: Claimants, tables: ClaimTables,
                pending: jax.Array, sketch: Optional[jax.Array],
                now: jax.Array) -> tuple[ClaimTables, RoundResult]:
  """One claim round for the ids of `who` (all, or a compacted few).

  Each pending id picks a slot (`choose_slots`), passes the frequency
  guard (`guard`) and claims it (`resolve`); the winners are written.

  Returns:
    The written `ClaimTables` and the round's `RoundResult`.
  """
  untouched, has, j = choose_slots(table, who, tables.last_seen, pending,
                                   now)
  stuck = pending & ~has
  has, declined = guard(table, tables.ids, who, sketch, has, j)
  target = jnp.where(has, who.homes + j, table.capacity)
  claims, won, winner = resolve(tables.claims, target, has, who.hi, who.lo,
                                table.capacity)
  ids = tables.ids.at[winner].set(who.words, mode='drop')
  last_seen = tables.last_seen.at[winner].set(now, mode='drop')
  if table.eviction == 'none':
    blocked = stuck & jnp.any(untouched & ~who.free, axis=1)
  else:
    blocked = jnp.zeros_like(stuck)
  return (ClaimTables(ids, last_seen, claims),
          RoundResult(won, target, j, stuck, blocked, declined))


def merge(carry: RoundCarry, tables: ClaimTables,
          result: RoundResult) -> RoundCarry:
  """The carry after a round: its tables, and its results folded in."""
  return RoundCarry(
      tables, jnp.where(result.won, result.target, carry.placed),
      jnp.where(result.won, result.j, carry.placed_j),
      carry.pending & ~result.won & ~result.stuck & ~result.declined,
      carry.stuck | result.stuck, carry.blocked | result.blocked,
      carry.declined | result.declined)


def full_round(table: Any, inputs: RoundInputs,
               carry: RoundCarry) -> RoundCarry:
  """A round over all `N` rows (rows not pending claim nothing)."""
  tables, result = claim_round(table, inputs.who, carry.tables,
                               carry.pending, inputs.sketch, inputs.now)
  return merge(carry, tables, result)


def compact_round(table: Any, inputs: RoundInputs, few: int,
                  carry: RoundCarry) -> RoundCarry:
  """A round for the pending ids compacted into `few` rows (they must
  fit), in batch order; its results are scattered back to `N` rows."""
  n = inputs.position.shape[0]
  rank = jnp.cumsum(carry.pending.astype(jnp.int32)) - 1
  sel = jnp.full((few,), n, jnp.int32).at[
      jnp.where(carry.pending, rank, few)].set(inputs.position, mode='drop')
  who = jax.tree.map(
      lambda a: a.at[sel].get(mode='fill', fill_value=0), inputs.who)
  tables, result = claim_round(table, who, carry.tables, sel < n,
                               inputs.sketch, inputs.now)
  back = [jnp.zeros((n,), r.dtype).at[sel].set(r, mode='drop')
          for r in result]
  return merge(carry, tables, RoundResult(*back))


def one_round_skipping(table: Any, inputs: RoundInputs, few: int,
                       carry: RoundCarry) -> RoundCarry:
  """A round that skips work (the CPU's version).

  The pending ids compacted into `few` rows when they fit (most ids of a
  batch are hits), all `N` rows when they do not: never a subset chosen by
  position, so the result does not depend on batch order. No round at all
  when no id is pending.
  """
  left = count(carry.pending)
  carry = lax.cond(left > few, functools.partial(full_round, table, inputs),
                   lambda x: x, carry)
  return lax.cond((left <= few) & (left > 0),
                  functools.partial(compact_round, table, inputs, few),
                  lambda x: x, carry)


def one_round(table: Any, inputs: RoundInputs, few: int,
              carry: RoundCarry) -> RoundCarry:
  """One claim round: `one_round_skipping` on the CPU, else `full_round`.

  Branch-free: a round over all `N` rows gives the compact round's bits
  (rows not pending claim nothing and their writes drop) and, with no id
  pending, changes nothing.
  """
  return branching.per_platform(
      functools.partial(one_round_skipping, table, inputs, few),
      functools.partial(full_round, table, inputs), carry)


def run_rounds(table: Any, inputs: RoundInputs,
               carry: RoundCarry) -> RoundCarry:
  """The `table.rounds` claim rounds.

  The first round: the batch's new ids (a share of it once the hot ids hold
  rows); later rounds: the few that lost a claim.
  """
  n = inputs.position.shape[0]
  carry = one_round(table, inputs, min(n, max(32, n // 4)), carry)
  if table.rounds > 1:
    later = min(n, max(32, n // 16))
    carry = lax.fori_loop(
        1, table.rounds, lambda _, c: one_round(table, inputs, later, c),
        carry)
  return carry


def claim_rounds(table: Any, ids: jax.Array, last_seen: jax.Array,
                 claims: jax.Array, counts: Optional[jax.Array],
                 sketch: Optional[jax.Array], seen: Optional[jax.Array],
                 words: jax.Array, win: Windows, admitted: jax.Array,
                 now: jax.Array) -> Claims:
  """Step 4: admitted ids claim slots in `table.rounds` rounds.

  In each round every unplaced id picks its best slot among those of its
  window not seen at this step (free first, then the policy's victim, ties
  to the earlier slot). Under `admission='frequency'` an id whose pick
  holds a live id (a victim) takes it only when the sketch counts it more
  often than the victim, else it is declined (no further round). Several
  ids picking one slot are resolved by id value (the smallest wins) through
  a scatter-max into the claim scratch, cleared where it was written.
  Losers try again in the next round.

  Args:
    table: the `IdTable`.
    ids: the state's id words.
    last_seen: the state's last-seen steps, hits already marked at `now`.
    claims: the claim scratch (all zero).
    counts: the state's `'lfu'` counts (None for other policies).
    sketch: the sketch after this step's counts (None without one).
    seen: int32 `[N]`, each id's count in it (None without a sketch).
    words: the batch's `uint32[N, 2]` id words.
    win: the `Windows` of step 1.
    admitted: bool `[N]`, the ids that claim a slot.
    now: the step.

  Returns:
    The `Claims`.
  """
  n = words.shape[0]
  position = lax.iota(jnp.int32, n)
  who = claimants(table, counts, seen, words, win, now)
  carry = RoundCarry(
      ClaimTables(ids, last_seen, claims),
      jnp.full((n,), table.capacity, jnp.int32), jnp.zeros((n,), jnp.int32),
      admitted, jnp.zeros((n,), bool), jnp.zeros((n,), bool),
      jnp.zeros((n,), bool))
  carry = run_rounds(table, RoundInputs(who, position, sketch, now), carry)
  return Claims(*carry.tables, carry.placed, carry.placed_j, carry.pending,
                carry.stuck | carry.pending, carry.blocked, carry.declined)


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


def renew_counts(table: Any, counts: Optional[jax.Array], win: Windows,
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


def move_wheel(table: Any, wheel: Optional[jax.Array], win: Windows,
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


def add_events(counters: Any, events: dict[str, jax.Array]) -> Any:
  """The `IdCounters` `counters` plus this step's `events` (name -> int32)."""
  return type(counters)(*(add64(old, events[name]) for name, old in zip(
      counters._fields, counters)))
