"""Guards against wrong use: checked ids under jit, misplaced transforms.

Three kinds of checks live here.

* Trace-time checks of a `SparseRows` gradient against its parameter, for
  what the `SparseRows` constructor cannot see: a gradient rebuilt by a
  `jax.tree.map` (which skips the constructor) with ids turned into floats or
  reshaped, or a parameter that cannot be updated row by row.
* A guard in `optax.chain`: a plain optax transformation placed after (or
  before) a lazy one sees `SparseRows` and maps over their ids as if they were
  numbers (scaling, clipping, norms). `lazy(...)` looks at the chain that calls
  it and raises, telling to put the whole chain inside `lazy(...)`. What it
  cannot see (a chain built some other way) is still caught at apply time when
  the ids stopped being integers.
* An opt-in checked mode for ids under `jax.jit`, where an out-of-range id
  touches no row without a word: `check_ids_in_range` records
  `jax.experimental.checkify` checks, `with_id_checks(tx)` runs them on every
  gradient it gets, and `checked(fn)` runs a function with its checks and
  raises `CheckError` when one failed.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import optax

from lazy_optax._src.sparse_rows import SparseRows, is_sparse_rows


# -- trace-time checks of one gradient leaf ---------------------------------

def check_sparse_gradient(grad: SparseRows, param: Any, path: str) -> None:
  """Raises if `grad` cannot be a row-sparse gradient of `param`.

  Complements the `SparseRows` constructor, which a `jax.tree.map` bypasses:
  the ids must still be an integer vector with one value row per id, and the
  parameter, when given, must be a floating array whose kind (real or
  complex) matches the values. Floating widths may differ (a bfloat16 table
  with float32 gradients computes in the wider dtype and stores the
  parameter's).

  Args:
    grad: the `SparseRows` gradient.
    param: the parameter (or `None` when `update` got no params).
    path: the parameter's path, for messages.

  Raises:
    TypeError: ids that are not integers, values or parameter of a wrong
      dtype.
    ValueError: ids that are not a vector, values without one row per id.
  """
  ids, values = grad.indices, grad.values
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
        f'The SparseRows gradient of parameter {path} has ids of dtype '
        f'{ids.dtype}: ids must be integers. A plain optax transformation '
        'placed before a lazy one treats the ids as numbers (scales, clips '
        'or normalizes them): put it inside lazy_optax.lazy(...).')
  if ids.ndim != 1:
    raise ValueError(
        f'The SparseRows gradient of parameter {path} has ids of shape '
        f'{tuple(ids.shape)}: ids must be a vector of shape [N].')
  if values.ndim < 1 or values.shape[0] != ids.shape[0]:
    raise ValueError(
        f'The SparseRows gradient of parameter {path} has {ids.shape[0]} ids '
        f'but values of shape {tuple(values.shape)}: values need one row per '
        'id.')
  if param is None:
    return
  dtype = getattr(param, 'dtype', None)
  if dtype is None:
    dtype = jnp.asarray(param).dtype
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise TypeError(
        f'Parameter {path} has dtype {dtype}: only floating parameters can '
        'take a SparseRows gradient.')
  if (jnp.issubdtype(dtype, jnp.complexfloating)
      != jnp.issubdtype(values.dtype, jnp.complexfloating)):
    raise TypeError(
        f'Parameter {path} has dtype {dtype} but its SparseRows gradient has '
        f'values of dtype {values.dtype}: one is complex, the other real.')


def tree_difference(a: Any, b: Any, a_name: str = 'the gradients',
                    b_name: str = 'the parameters') -> str:
  """Says where two trees that should match differ, by path.

  Args:
    a: one tree (`SparseRows` count as leaves).
    b: the other tree.
    a_name: what `a` is, for the message.
    b_name: what `b` is, for the message.

  Returns:
    A phrase naming the first path found only in `a` and the first found
    only in `b`, or both tree structures when the paths agree.
  """
  def paths(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sparse_rows)
    return [jax.tree_util.keystr(p) for p, _ in flat[0]]

  a_paths, b_paths = paths(a), paths(b)
  only_a = [p for p in a_paths if p not in set(b_paths)]
  only_b = [p for p in b_paths if p not in set(a_paths)]
  parts = [f'{len(only)} path(s) only in {name}, first {only[0]}'
           for only, name in ((only_a, a_name), (only_b, b_name)) if only]
  if not parts:
    return (f'{a_name} are {jax.tree.structure(a, is_leaf=is_sparse_rows)}, '
            f'{b_name} are {jax.tree.structure(b, is_leaf=is_sparse_rows)}')
  return '; '.join(parts)


# -- the chain guard ----------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _chain_codes() -> tuple[Any, Any]:
  return (optax.chain(optax.identity()).update.__code__,
          optax.named_chain(('identity', optax.identity())).update.__code__)


def _closure(fn: Any) -> dict[str, Any]:
  code, cells = getattr(fn, '__code__', None), getattr(fn, '__closure__', None)
  if code is None or cells is None:
    return {}
  try:
    return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}
  except ValueError:  # an empty cell
    return {}


@functools.lru_cache(maxsize=None)
def _extra_args_wrapper_code() -> Any:
  plain = optax.GradientTransformation(lambda p: (),
                                       lambda u, s, p=None: (u, s))
  return optax.with_extra_args_support(plain).update.__code__


def _unwrap(update_fn: Any) -> Any:
  """The update function under `optax.with_extra_args_support`'s wrapper."""
  while getattr(update_fn, '__code__', None) is _extra_args_wrapper_code():
    inner = _closure(update_fn).get('tx')
    if inner is None:
      break
    update_fn = inner.update
  return update_fn


def _is_plain_optax(update_fn: Any) -> bool:
  """Whether a transformation from plain optax would map over `SparseRows`.

  An optax chain counts when one of its members does. Transformations from
  lazy_optax and from elsewhere are trusted to know `SparseRows`.
  """
  chain_code, named_code = _chain_codes()
  update_fn = _unwrap(update_fn)
  code = getattr(update_fn, '__code__', None)
  if code is chain_code:
    return any(map(_is_plain_optax, _closure(update_fn).get('update_fns', ())))
  if code is named_code:
    return any(_is_plain_optax(t.update)
               for _, t in _closure(update_fn).get('transforms', ()))
  module = getattr(update_fn, '__module__', None) or ''
  return module == 'optax' or module.startswith('optax.')


def _describe(update_fn: Any, name: Optional[str]) -> str:
  update_fn = _unwrap(update_fn)
  qualname = getattr(update_fn, '__qualname__', repr(update_fn))
  maker = qualname.split('.<locals>')[0]
  module = getattr(update_fn, '__module__', '') or ''
  if module.startswith('optax'):
    maker = f'optax.{maker}'
  return f'{maker} ({name!r})' if name is not None else maker


def _chain_level(frame: Any) -> Optional[tuple[list[Any], list[Any], int]]:
  """The transforms of the chain running in `frame` and the current one."""
  chain_code, named_code = _chain_codes()
  try:
    local = frame.f_locals
    if frame.f_code is chain_code:
      fns = list(local['update_fns'])
      names = [None] * len(fns)
      current = local['fn']
    elif frame.f_code is named_code:
      pairs = list(local['transforms'])
      fns = [t.update for _, t in pairs]
      names = [n for n, _ in pairs]
      current = local['tx'].update
    else:
      return None
    position = next(i for i, f in enumerate(fns) if f is current)
  except (KeyError, StopIteration, TypeError, AttributeError):
    return None
  return fns, names, position


def check_chain_neighbours(sparse_paths: Sequence[str], depth: int = 2) -> None:
  """Raises if a plain optax transformation shares a chain with a lazy one.

  Called by `lazy(...)` while it updates `SparseRows` gradients. It looks at
  the `optax.chain` or `optax.named_chain` (and the chains around it) that
  called the lazy transformation; a transformation from plain optax before
  it saw the `SparseRows` gradients, one after it sees the `SparseRows`
  updates, and both treat the row ids as numbers. Other lazy transformations
  are fine. Nothing is checked when the caller is not a chain.

  Args:
    sparse_paths: paths of the parameters with `SparseRows` gradients.
    depth: how many frames up the lazy transformation's caller is.

  Raises:
    TypeError: naming the offending transformation and what to do.
  """
  try:
    frame = sys._getframe(depth)  # pylint: disable=protected-access
  except ValueError:
    return
  while frame is not None:
    level = _chain_level(frame)
    if level is None:
      return
    fns, names, position = level
    for i, fn in enumerate(fns):
      if i == position or not _is_plain_optax(fn):
        continue
      where = 'after' if i > position else 'before'
      raise TypeError(
          f'{_describe(fn, names[i])} sits {where} a lazy_optax.lazy(...) '
          f'transformation in an optax chain (positions {i} and {position}), '
          'so it would see SparseRows of parameter(s) '
          f'{", ".join(sparse_paths)} and treat their row ids as numbers. '
          'Wrap the whole chain in lazy_optax.lazy(optax.chain(...)) instead: '
          'then every transformation runs on the touched rows.')
    frame = frame.f_back


# -- checked mode for ids under jit -------------------------------------------

def check_ids_in_range(tree: Any) -> None:
  """Records a `checkify` check that every `SparseRows` id is in range.

  Under `jax.jit` an out-of-range id (a negative one too) touches no row and
  says nothing; this makes it say so. Call it inside a function that runs
  under `jax.experimental.checkify.checkify` (or `checked`); outside of jit it
  raises at once. The message names the parameter path, the first bad id,
  its position and how many ids are bad.

  Args:
    tree: a tree whose `SparseRows` leaves are checked (gradients, updates).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> def f(ids):
    ...   g = {'t': lazy_optax.SparseRows(ids, jnp.ones((2, 1)), 4)}
    ...   lazy_optax.check_ids_in_range(g)
    ...   return g['t'].to_dense()
    >>> _ = lazy_optax.checked(jax.jit(f))(jnp.array([1, 3]))
    >>> lazy_optax.checked(jax.jit(f))(jnp.array([1, 9]))
    Traceback (most recent call last):
    ...
    lazy_optax...CheckError: SparseRows for parameter ['t']: id 9 at ...
  """
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sparse_rows)[0]
  for path, leaf in flat:
    if not isinstance(leaf, SparseRows) or leaf.indices.shape[0] == 0:
      continue
    ids = leaf.indices
    bad = (ids < 0) | (ids >= leaf.num_rows)
    first = jnp.argmax(bad)
    where = jax.tree_util.keystr(path).replace('{', '{{').replace('}', '}}')
    checkify.check(
        ~jnp.any(bad),
        f'SparseRows for parameter {where}: id {{id}} at position {{pos}} is '
        f'out of range for a table of {leaf.num_rows} rows ({{count}} ids out '
        'of range in all); under jit such ids touch no row.',
        id=ids[first], pos=first, count=jnp.sum(bad))


def with_id_checks(
    tx: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """`tx`, checking the ids of every `SparseRows` gradient it gets.

  The opt-in checked mode: the returned transformation has `tx`'s state and
  updates, and its `update` records `check_ids_in_range` on the gradients.
  Run the train step with `checked` (or `checkify.checkify`) to get the
  report; the step's results are those of `tx`, with out-of-range ids
  touching no row. Under `jax.jit` JAX refuses to trace a step that uses it
  outside `checked` ("a checkify.check which was not functionalized").

  Args:
    tx: an optax transformation, typically a lazy one.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `tx`'s state.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> tx = lazy_optax.with_id_checks(lazy_optax.lazy_adam(0.1))
    >>> params = {'t': jnp.zeros((4, 2))}
    >>> @jax.jit
    ... def step(params, state, ids):
    ...   g = {'t': lazy_optax.SparseRows(ids, jnp.ones((2, 2)), 4)}
    ...   updates, state = tx.update(g, state, params)
    ...   return lazy_optax.apply_updates(params, updates), state
    >>> try:
    ...   lazy_optax.checked(step)(params, tx.init(params), jnp.array([0, -1]))
    ... except lazy_optax.CheckError as e:
    ...   print(str(e).split(':')[0])
    ...   params, state = e.outputs
    SparseRows for parameter ['t']
  """
  inner = optax.with_extra_args_support(tx)

  def update_fn(updates, state, params=None, **extra_args):
    check_ids_in_range(updates)
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


class CheckError(ValueError):
  """A check recorded under `checked` failed.

  Attributes:
    outputs: what the checked function returned. With out-of-range ids these
      are valid results (the bad ids touched no row), so training can go on
      from them even when the inputs were donated.
  """

  def __init__(self, message: str, outputs: Any):
    super().__init__(message)
    self.outputs = outputs


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Runs `fn` with its `checkify` checks and raises if one failed.

  `fn` may be jitted (with donated arguments) or not; the checks recorded by
  `check_ids_in_range` and `with_id_checks` inside it (and any other
  `checkify.check`) are carried out of jit and raised here.

  Args:
    fn: the function to run, typically a train step.

  Returns:
    A function with `fn`'s signature and outputs that raises `CheckError`
    (carrying the outputs) when a check failed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> def f(ids):
    ...   lazy_optax.check_ids_in_range(lazy_optax.SparseRows(ids,
    ...                                 jnp.ones((1, 1)), 3))
    ...   return ids
    >>> lazy_optax.checked(jax.jit(f))(jnp.array([2]))
    Array([2], dtype=int32)
  """
  checked_fn = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    error, outputs = checked_fn(*args, **kwargs)
    message = error.get()
    if message is not None:
      raise CheckError(message, outputs)
    return outputs

  return wrapper
