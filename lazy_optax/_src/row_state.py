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

from typing import Callable, Hashable, Optional, Sequence

import jax
import optax

from lazy_optax._src import tree_diff
from lazy_optax._src.paths import path_name

_FIRST_PROBE = 1_000_003


def _probe_shapes(
    param_shapes: Sequence[jax.ShapeDtypeStruct],
    row_param_positions: Sequence[int],
    used: set[int],
) -> tuple[list[jax.ShapeDtypeStruct], dict[int, int]]:
  """The shapes with each row-lazy parameter given its own unused row count,
  and each of its row dimensions grown by one.

  The probe sizes avoid every size in `used` (the sizes of the state and
  the parameters). A state leaf that follows a probe row count holds that
  parameter's rows; one that follows the row shape alone holds a statistic
  across rows (adafactor's factored moment), which the touched rows alone
  cannot update.

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
    probe_shapes[pos] = jax.ShapeDtypeStruct(
        (size, *(d + 1 for d in shape.shape[1:])), shape.dtype)
    size += 2
  return probe_shapes, probe_of


def _check_structure(state: optax.OptState, probe: optax.OptState,
                     state_def: jax.tree_util.PyTreeDef,
                     probe_def: jax.tree_util.PyTreeDef) -> None:
  """Refuses a state whose tree is not the one `init` gives."""
  if state_def != probe_def:
    difference = tree_diff.describe(
        state, probe, 'the given state', 'the state this optimizer makes')
    raise ValueError(
        'The optimizer state does not have the structure that this '
        'transformation\'s init gives for these parameters: was it built by '
        f'another optimizer or for other parameters? {difference}.\n'
        f' expected: {probe_def}\n got: {state_def}')


def _not_row_by_row(where: str, shape: tuple[int, ...],
                    across_rows: bool) -> ValueError:
  if across_rows:
    return ValueError(
        f'Optimizer state leaf {where} (shape {shape}) depends on the row '
        'shape of a row-lazy parameter but not on its row count: it holds '
        'a statistic across rows (such as a factored second moment), which '
        'cannot be updated from the touched rows alone. Keep that parameter '
        'dense (no SparseRows gradient) or use a transformation whose state '
        'mirrors the parameters row by row.')
  return ValueError(
      f'Optimizer state leaf {where} (shape {shape}) depends on the shape of '
      'a row-lazy parameter but does not hold one entry per row of it, so '
      'it cannot be updated row by row. Keep that parameter dense (no '
      'SparseRows gradient) or use a transformation whose state mirrors the '
      'parameters.')


def _leaf_owner(where: str, shape: tuple[int, ...], probe: tuple[int, ...],
                probe_of: dict[int, int],
                param_shapes: Sequence[jax.ShapeDtypeStruct],
                probe_shapes: Sequence[jax.ShapeDtypeStruct]
                ) -> Optional[int]:
  """One leaf's owner, from its shape and its shape under the probe.

  Args:
    where: the leaf's path, for the messages.
    shape: the leaf's shape in the given state.
    probe: its shape under the probe shapes.
    probe_of: the parameter position of each probe row count.
    param_shapes, probe_shapes: shape structs of the flattened parameters,
      real and probed.

  Returns:
    The owner's position, or None for a leaf that ignores the row counts.
  """
  if probe == shape:
    return None
  owner = probe_of.get(probe[0]) if probe else None
  if owner is None:
    raise _not_row_by_row(
        where, shape, across_rows=not set(probe) & set(probe_of))
  real = tuple(param_shapes[owner].shape)
  if probe[1:] == tuple(probe_shapes[owner].shape)[1:]:
    expected = real  # one row of the parameter per entry
  elif probe[1:] == shape[1:]:
    expected = real[:1] + probe[1:]  # a statistic per row
  else:
    raise _not_row_by_row(where, shape, across_rows=False)
  if shape != expected:
    raise ValueError(
        f'Optimizer state leaf {where} has shape {shape}, but this '
        f"transformation's init gives {expected} for these parameters: was "
        'the state built by another optimizer or for other parameters?')
  return owner


def row_owners(
    init_fn: Callable[[optax.Params], optax.OptState],
    param_shapes: Sequence[jax.ShapeDtypeStruct],
    rebuild_params: Callable[..., optax.Params],
    row_param_positions: Sequence[int],
    state: optax.OptState,
) -> list[Optional[int]]:
  """For each leaf of `state`, the parameter position whose rows it holds.

  One abstract trace of `init_fn`, for the probe shapes (`_probe_shapes`).

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
  used = {int(d) for leaf in jax.tree.leaves((state, param_shapes))
          for d in getattr(leaf, 'shape', ())}
  probe_shapes, probe_of = _probe_shapes(param_shapes, row_param_positions,
                                         used)
  probe = jax.eval_shape(lambda s: init_fn(rebuild_params(s)),
                         list(probe_shapes))
  probe_paths, probe_def = jax.tree_util.tree_flatten_with_path(probe)
  state_leaves, state_def = jax.tree.flatten(state)
  _check_structure(state, probe, state_def, probe_def)
  return [_leaf_owner(path_name(path), tuple(getattr(s, 'shape', ())),
                      tuple(p.shape), probe_of, param_shapes, probe_shapes)
          for (path, p), s in zip(probe_paths, state_leaves)]


def leaf_signature(x: object) -> tuple[tuple[int, ...], str]:
  """A leaf's shape and dtype (its type where it has no dtype)."""
  return tuple(getattr(x, 'shape', ())), str(getattr(x, 'dtype', type(x)))


def signature(tree: object) -> tuple[Hashable, ...]:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(leaf_signature(x) for x in leaves)


class OwnerCache:
  """`row_owners` for one transformation, remembered per tree signature.

  `row_owners` traces `init` once; a step that is not jitted would pay that
  on every call. The answer depends only
  on the structures, shapes and dtypes involved, so it is kept per such
  signature.
  """

  def __init__(self, init_fn: Callable[[optax.Params], optax.OptState]):
    self._init_fn = init_fn
    self._known: dict[Hashable, list[Optional[int]]] = {}

  def __call__(self, *, param_shapes: Sequence[jax.ShapeDtypeStruct],
               rebuild_params: Callable[..., optax.Params],
               row_param_positions: Sequence[int],
               state: optax.OptState) -> list[Optional[int]]:
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
