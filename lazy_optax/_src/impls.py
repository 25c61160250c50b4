"""Which row-update implementations this machine has, and which runs where."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import optax

from lazy_optax._src import cpu_kernels
from lazy_optax._src import row_context
from lazy_optax._src.sparse_rows import is_sparse_rows


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
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: Optional[optax.Params] = None,
    **extra_args: object,
) -> dict[str, row_context.Choice]:
  """Which implementation updates each row-sparse parameter, and why.

  Traces `tx.update(grads, opt_state, params, **extra_args)` abstractly
  (nothing runs, nothing is compiled) and reports the choice made for each
  parameter with a `SparseRows` gradient, as the same call inside your
  `jax.jit` step would make it. The CPU kernel's choice holds for a step
  compiled for CPU; the same step compiled for another platform takes
  `'xla'`. The choices come back from every `lazy(...)` inside `tx` through
  optax's extra arguments (the keyword `lazy_optax_rows`), so the wrappers
  between `tx` and `lazy` must forward them, as optax's do.

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

  Raises:
    ValueError: `grads` holds a `SparseRows` but no `lazy(...)` reported a
      choice (none is inside `tx`, or a wrapper dropped the extra
      arguments: a plain `optax.GradientTransformation` does).

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
  log: list[row_context.Choice] = []
  rows = {row_context.ROWS_KEY: row_context.Rows(log=log)}
  if (isinstance(tx, optax.GradientTransformation)
      and not isinstance(tx, optax.GradientTransformationExtraArgs)):
    rows = {}  # its update takes no extra arguments: none reach a lazy
  jax.eval_shape(lambda g, s, p, e: tx.update(g, s, p, **e, **rows), grads,
                 opt_state, params, extra_args)
  if not log and any(is_sparse_rows(x) for x in jax.tree.leaves(
      grads, is_leaf=is_sparse_rows)):
    raise ValueError(
        f'explain_update: no lazy(...) inside {type(tx).__name__} reported '
        f'its choices. They come back through optax\'s extra argument '
        f'{row_context.ROWS_KEY}=, which a wrapper around lazy(...) must '
        'forward (optax.GradientTransformationExtraArgs with **extra_args, as '
        'optax.chain, partition and apply_if_finite are); a plain '
        'optax.GradientTransformation drops it.')
  return {choice.parameter: choice for choice in log}
