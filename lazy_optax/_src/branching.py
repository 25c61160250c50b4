"""Work skipped under `lax.cond` on the CPU, done branch-free elsewhere.

XLA:GPU runs a conditional by copying its predicate to the host and waiting
for it: one device-to-host copy and one wait per conditional and step. A
conditional whose one branch passes a table through and whose other branch
scatters into it also keeps XLA from aliasing the table's buffer, so it
copies the table. Where a branch only skips batch-sized work, `per_platform`
lowers the skipping version for the CPU (where a conditional is a plain
branch and saves that work) and a branch-free version, giving the same bits,
for every other platform (`jax.lax.platform_dependent`: the choice is made
when the step is lowered, so the compiled step holds no conditional).

Each site is written as two small functions, so that tests on a CPU can run
the branch-free one (a direct call, or `per_platform` patched to pick it)
and compare it bit for bit with the skipping one.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import chex
import jax

_T = TypeVar('_T')


def per_platform(skipping: Callable[..., _T], branch_free: Callable[..., _T],
                 *args: chex.ArrayTree) -> _T:
  """`skipping(*args)` lowered for the CPU, `branch_free(*args)` elsewhere.

  Args:
    skipping: the version with a `lax.cond` that skips work.
    branch_free: the version without one; it must give the same outputs.
    *args: the arguments of both (pytrees of arrays).

  Returns:
    The outputs of the version lowered for the platform.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from lazy_optax._src import branching
    >>> def skipping(x):
    ...   return jax.lax.cond(jnp.any(x < 0), jnp.abs, lambda x: x, x)
    >>> branching.per_platform(skipping, jnp.abs, jnp.array([-1, 2]))
    Array([1, 2], dtype=int32)
  """
  return jax.lax.platform_dependent(*args, cpu=skipping, default=branch_free)

