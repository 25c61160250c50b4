"""Saying where two trees that should match differ, by parameter path."""

from __future__ import annotations

import chex
import jax

from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows


def _paths(tree: chex.ArrayTree) -> list[str]:
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sparse_rows)
  return [path_name(p) for p, _ in flat[0]]


def describe(a: chex.ArrayTree, b: chex.ArrayTree,
             a_name: str = 'the gradients',
             b_name: str = 'the parameters') -> str:
  """A phrase naming where `a` and `b` differ.

  Args:
    a: one tree (`SparseRows` count as leaves).
    b: the other tree.
    a_name: what `a` is, for the message.
    b_name: what `b` is, for the message.

  Returns:
    The first path found only in `a` and the first found only in `b`, or
    both tree structures when the paths agree.

  Example:
    >>> from lazy_optax._src.tree_diff import describe
    >>> describe({'a': 1, 'b': 2}, {'a': 1})
    '1 path(s) only in the gradients, first b'
  """
  a_paths, b_paths = _paths(a), _paths(b)
  only_a = [p for p in a_paths if p not in set(b_paths)]
  only_b = [p for p in b_paths if p not in set(a_paths)]
  parts = [f'{len(only)} path(s) only in {name}, first {only[0]}'
           for only, name in ((only_a, a_name), (only_b, b_name)) if only]
  if not parts:
    return (f'{a_name} are {jax.tree.structure(a, is_leaf=is_sparse_rows)}, '
            f'{b_name} are {jax.tree.structure(b, is_leaf=is_sparse_rows)}')
  return '; '.join(parts)
