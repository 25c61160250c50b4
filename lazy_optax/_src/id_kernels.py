"""`IdTable.assign` and `find` through the CPU kernels (`id_kernels.cc`).

The kernels follow the policy of `id_assign` and `id_claims` (the XLA path)
bit for bit: the same slots, evictions, counters, sketch and eviction log,
so a state written by one path is continued by the other. They run where the
kernels are loaded, the state lives on one CPU device and the table has no
`ttl`; `jax.lax.platform_dependent` keeps the XLA path for other platforms
(a step exported for GPU or TPU holds no call to them).

A call of `LazyOptaxIdAssign` updates the state's arrays in place (its
outputs alias its inputs, so a donated state is never copied) and returns
the slots, the fresh slots and ten int32 event counts (`EVENTS`); the
counters, the live count and the step are then updated here. The claim
scratch is not used (it stays all zero).
"""

from __future__ import annotations

from typing import Callable, Optional, TYPE_CHECKING, TypeVar, Union

import jax
import jax.numpy as jnp

from lazy_optax._src import backend
from lazy_optax._src import id_assign
from lazy_optax._src import id_claims
from lazy_optax._src.placement import placement

if TYPE_CHECKING:
  from lazy_optax._src.id_table import IdTable
  from lazy_optax._src.id_table import IdTableState

Out = TypeVar('Out')  # what `on_platform`'s two paths return

# The kernel's event counts, in the order it writes them.
EVENTS = ('admissions', 'evictions', 'rejections', 'overflows', 'unadmitted',
          'declined', 'live_delta', 'log_next', 'log_lost', 'no_room')
_EVICTION_CODES = {'lru': 0, 'lfu': 1, 'none': 2}
# Stand-ins for the parts of the state a table does not have.
_NO_INT = jax.ShapeDtypeStruct((1,), jnp.int32)
_NO_WORDS = jax.ShapeDtypeStruct((1, 2), jnp.uint32)


def usable(table: IdTable, state: IdTableState) -> bool:
  """Whether `assign` and `find` may take the kernels for this table.

  Args:
    table: the `IdTable`.
    state: its state (concrete or traced).

  Returns:
    True where the kernels are loaded, the table has no `ttl` and its state
    lives on one device that is a CPU (or not known until lowering).
  """
  return table.ttl is None and backend.row_kernels_allowed(
      placement(state.ids))


def _or_stand_in(x: Optional[jax.Array], like: jax.ShapeDtypeStruct
                 ) -> jax.Array:
  return jnp.zeros(like.shape, like.dtype) if x is None else x


def _attributes(table: IdTable) -> dict[str, Union[int, bool]]:
  sketch = table._sketch_shape  # pylint: disable=protected-access
  depth, width = sketch if sketch is not None else (1, 1)
  return dict(
      capacity=table.capacity, probe=id_assign.probe_size(table),
      eviction=_EVICTION_CODES[table.eviction],
      admit_after=table.admit_after, rounds=table.rounds,
      lfu_period=table.lfu_period, seed=table.seed,
      has_sketch=sketch is not None,
      all_lookups=table.admission == 'frequency',
      guarded=id_claims.guards(table), depth=depth, width=width,
      log_size=table._log_size)  # pylint: disable=protected-access


def assign(table: IdTable, state: IdTableState, words: jax.Array,
           now: jax.Array
           ) -> tuple[jax.Array, IdTableState, jax.Array, jax.Array]:
  """`id_pipeline.assign_xla` through the kernel (`usable` must hold)."""
  n = words.shape[0]
  parts = (state.ids, state.last_seen,
           _or_stand_in(state.counts, _NO_INT),
           _or_stand_in(state.sketch, _NO_INT),
           _or_stand_in(state.log_ids, _NO_WORDS),
           _or_stand_in(state.log_steps, _NO_INT))
  scalars = jnp.stack([now, state.step, state.log_next,
                       state.log_lost]).astype(jnp.int32)
  vector = jax.ShapeDtypeStruct((n,), jnp.int32)
  call = jax.ffi.ffi_call(
      'lazy_optax_LazyOptaxIdAssign',
      (vector, vector, jax.ShapeDtypeStruct((len(EVENTS),), jnp.int32))
      + tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts),
      input_output_aliases={2 + k: 3 + k for k in range(len(parts))},
      vmap_method='sequential')
  out = call(words.astype(jnp.uint32), scalars, *parts, **_attributes(table))
  slots, fresh, events = out[:3]
  ids, last_seen, counts, sketch, log_ids, log_steps = out[3:]
  e = dict(zip(EVENTS, events))
  zero = jnp.zeros((), jnp.int32)
  counters = id_assign.add_events(state.counters, {
      'admissions': e['admissions'], 'evictions': e['evictions'],
      'expirations': zero, 'rejections': e['rejections'],
      'overflows': e['overflows'], 'unadmitted': e['unadmitted'],
      'declined': e['declined']})
  new_state = state._replace(
      ids=ids, last_seen=last_seen,
      counts=None if state.counts is None else counts,
      sketch=None if state.sketch is None else sketch,
      log_ids=None if state.log_ids is None else log_ids,
      log_steps=None if state.log_steps is None else log_steps,
      log_next=e['log_next'], log_lost=e['log_lost'], step=now,
      live=state.live + e['live_delta'], counters=counters)
  new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state,
                           state)
  return slots, new_state, fresh, e['no_room']


def find(table: IdTable, state: IdTableState, words: jax.Array
         ) -> jax.Array:
  """`IdTable.find`'s slots through the kernel (`usable` must hold)."""
  call = jax.ffi.ffi_call(
      'lazy_optax_LazyOptaxIdFind',
      jax.ShapeDtypeStruct((words.shape[0],), jnp.int32),
      vmap_method='sequential')
  return call(words.astype(jnp.uint32), state.ids, capacity=table.capacity,
              probe=id_assign.probe_size(table), seed=table.seed)


def on_platform(table: IdTable, state: IdTableState,
                cpu: Callable[..., Out], default: Callable[..., Out],
                *args: Union[IdTableState, jax.Array]) -> Out:
  """`cpu(*args)` on CPU where `usable`, else (and elsewhere) `default`.

  Both paths return the same dtypes (int32 counts, the state's own dtypes,
  under x64 too): `jax.lax.platform_dependent` refuses branches that differ,
  at trace time, and `default` is traced once.
  """
  if not usable(table, state):
    return default(*args)
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)

