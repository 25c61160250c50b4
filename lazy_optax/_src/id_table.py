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
   times (the sketch counts every lookup of an id that holds no row).
4. Admitted ids claim slots in a fixed number of rounds (`rounds`). In each
   round every unplaced id picks its best slot among those of its window not
   seen at this step: free slots (empty, or expired under `ttl`) first, then
   the policy's victim (`'lru'`: the least recently seen; `'lfu'`: the
   lowest decayed count, then the least recently seen; `'none'`: no victim).
   Ties go to the earlier slot of the window. Several ids picking one slot
   are resolved by id value (the smallest id wins) through a scatter-max
   into a per-slot scratch that is zero again after every round, so the
   result depends on the set of ids only: any batch order and any device
   count give the same mapping. Losers try again in the next round.
5. Ids left without a slot (their whole window seen at this step, rounds
   exhausted, or a full window under `'none'`) get slot `capacity`: no row.

`capacity` is the slot that names no row: `lazy_optax.lookup` reads zeros
for it and no optimizer update reaches it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import checks
from lazy_optax._src import id_hashing
from lazy_optax._src import id_words
from lazy_optax._src import sharding as _sharding

_EVICTIONS = ('lru', 'lfu', 'none')
_MAX_CAPACITY = 2 ** 31 - 2          # capacity itself must fit int32
EMPTY_STEP = -(2 ** 30)              # last_seen of a never-used slot
_BIG_STEP = 2 ** 31 - 1
_COUNT_LIMIT = 2 ** 30


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
  """
  admissions: jax.Array
  evictions: jax.Array
  expirations: jax.Array
  rejections: jax.Array
  overflows: jax.Array
  unadmitted: jax.Array


class IdTableState(NamedTuple):
  """The state of an `IdTable`: a pytree of fixed shapes.

  Save it with orbax alongside the parameters and the optimizer state, and
  donate it to the jitted step (`assign` updates it in place).

  Attributes:
    ids: `uint32[capacity, 2]`, the raw id words of each slot's owner;
      `0xFFFFFFFF` words for an empty slot.
    last_seen: `int32[capacity]`, the step its owner was last assigned.
    counts: `int32[capacity]`, `'lfu'` counts (empty for other policies).
    claims: `uint32[capacity]`, scratch for resolving claims; all zero
      between calls.
    sketch: `int32[depth, width]`, the admission count-min sketch (empty
      when `admit_after == 1`).
    wheel: `int32[ttl + 1]`, live ids per last-seen step modulo `ttl + 1`
      (empty without `ttl`).
    log_ids: `uint32[eviction_log, 2]`, evicted ids (a ring).
    log_steps: `int32[eviction_log]`, the step each logged id lost its row
      (-1: unused entry).
    log_next: `int32[]`, the next ring entry to write.
    log_lost: `int32[]`, the latest eviction step among overwritten ring
      entries (-1: none), so `export_changes` knows what it cannot list.
    step: `int32[]`, the latest step given to `assign` (-1 before any).
    live: `int32[]`, the number of live ids.
    counters: the `IdCounters`.
  """
  ids: jax.Array
  last_seen: jax.Array
  counts: jax.Array
  claims: jax.Array
  sketch: jax.Array
  wheel: jax.Array
  log_ids: jax.Array
  log_steps: jax.Array
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
def _fresh_rows_from(capacity: Optional[int], leaves: Any) -> FreshRows:
  slots, ids = leaves
  return FreshRows(slots, ids, capacity)


jax.tree_util.register_pytree_with_keys(
    FreshRows,
    lambda rows: (((jax.tree_util.GetAttrKey('slots'), rows.slots),
                   (jax.tree_util.GetAttrKey('ids'), rows.ids)),
                  rows.capacity),
    _fresh_rows_from,
    lambda rows: ((rows.slots, rows.ids), rows.capacity))


def _add64(count: jax.Array, n: jax.Array) -> jax.Array:
  """`count` (uint32 [high, low]) plus a non-negative int32 `n`."""
  low = count[1] + n.astype(jnp.uint32)
  carry = (low < count[1]).astype(jnp.uint32)
  return jnp.stack([count[0] + carry, low])


def _after(index: jax.Array, read: jax.Array, fill: int) -> jax.Array:
  """`index`, made to depend on `read` (int32 values that are never max).

  A scatter into a donated array whose indices do not depend on an earlier
  gather from it makes XLA copy the whole array first (nothing orders the
  gather before the in-place write); measured here on every such pair. This
  keeps the indices as they are and adds the dependency.
  """
  return jnp.where(read != jnp.iinfo(jnp.int32).max, index, fill)


def _window(array: jax.Array, homes: jax.Array, probe: int) -> jax.Array:
  """`array[homes[i] : homes[i] + probe]` for each i: `[N, probe, ...]`."""
  rest = array.shape[1:]
  dims = lax.GatherDimensionNumbers(
      offset_dims=tuple(range(1, 2 + len(rest))), collapsed_slice_dims=(),
      start_index_map=(0,))
  return lax.gather(array, homes[:, None], dims, (probe, *rest),
                    mode='clip')


def _first(mask: jax.Array) -> jax.Array:
  """The first True column of each row of `mask [N, P]`, or P (int32).

  Two plain reductions: on XLA CPU `argmin`/`argmax` (a variadic reduce)
  measured several times slower.
  """
  probe = mask.shape[1]
  return jnp.min(jnp.where(mask, lax.iota(jnp.int32, probe)[None, :], probe),
                 axis=1)


def _pick(values: jax.Array, j: jax.Array) -> jax.Array:
  """`values[i, j[i]]` for `values [N, P]` (zero where `j[i]` is P)."""
  hit = lax.iota(jnp.int32, values.shape[1])[None, :] == j[:, None]
  if values.dtype == jnp.bool_:
    return jnp.any(hit & values, axis=1)
  return jnp.sum(jnp.where(hit, values, jnp.zeros((), values.dtype)), axis=1,
                 dtype=values.dtype)


def _count(mask: jax.Array) -> jax.Array:
  return jnp.sum(mask.astype(jnp.int32))


class _DefaultProbe(int):
  """The default `probe` (16), narrowed to `capacity` for smaller tables."""


_DEFAULT_PROBE = _DefaultProbe(16)


def _int_problem(value: Any, name: str, low: int,
                 high: int) -> Optional[Exception]:
  """What is wrong with an int argument (None: nothing)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    return TypeError(f'{name} must be a Python int, got {value!r}')
  if not low <= value <= high:
    return ValueError(f'{name} must lie in [{low}, {high}], got {value}')
  return None


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
      `[1, min(capacity, 4096)]`; default `min(16, capacity)`.
    eviction: `'lru'` (the least recently seen id of the window gives way),
      `'lfu'` (the lowest count, halved every `lfu_period` steps, then the
      least recently seen), or `'none'` (a full window rejects the new id).
    admit_after: an id gets a row once it was looked up this many times (a
      count-min sketch of `sketch_depth x sketch_width` counts); 1 admits at
      once.
    ttl: ids not seen for more than `ttl` steps are freed (None: never). An
      id last seen at step `t` is live through step `t + ttl`. Costs
      `4 * (ttl + 1)` bytes and `O(ttl)` element-wise work per step.
    rounds: claim rounds per `assign` (a fixed number; more rounds place
      more of the ids that collide on one slot within a step).
    lfu_period: steps per halving of the `'lfu'` counts.
    sketch_depth: rows of the admission sketch.
    sketch_width: columns of the admission sketch (default `capacity`).
    eviction_log: entries of the ring of evicted ids read by
      `export_changes` (default `capacity`; 0 for none).
    seed: salt of the hashes (fixed for the life of a table).
    checked: under `lazy_optax.checks.checked`, report (`CheckError`) a step in
      which ids got no row for lack of room (a full table).

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
  probe: int = _DEFAULT_PROBE
  eviction: str = 'lru'
  admit_after: int = 1
  ttl: Optional[int] = None
  rounds: int = 4
  lfu_period: int = 1000
  sketch_depth: int = 2
  sketch_width: Optional[int] = None
  eviction_log: Optional[int] = None
  seed: int = 0
  checked: bool = False

  def __post_init__(self):
    problems = self._argument_problems()
    _raise_all(problems)
    if type(self.probe) is _DefaultProbe:  # pylint: disable=unidiomatic-typecheck
      object.__setattr__(self, 'probe', min(int(self.probe), self.capacity))
    for name in ('capacity', 'probe', 'admit_after', 'ttl', 'rounds',
                 'lfu_period', 'sketch_depth', 'sketch_width', 'eviction_log',
                 'seed'):
      value = getattr(self, name)
      if value is not None:
        object.__setattr__(self, name, int(value))

  def _argument_problems(self) -> list[Exception]:
    """Every bad argument, in signature order (none hides another)."""
    problems = []

    def check(value: Any, name: str, low: int, high: int) -> bool:
      problem = _int_problem(value, name, low, high)
      if problem is not None:
        problems.append(problem)
      return problem is None

    capacity_ok = check(self.capacity, 'capacity', 1, _MAX_CAPACITY)
    if type(self.probe) is not _DefaultProbe:  # pylint: disable=unidiomatic-typecheck
      high = min(self.capacity, 4096) if capacity_ok else 4096
      name = f'probe (with capacity={self.capacity})' if capacity_ok and (
          self.capacity < 4096) else 'probe'
      check(self.probe, name, 1, high)
    if self.eviction not in _EVICTIONS:
      problems.append(ValueError(
          f'eviction must be one of {_EVICTIONS}, got {self.eviction!r}'))
    check(self.admit_after, 'admit_after', 1, _COUNT_LIMIT)
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
  def _sketch_shape(self) -> tuple[int, int]:
    if self.admit_after == 1:
      return (0, 0)
    width = self.sketch_width or self.capacity
    return (self.sketch_depth, width)

  @property
  def _log_size(self) -> int:
    return self.capacity if self.eviction_log is None else self.eviction_log

  def init(self) -> IdTableState:
    """An empty table's state (all slots free, counters zero).

    Returns:
      An `IdTableState`.
    """
    c = self.capacity
    return IdTableState(
        ids=jnp.full((c, 2), id_words.EMPTY_WORD, jnp.uint32),
        last_seen=jnp.full((c,), EMPTY_STEP, jnp.int32),
        counts=jnp.zeros((c if self.eviction == 'lfu' else 0,), jnp.int32),
        claims=jnp.zeros((c,), jnp.uint32),
        sketch=jnp.zeros(self._sketch_shape, jnp.int32),
        wheel=jnp.zeros((0 if self.ttl is None else self.ttl + 1,),
                        jnp.int32),
        log_ids=jnp.full((self._log_size, 2), id_words.EMPTY_WORD,
                         jnp.uint32),
        log_steps=jnp.full((self._log_size,), -1, jnp.int32),
        log_next=jnp.zeros((), jnp.int32),
        log_lost=jnp.full((), -1, jnp.int32),
        step=jnp.full((), -1, jnp.int32),
        live=jnp.zeros((), jnp.int32),
        counters=IdCounters(*(jnp.zeros((2,), jnp.uint32)
                              for _ in IdCounters._fields)))

  def shardings(self, mesh: Any, axis: Any) -> IdTableState:
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

    def spec(*parts: Any) -> Any:
      return jax.sharding.NamedSharding(mesh, P(*parts))

    def split_if(size: int, *parts: Any) -> Any:
      return spec(*parts) if size and size % devices == 0 else spec()

    whole = spec()
    log = self._log_size
    return IdTableState(
        ids=spec(axis), last_seen=spec(axis),
        counts=spec(axis) if self.eviction == 'lfu' else whole,
        claims=spec(axis), sketch=split_if(self._sketch_shape[1], None, axis),
        wheel=whole, log_ids=split_if(log, axis), log_steps=split_if(log, axis),
        log_next=whole, log_lost=whole, step=whole, live=whole,
        counters=IdCounters(*([whole] * len(IdCounters._fields))))

  @functools.cached_property
  def _state_shapes(self) -> IdTableState:
    return jax.eval_shape(self.init)

  # -- reading ----------------------------------------------------------------

  def _check_state(self, state: Any, where: str) -> None:
    if not isinstance(state, IdTableState):
      raise TypeError(f'{where}: the state must be the IdTableState from '
                      f'IdTable.init, got {type(state).__name__}.')
    expected = self._state_shapes
    for name, want, got in zip(IdTableState._fields, expected, state):
      for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        if tuple(jnp.shape(g)) != tuple(w.shape) or jnp.result_type(
            g) != w.dtype:
          raise ValueError(
              f'{where}: state.{name} has {jnp.result_type(g)}'
              f'{list(jnp.shape(g))}, but this IdTable ({self}) makes '
              f'{w.dtype}{list(w.shape)}: was the state made by another '
              'IdTable?')

  def _homes(self, words: jax.Array) -> jax.Array:
    """The first slot of each id's probe window: int32 `[N]`.

    Windows do not wrap around: they start in `[0, capacity - probe]`, so
    each is one contiguous slice of the state (a slice gather reads it
    several times faster than `probe` separate indices).
    """
    return id_hashing.home_slots(words, self.capacity - self.probe + 1,
                                 self.seed).astype(jnp.int32)

  def _alive(self, window_words: jax.Array, window_seen: jax.Array,
             now: jax.Array) -> jax.Array:
    occupied = window_words[..., 0] != jnp.uint32(id_words.EMPTY_WORD)
    if self.ttl is None:
      return occupied
    return occupied & (window_seen >= now - self.ttl)

  def find(self, state: IdTableState, raw_ids: Any, *,
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
    valid = id_words.valid_words(words)
    homes = self._homes(words)
    win_words = _window(state.ids, homes, self.probe)
    win_seen = _window(state.last_seen, homes, self.probe)
    now = jnp.maximum(state.step, 0)
    match = self._alive(win_words, win_seen, now) & (
        win_words[..., 0] == words[:, None, 0]) & (
            win_words[..., 1] == words[:, None, 1])
    hit_j = _first(match)
    found = valid & (hit_j < self.probe)
    return jnp.where(found, homes + hit_j, self.capacity).astype(jnp.int32)

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

  def _step(self, state: IdTableState, step: Any, where: str) -> jax.Array:
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

  def assign(self, state: IdTableState, raw_ids: Any, step: Any = None, *,
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

  def _assign(self, state: IdTableState, words: jax.Array, now: jax.Array
              ) -> tuple[jax.Array, IdTableState, FreshRows, jax.Array]:
    c, n = self.capacity, words.shape[0]
    prev = state.step
    valid = id_words.valid_words(words)
    position = lax.iota(jnp.int32, n)
    homes = self._homes(words)
    win_words = _window(state.ids, homes, self.probe)          # [n, P, 2]
    win_seen = _window(state.last_seen, homes, self.probe)     # [n, P]
    alive = self._alive(win_words, win_seen, now)
    match = alive & (win_words[..., 0] == words[:, None, 0]) & (
        win_words[..., 1] == words[:, None, 1])
    hit_j = _first(match)                    # probe (a live id is there once)
    found = valid & (hit_j < self.probe)
    hit_slot = homes + hit_j
    hit_seen = _pick(win_seen, hit_j)

    # Ttl: ids last seen before now - ttl expire now; the wheel says how many.
    wheel, expired_now, live = state.wheel, jnp.zeros((), jnp.int32), state.live
    if self.ttl is not None:
      w = self.ttl + 1
      k = lax.iota(jnp.int32, w)
      at_step = prev - jnp.mod(prev - k, w)
      expiring = (at_step < now - self.ttl) & (prev >= 0)
      expired_now = jnp.sum(jnp.where(expiring, wheel, 0))
      wheel = jnp.where(expiring, 0, wheel)
      live = live - expired_now

    # Admission: the sketch counts lookups of ids without a row.
    need = valid & ~found
    sketch = state.sketch
    admitted = need
    if self.admit_after > 1:
      depth, width = self._sketch_shape
      cols = id_hashing.sketch_columns(words, depth, width, self.seed)
      cols = jnp.where(need[None, :], cols, width)
      rows = jnp.broadcast_to(lax.iota(jnp.int32, depth)[:, None], cols.shape)
      sketch = sketch.at[rows, cols].add(1, mode='drop')
      sketch = sketch.at[rows, cols].min(_COUNT_LIMIT, mode='drop')
      seen = jnp.min(sketch.at[rows, cols].get(mode='fill', fill_value=0),
                     axis=0)
      admitted = need & (seen >= self.admit_after)

    # Hits are seen now: no new id of this step may take their slots.
    last_seen = state.last_seen.at[
        _after(jnp.where(found, hit_slot, c), hit_seen, c)].set(
            now, mode='drop')

    # Per window slot, the policy's preference (lower is better).
    free = ~alive
    if self.eviction == 'lfu':
      win_counts = _window(state.counts, homes, self.probe)
      score = jnp.where(free, -1, self._decayed(win_counts, win_seen, now))
    else:
      score = None

    placed = jnp.full((n,), c, jnp.int32)
    placed_j = jnp.zeros((n,), jnp.int32)
    no_room = jnp.zeros((n,), bool)
    blocked = jnp.zeros((n,), bool)     # a full window under 'none'
    hi_key = ~words[:, 0]
    lo_key = ~words[:, 1]

    per_id = {'homes': homes, 'words': words, 'hi': hi_key, 'lo': lo_key,
              'seen': win_seen, 'free': free}
    if score is not None:
      per_id['score'] = score

    def round_on(tables, ids_in, pending_in):
      """One claim round for the ids `ids_in` (all, or a compacted few)."""
      ids_table, last_seen, claims = tables
      homes_in = ids_in['homes']
      seen_now = _window(last_seen, homes_in, self.probe)
      untouched = seen_now < now
      eligible = untouched
      if self.eviction == 'none':
        eligible = untouched & ids_in['free']
      if self.eviction == 'lfu':
        best = jnp.min(jnp.where(eligible, ids_in['score'], _BIG_STEP), axis=1)
        eligible = eligible & (ids_in['score'] == best[:, None])
      # Free slots are older than live ones (empty: EMPTY_STEP; expired:
      # before now - ttl), so the least recently seen comes first.
      oldest = jnp.where(eligible, ids_in['seen'], _BIG_STEP)
      least = jnp.min(oldest, axis=1)
      has = pending_in & (least < _BIG_STEP)
      j = _first(oldest == least[:, None])
      target = jnp.where(has, homes_in + j, c)
      # The smallest id wins: the largest complement of its high word, then
      # of its low word. The scratch is cleared where it was written.
      hi, lo = ids_in['hi'], ids_in['lo']
      claims = claims.at[target].max(hi, mode='drop')
      won_high = has & (claims.at[target].get(mode='fill', fill_value=0)
                        == hi)
      second = jnp.where(won_high, target, c)
      claims = claims.at[second].set(jnp.uint32(0), mode='drop')
      claims = claims.at[second].max(lo, mode='drop')
      won = won_high & (claims.at[second].get(mode='fill', fill_value=0)
                        == lo)
      winner = jnp.where(won, target, c)
      claims = claims.at[winner].set(jnp.uint32(0), mode='drop')
      ids_table = ids_table.at[winner].set(ids_in['words'], mode='drop')
      last_seen = last_seen.at[winner].set(now, mode='drop')
      stuck = pending_in & ~has
      if self.eviction == 'none':
        blocked_in = stuck & jnp.any(untouched & ~ids_in['free'], axis=1)
      else:
        blocked_in = jnp.zeros_like(stuck)
      return (ids_table, last_seen, claims), (won, target, j, stuck,
                                              blocked_in)

    def merge(carry, tables, results):
      _, placed, placed_j, pending, no_room, blocked = carry
      won, target, j, stuck, blocked_in = results
      return (tables, jnp.where(won, target, placed),
              jnp.where(won, j, placed_j), pending & ~won & ~stuck,
              no_room | stuck, blocked | blocked_in)

    def full_round(carry):
      tables, _, _, pending, _, _ = carry
      new_tables, results = round_on(tables, per_id, pending)
      return merge(carry, new_tables, results)

    def compact_round(few, carry):
      """A round for the pending ids compacted into `few` rows."""
      tables, _, _, pending, _, _ = carry
      rank = jnp.cumsum(pending.astype(jnp.int32)) - 1
      sel = jnp.full((few,), n, jnp.int32).at[
          jnp.where(pending, rank, few)].set(position, mode='drop')
      ids_in = jax.tree.map(
          lambda a: a.at[sel].get(mode='fill', fill_value=0), per_id)
      new_tables, results = round_on(tables, ids_in, sel < n)
      back = [jnp.zeros((n,), r.dtype).at[sel].set(r, mode='drop')
              for r in results]
      return merge(carry, new_tables, tuple(back))

    def one_round(few, carry):
      # The pending ids compacted into `few` rows when they fit (most ids of
      # a batch are hits), all `n` rows when they do not: never a subset
      # chosen by position, so the result does not depend on batch order.
      left = _count(carry[3])
      carry = lax.cond(left > few, full_round, lambda x: x, carry)
      return lax.cond((left <= few) & (left > 0),
                      functools.partial(compact_round, few), lambda x: x,
                      carry)

    carry = ((state.ids, last_seen, state.claims), placed, placed_j,
             admitted, no_room, blocked)
    # The first round: the batch's new ids (a share of it once the hot ids
    # hold rows); later rounds: the few that lost a claim.
    carry = one_round(min(n, max(32, n // 4)), carry)
    if self.rounds > 1:
      later = min(n, max(32, n // 16))
      carry = lax.fori_loop(
          1, self.rounds, lambda _, c: one_round(later, c), carry)
    ((ids_table, last_seen, claims), placed, placed_j, pending, no_room,
     blocked) = carry
    no_room = no_room | pending          # lost every round

    inserted_any = placed < c
    slot = jnp.where(found, hit_slot, placed)
    # One representative position per slot (the last one), for everything
    # counted per id rather than per lookup.
    key = (position + 1).astype(jnp.uint32)
    claims = claims.at[slot].max(key, mode='drop')
    rep = (slot < c) & (claims.at[slot].get(mode='fill', fill_value=0) == key)
    claims = claims.at[jnp.where(rep, slot, c)].set(jnp.uint32(0), mode='drop')
    inserted = rep & inserted_any
    hit = rep & found
    old_alive = _pick(alive, placed_j)
    old_high = _pick(win_words[..., 0], placed_j)
    old_occupied = old_high != jnp.uint32(id_words.EMPTY_WORD)
    old_seen = _pick(win_seen, placed_j)
    old_words = jnp.stack([old_high, _pick(win_words[..., 1], placed_j)],
                          axis=-1)

    counts = state.counts
    if self.eviction == 'lfu':
      hit_count = counts.at[hit_slot].get(mode='clip')
      renewed = jnp.where(hit_seen < now,
                          self._decayed(hit_count, hit_seen, now) + 1,
                          hit_count)
      value = jnp.where(found, jnp.minimum(renewed, _COUNT_LIMIT), 1)
      counts = counts.at[jnp.where(rep, slot, c)].set(value, mode='drop')

    if self.ttl is not None:
      w = self.ttl + 1
      moved = hit & (hit_seen < now)
      evicted_live = inserted & old_alive
      wheel = wheel.at[jnp.where(moved, jnp.mod(hit_seen, w), w)].add(
          -1, mode='drop')
      wheel = wheel.at[jnp.where(evicted_live, jnp.mod(old_seen, w), w)].add(
          -1, mode='drop')
      wheel = wheel.at[jnp.mod(now, w)].add(_count(moved | inserted))

    live = live + _count(inserted & ~old_alive)

    # The eviction log: ids that lost their row (to a new owner here; under
    # ttl, an expired owner is logged at the step it expired).
    log_ids, log_steps = state.log_ids, state.log_steps
    log_next, log_lost = state.log_next, state.log_lost
    record = inserted & old_occupied
    evict_step = jnp.where(old_alive, now,
                           old_seen + (0 if self.ttl is None else self.ttl + 1))
    size = self._log_size
    if size > 0:
      total = _count(record)
      rank = jnp.cumsum(record.astype(jnp.int32)) - 1
      kept = record & (rank >= total - size)
      entry = jnp.mod(log_next + rank, size)
      target = jnp.where(kept, entry, size)
      overwritten = log_steps.at[target].get(mode='fill', fill_value=-1)
      target = _after(target, overwritten, size)
      log_lost = jnp.maximum(log_lost, jnp.max(
          jnp.where(kept, overwritten, -1), initial=-1))
      log_lost = jnp.maximum(log_lost, jnp.max(
          jnp.where(record & ~kept, evict_step, -1), initial=-1))
      log_ids = log_ids.at[target].set(old_words, mode='drop')
      log_steps = log_steps.at[target].set(evict_step, mode='drop')
      log_next = jnp.mod(log_next + total, size)
    else:
      log_lost = jnp.maximum(log_lost, jnp.max(
          jnp.where(record, evict_step, -1), initial=-1))

    full = no_room & ~blocked
    old = state.counters
    counters = IdCounters(
        admissions=_add64(old.admissions, _count(inserted)),
        evictions=_add64(old.evictions, _count(inserted & old_alive)),
        expirations=_add64(old.expirations, expired_now),
        rejections=_add64(old.rejections, _count(blocked)),
        overflows=_add64(old.overflows, _count(full)),
        unadmitted=_add64(old.unadmitted, _count(need & ~admitted)))
    new_state = IdTableState(
        ids=ids_table, last_seen=last_seen, counts=counts, claims=claims,
        sketch=sketch, wheel=wheel, log_ids=log_ids, log_steps=log_steps,
        log_next=log_next, log_lost=log_lost, step=now, live=live,
        counters=counters)
    # The state keeps its dtypes (under jax_enable_x64 scalar arithmetic
    # would otherwise widen some leaves to 64 bits).
    new_state = jax.tree.map(lambda new, old: new.astype(old.dtype),
                             new_state, state)
    slot = slot.astype(jnp.int32)
    fresh = FreshRows(jnp.where(inserted, slot, c).astype(jnp.int32), words)
    return slot, new_state, fresh, _count(no_room)

  def _decayed(self, count: jax.Array, seen: jax.Array,
               now: jax.Array) -> jax.Array:
    """`'lfu'` counts halved once per `lfu_period` boundary since `seen`."""
    period = self.lfu_period
    halvings = jnp.floor_divide(now, period) - jnp.floor_divide(
        jnp.maximum(seen, 0), period)
    return count >> jnp.clip(halvings, 0, 31)


# Jitted with the (hashable, frozen) table static: one compiled program per
# table and batch shape when called eagerly; inlined under an outer jit.
_assign_jit = jax.jit(IdTable._assign, static_argnums=0)
_find_jit = jax.jit(IdTable._find, static_argnums=0)
