"""`multi_steps`: accumulate k steps of row-sparse gradients, then update."""

from __future__ import annotations

from typing import cast, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import optax

from lazy_optax._src import branching
from lazy_optax._src import row_context
from lazy_optax._src import row_state
from lazy_optax._src.id_code import index_dtype
from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows


class RowBuffer(NamedTuple):
  """A table's accumulated rows: `k x ids per step` slots, filled in turn.

  Attributes:
    ids: int `[k * n]`, the row id of each slot; `num_rows` (no row) in a
      slot not filled yet.
    values: `[k * n, *row_shape]`, the (scaled) gradient rows.
  """
  ids: jax.Array
  values: jax.Array


class MultiStepsState(NamedTuple):
  """State of `multi_steps`.

  Attributes:
    mini_step: int32, steps accumulated since the last update (0 to k - 1).
    gradient_step: int32, updates made so far.
    inner_state: the wrapped transformation's state.
    acc: the accumulated gradients: a dense leaf per dense parameter, and a
      `RowBuffer` of `k x ids per step` rows per table.
  """
  mini_step: jax.Array
  gradient_step: jax.Array
  inner_state: optax.OptState
  acc: optax.Updates


def _is_leaf(x: object) -> bool:
  """Where the tree maps stop: at `None`, a `SparseRows` or a `RowBuffer`."""
  return x is None or is_sparse_rows(x) or isinstance(x, RowBuffer)


def _emptied(acc: Optional[jax.Array | RowBuffer],
             grad: Optional[ArrayLike | SparseRows],
             emit: jax.Array) -> Optional[jax.Array | RowBuffer]:
  """`acc` as it is, or, on an update step, with nothing accumulated."""
  if acc is None:
    return None
  if isinstance(acc, RowBuffer):
    # A `RowBuffer`'s gradient is a `SparseRows`: `_add_rows` checked it.
    num_rows = cast(SparseRows, grad).num_rows
    return RowBuffer(
        jnp.where(emit, jnp.asarray(num_rows, acc.ids.dtype), acc.ids),
        jnp.where(emit, jnp.zeros_like(acc.values), acc.values))
  return jnp.where(emit, jnp.zeros_like(acc), acc)


def _empty_acc(params: optax.Params, ids_per_step: Mapping[str, int],
               every_k: int) -> optax.Updates:
  """The accumulators of `params`, all empty: a `RowBuffer` per table.

  Raises:
    ValueError: if `ids_per_step` names a path that is not a parameter's.
  """
  found = set()

  def acc_for(path, p):
    if p is None:
      return None
    name = path_name(path)
    if name in ids_per_step:  # `every_k * n` unfilled slots
      found.add(name)
      size, num_rows = every_k * ids_per_step[name], int(jnp.shape(p)[0])
      return RowBuffer(
          jnp.full((size,), num_rows, index_dtype(num_rows)),
          jnp.zeros((size, *jnp.shape(p)[1:]), jnp.result_type(p)))
    return jnp.zeros(jnp.shape(p), jnp.result_type(p))

  acc = jax.tree_util.tree_map_with_path(acc_for, params,
                                         is_leaf=lambda x: x is None)
  missing = sorted(set(ids_per_step) - found)
  if missing:
    names = [path_name(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    raise ValueError(
        f'multi_steps: ids_per_step names {missing}, which are not '
        f'parameter paths; parameters: {names}.')
  return acc


def _add_dense(path: jax.tree_util.KeyPath, acc: jax.Array,
               g: ArrayLike | SparseRows, scale: float) -> jax.Array:
  """A dense parameter's accumulator `acc` plus its gradient `g`, scaled."""
  if isinstance(g, SparseRows):
    name = path_name(path)
    raise ValueError(
        f'multi_steps: parameter {name} gets SparseRows gradients but '
        f'ids_per_step does not name it, so its accumulator would be '
        f'dense and rows absent from a window would move as well. Add '
        f'{name!r}: <ids per step> to ids_per_step.')
  return acc + jnp.asarray(g) * scale


def _add_rows(path: jax.tree_util.KeyPath, buf: RowBuffer,
              g: ArrayLike | SparseRows, slot: jax.Array, every_k: int,
              scale: float) -> RowBuffer:
  """`buf` with the `SparseRows` `g`, scaled, in rows `slot * n` on."""
  name = path_name(path)
  n = buf.ids.shape[0] // every_k
  if not isinstance(g, SparseRows) or g.num_ids != n:
    got = (f'a SparseRows of {g.num_ids} ids' if isinstance(g, SparseRows)
           else 'a dense gradient')
    raise ValueError(
        f'multi_steps was set up for SparseRows gradients of {n} ids per '
        f'step for parameter {name}, got {got}.')
  g.check(f'parameter {name}')
  start = slot * n
  ids = jax.lax.dynamic_update_slice_in_dim(
      buf.ids, g.safe_ids(f'parameter {name}').astype(buf.ids.dtype),
      start, 0)
  values = jax.lax.dynamic_update_slice_in_dim(
      buf.values, (g.values * scale).astype(buf.values.dtype), start, 0)
  return RowBuffer(ids, values)


def _added(acc: optax.Updates, updates: optax.Updates, slot: jax.Array,
           every_k: int, use_grad_mean: bool) -> optax.Updates:
  """`acc` plus one step's `updates` (scaled by `1 / every_k` for a mean)."""
  scale = 1.0 / every_k if use_grad_mean else 1.0

  def add(path, a, g):
    if a is None:
      return None
    if isinstance(a, RowBuffer):
      return _add_rows(path, a, g, slot, every_k, scale)
    return _add_dense(path, a, g, scale)

  return jax.tree_util.tree_map_with_path(add, acc, updates, is_leaf=_is_leaf)


def _accumulated_grads(acc: optax.Updates,
                       updates: optax.Updates) -> optax.Updates:
  """The gradients `tx` gets: `acc`, a `SparseRows` per `RowBuffer`."""
  return jax.tree.map(
      lambda a, g: SparseRows.from_unique(a.ids, a.values, g.num_rows)
      if isinstance(a, RowBuffer) else a, acc, updates, is_leaf=_is_leaf)


def _params_like(acc: optax.Updates, updates: optax.Updates) -> optax.Params:
  """Shape structs of the parameters (a table's rows: its gradient's)."""

  def struct(a, g):
    if a is None:
      return None
    if isinstance(a, RowBuffer):
      return jax.ShapeDtypeStruct((g.num_rows, *a.values.shape[1:]),
                                  a.values.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))

  return jax.tree.map(struct, acc, updates, is_leaf=_is_leaf)


def _table_leaves(inner: optax.GradientTransformationExtraArgs,
                  acc: optax.Updates, updates: optax.Updates,
                  inner_state: optax.OptState
                  ) -> Optional[tuple[list[bool], set[str]]]:
  """Which leaves of `tx`'s state mirror a table, and the tables' names.

  None where `row_state.row_owners` refuses the state.
  """
  shapes, treedef = jax.tree.flatten(_params_like(acc, updates))
  paths = jax.tree_util.tree_leaves_with_path(
      acc, is_leaf=lambda x: isinstance(x, RowBuffer))
  names = [path_name(path) for path, _ in paths]
  tables = [i for i, (_, a) in enumerate(paths) if isinstance(a, RowBuffer)]
  try:
    owners = row_state.row_owners(
        inner.init, shapes, lambda leaves: jax.tree.unflatten(treedef, leaves),
        tables, inner_state)
  except ValueError:
    return None
  return ([o is not None for o in owners],
          {names[o] for o in owners if o is not None})


def _lazy_choices(inner: optax.GradientTransformationExtraArgs,
                  acc: optax.Updates, updates: optax.Updates,
                  inner_state: optax.OptState, params: Optional[optax.Params],
                  extra_args: Mapping[str, object]
                  ) -> dict[str, row_context.Choice]:
  """What each `lazy(...)` inside `tx` chooses for its tables, by
  parameter (traced abstractly, as `explain_update` does; never
  reported)."""
  log: list[row_context.Choice] = []
  args = {k: v for k, v in extra_args.items() if k != row_context.ROWS_KEY}
  args[row_context.ROWS_KEY] = row_context.Rows(log=log)
  jax.eval_shape(lambda: inner.update(_accumulated_grads(acc, updates),
                                      inner_state, params, **args))
  return {choice.parameter: choice for choice in log}


def _select(emit: jax.Array, new: jax.Array,
            old: Optional[jax.Array] = None) -> jax.Array:
  """`new` if `emit`, else `old` or zeros (key arrays through their data)."""
  if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(new)
    other = jnp.zeros_like(data) if old is None else jax.random.key_data(old)
    return jax.random.wrap_key_data(jnp.where(emit, data, other),
                                    impl=jax.random.key_impl(new))
  return jnp.where(emit, new, jnp.zeros_like(new) if old is None else old)


def _update_if(emit: jax.Array, inner: optax.GradientTransformationExtraArgs,
               acc: optax.Updates, updates: optax.Updates,
               inner_state: optax.OptState, params: Optional[optax.Params],
               extra_args: Mapping[str, object]
               ) -> tuple[optax.Updates, optax.OptState]:
  """`tx`'s updates and state if `emit`, else zero updates and `inner_state`.

  A `lax.cond` would copy every table-sized state leaf that XLA's path
  scatters into, so where each belongs to a table of a `lazy(...)`, `tx`
  runs at every step, branch-free, its tables given no row when not
  `emit` (docs/performance.md: where the CPU keeps the `lax.cond`).
  """
  def do_update(_):
    grads = _accumulated_grads(acc, updates)
    return inner.update(grads, inner_state, params, **extra_args)

  def skipping(emit):
    def skip(_):
      shapes = jax.eval_shape(do_update, None)[0]
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      return zeros, inner_state
    return jax.lax.cond(emit, do_update, skip, None)

  found = _table_leaves(inner, acc, updates, inner_state)
  if found is None or not found[1]:
    # No table-sized state (or one that cannot be told apart): the
    # lax.cond skips the dense work, and copies nothing table-sized.
    return skipping(emit)
  flags, owners = found
  choices = _lazy_choices(inner, acc, updates, inner_state, params,
                          extra_args)
  if not owners <= set(choices):
    return skipping(emit)

  def branch_free(emit):
    def no_rows(a, g):
      if not isinstance(a, RowBuffer):
        return a
      return RowBuffer(
          jnp.where(emit, a.ids, jnp.asarray(g.num_rows, a.ids.dtype)),
          a.values)
    masked = jax.tree.map(no_rows, acc, updates, is_leaf=_is_leaf)
    new_updates, new_state = inner.update(
        _accumulated_grads(masked, updates), inner_state, params,
        **extra_args)
    new_leaves, state_def = jax.tree.flatten(new_state)
    kept = [n if table else _select(emit, n, o) for n, o, table in zip(
        new_leaves, jax.tree.leaves(inner_state), flags)]
    # A table's row-sparse update names only rows of the masked gradient:
    # none on a step that does not emit. Dense updates are zeroed.
    zeroed = jax.tree.map(
        lambda n: n if is_sparse_rows(n) else _select(emit, n),
        new_updates, is_leaf=is_sparse_rows)
    return zeroed, jax.tree.unflatten(state_def, kept)

  if any(c.impl == 'xla' for c in choices.values()):
    return branch_free(emit)
  return branching.per_platform(skipping, branch_free, emit)


def _update(inner: optax.GradientTransformationExtraArgs, every_k: int,
            use_grad_mean: bool, updates: optax.Updates,
            state: MultiStepsState, params: Optional[optax.Params],
            extra_args: Mapping[str, object]
            ) -> tuple[optax.Updates, MultiStepsState]:
  """One step: adds `updates`; every `every_k`-th step, updates with `tx`."""
  acc = _added(state.acc, updates, state.mini_step, every_k, use_grad_mean)
  emit = state.mini_step == every_k - 1
  new_updates, inner_state = _update_if(emit, inner, acc, updates,
                                        state.inner_state, params, extra_args)
  acc = jax.tree.map(lambda a, g: _emptied(a, g, emit), acc, updates,
                     is_leaf=_is_leaf)
  return new_updates, MultiStepsState(
      mini_step=(state.mini_step + 1) % every_k,
      gradient_step=jnp.where(emit,
                              optax.safe_increment(state.gradient_step),
                              state.gradient_step),
      inner_state=inner_state, acc=acc)


def multi_steps(
    tx: optax.GradientTransformation,
    every_k: int,
    ids_per_step: Mapping[str, int],
    *,
    use_grad_mean: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates `every_k` steps of gradients, then makes one update with `tx`.

  The row-sparse counterpart of `optax.MultiSteps`, which keeps a dense
  accumulator as large as the parameters (and cannot take `SparseRows`). Here
  each table's accumulator is a `RowBuffer` of `every_k x
  ids_per_step[table]` rows that the steps fill in turn, so memory is
  O(k x batch), not O(table). Dense parameters accumulate densely. On every
  `every_k`-th step `tx` gets the accumulated gradients (their mean if
  `use_grad_mean`, else their sum) and its update is returned; the other
  steps return zero updates (an empty `SparseRows` for tables) and leave
  `tx`'s state as it was.

  Args:
    tx: the transformation to apply every `every_k` steps, usually lazy
      (`lazy_optax.lazy_adam(...)`, `lazy_optax.lazy(...)`).
    every_k: the number of steps to accumulate.
    ids_per_step: for every table that gets `SparseRows` gradients, its path
      name (`'emb/table'`, as `lazy_optax.tree.path_name` writes it) and the
      number of ids its gradient holds each step.
    use_grad_mean: update with the mean of the accumulated gradients (as
      `optax.MultiSteps` does by default) rather than their sum.

  Returns:
    An `optax.GradientTransformationExtraArgs` with a `MultiStepsState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'t': jnp.zeros((10, 2))}
    >>> tx = lazy_optax.wrappers.multi_steps(
    ...     lazy_optax.lazy_adam(0.1), every_k=2, ids_per_step={'t': 3})
    >>> state = tx.init(params)
    >>> for ids in ([1, 2, 2], [5, 1, 1]):
    ...   g = {'t': lazy_optax.SparseRows(jnp.array(ids), jnp.ones((3, 2)), 10)}
    ...   updates, state = tx.update(g, state, params)
    ...   params = lazy_optax.apply_updates(params, updates)
    >>> [float(x) for x in params['t'][:6, 0]]
    [0.0, -0.1, -0.1, 0.0, 0.0, -0.1]
  """
  if not isinstance(every_k, int) or every_k < 1:
    raise ValueError(f'multi_steps: every_k must be an int >= 1, got '
                     f'{every_k!r}.')
  inner = optax.with_extra_args_support(tx)
  wanted = dict(ids_per_step)

  def init_fn(params):
    acc = _empty_acc(params, wanted, every_k)
    return MultiStepsState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
                           inner.init(params), acc)

  def update_fn(updates, state, params=None, **extra_args):
    return _update(inner, every_k, use_grad_mean, updates, state, params,
                   extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
