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

from typing import Optional, TYPE_CHECKING
import warnings

import numpy as np

from lazy_optax._src import deprecations
from lazy_optax._src import id_words

if TYPE_CHECKING:
  from lazy_optax._src.id_table import IdTableState


def check_since_step(since_step: object, where: str) -> int:
  """`since_step` as an int, or a TypeError naming it."""
  if isinstance(since_step, bool) or not isinstance(since_step,
                                                    (int, np.integer)):
    raise TypeError(f'{where}: since_step must be an int, got '
                    f'{since_step!r}.')
  return int(since_step)


def changes(id_state: IdTableState, since: int, ttl: Optional[int], where: str
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The host scan behind `IdTable.export_changes` (see its docstring).

  Args:
    id_state: an `IdTableState` whose shapes were checked by the caller.
    since: the first step to include.
    ttl: the table's `ttl`.
    where: the caller's name, for errors.

  Returns:
    `(changed_ids, changed_slots, evicted_ids)`.
  """
  now = int(np.asarray(id_state.step))
  lost = int(np.asarray(id_state.log_lost))
  if lost >= since:
    raise ValueError(
        f'{where}: ids evicted at step {lost} (>= since_step={since}) '
        'were overwritten in the eviction log before this export, so the '
        'evicted ids cannot all be listed. Export more often, or give the '
        'IdTable a larger eviction_log.')
  words = np.asarray(id_state.ids)
  last_seen = np.asarray(id_state.last_seen).astype(np.int64)
  occupied = words[:, 0] != id_words.EMPTY_WORD
  alive = occupied.copy()
  if ttl is not None:
    alive &= last_seen >= now - ttl
  changed = alive & (last_seen >= since)
  changed_slots = np.flatnonzero(changed).astype(np.int64)
  changed_ids = id_words.join_words(words[changed_slots])

  evicted: list[np.ndarray] = []
  if id_state.log_steps is not None:
    log_steps = np.asarray(id_state.log_steps).astype(np.int64)
    in_log = (log_steps >= 0) & (log_steps >= since)
    evicted.append(id_words.join_words(np.asarray(id_state.log_ids)[in_log]))
  if ttl is not None:
    # Expired owners still in their slot lost their row at last_seen + ttl + 1.
    expired = occupied & ~alive & (last_seen + ttl + 1 >= since)
    evicted.append(id_words.join_words(words[expired]))
  live_ids = id_words.join_words(words[alive])
  evicted_ids = np.setdiff1d(
      np.concatenate(evicted) if evicted else np.zeros((0,), np.int64),
      live_ids)
  return changed_ids, changed_slots, evicted_ids.astype(np.int64)


def export_changes(id_state: IdTableState, since_step: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Deprecated: use `IdTable.export_changes(id_state, since_step)`.

  This function infers the table's `ttl` from the length of the state's
  wheel; the method reads it from the table.

  Args:
    id_state: an `IdTableState`.
    since_step: the first step to include (0 or less: everything).

  Returns:
    `(changed_ids, changed_slots, evicted_ids)`, as the method.

  Example:
    >>> import warnings
    >>> import numpy as np
    >>> import lazy_optax
    >>> t = lazy_optax.IdTable(capacity=2, probe=2)
    >>> _, state, _ = t.assign(t.init(), np.array([10, 11]), step=0)
    >>> with warnings.catch_warnings():
    ...   warnings.simplefilter('ignore', DeprecationWarning)
    ...   changed_ids, _, _ = lazy_optax.export_changes(state, since_step=0)
    >>> sorted(changed_ids.tolist())
    [10, 11]
  """
  where = 'export_changes'
  warnings.warn(deprecations.message('lazy_optax.export_changes',
                                     'lazy_optax.IdTable.export_changes'),
                DeprecationWarning, stacklevel=2)
  fields = ('ids', 'last_seen', 'wheel', 'log_ids', 'log_steps', 'log_lost',
            'step')
  if not isinstance(id_state, tuple) or not all(
      hasattr(id_state, name) for name in fields):
    raise TypeError(f'{where}: id_state must be an IdTableState, got '
                    f'{type(id_state).__name__}.')
  since = check_since_step(since_step, where)
  wheel = id_state.wheel
  size = 0 if wheel is None else int(np.shape(wheel)[0])
  return changes(id_state, since, size - 1 if size else None, where)
