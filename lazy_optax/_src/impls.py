"""Which row-update implementations this machine has, and which runs where."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax

from lazy_optax._src import cpu_kernels
from lazy_optax._src import fused


class ImplStatus(NamedTuple):
  """Whether an implementation is available, and from where or why not."""
  available: bool
  detail: str


def kernel_status() -> dict[str, ImplStatus]:
  """Says which row-update implementations this machine has, and why not.

  `lazy(...)` updates the touched rows of each table with one of:

  - `'generic'`: its gather, the transformation on the row blocks, and its
    write-back. Any optax transformation, any platform.
  - `'xla'`: a lazy_optax rule's row update written by XLA, the step
    computed from the rows read back. Any platform.
  - `'cpu_kernel'`: the rule's C++ kernel (moments updated in place, one
    pass over the rows), with C++ deduplication, row gathers, write-backs
    and scatter-adds for every other leaf. Tables on CPU.

  The CPU kernels are compiled once per machine with the system's C++
  compiler (or come prebuilt with a platform wheel) and loaded on first use;
  this function loads them if that was not tried yet, so call it outside
  `jax.jit`. It never raises: a missing compiler, a failed build or a
  refused cache file show up as `available=False` with the reason (and in a
  warning on the `lazy_optax` logger). `LAZY_OPTAX_CPU_KERNELS=0` switches
  the kernels off.

  Returns:
    A dict from implementation name to `ImplStatus(available, detail)`.

  Example:
    >>> import lazy_optax
    >>> status = lazy_optax.kernel_status()
    >>> sorted(status)
    ['cpu_kernel', 'generic', 'xla']
    >>> status['generic'].available
    True
  """
  cpu = cpu_kernels.ensure_loaded()
  return {
      'generic': ImplStatus(True, "lazy(...)'s gather, the transformation "
                            'on the row blocks, and its write-back'),
      'xla': ImplStatus(True, "a lazy_optax rule's row update written by "
                        'XLA'),
      'cpu_kernel': ImplStatus(cpu.loaded, cpu.detail),
  }


def explain_update(
    tx: Any,
    grads: Any,
    opt_state: Any,
    params: Optional[Any] = None,
    **extra_args: Any,
) -> dict[str, fused.Choice]:
  """Which implementation updates each row-sparse parameter, and why.

  Traces `tx.update(grads, opt_state, params, **extra_args)` abstractly
  (nothing runs, nothing is compiled) and reports the choice made for each
  parameter with a `SparseRows` gradient, as the same call inside your
  `jax.jit` step would make it. The CPU kernel's choice holds for a step
  compiled for CPU; the same step compiled for another platform takes
  `'xla'`.

  Args:
    tx: the optimizer (any composition containing `lazy(...)`).
    grads: a gradient tree as the train step gives it (arrays or
      `jax.ShapeDtypeStruct`s, `SparseRows` for the tables).
    opt_state: `tx`'s state (arrays or shape structs).
    params: the parameters, for transformations that need them.
    **extra_args: optax's extra arguments of the update (CowClip's
      `counts=`).

  Returns:
    A dict from parameter path (`'emb/table'`) to a `Choice(parameter, rule,
    impl, reason)`; where a chain holds several rules, the last one's.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((100, 8))}
    >>> tx = lazy_optax.lazy_adam(1e-3, impl='xla')
    >>> grads = {'table': lazy_optax.SparseRows(jnp.array([1, 2]),
    ...                                         jnp.ones((2, 8)), 100)}
    >>> choice = lazy_optax.explain_update(tx, grads, tx.init(params))
    >>> choice['table'].impl, choice['table'].rule
    ('xla', 'adam')
  """
  with fused.recording() as log:
    jax.eval_shape(lambda g, s, p, e: tx.update(g, s, p, **e), grads,
                   opt_state, params, extra_args)
  return {choice.parameter: choice for choice in log}
