"""`export_changes`: what changed in an id table since a step, for serving.

A serving copy of an embedding table needs, now and then, the rows that
training changed and the ids that lost their row. `export_changes` reads
both from an `IdTableState` on the host (a scan of the state: run it when
exporting, not in the train step):

* changed: live ids assigned (so looked up and updated) at a step
  `>= since_step`, with their slots. A row changes only when its id is
  looked up (lazy updates touch nothing else) or when it is reset for a new
  owner, which is an assignment too.
* evicted: ids that lost their row at a step `>= since_step` (to another
  id, or by `ttl`) and hold none now. An evicted id that came back since is
  listed as changed instead, with its new slot.

Apply the evicted ids first (delete), then the changed ones (upsert the row
of `table[slot]`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lazy_optax._src import id_words
from lazy_optax._src.id_table import IdTableState


def export_changes(id_state: IdTableState, since_step: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Ids whose rows changed since a step, their slots, and evicted ids.

  Runs on the host (NumPy) over the whole state: call it when exporting to
  serving, not in the train step. `since_step=s` covers the steps `s, s + 1,
  ..., id_state.step`; to export incrementally, pass the previous export's
  `int(id_state.step) + 1`.

  Args:
    id_state: an `IdTableState` (sharded or not).
    since_step: the first step to include (0 or less: everything).

  Returns:
    `(changed_ids, changed_slots, evicted_ids)`: int64 ids and int64 slots of
    the live ids assigned at a step `>= since_step` (ordered by slot), and
    the sorted int64 ids that lost their row at a step `>= since_step` and
    hold none now.

  Raises:
    TypeError: `id_state` is not an `IdTableState`.
    ValueError: the eviction log overwrote evictions at or after
      `since_step` (export more often, or give the `IdTable` a larger
      `eviction_log`), so the evicted ids cannot all be listed.

  Example:
    >>> import numpy as np
    >>> import lazy_optax
    >>> t = lazy_optax.IdTable(capacity=2, probe=2)
    >>> _, state, _ = t.assign(t.init(), np.array([10, 11]), step=0)
    >>> _, state, _ = t.assign(state, np.array([12]), step=1)
    >>> changed_ids, changed_slots, evicted = lazy_optax.export_changes(
    ...     state, since_step=1)
    >>> changed_ids.tolist(), evicted.tolist()
    ([12], [10])
  """
  if not isinstance(id_state, IdTableState):
    raise TypeError('export_changes: id_state must be an IdTableState, got '
                    f'{type(id_state).__name__}.')
  if isinstance(since_step, bool) or not isinstance(since_step,
                                                    (int, np.integer)):
    raise TypeError('export_changes: since_step must be an int, got '
                    f'{since_step!r}.')
  since = int(since_step)
  now = int(np.asarray(id_state.step))
  lost = int(np.asarray(id_state.log_lost))
  if lost >= since:
    raise ValueError(
        f'export_changes: ids evicted at step {lost} (>= since_step={since}) '
        'were overwritten in the eviction log before this export, so the '
        'evicted ids cannot all be listed. Export more often, or give the '
        'IdTable a larger eviction_log.')
  words = np.asarray(id_state.ids)
  last_seen = np.asarray(id_state.last_seen).astype(np.int64)
  wheel_size = int(np.asarray(id_state.wheel).shape[0])
  ttl = wheel_size - 1 if wheel_size else None
  occupied = words[:, 0] != id_words.EMPTY_WORD
  alive = occupied.copy()
  if ttl is not None:
    alive &= last_seen >= now - ttl
  changed = alive & (last_seen >= since)
  changed_slots = np.flatnonzero(changed).astype(np.int64)
  changed_ids = id_words.join_words(words[changed_slots])

  log_steps = np.asarray(id_state.log_steps).astype(np.int64)
  in_log = (log_steps >= 0) & (log_steps >= since)
  evicted: list[Any] = [id_words.join_words(np.asarray(id_state.log_ids)[
      in_log])]
  if ttl is not None:
    # Expired owners still in their slot lost their row at last_seen + ttl + 1.
    expired = occupied & ~alive & (last_seen + ttl + 1 >= since)
    evicted.append(id_words.join_words(words[expired]))
  live_ids = id_words.join_words(words[alive])
  evicted_ids = np.setdiff1d(np.concatenate(evicted), live_ids)
  return changed_ids, changed_slots, evicted_ids.astype(np.int64)
