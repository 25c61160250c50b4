"""One read per stack: an `EmbeddingCollection`'s lookup.

Each feature's ids are checked against its own table (`lookups`' rule, the
`ValueError` naming the table and the id where they are concrete), moved
into stack rows by the table's offset, and every feature of a stack is read
in one `lookups` gather of the stack. Under `lazy_optax.value_and_grad` the
stack then gets one `SparseRows` gradient, whatever its number of tables.

An id outside its own table's rows never lands on a neighbour: it becomes id
-1 of the stack (a zero row, no gradient row), so the checked mode's
`with_id_checks` still sees an out-of-range id, and
`EmbeddingCollection.check_ids` names its table. Padding and masked slots
stay inactive, as in `lookup` and `lookup_bag`.

Consecutive features of one ids shape that read distinct tables form a
run, read example by example (`[*shape, features]`, each example's rows
side by side, as one table with ids offset by hand would give them); runs
follow one another in the features' order. So each table's ids keep the
order that separate tables looked up feature by feature would see, and the
gradient sums a row's repeated ids in that order.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import jax
from jax.experimental import checkify
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np

from lazy_optax._src import lookups
from lazy_optax._src import validate
from lazy_optax._src.collection_plan import FeatureSpec
from lazy_optax._src.collection_plan import Stack
from lazy_optax._src.id_code import index_dtype
from lazy_optax._src.row_reads import in_range

CALLER = 'EmbeddingCollection.lookup'


@dataclasses.dataclass
class _Slots:
  """One feature's checked ids and which of its slots are real."""
  spec: FeatureSpec
  ids: jax.Array
  active: Optional[jax.Array]
  weights: Optional[jax.Array]
  offset: int
  rows: int


def where_of(feature: FeatureSpec) -> str:
  return f'{CALLER} of table {feature.table} (feature {feature.name})'


def _extras(spec: FeatureSpec,
            extras: Mapping[str, Optional[Mapping[str, ArrayLike]]],
            where: str) -> dict[str, ArrayLike]:
  """The feature's `lengths`, `masks` and `weights` (single ids take none)."""
  given = {k: v[spec.name] for k, v in extras.items()
           if v is not None and spec.name in v}
  if given and spec.mode is None:
    raise ValueError(f'{where}: {sorted(given)} given for a feature of single '
                     "ids; they belong to bags (FeatureSpec(mode='sum', "
                     "'mean' or 'max')).")
  return given


def feature_slots(
    spec: FeatureSpec, raw: ArrayLike, stack: Stack,
    extras: Mapping[str, Optional[Mapping[str, ArrayLike]]]) -> _Slots:
  """Checks one feature's ids and finds its real slots."""
  where = where_of(spec)
  offset, rows = stack.span(spec.table)
  ids = lookups.check_ids(raw, where, rows)
  given = _extras(spec, extras, where)
  weights = None
  if spec.mode is None:
    active = lookups.not_padding(ids, spec.padding_id, where)
  else:
    active, weights = lookups.bag_slots(
        ids, spec.mode, given.get('masks'), given.get('lengths'),
        given.get('weights'), spec.padding_id, where)
  lookups.check_in_range(ids, active, rows, where)
  return _Slots(spec, ids, active, weights, offset, rows)


def _runs(slots: Sequence[_Slots]) -> list[list[_Slots]]:
  """Consecutive features of one ids shape and of distinct tables."""
  runs: list[list[_Slots]] = []
  for s in slots:
    if runs and runs[-1][0].ids.shape == s.ids.shape and all(
        r.spec.table != s.spec.table for r in runs[-1]):
      runs[-1].append(s)
    else:
      runs.append([s])
  return runs


def _stack_ids(run: Sequence[_Slots], id_dtype: DTypeLike) -> jax.Array:
  """The run's ids as stack rows `[*shape, k]`; ids outside their table -1."""
  ids = jnp.stack([s.ids.astype(id_dtype) for s in run], axis=-1)
  shape = (len(run),)
  rows = np.asarray([s.rows for s in run], id_dtype).reshape(shape)
  offsets = np.asarray([s.offset for s in run], id_dtype).reshape(shape)
  return jnp.where((ids >= 0) & (ids < rows), ids + offsets, -1)


def _stack_active(runs: Sequence[Sequence[_Slots]]) -> Optional[jax.Array]:
  """Which of the stack's ids (`_stack_ids`' order) are real (None: all)."""
  if all(s.active is None for run in runs for s in run):
    return None
  return jnp.concatenate([
      jnp.stack([jnp.ones(s.ids.shape, bool) if s.active is None
                 else s.active for s in run], axis=-1).reshape(-1)
      for run in runs])


def read_stack(table: ArrayLike, stack: Stack, slots: Sequence[_Slots],
               dtype: Optional[DTypeLike]) -> dict[str, jax.Array]:
  """Every feature of one stack, in one gather of `table` (the stack)."""
  runs = _runs(slots)
  id_dtype = index_dtype(stack.rows + 1)
  ids = jnp.concatenate([_stack_ids(run, id_dtype).reshape(-1)
                         for run in runs])
  rows = lookups._gather(table, ids, _stack_active(runs), dtype,  # pylint: disable=protected-access
                         CALLER, stack.name)
  out = {}
  parts = jax.lax.split(rows, [len(run) * run[0].ids.size for run in runs])
  for run, part in zip(runs, parts):
    # Example-major (module doc): feature j is columns [j * width,
    # (j + 1) * width), split with `lax.split` (its gradient: one concat).
    width = rows.shape[-1]
    part = part.reshape(run[0].ids.shape + (len(run) * width,))
    columns = jax.lax.split(part, [width] * len(run), axis=part.ndim - 1)
    for s, column in zip(run, columns):
      out[s.spec.name] = (column if s.spec.mode is None or s.active is None
                          else lookups.pool(column, s.active, s.weights,
                                            s.spec.mode))
  return out


def check_slots(s: _Slots) -> None:
  """Records a `checkify` check that a feature's real ids fit its table."""
  if not isinstance(s.ids, jax.core.Tracer) and not isinstance(
      s.active, jax.core.Tracer):
    return  # concrete: feature_slots has raised already
  bad = ~in_range(s.ids, s.rows)
  if s.active is not None:
    bad = bad & s.active
  flat = bad.reshape(-1)
  first = jnp.argmax(flat)
  checkify.check(
      ~jnp.any(flat),
      validate.out_of_range_message(where_of(s.spec), s.rows),
      id=s.ids.reshape(-1)[first], position=first, count=jnp.sum(flat))
