"""`lazy(tx)`: any optax transformation, applied to the touched rows only."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import checks as _checks
from lazy_optax._src import row_state
from lazy_optax._src import sharding as _sharding
from lazy_optax._src.sparse_rows import SparseRows, deduplicate, is_sparse_rows


class _RowLeaf(NamedTuple):
  """How one row-lazy gradient leaf is updated."""
  ids: Optional[jax.Array]       # unique ids (SparseRows) or None
  row_mask: Optional[jax.Array]  # rows touched (dense, skip_zero_rows) or None


def _shape_struct(x: Any, path: str) -> jax.ShapeDtypeStruct:
  if isinstance(x, SparseRows):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if not hasattr(x, 'shape') or not hasattr(x, 'dtype'):
    x = jnp.asarray(x)
  return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def _check_sparse_leaf(grad: SparseRows, param: Any, path: str) -> None:
  _checks.check_sparse_gradient(grad, param, path)
  if not jnp.issubdtype(grad.values.dtype, jnp.inexact):
    raise TypeError(
        f'Gradient for parameter {path} is a SparseRows with values of dtype '
        f'{grad.values.dtype}; gradients must be floating point.')
  if param is None:
    return
  shape = tuple(getattr(param, 'shape', ()))
  if len(shape) < 1:
    raise ValueError(
        f'Parameter {path} has shape {shape}: a SparseRows gradient needs a '
        'parameter of at least one dimension (its rows).')
  if shape[0] != grad.num_rows:
    raise ValueError(
        f'Parameter {path} has {shape[0]} rows but its SparseRows gradient '
        f'says num_rows={grad.num_rows}.')
  if shape[1:] != grad.row_shape:
    raise ValueError(
        f'Parameter {path} has rows of shape {shape[1:]} but its SparseRows '
        f'gradient has rows of shape {grad.row_shape}.')


def _gather_rows(leaf: jax.Array, ids: jax.Array) -> jax.Array:
  # Unused slots hold id `num_rows`: they read zeros.
  return leaf.at[ids].get(mode='fill', fill_value=0,
                          **_sharding.gather_kwargs(leaf))


def _broadcast_rows(mask: jax.Array, like: jax.Array) -> jax.Array:
  return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


def _touched_rows(grad: jax.Array) -> jax.Array:
  if grad.ndim == 1:
    return grad != 0
  return jnp.any(grad != 0, axis=tuple(range(1, grad.ndim)))


def lazy(
    tx: optax.GradientTransformation,
    *,
    skip_zero_rows: bool = False,
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
  inner = optax.with_extra_args_support(tx)

  def init_fn(params):
    return inner.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        updates, is_leaf=is_sparse_rows)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    grads = [g for _, g in flat]
    param_leaves: list[Any] = [None] * len(grads)
    if params is not None:
      try:
        param_leaves = treedef.flatten_up_to(params)
      except (ValueError, TypeError) as e:
        raise ValueError(
            'params and gradients have different tree structures: '
            f'{_checks.tree_difference(updates, params)}.') from e

    rows: dict[int, _RowLeaf] = {}
    row_grads = list(grads)
    for i, g in enumerate(grads):
      if isinstance(g, SparseRows):
        _check_sparse_leaf(g, param_leaves[i], paths[i])
        unique = deduplicate(g)
        rows[i] = _RowLeaf(unique.ids, None)
        row_grads[i] = unique.values
      elif hasattr(g, 'dtype') and not jnp.issubdtype(g.dtype, jnp.inexact):
        raise TypeError(
            f'Gradient for parameter {paths[i]} has dtype {g.dtype}; '
            'gradients must be floating point.')
      elif skip_zero_rows and jnp.ndim(g) >= 1:
        rows[i] = _RowLeaf(None, _touched_rows(jnp.asarray(g)))
    if not rows:
      return inner.update(updates, state, params, **extra_args)
    sparse_paths = [paths[i] for i, r in rows.items() if r.ids is not None]
    if sparse_paths:  # a plain optax transformation must not see SparseRows
      _checks.check_chain_neighbours(sparse_paths)

    shapes = [_shape_struct(g, p) for g, p in zip(grads, paths)]
    owners = row_state.row_owners(
        inner.init, shapes, treedef.unflatten, list(rows), state)
    state_leaves, state_def = jax.tree.flatten(state)

    def gather(leaf, pos):
      if pos is None or rows[pos].ids is None:
        return leaf
      return _gather_rows(leaf, rows[pos].ids)

    row_state_tree = state_def.unflatten(
        [gather(s, o) for s, o in zip(state_leaves, owners)])
    row_params = None
    if params is not None:
      row_params = treedef.unflatten([
          gather(p, i) if i in rows else p
          for i, p in enumerate(param_leaves)])
    new_updates, new_row_state = inner.update(
        treedef.unflatten(row_grads), row_state_tree, row_params, **extra_args)

    def put_back(old, new, pos):
      if pos is None:
        return new
      leaf = rows[pos]
      if leaf.ids is not None:
        return old.at[leaf.ids].set(new.astype(old.dtype), mode='drop',
                                    **_sharding.scatter_kwargs(old))
      return jnp.where(_broadcast_rows(leaf.row_mask, old), new, old)

    new_state = state_def.unflatten([
        put_back(o, n, pos) for o, n, pos in zip(
            state_leaves, jax.tree.leaves(new_row_state), owners)])

    out = treedef.flatten_up_to(new_updates)
    for i, leaf in rows.items():
      if leaf.ids is not None:
        out[i] = SparseRows.from_unique(leaf.ids, out[i], grads[i].num_rows)
      else:
        out[i] = jnp.where(_broadcast_rows(leaf.row_mask, out[i]), out[i],
                           jnp.zeros_like(out[i]))
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
