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

from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import validate

_MODES = ('raise', 'warn')
_mode = 'raise'


class DamagedIdsError(ValueError):
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


def _report(where: str, total: int, count: Any) -> np.ndarray:
  # Under `jax.vmap` the `lax.cond` below becomes a select that runs this
  # branch for every member: only a count above zero is damage.
  count = np.asarray(count)
  if count.any():
    message = validate.damaged_ids_message(where, int(count.sum()),
                                           total * max(count.size, 1))
    if _mode != 'warn':
      raise DamagedIdsError(
          message + ' The step was stopped: its update of this table would '
          "have been dropped (lazy_optax.checks.on_damaged_ids('warn') lets "
          'it go on without it).')
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
  """
  def report(count):
    return jax.pure_callback(
        lambda n: _report(where, total, n),
        jax.ShapeDtypeStruct((), jnp.int32), count, vmap_method='expand_dims')

  return jax.lax.cond(all_intact, lambda count: jnp.zeros((), jnp.int32),
                      report, damaged.astype(jnp.int32))
