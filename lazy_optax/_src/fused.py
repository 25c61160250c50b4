"""Fused row updates: how a rule updates its state tables, on their backend.

`lazy(tx)` owns the row-sparse path of every leaf: it flattens the gradient,
validates and deduplicates the ids, finds the state leaves that mirror each
table, gathers their touched rows, runs `tx` on those row blocks and writes
the new rows back. That generic path works for any optax transformation.

A rule written as a `RowRule` (lazy_optax's own optimizers are) can update
its tables better, in place. It says so where `lazy` reads it without
tracing `update`: its state type is *declared* (`declare(StateType,
RuleFacts(...))`: the rule's name, the state fields that mirror the
parameters, its CPU kernel). `lazy` finds the declared states in the
abstract state by type (as optax's `tree_utils` find configuration),
decides each table's `backend.Backend` from `impl=`, where the table lives
and those facts, before its one trace of `update`, and hands the rule, in
the place of each of its state row blocks, a `TableRows`: the whole table,
the touched rows' ids and the decided backend (aux data, compared by
value). `apply_rule` runs that backend:

- `'generic'`: the rule's arithmetic on the gathered rows, written back;
- `'xla'`: the same arithmetic, the step computed from the rows read back
  (faster for rows of 128 bytes or more on CPU);
- `'cpu_kernel'`: the rule's C++ kernel updates the tables in place and
  returns the step (one pass over the touched rows). On a mesh with
  Explicit axes whose rows are split, each device runs it on its own rows
  inside `jax.shard_map`. Lowered for another platform, the step takes
  `'xla'`.

The rule returns a `TableRows` of its new tables, and `lazy` keeps them.
Anywhere else (a dense gradient, a wrapper that rebuilt the state) the rule
gets plain arrays and computes on them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazy_optax._src import backend as _backend
from lazy_optax._src import cpu_kernels
from lazy_optax._src import row_ops
from lazy_optax._src import validate
from lazy_optax._src.backend import Backend
from lazy_optax._src.backend import REGATHER_MIN_ROW_BYTES
from lazy_optax._src.backend import row_bytes as _row_bytes
from lazy_optax._src.placement import Placement

IMPLS = validate.IMPLS

_Hyper = TypeVar('_Hyper')  # a rule's hyperparameter record


class RuleFacts(NamedTuple):
  """What a rule is, declared with its state type (`declare`).

  Attributes:
    name: the rule's name, for messages and `explain_update` (`'adam'`).
    tables: the state fields that mirror the parameters row by row, in the
      order its kernel takes them.
    kernel: the CPU kernel's FFI target (one of `cpu_kernels.RULES`), or
      None.
    int_tables: the tables that are int32 counters (exact, any parameter
      dtype).
  """
  name: str
  tables: tuple[str, ...]
  kernel: Optional[str] = None
  int_tables: tuple[str, ...] = ()


_DECLARED: dict[type, RuleFacts] = {}


def declare(state_type: type, facts: RuleFacts) -> RuleFacts:
  """Declares that states of `state_type` belong to the rule `facts` names.

  Called once, beside the state's class. `lazy(...)` finds such states in
  `tx.init`'s abstract state by type and decides their tables' backends
  from these facts, before it traces `update`.

  Args:
    state_type: the rule's state class (a NamedTuple with the fields named
      in `facts.tables`).
    facts: the rule's `RuleFacts`.

  Returns:
    `facts`, for the rule's `RowRule`.
  """
  missing = set(facts.tables) - set(getattr(state_type, '_fields', ()))
  if missing:
    raise TypeError(f'{state_type.__name__} has no fields {sorted(missing)}.')
  _DECLARED[state_type] = facts
  return facts


def facts_of(node: object) -> Optional[RuleFacts]:
  """The `RuleFacts` declared for `node`'s type, or None."""
  return _DECLARED.get(type(node))


class RowRule(NamedTuple):
  """A rule's row update, in the two steps that every implementation shares.

  A rule is written once: `new_rows` and `step` in JAX (the 'generic' and
  'xla' paths, and every platform), and, for a CPU kernel, its arithmetic in
  rows.cc (a struct with its `Hyper` record) named by `kernel`, with
  `kernel_hyper` building the Python record of the same fields.

  Attributes:
    name: the rule's name, for messages (`'adam'`).
    new_rows: `(g, rows, params, hyper) -> new rows`: the new state rows
      (a dict keyed like `rows`, in the compute dtype) from the gradient rows
      `g`, the old state rows and, for rules that read them, the parameter
      rows.
    step: `(g, stored, params, hyper) -> updates`: the update rows, from the
      new state rows as stored (rounded to their dtypes).
    tables: the state tables' names, in the order the kernel takes them.
    kernel: the CPU kernel's FFI target (one of `cpu_kernels.RULES`), or
      None.
    kernel_hyper: `hyper -> record`, the kernel's hyperparameter record (a
      NamedTuple with the fields of the kernel's `Hyper`, in order).
    needs_params: whether `new_rows`, `step` or the kernel read the
      parameter rows.
    step_reads_old_rows: whether `step` also takes the old state rows, as
      `step(g, stored, params, hyper, rows)` (a rule whose step depends on
      more than the new state, such as the steps since a row's last update).
    int_tables: the tables that are int32 counters (the kernel's `kInt32`):
      int32 whatever the parameter's dtype, read and written exactly. The
      others are float32 or bfloat16 for the kernel.
  """
  name: str
  new_rows: Callable[..., dict[str, jax.Array]]
  step: Callable[..., jax.Array]
  tables: tuple[str, ...] = ()
  kernel: Optional[str] = None
  kernel_hyper: Optional[Callable[..., Any]] = None
  needs_params: bool = False
  step_reads_old_rows: bool = False
  int_tables: tuple[str, ...] = ()

  @property
  def facts(self) -> RuleFacts:
    """The facts `lazy` reads (what `declare` states for its state)."""
    return RuleFacts(self.name, self.tables, self.kernel, self.int_tables)


@jax.tree_util.register_pytree_with_keys_class
class TableRows:
  """A state table that `lazy` hands its rule: the table and the touched ids.

  Its leaves are the whole table and the distinct ids (unused slots
  `num_rows`); its aux data, compared by value, is the `Backend` that
  `lazy` decided for the table, the rule's name and the parameter's.
  A rule returns its new tables as `TableRows` too, with the backend it
  ran.
  """

  __slots__ = ('table', 'ids', 'backend', 'rule', 'name')
  table: jax.Array
  ids: jax.Array
  backend: Backend
  rule: str
  name: str

  def __init__(self, table: jax.Array, ids: jax.Array, backend: Backend,
               rule: str, name: str) -> None:
    for field, value in zip(self.__slots__,
                            (table, ids, backend, rule, name)):
      object.__setattr__(self, field, value)

  def __setattr__(self, name: str, value: object) -> None:
    raise AttributeError('TableRows is immutable.')

  def __repr__(self) -> str:
    return (f'TableRows({self.name}, {self.rule}, {self.backend.kind}, '
            f'table={self.table.dtype}{list(self.table.shape)})')

  def replace(self, table: jax.Array, backend: Backend) -> TableRows:
    return TableRows(table, self.ids, backend, self.rule, self.name)

  def tree_flatten_with_keys(self):
    keys = map(jax.tree_util.GetAttrKey, ('table', 'ids'))
    return tuple(zip(keys, (self.table, self.ids))), (
        self.backend, self.rule, self.name)

  def tree_flatten(self):
    return (self.table, self.ids), (self.backend, self.rule, self.name)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)


def is_table_rows(x: object) -> bool:
  """Whether `x` is a `TableRows` (use as `is_leaf`)."""
  return isinstance(x, TableRows)


def stored_rows(tree: optax.Updates) -> optax.Updates:
  """`tree` with each `TableRows` read at its ids: the rows a rule stored
  (for a statistic of them, such as a peak); other leaves as they are."""
  return jax.tree.map(
      lambda t: row_ops.gather(t.table, t.ids, t.backend)
      if isinstance(t, TableRows) else t, tree, is_leaf=is_table_rows)


def stateless_rule(name: str, step: Callable[..., jax.Array]) -> RowRule:
  """A `RowRule` without state that reads the parameter rows (a clip).

  It has no tables for a kernel to update in place: XLA computes it on the
  rows it is given, on every backend.

  Args:
    name: the rule's name, for messages.
    step: `(g, params, hyper) -> updates`: the update rows from the incoming
      update (or gradient) rows `g` and the parameter rows.

  Returns:
    The `RowRule` (no tables, `needs_params=True`), for `apply_stateless`.
  """

  def new_rows(g, rows, params, hyper):
    del g, params, hyper
    return dict(rows)

  def rule_step(g, stored, params, hyper):
    del stored
    return step(g, params, hyper)

  return RowRule(name, new_rows, rule_step, (), needs_params=True)


def apply_stateless(rule: RowRule, updates: Any, params: Any,
                    hyper: Any) -> Any:
  """A `stateless_rule` on every leaf: the new updates (XLA's arithmetic on
  the rows given)."""
  leaves, treedef = jax.tree.flatten(updates)
  param_leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
  return jax.tree.unflatten(treedef, [
      rule.step(g, {}, p, hyper).astype(g.dtype)
      for g, p in zip(leaves, param_leaves)])


def refusal(facts: RuleFacts,
            tables: Mapping[str, jax.Array | jax.ShapeDtypeStruct],
            grad_dtype: jax.typing.DTypeLike,
            ids_dtype: jax.typing.DTypeLike) -> str:
  """Why the rule's CPU kernel cannot take these operands ('' if it can);
  where the table lives is `backend.decide`'s to judge.

  Args:
    facts: the rule's declared facts.
    tables: its state tables of one parameter (shapes and dtypes), by field.
    grad_dtype: the gradient's dtype.
    ids_dtype: the dtype of the table's ids.

  Returns:
    The reason, or ''.
  """
  if facts.kernel is None:
    return f'{facts.name} has no CPU kernel'
  for name, table in tables.items():
    dtype = jnp.dtype(table.dtype)
    if name in facts.int_tables:
      if dtype != cpu_kernels.COUNTER_DTYPE:
        return f'its {name} is {dtype} (the kernel counts in int32)'
    elif dtype not in cpu_kernels.STORAGE_DTYPES:
      return f'its {name} is {dtype} (the kernel stores float32, bfloat16)'
  if (not jnp.issubdtype(grad_dtype, jnp.floating)
      or jnp.dtype(grad_dtype).itemsize > 4):
    return f'the gradient is {jnp.dtype(grad_dtype)}'
  if jnp.dtype(ids_dtype) != jnp.dtype(jnp.int32):
    return 'the table needs 64-bit ids'
  return ''


def traced_once(fn: Callable[..., Any], *args: Any) -> Any:
  """`fn(*args)`, traced once per signature and inlined where it is called.

  The arrays among `args`' leaves are the jitted call's arguments; every
  other leaf (a Python number among the hyperparameters) is static, so the
  step holds the operations `fn` called directly would put there. Where a
  leaf cannot be hashed, `fn` is called directly.
  """
  leaves, tree = jax.tree.flatten(args)
  dynamic = tuple(isinstance(x, (jax.Array, np.ndarray, np.generic))
                  for x in leaves)
  static = tuple(None if d else _Exact(x) for d, x in zip(dynamic, leaves))
  try:
    hash((fn, static))
  except TypeError:
    return fn(*args)
  return _call(fn, tree, dynamic, static,
               *(x for d, x in zip(dynamic, leaves) if d))


class _Exact:
  """A static leaf, equal to another of the same type and exact value
  only: a trace made for `0` is not reused for `False`, nor `0.0`'s for
  `-0.0` or `2`'s for `2.0`."""

  __slots__ = ('value', 'key')

  def __init__(self, value: Any):
    self.value = value
    self.key = (type(value), repr(value)
                if isinstance(value, (int, float, complex)) else value)

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Exact) and self.key == other.key


@functools.partial(jax.jit, inline=True, static_argnums=(0, 1, 2, 3))
def _call(fn: Callable[..., Any], tree: jax.tree_util.PyTreeDef,
          dynamic: tuple[bool, ...], static: tuple[Optional[_Exact], ...],
          *arrays: jax.Array) -> Any:
  given = iter(arrays)
  leaves = [next(given) if d else s.value  # type: ignore[union-attr]
            for d, s in zip(dynamic, static)]
  return fn(*jax.tree.unflatten(tree, leaves))


def _step(rule: RowRule, g: jax.Array, stored: dict[str, jax.Array],
          params: Optional[jax.Array], hyper: object,
          rows: dict[str, jax.Array]) -> jax.Array:
  if rule.step_reads_old_rows:
    return traced_once(rule.step, g, stored, params, hyper, rows)
  return traced_once(rule.step, g, stored, params, hyper)


def _dense(rule: RowRule, g: jax.Array, rows: dict[str, jax.Array],
           params: Optional[jax.Array], hyper: object
           ) -> tuple[jax.Array, dict[str, jax.Array]]:
  new = traced_once(rule.new_rows, g, rows, params, hyper)
  stored = {k: new[k].astype(rows[k].dtype) for k in rows}
  return _step(rule, g, stored, params, hyper, rows).astype(g.dtype), stored


def _xla_tables(rule: RowRule, g: jax.Array, tables: dict[str, jax.Array],
                ids: jax.Array, params: Optional[jax.Array], hyper: object,
                *, reread: bool,
                backend: Optional[Backend] = None
                ) -> tuple[dict[str, jax.Array], jax.Array]:
  """The new tables (rows written by XLA) and the step."""
  rows = {k: row_ops.gather(t, ids, backend) for k, t in tables.items()}
  new = traced_once(rule.new_rows, g, rows, params, hyper)
  stored = {k: new[k].astype(rows[k].dtype) for k in rows}
  out = {k: row_ops.put(tables[k], ids, stored[k], backend) for k in tables}
  if reread:
    stored = {k: row_ops.gather(out[k], ids, backend) for k in out}
  return out, _step(rule, g, stored, params, hyper, rows).astype(g.dtype)


def _kernel_tables(rule: RowRule, g: jax.Array, tables: dict[str, jax.Array],
                   ids: jax.Array, params: Optional[jax.Array], hyper: object,
                   backend: Backend) -> tuple[dict[str, jax.Array], jax.Array]:
  assert rule.kernel is not None and rule.kernel_hyper is not None
  where = backend.where
  target = rule.kernel
  names = list(rule.tables)
  h = cpu_kernels.pack(target, rule.kernel_hyper(hyper))
  # Rules that read no parameter rows get the gradient rows in their place.
  p = params if rule.needs_params else g

  def on_cpu(ids, g, h, p, *ts):
    return cpu_kernels.rule(target, ids, g, h, p, ts)

  if where.kind == 'explicit':
    on_cpu = _per_shard(on_cpu, where, len(names))

  def elsewhere(ids, g, h, p, *ts):
    del h
    new, u = _xla_tables(rule, g, dict(zip(names, ts)), ids,
                         p if rule.needs_params else params, hyper,
                         reread=_row_bytes(g) >= REGATHER_MIN_ROW_BYTES,
                         backend=backend)
    return tuple(new[k] for k in names), u.astype(jnp.float32)

  new, u = jax.lax.platform_dependent(
      ids, g.astype(jnp.float32), h, p, *(tables[k] for k in names),
      cpu=on_cpu, default=elsewhere)
  return dict(zip(names, new)), u.astype(g.dtype)


def _per_shard(kernel: Callable[..., tuple[tuple[jax.Array, ...], jax.Array]],
               where: Placement, num_tables: int
               ) -> Callable[..., tuple[tuple[jax.Array, ...], jax.Array]]:
  """`kernel` run by each device on its own rows (`jax.shard_map`).

  `kernel(ids, g, h, p, *tables)` returns `(new tables, update rows)`, the
  rows zero for ids the device does not hold (summed over the devices).
  """
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  axes = where.row_axes
  table_spec = P(axes if len(axes) > 1 else axes[0]) if axes else P()

  def body(ids, g, h, p, *tables):
    local = tables[0].shape[0]
    if axes:
      index = jax.lax.axis_index(axes)
      ids = ids - index * local
      ids = jnp.where((ids >= 0) & (ids < local), ids, local)
    new, out = kernel(ids, g, h, p, *tables)
    if axes:
      out = jax.lax.psum(out, axes)
    return new, out

  return jax.shard_map(
      body, mesh=where.mesh,
      in_specs=(P(), P(), P(), P()) + (table_spec,) * num_tables,
      out_specs=((table_spec,) * num_tables, P()))


def narrowed(backend: Backend, impl: str, kernel: Callable[[], Backend]
             ) -> Backend:
  """`backend` as an inner `impl=` narrows it: `'xla'` or `'generic'`
  replace a kernel, `'cpu_kernel'` asks `kernel()` for one (which raises
  where none can run)."""
  if impl == 'auto' or impl == backend.kind:
    return backend
  if impl == 'cpu_kernel':
    return kernel()._replace(row_kernels=backend.row_kernels)
  return backend._replace(kind=impl, reason=f"impl='{impl}' was asked for",
                          row_kernels=False)


def _kernel_or_raise(rule: RowRule, g: jax.Array,
                     given: dict[str, TableRows]
                     ) -> Backend:
  first = next(iter(given.values()))
  why = refusal(rule.facts, {k: t.table for k, t in given.items()}, g.dtype,
                first.ids.dtype)
  return _backend.decide(first.table, 'cpu_kernel', refusal=why,
                         subject=rule.name, name=first.name)


def _tabled(rule: RowRule, g: jax.Array, given: dict[str, TableRows],
            params: Optional[jax.Array], hyper: object, impl: str
            ) -> tuple[jax.Array, dict[str, TableRows]]:
  """One leaf whose state tables `lazy` handed over whole."""
  first = next(iter(given.values()))
  if first.rule != rule.name or set(given) != set(rule.tables):
    raise ValueError(
        f'{rule.name} was handed the tables of {first.rule} '
        f'({sorted(given)}): its state type declares other facts than its '
        'RowRule.')
  backend = narrowed(first.backend, impl,
                     lambda: _kernel_or_raise(rule, g, given))
  tables = {k: t.table for k, t in given.items()}
  ids = first.ids
  if backend.kind == 'generic':
    rows = {k: row_ops.gather(t, ids, backend) for k, t in tables.items()}
    u, stored = _dense(rule, g, rows, params, hyper)
    new = {k: row_ops.put(tables[k], ids, stored[k], backend) for k in tables}
  elif backend.kind == 'xla':
    new, u = _xla_tables(rule, g, tables, ids, params, hyper, reread=True,
                         backend=backend)
  else:
    new, u = _kernel_tables(rule, g, tables, ids, params, hyper, backend)
  return u, {k: given[k].replace(new[k], backend) for k in given}


def apply_rule(rule: RowRule, updates: optax.Updates,
               tables: Mapping[str, optax.Updates],
               params: Optional[optax.Params], hyper: _Hyper, impl: str, *,
               leaf_hyper: Optional[Callable[[int, _Hyper], _Hyper]] = None
               ) -> tuple[optax.Updates, dict[str, optax.Updates]]:
  """Runs `rule` on every leaf of `updates`: in place where `lazy` says.

  A leaf whose state tables are `TableRows` (handed over by `lazy`) runs
  the backend they carry, narrowed by `impl`; any other leaf gets the
  rule's arithmetic on what it was given.

  Args:
    rule: the `RowRule`.
    updates: the gradient tree (row blocks inside `lazy`, dense arrays
      otherwise).
    tables: the rule's state trees that mirror the parameters, by name
      (`{'mu': state.mu, 'nu': state.nu}`), each with the structure of
      `updates`.
    params: the parameters (row blocks inside `lazy`) or None.
    hyper: the rule's hyperparameters, passed to `new_rows`, `step` and
      `kernel_hyper` as given.
    impl: one of `IMPLS`: the rule's own; `'xla'` or `'generic'` replace
      the kernel `lazy` chose.
    leaf_hyper: `(leaf index, hyper) -> hyper` for rules whose
      hyperparameters differ per leaf (a weight-decay mask).

  Returns:
    `(updates, new_tables)` with the structures of `updates` and `tables`.
  """
  treedef: jax.tree_util.PyTreeDef = jax.tree.structure(updates)
  grads = treedef.flatten_up_to(updates)
  leaves = {k: treedef.flatten_up_to(v) for k, v in tables.items()}
  param_leaves = ([None] * len(grads) if params is None
                  else treedef.flatten_up_to(params))
  out: list[jax.Array] = []
  new: dict[str, list[Union[jax.Array, TableRows]]] = {k: [] for k in tables}
  for i, g in enumerate(grads):
    rows = {k: leaves[k][i] for k in tables}
    h = hyper if leaf_hyper is None else leaf_hyper(i, hyper)
    stored: Mapping[str, Union[jax.Array, TableRows]]
    if rows and all(isinstance(r, TableRows) for r in rows.values()):
      u, stored = _tabled(rule, g, rows, param_leaves[i], h, impl)
    else:
      u, stored = _dense(rule, g, rows, param_leaves[i], h)
    out.append(u)
    for k in tables:
      new[k].append(stored[k])
  return (treedef.unflatten(out),
          {k: treedef.unflatten(v) for k, v in new.items()})


def check_impl(impl: str, where: str) -> None:
  """`impl` must be one of `IMPLS`."""
  validate.impl_argument(impl, where)


def unused_impl(impl: str, where: str) -> None:
  """`impl=` of a rule without state: checked, and deprecated when given
  (such a rule has no table to update in place: XLA computes it on the
  rows, whatever `impl` says; `lazy(..., impl=)` decides the tables')."""
  validate.ignored_impl(impl, where, (
      f'{where} has no state table to update in place, so XLA computes it '
      'on the rows lazy(...) gathers'))
