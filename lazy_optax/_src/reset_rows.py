"""`reset_rows`: fresh table rows and optimizer-state rows for new owners.

The state leaves that mirror a table are found as `lazy(tx)` finds them
(`row_state.row_owners`); a fresh state row is what `tx.init` gives the
parameters with the table replaced by its `[batch, ...]` block of fresh
rows. Cost: O(batch x row size); nothing reads or writes a whole table.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, NamedTuple, Optional
import weakref
import zlib

import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import branching
from lazy_optax._src import id_hashing
from lazy_optax._src import row_state
from lazy_optax._src import sharding as _sharding
from lazy_optax._src.id_table import FreshRows
from lazy_optax._src.paths import path_name

_OWNER_CACHES: weakref.WeakKeyDictionary[
    optax.TransformInitFn, row_state.OwnerCache] = weakref.WeakKeyDictionary()
# What a reset carries from chunk to chunk: the tables and the state leaves
# they own.
_Carry = tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]


def _owner_cache(init_fn: optax.TransformInitFn) -> row_state.OwnerCache:
  try:
    cache = _OWNER_CACHES.get(init_fn)
    if cache is None:
      cache = _OWNER_CACHES[init_fn] = row_state.OwnerCache(init_fn)
    return cache
  except TypeError:        # not weakly referable: no cache
    return row_state.OwnerCache(init_fn)


def fresh_rows(init: Callable[..., jax.Array], key: jax.typing.ArrayLike,
               ids: jax.Array, row_shape: tuple[int, ...],
               dtype: jax.typing.DTypeLike, name: str) -> jax.Array:
  """The initial rows of ids: `init` with a key from the raw id and table.

  The same (key, table name, raw id) always gives the same row.

  Args:
    init: a `jax.nn.initializers` function `(key, shape, dtype) -> array`.
    key: a `jax.random` key.
    ids: id words `[N, 2]`.
    row_shape: the table's row shape.
    dtype: the table's dtype.
    name: the table's path (salts the keys, so tables differ).

  Returns:
    `[N, *row_shape]` rows.
  """
  words = id_hashing.key_words(key)
  salted = words ^ jnp.asarray([zlib.crc32(name.encode('utf-8')), 0],
                              jnp.uint32)
  keys = id_hashing.id_keys(salted, ids)
  return jax.vmap(lambda k: jnp.asarray(init(k, row_shape, dtype)))(keys)


def _pack(rows: FreshRows, num_rows: int
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The fresh entries first, in order: slots, ids and count.

  The entries past `count` are filler (slot `num_rows`, zero ids): their
  rows are computed with the others' but name no row, so they are dropped.
  One prefix sum (on the CPU a chain of reduce-windows, most of this cost).
  """
  active = rows.slots < num_rows
  needed = jnp.cumsum(active.astype(jnp.int32))
  dest = jnp.where(active, needed - 1, rows.slots.shape[0])
  slots = jnp.full_like(rows.slots, num_rows).at[dest].set(
      rows.slots, mode='drop', unique_indices=True)
  ids = jnp.zeros_like(rows.ids).at[dest].set(rows.ids, mode='drop',
                                               unique_indices=True)
  return slots, ids, needed[-1]


def _chunk_size(n: int) -> int:
  """On the CPU, fresh rows are reset in chunks, skipping (`lax.cond`) the
  chunks past the batch's fresh count: once the hot ids hold their rows, a
  small share of each batch is new. Eight chunks at most (each skip costs a
  few us)."""
  return max(256, -(-n // 8))


def _chunks_skipping(reset_chunk: Callable[[int, int, _Carry], _Carry], n: int,
                     size: int, carry: _Carry, count: jax.Array) -> _Carry:
  """`reset_chunk` chunk by chunk, skipping (`lax.cond`) those past `count`
  (the CPU's version; elsewhere one `reset_chunk(0, n)` gives the same bits:
  the entries past `count` name no row and their writes drop)."""
  for start in range(0, n, size):
    carry = jax.lax.cond(
        count > start, functools.partial(reset_chunk, start, size),
        lambda c: c, carry)
  return carry


@functools.partial(jax.jit, static_argnums=(0, 2))
def _fresh_state_leaves(init_fn: optax.TransformInitFn, params: optax.Params,
                        wanted: tuple[int, ...]) -> list[jax.Array]:
  """`tx.init(params)`'s leaves at `wanted` (jitted: the rest is removed)."""
  leaves = jax.tree.leaves(init_fn(params))
  return [leaves[i] for i in wanted]


def _check_fresh(name: str, rows: object, table: jax.typing.ArrayLike
                 ) -> None:
  where = f'reset_rows: table {name}'
  if not isinstance(rows, FreshRows):
    raise TypeError(
        f'{where}: expected the FreshRows that IdTable.assign returns, got '
        f'{type(rows).__name__}.')
  slots, ids = rows.slots, rows.ids
  if jnp.ndim(table) < 1:
    raise ValueError(f'{where} has shape {jnp.shape(table)}: a table needs '
                     'rows.')
  num_rows = jnp.shape(table)[0]
  if rows.capacity is not None and rows.capacity != num_rows:
    raise ValueError(
        f'{where} has {num_rows} rows, but its FreshRows come from an IdTable '
        f'of capacity {rows.capacity}: slot s names row s and slot '
        f'{rows.capacity} no row, so the table needs exactly capacity rows '
        f'(fresh slots at or above {num_rows} would be skipped, and a filler '
        f'slot below it would reset a real row).')
  if (jnp.ndim(slots) != 1 or not jnp.issubdtype(jnp.result_type(slots),
                                                  jnp.integer)):
    raise ValueError(f'{where}: fresh.slots must be an integer vector, got '
                     f'{jnp.result_type(slots)}{list(jnp.shape(slots))}.')
  if (tuple(jnp.shape(ids)) != (jnp.shape(slots)[0], 2)
      or jnp.result_type(ids) != jnp.uint32):
    raise ValueError(f'{where}: fresh.ids must be uint32 [{len(slots)}, 2] '
                     f'words, got {jnp.result_type(ids)}'
                     f'{list(jnp.shape(ids))}.')


def reset_rows(
    tx: optax.GradientTransformation,
    params: optax.Params,
    opt_state: optax.OptState,
    fresh: Mapping[str, FreshRows],
    *,
    init: Optional[Callable[..., jax.Array]],
    key: Optional[jax.typing.ArrayLike] = None,
) -> tuple[optax.Params, optax.OptState]:
  """Re-initializes the rows of slots that changed owner, and their state.

  For each table named in `fresh` (by its path, as `lazy_optax.tree.path_name`
  writes it: `'emb/table'`), the rows at `fresh[name].slots` become
  `init(key_id, row_shape, dtype)`, where `key_id` is derived from `key`, the
  table's path and the **raw id** (the same id always starts from the same
  row); and every optimizer-state leaf that mirrors the table (any lazy
  state: moments, accumulators, per-row counts, FTRL's `n` and `z`) gets,
  at those rows, what `tx.init` gives a fresh row. Scalar state (`count`,
  schedules) is left alone. Slots equal to the table's row count (filler)
  touch nothing. Jit it with `params` and `opt_state` donated: it costs
  O(batch x row size).

  The per-id keys come from a counter-based hash PRNG (integer mixing), not
  threefry: a `[4096, 64]` block of `normal` rows costs a few tenths of a
  millisecond on a CPU, most of it the normal distribution's transform
  (`uniform` initializers are cheaper still).

  Args:
    tx: the optimizer whose state is `opt_state` (lazy or not).
    params: the parameters (a pytree holding the tables).
    opt_state: `tx`'s state for `params`.
    fresh: `{table path: FreshRows}` from `IdTable.assign`.
    init: a `jax.nn.initializers` function for new rows, or None for zeros.
    key: a `jax.random` key (the same at every step, so that an id starts
      from the same row whenever it is admitted).

  Returns:
    `(params, opt_state)` with the fresh rows reset.

  Raises:
    KeyError: a name in `fresh` is not a parameter path.
    TypeError, ValueError: malformed `fresh`, a table whose row count is not
      the capacity of the `IdTable` that made its `FreshRows` (at trace
      time), or a state leaf that does not mirror the table row by row (as
      for `lazy`).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import lazy_optax
    >>> table_ids = lazy_optax.IdTable(capacity=4, probe=4)
    >>> tx = lazy_optax.lazy_adam(0.1)
    >>> params = {'emb': jnp.ones((4, 2))}
    >>> opt_state = tx.init(params)
    >>> slots, id_state, fresh = table_ids.assign(
    ...     table_ids.init(), np.array([2**40, 5]), step=0)
    >>> params, opt_state = lazy_optax.reset_rows(
    ...     tx, params, opt_state, {'emb': fresh},
    ...     init=jax.nn.initializers.normal(0.01), key=jax.random.key(0))
    >>> bool((params['emb'][slots] != 1).all())
    True
  """
  if not isinstance(fresh, Mapping):
    raise TypeError('reset_rows: fresh must be a mapping {table path: '
                    f'FreshRows}}, got {type(fresh).__name__}.')
  if init is not None and key is None:
    raise ValueError('reset_rows: give a key (jax.random.key(...)) for init, '
                     'or init=None for zero rows.')
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  names = [path_name(p) for p, _ in flat]
  leaves = [x for _, x in flat]
  positions: dict[int, FreshRows] = {}
  for name, rows in fresh.items():
    if name not in names:
      raise KeyError(
          f'reset_rows: no parameter named {name!r}; the parameters are '
          f'{names}.')
    pos = names.index(name)
    _check_fresh(name, rows, leaves[pos])
    positions[pos] = rows
  if not positions:
    return params, opt_state
  fresh = {name: FreshRows(*rows) for name, rows in fresh.items()}
  try:
    hash((tx, init))
  except TypeError:
    return _reset(tx, init, params, opt_state, fresh, key)
  return _reset_jit(tx, init, params, opt_state, fresh, key)


class _Plan(NamedTuple):
  """What each chunk of a reset reads (the tables by their position)."""
  init_fn: optax.TransformInitFn    # tx.init
  init: Optional[Callable[..., jax.Array]]  # the row initializer (None: 0)
  key: Optional[jax.typing.ArrayLike]
  rebuild: Callable[[list[jax.Array]], optax.Params]
  names: list[str]                  # of the parameter leaves
  leaves: list[jax.Array]           # the parameter leaves, before the reset
  packed: dict[int, tuple[jax.Array, jax.Array, jax.Array]]  # by table, _pack's
  wanted: tuple[int, ...]           # the state leaves that a table owns
  owners: list[Optional[int]]       # of every state leaf


def _write_rows(leaf: jax.Array, slots: jax.Array,
                rows: jax.Array) -> jax.Array:
  """`leaf` with `rows` at `slots` (filler slots dropped), sharding kept."""
  return leaf.at[slots].set(rows, mode='drop',
                            **_sharding.scatter_kwargs(leaf))


def _reset_tables(plan: _Plan, start: int, size: int,
                  table_leaves: tuple[jax.Array, ...]
                  ) -> tuple[tuple[jax.Array, ...], list[jax.Array],
                             dict[int, jax.Array]]:
  """Writes fresh entries `[start, start + size)` into every table.

  Returns:
    The tables, the parameter leaves with each table replaced by its chunk
    of fresh rows (what `tx.init` sees), and each table's chunk of slots.
  """
  tables = list(table_leaves)
  stand_in = list(plan.leaves)
  chunk_slots = {}
  for k, pos in enumerate(plan.packed):
    slots, ids, _ = plan.packed[pos]
    slots, ids = slots[start:start + size], ids[start:start + size]
    chunk_slots[pos] = slots
    row_shape = tuple(jnp.shape(plan.leaves[pos])[1:])
    dtype = jnp.result_type(plan.leaves[pos])
    if plan.init is None:
      rows = jnp.zeros((slots.shape[0], *row_shape), dtype)
    else:
      assert plan.key is not None  # reset_rows refuses an init without a key
      rows = fresh_rows(plan.init, plan.key, ids, row_shape, dtype,
                        plan.names[pos]).astype(dtype)
    stand_in[pos] = rows
    tables[k] = _write_rows(tables[k], slots, rows)
  return tuple(tables), stand_in, chunk_slots


def _reset_state(plan: _Plan, stand_in: list[jax.Array],
                 chunk_slots: dict[int, jax.Array],
                 owned_leaves: tuple[jax.Array, ...]
                 ) -> tuple[jax.Array, ...]:
  """Writes what `tx.init` gives the chunk's fresh rows into owned leaves."""
  owned = list(owned_leaves)
  if plan.wanted:
    fresh_state = _fresh_state_leaves(plan.init_fn, plan.rebuild(stand_in),
                                      plan.wanted)
    for k, (i, value) in enumerate(zip(plan.wanted, fresh_state)):
      owner = plan.owners[i]
      assert owner is not None
      slots = chunk_slots[owner]
      leaf = owned[k]
      expected = (slots.shape[0], *jnp.shape(leaf)[1:])
      if tuple(value.shape) != expected:
        raise ValueError(
            f'reset_rows: tx.init gives a state leaf of shape '
            f'{tuple(value.shape)} for {slots.shape[0]} fresh rows, '
            f'expected {expected}.')
      owned[k] = _write_rows(leaf, slots, value.astype(leaf.dtype))
  return tuple(owned)


def _reset_chunk(plan: _Plan, start: int, size: int, carry: _Carry
                 ) -> _Carry:
  """Resets fresh entries `[start, start + size)`: `(tables, owned leaves)`."""
  table_leaves, owned_leaves = carry
  table_leaves, stand_in, chunk_slots = _reset_tables(plan, start, size,
                                                      table_leaves)
  return table_leaves, _reset_state(plan, stand_in, chunk_slots, owned_leaves)


def _reset_all(reset_chunk: Callable[[int, int, _Carry], _Carry], n: int,
               count: jax.Array, carry: _Carry) -> _Carry:
  """`reset_chunk` over all `n` entries: at once where one chunk holds them,
  else in chunks skipping those past `count` on the CPU, at once elsewhere."""
  size = _chunk_size(n)
  if size >= n:
    return reset_chunk(0, n, carry)
  return branching.per_platform(
      functools.partial(_chunks_skipping, reset_chunk, n, size),
      lambda c, _: reset_chunk(0, n, c), carry, count)


def _reset(tx: optax.GradientTransformation,
           init: Optional[Callable[..., jax.Array]], params: optax.Params,
           opt_state: optax.OptState, fresh: Mapping[str, FreshRows],
           key: Optional[jax.typing.ArrayLike]
           ) -> tuple[optax.Params, optax.OptState]:
  """`reset_rows` after its checks."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  rebuild = treedef.unflatten  # type: ignore[attr-defined]
  names = [path_name(p) for p, _ in flat]
  leaves = [x for _, x in flat]
  positions = {names.index(name): rows for name, rows in fresh.items()}
  owners = _owner_cache(tx.init)(
      param_shapes=[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                    for x in leaves],
      rebuild_params=rebuild, row_param_positions=list(positions),
      state=opt_state)
  state_leaves, state_def = jax.tree.flatten(opt_state)
  wanted = tuple(i for i, o in enumerate(owners) if o in positions)
  packed = {pos: _pack(rows, jnp.shape(leaves[pos])[0])
            for pos, rows in positions.items()}
  n = max(rows.slots.shape[0] for rows in positions.values())
  count = functools.reduce(jnp.maximum, [p[2] for p in packed.values()])
  plan = _Plan(tx.init, init, key, rebuild, names, leaves, packed, wanted,
               owners)
  tables, owned = _reset_all(
      functools.partial(_reset_chunk, plan), n, count,
      (tuple(leaves[pos] for pos in positions),
       tuple(state_leaves[i] for i in wanted)))
  new_leaves = list(leaves)
  for pos, value in zip(positions, tables):
    new_leaves[pos] = value
  for i, value in zip(wanted, owned):
    state_leaves[i] = value
  return rebuild(new_leaves), state_def.unflatten(  # type: ignore[attr-defined]
      state_leaves)


# Jitted with `tx` and `init` static: one compiled program per signature when
# called eagerly (instead of one dispatch per operation); inlined under an
# outer jit.
_reset_jit = jax.jit(_reset, static_argnums=(0, 1))
