"""A rule's `scale_by_X` form: the bare rule, as optax's `scale_by_adam` is.

`scale_by_lazy_adam()` and the other `scale_by_X` return the rule itself,
without `lazy(...)`: inside a `lazy(...)` (`lazy_adam` is
`lazy(optax.chain(scale_by_lazy_adam(), optax.scale_by_learning_rate(lr)))`)
it updates the touched rows; on a dense gradient it updates every row, as
the dense rule does. Before 0.2 `scale_by_X` returned `lazy(rule)`; a
`SparseRows` gradient that reaches the bare rule outside `lazy(...)` still
takes that path, with a `DeprecationWarning`, until 0.3.
"""

from __future__ import annotations

import warnings

import jax
import optax

from lazy_optax._src.lazy import lazy
from lazy_optax._src.sparse_rows import is_sparse_rows

__all__ = ('bare',)


def bare(rule: optax.GradientTransformationExtraArgs, name: str,
         impl: str) -> optax.GradientTransformationExtraArgs:
  """`rule` (state and all) as its `scale_by_X` returns it; `name` and
  `impl` are for the deprecated path."""
  wrapped = lazy(rule, impl=impl)

  def update_fn(updates, state, params=None, **extra_args):
    if not any(map(is_sparse_rows,
                   jax.tree.leaves(updates, is_leaf=is_sparse_rows))):
      return rule.update(updates, state, params, **extra_args)
    warnings.warn(
        f'{name}() given a SparseRows gradient outside lazy_optax.lazy(...) '
        f'is deprecated: {name} is the bare rule, as optax.scale_by_adam '
        f'is. Wrap it: lazy_optax.lazy(optax.chain({name}(...), '
        'optax.scale_by_learning_rate(lr))). This still works until '
        'lazy_optax 0.3.', DeprecationWarning, stacklevel=2)
    return wrapped.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(wrapped.init, update_fn)
