"""`lazy_adam_cowclip`: CowClip, then TensorFlow's Adam rule, made lazy.

A composition of two rules, in a module of its own so that no rule module
imports another (`cowclip` and `adam` each stand alone).
"""

from __future__ import annotations

from typing import Optional

import jax
import optax

from lazy_optax._src import validate
from lazy_optax._src.adam import epsilon_hat_adam
from lazy_optax._src.cowclip import cowclip
from lazy_optax._src.lazy import lazy


def lazy_adam_cowclip(
    learning_rate: optax.ScalarOrSchedule,
    coef: float = 1.0,
    lower_bound: float = 1e-5,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """`lazy_adam` on CowClip-clipped gradients (the paper's optimizer).

  `lazy(optax.chain(cowclip(coef, lower_bound), epsilon-hat Adam,
  optax.scale_by_learning_rate(learning_rate)))`: its `update` takes
  `params` and `counts=` (see `cowclip`). Its state is `lazy_adam`'s with an
  `EmptyState` first.

  Args:
    learning_rate: a float or an optax schedule of the step count.
    coef: CowClip's ratio `r`.
    lower_bound: CowClip's `zeta`.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: "epsilon hat", added to `sqrt(v)`.
    mu_dtype: dtype of `mu` (default: the parameter's).
    nu_dtype: dtype of `nu` (default: the parameter's).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'`: Adam's tables
      (the clip is XLA's on the rows).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp, lazy_optax
    >>> params = {'table': jnp.ones((100, 4))}
    >>> tx = lazy_optax.lazy_adam_cowclip(1e-3)
    >>> ids = jnp.array([3, 7, 3])
    >>> grads = {'table': lazy_optax.SparseRows(ids, jnp.ones((3, 4)), 100)}
    >>> counts = {'table': lazy_optax.id_counts(ids, 100)}
    >>> u, state = tx.update(grads, tx.init(params), params, counts=counts)
    >>> float(u['table'].to_dense()[3, 0])
    -0.001...
  """
  validate.hyperparameters('lazy_adam_cowclip', beta=dict(b1=b1, b2=b2),
                           non_negative=dict(eps=eps))
  return lazy(optax.chain(
      cowclip(coef, lower_bound),
      epsilon_hat_adam(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype,
                       nu_dtype=nu_dtype, impl=impl),
      optax.scale_by_learning_rate(learning_rate)), impl=impl)
