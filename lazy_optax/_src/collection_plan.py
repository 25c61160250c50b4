"""Tables, features and the stacking plan of an `EmbeddingCollection`.

A `TableSpec` names a table (rows, width, dtype, initializer, optimizer
label, learning-rate multiplier), a `FeatureSpec` a batch input that reads
one table (single ids or bags). `make_plan` decides once, from the specs
alone, which tables share a stacked array (a `Stack`) and where each
table's rows start in it, by the stacking rule of `EmbeddingCollection`'s
docstring (a stack forced by `TableSpec.stack` whose tables disagree on it
is refused, naming them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence
import zlib

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
import numpy as np

from lazy_optax._src.id_code import index_dtype

Initializer = Callable[[jax.Array, tuple[int, ...], DTypeLike], jax.Array]

_MODES = (None, 'sum', 'mean', 'max')

# Flax's `nn.Embed` default (and lazy_optax.flax's).
default_initializer = jax.nn.initializers.variance_scaling(
    1.0, 'fan_in', 'normal', out_axis=0)


def _name(value: object, what: str) -> str:
  if not isinstance(value, str) or not value:
    raise TypeError(f'{what}: name must be a non-empty str, got {value!r}.')
  return value


def _count(value: object, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
      value < 1):
    raise ValueError(f'{what} must be a positive int, got {value!r}.')
  return int(value)


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One embedding table of an `EmbeddingCollection`.

  Attributes:
    name: the table's name (unique in the collection).
    rows: its row count.
    width: its row width (floats a row).
    dtype: its dtype (default float32).
    initializer: `initializer(key, (rows, width), dtype) -> array`, as
      `jax.nn.initializers` give (default: Flax's `nn.Embed` one). Compared
      by identity, as functions are.
    optimizer: the label of its optimizer (a key of the mapping given to
      `EmbeddingCollection.optimizer`).
    lr_multiplier: its learning rate is the optimizer's times this.
    stack: optional name of the stack it must join; by default the stack is
      chosen by the stacking rule (see `EmbeddingCollection`).

  Example:
    >>> import lazy_optax
    >>> lazy_optax.TableSpec('user', rows=1000, width=16)
    TableSpec(name='user', rows=1000, width=16, dtype=float32, ...)
  """

  name: str
  rows: int
  width: int
  dtype: DTypeLike = 'float32'
  initializer: Optional[Initializer] = None
  optimizer: str = 'default'
  lr_multiplier: float = 1.0
  stack: Optional[str] = None

  def __post_init__(self):
    where = f'TableSpec {self.name!r}'
    _name(self.name, 'TableSpec')
    object.__setattr__(self, 'rows', _count(self.rows, f'{where}: rows'))
    object.__setattr__(self, 'width', _count(self.width, f'{where}: width'))
    dtype = np.dtype(jnp.dtype(self.dtype))
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f'{where}: dtype must be floating, got {dtype}.')
    object.__setattr__(self, 'dtype', dtype)
    _name(self.optimizer, f'{where}: optimizer label')
    multiplier = float(self.lr_multiplier)
    if not np.isfinite(multiplier) or multiplier <= 0:
      raise ValueError(f'{where}: lr_multiplier must be a positive finite '
                       f'number, got {self.lr_multiplier!r}.')
    object.__setattr__(self, 'lr_multiplier', multiplier)
    if self.stack is not None:
      _name(self.stack, f'{where}: stack')

  def __repr__(self) -> str:
    extra = ''.join(
        f', {k}={getattr(self, k)!r}' for k in ('initializer', 'stack')
        if getattr(self, k) is not None)
    return (f'TableSpec(name={self.name!r}, rows={self.rows}, width='
            f'{self.width}, dtype={self.dtype}, optimizer={self.optimizer!r}, '
            f'lr_multiplier={self.lr_multiplier}{extra})')


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One input of an `EmbeddingCollection`: ids that read one table.

  Attributes:
    name: the feature's name (unique in the collection; the key of its ids
      and of its rows in `EmbeddingCollection.lookup`).
    table: the name of the table it reads (features may share a table).
    mode: `None` for single ids (any shape, one row each, as
      `lazy_optax.lookup`), or `'sum'`, `'mean'`, `'max'` for bags of ids
      `[batch, max_len]` pooled to `[batch, width]` as `lazy_optax.lookup_bag`
      does (with lengths, a mask or per-sample weights given at lookup).
    padding_id: optional id whose slots read the padding row as it is (zeros
      when outside the table) and never produce a gradient row; for bags,
      its slots are left out of the bag.

  Example:
    >>> import lazy_optax
    >>> lazy_optax.FeatureSpec('history', table='item', mode='mean')
    FeatureSpec(name='history', table='item', mode='mean', padding_id=None)
  """

  name: str
  table: str
  mode: Optional[str] = None
  padding_id: Optional[int] = None

  def __post_init__(self):
    _name(self.name, 'FeatureSpec')
    _name(self.table, f'FeatureSpec {self.name!r}: table')
    if self.mode not in _MODES:
      raise ValueError(f'FeatureSpec {self.name!r}: mode must be one of '
                       f'{_MODES}, got {self.mode!r}.')
    if self.padding_id is not None:
      if isinstance(self.padding_id, bool) or not isinstance(
          self.padding_id, (int, np.integer)):
        raise TypeError(f'FeatureSpec {self.name!r}: padding_id must be an '
                        f'int or None, got {self.padding_id!r}.')
      object.__setattr__(self, 'padding_id', int(self.padding_id))


@dataclasses.dataclass(frozen=True)
class Stack:
  """One stacked array of the plan: tables of one kind, one after another.

  Attributes:
    name: the stack's name, its key in the params.
    width: the row width of its tables.
    dtype: their dtype.
    optimizer: their optimizer label.
    lr_multiplier: their common learning-rate multiplier, or None when they
      differ (a label declared linear in the learning rate: each table's
      updates are scaled by its multiplier).
    tables: the table names, in the order of their rows.
    offsets: the first stack row of each table.
    table_rows: the row count of each table.
  """

  name: str
  width: int
  dtype: DTypeLike
  optimizer: str
  lr_multiplier: Optional[float]
  tables: tuple[str, ...]
  offsets: tuple[int, ...]
  table_rows: tuple[int, ...]

  @property
  def rows(self) -> int:
    """The stack's row count: its tables' rows; also its "no row" id."""
    return self.offsets[-1] + self.table_rows[-1]

  def span(self, table: str) -> tuple[int, int]:
    """`(first row, row count)` of `table` in the stack."""
    i = self.tables.index(table)
    return self.offsets[i], self.table_rows[i]

  def __repr__(self) -> str:
    lr = ('per table' if self.lr_multiplier is None
          else f'{self.lr_multiplier:g}')
    spans = ', '.join(f'{t}[{o}:{o + r}]' for t, o, r in
                      zip(self.tables, self.offsets, self.table_rows))
    return (f'Stack({self.name!r}: {self.rows} x {self.width} {self.dtype}, '
            f'optimizer {self.optimizer!r}, lr x {lr}; {spans})')


def _check_forced(name: str, specs: Sequence[TableSpec], linear: bool) -> None:
  """A forced stack's tables must agree on what the stacking rule needs."""
  first = specs[0]
  for spec in specs[1:]:
    for field in ('width', 'dtype', 'optimizer') + (
        () if linear else ('lr_multiplier',)):
      if getattr(spec, field) != getattr(first, field):
        raise ValueError(
            f'stack {name!r}: tables {first.name!r} and {spec.name!r} cannot '
            f'share it: they differ in {field} ({getattr(first, field)!r} vs '
            f'{getattr(spec, field)!r}). Tables of a stack need the same '
            'width, dtype and optimizer label'
            + ('.' if linear else ', and the same lr_multiplier unless their '
               'label is in linear_in_lr.'))


def _stack(name: str, specs: Sequence[TableSpec]) -> Stack:
  rows = tuple(s.rows for s in specs)
  offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(rows)[:-1]]))
  multipliers = {s.lr_multiplier for s in specs}
  stack = Stack(name, specs[0].width, specs[0].dtype, specs[0].optimizer,
                multipliers.pop() if len(multipliers) == 1 else None,
                tuple(s.name for s in specs), offsets, rows)
  index_dtype(stack.rows + 1)  # refuses a stack int32 ids cannot address
  return stack


def make_plan(tables: Sequence[TableSpec],
              linear_in_lr: Sequence[str]) -> tuple[Stack, ...]:
  """The stacks of `tables`, in the order of their first table.

  Args:
    tables: the table specs, names unique.
    linear_in_lr: the optimizer labels whose updates are linear in the
      learning rate (tables of other multipliers may share their stacks).

  Returns:
    The stacks; each table is in exactly one.
  """
  groups: dict[str, list[TableSpec]] = {}
  for spec in tables:
    lr = ('' if spec.optimizer in linear_in_lr or spec.lr_multiplier == 1.0
          else f'_lr{spec.lr_multiplier:g}')
    name = spec.stack or f'{spec.optimizer}_{spec.dtype}_{spec.width}{lr}'
    groups.setdefault(name, []).append(spec)
  plan = []
  for name, specs in groups.items():
    _check_forced(name, specs, specs[0].optimizer in linear_in_lr)
    plan.append(_stack(name, specs))
  return tuple(plan)


def table_key(key: jax.Array, name: str) -> jax.Array:
  """The key a table's initializer gets: `key` folded with its name's CRC-32.

  Derived from the name alone, so a table starts the same whatever its
  stack, position or neighbours.

  Args:
    key: the key given to `EmbeddingCollection.init`.
    name: the table's name.

  Returns:
    `jax.random.fold_in(key, zlib.crc32(name) & 0x7FFFFFFF)`.
  """
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def check_keys_distinct(tables: Sequence[TableSpec]) -> None:
  """Two names of one CRC-32 would start their tables alike: refused."""
  seen: dict[int, str] = {}
  for spec in tables:
    crc = zlib.crc32(spec.name.encode()) & 0x7FFFFFFF
    if crc in seen:
      raise ValueError(f'tables {seen[crc]!r} and {spec.name!r} would get the '
                       'same initializer key (their names hash alike); '
                       'rename one.')
    seen[crc] = spec.name
