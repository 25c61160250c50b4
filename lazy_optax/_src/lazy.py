"""`lazy(tx)`: any optax transformation, applied to the touched rows only."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import backend as _backend
from lazy_optax._src import cpu_kernels
from lazy_optax._src import damage
from lazy_optax._src import grads as _grads
from lazy_optax._src import row_context
from lazy_optax._src import row_ops
from lazy_optax._src import row_state
from lazy_optax._src import tree_diff
from lazy_optax._src import validate
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import distinct_rows
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows


class _RowLeaf(NamedTuple):
  """How one row-lazy gradient leaf is updated."""
  ids: Optional[jax.Array]       # unique ids (SparseRows) or None
  row_mask: Optional[jax.Array]  # rows touched (dense, skip_zero_rows) or None


class _Leaves(NamedTuple):
  """The gradient tree flattened with `SparseRows` as leaves."""
  treedef: Any
  names: list[str]
  grads: list[Any]
  params: list[Any]


def _shape_struct(x: Any) -> jax.ShapeDtypeStruct:
  if isinstance(x, SparseRows):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if not hasattr(x, 'shape') or not hasattr(x, 'dtype'):
    x = jnp.asarray(x)
  return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def _flatten(updates: Any, params: Any) -> _Leaves:
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      updates, is_leaf=is_sparse_rows)
  grads = [g for _, g in flat]
  param_leaves: list[Any] = [None] * len(grads)
  if params is not None:
    try:
      param_leaves = treedef.flatten_up_to(  # type: ignore[attr-defined]
          params)
    except (ValueError, TypeError) as e:
      raise ValueError(
          'params and gradients have different tree structures: '
          f'{tree_diff.describe(updates, params)}.') from e
  return _Leaves(treedef, [path_name(p) for p, _ in flat], grads,
                 param_leaves)


def check_sparse_leaf(grad: SparseRows, param: Any, name: str) -> None:
  where = f'parameter {name}'
  grad.check(where)
  validate.floating(grad.values.dtype, f'The SparseRows gradient of {where}')
  if param is None:
    return
  shape = tuple(getattr(param, 'shape', ()))
  dtype = getattr(param, 'dtype', None) or jnp.asarray(param).dtype
  validate.floating(dtype, f'Parameter {name}',
                    'parameters with a SparseRows gradient')
  if (jnp.issubdtype(dtype, jnp.complexfloating)
      != jnp.issubdtype(grad.values.dtype, jnp.complexfloating)):
    raise TypeError(
        f'Parameter {name} has dtype {dtype} but its SparseRows gradient has '
        f'values of dtype {grad.values.dtype}: one is complex, the other real.')
  if len(shape) < 1:
    raise ValueError(
        f'Parameter {name} has shape {shape}: a SparseRows gradient needs a '
        'parameter of at least one dimension (its rows).')
  if shape[0] != grad.num_rows:
    raise ValueError(
        f'Parameter {name} has {shape[0]} rows but its SparseRows gradient '
        f'says num_rows={grad.num_rows}.')
  if shape[1:] != grad.row_shape:
    raise ValueError(
        f'Parameter {name} has rows of shape {shape[1:]} but its SparseRows '
        f'gradient has rows of shape {grad.row_shape}.')


_DENSE_RULE = (
    'a dense gradient: tx updates every row of this table (moments of '
    'untouched rows decay, and those rows move), O(table) per step')


def _dense_table_message(name: str) -> str:
  return (
      f'Parameter {name} gets a dense gradient, but lazy_optax.value_and_grad '
      'gave it a SparseRows gradient (its lookups read it): accumulate '
      'gradients with lazy_optax.tree.add(g1, g2) starting from the first '
      'gradients, not into jax.tree.map(jnp.zeros_like, params), or use '
      'lazy_optax.wrappers.multi_steps.\n'
      f'Its update would be dense ({_DENSE_RULE}), not the lazy update of '
      'the rows the batch touched. To train this table densely on purpose, '
      'leave it out of value_and_grad(tables=[...]) or take its gradient '
      'with jax.grad; lazy(tx, skip_zero_rows=True) updates only the rows '
      'whose dense gradient is not zero.')


def _check_dense_tables(leaves: _Leaves, skip_zero_rows: bool,
                        extra_args: dict[str, Any]) -> None:
  """Refuses a dense gradient for a table that `value_and_grad` gave a
  `SparseRows` (the zeros_like accumulation); `explain_update` is told
  which tables take the dense rule."""
  context = row_context.context_of(extra_args)
  log = context.log if context is not None else None
  for g, p, name in zip(leaves.grads, leaves.params, leaves.names):
    if isinstance(g, SparseRows) or skip_zero_rows or jnp.ndim(g) < 2:
      continue
    refused = p is not None and _grads.had_row_sparse_gradient(p)
    if log is not None:
      log.append(row_context.Choice(
          name, 'tx', 'dense',
          _dense_table_message(name).replace('\n', ' ') if refused
          else _DENSE_RULE + '; a SparseRows gradient (from '
          'lazy_optax.value_and_grad) updates only the touched rows'))
    elif refused:
      raise ValueError(_dense_table_message(name))


def _touched_rows(grad: jax.Array) -> jax.Array:
  if grad.ndim == 1:
    return grad != 0
  return jnp.any(grad != 0, axis=tuple(range(1, grad.ndim)))


def _row_leaves(leaves: _Leaves, skip_zero_rows: bool,
                backends: Optional[dict[int, _backend.Backend]]
                ) -> tuple[dict[int, _RowLeaf], list[Any]]:
  """Which leaves are updated row by row, and the gradients `tx` sees."""
  rows: dict[int, _RowLeaf] = {}
  row_grads = list(leaves.grads)
  for i, (g, name) in enumerate(zip(leaves.grads, leaves.names)):
    if isinstance(g, SparseRows):
      check_sparse_leaf(g, leaves.params[i], name)
      ids, values = distinct_rows(g, f'parameter {name}',
                                  backends.get(i) if backends else None)
      rows[i] = _RowLeaf(ids, None)
      row_grads[i] = values
    elif hasattr(g, 'dtype'):
      validate.floating(g.dtype, f'Gradient for parameter {name}')
    if skip_zero_rows and not isinstance(g, SparseRows) and jnp.ndim(g) >= 1:
      rows[i] = _RowLeaf(None, _touched_rows(jnp.asarray(g)))
  return rows, row_grads


def _gated(rows: dict[int, _RowLeaf], grads: list[Any]
           ) -> tuple[dict[int, _RowLeaf], Optional[int]]:
  """`rows` whose ids name no row if a check of the step helper failed
  (`damage.gate`: all of this update's gradients are checked by now), and
  how many checks they saw."""
  seen = None
  for i, row in rows.items():
    if row.ids is not None:
      ids, seen = damage.gate(row.ids, grads[i].num_rows)
      rows[i] = row._replace(ids=ids)
  return rows, seen


def _note_writes(state: Any, new_state: Any, owners: list[Optional[int]],
                 rows: dict[int, _RowLeaf], seen: Optional[int]) -> None:
  """Tells the step helper which state tables only gated writes changed."""
  for old, new, pos in zip(jax.tree.leaves(state), jax.tree.leaves(new_state),
                           owners):
    if pos is not None and rows[pos].ids is not None:
      damage.note(new, old, seen)


def _gather(leaf: jax.Array, row: _RowLeaf,
            backend: Optional[_backend.Backend]) -> jax.Array:
  if row.ids is None:
    return leaf
  # Unused slots hold id `num_rows`: they read zeros.
  return row_ops.gather(leaf, row.ids, backend)


def _put_back(old: jax.Array, new: jax.Array, row: _RowLeaf,
              backend: Optional[_backend.Backend]) -> jax.Array:
  if row.ids is not None:
    return row_ops.put(old, row.ids, new, backend)
  assert row.row_mask is not None
  return jnp.where(broadcast_rows(row.row_mask, old), new, old)


def _row_updates(leaves: _Leaves, rows: dict[int, _RowLeaf],
                 new_updates: Any, context: row_context.RowContext) -> Any:
  out = leaves.treedef.flatten_up_to(new_updates)
  for i, row in rows.items():
    if row.ids is not None:
      how = context.fused_add(out[i])  # a rule's rows, as it returned them
      # The update's rows move as its gradient's (`impl`, part of the tree
      # structure): a `lax.cond` between the two (`optax.apply_if_finite`)
      # has one tree structure.
      out[i] = SparseRows.from_unique(
          row.ids, out[i], leaves.grads[i].num_rows, distinct=True,
          impl=leaves.grads[i].impl)
      if how is not None:
        out[i] = out[i].with_fused_add(how)
    else:
      assert row.row_mask is not None
      out[i] = jnp.where(broadcast_rows(row.row_mask, out[i]), out[i],
                         jnp.zeros_like(out[i]))
  return leaves.treedef.unflatten(out)


_NO_RULE = ('no lazy_optax rule found these rows in the row context that '
            'lazy(...) passes as the extra argument '
            f'{row_context.ROWS_KEY}= (tx holds no lazy_optax rule, a wrapper '
            'around the rule dropped '
            "optax's extra arguments, as a plain optax.GradientTransformation "
            'does, or handed it copies of the rows, as a lax.cond does): '
            'lazy(...) ran tx on the gathered rows')

_LOST = ('its update ran where lazy(...) cannot take the tables it writes '
         '(a wrapper rebuilt its state, as optax.apply_if_finite\'s lax.cond '
         'does): the rule computes on the row blocks and lazy(...) writes '
         'them back')


class _Plan(NamedTuple):
  """What `lazy` decided for one update, per position of a `SparseRows`."""
  tables: dict[int, _backend.Backend]            # the row moves
  rules: dict[int, dict[str, _backend.Backend]]  # each rule's update


def _signature(tree: Any) -> tuple[Any, ...]:
  """`row_state.signature`, a `SparseRows` described by its shapes, not
  flattened: flattening one built from ids encodes them (ops that a trace
  would carry to its end unused)."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sparse_rows)
  return treedef, tuple(
      (x.num_rows, x.num_ids, x.row_shape, str(x.dtype))
      if is_sparse_rows(x) else row_state.leaf_signature(x) for x in leaves)


class _ProbeCache:
  """What the rules ask for, per tree signature (one abstract trace each)."""

  def __init__(self) -> None:
    self._known: dict[Any, tuple[dict[str, list[row_context.Request]],
                                 set[str]]] = {}

  def __call__(self, probe: Any, tree: Any
               ) -> tuple[dict[str, list[row_context.Request]], set[str]]:
    key = (_signature(tree), cpu_kernels.loaded())
    known = self._known.get(key)
    if known is None:
      box = []
      jax.eval_shape(lambda: box.append(probe()))
      known = self._known[key] = (box[0].requests, box[0].lost())
    return known


def _table_of(pos: int, leaves: _Leaves, state_leaves: list[Any],
              owners: list[Optional[int]]) -> Any:
  """The array whose placement decides the table at `pos`."""
  if leaves.params[pos] is not None:
    return leaves.params[pos]
  for leaf, owner in zip(state_leaves, owners):
    if owner == pos:
      return leaf
  return leaves.grads[pos].values


def _decide_table(table: Any, name: str, impl: str, grad_impl: str,
                  requests: list[row_context.Request], lost: bool
                  ) -> tuple[_backend.Backend, dict[str, _backend.Backend]]:
  """One table's backend: its row moves (XLA's where `lazy`, a rule or the
  gradient asks for them), and each rule's update."""
  where = _backend.placement(table)
  asked = [impl, grad_impl] + [r.impl for r in requests]
  row_kernels = (not {'xla', 'generic'} & set(asked)
                 and _backend.row_kernels_allowed(where))
  moves = _backend.Backend('generic', 'lazy(...) moves the rows',
                           row_kernels, where)
  rules = {}
  for r in requests:
    if lost:
      rules[r.rule] = _backend.Backend('generic', _LOST, row_kernels, where)
      continue
    decided = _backend.decide(table, impl if r.impl == 'auto' else r.impl,
                              refusal=r.refusal, subject=r.rule, name=name)
    rules[r.rule] = decided._replace(row_kernels=row_kernels)
  return moves, rules


def _state_owners(find_owners: Any, leaves: _Leaves, positions: list[int],
                  state: Any) -> list[Optional[int]]:
  """Per state leaf, the position of the table it mirrors (None: none), among
  the tables at `positions` (`row_state.OwnerCache`)."""
  return find_owners(
      param_shapes=[_shape_struct(g) for g in leaves.grads],
      rebuild_params=leaves.treedef.unflatten,
      row_param_positions=positions, state=state)


def _decide(leaves: _Leaves, state: Any, impl: str,
            requests: dict[str, list[row_context.Request]], lost: set[str],
            find_owners: Any) -> _Plan:
  sparse = [i for i, g in enumerate(leaves.grads)
            if isinstance(g, SparseRows)]
  owners = _state_owners(find_owners, leaves, sparse, state)
  state_leaves = jax.tree.leaves(state)
  plan = _Plan({}, {})
  for pos in sparse:
    name = leaves.names[pos]
    plan.tables[pos], plan.rules[pos] = _decide_table(
        _table_of(pos, leaves, state_leaves, owners), name, impl,
        leaves.grads[pos].impl, requests.get(name, []), name in lost)
  return plan


class _Blocks(NamedTuple):
  """One trace's row blocks, and what gathering them and writing them back
  reads."""
  leaves: _Leaves
  rows: dict[int, _RowLeaf]             # the row-lazy leaves, by position
  plan: Optional[_Plan]                 # None while `lazy` probes
  context: row_context.RowContext       # where the blocks are registered

  def moves(self, pos: int) -> Optional[_backend.Backend]:
    """The row moves of the table at `pos` (None while probing)."""
    return self.plan.tables.get(pos) if self.plan is not None else None


def _at_rows(blocks: _Blocks, leaf: Any, pos: Optional[int]) -> Any:
  """`leaf` at the touched rows of the table at `pos` (the leaf itself for
  None), registered in the context where it is gathered by ids."""
  if pos is None:
    return leaf
  row = blocks.rows[pos]
  move = blocks.moves(pos)
  block = _gather(leaf, row, move)
  if row.ids is not None:
    plan = blocks.plan
    blocks.context.register(block, row_context.Block(
        leaf, row.ids, blocks.leaves.names[pos],
        plan.rules.get(pos, {}) if plan is not None else None, move))
  return block


def _row_inputs(blocks: _Blocks, state: Any, owners: list[Optional[int]],
                params: Any) -> tuple[Any, Any]:
  """The state and parameters `tx.update` sees: each leaf that mirrors a
  table at its touched rows (the state first)."""
  state_leaves, state_def = jax.tree.flatten(state)
  row_state_tree = jax.tree.unflatten(
      state_def, [_at_rows(blocks, s, o) for s, o in zip(state_leaves, owners)])
  row_params = None
  if params is not None:
    row_params = blocks.leaves.treedef.unflatten(
        [_at_rows(blocks, p, i if i in blocks.rows else None)
         for i, p in enumerate(blocks.leaves.params)])
  return row_state_tree, row_params


def _write_back(blocks: _Blocks, old: Any, new: Any, pos: Optional[int]
                ) -> Any:
  """The new state leaf: the table a rule wrote itself, else `new`'s rows
  written into `old` (`new` itself for a leaf that mirrors no table)."""
  if pos is None:
    return new
  table = blocks.context.written(new)  # the rule wrote the whole table itself
  if table is not None:
    return table
  return _put_back(old, new, blocks.rows[pos], blocks.moves(pos))


def _new_state(blocks: _Blocks, state: Any, new_row_state: Any,
               owners: list[Optional[int]]) -> Any:
  """`state` with the rows `tx.update` returned written back."""
  state_leaves, state_def = jax.tree.flatten(state)
  return jax.tree.unflatten(state_def, [
      _write_back(blocks, o, n, pos) for o, n, pos in zip(
          state_leaves, jax.tree.leaves(new_row_state), owners)])


def _record_unfused(blocks: _Blocks, owners: list[Optional[int]]) -> None:
  """Records `tx`'s generic update for each table no rule reported on."""
  for pos, row in blocks.rows.items():
    name = blocks.leaves.names[pos]
    if row.ids is not None and name not in blocks.context.chosen:
      blocks.context.record(row_context.Choice(
          name, 'tx', 'generic',
          (_NO_RULE if pos in owners else 'no state rows: only the update rows')
          + _moves_note(blocks.moves(pos))))


def _trace(inner: Any, find_owners: Any, leaves: _Leaves, state: Any,
           params: Any, extra_args: dict[str, Any], skip_zero_rows: bool,
           plan: Optional[_Plan]) -> tuple[Any, Any, row_context.RowContext]:
  """`inner.update` on the touched rows: gather, update, write back.

  With `plan` None this is `lazy`'s probe: the blocks carry no backend and
  the rules report what they ask for.
  """
  moves = plan.tables if plan is not None else None
  rows, row_grads = _row_leaves(leaves, skip_zero_rows, moves)
  rows, seen = _gated(rows, leaves.grads)
  owners = _state_owners(find_owners, leaves, list(rows), state)
  # Nested in another `lazy` (or in `explain_update`): the outer context
  # stays reachable through this one.
  context = row_context.RowContext(row_context.context_of(extra_args))
  blocks = _Blocks(leaves, rows, plan, context)
  row_state_tree, row_params = _row_inputs(blocks, state, owners, params)
  new_updates, new_row_state = inner.update(
      leaves.treedef.unflatten(row_grads), row_state_tree, row_params,
      **{**extra_args, row_context.ROWS_KEY: context})
  new_state = _new_state(blocks, state, new_row_state, owners)
  _note_writes(state, new_state, owners, rows, seen)
  _record_unfused(blocks, owners)
  return (_row_updates(leaves, rows, new_updates, context),
          new_state, context)


def _moves_note(move: Optional[_backend.Backend]) -> str:
  if move is None:
    return ''
  return (' (rows moved by the C++ kernels on CPU)' if move.row_kernels
          else ' (rows moved by XLA)')


def lazy(
    tx: optax.GradientTransformation,
    *,
    skip_zero_rows: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Makes any optax transformation lazy: it updates only the touched rows.

  For every gradient leaf that is a `SparseRows`, the ids are deduplicated
  (duplicates summed), the touched rows of the parameter and of every state
  leaf that mirrors it (`mu`, `nu`, traces, accumulators) are gathered, `tx`
  runs on those small row blocks, and the new state rows are written back.
  Rows the batch did not touch, in the parameters and in the state, stay
  bit-for-bit unchanged. Scalar state such as `count` advances once per step
  exactly as in `tx`, so bias corrections use the global step. The update for
  a `SparseRows` leaf is a `SparseRows` (apply it with `apply_updates` or
  `optax.apply_updates`). Dense gradient leaves go to `tx` unchanged.

  The state is `tx`'s own state, so `lazy(optax.adam(...))` and
  `optax.adam(...)` states are interchangeable.

  `tx.update` gets the caller's extra arguments and one more,
  `lazy_optax_rows=`: the row blocks' context, through which lazy_optax's
  rules inside `tx` find their tables and run the update `lazy` decided
  for them. optax's wrappers forward it; a wrapper that drops extra
  arguments (a plain `optax.GradientTransformation` around a rule) leaves
  that rule its arithmetic on the gathered rows (`explain_update` says
  so). A transformation of yours that takes `**extra_args` receives it
  too, and should ignore it.

  Transformations that look across rows (global-norm clipping, for example)
  see the touched rows only; the unused padding slots hold zero gradients, so
  a global norm equals that of the summed dense gradient.

  Args:
    tx: any `optax.GradientTransformation` whose parameter-shaped state
      mirrors the parameters row for row.
    skip_zero_rows: also treat dense gradient leaves lazily: a row whose
      gradient is entirely zero counts as untouched, so neither it nor its
      state rows change. Meant for models whose embedding gradients arrive
      dense from `jax.grad`; it still costs O(table) per step (the gradient
      is dense). Caveat: a row that the batch did touch but whose gradient is
      exactly zero is skipped too.
    impl: how each table's rows are moved and updated: `'auto'` (the C++
      kernels where the table lives on one CPU device, or the rule's kernel
      per shard on an Explicit mesh; XLA elsewhere), `'xla'` or
      `'generic'` (XLA's ops only: no C++ call for the deduplication, the
      gathers, the write-back or the update's scatter-add) or
      `'cpu_kernel'` (an error where no kernel can run). A lazy_optax rule
      inside `tx` whose own `impl=` is not `'auto'` decides for itself; an
      `'xla'` or `'generic'` from either side keeps the table's row moves
      off the C++ kernels. `explain_update` tells what each table got.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `tx`'s state.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((6, 2))}
    >>> tx = lazy_optax.lazy(optax.adam(0.1))
    >>> state = tx.init(params)
    >>> grads = {'table': lazy_optax.SparseRows(jnp.array([1, 1]),
    ...                                         jnp.ones((2, 2)), num_rows=6)}
    >>> updates, state = tx.update(grads, state, params)
    >>> params = lazy_optax.apply_updates(params, updates)
    >>> params['table'][:3]
    Array([[ 0. ,  0. ],
           [-0.1, -0.1],
           [ 0. ,  0. ]], dtype=float32)
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
        'lazy() takes an optax.GradientTransformation (something with init '
        f'and update, such as optax.adam(1e-3)), got {type(tx).__name__}.')
  validate.impl_argument(impl, 'lazy')
  inner = optax.with_extra_args_support(tx)
  find_owners = row_state.OwnerCache(inner.init)
  probes = _ProbeCache()

  def init_fn(params):
    cpu_kernels.load_for(params)
    return inner.init(params)

  def run(leaves, state, params, extra_args, plan):
    return _trace(inner, find_owners, leaves, state, params, extra_args,
                  skip_zero_rows, plan)

  def update_fn(updates, state, params=None, **extra_args):
    leaves = _flatten(updates, params)
    _check_dense_tables(leaves, skip_zero_rows, extra_args)
    if not any(isinstance(g, SparseRows) for g in leaves.grads):
      # Dense leaves only: checked, and row-lazy with skip_zero_rows.
      if not _row_leaves(leaves, skip_zero_rows, None)[0]:
        return inner.update(updates, state, params, **extra_args)
      new_updates, new_state, _ = run(leaves, state, params, extra_args,
                                      None)
      return new_updates, new_state
    requests, lost = probes(
        lambda: run(leaves, state, params, extra_args, None)[2],
        (updates, state, params, sorted(extra_args)))
    plan = _decide(leaves, state, impl, requests, lost, find_owners)
    new_updates, new_state, context = run(leaves, state, params, extra_args,
                                          plan)
    context.publish()
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init=init_fn,
                                               update=update_fn)
