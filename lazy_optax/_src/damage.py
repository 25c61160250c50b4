"""What a jitted step does when a gradient's row ids were damaged.

Arithmetic on a gradient tree that reaches the id code of a `SparseRows`
(`jax.tree.map(jnp.add, g1, g2)`, `optax.tree.add`, raw `lax.psum` /
`lax.pmean`, `optax.add_noise`, `optax.centralize`, a scale factor below
2**-66) leaves ids that name no row, or the wrong one. Where the code is
concrete that raises at once; under `jax.jit` it can only be seen when the
step runs. Then, by default, the step raises `DamagedIdsError` (carried out
of the compiled program by a host callback that sits in the error branch of
a `lax.cond`, so the normal path holds none; the ids the step writes depend
on its result, so its exception reaches the step's outputs): no step goes
on after a table's update was dropped. `on_damaged_ids('warn')` opts into
the older behaviour: the damaged gradient writes no row, and a
`RuntimeWarning` says so.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, NamedTuple, Optional, TypeVar
import warnings

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from lazy_optax._src import validate

_MODES = ('raise', 'warn')
_T = TypeVar('_T')
_mode = 'raise'


class StepError(ValueError):
  """A step that lazy_optax refused when it ran.

  Attributes:
    outputs: what the step returned, or None. From
      `lazy_optax.perf.make_train_step` these hold, at each donated
      argument's position, the state from before the refused step (it wrote
      nothing): resume from them. From `checks.checked`, see `CheckError`.
  """

  def __init__(self, message: str,
               outputs: Optional[chex.ArrayTree] = None):
    super().__init__(message)
    self.outputs = outputs


class DamagedIdsError(StepError):
  """A jitted step met a `SparseRows` whose row ids arithmetic had changed."""


def on_damaged_ids(mode: str) -> str:
  """Sets what a jitted step does with damaged row ids; returns the old mode.

  The mode is read when a step runs and meets damaged ids, so it applies
  to steps compiled before it was set as well.

  Args:
    mode: `'raise'` (the default: the step raises `DamagedIdsError` when it
      runs, wrapped by JAX in its runtime error) or `'warn'` (an explicit
      opt-in: the damaged gradient writes no row of its table, a
      `RuntimeWarning` says so, and the rest of the step is applied).

  Returns:
    The mode that was set before.

  Example:
    >>> import lazy_optax
    >>> old = lazy_optax.checks.on_damaged_ids('warn')
    >>> lazy_optax.checks.on_damaged_ids(old)
    'warn'
  """
  global _mode
  if mode not in _MODES:
    raise ValueError(f"on_damaged_ids: mode must be one of {_MODES}, got "
                     f'{mode!r}.')
  old, _mode = _mode, mode
  return old


def _report(where: str, total: int, count: ArrayLike) -> np.ndarray:
  # Under `jax.vmap` the `lax.cond` below becomes a select that runs this
  # branch for every member: only a count above zero is damage.
  count = np.asarray(count)
  if count.any():
    message = validate.damaged_ids_message(where, int(count.sum()),
                                           total * max(count.size, 1))
    if _mode != 'warn':
      raise DamagedIdsError(
          message + '\nThe step was stopped: its update of this table would '
          "have been dropped (lazy_optax.checks.on_damaged_ids('warn') lets "
          'it go on without it). ' + DONATED_LOST)
    warnings.warn(message + ' No row was written from these ids.',
                  RuntimeWarning, stacklevel=2)
  return np.zeros(count.shape, np.int32)


def report_if_damaged(all_intact: jax.Array, damaged: jax.Array, where: str,
                      total: int) -> jax.Array:
  """Under a trace: raises (or warns) when the step runs, if `damaged > 0`.

  The host callback sits in the false branch of a `lax.cond`, and what it
  returns (a zero) is returned here, for the caller to fold into the ids it
  writes: the step's outputs then depend on the callback, so its exception
  reaches them on every backend and device count.

  Args:
    all_intact: bool scalar, whether every id is intact.
    damaged: int32 scalar, how many ids are damaged.
    where: what the gradient is, for the message.
    total: how many ids it holds.

  Returns:
    An int32 zero.

  Inside `lazy_optax.perf.make_train_step` (at its trace's level, in the
  default mode 'raise' when traced) the damage is returned as data instead
  (`refuse_when`): the step writes nothing and the helper raises after it
  holds the state.
  """
  def message(count):
    return validate.damaged_ids_message(where, count, total)

  if _mode == 'raise' and refuse_when(~all_intact, DamagedIdsError, message,
                                     count=damaged.astype(jnp.int32)):
    return jnp.zeros((), jnp.int32)

  def report(count):
    return jax.pure_callback(
        lambda n: _report(where, total, n),
        jax.ShapeDtypeStruct((), jnp.int32), count, vmap_method='expand_dims')

  return jax.lax.cond(all_intact, lambda count: jnp.zeros((), jnp.int32),
                      report, damaged.astype(jnp.int32))


DONATED_LOST = (
    'A step jitted with donate_argnums loses the params and optimizer state '
    'it was given when it fails (JAX deletes donated inputs): build it with '
    'lazy_optax.perf.make_train_step, which refuses such a step without '
    'writing and hands that state back on the exception (e.outputs), or do '
    'not donate while debugging.')


# -- errors as data: what make_train_step's compiled step returns ------------

def _trace_state() -> object:
  """An opaque token of the current trace (equal within one trace level);
  None where JAX has no such token (then nothing is recorded)."""
  extend_core = getattr(getattr(jax, 'extend', None), 'core', None)
  get = getattr(extend_core, 'get_opaque_trace_state', None)
  if get is None:  # older JAX
    get = getattr(jax.core, 'get_opaque_trace_state', None)
  return None if get is None else get(convention='nnx')


class _Report(NamedTuple):
  bad: jax.Array                   # bool scalar: this check failed
  error: type                      # the exception to raise
  message: Callable[..., str]      # the message, from the fields' values
  fields: dict[str, jax.Array]     # scalars, read on the host


class Refusals:
  """The checks met while tracing one step, returned from it as data.

  Active (`recording`) while `make_train_step` traces the step: a check at
  the step's trace level is recorded here (`refuse_when`) instead of raising
  from a host callback; row writes at that level send their ids to the "no
  row" sentinel once a check is recorded (`gate`), and note what they wrote
  (`note`), so that the helper can keep every other leaf with a `where`.
  Checks inside a nested transformation (`jax.vmap`, `lax.scan`,
  `shard_map` bodies) keep their usual form.
  """

  def __init__(self) -> None:
    self.top = _trace_state()
    self.reports: list[_Report] = []
    self._notes: dict[int, tuple[object, object, int]] = {}

  def here(self) -> bool:
    return self.top is not None and _trace_state() == self.top

  def failed(self) -> Optional[jax.Array]:
    """Whether any recorded check failed (None: none was recorded)."""
    if not self.reports:
      return None
    return jnp.any(jnp.stack([jnp.asarray(r.bad).reshape(()) for r in
                              self.reports]))

  def note(self, written: object, base: object, seen: int) -> None:
    self._notes[id(written)] = (written, base, seen)

  def unchanged_when_failed(self, out: object, before: object) -> bool:
    """Whether `out` equals `before` when a check failed: it is `before`, or
    was written from it by gated writes that saw every check."""
    while out is not before:
      entry = self._notes.get(id(out))
      if entry is None or entry[0] is not out or entry[2] < len(
          self.reports):
        return False
      out = entry[1]
    return True


_local = threading.local()


def active() -> Optional[Refusals]:
  """The `Refusals` of the step being traced at this level, if any."""
  stack = getattr(_local, 'stack', ())
  if stack and stack[-1].here():
    return stack[-1]
  return None


@contextlib.contextmanager
def recording() -> Iterator[Refusals]:
  """Records the checks of the step traced inside (see `Refusals`)."""
  refusals = Refusals()
  _local.stack = getattr(_local, 'stack', ()) + (refusals,)
  try:
    yield refusals
  finally:
    _local.stack = _local.stack[:-1]


def refuse_when(bad: ArrayLike, error: type, message: Callable[..., str],
                **fields: jax.Array) -> bool:
  """Records a check as data if a step helper traces at this level.

  Args:
    bad: bool scalar, whether the check failed.
    error: the exception class to raise (a `StepError`).
    message: makes the message from the fields' host values.
    **fields: integer scalars the message needs.

  Returns:
    Whether it was recorded (False: the caller reports it its own way).
  """
  refusals = active()
  if refusals is None:
    return False
  refusals.reports.append(_Report(jnp.asarray(bad), error, message, fields))
  return True


def gate(ids: jax.Array, num_rows: int) -> tuple[jax.Array, Optional[int]]:
  """`ids`, all `num_rows` (no row) when a recorded check failed.

  Returns:
    The ids and how many checks they saw (None: no step helper here).
  """
  refusals = active()
  if refusals is None:
    return ids, None
  failed = refusals.failed()
  if failed is not None:
    ids = jnp.where(failed, jnp.asarray(num_rows, ids.dtype), ids)
  return ids, len(refusals.reports)


def note(written: _T, base: object, seen: Optional[int]) -> _T:
  """Notes that `written` is `base` with gated writes only; returns it."""
  refusals = active()
  if refusals is not None and seen is not None:
    refusals.note(written, base, seen)
  return written
