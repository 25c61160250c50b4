"""`lazy(tx)`: any optax transformation, applied to the touched rows only."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import backend as _backend
from lazy_optax._src import cpu_kernels
from lazy_optax._src import damage
from lazy_optax._src import fused
from lazy_optax._src import grads as _grads
from lazy_optax._src import row_context
from lazy_optax._src import row_ops
from lazy_optax._src import row_state
from lazy_optax._src import table_plan
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
  treedef: jax.tree_util.PyTreeDef
  names: list[str]
  grads: list[Union[SparseRows, jax.Array]]
  params: list[Optional[jax.Array]]


def _shape_struct(x: Union[SparseRows, jax.typing.ArrayLike]
                  ) -> jax.ShapeDtypeStruct:
  if isinstance(x, SparseRows):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  shape, dtype = getattr(x, 'shape', None), getattr(x, 'dtype', None)
  if shape is None or dtype is None:
    array = jnp.asarray(x)
    shape, dtype = array.shape, array.dtype
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _sparse(leaves: _Leaves, pos: int) -> SparseRows:
  """The `SparseRows` gradient at `pos` (a position the caller knows)."""
  grad = leaves.grads[pos]
  assert isinstance(grad, SparseRows)
  return grad


def _flatten(updates: optax.Updates, params: Optional[optax.Params]
             ) -> _Leaves:
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      updates, is_leaf=is_sparse_rows)
  grads = [g for _, g in flat]
  param_leaves: list[Optional[jax.Array]] = [None] * len(grads)
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


def check_sparse_leaf(grad: SparseRows, param: Optional[jax.typing.ArrayLike],
                      name: str) -> None:
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
                        extra_args: dict[str, object]) -> None:
  """Refuses a dense gradient for a table that `value_and_grad` gave a
  `SparseRows` (the zeros_like accumulation); `explain_update` is told
  which tables take the dense rule."""
  given = row_context.rows_of(extra_args)
  log = given.log if given is not None else None
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


def _row_leaves(leaves: _Leaves, skip_zero_rows: bool,
                backends: Optional[dict[int, _backend.Backend]]
                ) -> tuple[dict[int, _RowLeaf],
                           list[Union[SparseRows, jax.Array]]]:
  """Which leaves are updated row by row, and the gradients `tx` sees."""
  rows: dict[int, _RowLeaf] = {}
  row_grads = list(leaves.grads)
  for i, (g, name) in enumerate(zip(leaves.grads, leaves.names)):
    if isinstance(g, SparseRows):  # checked by `_trace` already
      ids, values = distinct_rows(g, f'parameter {name}',
                                  backends.get(i) if backends else None)
      rows[i] = _RowLeaf(ids, None)
      row_grads[i] = values
    elif hasattr(g, 'dtype'):
      validate.floating(g.dtype, f'Gradient for parameter {name}')
    if skip_zero_rows and not isinstance(g, SparseRows) and jnp.ndim(g) >= 1:
      nonzero = jnp.asarray(g) != 0
      rows[i] = _RowLeaf(None, jnp.any(nonzero, axis=tuple(
          range(1, nonzero.ndim))) if nonzero.ndim > 1 else nonzero)
  return rows, row_grads


def _gated(rows: dict[int, _RowLeaf], leaves: _Leaves
           ) -> tuple[dict[int, _RowLeaf], Optional[int]]:
  """`rows` whose ids name no row if a check of the step helper failed
  (`damage.gate`: all of this update's gradients are checked by now), and
  how many checks they saw."""
  seen = None
  for i, row in rows.items():
    if row.ids is not None:
      ids, seen = damage.gate(row.ids, _sparse(leaves, i).num_rows)
      rows[i] = row._replace(ids=ids)
  return rows, seen


def _note_writes(state: optax.OptState, new_state: optax.OptState,
                 owners: list[Optional[int]],
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
                 new_updates: optax.Updates) -> optax.Updates:
  out = leaves.treedef.flatten_up_to(new_updates)
  for i, row in rows.items():
    if row.ids is not None:
      out[i] = SparseRows.from_unique(
          row.ids, out[i], _sparse(leaves, i).num_rows, distinct=True)
    else:
      assert row.row_mask is not None
      out[i] = jnp.where(broadcast_rows(row.row_mask, out[i]), out[i],
                         jnp.zeros_like(out[i]))
  return leaves.treedef.unflatten(out)


class _Blocks(NamedTuple):
  """One trace's row blocks, and the plan that moves them."""
  leaves: _Leaves
  rows: dict[int, _RowLeaf]             # the row-lazy leaves, by position
  plan: Optional[table_plan.Plan]       # None for dense leaves only

  def moves(self, pos: int) -> Optional[_backend.Backend]:
    return self.plan.moves.get(pos) if self.plan is not None else None


def _at_rows(blocks: _Blocks, leaf: Optional[jax.Array],
             pos: Optional[int], index: Optional[int] = None
             ) -> Union[None, jax.Array, fused.TableRows]:
  """`leaf` at the touched rows of the table at `pos` (the leaf itself for
  None); a declared rule's table handed whole (`fused.TableRows`) where
  the plan says so."""
  if pos is None or leaf is None:
    return leaf
  row = blocks.rows[pos]
  plan = blocks.plan
  if plan is not None and index in plan.tabled and row.ids is not None:
    decided, rule = plan.tabled[index]
    return fused.TableRows(leaf, row.ids, decided, rule,
                           blocks.leaves.names[pos])
  return _gather(leaf, row, blocks.moves(pos))


def _row_inputs(blocks: _Blocks, state: optax.OptState,
                owners: list[Optional[int]], params: Optional[optax.Params]
                ) -> tuple[optax.OptState, Optional[optax.Params]]:
  """The state and parameters `tx.update` sees: each leaf that mirrors a
  table at its touched rows (the state first)."""
  state_leaves, state_def = jax.tree.flatten(state)
  row_state_tree = jax.tree.unflatten(state_def, [
      _at_rows(blocks, s, o, i)
      for i, (s, o) in enumerate(zip(state_leaves, owners))])
  row_params = None
  if params is not None:
    row_params = blocks.leaves.treedef.unflatten(
        [_at_rows(blocks, p, i if i in blocks.rows else None)
         for i, p in enumerate(blocks.leaves.params)])
  return row_state_tree, row_params


def _write_back(blocks: _Blocks, old: jax.Array,
                new: Union[jax.Array, fused.TableRows], pos: Optional[int]
                ) -> jax.Array:
  """The new state leaf: the table a rule wrote itself, else `new`'s rows
  written into `old` (`new` itself for a leaf that mirrors no table)."""
  if isinstance(new, fused.TableRows):
    return new.table
  if pos is None:
    return new
  return _put_back(old, new, blocks.rows[pos], blocks.moves(pos))


def _new_state(blocks: _Blocks, state: optax.OptState,
               new_row_state: optax.OptState, owners: list[Optional[int]]
               ) -> optax.OptState:
  """`state` with the rows `tx.update` returned written back."""
  state_leaves, state_def = jax.tree.flatten(state)
  new_leaves = jax.tree.leaves(new_row_state, is_leaf=fused.is_table_rows)
  return jax.tree.unflatten(state_def, [
      _write_back(blocks, o, n, pos)
      for o, n, pos in zip(state_leaves, new_leaves, owners)])


def _ids_tree(leaves: _Leaves, rows: dict[int, _RowLeaf]
              ) -> optax.Updates:
  out: list[Optional[row_context.TableIds]] = [None] * len(leaves.grads)
  for i, row in rows.items():
    if row.ids is not None:
      out[i] = row_context.TableIds(row.ids, _sparse(leaves, i).num_rows)
  return leaves.treedef.unflatten(out)


def _trace(inner: optax.GradientTransformationExtraArgs,
           find_owners: row_state.OwnerCache, leaves: _Leaves,
           state: optax.OptState, params: Optional[optax.Params],
           extra_args: dict[str, object], skip_zero_rows: bool,
           impl: str) -> tuple[optax.Updates, optax.OptState]:
  """`inner.update` on the touched rows: decide, gather, update, write
  back (one trace of `inner.update`)."""
  sparse = [i for i, g in enumerate(leaves.grads)
            if isinstance(g, SparseRows)]
  for i in sparse:  # before the state is read: its messages name the cause
    check_sparse_leaf(_sparse(leaves, i), leaves.params[i], leaves.names[i])
  plan = (table_plan.decide(
      {i: table_plan.Table(leaves.names[i], _sparse(leaves, i),
                           leaves.params[i])
       for i in sparse}, state,
      _state_owners(find_owners, leaves, sparse, state), impl)
          if sparse else None)
  rows, row_grads = _row_leaves(
      leaves, skip_zero_rows, plan.moves if plan is not None else None)
  rows, seen = _gated(rows, leaves)
  owners = _state_owners(find_owners, leaves, list(rows), state)
  blocks = _Blocks(leaves, rows, plan)
  row_state_tree, row_params = _row_inputs(blocks, state, owners, params)
  given = row_context.rows_of(extra_args)
  new_updates, new_row_state = inner.update(
      leaves.treedef.unflatten(row_grads), row_state_tree, row_params,
      **{**extra_args, row_context.ROWS_KEY: row_context.Rows(
          _ids_tree(leaves, rows))})
  new_state = _new_state(blocks, state, new_row_state, owners)
  _note_writes(state, new_state, owners, rows, seen)
  if plan is not None and given is not None and given.log is not None:
    table_plan.report(plan, new_row_state, given.log)
  return _row_updates(leaves, rows, new_updates), new_state


def _state_owners(find_owners: row_state.OwnerCache, leaves: _Leaves,
                  positions: list[int], state: optax.OptState
                  ) -> list[Optional[int]]:
  """Per state leaf, the position of the table it mirrors (None: none), among
  the tables at `positions` (`row_state.OwnerCache`)."""
  return find_owners(
      param_shapes=[_shape_struct(g) for g in leaves.grads],
      rebuild_params=leaves.treedef.unflatten,
      row_param_positions=positions, state=state)


def _narrow(state: optax.OptState, impl: str) -> optax.OptState:
  """The tables an outer `lazy` handed over whole, as this `lazy`'s
  `impl=` narrows them (a `lazy` nested in another)."""
  if impl == 'auto':
    return state
  return jax.tree.map(
      lambda t: t.replace(t.table, fused.narrowed(
          t.backend, impl, lambda: _backend.decide(
              t.table, impl, subject='lazy', name=t.name)))
      if isinstance(t, fused.TableRows) else t,
      state, is_leaf=fused.is_table_rows)


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

  `lazy` decides how each table's rows move and how each lazy_optax rule
  inside `tx` updates them (the rules declare their state types,
  `fused.declare`) before it traces `tx.update`, once. A rule gets its
  tables whole in its state (`fused.TableRows`), whatever wrappers lie
  between; a wrapper that rebuilds its state under a `lax.cond`
  (`optax.apply_if_finite`) leaves it its arithmetic on the gathered rows.
  `tx.update` gets the caller's extra arguments and one more,
  `lazy_optax_rows=` (the row ids, `row_context.Rows`): a transformation
  of yours that takes `**extra_args` receives it too, and should ignore
  it.

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
      inside `tx` whose own `impl=` is not `'auto'` narrows that for its
      tables (`'xla'` or `'generic'` replace its kernel); the row moves
      follow this `impl=`. `explain_update` tells what each table got.

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

  def init_fn(params):
    cpu_kernels.load_for(params)
    return inner.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    leaves = _flatten(updates, params)
    _check_dense_tables(leaves, skip_zero_rows, extra_args)
    if (not any(isinstance(g, SparseRows) for g in leaves.grads)
        and not _row_leaves(leaves, skip_zero_rows, None)[0]):
      # Dense leaves only (or the row blocks of an outer `lazy`).
      return inner.update(updates, _narrow(state, impl), params,
                          **extra_args)
    return _trace(inner, find_owners, leaves, state, params, extra_args,
                  skip_zero_rows, impl)

  return optax.GradientTransformationExtraArgs(init=init_fn,
                                               update=update_fn)
