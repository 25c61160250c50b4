"""Labels from parameter paths, for `optax.partition` with `SparseRows`."""

from __future__ import annotations

from typing import Callable, Hashable

import chex
import jax
import optax

from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows


def path_labels(
    label_of: Callable[[str], Hashable],
) -> Callable[[optax.Params], chex.ArrayTree]:
  """A label function for `optax.partition` that labels leaves by path.

  `optax.partition` calls a callable label function on the parameters at
  `init` and on the gradients at `update`. A `SparseRows` gradient is itself
  a small tree (ids and values), so a label function written with a plain
  `jax.tree.map` would label its ids and its values separately, and one that
  looks at shapes or dtypes would see different things at `init` and
  `update`. The function returned here labels every parameter, and every
  `SparseRows` as a single leaf, from its path alone, so `init` and `update`
  agree.

  Args:
    label_of: maps a parameter's path name (keys joined by `/`, e.g.
      `'emb/table'`; see `path_name`) to its label.

  Returns:
    A callable taking a tree of parameters or gradients and returning the
    tree of labels, with one label per parameter.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> params = {'emb': {'table': jnp.zeros((100, 4))}, 'w': jnp.zeros(4)}
    >>> labels = lazy_optax.tree.path_labels(
    ...     lambda name: 'lazy' if name.startswith('emb/') else 'dense')
    >>> tx = optax.partition({'lazy': lazy_optax.lazy_adam(1e-3),
    ...                       'dense': optax.adamw(1e-3)}, labels)
    >>> state = tx.init(params)
    >>> grads = {'emb': {'table': lazy_optax.SparseRows(jnp.array([5]),
    ...                                                 jnp.ones((1, 4)), 100)},
    ...          'w': jnp.ones(4)}
    >>> updates, state = tx.update(grads, state, params)
    >>> updates['emb']['table']
    SparseRows(num_rows=100, ids=1, row_shape=(4,), dtype=float32)
  """
  if not callable(label_of):
    raise TypeError(
        'path_labels takes a function from a path name to a label, got '
        f'{type(label_of).__name__}.')

  def labels(tree: optax.Params) -> chex.ArrayTree:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: label_of(path_name(path)), tree,
        is_leaf=is_sparse_rows)

  return labels
