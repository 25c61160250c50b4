"""Per-parameter learning rates chosen by regular expressions on the path.

A parameter's path is its `jax.tree_util` key path written as `path_name`
writes it: the keys joined by `'/'`, a dict key or attribute name as is and a
sequence index as its number. So `{'encoder': {'embedding': t}}` gives
`"encoder/embedding"`, Flax's `{'params': {'Dense_0': {'kernel': w}}}` gives
`"params/Dense_0/kernel"` and `[w, b]` gives `"0"` and `"1"`.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence, Union

import jax
import optax

from lazy_optax._src.labels import path_labels
from lazy_optax._src.labels import path_name
from lazy_optax._src.lazy import lazy
from lazy_optax._src.sparse_rows import is_sparse_rows

_DEFAULT = 'default'


PatternLRs = Sequence[tuple[Union[str, Sequence[str]], optax.ScalarOrSchedule]]

_KERAS_HINT = (
    "for Keras' spelling write [(g['patterns'], g['lr']) for g in "
    'pattern_lrs]')


def _normalize_groups(
    pattern_lrs: PatternLRs,
) -> list[tuple[list[re.Pattern[str]], optax.ScalarOrSchedule]]:
  """Checks the `(patterns, lr)` pairs and compiles their patterns."""
  if isinstance(pattern_lrs, (Mapping, str)):
    raise TypeError(
        'per_pattern_lr: pattern_lrs is a sequence of (patterns, lr) pairs, '
        f'got a {type(pattern_lrs).__name__}; {_KERAS_HINT}.')
  items = []
  for i, group in enumerate(pattern_lrs):
    if not (isinstance(group, (tuple, list)) and len(group) == 2):
      raise TypeError(
          f'pattern_lrs[{i}] must be a (patterns, lr) pair, got {group!r}; '
          f'{_KERAS_HINT}.')
    items.append((group[0], group[1]))
  groups = []
  for i, (given, lr) in enumerate(items):
    patterns = [given] if isinstance(given, (str, re.Pattern)) else given
    compiled = []
    for pattern in patterns:
      if isinstance(pattern, re.Pattern):
        compiled.append(pattern)
        continue
      if not isinstance(pattern, str):
        raise TypeError(
            f'Group {i} of pattern_lrs: a pattern must be a string, got '
            f'{pattern!r}.')
      try:
        compiled.append(re.compile(pattern))
      except re.error as e:
        raise ValueError(
            f'Group {i} of pattern_lrs: {pattern!r} is not a valid regular '
            f'expression ({e}).') from e
    if not compiled:
      raise ValueError(f'Group {i} of pattern_lrs has no pattern.')
    if not (callable(lr) or isinstance(lr, (int, float))
            or hasattr(lr, 'dtype')):
      raise TypeError(
          f'Group {i} of pattern_lrs: the learning rate must be a number or '
          f'a schedule, got {lr!r}.')
    groups.append((compiled, lr))
  return groups


def _label_of(
    path: str,
    groups: list[tuple[list[re.Pattern[str]], optax.ScalarOrSchedule]],
) -> str:
  for i, (patterns, _) in enumerate(groups):
    if any(p.search(path) for p in patterns):
      return f'pattern_{i}'
  return _DEFAULT


def per_pattern_lr(
    optimizer: Callable[[optax.ScalarOrSchedule],
                        optax.GradientTransformation],
    learning_rate: optax.ScalarOrSchedule,
    pattern_lrs: PatternLRs,
    *,
    require_match: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Per-parameter learning rates, chosen by regular expressions on paths.

  Each group is a list of regular expressions with a learning rate (a float
  or an optax schedule of the step count). Groups are tried in order against
  each parameter's path (see `path_name`, e.g. `"encoder/embedding"`) with
  `re.search`, so a pattern matches anywhere in the path unless anchored with
  `^` and `$`; the first group with a matching pattern wins, and parameters
  that no group matches use `learning_rate`. Every group runs
  `optimizer(its_rate)`, so all other hyperparameters (betas, epsilon, weight
  decay) are shared; the result equals running one separate optimizer per
  group. Lazy (`SparseRows`) and dense leaves both work, with any lazy_optax
  or optax optimizer: the whole partition runs inside `lazy(...)`, so a
  plain `optax.adam` updates only the touched rows of a table too. This is
  what Keras optimizers with a `pattern_lrs` argument (`AdamMultilr`)
  offered.

  Args:
    optimizer: a function from a learning rate to a transformation, e.g.
      `lazy_optax.lazy_adam` or `lambda lr: optax.adamw(lr, b2=0.98)`.
    learning_rate: the rate of the parameters that no group matches.
    pattern_lrs: the groups, in order: a sequence of `(patterns, lr)` pairs,
      where `patterns` is a regular expression or a list of them. (Keras'
      `[{'patterns': [...], 'lr': lr}]` becomes `[(g['patterns'], g['lr'])
      for g in pattern_lrs]`.)
    require_match: raise in `init` when a group matches no parameter (a
      misspelt pattern would otherwise silently fall back to the default).

  Returns:
    An `optax.GradientTransformationExtraArgs`: `lazy` of an
    `optax.partition` with one part per group (`'pattern_0'`, ...) plus
    `'default'`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> params = {'encoder': {'embedding': jnp.zeros((10, 2))},
    ...           'head': jnp.zeros(2)}
    >>> tx = lazy_optax.compat.per_pattern_lr(
    ...     optax.sgd, 1.0, [(r'embedding', 0.1)])
    >>> state = tx.init(params)
    >>> grads = {'encoder': {'embedding': lazy_optax.SparseRows(
    ...              jnp.array([4]), jnp.ones((1, 2)), 10)},
    ...          'head': jnp.ones(2)}
    >>> updates, state = tx.update(grads, state, params)
    >>> new = lazy_optax.apply_updates(params, updates)
    >>> new['encoder']['embedding'][4], new['head']
    (Array([-0.1, -0.1], dtype=float32), Array([-1., -1.], dtype=float32))
  """
  if not callable(optimizer):
    raise TypeError(
        'per_pattern_lr: optimizer must be a function from a learning rate '
        f'to an optax transformation (e.g. optax.adam), got {optimizer!r}.')
  groups = _normalize_groups(pattern_lrs)
  transforms = {}
  for i, (_, lr) in enumerate(groups):
    transforms[f'pattern_{i}'] = optimizer(lr)
  transforms[_DEFAULT] = optimizer(learning_rate)
  for label, tx in transforms.items():
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
          f'per_pattern_lr: optimizer(lr) must return an optax '
          f'GradientTransformation, got {type(tx).__name__} for {label}.')

  labels = path_labels(lambda name: _label_of(name, groups))

  inner = optax.partition(transforms, labels)

  def init_fn(params):
    if require_match:
      used = set(jax.tree.leaves(labels(params)))
      for i, (patterns, _) in enumerate(groups):
        if f'pattern_{i}' not in used:
          paths = [path_name(p) for p, _ in
                   jax.tree_util.tree_leaves_with_path(
                       params, is_leaf=is_sparse_rows)]
          raise ValueError(
              f'Group {i} of pattern_lrs ({[p.pattern for p in patterns]}) '
              'matches no parameter (or only parameters that an earlier '
              f'group took). Parameter paths: {paths}. Pass '
              'require_match=False to allow this.')
    return inner.init(params)

  return lazy(optax.GradientTransformationExtraArgs(init_fn, inner.update))
