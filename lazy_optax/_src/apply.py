"""Adding dense and row-sparse updates to parameters."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import optax

from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import SparseRows


def _add(path: jax.tree_util.KeyPath, param: Optional[ArrayLike],
         update: ArrayLike | SparseRows) -> Optional[jax.Array]:
  if param is None:
    return None
  where = f'parameter {path_name(path)}'
  param = jnp.asarray(param)
  if isinstance(update, SparseRows):
    return update.add_to(param, where)
  update = jnp.asarray(update)
  if tuple(update.shape) != tuple(param.shape):
    raise ValueError(
        f'Parameter {path_name(path)} has shape {tuple(param.shape)} but its '
        f'update has shape {tuple(update.shape)}.')
  return (param + update).astype(param.dtype)


def apply_updates(params: optax.Params,
                  updates: optax.Updates) -> optax.Params:
  """Adds updates to parameters; a `SparseRows` update adds its rows only.

  Like `optax.apply_updates`, but shapes are checked (no silent broadcasting)
  and a `SparseRows` update is a scatter-add onto its rows, so the other rows
  of the table are not touched. `optax.apply_updates` gives the same result,
  since a `SparseRows` knows how to add itself to an array. Under `jax.jit`
  with the parameters donated, XLA updates the table in place.

  Args:
    params: a tree of parameters.
    updates: a tree of updates of the same structure, where a table's leaf
      may be a `SparseRows`.

  Returns:
    The updated parameters, with the structure, shapes and dtypes of
    `params`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((4, 2)), 'bias': jnp.zeros(2)}
    >>> updates = {'table': lazy_optax.SparseRows(jnp.array([3]),
    ...                                           jnp.ones((1, 2)), 4),
    ...            'bias': jnp.ones(2)}
    >>> lazy_optax.apply_updates(params, updates)['table'][3]
    Array([1., 1.], dtype=float32)
  """
  return jax.tree_util.tree_map_with_path(
      _add, params, updates, is_leaf=lambda x: x is None)
