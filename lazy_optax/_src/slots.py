"""Optimizer slots by parameter path, as TensorFlow's `get_slot` gave them.

A slot is a state field that holds one array per parameter (`mu`, `nu`,
`nu_max`, `trace`, ...). TensorFlow and Keras name Adam's slots `"m"`, `"v"`
and `"vhat"`; optax names them `mu`, `nu` and `nu_max`. Both spellings are
accepted here. Slots are found anywhere in a state: inside `optax.chain`,
`optax.partition`, `optax.masked`, `optax.inject_hyperparams` and `lazy(...)`
(whose state is its inner transformation's own).
"""

from __future__ import annotations

from typing import Hashable, Iterator, Sequence, Union

import chex
import jax
import optax

from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows

# TensorFlow / Keras slot name -> optax state field.
TF_SLOT_NAMES = {'m': 'mu', 'v': 'nu', 'vhat': 'nu_max'}
_OPTAX_TO_TF = {v: k for k, v in TF_SLOT_NAMES.items()}


def _is_masked(x: object) -> bool:
  return isinstance(x, optax.MaskedNode)


def _is_leaf(x: object) -> bool:
  return _is_masked(x) or is_sparse_rows(x) or x is None


def _fields(state: optax.OptState,
            where: str = '') -> Iterator[tuple[str, str, chex.ArrayTree]]:
  """Yields `(field name, location, value)` for every NamedTuple field."""
  if _is_masked(state) or is_sparse_rows(state):
    return
  if isinstance(state, tuple) and hasattr(state, '_fields'):  # NamedTuple
    for name, value in zip(state._fields, state):
      loc = f'{where}.{name}'
      yield name, loc, value
      yield from _fields(value, loc)
  elif isinstance(state, (tuple, list)):
    for i, value in enumerate(state):
      yield from _fields(value, f'{where}[{i}]')
  elif isinstance(state, dict):
    for k, value in state.items():
      yield from _fields(value, f'{where}[{k!r}]')


def _mirrors(value: chex.ArrayTree, params: optax.Params) -> bool:
  """Whether `value` holds one array per parameter (some maybe masked).

  `optax.masked` and `optax.partition` replace the entries of parameters
  they do not handle, or whole subtrees given by a prefix mask, with
  `optax.MaskedNode`; per-row slots hold `[num_rows]` (or `[num_rows, 1]`)
  per parameter.
  """
  if not jax.tree_util.all_leaves([params], is_leaf=_is_leaf) and (
      jax.tree_util.all_leaves([value], is_leaf=_is_leaf)):
    return False  # a single array is no slot of a tree of parameters
  leaves, value_def = jax.tree.flatten(value, is_leaf=_is_leaf)
  try:
    subtrees = value_def.flatten_up_to(params)  # type: ignore[attr-defined]
  except (ValueError, TypeError):
    return False
  kept = 0
  for leaf, sub in zip(leaves, subtrees):
    if _is_masked(leaf):
      continue
    shape = getattr(sub, 'shape', None)
    if shape is None or getattr(leaf, 'shape', None) is None:
      return False
    rows = tuple(shape)[:1]
    if tuple(leaf.shape) not in (tuple(shape), rows, rows + (1,)):
      return False
    kept += 1
  return kept > 0


def get_slot_names(state: optax.OptState, params: optax.Params) -> list[str]:
  """The names of the slots in `state` (TensorFlow's `get_slot_names()`).

  A slot is a state field holding a tree with the structure of `params`.
  Adam's slots are reported with TensorFlow's names (`'m'`, `'v'`, and
  `'vhat'` with AMSGrad); others with their optax field name (`'trace'`,
  `'sum_of_squares'`, `'row_count'`, ...).

  Args:
    state: an optimizer state, from any lazy_optax or optax transformation.
    params: the parameters (or any tree of their structure).

  Returns:
    A sorted list of slot names, each accepted by `get_slot`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((5, 2))}
    >>> state = lazy_optax.lazy_adam(1e-3).init(params)
    >>> lazy_optax.compat.get_slot_names(state, params)
    ['m', 'v']
  """
  names = set()
  for name, _, value in _fields(state):
    if _mirrors(value, params):
      names.add(_OPTAX_TO_TF.get(name, name))
  return sorted(names)


def get_slot(
    state: optax.OptState,
    param_path: Union[str, Sequence[Hashable]],
    name: str,
) -> jax.Array:
  """A parameter's slot array (TensorFlow's `optimizer.get_slot(var, name)`).

  Args:
    state: an optimizer state, from any lazy_optax or optax transformation
      (also inside `optax.chain`, `optax.partition`, `optax.masked` and
      `optax.inject_hyperparams`).
    param_path: the parameter's path as `path_name` writes it, such as
      `"encoder/embedding"`, or the sequence of its keys
      (`('encoder', 'embedding')`).
    name: `'m'` or `'mu'` (first moment), `'v'` or `'nu'` (second moment),
      `'vhat'` or `'nu_max'` (AMSGrad's maximum), or any other optax state
      field that mirrors the parameters (`'trace'`, `'row_count'`, ...).

  Returns:
    The slot's array for that parameter (same shape as the parameter, or
    `[num_rows]` for per-row slots).

  Raises:
    KeyError: naming the slot and path, when no such slot exists for the
      parameter (the message lists what does exist).
    ValueError: when several transformations in the state keep that slot for
      the parameter (e.g. two Adams in one chain).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> params = {'encoder': {'embedding': jnp.zeros((5, 2))}}
    >>> tx = optax.inject_hyperparams(lazy_optax.lazy_adam)(learning_rate=0.1)
    >>> state = tx.init(params)
    >>> lazy_optax.compat.get_slot(state, 'encoder/embedding', 'm').shape
    (5, 2)
  """
  if not isinstance(param_path, str):
    param_path = '/'.join(str(k) for k in param_path)
  if not isinstance(name, str):
    raise TypeError(f'get_slot: name must be a string, got {name!r}.')
  field = TF_SLOT_NAMES.get(name, name)
  found = []
  known_paths: set[str] = set()
  slots = optax.tree_utils.tree_get_all_with_path(state, field)
  for path, value in slots:
    leaves = {path_name(p): leaf for p, leaf in
              jax.tree_util.tree_leaves_with_path(value, is_leaf=_is_leaf)}
    known_paths.update(p for p, x in leaves.items() if not _is_masked(x))
    leaf = leaves.get(param_path)
    if leaf is not None and not _is_masked(leaf):
      found.append((path_name(path), leaf))
  if not found:
    if not slots:
      names = sorted({_OPTAX_TO_TF.get(f, f) for f, _, _ in _fields(state)})
      raise KeyError(
          f'get_slot: the optimizer state has no slot {name!r}; its state '
          f'fields are {names}.')
    raise KeyError(
        f'get_slot: no slot {name!r} for parameter path {param_path!r}; '
        f'paths with that slot: {sorted(known_paths)}.')
  if len(found) > 1:
    raise ValueError(
        f'get_slot: parameter {param_path!r} has {len(found)} slots '
        f'{name!r}, at {[loc for loc, _ in found]}; read the one you mean '
        'from the state directly.')
  return found[0][1]


def global_step(state: optax.OptState) -> jax.Array:
  """A state's step count (TensorFlow's `global_step`, Keras' `iterations`).

  Returns the first `count` field found in the state (depth first). Every
  `count` in a lazy_optax or optax state advances once per `update`, so they
  agree; inside `optax.MultiSteps` count the inner steps instead.

  Args:
    state: an optimizer state.

  Returns:
    The integer scalar: how many updates the state has seen.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy_adam(1e-3)
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> _, state = tx.update({'w': jnp.ones(2)}, state)
    >>> int(lazy_optax.compat.global_step(state))
    1
  """
  for _, value in optax.tree_utils.tree_get_all_with_path(state, 'count'):
    if getattr(value, 'ndim', None) == 0:
      return value
  raise KeyError('global_step: the optimizer state has no scalar `count` '
                 'field (is it a stateless transformation?).')
