"""Many tables as one: `EmbeddingCollection`.

Tables of one kind (row width, dtype, optimizer label, learning rate) live
in one stacked `[rows, width]` array, each at its offset, so a train step
reads, differentiates and updates a stack with one gather, one `SparseRows`
gradient, one deduplication and one row update, whatever the number of
tables in it: its compiled step grows with stacks, not tables (FBGEMM's
table-batched embeddings, jax-tpu-embedding's stacked tables).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import optax

from lazy_optax._src import collection_lookup as _lookup
from lazy_optax._src import collection_optim as _optim
from lazy_optax._src import collection_plan as _plan
from lazy_optax._src.collection_plan import FeatureSpec
from lazy_optax._src.collection_plan import Stack
from lazy_optax._src.collection_plan import TableSpec
from lazy_optax._src.id_table import FreshRows

Transform = Union[optax.GradientTransformation,
                  Callable[[float], optax.GradientTransformation]]


def _check_features(features: Sequence[FeatureSpec], names: set[str]) -> None:
  for f in features:
    if not isinstance(f, FeatureSpec):
      raise TypeError(f'EmbeddingCollection: features must be FeatureSpecs, '
                      f'got {f!r}.')
    if f.table not in names:
      raise ValueError(f'FeatureSpec {f.name!r} reads table {f.table!r}, '
                       f'which is not a table of the collection '
                       f'({sorted(names)}).')


def _unique(names: Sequence[str], what: str) -> None:
  seen = set()
  for name in names:
    if name in seen:
      raise ValueError(f'EmbeddingCollection: two {what} are named {name!r}.')
    seen.add(name)


@dataclasses.dataclass(frozen=True, init=False)
class EmbeddingCollection:
  """Embedding tables stacked by kind, looked up and trained as one.

  Declared once from `TableSpec` and `FeatureSpec` specs; the plan (`plan`:
  which tables share which stacked array, at which offsets) is decided at
  construction from the specs alone. Frozen, hashable and compared by value,
  so it can be a static argument or a field of a Flax/Equinox module.

  The stacking rule: tables share a stack when they have the same width,
  dtype and optimizer label, and the same `lr_multiplier` unless their label
  is in `linear_in_lr` (then each table's updates are scaled by its
  multiplier, exact to one rounding for a rule whose update is linear in the
  learning rate: the Adam family, `rowwise_adagrad`, SGD; not `ftrl` or
  `rowwise_rmsprop_ar`). Widths are not padded: other widths, other stacks.
  `TableSpec.stack` forces a stack by name.

  Params are `{stack name: [stack rows, width] array}`; `tables(params)`
  gives each table by name.

  Args:
    tables: the tables, `TableSpec` specs (names unique).
    features: the features, `FeatureSpec` specs (names unique, each naming
      a table). None or empty: one feature of single ids per table, named
      as the table.
    linear_in_lr: optimizer labels whose update is linear in the learning
      rate, declared by the user: their tables stack across multipliers.

  Attributes:
    table_specs: the table specs, a tuple.
    feature_specs: the feature specs, a tuple.
    linear_in_lr: a tuple.
    plan: the stacks (`Stack` objects), decided at construction.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> coll = lazy_optax.EmbeddingCollection(
    ...     [lazy_optax.TableSpec('user', 100, 4),
    ...      lazy_optax.TableSpec('item', 50, 4)],
    ...     [lazy_optax.FeatureSpec('user', 'user'),
    ...      lazy_optax.FeatureSpec('history', 'item', mode='mean')])
    >>> coll.plan
    (Stack('default_float32_4': 150 x 4 float32, optimizer 'default',
           lr x 1; user[0:100], item[100:150]),)
    >>> params = coll.init(jax.random.key(0))
    >>> {name: a.shape for name, a in params.items()}
    {'default_float32_4': (150, 4)}
    >>> out = coll.lookup(params, {'user': jnp.array([3, 7]),
    ...                            'history': jnp.array([[1, 2], [0, 0]])},
    ...                   lengths={'history': jnp.array([2, 1])})
    >>> out['user'].shape, out['history'].shape
    ((2, 4), (2, 4))
    >>> {name: t.shape for name, t in coll.tables(params).items()}
    {'user': (100, 4), 'item': (50, 4)}
  """

  table_specs: tuple[TableSpec, ...]
  feature_specs: tuple[FeatureSpec, ...]
  linear_in_lr: tuple[str, ...]
  plan: tuple[Stack, ...] = dataclasses.field(compare=False, repr=False)

  def __init__(self, tables: Sequence[TableSpec],
               features: Optional[Sequence[FeatureSpec]] = None, *,
               linear_in_lr: Sequence[str] = ()):
    tables = tuple(tables)
    for spec in tables:
      if not isinstance(spec, TableSpec):
        raise TypeError(f'EmbeddingCollection: tables must be TableSpecs, got '
                        f'{spec!r}.')
    features = tuple(features or ()) or tuple(
        FeatureSpec(t.name, t.name) for t in tables)
    _unique([t.name for t in tables], 'tables')
    _unique([f.name for f in features], 'features')
    _check_features(features, {t.name for t in tables})
    _plan.check_keys_distinct(tables)
    if isinstance(linear_in_lr, str):
      linear_in_lr = (linear_in_lr,)
    linear = tuple(linear_in_lr)
    object.__setattr__(self, 'table_specs', tables)
    object.__setattr__(self, 'feature_specs', features)
    object.__setattr__(self, 'linear_in_lr', linear)
    object.__setattr__(self, 'plan', _plan.make_plan(tables, linear))

  # -- the plan ------------------------------------------------------------
  def table(self, name: str) -> TableSpec:
    """The `TableSpec` named `name`."""
    for spec in self.table_specs:
      if spec.name == name:
        return spec
    raise KeyError(f'EmbeddingCollection: no table {name!r} '
                   f'({[t.name for t in self.table_specs]}).')

  def stack_of(self, table: str) -> Stack:
    """The stack holding table `table`."""
    self.table(table)
    return next(s for s in self.plan if table in s.tables)

  def describe(self) -> str:
    """The plan, one line a stack, and the features reading each table."""
    lines = [repr(s) for s in self.plan]
    lines += [f'feature {f.name!r} -> table {f.table!r}'
              + (f' ({f.mode} bags)' if f.mode else '')
              for f in self.feature_specs]
    return '\n'.join(lines)

  # -- params --------------------------------------------------------------
  def init(self, key: jax.Array) -> dict[str, jax.Array]:
    """The stacked params, each table as its initializer gives it alone.

    Table `t` gets `t.initializer(table_key(key, t.name), (t.rows,
    t.width), t.dtype)`: its key is `jax.random.fold_in(key, crc32(name))`
    (see `collection_plan.table_key`), so its rows do not depend on the
    plan, its position or the other tables.

    Args:
      key: a `jax.random` key.

    Returns:
      `{stack name: [stack rows, width] array}`.
    """
    return self.params_from_tables({
        t.name: self._init_table(key, t) for t in self.table_specs})

  def _init_table(self, key: jax.Array, t: TableSpec) -> jax.Array:
    init = t.initializer or _plan.default_initializer
    table = jnp.asarray(init(_plan.table_key(key, t.name), (t.rows, t.width),
                             t.dtype))
    if table.shape != (t.rows, t.width) or table.dtype != t.dtype:
      raise ValueError(
          f'table {t.name!r}: its initializer gave {table.dtype}'
          f'{list(table.shape)}, not {t.dtype}[{t.rows}, {t.width}].')
    return table

  def tables(self, params: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Each table by name, sliced from the stacked params.

    Args:
      params: the collection's params `{stack name: array}` (or a tree
        holding them, see `optimizer`).

    Returns:
      `{table name: [rows, width] array}`, in declared table order.
    """
    out = {}
    for stack in self.plan:
      array = _optim.stack_param(params, stack)
      for name, offset, rows in zip(stack.tables, stack.offsets,
                                    stack.table_rows):
        out[name] = array[offset:offset + rows]
    return {t.name: out[t.name] for t in self.table_specs}

  def params_from_tables(self, tables: Mapping[str, jax.Array]
                         ) -> dict[str, jax.Array]:
    """The stacked params from `{table name: [rows, width] array}`.

    Args:
      tables: every table of the collection, by name.

    Returns:
      `{stack name: array}`, each stack its tables concatenated in plan order.
    """
    return _optim.stack_arrays(self, tables)

  # -- lookups -------------------------------------------------------------
  def lookup(self, params: Mapping[str, jax.Array],
             ids_by_feature: Mapping[str, ArrayLike], *,
             lengths: Optional[Mapping[str, ArrayLike]] = None,
             masks: Optional[Mapping[str, ArrayLike]] = None,
             weights: Optional[Mapping[str, ArrayLike]] = None,
             dtype: Optional[DTypeLike] = None) -> dict[str, jax.Array]:
    """Each feature's rows, with one read (one gradient) per stack.

    Single-id features return `ids.shape + (width,)` as `lazy_optax.lookup`;
    bag features `[batch, width]` as `lazy_optax.lookup_bag` with their
    feature's mode. Ids follow `lookup`'s rule against their own table: ids
    outside `[0, rows)` read zero rows and produce no gradient row (never a
    neighbour's row); concrete ones raise `ValueError` naming the table, the
    feature and the id; under `jax.jit`, `check_ids` inside
    `lazy_optax.checks.checked` reports them.

    Args:
      params: the collection's params `{stack name: array}`, as the loss got
        them (not a copy).
      ids_by_feature: `{feature name: integer ids}`, for some or all
        features.
      lengths: optional `{bag feature: [batch] lengths}`.
      masks: optional `{bag feature: boolean [batch, max_len]}`.
      weights: optional `{bag feature: floating [batch, max_len]}`
        per-sample weights (modes `'sum'` and `'mean'`).
      dtype: optional dtype of the rows.

    Returns:
      `{feature name: array}` for the features given, in declared order.
    """
    extras = {'lengths': lengths, 'masks': masks, 'weights': weights}
    by_stack = self._slots(ids_by_feature, extras)
    out: dict[str, jax.Array] = {}
    for stack, slots in by_stack:
      out.update(_lookup.read_stack(_optim.stack_param(params, stack), stack,
                                    slots, dtype))
    return {f.name: out[f.name] for f in self.feature_specs if f.name in out}

  def check_ids(self, ids_by_feature: Mapping[str, ArrayLike], *,
                lengths: Optional[Mapping[str, ArrayLike]] = None,
                masks: Optional[Mapping[str, ArrayLike]] = None) -> None:
    """Records `checkify` checks that every real id fits its own table.

    The checked mode for `lookup` under `jax.jit`: call it in the step run
    by `lazy_optax.checks.checked`, which raises `CheckError` naming the
    table, the feature and the first bad id. Concrete ids raise
    `ValueError` at once.

    Args:
      ids_by_feature: as for `lookup`.
      lengths: as for `lookup`.
      masks: as for `lookup`.
    """
    extras = {'lengths': lengths, 'masks': masks, 'weights': None}
    for _, slots in self._slots(ids_by_feature, extras):
      for s in slots:
        _lookup.check_slots(s)

  def _slots(
      self, ids_by_feature: Mapping[str, ArrayLike],
      extras: Mapping[str, Optional[Mapping[str, ArrayLike]]],
  ) -> list[tuple[Stack, list[_lookup._Slots]]]:
    """The checked slots of the features given, grouped by stack."""
    known = {f.name: f for f in self.feature_specs}
    for name in ids_by_feature:
      if name not in known:
        raise ValueError(f'{_lookup.CALLER}: no feature {name!r} (features: '
                         f'{list(known)}).')
    for kind, given in extras.items():
      for name in given or ():
        if name not in ids_by_feature:
          raise ValueError(f'{_lookup.CALLER}: {kind} given for feature '
                           f'{name!r}, whose ids are not.')
    out = []
    for stack in self.plan:
      slots = [_lookup.feature_slots(f, ids_by_feature[f.name], stack, extras)
               for f in self.feature_specs
               if f.name in ids_by_feature and f.table in stack.tables]
      if slots:
        out.append((stack, slots))
    return out

  def fresh_rows(self, fresh_by_table: Mapping[str, FreshRows], *,
                 prefix: str = '') -> dict[str, FreshRows]:
    """The `FreshRows` of per-table `IdTable` objects, as rows of stacks.

    With one `lazy_optax.IdTable` per hashed table (its capacity the
    table's rows, its slots fed as the feature's ids), `assign` gives
    `FreshRows` in the table's own rows; this moves each to its stack's
    rows (slot + the table's offset; the filler, `capacity`, to the stack's
    "no row" id) and joins those of one stack, for `lazy_optax.reset_rows`,
    which then resets those rows of the stack and of its state and no row
    of another table. `IdTable.export_changes` needs nothing: its slots
    index `tables(params)[name]`.

    Args:
      fresh_by_table: `{table name: FreshRows}` from each table's
        `IdTable.assign`.
      prefix: the path of the collection's params in the model (`'emb'`
        for `{'emb': params}`), '' for the params themselves.

    Returns:
      `{stack path: FreshRows}` for `reset_rows`.

    Raises:
      ValueError: a `FreshRows` from an `IdTable` whose capacity is not its
        table's row count.

    Example:
      >>> import numpy as np
      >>> import lazy_optax
      >>> coll = lazy_optax.EmbeddingCollection(
      ...     [lazy_optax.TableSpec('a', 4, 2),
      ...      lazy_optax.TableSpec('b', 3, 2)])
      >>> ids_b = lazy_optax.IdTable(capacity=3, probe=3)
      >>> slots, state, fresh = ids_b.assign(ids_b.init(), np.array([99]),
      ...                                    step=0)
      >>> out = coll.fresh_rows({'b': fresh})
      >>> [(name, r.slots.tolist(), r.capacity) for name, r in out.items()]
      [('default_float32_2', [4], 7)]
    """
    return _optim.fresh_rows(self, fresh_by_table, prefix)

  # -- optimizers ----------------------------------------------------------
  def optimizer(self, transforms: Mapping[str, Transform]
                ) -> optax.GradientTransformation:
    """The optimizer of the stacks: an `optax.partition` by stack.

    Each stack gets its label's transformation. A label maps to an optax
    transformation, or to a factory `multiplier -> transformation` (for
    example `lambda m: lazy_optax.ftrl(0.1 * m)`): a stack whose tables
    share multiplier `m` gets `factory(m)`, the transformation the tables
    would have alone, bit for bit. A stack of a label in `linear_in_lr`
    whose tables' multipliers differ gets `factory(1.0)` (or the
    transformation) with each table's row updates scaled by its
    multiplier, which equals training it alone with `lr * multiplier` to
    one rounding a step.

    The transformation applies to the collection's params, or to a tree
    holding them (a leaf belongs to the stack its last path key names), for
    example inside `optax.partition` with the rest of a model.

    Args:
      transforms: `{optimizer label: transformation or factory}`.

    Returns:
      An `optax.GradientTransformation`.
    """
    return _optim.collection_optimizer(self, transforms, by='stack')

  def table_optimizer(self, transforms: Mapping[str, Transform]
                      ) -> optax.GradientTransformation:
    """The same optimizers over separate tables `{table name: array}`.

    What `optimizer` computes stack by stack, here table by table (each
    table gets its label's `factory(multiplier)`); its state converts to and
    from the stacked one with `state_from_tables` and `state_tables`.

    Args:
      transforms: as for `optimizer`.

    Returns:
      An `optax.GradientTransformation` over `tables(params)`.
    """
    return _optim.collection_optimizer(self, transforms, by='table')

  def state_tables(self, state: optax.OptState,
                   transforms: Mapping[str, Transform]) -> optax.OptState:
    """The state of `table_optimizer(transforms)` from `optimizer`'s state.

    Each table's state rows are sliced from its stack's; the state shared by
    a stack's tables (counts, schedules) is given to each of them.

    Args:
      state: the state of `optimizer(transforms)`.
      transforms: the transformations given to `optimizer`.

    Returns:
      The state of `table_optimizer(transforms)` over `tables(params)`.
    """
    return _optim.state_to_tables(self, state, transforms)

  def state_from_tables(self, state: optax.OptState,
                        transforms: Mapping[str, Transform]
                        ) -> optax.OptState:
    """The state of `optimizer(transforms)` from `table_optimizer`'s state.

    Each stack's state rows are its tables' concatenated; the state its
    tables share (counts, schedules) must be equal in all of them.

    Args:
      state: the state of `table_optimizer(transforms)`.
      transforms: the transformations given to `optimizer`.

    Returns:
      The state of `optimizer(transforms)` over the stacked params.

    Raises:
      ValueError: a stack's tables disagree on a shared state leaf.
    """
    return _optim.state_from_tables(self, state, transforms)

  def __str__(self) -> str:
    return f'EmbeddingCollection:\n{self.describe()}'



def check_collection(collection: object, where: str) -> EmbeddingCollection:
  """`collection`, refused unless an `EmbeddingCollection` (the layers')."""
  if not isinstance(collection, EmbeddingCollection):
    raise TypeError(f'{where}: collection must be a '
                    'lazy_optax.EmbeddingCollection, got '
                    f'{type(collection).__name__}.')
  return collection
