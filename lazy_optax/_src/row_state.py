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


def _row_count_probe(
    param_shapes: Sequence[jax.ShapeDtypeStruct],
    row_param_positions: Sequence[int],
    used: set[int],
) -> tuple[list[jax.ShapeDtypeStruct], dict[int, int]]:
  """The shapes with each row-lazy parameter given its own unused row count.

  The probe sizes avoid every size in `used` (the sizes of the state and
  the parameters; a state that differs from what `init` gives is refused
  by `row_owners`).

  Returns:
    The probe shapes, and the position of the parameter of each probe size.
  """
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
  return probe_shapes, probe_of


def _row_shape_probe(
    param_shapes: Sequence[jax.ShapeDtypeStruct],
    row_param_positions: Sequence[int],
) -> list[jax.ShapeDtypeStruct]:
  """The shapes with each row-lazy parameter's row shape (not row count) grown.

  A leaf that follows this probe but not the row count holds a statistic
  across rows (adafactor's factored column moment, a column sum), which the
  touched rows alone cannot update.
  """
  trail_shapes = list(param_shapes)
  for pos in row_param_positions:
    shape = param_shapes[pos]
    trail_shapes[pos] = jax.ShapeDtypeStruct(
        (shape.shape[0], *(d + 1 for d in shape.shape[1:])), shape.dtype)
  return trail_shapes


def _check_structure(state: Any, real: Any, state_def: Any,
                     real_def: Any) -> None:
  """Refuses a state whose tree is not the one `init` gives (`real`)."""
  if state_def != real_def:
    difference = tree_diff.describe(
        state, real, 'the given state', 'the state this optimizer makes')
    raise ValueError(
        'The optimizer state does not have the structure that this '
        'transformation\'s init gives for these parameters: was it built by '
        f'another optimizer or for other parameters? {difference}.\n'
        f' expected: {real_def}\n got: {state_def}')


def _check_leaf_shape(where: str, state_leaf: Any, real: Any) -> None:
  """Refuses a state leaf whose shape is not the one `init` gives."""
  if tuple(getattr(state_leaf, 'shape', ())) != tuple(real.shape):
    raise ValueError(
        f'Optimizer state leaf {where} has shape {tuple(state_leaf.shape)}, '
        'but this transformation\'s init gives '
        f'{tuple(real.shape)} for these parameters: was the state built by '
        'another optimizer or for other parameters?')


def _check_not_across_rows(where: str, real: Any, trail: Any) -> None:
  """Refuses a leaf that follows a row shape (`trail`) but not a row count.

  `trail` is None where the row-shape probe's state has other leaves.
  """
  if trail is not None and tuple(trail.shape) != tuple(real.shape):
    raise ValueError(
        f'Optimizer state leaf {where} (shape {tuple(real.shape)}) depends '
        'on the row shape of a row-lazy parameter but not on its row '
        'count: it holds a statistic across rows (such as a factored '
        'second moment), which cannot be updated from the touched rows '
        'alone. Keep that parameter dense (no SparseRows gradient) or use '
        'a transformation whose state mirrors the parameters row by row.')


def _row_owner(where: str, real: Any, probe: Any, probe_of: dict[int, int],
               param_shapes: Sequence[jax.ShapeDtypeStruct]) -> int:
  """The parameter whose row-count probe the leaf follows, one entry a row."""
  owner = probe_of.get(probe.shape[0]) if probe.shape else None
  if (owner is None or tuple(probe.shape[1:]) != tuple(real.shape[1:])
      or real.shape[0] != param_shapes[owner].shape[0]):
    raise ValueError(
        f'Optimizer state leaf {where} (shape {tuple(real.shape)}) depends on '
        'the shape of a row-lazy parameter but does not hold one entry per '
        'row of it, so it cannot be updated row by row. Keep that '
        'parameter dense (no SparseRows gradient) or use a transformation '
        'whose state mirrors the parameters.')
  return owner


def _leaf_owner(where: str, state_leaf: Any, real: Any, probe: Any,
                trail: Any, probe_of: dict[int, int],
                param_shapes: Sequence[jax.ShapeDtypeStruct]
                ) -> Optional[int]:
  """One leaf's owner from its shapes under `init`, both probes and `state`.

  Args:
    where: the leaf's path, for the messages.
    state_leaf: the leaf of the given state.
    real, probe, trail: its shapes under the real shapes, the row-count
      probe and the row-shape probe (`trail` None where that probe's state
      has other leaves).
    probe_of: the parameter position of each probe row count.
    param_shapes: shape structs of the flattened parameters.

  Returns:
    The owner's position, or None for a leaf that ignores the row counts.
  """
  _check_leaf_shape(where, state_leaf, real)
  if tuple(probe.shape) == tuple(real.shape):
    _check_not_across_rows(where, real, trail)
    return None
  return _row_owner(where, real, probe, probe_of, param_shapes)


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
  used = _all_dims((state, param_shapes))
  probe_shapes, probe_of = _row_count_probe(param_shapes, row_param_positions,
                                            used)
  trail_shapes = _row_shape_probe(param_shapes, row_param_positions)
  # The real shapes and both probes, in one abstract evaluation.
  real, probe, trail = jax.eval_shape(
      lambda *shapes: tuple(init_fn(rebuild_params(s)) for s in shapes),
      list(param_shapes), probe_shapes, trail_shapes)
  trail_leaves = jax.tree.leaves(trail)

  real_paths, real_def = jax.tree_util.tree_flatten_with_path(real)
  state_leaves, state_def = jax.tree.flatten(state)
  _check_structure(state, real, state_def, real_def)
  probe_leaves = jax.tree.leaves(probe)
  if len(trail_leaves) != len(probe_leaves):
    trail_leaves = [None] * len(probe_leaves)
  return [_leaf_owner(path_name(path), s, r, p, t, probe_of, param_shapes)
          for (path, r), p, s, t in zip(real_paths, probe_leaves, state_leaves,
                                        trail_leaves)]


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
