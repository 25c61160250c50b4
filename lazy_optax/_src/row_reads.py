"""Reading table rows, and the recorder a lookup reports to.

The layer below both `lookups` (which reads rows for the loss) and `grads`
(whose `value_and_grad` records what the lookups read): `read_rows` is the one
gather of rows under the rule for ids, and `Recorder` is what a lookup hands
its table and ids to while a `value_and_grad` traces the loss. `lookups`
asks `active_recorder()` for it; `grads` installs one with `recording(...)`.
Neither of the two imports the other.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import threading
from typing import Any, Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from lazy_optax._src import sharding as _sharding
from lazy_optax._src.id_code import index_dtype

_LOCAL = threading.local()


def in_range(ids: jax.Array, num_rows: int) -> jax.Array:
  """Which ids name a row of a table of `num_rows` rows."""
  return (ids >= 0) & (ids < num_rows)


def _rows_like_ids(table: ArrayLike, ids: ArrayLike) -> dict[str, Any]:
  """Under Explicit mesh axes, rows split like their ids (the batch)."""
  mesh = _sharding.explicit_mesh(table) or _sharding.explicit_mesh(ids)
  if mesh is None:
    return {}
  spec = tuple(jax.typeof(ids).sharding.spec)
  spec += (None,) * (jnp.ndim(ids) - len(spec) + jnp.ndim(table) - 1)
  return {'out_sharding': jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*spec))}


@functools.partial(jax.jit, static_argnames='dtype', inline=True)
def read_rows(table: ArrayLike, ids: jax.Array,
              dtype: Optional[DTypeLike] = None) -> jax.Array:
  """`table[ids]`, with zero rows for ids outside `[0, num_rows)`.

  Out-of-range ids (negative ones too: JAX would wrap them before any gather
  mode applies) are mapped to `num_rows` and read with `mode='fill'`.
  One compiled program outside a trace (per shape and dtype); inlined in one.

  Args:
    table: `[num_rows, *row_shape]`.
    ids: integer ids of any shape.
    dtype: optional dtype of the rows.

  Returns:
    `ids.shape + row_shape` rows.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax._src.row_reads import read_rows
    >>> read_rows(jnp.arange(4.).reshape(2, 2), jnp.array([1, -1, 2]))
    Array([[2., 3.],
           [0., 0.],
           [0., 0.]], dtype=float32)
  """
  num_rows = jnp.shape(table)[0]
  ids = ids.astype(index_dtype(num_rows))
  safe = jnp.where(in_range(ids, num_rows), ids, num_rows)
  table = jnp.asarray(table)
  rows = table.at[safe].get(mode='fill', fill_value=0,
                            **_rows_like_ids(table, safe))
  return rows if dtype is None else rows.astype(dtype)


class Recorder(abc.ABC):
  """The tables of one `value_and_grad` call, as the loss was handed them."""

  def __init__(self, tables: Mapping[int, object], names: Sequence[str]):
    self.tables = tables      # position -> the parameter leaf
    self.names = names        # position -> its path name ('emb/table')

  def position_of(self, table: object) -> Optional[int]:
    for pos, leaf in self.tables.items():
      if leaf is table:
        return pos
    return None

  def name_of(self, table: object) -> Optional[str]:
    pos = self.position_of(table)
    return None if pos is None else self.names[pos]

  @abc.abstractmethod
  def take(self, table: ArrayLike, ids: jax.Array, active: Optional[jax.Array],
           dtype: Optional[DTypeLike]) -> Optional[jax.Array]:
    """The rows of a lookup, or None to let it read `table` plainly."""


def active_recorder() -> Optional[Recorder]:
  """The recorder of the innermost `value_and_grad` being traced, if any."""
  stack = getattr(_LOCAL, 'stack', None)
  return stack[-1] if stack else None


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
  """Makes `recorder` the active one while the loss is traced."""
  stack = getattr(_LOCAL, 'stack', None)
  if stack is None:
    stack = _LOCAL.stack = []
  stack.append(recorder)
  try:
    yield recorder
  finally:
    stack.pop()
