"""Parameter paths as the names the API takes: `'emb/table'`."""

from __future__ import annotations

import jax


def _key_name(key: object) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: jax.tree_util.KeyPath) -> str:
  """A path of JAX tree keys as a `/`-separated name, e.g. `'emb/table'`.

  A trailing `value` attribute (the array inside a Flax `nnx.Variable`, which
  `nnx.Optimizer` passes to `init` but not to `update`) is left out, so a
  parameter has the same name at `init` and at `update`.

  Args:
    path: a key path, as given by `jax.tree_util.tree_map_with_path`.

  Returns:
    The keys' names joined by `/`.

  Example:
    >>> import jax
    >>> from lazy_optax.tree import path_name
    >>> [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(
    ...     {'emb': {'table': 0}, 'dense': [1, 2]})]
    ['dense/0', 'dense/1', 'emb/table']
  """
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == 'value'):
    path = path[:-1]
  return '/'.join(_key_name(k) for k in path)
