"""Fused row updates: how a rule updates its state rows, on its table's backend.

`lazy(tx)` owns the row-sparse path of every leaf: it flattens the gradient,
validates and deduplicates the ids, finds the state leaves that mirror each
table, gathers their touched rows, runs `tx` on those row blocks and writes
the new rows back. That generic path works for any optax transformation.

A rule written as a `RowRule` (lazy_optax's own optimizers are) can do the
row update better, and `lazy(...)` lets it: `lazy` builds a
`row_context.RowContext` that maps each gathered row block to a `Block`
(its full table, the distinct ids and the table's `backend.Backend`, which
`lazy` decided once for the table, `lazy.py`) and hands it to `tx.update`
as one of optax's extra arguments (`row_context.py` says who writes and
reads what there). A rule is a `GradientTransformationExtraArgs` whose
`update` hands `row_context.context_of(extra_args)` to `apply_rule`, which
looks its state leaves up in that context (and nowhere else) and runs the
backend's implementation:

- `'generic'`: the rule's arithmetic on the row blocks; `lazy` writes them
  back (what any optax transformation gets);
- `'xla'`: the same arithmetic, the new rows written by the rule, and the
  step computed from the rows read back, so that XLA reads each state row
  once (faster for rows of 128 bytes or more);
- `'cpu_kernel'`: the rule's C++ kernel updates the tables in place and
  returns the step (one pass over the touched rows). On a mesh with
  Explicit axes whose rows are split, each device runs it on its own rows
  inside `jax.shard_map`. Lowered for another platform, the step takes
  `'xla'`.

To decide, `lazy` first traces `tx.update` abstractly with a *probe*
context (blocks without a backend): each rule reports what it asks for (its
`impl=`, and why its kernel cannot take these operands, if so), and `lazy`
sees whether the tables the rule writes come back to it (they do not when
a wrapper rebuilds the state, as `optax.apply_if_finite`'s `lax.cond`
does: that rule then gets `'generic'`, so that no kernel writes a copy of
the table inside the branch). The rule hands the new tables back to `lazy`
through the context, so no code reads a chain's state by position. Where
the row blocks do not arrive as `lazy` gathered them, or the context does
not arrive (a plain `optax.GradientTransformation` around the rule drops
extra arguments), the rule computes on whatever it is given and `lazy`
writes the rows back: correct, generic. `explain_update` reports each
table's decision, as the compiled step runs it: it passes a `RowContext`
holding a log under the same keyword (`row_context.ROWS_KEY`), and every
`lazy` inside records its choices there.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from lazy_optax._src import cpu_kernels
from lazy_optax._src import row_ops
from lazy_optax._src import validate
from lazy_optax._src.backend import Backend
from lazy_optax._src.backend import REGATHER_MIN_ROW_BYTES  # noqa: F401
from lazy_optax._src.backend import row_bytes as _row_bytes
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.placement import Placement
from lazy_optax._src.placement import placement
from lazy_optax._src.row_context import Block
from lazy_optax._src.row_context import Choice
from lazy_optax._src.row_context import FusedAdd
from lazy_optax._src.row_context import Request
from lazy_optax._src.row_context import RowContext

IMPLS = validate.IMPLS


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
    fused_add: for a rule without state whose update is a function of the
      parameter rows (row max-norm), `(table, ids, g, words, dtype) -> table
      + update`: its kernel and the scatter-add of its update in one pass,
      bit for bit as the two (`g` the incoming rows, `words` the packed
      record, `dtype` the update's); `apply_updates` takes it where it adds
      the update to the very table the rule read (`FusedAdd`).
    split_params: for a rule whose new state does not read the parameter
      rows and whose update is linear in them, `base + keep * params` with
      `base` and the per-row `keep` computed without them (`step` computes
      the same in that order): its kernel's split target
      (`cpu_kernels.rule_split`) updates the state and returns `base` and
      `keep`, the update rows are computed from them by XLA, and
      `apply_updates` adds them to the very table the rule read in one pass
      (`cpu_kernels.add_linear`, `FusedAdd`), so the parameter rows are
      not gathered at all.
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
  fused_add: Optional[Callable[..., jax.Array]] = None
  split_params: bool = False


def stateless_rule(name: str, step: Callable[..., jax.Array], kernel: str,
                   kernel_hyper: Callable[..., Any],
                   fused_add: Optional[Callable[..., jax.Array]] = None
                   ) -> RowRule:
  """A `RowRule` without state that reads the parameter rows (a clip).

  Args:
    name: the rule's name, for messages.
    step: `(g, params, hyper) -> updates`: the update rows from the incoming
      update (or gradient) rows `g` and the parameter rows.
    kernel: the CPU kernel's FFI target (one of `cpu_kernels.RULES`).
    kernel_hyper: `hyper -> record`, the kernel's hyperparameter record.
    fused_add: the kernel that applies the update where it is added (see
      `RowRule.fused_add`), or None.

  Returns:
    The `RowRule` (no tables, `needs_params=True`), for `apply_stateless`.
  """

  def new_rows(g, rows, params, hyper):
    del g, params, hyper
    return dict(rows)

  def rule_step(g, stored, params, hyper):
    del stored
    return step(g, params, hyper)

  return RowRule(name, new_rows, rule_step, (), kernel, kernel_hyper,
                 needs_params=True, fused_add=fused_add)


def apply_stateless(rule: RowRule, updates: Any, params: Any, hyper: Any,
                    impl: str, *, context: Optional[RowContext]) -> Any:
  """`apply_rule` for a `stateless_rule`: the new updates alone."""
  out, _ = apply_rule(rule, updates, {}, params, hyper, impl,
                      context=context)
  return out


def _rule_refusal(rule: RowRule, g: Any, blocks: dict[str, Block]) -> str:
  """Why the rule's CPU kernel cannot take these operands ('' if it can);
  where the table lives is `lazy`'s to judge (`backend.decide`)."""
  if rule.kernel is None:
    return f'{rule.name} has no CPU kernel'
  if not rule.tables and placement(
      next(iter(blocks.values())).table).kind == 'explicit':
    return 'a rule without state runs its kernel on one device only'
  for name, block in blocks.items():
    dtype = jnp.dtype(block.table.dtype)
    if name in rule.int_tables:
      if dtype != cpu_kernels.COUNTER_DTYPE:
        return f'its {name} is {dtype} (the kernel counts in int32)'
    elif dtype not in cpu_kernels.STORAGE_DTYPES:
      return f'its {name} is {dtype} (the kernel stores float32, bfloat16)'
  if (not jnp.issubdtype(g.dtype, jnp.floating)
      or jnp.dtype(g.dtype).itemsize > 4):
    return f'the gradient is {jnp.dtype(g.dtype)}'
  ids = next(iter(blocks.values())).ids
  if jnp.dtype(ids.dtype) != jnp.dtype(jnp.int32):
    return 'the table needs 64-bit ids'
  return ''


def _step(rule: RowRule, g: Any, stored: dict[str, Any], params: Any,
          hyper: Any, rows: dict[str, Any]) -> Any:
  if rule.step_reads_old_rows:
    return rule.step(g, stored, params, hyper, rows)
  return rule.step(g, stored, params, hyper)


def _dense(rule: RowRule, g: Any, rows: dict[str, Any], params: Any,
           hyper: Any) -> tuple[Any, dict[str, Any]]:
  new = rule.new_rows(g, rows, params, hyper)
  stored = {k: new[k].astype(rows[k].dtype) for k in rows}
  return _step(rule, g, stored, params, hyper, rows).astype(g.dtype), stored


def _xla_tables(rule: RowRule, g: Any, tables: dict[str, jax.Array],
                ids: jax.Array, params: Any, hyper: Any, *, reread: bool,
                rows: Optional[dict[str, Any]] = None,
                backend: Optional[Backend] = None
                ) -> tuple[dict[str, jax.Array], jax.Array]:
  """The new tables (rows written by XLA) and the step."""
  if rows is None:
    rows = {k: row_ops.gather(t, ids, backend) for k, t in tables.items()}
  new = rule.new_rows(g, rows, params, hyper)
  stored = {k: new[k].astype(rows[k].dtype) for k in rows}
  out = {k: row_ops.put(tables[k], ids, stored[k], backend) for k in tables}
  if reread:
    stored = {k: row_ops.gather(out[k], ids, backend) for k in out}
  return out, _step(rule, g, stored, params, hyper, rows).astype(g.dtype)


def _kernel_tables(rule: RowRule, g: Any, tables: dict[str, jax.Array],
                   ids: jax.Array, params: Any, hyper: Any,
                   backend: Backend) -> tuple[dict[str, jax.Array], jax.Array]:
  assert rule.kernel is not None and rule.kernel_hyper is not None
  where = backend.where
  target = rule.kernel
  names = list(rule.tables)
  if sorted(names) != sorted(tables):
    raise ValueError(f'{rule.name}: the kernel takes tables {names}, the '
                     f'rule was given {sorted(tables)}.')
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


def _split_kernel_tables(rule: RowRule, g: Any, tables: dict[str, jax.Array],
                         ids: jax.Array, params: Any, hyper: Any,
                         backend: Backend
                         ) -> tuple[dict[str, jax.Array], jax.Array,
                                    tuple[jax.Array, jax.Array]]:
  """`_kernel_tables` for a `split_params` rule: the new tables, the update
  rows `base + keep * params` (computed by XLA, unused where
  `apply_updates` adds them in one pass) and `(base, keep)` (elsewhere than
  on CPU, the update rows and no `keep`)."""
  assert rule.kernel is not None and rule.kernel_hyper is not None
  names = list(rule.tables)
  target = rule.kernel
  h = cpu_kernels.pack(target, rule.kernel_hyper(hyper))

  def on_cpu(ids, g, h, p, *ts):
    del p
    return cpu_kernels.rule_split(target, ids, g, h, ts)

  if backend.where.kind == 'explicit':
    on_cpu = _per_shard(on_cpu, backend.where, len(names), 2)

  def elsewhere(ids, g, h, p, *ts):
    del h
    new, u = _xla_tables(rule, g, dict(zip(names, ts)), ids, p, hyper,
                         reread=_row_bytes(g) >= REGATHER_MIN_ROW_BYTES,
                         backend=backend)
    return (tuple(new[k] for k in names), u.astype(jnp.float32),
            jnp.zeros(ids.shape, jnp.float32))

  # The parameter rows are an operand only for the XLA path: on CPU they
  # are read where the update is used.
  new, base, keep = jax.lax.platform_dependent(
      ids, g.astype(jnp.float32), h, params, *(tables[k] for k in names),
      cpu=on_cpu, default=elsewhere)
  u = jax.lax.platform_dependent(
      base, keep, params,
      cpu=lambda b, k, p: b + broadcast_rows(k, b) * p.astype(jnp.float32),
      default=lambda b, k, p: b)
  return dict(zip(names, new)), u.astype(g.dtype), (base, keep)


def _per_shard(kernel: Callable[..., Any], where: Placement,
               num_tables: int, num_rows_out: int = 1) -> Callable[..., Any]:
  """`kernel` run by each device on its own rows (`jax.shard_map`).

  `kernel(ids, g, h, p, *tables)` returns `(new tables, *row outputs)`,
  `num_rows_out` of them, zero for ids the device does not hold (summed
  over the devices).
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
    new, *out = kernel(ids, g, h, p, *tables)
    if axes:
      out = [jax.lax.psum(x, axes) for x in out]
    return (new, *out)

  return jax.shard_map(
      body, mesh=where.mesh,
      in_specs=(P(), P(), P(), P()) + (table_spec,) * num_tables,
      out_specs=((table_spec,) * num_tables,) + (P(),) * num_rows_out)


def _lazy_blocks(rule: RowRule, rows: dict[str, Any], params: Any,
                 context: Optional[RowContext]
                 ) -> Optional[tuple[RowContext, dict[str, Block]]]:
  """The context and blocks of `rows` if all are `lazy`'s, of one table.

  A rule without state (a clip) is located by its parameter rows.
  """
  if context is None:
    return None
  param_block = (context.find(params)
                 if rule.needs_params and params is not None else None)
  if not rows:
    if param_block is None:
      return None
    return param_block[0], {'params': param_block[1]}
  found = [context.find(v) for v in rows.values()]
  if any(f is None for f in found):
    return None
  owner = found[0][0]  # type: ignore[index]
  blocks = {k: f[1] for k, f in zip(rows, found)}  # type: ignore[index]
  ids = next(iter(blocks.values())).ids
  if any(b.ids is not ids for b in blocks.values()):
    return None
  if rule.needs_params and (param_block is None
                            or param_block[1].ids is not ids):
    return None
  return owner, blocks


def _decided(rule: RowRule, g: Any, impl: str, context: RowContext,
             block: Block, blocks: dict[str, Block],
             params: Any = None) -> Backend:
  """The backend `lazy` decided for this rule's table (or, while it probes,
  the request reported and a stand-in that writes the tables)."""
  if block.backends is None:  # probing: report, and write as 'xla' would
    context.request(block.name, Request(rule.name, impl,
                                        _rule_refusal(rule, g, blocks)))
    kind = 'generic' if impl == 'generic' else 'xla'
    return Backend(kind, 'probe', False, Placement('one'))
  backend = block.backends.get(rule.name)
  if backend is None:  # a rule `lazy` did not see while probing
    backend = Backend('generic', f'{rule.name} was not seen when lazy(...) '
                      'decided this table', False, Placement('one'))
  reason = backend.reason
  if backend.kind == 'cpu_kernel' and _adds_in_one_pass(rule, g, context,
                                                        params):
    reason += ('; apply_updates given these very parameters runs it inside '
               'its scatter-add, reading each row once')
  context.record(Choice(block.name, rule.name, backend.kind, reason))
  return backend


def _fuses(rule: RowRule) -> bool:
  """Whether the rule's kernel path adds its update in one pass
  (`FusedAdd`)."""
  return rule.fused_add is not None or (rule.split_params
                                        and rule.needs_params)


def _adds_in_one_pass(rule: RowRule, g: Any, context: RowContext,
                      params: Any) -> bool:
  """Whether `apply_updates` adds the rule's update (on its kernel's path)
  in one pass: where the `FusedAdd` takes its kernel (`_one_pass`)."""
  found = context.find(params) if _fuses(rule) else None
  if found is None:
    return False
  table = found[1].table
  return (row_ops.kernels_for(table, found[1].table_backend)
          and jnp.dtype(table.dtype) in cpu_kernels.STORAGE_DTYPES
          and jnp.dtype(g.dtype) in cpu_kernels.STORAGE_DTYPES)


def _one_leaf(rule: RowRule, g: Any, rows: dict[str, Any], params: Any,
              hyper: Any, impl: str, context: Optional[RowContext]
              ) -> tuple[Any, dict[str, Any]]:
  found = _lazy_blocks(rule, rows, params, context)
  if found is None:
    return _dense(rule, g, rows, params, hyper)
  context, blocks = found
  block = next(iter(blocks.values()))
  backend = _decided(rule, g, impl, context, block, blocks, params)
  if backend.kind == 'generic':
    return _dense(rule, g, rows, params, hyper)
  if block.backends is None:  # probing: the rows, as if written to tables
    return _probed(rule, g, rows, params, hyper, context, blocks)
  tables = {k: b.table for k, b in blocks.items() if k in rows}
  if backend.kind == 'xla':
    new, u = _xla_tables(rule, g, tables, block.ids, params, hyper,
                         reread=True, rows=rows, backend=backend)
  elif rule.split_params and rule.needs_params:
    new, u, split = _split_kernel_tables(rule, g, tables, block.ids, params,
                                         hyper, backend)
    found_params = context.find(params)
    assert found_params is not None  # `_lazy_blocks` found them
    context.fuse(u, _linear_add(*split, found_params[1]))
  else:
    new, u = _kernel_tables(rule, g, tables, block.ids, params, hyper,
                            backend)
    if rule.fused_add is not None and not rows:
      context.fuse(u, _fused_add(rule, g, hyper, blocks['params']))
  # Hand the tables to `lazy`; the rows read back stand for them in the
  # state `tx` returns (correct rows even where `lazy` cannot find them).
  stored = {}
  for k, table in new.items():
    stored[k] = row_ops.gather(table, block.ids, backend)
    context.wrote(stored[k], table, block.name)
  return u, stored


def _probed(rule: RowRule, g: Any, rows: dict[str, Any], params: Any,
            hyper: Any, context: RowContext, blocks: dict[str, Block]
            ) -> tuple[Any, dict[str, Any]]:
  """What a rule hands `lazy` while it probes: the new rows of the rule's
  arithmetic, each marked as standing for its written table (what `lazy`
  needs to see which tables come back), without the gathers and writes
  that only the traced step needs."""
  u, stored = _dense(rule, g, rows, params, hyper)
  for k, new in stored.items():
    context.wrote(new, blocks[k].table, blocks[k].name)
  return u, stored


def _one_pass(block: Block, operands: tuple[jax.Array, ...],
              kernel: Callable[..., jax.Array]) -> FusedAdd:
  """The `FusedAdd` of `block`'s parameter table: on CPU
  `kernel(table, ids, *operands, update dtype)`, which computes the update
  from each parameter row it reads and adds it (the update's rows left
  unused, for XLA to drop), elsewhere the scatter-add of the rows."""

  def add(table, ids, values, moves):
    rows = values.astype(table.dtype)
    if not (row_ops.kernels_for(table, moves)
            and jnp.dtype(ids.dtype) == jnp.dtype(jnp.int32)
            and jnp.dtype(table.dtype) in cpu_kernels.STORAGE_DTYPES
            and jnp.dtype(values.dtype) in cpu_kernels.STORAGE_DTYPES):
      return row_ops.add(table, ids, rows, moves)
    return jax.lax.platform_dependent(
        table, ids, rows, *operands,
        cpu=lambda t, i, _, *o: kernel(t, i, *o, values.dtype),
        default=lambda t, i, r, *o: row_ops.add(t, i, r, moves))

  return FusedAdd(block.table, add)


def _fused_add(rule: RowRule, g: Any, hyper: Any, block: Block) -> FusedAdd:
  """How the update of `rule` (without state) on `g` is added to the
  parameter table of `block` in one pass: its `fused_add` kernel."""
  assert rule.fused_add is not None and rule.kernel_hyper is not None
  assert rule.kernel is not None
  words = cpu_kernels.pack(rule.kernel, rule.kernel_hyper(hyper))
  return _one_pass(block, (g, words), rule.fused_add)


def _linear_add(base: jax.Array, keep: jax.Array, block: Block) -> FusedAdd:
  """How the update `base + keep * params` of a `split_params` rule is added
  to the parameter table of `block` in one pass (`cpu_kernels.add_linear`).
  """
  return _one_pass(block, (base, keep), cpu_kernels.add_linear)


def apply_rule(rule: RowRule, updates: Any, tables: dict[str, Any],
               params: Any, hyper: Any, impl: str, *,
               context: Optional[RowContext],
               leaf_hyper: Optional[Callable[[int, Any], Any]] = None
               ) -> tuple[Any, dict[str, Any]]:
  """Runs `rule` on every leaf of `updates`: fused where `lazy` allows.

  A leaf is fused where its state leaves (or, for a rule without state, its
  parameter rows) are row blocks that `context` (or an outer `lazy`'s
  context it holds) gathered; any other leaf gets the rule's arithmetic on
  what it was given.

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
    impl: one of `IMPLS`.
    context: the `RowContext` that `lazy` passed in the rule's extra
      arguments (`row_context.context_of(extra_args)`), or None.
    leaf_hyper: `(leaf index, hyper) -> hyper` for rules whose
      hyperparameters differ per leaf (a weight-decay mask).

  Returns:
    `(updates, new_tables)` with the structures of `updates` and `tables`.
  """
  treedef: Any = jax.tree.structure(updates)
  grads = treedef.flatten_up_to(updates)
  leaves = {k: treedef.flatten_up_to(v) for k, v in tables.items()}
  param_leaves = ([None] * len(grads) if params is None
                  else treedef.flatten_up_to(params))
  out: list[Any] = []
  new: dict[str, list[Any]] = {k: [] for k in tables}
  for i, g in enumerate(grads):
    rows = {k: leaves[k][i] for k in tables}
    h = hyper if leaf_hyper is None else leaf_hyper(i, hyper)
    u, stored = _one_leaf(rule, g, rows, param_leaves[i], h, impl,
                          context)
    out.append(u)
    for k in tables:
      new[k].append(stored[k])
  return (treedef.unflatten(out),
          {k: treedef.unflatten(v) for k, v in new.items()})


def check_impl(impl: str, where: str) -> None:
  """`impl` must be one of `IMPLS`."""
  validate.impl_argument(impl, where)
