"""An `EmbeddingCollection`'s params, optimizers and their per-table views.

`collection_optimizer` builds an `optax.partition` with one transformation
a stack (or, for the separate-table equivalent, one a table) from the
optimizer labels' transformations. A stack whose tables' learning-rate
multipliers differ (a label declared linear in the learning rate) scales
each table's row updates by its multiplier (`scale_rows_by_table`).

The state conversions go leaf by leaf: a stack's state leaf that holds one
entry per stack row is its tables' leaves concatenated; any other leaf
(a count, a schedule's state) is shared by the stack's tables.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence, TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np
import optax

from lazy_optax._src.collection_plan import Stack
from lazy_optax._src.id_table import FreshRows
from lazy_optax._src.labels import path_labels
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows

if TYPE_CHECKING:
  from typing_extensions import TypeIs

  from lazy_optax._src.collection import EmbeddingCollection
  from lazy_optax._src.collection import Transform


def stack_param(params: optax.Params, stack: Stack) -> jax.Array:
  """`params[stack.name]`, or a `ValueError` naming the missing stack."""
  if not isinstance(params, Mapping) or stack.name not in params:
    keys = list(params) if isinstance(params, Mapping) else type(params)
    raise ValueError(f'EmbeddingCollection: params have no stack '
                     f'{stack.name!r} (got {keys}); they are what init gives, '
                     '{stack name: array}.')
  return params[stack.name]


def stack_arrays(collection: EmbeddingCollection,
                 tables: Mapping[str, ArrayLike]) -> dict[str, jax.Array]:
  """`{stack name: array}` from `{table name: array}` (each checked)."""
  specs = {t.name: t for t in collection.table_specs}
  unknown = sorted(set(tables) - set(specs))
  missing = [n for n in specs if n not in tables]
  if unknown or missing:
    raise ValueError(f'EmbeddingCollection: tables {unknown} are not in the '
                     f'collection, and {missing} are missing.')
  for name, array in tables.items():
    t = specs[name]
    if (tuple(jnp.shape(array)) != (t.rows, t.width)
        or jnp.result_type(array) != t.dtype):
      raise ValueError(
          f'table {name!r}: got {jnp.result_type(array)}'
          f'{list(jnp.shape(array))}, its spec is {t.dtype}[{t.rows}, '
          f'{t.width}].')
  return {s.name: (jnp.asarray(tables[s.tables[0]]) if len(s.tables) == 1
                   else jnp.concatenate([tables[n] for n in s.tables]))
          for s in collection.plan}


# -- scaling a stack's rows by their table's multiplier -----------------------

def _scaled_leaf(stack: Stack, multipliers: tuple[float, ...],
                 u: jax.Array | SparseRows) -> jax.Array | SparseRows:
  if isinstance(u, SparseRows):
    ids = u.safe_ids(f'updates of stack {stack.name}', report=False)
    # Each id's table's multiplier (ids outside: the last table's).
    starts = jnp.asarray(np.asarray(stack.offsets[1:], np.int64), ids.dtype)
    table = jnp.sum(ids[:, None] >= starts[None, :], axis=1)
    factor = jnp.asarray(multipliers, jnp.float32)[table]
    factor = factor.reshape((-1,) + (1,) * (u.values.ndim - 1))
    values = (u.values.astype(jnp.float32) * factor).astype(u.values.dtype)
    return SparseRows.from_unique(ids, values, u.num_rows, distinct=True)
  per_row = np.repeat(np.asarray(multipliers, np.float32), stack.table_rows)
  per_row = per_row.reshape((-1,) + (1,) * (jnp.ndim(u) - 1))
  return (jnp.asarray(u, jnp.float32) * per_row).astype(jnp.result_type(u))


def scale_rows_by_table(stack: Stack, multipliers: tuple[float, ...]
                        ) -> optax.GradientTransformation:
  """Multiplies each row's update by its table's learning-rate multiplier.

  Placed after a rule whose update is linear in the learning rate, the rows
  of table `t` move as under that rule with `lr * multipliers[t]`, to one
  float32 rounding (the product is rounded once more).

  Args:
    stack: the stack whose rows the updates are.
    multipliers: one per table of the stack.

  Returns:
    A stateless `optax.GradientTransformation`.
  """
  def update_fn(updates, state, params=None):
    del params
    return jax.tree.map(lambda u: _scaled_leaf(stack, multipliers, u),
                        updates, is_leaf=is_sparse_rows), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update_fn)


# -- the optimizers -----------------------------------------------------------

def _is_factory(
    entry: Transform,
) -> TypeIs[Callable[[float], optax.GradientTransformation]]:
  return callable(entry) and not isinstance(entry,
                                            optax.GradientTransformation)


def _transform(entry: Transform, label: str, where: str,
               multipliers: tuple[float, ...], stack: Stack,
               linear: bool) -> optax.GradientTransformation:
  """The transformation of a stack (or a table) of `multipliers`."""
  if len(set(multipliers)) == 1:
    m = multipliers[0]
    if _is_factory(entry):
      return entry(m)
    if m == 1.0:
      return entry
    if not linear:
      raise ValueError(
          f'{where}: lr_multiplier {m:g} with optimizer label {label!r}, which '
          'is a transformation: give a factory `multiplier -> transformation` '
          f'for {label!r} (or declare it in linear_in_lr if its update is '
          'linear in the learning rate).')
  base = entry(1.0) if _is_factory(entry) else entry
  return optax.chain(base, scale_rows_by_table(stack, multipliers))


def collection_optimizer(collection: EmbeddingCollection,
                         transforms: Mapping[str, Transform],
                         by: str) -> optax.GradientTransformation:
  """`optax.partition` of the stacks (`by='stack'`) or tables (`'table'`)."""
  labels = {t.optimizer for t in collection.table_specs}
  missing = sorted(labels - set(transforms))
  if missing:
    raise ValueError(f'EmbeddingCollection.optimizer: no transformation for '
                     f'optimizer labels {missing}.')
  txs: dict[str, optax.GradientTransformation] = {}
  for stack in collection.plan:
    linear = stack.optimizer in collection.linear_in_lr
    entry = transforms[stack.optimizer]
    mults = tuple(collection.table(t).lr_multiplier for t in stack.tables)
    if by == 'stack':
      txs[stack.name] = _transform(entry, stack.optimizer,
                                   f'stack {stack.name!r}', mults, stack,
                                   linear)
    else:
      for t, m in zip(stack.tables, mults):
        one = Stack(t, stack.width, stack.dtype, stack.optimizer, m, (t,),
                    (0,), (collection.table(t).rows,))
        txs[t] = _transform(entry, stack.optimizer, f'table {t!r}', (m,), one,
                            linear)

  def label_of(name: str) -> str:
    key = name.rsplit('/', 1)[-1]
    if key not in txs:
      raise ValueError(f'EmbeddingCollection.optimizer: parameter {name} is '
                       f'not a {by} of the collection ({sorted(txs)}).')
    return key

  return optax.partition(txs, path_labels(label_of))


# -- the state, per table -----------------------------------------------------

class _Shapes(NamedTuple):
  stack: jax.Array | jax.ShapeDtypeStruct   # the stack's leaf
  table: jax.Array | jax.ShapeDtypeStruct   # the table's
  rows: tuple[int, int]  # (stack rows, table rows)


def _is_row_leaf(s: _Shapes, where: str) -> bool:
  """Whether a state leaf holds one entry per row (else it is shared)."""
  stack_rows, table_rows = s.rows
  a, b = tuple(jnp.shape(s.stack)), tuple(jnp.shape(s.table))
  if a == b:
    return stack_rows == table_rows and bool(a) and a[0] == stack_rows
  if a and b and a[0] == stack_rows and b == (table_rows,) + a[1:]:
    return True
  raise ValueError(f'{where}: a state leaf of shape {a} for the stack and '
                   f'{b} for the table is neither one entry per row nor '
                   'shared; the state does not come from these optimizers.')


def _inner(state: optax.OptState, key: str, where: str) -> list[jax.Array]:
  inner = getattr(state, 'inner_states', None)
  if not isinstance(inner, Mapping) or key not in inner:
    raise ValueError(f'{where}: the state has no part {key!r}; give the state '
                     'of this collection\'s optimizer (or table_optimizer) '
                     'built from the same transformations.')
  return jax.tree.leaves(inner[key])


def _template(collection: EmbeddingCollection,
              transforms: Mapping[str, Transform],
              by: str) -> optax.PartitionState:
  tx = collection_optimizer(collection, transforms, by)
  specs = collection.table_specs
  shapes = ({s.name: jax.ShapeDtypeStruct((s.rows, s.width), s.dtype)
             for s in collection.plan} if by == 'stack' else
            {t.name: jax.ShapeDtypeStruct((t.rows, t.width), t.dtype)
             for t in specs})
  return jax.eval_shape(tx.init, shapes)


def state_to_tables(collection: EmbeddingCollection, state: optax.OptState,
                    transforms: Mapping[str, Transform]) -> optax.OptState:
  """`table_optimizer`'s state from `optimizer`'s (see the class)."""
  template = _template(collection, transforms, 'table')
  out = {}
  for stack in collection.plan:
    leaves = _inner(state, stack.name, f'stack {stack.name!r}')
    for t, offset, rows in zip(stack.tables, stack.offsets,
                               stack.table_rows):
      want, treedef = jax.tree.flatten(template.inner_states[t])
      where = f'state of table {t!r} (stack {stack.name!r})'
      _same_count(leaves, want, where)
      out[t] = jax.tree.unflatten(treedef, [
          leaf[offset:offset + rows]
          if _is_row_leaf(_Shapes(leaf, w, (stack.rows, rows)), where)
          else leaf for leaf, w in zip(leaves, want)])
  return template._replace(inner_states=out)


def _same_count(have: Sequence[object], want: Sequence[object],
                where: str) -> None:
  if len(have) != len(want):
    raise ValueError(f'{where}: {len(have)} state leaves where the optimizer '
                     f'has {len(want)}; the state comes from other '
                     'transformations.')


def _shared(values: Sequence[jax.Array], names: tuple[str, ...],
            where: str) -> jax.Array:
  first = values[0]
  for name, v in zip(names[1:], values[1:]):
    if not np.array_equal(np.asarray(v), np.asarray(first)):
      raise ValueError(
          f'{where}: tables {names[0]!r} and {name!r} hold different values '
          f'of a state leaf their stack shares ({np.asarray(first)} vs '
          f'{np.asarray(v)}), such as a step count: they were not trained '
          'together, and one stack cannot continue both.')
  return first


def state_from_tables(collection: EmbeddingCollection, state: optax.OptState,
                      transforms: Mapping[str, Transform]) -> optax.OptState:
  """`optimizer`'s state from `table_optimizer`'s (see the class)."""
  template = _template(collection, transforms, 'stack')
  out = {}
  for stack in collection.plan:
    where = f'state of stack {stack.name!r}'
    want, treedef = jax.tree.flatten(template.inner_states[stack.name])
    per_table = [_inner(state, t, f'table {t!r}') for t in stack.tables]
    for leaves in per_table:
      _same_count(leaves, want, where)
    new = []
    for i, w in enumerate(want):
      parts = [leaves[i] for leaves in per_table]
      rows = all(_is_row_leaf(_Shapes(w, p, (stack.rows, r)), where)
                 for p, r in zip(parts, stack.table_rows))
      new.append(jnp.concatenate(parts) if rows and len(parts) > 1
                 else parts[0] if rows else _shared(parts, stack.tables,
                                                    where))
    out[stack.name] = jax.tree.unflatten(treedef, new)
  return template._replace(inner_states=out)


def fresh_rows(coll: EmbeddingCollection,
               fresh_by_table: Mapping[str, FreshRows],
               prefix: str) -> dict[str, FreshRows]:
  """`EmbeddingCollection.fresh_rows`: table slots moved to stack rows."""
  by_stack: dict[str, list[tuple[jax.Array, jax.Array]]] = {}
  for name, fresh in fresh_by_table.items():
    stack = coll.stack_of(name)
    offset, rows = stack.span(name)
    if fresh.capacity is not None and fresh.capacity != rows:
      raise ValueError(
          f'EmbeddingCollection.fresh_rows: table {name!r} has {rows} rows, '
          f'but its FreshRows come from an IdTable of capacity '
          f'{fresh.capacity}.')
    slots = jnp.asarray(fresh.slots)
    moved = jnp.where((slots >= 0) & (slots < rows), slots + offset,
                      stack.rows).astype(slots.dtype)
    by_stack.setdefault(stack.name, []).append((moved, fresh.ids))
  out = {}
  for stack in coll.plan:
    if stack.name in by_stack:
      parts = by_stack[stack.name]
      path = f'{prefix}/{stack.name}' if prefix else stack.name
      out[path] = FreshRows(jnp.concatenate([s for s, _ in parts]),
                            jnp.concatenate([i for _, i in parts]),
                            stack.rows)
  return out
