"""Row lookups with row-sparse gradients: `lookup` and `lookup_bag`.

One rule for ids, shared by `lookup`, `lookup_bag` and the Flax, Haiku and
Equinox layers, eagerly and under `jax.jit` alike:

* ids in `[0, num_rows)` read their row; under `lazy_optax.value_and_grad`
  each gives the table's `SparseRows` gradient one slot.
* ids outside `[0, num_rows)` (negative ones included: they are not wrapped
  around) read zero rows and never produce a gradient row (their slots hold
  id `num_rows` and zero values, which every scatter drops). Where the ids
  are concrete this is a `ValueError` naming the table and the first bad
  id; under `jax.jit`, `lazy_optax.checks.checked` reports it as a `CheckError`.
* slots holding `padding_id` read the padding row as it is (zeros when
  `padding_id` is outside the table) and never produce a gradient row, so no
  optimizer ever updates the padding row for them.
* masked slots of a bag (`mask`, `lengths`) are left out of the bag and
  never produce a gradient row; their ids are not checked.

The ids are checked by one validator, `check_ids`, in every entry point.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np

from lazy_optax._src import validate
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.row_reads import active_recorder
from lazy_optax._src.row_reads import read_rows

_MODES = ('sum', 'mean', 'max')


def where_of(caller: str, path: Optional[str]) -> str:
  return f'{caller} of table {path}' if path else caller


def check_ids(ids: ArrayLike | Sequence[int], where: str,
              num_rows: Optional[int] = None) -> jax.Array:
  """The lookup ids as an array; they must have an integer dtype.

  Args:
    ids: the ids given to a lookup or embedding layer.
    where: who got them, for the message (`'lookup of table emb/table'`).
    num_rows: the table's row count: host ids that JAX's integer dtype
      cannot hold (int64 without x64) raise the out-of-range `ValueError`
      before the cast would wrap them onto a row.

  Returns:
    `ids` as a JAX array (tracers are returned as they are).

  Raises:
    TypeError: the ids are not integers.
    ValueError: a host id does not fit JAX's integer dtype.
  """
  if num_rows is not None:
    validate.ids_fit_jax(ids, num_rows, where)
  if not isinstance(ids, jax.core.Tracer):
    ids = jnp.asarray(ids)
  validate.integer_ids(ids, where)
  return ids


def _rows_of(table: ArrayLike) -> Optional[int]:
  return jnp.shape(table)[0] if jnp.ndim(table) else None


def check_in_range(ids: jax.Array, active: Optional[jax.Array],
                   num_rows: int, where: str) -> None:
  """Out-of-range ids of active slots raise a `ValueError` when concrete.

  Traced ids are not checked here: a check in the traced step (even a
  `checkify.debug_check`) sends every call of a jitted step through Python
  dispatch, measured at 0.15 ms of a 0.5 ms train step. The checked mode
  reports them (module doc).
  """
  concrete = not isinstance(ids, jax.core.Tracer) and (
      active is None or not isinstance(active, jax.core.Tracer))
  if not concrete:
    return
  host = np.asarray(ids)
  bad = (host < 0) | (host >= num_rows)
  if active is not None:
    bad &= np.asarray(active)
  if bad.any():
    first = int(np.flatnonzero(bad.reshape(-1))[0])
    index = np.asarray(np.unravel_index(first, host.shape))
    raise ValueError(validate.out_of_range_message(where, num_rows).format(
        id=int(host.reshape(-1)[first]), position=index, count=int(bad.sum())))


def _gather(table: ArrayLike, ids: jax.Array, active: Optional[jax.Array],
            dtype: Optional[DTypeLike], caller: str,
            path: Optional[str]) -> jax.Array:
  """Reads `table[ids]` under the one rule for ids; see the module doc."""
  recorder = active_recorder()
  if recorder is not None:
    path = recorder.name_of(table) or path
  where = where_of(caller, path)
  if jnp.ndim(table) < 1:
    raise ValueError(
        f'{where}: the table must have at least one dimension (its rows), got '
        f'shape {tuple(jnp.shape(table))}.')
  num_rows = jnp.shape(table)[0]
  check_in_range(ids, active, num_rows, where)
  if recorder is not None:
    rows = recorder.take(table, ids, active, dtype)
    if rows is not None:
      return rows
  return plain_rows(table, ids, active, dtype)


def plain_rows(table: ArrayLike, ids: jax.Array, active: Optional[jax.Array],
               dtype: Optional[DTypeLike] = None) -> jax.Array:
  """The rows as `jax.grad` sees them: a dense gradient, none for inactive.

  Inactive slots (padding, masked) read their rows but pass no gradient.
  """
  rows = read_rows(table, ids)
  if active is not None:
    rows = jnp.where(broadcast_rows(active, rows), rows,
                     jax.lax.stop_gradient(rows))
  return rows if dtype is None else rows.astype(dtype)


def not_padding(ids: jax.Array, padding_id: Optional[int],
             where: str) -> Optional[jax.Array]:
  """Which slots are not padding (None when there is no padding id)."""
  if padding_id is None:
    return None
  if isinstance(padding_id, bool) or not isinstance(
      padding_id, (int, np.integer)):
    raise TypeError(
        f'{where}: padding_id must be a Python int or None, got '
        f'{padding_id!r}.')
  return ids != int(padding_id)


def lookup_rows(table: ArrayLike, ids: ArrayLike | Sequence[int], *,
                dtype: Optional[DTypeLike] = None,
                padding_id: Optional[int] = None,
                path: Optional[str] = None,
                caller: str = 'lookup') -> jax.Array:
  """`lookup`, for the layers: `path` names the table in messages."""
  ids = check_ids(ids, where_of(caller, path), _rows_of(table))
  active = not_padding(ids, padding_id, where_of(caller, path))
  return _gather(table, ids, active, dtype, caller, path)


def lookup(table: ArrayLike, ids: ArrayLike,
           dtype: Optional[DTypeLike] = None, *,
           padding_id: Optional[int] = None) -> jax.Array:
  """Rows `table[ids]`, whose gradient `value_and_grad` returns row-sparse.

  Outside `value_and_grad`, `jax.grad` gives the usual dense gradient.
  Inside it, the table's gradient arrives as a `SparseRows` holding one slot
  per id. Ids outside `[0, num_rows)` (negative ones included) read zero rows
  and never produce a gradient row; concrete ones raise `ValueError` naming
  the first bad id (under `jax.jit`, `lazy_optax.checks.checked` reports them).

  Args:
    table: the parameter array `[num_rows, *row_shape]`, exactly as the loss
      function received it (not a copy or a cast of it).
    ids: integer array of any shape.
    dtype: optional dtype of the returned rows.
    padding_id: optional id whose slots read the padding row as it is (zeros
      if the id is outside the table) and never produce a gradient row, so
      the padding row is never updated for them (PyTorch's `padding_idx`,
      Keras' `mask_zero` with `padding_id=0`). Not wrapped: `-1` marks `-1`
      slots.

  Returns:
    An array of shape `ids.shape + table.shape[1:]`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> table = jnp.arange(6.).reshape(3, 2)
    >>> lazy_optax.lookup(table, jnp.array([2, 0]))
    Array([[4., 5.],
           [0., 1.]], dtype=float32)
    >>> lazy_optax.lookup(table, jnp.array([2, -1]), padding_id=-1)
    Array([[4., 5.],
           [0., 0.]], dtype=float32)
  """
  return lookup_rows(table, ids, dtype=dtype, padding_id=padding_id)


def bag_slots(ids: jax.Array, mode: str, mask: Optional[ArrayLike],
              lengths: Optional[ArrayLike],
              per_sample_weights: Optional[ArrayLike],
              padding_id: Optional[int], where: str
              ) -> tuple[jax.Array, Optional[jax.Array]]:
  """A bag lookup's checked arguments: its member slots and its weights."""
  if ids.ndim != 2:
    raise ValueError(
        f'{where}: ids must be a padded [batch, max_len] array, got shape '
        f'{tuple(ids.shape)}.')
  if mode not in _MODES:
    raise ValueError(f'{where}: mode must be one of {_MODES}, got {mode!r}.')
  if mask is not None and lengths is not None:
    raise ValueError(f'{where}: give mask or lengths, not both.')
  return (_bag_members(ids, mask, lengths, padding_id, where),
          _bag_weights(per_sample_weights, ids, mode, where))


def _bag_mask(mask: ArrayLike, ids: jax.Array, where: str) -> jax.Array:
  """`mask` as an array; it must be boolean, of the ids' shape."""
  mask = mask if isinstance(mask, jax.core.Tracer) else jnp.asarray(mask)
  if mask.shape != ids.shape or mask.dtype != jnp.bool_:
    raise ValueError(
        f'{where}: mask must be a boolean array of the ids\' shape '
        f'{tuple(ids.shape)}, got {mask.dtype}{list(mask.shape)}.')
  return mask


def _bag_lengths(lengths: ArrayLike, ids: jax.Array, where: str) -> jax.Array:
  """`lengths` as integers `[batch]`, each in `[0, max_len]` where concrete."""
  lengths = check_ids(lengths, where + ' (lengths)')
  if lengths.shape != ids.shape[:1]:
    raise ValueError(
        f'{where}: lengths must have shape [batch] = {ids.shape[:1]}, got '
        f'{tuple(lengths.shape)}.')
  if not isinstance(lengths, jax.core.Tracer):
    host = np.asarray(lengths)
    bad = np.flatnonzero((host < 0) | (host > ids.shape[1]))
    if bad.size:
      raise ValueError(
          f'{where}: lengths[{int(bad[0])}] = {int(host[bad[0]])} is not a '
          f'length of a bag of {ids.shape[1]} slots (lengths must lie in '
          f'[0, {ids.shape[1]}]; {bad.size} do not).')
  return lengths


def _bag_members(ids: jax.Array, mask: Optional[ArrayLike],
                 lengths: Optional[ArrayLike],
                 padding_id: Optional[int], where: str) -> jax.Array:
  """Which slots are in their bag: inside `mask` or `lengths`, not padding."""
  member = jnp.ones(ids.shape, bool)
  if mask is not None:
    member = _bag_mask(mask, ids, where)
  if lengths is not None:
    lengths = _bag_lengths(lengths, ids, where)
    member = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
  real = not_padding(ids, padding_id, where)
  if real is not None:
    member = member & real
  return member


def _bag_weights(per_sample_weights: Optional[ArrayLike], ids: jax.Array,
                 mode: str, where: str) -> Optional[jax.Array]:
  """The weights as an array (None without them): floating, the ids' shape.

  Refused with `mode='max'`, as in `torch.nn.EmbeddingBag`.
  """
  if per_sample_weights is None:
    return None
  if mode == 'max':
    raise ValueError(
        f"{where}: per_sample_weights work with mode='sum' or 'mean', not "
        "'max' (as in torch.nn.EmbeddingBag).")
  weights = per_sample_weights
  if not isinstance(weights, jax.core.Tracer):
    weights = jnp.asarray(weights)
  if weights.shape != ids.shape or not jnp.issubdtype(weights.dtype,
                                                      jnp.inexact):
    raise ValueError(
        f'{where}: per_sample_weights must be a floating array of the ids\' '
        f'shape {tuple(ids.shape)}, got '
        f'{weights.dtype}{list(weights.shape)}.')
  return weights


def _max_pool(rows: jax.Array, slot: jax.Array) -> jax.Array:
  """Each bag's elementwise maximum over its member slots (zeros if empty).

  The first maximum of each entry takes it, and its whole gradient (as
  `torch.nn.EmbeddingBag` does; `jnp.max` would split a tie's gradient).
  """
  lowest = (-jnp.inf if jnp.issubdtype(rows.dtype, jnp.inexact)
            else jnp.iinfo(rows.dtype).min)
  first = jnp.argmax(jnp.where(slot, rows, lowest), axis=1)
  out = jnp.take_along_axis(rows, first[:, None], axis=1)[:, 0]
  return jnp.where(jnp.any(slot, axis=1), out, jnp.zeros_like(out))


def pool(rows: jax.Array, member: jax.Array, weights: Optional[jax.Array],
         mode: str) -> jax.Array:
  """Each bag's rows pooled over its `member` slots (empty bags: zeros).

  `'max'`: `_max_pool`; `'sum'`, `'mean'`: the weighted sum or mean, weights
  defaulting to 1 (a bag of zero weight gives zeros).
  """
  slot = broadcast_rows(member, rows)
  if mode == 'max':
    return _max_pool(rows, slot)
  if weights is None:
    weights = member.astype(rows.dtype)
  else:
    weights = jnp.where(member, weights.astype(rows.dtype), 0)
  weights = broadcast_rows(weights, rows)
  # where, not a product alone: a masked slot's row never reaches the bag
  # (an inf or NaN there would otherwise make a NaN sum).
  total = jnp.sum(jnp.where(slot, rows * weights, 0), axis=1)
  if mode == 'sum':
    return total
  denominator = jnp.sum(weights, axis=1)
  empty = denominator == 0
  return jnp.where(empty, 0, total / jnp.where(empty, 1, denominator)).astype(
      total.dtype)


def bag_rows(table: ArrayLike, ids: ArrayLike | Sequence[int], *,
             mask: Optional[ArrayLike] = None,
             lengths: Optional[ArrayLike] = None, mode: str = 'mean',
             per_sample_weights: Optional[ArrayLike] = None,
             padding_id: Optional[int] = None,
             dtype: Optional[DTypeLike] = None,
             path: Optional[str] = None,
             caller: str = 'lookup_bag') -> jax.Array:
  """`lookup_bag`, for the layers: `path` names the table in messages."""
  where = where_of(caller, path)
  ids = check_ids(ids, where, _rows_of(table))
  member, weights = bag_slots(ids, mode, mask, lengths, per_sample_weights,
                              padding_id, where)
  rows = _gather(table, ids, member, dtype, caller, path)     # [B, L, ...]
  return pool(rows, member, weights, mode)


def lookup_bag(table: ArrayLike, ids: ArrayLike, *,
               mask: Optional[ArrayLike] = None,
               lengths: Optional[ArrayLike] = None, mode: str = 'mean',
               per_sample_weights: Optional[ArrayLike] = None,
               padding_id: Optional[int] = None,
               dtype: Optional[DTypeLike] = None) -> jax.Array:
  """Pooled rows of bags of ids, with a row-sparse gradient of the real ids.

  The counterpart of `torch.nn.EmbeddingBag` and TensorFlow's
  `embedding_lookup_sparse`, for multi-hot features (a user's last items, a
  document's tokens). Bag `b` holds the ids `ids[b, j]` whose slot is real:
  inside `mask` (or `j < lengths[b]`) and not `padding_id`. Under
  `lazy_optax.value_and_grad` the table's `SparseRows` gradient has values
  for the real ids only; masked and padding slots point at no row (a touched
  row with a zero gradient would still move under Adam's momentum).

  Modes, over the real slots of each bag (empty bags give zeros):
  `'sum'`: `sum_j w_j * row_j`; `'mean'`: `sum_j w_j * row_j / sum_j w_j`
  (the plain mean without weights, TensorFlow's weighted mean with them);
  `'max'`: the elementwise maximum. Weights `w` default to 1.

  Ids follow `lookup`'s rule: real ids outside `[0, num_rows)` read zero
  rows and give no gradient row (a `ValueError` where they are concrete).

  Args:
    table: the parameter array `[num_rows, *row_shape]`, as the loss function
      received it.
    ids: integer array `[batch, max_len]`, padded.
    mask: optional boolean `[batch, max_len]`, True for real slots.
    lengths: optional integer `[batch]`: the first `lengths[b]` slots of bag
      `b` are real. Give `mask` or `lengths` (or neither: all slots real).
    mode: `'sum'`, `'mean'` (default, as in PyTorch) or `'max'`.
    per_sample_weights: optional floating `[batch, max_len]` weights, for
      `'sum'` and `'mean'`.
    padding_id: optional id whose slots are not part of any bag.
    dtype: optional dtype of the rows (and result).

  Returns:
    An array `[batch, *row_shape]`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> table = jnp.arange(8.).reshape(4, 2)
    >>> ids = jnp.array([[1, 3, 0], [2, 0, 0]])
    >>> lazy_optax.lookup_bag(table, ids, lengths=jnp.array([2, 1]))
    Array([[4., 5.],
           [4., 5.]], dtype=float32)
    >>> lazy_optax.lookup_bag(table, ids, mode='sum', padding_id=0)
    Array([[ 8., 10.],
           [ 4.,  5.]], dtype=float32)
  """
  return bag_rows(table, ids, mask=mask, lengths=lengths, mode=mode,
                  per_sample_weights=per_sample_weights,
                  padding_id=padding_id, dtype=dtype)
