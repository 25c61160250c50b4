"""Step 4 of `IdTable.assign`: admitted ids claim slots, smallest id wins.

`claim_rounds` runs `table.rounds` claim rounds, as step 4 of `id_table`'s
docstring describes them: each unplaced id picks its best slot
(`choose_slots`), the frequency guard may decline it (`guard`), and the
smallest id wins a slot picked by several (`resolve`); ids left without a
slot have no room (`Claims`).

`run_rounds` runs the rounds (`claim_round`, then `merge` into the
`RoundCarry`). On the CPU a round skips work (`one_round_skipping`): it runs
over the pending ids compacted into a few rows when they fit
(`compact_round`), over all `N` rows when they do not (`full_round`), and
not at all when no id is pending. Elsewhere every round runs over all `N`
rows, branch-free: rows not pending claim nothing, so both give the same
bits. The first round's few rows are a share of the batch (its new ids),
later rounds' a smaller one (the few that lost a claim).

The window reads (`window`, `first`, `pick`, `decayed`, `estimate`) are
`id_assign`'s. `table` is the (static, frozen) `IdTable` whose fields
configure a round. Everything here is batch-sized: no loop over ids, no
table-sized array.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, TYPE_CHECKING

import jax
from jax import lax
import jax.numpy as jnp

from lazy_optax._src import branching
from lazy_optax._src import id_words
from lazy_optax._src.id_assign import count
from lazy_optax._src.id_assign import decayed
from lazy_optax._src.id_assign import estimate
from lazy_optax._src.id_assign import first
from lazy_optax._src.id_assign import pick
from lazy_optax._src.id_assign import probe_size
from lazy_optax._src.id_assign import window
from lazy_optax._src.id_assign import Windows

if TYPE_CHECKING:
  from lazy_optax._src.id_table import IdTable

BIG_STEP = 2 ** 31 - 1


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


def guards(table: IdTable) -> bool:
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
  """What the claim rounds carry from one round to the next: the
  `ClaimTables` (winners written) and `Claims`' per-id fields so far, with
  `stuck`, the ids that found no slot to claim in some round."""
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


def claimants(table: IdTable, counts: Optional[jax.Array],
              seen: Optional[jax.Array], words: jax.Array, win: Windows,
              now: jax.Array) -> Claimants:
  """The batch's per-id arrays for the claim rounds (see `claim_rounds`)."""
  free = ~win.alive
  hi, lo = ~words[:, 0], ~words[:, 1]
  score = None
  if table.eviction == 'lfu':
    assert counts is not None
    win_counts = win.counts if win.counts is not None else window(
        counts, win.homes, probe_size(table))
    score = jnp.where(
        free, -1, decayed(win_counts, win.seen, now, table.lfu_period))
  frequency = None
  if guards(table):
    assert seen is not None
    frequency = seen
  return Claimants(frequency=frequency, free=free, hi=hi, homes=win.homes,
                   lo=lo, score=score, seen=win.seen, words=words)


def choose_slots(table: IdTable, who: Claimants, last_seen: jax.Array,
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
  seen_now = window(last_seen, who.homes, probe_size(table))
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


def guard(table: IdTable, ids: jax.Array, who: Claimants,
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


def claim_round(table: IdTable, who: Claimants, tables: ClaimTables,
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


# Jitted (the table static): each round's version for the CPU and the
# branch-free one both run it, and `jax.jit` traces it once for both.
@functools.partial(jax.jit, static_argnums=0)
def full_round(table: IdTable, inputs: RoundInputs,
               carry: RoundCarry) -> RoundCarry:
  """A round over all `N` rows (rows not pending claim nothing)."""
  tables, result = claim_round(table, inputs.who, carry.tables,
                               carry.pending, inputs.sketch, inputs.now)
  return merge(carry, tables, result)


def compact_round(table: IdTable, inputs: RoundInputs, few: int,
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


def one_round_skipping(table: IdTable, inputs: RoundInputs, few: int,
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


def one_round(table: IdTable, inputs: RoundInputs, few: int,
              carry: RoundCarry) -> RoundCarry:
  """One claim round: `one_round_skipping` on the CPU, else `full_round`.

  Branch-free: a round over all `N` rows gives the compact round's bits
  (rows not pending claim nothing and their writes drop) and, with no id
  pending, changes nothing.
  """
  return branching.per_platform(
      functools.partial(one_round_skipping, table, inputs, few),
      functools.partial(full_round, table, inputs), carry)


def run_rounds(table: IdTable, inputs: RoundInputs,
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


def claim_rounds(table: IdTable, ids: jax.Array, last_seen: jax.Array,
                 claims: jax.Array, counts: Optional[jax.Array],
                 sketch: Optional[jax.Array], seen: Optional[jax.Array],
                 words: jax.Array, win: Windows, admitted: jax.Array,
                 now: jax.Array) -> Claims:
  """Step 4: admitted ids claim slots in `table.rounds` rounds (module doc).

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
