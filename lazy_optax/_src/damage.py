"""What a jitted step does when a gradient's row ids were damaged.

Arithmetic on a gradient tree that reaches the id code of a `SparseRows`
(`jax.tree.map(jnp.add, g1, g2)`, `optax.tree.add`, raw `lax.psum` /
`lax.pmean`, `optax.add_noise`, `optax.centralize`, a scale factor below
2**-66) leaves ids that name no row, or the wrong one. Where the code is
concrete that raises at once; under `jax.jit` it can only be seen when the
step runs. Then, by default, the step raises `DamagedIdsError` (carried out
of the compiled program by a host callback that sits in the error branch of
a `lax.cond`, so the normal path holds none): no step goes on after a
table's update was dropped. `on_damaged_ids('warn')` opts into the older
behaviour: the damaged gradient writes no row, and a `RuntimeWarning` says so.
"""

from __future__ import annotations

from typing import Any
import warnings

import jax
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


def _report(where: str, total: int, count: Any) -> None:
  # Under `jax.vmap` the `lax.cond` below becomes a select that runs this
  # branch for every member: only a count above zero is damage.
  count = np.asarray(count)
  if not count.any():
    return
  message = validate.damaged_ids_message(where, int(count.sum()),
                                         total * max(count.size, 1))
  if _mode == 'warn':
    warnings.warn(message + ' No row was written from these ids.',
                  RuntimeWarning, stacklevel=2)
    return
  raise DamagedIdsError(
      message + ' The step was stopped: its update of this table would have '
      "been dropped (lazy_optax.checks.on_damaged_ids('warn') lets it go on "
      'without it).')


def report_if_damaged(all_intact: jax.Array, damaged: jax.Array, where: str,
                      total: int) -> None:
  """Under a trace: raises (or warns) when the step runs, if `damaged > 0`.

  Args:
    all_intact: bool scalar, whether every id is intact.
    damaged: int scalar, how many ids are damaged.
    where: what the gradient is, for the message.
    total: how many ids it holds.
  """
  def report(count):
    jax.debug.callback(lambda n: _report(where, total, n), count)

  jax.lax.cond(all_intact, lambda count: None, report, damaged)
