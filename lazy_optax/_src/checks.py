"""The opt-in checked mode: row-id problems reported under `jax.jit`.

Under `jax.jit` an out-of-range id, or an id damaged by arithmetic on the
gradient tree, touches no row; when the ids are concrete the same problems
raise at once. The checked mode makes the jitted case speak too:
`check_ids_in_range` records `jax.experimental.checkify` checks,
`with_id_checks(tx)` runs them on every gradient it gets, and `checked(fn)`
runs a function with its checks and raises `CheckError` when one failed.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, ParamSpec, TypeVar

import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import optax

from lazy_optax._src import damage
from lazy_optax._src import id_code
from lazy_optax._src import validate
from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows

_P = ParamSpec('_P')
_T = TypeVar('_T')

# -- checked mode for ids under jit -------------------------------------------

def check_ids_in_range(tree: chex.ArrayTree) -> None:
  """Records `checkify` checks that `SparseRows` ids are intact and in range.

  Under `jax.jit` an out-of-range id (a negative one too), or ids damaged by
  arithmetic on the gradient tree (see `SparseRows`), touch no row; this
  makes them say so. Call it inside a function that runs
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
    ...   lazy_optax.checks.check_ids_in_range(g)
    ...   return g['t'].to_dense()
    >>> _ = lazy_optax.checks.checked(jax.jit(f))(jnp.array([1, 3]))
    >>> lazy_optax.checks.checked(jax.jit(f))(jnp.array([1, 9]))
    Traceback (most recent call last):
    ...
    lazy_optax...CheckError: SparseRows for parameter t: id 9 at ...
  """
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sparse_rows)[0]
  for path, leaf in flat:
    if not isinstance(leaf, SparseRows) or leaf.num_ids == 0:
      continue
    where = f'parameter {path_name(path)}'
    leaf.check(where)
    decoded = leaf.decoded()
    damaged = id_code.damaged(decoded, leaf.values)
    _check(~jnp.any(damaged),
           validate.damaged_ids_message(
               where.replace('{', '{{').replace('}', '}}'), '{count}',
               leaf.num_ids),
           count=jnp.sum(damaged))
    ids = decoded.ids
    # Id num_rows is the slot that names no row (padding, masked bag slots,
    # unused deduplication slots): not an error.
    bad = decoded.intact & ((ids < 0) | (ids > leaf.num_rows))
    first = jnp.argmax(bad)
    _check(~jnp.any(bad),
           validate.out_of_range_message(f'SparseRows for {where}',
                                         leaf.num_rows),
           id=ids[first], position=first, count=jnp.sum(bad))


_NOT_FUNCTIONALIZED = (
    '{what} records checks that only a checked step can run: under jax.jit '
    'wrap the step with lazy_optax.checks.checked(jax.jit(step)) or build '
    'it with lazy_optax.perf.make_train_step(step) (which also keeps the '
    'donated state when a check fails){alternative}.\nOtherwise JAX fails '
    'when it compiles the step: "Cannot abstractly evaluate a checkify.check '
    'which was not functionalized".')


_checking = threading.local()   # how many `checked` calls are tracing


def _check(ok: jax.Array, message: str, what: str = '',
           alternative: str = '', **fields: Any) -> None:
  """`checkify.check`, or a check returned as data inside
  `make_train_step`. With `what`, a traced check outside `checked` (where
  JAX would fail only when it lowers the step, with its own words) raises
  an error that names the fix."""
  if damage.refuse_when(~ok, CheckError,
                        lambda **values: message.format(**values),
                        **fields):
    return
  if (what and not getattr(_checking, 'depth', 0)
      and isinstance(ok, jax.core.Tracer)):
    raise ValueError(_NOT_FUNCTIONALIZED.format(what=what,
                                                alternative=alternative))
  checkify.check(ok, message, **fields)


def check_id_table_room(no_room: jax.Array, live: jax.Array,
                        capacity: int) -> None:
  """Records a `checkify` check that every looked-up id got a row.

  Used by `IdTable(checked=True).assign`: lookups left without a row for
  lack of room (a full probe window, a full table) are reported under
  `checked`, naming how many and how full the table is.

  Args:
    no_room: int32 scalar, the lookups of this call that found no room.
    live: int32 scalar, the live ids after the call.
    capacity: the table's slot count.
  """
  _check(
      no_room == 0,
      'IdTable: {no_room} looked-up ids got no row (slot capacity) for lack '
      f'of room: give it more capacity than {capacity} slots, a larger probe, '
      "an eviction policy other than 'none', or a ttl.\n{{live}} of "
      f'{capacity} slots hold live ids: the table or its probe windows are '
      'full.',
      what='IdTable(checked=True)',
      alternative=', or drop checked=True',
      no_room=no_room, live=live)


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
    >>> tx = lazy_optax.checks.with_id_checks(lazy_optax.lazy_adam(0.1))
    >>> params = {'t': jnp.zeros((4, 2))}
    >>> @jax.jit
    ... def step(params, state, ids):
    ...   g = {'t': lazy_optax.SparseRows(ids, jnp.ones((2, 2)), 4)}
    ...   updates, state = tx.update(g, state, params)
    ...   return lazy_optax.apply_updates(params, updates), state
    >>> try:
    ...   lazy_optax.checks.checked(step)(params, tx.init(params),
    ...                                   jnp.array([0, -1]))
    ... except lazy_optax.checks.CheckError as e:
    ...   print(str(e).split(':')[0])
    ...   params, state = e.outputs
    SparseRows for parameter t
  """
  inner = optax.with_extra_args_support(tx)

  def update_fn(updates, state, params=None, **extra_args):
    check_ids_in_range(updates)
    # The checks above report damaged ids as a CheckError; `tx` gets ids
    # that name no row in their place, so the step itself does not raise.
    updates = jax.tree_util.tree_map_with_path(
        _reported, updates, is_leaf=is_sparse_rows)
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def _reported(path: jax.tree_util.KeyPath,
              leaf: chex.ArrayTree) -> chex.ArrayTree:
  if not isinstance(leaf, SparseRows):
    return leaf
  ids = leaf.safe_ids(f'parameter {path_name(path)}', report=False)
  return SparseRows.from_unique(ids, leaf.values, leaf.num_rows)


class CheckError(damage.StepError):
  """A check recorded under `checked` (or in `make_train_step`) failed.

  Attributes:
    outputs: what the checked function returned. Under `checked` the bad
      ids touched no row, but the step's other updates (dense leaves, other
      tables, the step count) were applied. From
      `lazy_optax.perf.make_train_step` the step wrote nothing: the donated
      arguments' positions hold the state from before it, and resuming from
      them equals a run without that step.
  """


def checked(fn: Callable[_P, _T]) -> Callable[_P, _T]:
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
    ...   lazy_optax.checks.check_ids_in_range(lazy_optax.SparseRows(ids,
    ...                                 jnp.ones((1, 1)), 3))
    ...   return ids
    >>> lazy_optax.checks.checked(jax.jit(f))(jnp.array([2]))
    Array([2], dtype=int32)
  """
  checked_fn = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    _checking.depth = getattr(_checking, 'depth', 0) + 1
    try:
      error, outputs = checked_fn(*args, **kwargs)
    finally:
      _checking.depth -= 1
    message = error.get()
    if message is not None:
      raise CheckError(message, outputs)
    return outputs

  return wrapper
