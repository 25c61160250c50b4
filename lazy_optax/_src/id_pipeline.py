"""The XLA path of `IdTable.assign`: its steps in order, one batch.

`assign_xla` runs the steps of `id_table`'s docstring on a batch of id
words: `_place` steps 1 to 4 (in `id_assign` and `id_claims`), `_account`
step 5, which builds the new state with the old one's dtypes. This module
only wires the steps (`id_table` imports it; the state's classes are named
here for type checking only). Everything here is batch-sized.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, TYPE_CHECKING

import jax
import jax.numpy as jnp

from lazy_optax._src import id_assign
from lazy_optax._src import id_claims
from lazy_optax._src import id_words

if TYPE_CHECKING:
  from lazy_optax._src.id_table import IdCounters
  from lazy_optax._src.id_table import IdTable
  from lazy_optax._src.id_table import IdTableState


def assign_xla(table: IdTable, state: IdTableState, words: jax.Array,
               now: jax.Array
               ) -> tuple[jax.Array, IdTableState, jax.Array, jax.Array]:
  """One `assign` call through XLA: steps 1 to 4 `_place`, 5 `_account`.

  Args:
    table: the `IdTable`.
    state: its `IdTableState`.
    words: the batch's `uint32[N, 2]` id words.
    now: the step (int32 scalar).

  Returns:
    `(slots, state, fresh_slots, no_room)`, as `id_kernels.assign` returns
    them: int32 `[N]` slots (`capacity`: no row), the new state, int32
    `[N]` the `FreshRows` slots (a newly placed id's slot at one position
    each, else `capacity`), and the number of ids left without room.
  """
  placed = _place(table, state, words, now)
  new_state, slot, inserted = _account(table, state, now, placed)
  slot = slot.astype(jnp.int32)
  fresh = jnp.where(inserted, slot, table.capacity).astype(jnp.int32)
  return slot, new_state, fresh, id_assign.count(placed.claimed.no_room)


class _Placed(NamedTuple):
  """What steps 1 to 4 of `assign` leave to its accounting.

  Attributes:
    win: the `id_assign.Windows` of step 1.
    wheel: the `ttl` wheel, this step's expired ids cleared (step 2).
    expired: the number of ids that expired at this step.
    live: the live count without them.
    need: bool `[N]`, valid ids that held no row.
    sketch: the sketch after this step's counts (step 3).
    admitted: bool `[N]`, the ids of `need` admitted: they claim a slot.
    claimed: the `id_claims.Claims` of step 4.
  """
  win: id_assign.Windows
  wheel: Optional[jax.Array]
  expired: jax.Array
  live: jax.Array
  need: jax.Array
  sketch: Optional[jax.Array]
  admitted: jax.Array
  claimed: id_claims.Claims


def _place(table: IdTable, state: IdTableState, words: jax.Array,
           now: jax.Array) -> _Placed:
  """Steps 1 to 4 of the module doc: hits, expiry, admission and claims."""
  # 1. Probe windows: each id's window, and the live ids found there.
  win = id_assign.probe_windows(table, state.ids, state.last_seen, words,
                                now, state.counts)
  # 2. Expiry: under ttl, ids last seen before now - ttl expire now.
  wheel, expired, live = id_assign.expire(table, state.wheel, state.live,
                                          state.step, now)
  # 3. Admission: the sketch counts lookups of ids without a row.
  valid = id_words.valid_words(words)
  need = valid & ~win.found
  sketch, admitted, seen = id_assign.admit(table, state.sketch, words, valid,
                                           need, state.step, now)
  # 4. Claim rounds: admitted ids take free slots or the policy's victims;
  # hits are seen now, so that no new id of this step takes their slots.
  c = table.capacity
  last_seen = state.last_seen.at[id_assign.after(
      jnp.where(win.found, win.hit_slot, c), win.hit_seen, c)].set(
          now, mode='drop')
  claimed = id_claims.claim_rounds(
      table, state.ids, last_seen, state.claims, state.counts, sketch, seen,
      words, win, admitted, now)
  return _Placed(win, wheel, expired, live, need, sketch, admitted, claimed)


def _account(table: IdTable, state: IdTableState, now: jax.Array,
             placed: _Placed) -> tuple[IdTableState, jax.Array, jax.Array]:
  """Step 5: accounting, per slot (one representative position each).

  Returns:
    `(state, slot, inserted)`: the new state (the old one's dtypes), int
    `[N]` each id's slot (`capacity`: none), and bool `[N]` the positions
    that represent a newly placed id.
  """
  c = table.capacity
  win, claimed = placed.win, placed.claimed
  slot = jnp.where(win.found, win.hit_slot, claimed.placed)
  claims, rep = id_assign.representatives(claimed.claims, slot, c)
  inserted = rep & (claimed.placed < c)
  hit = rep & win.found
  owners = _old_owners(win, claimed.placed_j)
  counts = id_assign.renew_counts(table, state.counts, win, slot, rep, now)
  wheel = id_assign.move_wheel(table, placed.wheel, win, hit, inserted,
                               owners.alive, owners.seen, now)
  live = placed.live + id_assign.count(inserted & ~owners.alive)
  log = _log(table, state, inserted, owners, now)
  counters = _events(state.counters, placed, inserted, owners.alive)
  new_state = state._replace(
      ids=claimed.ids, last_seen=claimed.last_seen, counts=counts,
      claims=claims, sketch=placed.sketch, wheel=wheel, log_ids=log.log_ids,
      log_steps=log.log_steps, log_next=log.log_next,
      log_lost=log.log_lost, step=now, live=live, counters=counters)
  # The old state's dtypes: under jax_enable_x64 scalar arithmetic would
  # widen some leaves to 64 bits.
  return (jax.tree.map(lambda new, old: new.astype(old.dtype), new_state,
                       state), slot, inserted)


class _Owners(NamedTuple):
  """The owners, before this step, of the slots the ids were placed in.

  Attributes:
    alive: bool `[N]`, the owner was live.
    seen: int32 `[N]`, its last-seen step.
    words: uint32 `[N, 2]`, its id words.
    occupied: bool `[N]`, the slot held an id (live or expired).
  """
  alive: jax.Array
  seen: jax.Array
  words: jax.Array
  occupied: jax.Array


def _old_owners(win: id_assign.Windows, j: jax.Array) -> _Owners:
  """The old owners of each id's slot at window position `j`, read from the
  windows of step 1."""
  alive = id_assign.pick(win.alive, j)
  seen = id_assign.pick(win.seen, j)
  words = jnp.stack([id_assign.pick(win.words[..., 0], j),
                     id_assign.pick(win.words[..., 1], j)], axis=-1)
  occupied = words[:, 0] != jnp.uint32(id_words.EMPTY_WORD)
  return _Owners(alive, seen, words, occupied)


def _log(table: IdTable, state: IdTableState, inserted: jax.Array,
         owners: _Owners, now: jax.Array) -> id_assign.Log:
  """The eviction log: ids that lost their row (to a new owner here; under
  ttl, an expired owner is logged at the step it expired)."""
  evict_step = jnp.where(owners.alive, now, owners.seen + (
      0 if table.ttl is None else table.ttl + 1))
  return id_assign.log_evictions(
      id_assign.Log(state.log_ids, state.log_steps, state.log_next,
                    state.log_lost),
      inserted & owners.occupied, owners.words, evict_step)


def _events(counters: IdCounters, placed: _Placed, inserted: jax.Array,
            old_alive: jax.Array) -> IdCounters:
  """The counters plus this step's admissions, evictions, expirations,
  rejections, overflows, unadmitted and declined lookups."""
  claimed = placed.claimed
  full = claimed.no_room & ~claimed.blocked
  return id_assign.add_events(counters, {
      'admissions': id_assign.count(inserted),
      'evictions': id_assign.count(inserted & old_alive),
      'expirations': placed.expired,
      'rejections': id_assign.count(claimed.blocked),
      'overflows': id_assign.count(full),
      'unadmitted': id_assign.count(placed.need & ~placed.admitted),
      'declined': id_assign.count(claimed.declined)})
