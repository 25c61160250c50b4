"""Checks of user input, one function per kind, one wording each.

Every message says what was wrong, where (`where` is a phrase such as
`'parameter emb/table'` or `'SparseRows'`) and, where there is one, what to
do instead.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Mapping, Optional, Sequence
import warnings

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import numpy as np

_FIX = ('combine gradient trees with lazy_optax.tree.add(g1, g2), across '
        'devices with lazy_optax.tree.psum or lazy_optax.tree.pmean, and '
        'scale them with lazy_optax.tree.scale')

_COMBINE = (
    'On a tree of gradients (a dict, a list, a model): '
    'lazy_optax.tree.add(g1, g2) adds dense leaves and concatenates the '
    'rows of SparseRows leaves (g1 + g2 does that for two SparseRows only); '
    'lazy_optax.tree.psum(grads, axis) and lazy_optax.tree.pmean(grads, '
    'axis) combine devices; lazy_optax.tree.scale(grads, s) scales; '
    'jax.tree.map(lambda g: g.astype(dtype), grads, '
    'is_leaf=lazy_optax.tree.is_sparse_rows) casts the values only; plain '
    'optax transformations go inside lazy_optax.lazy(optax.chain(...)).')


def damaged_ids_message(where: str, count: int | str, total: int) -> str:
  """The message for ids changed by arithmetic on the gradient tree.

  Its first line says what happened and what to write instead.
  """
  return (
      f'The row ids of {where} were changed by arithmetic on the gradient '
      f'tree ({count} of {total} ids damaged): {_FIX}.\n'
      'What damages them: jax.tree.map of add, subtract or mean '
      '(jax.tree.map(jnp.add, g1, g2)), optax.tree.add, lax.psum, lax.pmean, '
      'a cast, added noise, or a scale factor of magnitude below 2**-66 '
      '(about 1.4e-20, which flushes the ids to zero). Accumulating into '
      'jax.tree.map(jnp.zeros_like, grads) damages them too: start from the '
      f'first gradients instead. {_COMBINE}')


def reduced_values_message(where: str, axes: Iterable[Hashable]) -> str:
  """The message for values summed across devices while the ids were not."""
  return (
      f'The values of {where} do not vary over the mesh axes {list(axes)} '
      'while its row ids do: inside jax.shard_map (check_vma=True) autodiff '
      'already summed the gradient of a replicated input across devices, so '
      "each device's ids would get other devices' values. Build the gradient "
      'with lazy_optax.value_and_grad (or differentiate with respect to the '
      'looked-up rows, which vary with the ids), then combine devices with '
      'lazy_optax.tree.psum or lazy_optax.tree.pmean.')


SPARSE_ROWS_CLASS_HINT = (
    "<class 'lazy_optax.SparseRows'> (a row-sparse gradient of the "
    'parameter at that key path, which code that pairs it with a dense '
    'tree cannot take: apply updates with lazy_optax.apply_updates '
    '(Equinox: lazy_optax.equinox.apply_updates, not '
    'eqx.apply_updates), give a table that optax.partition routes to a '
    'plain optax optimizer a lazy one (lazy_optax.lazy(...)), use '
    'lazy_optax.wrappers.multi_steps instead of optax.MultiSteps and '
    'lazy_optax.tree.path_labels as the label function of optax.partition, '
    'and put other transformations inside lazy_optax.lazy(...))')


class SparseRowsClass(type):
  """`SparseRows`'s metaclass: a class repr with a hint, for JAX's pytree
  structure errors to print."""

  def __repr__(cls) -> str:
    return SPARSE_ROWS_CLASS_HINT


MISSING = object()   # an argument not given


def sparse_rows_arguments(ids: object, values: object, rows: object,
                          indices: object,
                          impl: object) -> tuple[jax.Array, jax.Array, int]:
  """`SparseRows(...)`'s arguments, checked: `(ids, values, num_rows)`.

  Concrete ids and values come back as arrays (the ids with all their bits:
  checked in range before any cast).
  """
  ids = _ids_argument(ids, indices, values, rows)
  rows = num_rows(rows)
  given = ids
  ids = ids if isinstance(ids, jax.core.Tracer) else jnp.asarray(ids)
  values = (values if isinstance(values, jax.core.Tracer)
            else jnp.asarray(values))
  index_vector(ids, 'SparseRows')
  one_row_per_index(ids.shape[0], values, 'SparseRows')
  if not isinstance(ids, jax.core.Tracer):
    indices_in_range(given, rows, 'SparseRows')
  ignored_impl(impl, 'SparseRows', GRADIENT_MOVES)
  return ids, values, rows


def _ids_argument(ids: object, indices: object, values: object,
                 rows: object) -> object:
  """`SparseRows`'s ids, given as `ids` or as the deprecated `indices`."""
  if indices is not MISSING:
    if ids is not MISSING:
      raise TypeError('SparseRows: pass the row ids once, as ids (indices '
                      'is its deprecated name).')
    warnings.warn(
        'SparseRows(indices=...) is deprecated and will be removed after '
        'lazy_optax 0.2: use SparseRows(ids=...).', DeprecationWarning,
        stacklevel=4)   # the caller of SparseRows(...)
    ids = indices
  for name, given in (('ids', ids), ('values', values), ('num_rows', rows)):
    if given is MISSING:
      raise TypeError(f'SparseRows() missing required argument: {name!r}.')
  return ids


def parts_of_one_table(
    shapes: Sequence[Optional[tuple[int, ...]]]) -> None:
  """`SparseRows.concatenate`'s parts: `SparseRows` (shape) of one table."""
  if not shapes or any(shape is None for shape in shapes):
    raise TypeError('SparseRows.concatenate takes a non-empty sequence of '
                    'SparseRows.')
  for shape in shapes[1:]:
    if shape != shapes[0]:
      raise ValueError(
          'SparseRows.concatenate: the parts stand for arrays of different '
          f'shapes, {shapes[0]} and {shape}; only gradients of one table can '
          'be combined.')


def num_rows(value: object) -> int:
  """A static, non-negative row count."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(
        f'SparseRows: num_rows must be a static Python int, got {value!r}.')
  if value < 0:
    raise ValueError(f'SparseRows: num_rows must be >= 0, got {value}.')
  return int(value)


def integer_ids(ids: ArrayLike, where: str) -> None:
  """Row ids (of any shape) must have an integer dtype."""
  dtype = jnp.result_type(ids)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(
        f'{where}: row ids must have an integer dtype, got {dtype}.')


def index_vector(ids: ArrayLike, where: str) -> None:
  """Ids must be an integer vector `[N]`."""
  integer_ids(ids, where)
  if jnp.ndim(ids) != 1:
    raise ValueError(
        f'{where}: row ids must be a vector of shape [N], got shape '
        f'{tuple(jnp.shape(ids))}.')


def one_row_per_index(count: int, values: ArrayLike, where: str) -> None:
  """Values `[count, *row_shape]`: one row per id."""
  shape = tuple(jnp.shape(values))
  if len(shape) < 1 or shape[0] != count:
    raise ValueError(
        f'{where}: values must have one row per id: {count} ids but values '
        f'of shape {shape}.')


def out_of_range_message(where: str, num_rows: int) -> str:
  """The out-of-range message, with `{id}`, `{position}` and `{count}` fields.

  One wording for eager errors (`str.format`) and checked mode (`checkify`
  formats the same fields).
  """
  where = where.replace('{', '{{').replace('}', '}}')
  return (f'{where}: id {{id}} at position {{position}} is out of range for '
          f'a table of {num_rows} rows ({{count}} ids out of range in all); '
          f'ids outside [0, {num_rows}) touch no row: map ids into the '
          'table before the lookup (lazy_optax.IdTable maps unbounded ids '
          'to rows), or give it more rows.')


def indices_in_range(ids: object, num_rows: int, where: str) -> None:
  """Concrete ids must lie in `[0, num_rows)`; names the first bad one.

  Ids spread over several processes cannot be read here (each process holds
  only its part); like traced ids, they touch no row where out of range.
  """
  if isinstance(ids, jax.Array) and not ids.is_fully_addressable:
    return
  host = np.asarray(ids)
  if not host.size:
    return
  bad = np.flatnonzero((host < 0) | (host >= num_rows))
  if bad.size:
    raise ValueError(out_of_range_message(where, num_rows).format(
        id=int(host[bad[0]]), position=int(bad[0]), count=bad.size))


def ids_fit_jax(ids: ArrayLike | Sequence[int], num_rows: int,
                where: str) -> None:
  """Concrete host ids must survive the cast to JAX's integer dtype.

  Without `jax_enable_x64`, `jnp.asarray` cuts NumPy int64 ids to int32
  silently (`2**32 + 3` becomes `3`, a row of the table). Such an id is out
  of range for any table whose rows JAX can index, so it is refused here,
  on the host, before any cast, with the out-of-range message.
  """
  if isinstance(ids, (jax.Array, jax.core.Tracer)):
    return
  host = np.asarray(ids)
  if host.dtype.kind not in 'iu' or not host.size:
    return
  target = np.dtype(jax.dtypes.canonicalize_dtype(host.dtype))
  if target == host.dtype:
    return
  info = np.iinfo(target)
  lost = (host < info.min) | (host > info.max)
  if lost.any():
    first = int(np.flatnonzero(lost.reshape(-1))[0])
    position = np.asarray(np.unravel_index(first, host.shape))
    raise ValueError(out_of_range_message(where, num_rows).format(
        id=int(host.reshape(-1)[first]), position=position,
        count=int(lost.sum())))


def id_code_structure(code: ArrayLike, values: ArrayLike, width: int,
                      where: str) -> None:
  """What a tree-wide cast or reshape of a `SparseRows` shows at trace time."""
  dtype = jnp.result_type(code)
  if dtype != jnp.float32:
    raise TypeError(
        f'The row ids of {where} were cast to {dtype} by an operation on the '
        'gradient tree: cast the values only, jax.tree.map(lambda g: '
        'g.astype(dtype), grads, is_leaf=lazy_optax.tree.is_sparse_rows).\n'
        f'{_COMBINE}')
  shape = tuple(jnp.shape(code))
  if len(shape) != 2 or shape[1] != width:
    raise ValueError(
        f'The row ids of {where} were reshaped to {shape} by an operation on '
        f'the gradient tree: {_FIX}.\n{_COMBINE}')
  one_row_per_index(shape[0], values, where)


def same_shape(got: tuple[int, ...], expected: tuple[int, ...],
               where: str) -> None:
  """A parameter and its update or gradient have the same dense shape."""
  if tuple(got) != tuple(expected):
    raise ValueError(
        f'{where[0].upper()}{where[1:]} has shape {tuple(got)} but its '
        f'SparseRows is for shape {tuple(expected)}.')


_RANGES = {
    'beta': ('in [0, 1)', lambda x: 0 <= x < 1),
    'non_negative': ('>= 0', lambda x: x >= 0),
    'positive': ('> 0', lambda x: x > 0),
    'non_positive': ('<= 0', lambda x: x <= 0),
}


def hyperparameters(fn: str, **kinds: Mapping[str, object]) -> None:
  """Checks an optimizer's hyperparameters that are Python numbers.

  One place and one wording for every optimizer: `'{fn}: {name} must be
  in [0, 1), got {value}.'`. Arrays, traced values and schedules pass.

  Args:
    fn: the public function's name, for the message.
    **kinds: for each kind of range (`beta` for [0, 1), `non_negative`,
      `positive`, `non_positive`), a dict of argument name to value.

  Raises:
    ValueError: naming the first argument out of its range.
  """
  for kind, values in kinds.items():
    wording, ok = _RANGES[kind]
    for name, value in values.items():
      if (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, bool) and not ok(value)):
        raise ValueError(f'{fn}: {name} must be {wording}, got {value!r}.')


def floating(dtype: DTypeLike, where: str, what: str = 'gradients') -> None:
  """Gradients (and parameters with row-sparse gradients) are floating."""
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise TypeError(f'{where} has dtype {dtype}; {what} must be floating '
                    'point.')



IMPLS = ('auto', 'generic', 'xla', 'cpu_kernel')

# Why a gradient's `impl=` decides nothing (`SparseRows`, `value_and_grad`).
GRADIENT_MOVES = ("a gradient's rows move with XLA's ops until lazy(...) "
                  'decides its table')


def impl_argument(impl: object, where: str) -> None:
  """`impl` must be one of `IMPLS`."""
  if impl not in IMPLS:
    raise ValueError(f'{where}: impl must be one of {IMPLS}, got {impl!r}.')


def ignored_impl(impl: object, where: str, why: str,
                 stacklevel: int = 4) -> None:
  """An `impl=` that no longer decides anything: checked, and deprecated
  when given (`why` says what decides instead)."""
  impl_argument(impl, where)
  if impl != 'auto':
    warnings.warn(
        f"{where}(impl='{impl}') has no effect: {why}; pass impl= to "
        'lazy(...) or to the optimizer. The argument goes in lazy_optax 0.3.',
        DeprecationWarning, stacklevel=stacklevel)
