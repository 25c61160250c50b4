"""Finding the optimizer-state leaves that hold one row per table row.

`lazy(tx)` must gather and scatter the rows of every state leaf that mirrors
a row-lazy parameter (`mu`, `nu`, traces, accumulators, per-row counters) and
leave the other leaves (`count`, hyperparameters) whole. The owners are found
from `tx.init` itself, without running it: one `jax.eval_shape` initialises
the state for the real shapes and again with each row-lazy parameter given a
distinct, otherwise unused row count. A leaf whose leading size follows that
probe belongs to that parameter. This sees through `optax.chain`,
`optax.partition`, `optax.masked` and `optax.inject_hyperparams` alike, and a
leaf that changes in any other way (a transposed or reduced copy of the
table) is refused with its path, since it cannot be updated row by row.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax

from lazy_optax._src import tree_diff
from lazy_optax._src.paths import path_name

_FIRST_PROBE = 1_000_003


def _all_dims(tree: Any) -> set[int]:
  dims: set[int] = set()
  for leaf in jax.tree.leaves(tree):
    dims.update(int(d) for d in getattr(leaf, 'shape', ()))
  return dims


def row_owners(
    init_fn: Any,
    param_shapes: Sequence[jax.ShapeDtypeStruct],
    rebuild_params: Any,
    row_param_positions: Sequence[int],
    state: Any,
) -> list[Optional[int]]:
  """For each leaf of `state`, the parameter position whose rows it holds.

  Args:
    init_fn: the inner transformation's `init`.
    param_shapes: shape structs of the flattened parameters.
    rebuild_params: callable turning a list of leaves into a params tree.
    row_param_positions: positions of the parameters updated row by row.
    state: the optimizer state, whose leaves are classified.

  Returns:
    A list with one entry per leaf of `jax.tree.leaves(state)`: the position
    (into `param_shapes`) of the parameter whose rows the leaf holds, or
    `None` for a leaf that is used whole.

  Raises:
    ValueError: naming the state leaf, when the state does not come from this
      transformation or a leaf depends on a table in a way other than one
      entry per row.
  """
  # The probe sizes avoid every size in the state and the parameters (a
  # state that differs from what `init` gives is refused below).
  used = _all_dims((state, param_shapes))
  probe_shapes = list(param_shapes)
  probe_of: dict[int, int] = {}
  size = _FIRST_PROBE
  for pos in row_param_positions:
    while size in used:
      size += 2
    probe_of[size] = pos
    shape = param_shapes[pos]
    probe_shapes[pos] = jax.ShapeDtypeStruct((size, *shape.shape[1:]),
                                             shape.dtype)
    size += 2
  # A second probe grows the row shape (not the row count) of the row-lazy
  # parameters: a leaf that follows it but not the row count holds a
  # statistic across rows (adafactor's factored column moment, a column
  # sum), which the touched rows alone cannot update.
  trail_shapes = list(param_shapes)
  for pos in row_param_positions:
    shape = param_shapes[pos]
    trail_shapes[pos] = jax.ShapeDtypeStruct(
        (shape.shape[0], *(d + 1 for d in shape.shape[1:])), shape.dtype)
  # The real shapes and both probes, in one abstract evaluation.
  real, probe, trail = jax.eval_shape(
      lambda *shapes: tuple(init_fn(rebuild_params(s)) for s in shapes),
      list(param_shapes), probe_shapes, trail_shapes)
  trail_leaves = jax.tree.leaves(trail)

  real_paths, real_def = jax.tree_util.tree_flatten_with_path(real)
  state_leaves, state_def = jax.tree.flatten(state)
  if state_def != real_def:  # type: ignore[operator]  # jaxlib's stubs
    difference = tree_diff.describe(
        state, real, 'the given state', 'the state this optimizer makes')
    raise ValueError(
        'The optimizer state does not have the structure that this '
        'transformation\'s init gives for these parameters: was it built by '
        f'another optimizer or for other parameters? {difference}.\n'
        f' expected: {real_def}\n got: {state_def}')
  probe_leaves = jax.tree.leaves(probe)
  owners: list[Optional[int]] = []
  for (path, r), p, s in zip(real_paths, probe_leaves, state_leaves):
    where = path_name(path)
    if tuple(getattr(s, 'shape', ())) != tuple(r.shape):
      raise ValueError(
          f'Optimizer state leaf {where} has shape {tuple(s.shape)}, but this '
          f'transformation\'s init gives {tuple(r.shape)} for these '
          'parameters: was the state built by another optimizer or for other '
          'parameters?')
    if tuple(p.shape) == tuple(r.shape):
      if (len(trail_leaves) == len(probe_leaves) and
          tuple(trail_leaves[len(owners)].shape) != tuple(r.shape)):
        raise ValueError(
            f'Optimizer state leaf {where} (shape {tuple(r.shape)}) depends '
            'on the row shape of a row-lazy parameter but not on its row '
            'count: it holds a statistic across rows (such as a factored '
            'second moment), which cannot be updated from the touched rows '
            'alone. Keep that parameter dense (no SparseRows gradient) or use '
            'a transformation whose state mirrors the parameters row by row.')
      owners.append(None)
      continue
    owner = probe_of.get(p.shape[0]) if p.shape else None
    if (owner is None or tuple(p.shape[1:]) != tuple(r.shape[1:])
        or r.shape[0] != param_shapes[owner].shape[0]):
      raise ValueError(
          f'Optimizer state leaf {where} (shape {tuple(r.shape)}) depends on '
          'the shape of a row-lazy parameter but does not hold one entry per '
          'row of it, so it cannot be updated row by row. Keep that '
          'parameter dense (no SparseRows gradient) or use a transformation '
          'whose state mirrors the parameters.')
    owners.append(owner)
  return owners


def leaf_signature(x: Any) -> tuple[Any, ...]:
  """A leaf's shape and dtype (its type where it has no dtype)."""
  return tuple(getattr(x, 'shape', ())), str(getattr(x, 'dtype', type(x)))


def signature(tree: Any) -> tuple[Any, ...]:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(leaf_signature(x) for x in leaves)


class OwnerCache:
  """`row_owners` for one transformation, remembered per tree signature.

  `row_owners` traces `init` three times (in one `jax.eval_shape`); a step
  that is not jitted would pay that on every call. The answer depends only
  on the structures, shapes and dtypes involved, so it is kept per such
  signature.
  """

  def __init__(self, init_fn: Any):
    self._init_fn = init_fn
    self._known: dict[Any, list[Optional[int]]] = {}

  def __call__(self, *, param_shapes: Sequence[jax.ShapeDtypeStruct],
               rebuild_params: Any, row_param_positions: Sequence[int],
               state: Any) -> list[Optional[int]]:
    key = (signature(rebuild_params(list(param_shapes))),
           tuple(row_param_positions), signature(state))
    owners = self._known.get(key)
    if owners is None:
      owners = row_owners(
          self._init_fn, param_shapes=param_shapes,
          rebuild_params=rebuild_params,
          row_param_positions=row_param_positions, state=state)
      self._known[key] = owners
    return list(owners)
