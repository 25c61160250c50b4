"""`IdTable`: collision-free rows for raw ids from an unbounded space.

A table of `capacity` slots maps raw ids (up to `2**63 - 1`) to rows of an
ordinary `[capacity, ...]` parameter. Its state is a pytree of fixed shapes
(`IdTableState`): the id words held by each slot, the step each was last
seen, the per-slot counts of the `'lfu'` policy, a count-min sketch for
admission, a wheel of live ids per step for `ttl`, a log of evictions for
`export_changes`, and counters. `assign` is a pure function of that state
and a batch of ids, jit-able with the state donated; nothing in it is a loop
over ids or an array the size of the table.

How `assign` places a batch (all steps batch-sized):

1. Each id hashes to a home slot in `[0, capacity - probe]`; its probe
   window is the `probe` slots from there (one contiguous slice: windows do
   not wrap around). One slice gather reads the windows' ids and last-seen
   steps.
2. An id found live in its window is a hit: its slot is marked seen at this
   step, so no new id of the same step can take it.
3. A missing id is admitted once the sketch has counted it `admit_after`
   times (under `admission='frequency'` the sketch counts every lookup and
   is halved every `lfu_period` steps; under `'always'` it counts the
   lookups of ids that hold no row).
4. Admitted ids claim slots in a fixed number of rounds (`rounds`). In each
   round every unplaced id picks its best slot among those of its window not
   seen at this step: free slots (empty, or expired under `ttl`) first, then
   the policy's victim (`'lfu'`, the default: the lowest decayed count,
   then the least recently seen; `'lru'`: the least recently seen; `'none'`:
   no victim).
   Ties go to the earlier slot of the window. Under `admission='frequency'`
   (the default) an id takes a victim's slot only when the sketch counts it
   more often than the victim (TinyLFU); else it is declined: no row at this
   step, no further round. Several ids picking one slot are resolved by id
   value (the smallest id wins) through a scatter-max into a per-slot scratch
   that is zero again after every round, so the
   result depends on the set of ids only: any batch order and any device
   count give the same mapping. Losers try again in the next round.
5. Ids left without a slot (their whole window seen at this step, rounds
   exhausted, or a full window under `'none'`) get slot `capacity`: no row.

The steps live in `id_assign` (1 to 3, 5) and `id_claims` (4);
`id_pipeline.assign_xla` runs them in this order through XLA, the CPU kernel
(`id_kernels`) does the same in C++ where it may run.

`capacity` is the slot that names no row: `lazy_optax.lookup` reads zeros
for it and no optimizer update reaches it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import checks
from lazy_optax._src import cpu_kernels
from lazy_optax._src import id_assign
from lazy_optax._src import id_claims
from lazy_optax._src import id_export
from lazy_optax._src import id_kernels
from lazy_optax._src import id_pipeline
from lazy_optax._src import id_words
from lazy_optax._src import sharding as _sharding

_EVICTIONS = ('lru', 'lfu', 'none')
_ADMISSIONS = ('frequency', 'always')
_DEFAULT_PROBE = 16
_MAX_CAPACITY = 2 ** 31 - 2          # capacity itself must fit int32
EMPTY_STEP = -(2 ** 30)              # last_seen of a never-used slot
# The default sketch width per slot: a sketch as narrow as the table counts
# a stream with many more distinct ids than slots with collisions that blur
# the frequency guard (docs/hashed_ids.md, "Which policy for which stream").
SKETCH_COLUMNS_PER_SLOT = 16
_MAX_SKETCH_WIDTH = 2 ** 31 - 1


class IdCounters(NamedTuple):
  """Cumulative counts of an id table's events, since `init`.

  Each field is a `uint32[2]` count (high word, low word), so it does not
  wrap around in long runs; `IdTable.stats` reads them as Python ints.

  Attributes:
    admissions: ids given a row (a new id, or a returning evicted one).
    evictions: live ids that lost their row to another id.
    expirations: ids freed because they were not seen for `ttl` steps.
    rejections: lookups that got no row because their probe window was full
      of live ids under `eviction='none'`.
    overflows: lookups that got no row because every slot of their probe
      window was taken by ids of the same step (or they lost every round).
    unadmitted: lookups of ids not yet seen `admit_after` times.
    declined: lookups refused the slot of a live id that the sketch counts
      as often or more (`admission='frequency'`).
  """
  admissions: jax.Array
  evictions: jax.Array
  expirations: jax.Array
  rejections: jax.Array
  overflows: jax.Array
  unadmitted: jax.Array
  declined: jax.Array


class IdTableState(NamedTuple):
  """The state of an `IdTable`: a pytree of fixed shapes.

  Save it with orbax alongside the parameters and the optimizer state, and
  donate it to the jitted step (`assign` updates it in place). The parts a
  configuration does not use are `None` (an empty pytree node), never a
  zero-size array, so every configuration checkpoints.

  Attributes:
    ids: `uint32[capacity, 2]`, the raw id words of each slot's owner;
      `0xFFFFFFFF` words for an empty slot.
    last_seen: `int32[capacity]`, the step its owner was last assigned.
    counts: `int32[capacity]`, `'lfu'` counts (None for other policies).
    claims: `uint32[capacity]`, scratch for resolving claims; all zero
      between calls.
    sketch: `int32[depth, width]`, the count-min sketch of lookups (None
      when `admit_after == 1` and nothing is frequency-guarded).
    wheel: `int32[ttl + 1]`, live ids per last-seen step modulo `ttl + 1`
      (None without `ttl`).
    log_ids: `uint32[eviction_log, 2]`, evicted ids (a ring; None when
      `eviction_log=0`).
    log_steps: `int32[eviction_log]`, the step each logged id lost its row
      (-1: unused entry; None when `eviction_log=0`).
    log_next: `int32[]`, the next ring entry to write.
    log_lost: `int32[]`, the latest eviction step among overwritten ring
      entries (-1: none), so `export_changes` knows what it cannot list.
    step: `int32[]`, the latest step given to `assign` (-1 before any).
    live: `int32[]`, the number of live ids.
    counters: the `IdCounters`.
  """
  ids: jax.Array
  last_seen: jax.Array
  counts: Optional[jax.Array]
  claims: jax.Array
  sketch: Optional[jax.Array]
  wheel: Optional[jax.Array]
  log_ids: Optional[jax.Array]
  log_steps: Optional[jax.Array]
  log_next: jax.Array
  log_lost: jax.Array
  step: jax.Array
  live: jax.Array
  counters: IdCounters


class FreshRows(NamedTuple):
  """The slots whose owner changed in one `assign` call, and their new ids.

  Give it to `reset_rows` (`{'emb/table': fresh}`), which re-initializes
  those rows of the table and of every optimizer-state leaf that mirrors it.

  Attributes:
    slots: `int32[N]` (one entry per looked-up id): a slot that got a new
      owner, or `capacity` (nothing to reset). Each fresh slot appears once.
    ids: `uint32[N, 2]`: the raw id words at the same positions (used to
      derive each fresh row's initial value from its id).
    capacity: the capacity of the `IdTable` that made it (static: not a
      leaf of the pytree), so that `reset_rows` refuses a table of another
      row count at trace time; None (no check) for hand-made ones.
  """
  slots: jax.Array
  ids: jax.Array
  capacity: Optional[int] = None


# The capacity is static data of the pytree (known at trace time), the
# slots and ids its leaves.
def _fresh_rows_from(capacity: Optional[int], leaves: Iterable[jax.Array]
                     ) -> FreshRows:
  slots, ids = leaves
  return FreshRows(slots, ids, capacity)


jax.tree_util.register_pytree_with_keys(
    FreshRows,
    lambda rows: (((jax.tree_util.GetAttrKey('slots'), rows.slots),
                   (jax.tree_util.GetAttrKey('ids'), rows.ids)),
                  rows.capacity),
    _fresh_rows_from,
    lambda rows: ((rows.slots, rows.ids), rows.capacity))


def _raise_all(problems: list[Exception]) -> None:
  """One error naming every bad argument (a TypeError if all are)."""
  if not problems:
    return
  kind = TypeError if all(isinstance(p, TypeError) for p in problems) else (
      ValueError)
  if len(problems) == 1:
    raise kind(f'IdTable: {problems[0]}.')
  listed = '; '.join(str(p) for p in problems)
  raise kind(f'IdTable: {len(problems)} bad arguments: {listed}.')


@dataclasses.dataclass(frozen=True)
class IdTable:
  """A collision-free map from raw ids to the rows of a `[capacity, ...]` table.

  Every live id holds its own slot (row) of the table: no two ids share a
  row, unlike `id % capacity`. New ids take free slots of their probe window
  or evict an old id there (`eviction`); ids not seen for `ttl` steps are
  freed; `admit_after` keeps rare ids out until they were seen that often.
  Slot `capacity` means "no row": `lazy_optax.lookup` reads a zero row for
  it and no gradient row is produced. See docs/hashed_ids.md.

  Attributes:
    capacity: the number of slots (the table's row count), at most
      `2**31 - 2`.
    probe: the probe window's size (slots an id may live in), in
      `[1, min(capacity, 4096)]`; None (the default) means
      `min(16, capacity)`.
    eviction: `'lfu'` (the default: the lowest count, halved every
      `lfu_period` steps, then the least recently seen id of the window
      gives way), `'lru'` (the least recently seen; the default before,
      still one argument away: `eviction='lru'`), or `'none'` (a full
      window rejects the new id).
    admission: `'frequency'` (a new id takes the victim's slot only when
      the count-min sketch has seen it more often than the victim, counts
      halved every `lfu_period` steps: ids that keep coming back are not
      pushed out by rarer ones) or `'always'` (the victim always gives way:
      the behaviour before `admission` existed). Listed last, after
      `checked`, so positional arguments keep their meaning.
    admit_after: an id gets a row once it was looked up this many times (a
      count-min sketch of `sketch_depth x sketch_width` counts); 1 admits at
      once.
    ttl: ids not seen for more than `ttl` steps are freed (None: never). An
      id last seen at step `t` is live through step `t + ttl`. Costs
      `4 * (ttl + 1)` bytes and `O(ttl)` element-wise work per step.
    rounds: claim rounds per `assign` (a fixed number; more rounds place
      more of the ids that collide on one slot within a step).
    lfu_period: steps per halving of the `'lfu'` counts (and of the sketch
      under `admission='frequency'`).
    sketch_depth: rows of the admission sketch.
    sketch_width: columns of the admission sketch (default
      `16 * capacity`, at most `2**31 - 1`: 128 bytes a slot at depth 2, so
      that a stream of many more distinct ids than slots is counted with
      few collisions; `sketch_width=capacity` was the default before); the
      table holds a sketch when `admit_after > 1` or under
      `admission='frequency'` with a victim policy.
    eviction_log: entries of the ring of evicted ids read by
      `export_changes` (default `capacity`; 0 for none).
    seed: salt of the hashes (fixed for the life of a table).
    checked: under `lazy_optax.checks.checked` or in a step built with
      `lazy_optax.perf.make_train_step`, report (`CheckError`) a step in
      which ids got no row for lack of room (a full table); in another
      jitted step, an error naming these two.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> import lazy_optax
    >>> table_ids = lazy_optax.IdTable(capacity=4, probe=4)
    >>> state = table_ids.init()
    >>> ids = np.array([10**12, 7, 10**12], np.int64)
    >>> slots, state, fresh = table_ids.assign(state, ids, step=0)
    >>> bool(slots[0] == slots[2]), bool(slots[0] != slots[1])
    (True, True)
    >>> table_ids.find(state, np.array([7, 8], np.int64))[1]   # absent: 4
    Array(4, dtype=int32)
  """

  capacity: int
  probe: Optional[int] = None
  eviction: str = 'lfu'
  admit_after: int = 1
  ttl: Optional[int] = None
  rounds: int = 4
  lfu_period: int = 1000
  sketch_depth: int = 2
  sketch_width: Optional[int] = None
  eviction_log: Optional[int] = None
  seed: int = 0
  checked: bool = False
  admission: str = 'frequency'

  def __post_init__(self):
    problems = self._argument_problems()
    _raise_all(problems)
    if self.probe is None:
      object.__setattr__(self, 'probe', min(_DEFAULT_PROBE, self.capacity))
    for name in ('capacity', 'probe', 'admit_after', 'ttl', 'rounds',
                 'lfu_period', 'sketch_depth', 'sketch_width', 'eviction_log',
                 'seed'):
      value = getattr(self, name)
      if value is not None:
        object.__setattr__(self, name, int(value))

  def _argument_problems(self) -> list[Exception]:
    """Every bad argument, in signature order (none hides another)."""
    problems: list[Exception] = []

    def check(value: object, name: str, low: int, high: int) -> bool:
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        problems.append(TypeError(f'{name} must be a Python int, got '
                                  f'{value!r}'))
      elif not low <= value <= high:
        problems.append(ValueError(f'{name} must lie in [{low}, {high}], '
                                   f'got {value}'))
      else:
        return True
      return False

    capacity_ok = check(self.capacity, 'capacity', 1, _MAX_CAPACITY)
    if self.probe is not None:
      high = min(self.capacity, 4096) if capacity_ok else 4096
      name = f'probe (with capacity={self.capacity})' if capacity_ok and (
          self.capacity < 4096) else 'probe'
      check(self.probe, name, 1, high)
    if self.eviction not in _EVICTIONS:
      problems.append(ValueError(
          f'eviction must be one of {_EVICTIONS}, got {self.eviction!r}'))
    if self.admission not in _ADMISSIONS:
      problems.append(ValueError(
          f'admission must be one of {_ADMISSIONS}, got {self.admission!r}'))
    check(self.admit_after, 'admit_after', 1, id_assign.COUNT_LIMIT)
    if self.ttl is not None:
      check(self.ttl, 'ttl', 0, 2 ** 26)
    check(self.rounds, 'rounds', 1, 64)
    check(self.lfu_period, 'lfu_period', 1, 2 ** 30)
    check(self.sketch_depth, 'sketch_depth', 1, 16)
    if self.sketch_width is not None:
      check(self.sketch_width, 'sketch_width', 1, 2 ** 31 - 1)
    if self.eviction_log is not None:
      check(self.eviction_log, 'eviction_log', 0, 2 ** 31 - 1)
    check(self.seed, 'seed', 0, 2 ** 32 - 1)
    if not isinstance(self.checked, bool):
      problems.append(TypeError(f'checked must be a bool, got '
                                f'{self.checked!r}'))
    return problems

  # -- shapes -----------------------------------------------------------------

  @property
  def _sketch_shape(self) -> Optional[tuple[int, int]]:
    if self.admit_after == 1 and not id_claims.guards(self):
      return None
    width = self.sketch_width or min(SKETCH_COLUMNS_PER_SLOT * self.capacity,
                                     _MAX_SKETCH_WIDTH)
    return (self.sketch_depth, width)

  @property
  def _log_size(self) -> int:
    return self.capacity if self.eviction_log is None else self.eviction_log

  def init(self) -> IdTableState:
    """An empty table's state (all slots free, counters zero).

    Parts the configuration does not use are `None` (no zero-size arrays,
    which orbax cannot save).

    Returns:
      An `IdTableState`.
    """
    state = _empty_state_jit(self)
    cpu_kernels.load_for(state)   # eagerly, on concrete CPU arrays only
    return state

  def shardings(self, mesh: jax.sharding.Mesh,
                axis: Union[str, tuple[str, ...]]) -> IdTableState:
    """Shardings for the state: slot arrays split over `axis` of `mesh`.

    Slot `s` lives with row `s` of a table sharded by rows over the same
    axis (hash buckets are contiguous slot ranges). The eviction log and the
    sketch's columns are split too when their sizes divide evenly; the
    wheel, counters and scalars are replicated.

    Args:
      mesh: a `jax.sharding.Mesh`.
      axis: the mesh axis (or axes) that splits the slots.

    Returns:
      An `IdTableState` of `NamedSharding`s (give it to `jax.device_put` or
      as the jitted step's `in_shardings`/`out_shardings`).
    """
    P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
    names = axis if isinstance(axis, tuple) else (axis,)
    devices = 1
    for name in names:
      devices *= mesh.shape[name]

    # Untyped (`Any`): the IdTableState built here holds shardings in fields
    # typed as arrays.
    def spec(*parts: Union[None, str, tuple[str, ...]]) -> Any:
      return jax.sharding.NamedSharding(mesh, P(*parts))

    def split_if(size: int, *parts: Union[None, str, tuple[str, ...]]
                 ) -> Any:
      return spec(*parts) if size % devices == 0 else spec()

    whole = spec()
    log, sketch = self._log_size, self._sketch_shape
    return IdTableState(
        ids=spec(axis), last_seen=spec(axis),
        counts=spec(axis) if self.eviction == 'lfu' else None,
        claims=spec(axis),
        sketch=None if sketch is None else split_if(sketch[1], None, axis),
        wheel=None if self.ttl is None else whole,
        log_ids=split_if(log, axis) if log else None,
        log_steps=split_if(log, axis) if log else None,
        log_next=whole, log_lost=whole, step=whole, live=whole,
        counters=IdCounters(*([whole] * len(IdCounters._fields))))

  @functools.cached_property
  def _state_shapes(self) -> IdTableState:
    return jax.eval_shape(self.init)

  # -- reading ----------------------------------------------------------------

  def _check_state(self, state: object, where: str) -> None:
    if not isinstance(state, IdTableState):
      raise TypeError(f'{where}: the state must be the IdTableState from '
                      f'IdTable.init, got {type(state).__name__}.')
    expected = self._state_shapes
    for name, want, got in zip(IdTableState._fields, expected, state):
      if (want is None) != (got is None):
        made = 'no array' if want is None else 'an array'
        hint = (' (zero-size arrays stood for unused parts before; they are '
                'None now)' if want is None
                and 0 in tuple(getattr(got, 'shape', ())) else '')
        if name == 'counts' and got is None:
          hint = (" (the default eviction was 'lru' before 'lfu': pass "
                  "eviction='lru' for a state made with that default)")
        raise ValueError(
            f'{where}: state.{name} is '
            f'{"None" if got is None else "an array"}, but this IdTable '
            f'({self}) makes {made}{hint}: was the state made by another '
            'IdTable?')
      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        if tuple(jnp.shape(g)) != tuple(w.shape) or jnp.result_type(
            g) != w.dtype:
          hint = (f' (the sketch was `capacity` wide by default before: '
                  f'pass sketch_width={jnp.shape(g)[-1]} for such a state)'
                  if name == 'sketch' and self.sketch_width is None
                  and jnp.ndim(g) == 2 else '')
          raise ValueError(
              f'{where}: state.{name} has {jnp.result_type(g)}'
              f'{list(jnp.shape(g))}, but this IdTable ({self}) makes '
              f'{w.dtype}{list(w.shape)}{hint}: was the state made by '
              'another IdTable?')

  def find(self, state: IdTableState, raw_ids: jax.typing.ArrayLike, *,
           ids_are_32bit: bool = False) -> jax.Array:
    """The slots of live ids, `capacity` for absent ones; never inserts.

    For serving and evaluation: the state is read, not changed (an id that
    is found is not marked as seen, and no counter moves). Under `ttl`, ids
    count as live up to the latest step given to `assign`.

    Args:
      state: the table's state.
      raw_ids: ids of any shape (as for `assign`).
      ids_are_32bit: as for `assign`: lets traced int32 ids through.

    Returns:
      int32 slots of the ids' shape, in `[0, capacity]`.

    Raises:
      TypeError, ValueError: bad ids or state (as for `assign`).

    Example:
      >>> import numpy as np
      >>> import lazy_optax
      >>> t = lazy_optax.IdTable(capacity=8, probe=2)
      >>> slots, state, _ = t.assign(t.init(), np.array([3, 9]), step=0)
      >>> bool((t.find(state, np.array([3, 9])) == slots).all())
      True
      >>> t.find(state, np.array([4]))
      Array([8], dtype=int32)
    """
    where = 'IdTable.find'
    self._check_state(state, where)
    words, shape = id_words.to_words(raw_ids, where,
                                     ids_are_32bit=ids_are_32bit)
    mesh = _sharding.explicit_mesh(state.ids)
    if mesh is not None:
      whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
      return jax.sharding.auto_axes(
          functools.partial(_find_jit, self), axes=mesh.explicit_axes,
          out_sharding=whole)(state, words).reshape(shape)
    return _find_jit(self, state, words).reshape(shape)

  def _find(self, state: IdTableState, words: jax.Array) -> jax.Array:
    return id_kernels.on_platform(
        self, state, functools.partial(id_kernels.find, self),
        self._find_xla, state, words)

  def _find_xla(self, state: IdTableState, words: jax.Array) -> jax.Array:
    win = id_assign.probe_windows(self, state.ids, state.last_seen, words,
                                  jnp.maximum(state.step, 0))
    return jnp.where(win.found, win.hit_slot, self.capacity).astype(jnp.int32)

  def export_changes(self, state: IdTableState, since_step: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids whose rows changed since a step, their slots, and evicted ids.

    For serving (see `lazy_optax._src.id_export`): runs on the host (NumPy)
    over the whole state, so call it when exporting, not in the train step.
    `since_step=s` covers the steps `s, s + 1, ..., state.step`; to export
    incrementally, pass the previous export's `int(state.step) + 1`. Apply
    the evicted ids first (delete), then the changed ones (upsert
    `table[slot]`).

    Args:
      state: this table's state (sharded or not).
      since_step: the first step to include (0 or less: everything).

    Returns:
      `(changed_ids, changed_slots, evicted_ids)`: int64 ids and int64
      slots of the live ids assigned at a step `>= since_step` (ordered by
      slot), and the sorted int64 ids that lost their row at a step
      `>= since_step` and hold none now.

    Raises:
      TypeError: `state` is not this table's `IdTableState`, or
        `since_step` is not an int.
      ValueError: the eviction log overwrote evictions at or after
        `since_step` (export more often, or give the `IdTable` a larger
        `eviction_log`), so the evicted ids cannot all be listed.

    Example:
      >>> import numpy as np
      >>> import lazy_optax
      >>> t = lazy_optax.IdTable(capacity=2, probe=2, admission='always')
      >>> _, state, _ = t.assign(t.init(), np.array([10, 11]), step=0)
      >>> _, state, _ = t.assign(state, np.array([12]), step=1)
      >>> changed_ids, changed_slots, evicted = t.export_changes(
      ...     state, since_step=1)
      >>> changed_ids.tolist(), evicted.tolist()
      ([12], [10])
    """
    where = 'IdTable.export_changes'
    self._check_state(state, where)
    since = id_export.check_since_step(since_step, where)
    return id_export.changes(state, since, self.ttl, where)

  def stats(self, state: IdTableState) -> dict[str, int]:
    """The counters as Python ints (on the host): live ids and events.

    Args:
      state: the table's state.

    Returns:
      A dict with `live`, `capacity`, `step` and the `IdCounters` fields.
    """
    out = {'live': int(state.live), 'capacity': self.capacity,
           'step': int(state.step)}
    for name, value in zip(IdCounters._fields, state.counters):
      high, low = (int(v) for v in np.asarray(value))
      out[name] = (high << 32) | low
    return out

  # -- assign -----------------------------------------------------------------

  def _step(self, state: IdTableState,
            step: Optional[jax.typing.ArrayLike], where: str) -> jax.Array:
    if step is None:
      return state.step + 1
    if isinstance(step, bool) or not jnp.issubdtype(jnp.result_type(step),
                                                    jnp.integer):
      raise TypeError(f'{where}: step must be an integer, got {step!r}.')
    if not isinstance(step, jax.core.Tracer):
      value = int(np.asarray(step))
      if not 0 <= value < 2 ** 30:
        raise ValueError(f'{where}: step must lie in [0, 2**30), got '
                         f'{value}.')
      if not isinstance(state.step, jax.core.Tracer) and value < int(
          state.step):
        raise ValueError(
            f'{where}: step {value} is before the state\'s step '
            f'{int(state.step)}: steps must not go back.')
    # Under jit a step before the state's counts as the state's step.
    return jnp.maximum(jnp.asarray(step, jnp.int32), state.step)

  def assign(self, state: IdTableState, raw_ids: jax.typing.ArrayLike,
             step: Optional[jax.typing.ArrayLike] = None, *,
             ids_are_32bit: bool = False
             ) -> tuple[jax.Array, IdTableState, FreshRows]:
    """Slots for a batch of raw ids, inserting new ids (see the module doc).

    Pure and jit-able; donate `state`. Every call touches O(batch x probe)
    entries of the state, never the whole table.

    Args:
      state: the table's state.
      raw_ids: ids of any shape, in a form that cannot have lost bits:
        concrete integer arrays (NumPy int64 outside jit, converted on the
        host), `uint32[..., 2]` words from `lazy_optax.split_ids` (inside
        jit), or traced int64 under `jax_enable_x64`. Traced int32 ids are
        refused at trace time (they may be int64 ids that `jax.jit` cut to
        32 bits) unless `ids_are_32bit=True`. Concrete invalid ids raise;
        traced ones (negative int32) get slot `capacity`.
      step: the training step (a non-decreasing int, traced or not); the
        default is the state's step + 1. It drives `'lru'`, `ttl` and
        `export_changes`.
      ids_are_32bit: the caller's promise that every id lies in
        `[0, 2**31 - 1]`: traced int32 ids are then taken as they are
        (concrete ones are checked against it).

    Returns:
      `(slots, state, fresh)`: int32 slots of the ids' shape in
      `[0, capacity]` (`capacity`: no row), the new state, and the
      `FreshRows` to give to `reset_rows`.

    Raises:
      TypeError, ValueError: bad ids, step or state.
    """
    where = 'IdTable.assign'
    self._check_state(state, where)
    words, shape = id_words.to_words(raw_ids, where,
                                     ids_are_32bit=ids_are_32bit)
    now = self._step(state, step, where)
    mesh = _sharding.explicit_mesh(state.ids)
    if mesh is None:
      slots, state, fresh, room = _assign_jit(self, state, words, now)
    else:
      # Under an Explicit mesh the claims run with the mesh's axes made
      # Auto (XLA partitions the gathers and scatters as for any step); the
      # state keeps its shardings, the batch-sized outputs are replicated.
      # `Any`: a sharding where FreshRows has arrays (out_sharding below).
      whole: Any = jax.sharding.NamedSharding(mesh,
                                              jax.sharding.PartitionSpec())
      specs = jax.tree.map(lambda x: jax.typeof(x).sharding, state)
      slots, state, fresh, room = jax.sharding.auto_axes(
          functools.partial(_assign_jit, self), axes=mesh.explicit_axes,
          out_sharding=(whole, specs, FreshRows(whole, whole), whole))(
              state, words, now)
    if self.checked:
      checks.check_id_table_room(room, state.live, self.capacity)
    fresh = fresh._replace(capacity=self.capacity)
    return slots.reshape(shape), state, fresh

  def _empty_state(self) -> IdTableState:
    """`init`'s arrays (jitted below: one program, not one per array)."""
    c, log, sketch = self.capacity, self._log_size, self._sketch_shape
    return IdTableState(
        ids=jnp.full((c, 2), id_words.EMPTY_WORD, jnp.uint32),
        last_seen=jnp.full((c,), EMPTY_STEP, jnp.int32),
        counts=jnp.zeros((c,), jnp.int32) if self.eviction == 'lfu' else None,
        claims=jnp.zeros((c,), jnp.uint32),
        sketch=None if sketch is None else jnp.zeros(sketch, jnp.int32),
        wheel=None if self.ttl is None else jnp.zeros((self.ttl + 1,),
                                                      jnp.int32),
        log_ids=jnp.full((log, 2), id_words.EMPTY_WORD, jnp.uint32)
        if log else None,
        log_steps=jnp.full((log,), -1, jnp.int32) if log else None,
        log_next=jnp.zeros((), jnp.int32),
        log_lost=jnp.full((), -1, jnp.int32),
        step=jnp.full((), -1, jnp.int32),
        live=jnp.zeros((), jnp.int32),
        counters=IdCounters(*(jnp.zeros((2,), jnp.uint32)
                              for _ in IdCounters._fields)))

  def _assign(self, state: IdTableState, words: jax.Array, now: jax.Array
              ) -> tuple[jax.Array, IdTableState, FreshRows, jax.Array]:
    """The CPU kernel where it may run (`id_kernels.usable`), else XLA's."""

    def kernel(state, words, now):
      slots, state, fresh, room = id_kernels.assign(self, state, words, now)
      return slots, state, FreshRows(fresh, words), room

    return id_kernels.on_platform(self, state, kernel, self._assign_xla,
                                  state, words, now)

  def _assign_xla(self, state: IdTableState, words: jax.Array,
                  now: jax.Array
                  ) -> tuple[jax.Array, IdTableState, FreshRows, jax.Array]:
    """The steps of the module doc through XLA (`id_pipeline.assign_xla`)."""
    slots, state, fresh, room = id_pipeline.assign_xla(self, state, words, now)
    return slots, state, FreshRows(fresh, words), room


# Jitted with the (hashable, frozen) table static: one compiled program per
# table and batch shape when called eagerly; inlined under an outer jit.
_empty_state_jit = jax.jit(IdTable._empty_state, static_argnums=0)
_assign_jit = jax.jit(IdTable._assign, static_argnums=0)
_find_jit = jax.jit(IdTable._find, static_argnums=0)


def check_id_table(table: object, where: str) -> IdTable:
  """`table`, refused unless an `IdTable` (the hashed-id layers' check)."""
  if not isinstance(table, IdTable):
    raise TypeError(f'{where}: table must be a lazy_optax.IdTable, got '
                    f'{type(table).__name__}.')
  return table
