"""TensorFlow's Adam rule with epsilon hat (`LazyAdamOptimizer`), made lazy.

Per step, for the rows the batch touched (duplicates summed first):

    t    <- t + 1                      (one global count for all rows)
    lr_t <- lr * sqrt(1 - b2^t) / (1 - b1^t)
    m    <- b1 * m + (1 - b1) * g
    v    <- b2 * v + (1 - b2) * g * g
    p    <- p - lr_t * m / (sqrt(v) + eps)          ("epsilon hat")

This differs from `optax.adam`, which bias-corrects `m` and `v` first and
adds `eps` to `sqrt(v_hat)`; the two agree as `eps -> 0`.

The rule is a `fused.RowRule`: inside `lazy(...)` its row update runs as the
C++ kernel on CPU, XLA's row update elsewhere, or `lazy`'s generic path
(`impl=`; see `fused`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazy_optax._src import fused
from lazy_optax._src import numerics
from lazy_optax._src import validate
from lazy_optax._src.bare import bare
from lazy_optax._src.lazy import lazy
from lazy_optax._src.numerics import complement
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import Mask


class ScaleByLazyAdamState(NamedTuple):
  """State of `scale_by_lazy_adam`: global step and the two moments."""
  count: chex.Array  # int32 scalar, the global step
  mu: optax.Updates
  nu: optax.Updates


fused.declare(ScaleByLazyAdamState, fused.RuleFacts(
    'adam', ('mu', 'nu'), 'LazyOptaxAdam'))


class ScaleByLazyAMSGradState(NamedTuple):
  """State of `scale_by_lazy_adam(amsgrad=True)`: also the running max of nu."""
  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates
  nu_max: optax.Updates


fused.declare(ScaleByLazyAMSGradState, fused.RuleFacts(
    'amsgrad', ('mu', 'nu', 'nu_max'), 'LazyOptaxAmsgrad'))


class AdamHyper(NamedTuple):
  """The Adam rule's hyperparameters at one step (`new_rows`, `step`)."""
  b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  eps_root: jax.typing.ArrayLike
  count: chex.Array  # int32 scalar, the new global step


class AdamKernelHyper(NamedTuple):
  """The Adam kernel's record: rows.cc's `ADAM_FIELDS`, in order, made from
  an `AdamHyper` by `_kernel_hyper`."""
  b1: jax.typing.ArrayLike
  one_minus_b1: jax.typing.ArrayLike
  b2: jax.typing.ArrayLike
  one_minus_b2: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  eps_root: jax.typing.ArrayLike
  correction: jax.Array  # sqrt(1 - b2^t) / (1 - b1^t)


def _bias_correction(b1: jax.typing.ArrayLike, b2: jax.typing.ArrayLike,
                     count: jax.Array, dtype: jax.typing.DTypeLike
                     ) -> jax.Array:
  """TensorFlow's step-size correction `sqrt(1 - b2^t) / (1 - b1^t)`."""
  return _correction(complement(b1, dtype), complement(b2, dtype), count,
                     jnp.dtype(dtype))


@functools.partial(jax.jit, inline=True, static_argnums=3)
def _correction(one_minus_b1: jax.typing.ArrayLike,
                one_minus_b2: jax.typing.ArrayLike, count: jax.Array,
                dtype: np.dtype) -> jax.Array:
  # Traced once per signature, inlined where it is called.
  return (jnp.sqrt(numerics.one_minus_power_of(one_minus_b2, count, dtype))
          / numerics.one_minus_power_of(one_minus_b1, count, dtype))


def _kernel_hyper(h: AdamHyper) -> AdamKernelHyper:
  """The kernel's record: `1 - b` and the correction computed once."""
  return AdamKernelHyper(
      h.b1, 1 - h.b1, h.b2, 1 - h.b2, h.eps, h.eps_root,
      _bias_correction(h.b1, h.b2, h.count, jnp.float32))


def _second_moment(amsgrad: bool) -> str:
  return 'nu_max' if amsgrad else 'nu'


def _adam_rule(amsgrad: bool) -> fused.RowRule:
  """TensorFlow's Adam rule (epsilon hat) as a `RowRule` of an `AdamHyper`."""

  def new_rows(g, rows, params, hyper: AdamHyper):
    del params
    b1, b2 = hyper.b1, hyper.b2
    dtype = compute_dtype(*(x.dtype for x in (g, *rows.values())))
    g = g.astype(dtype)
    new = {'mu': b1 * rows['mu'].astype(dtype) + (1 - b1) * g,
           'nu': b2 * rows['nu'].astype(dtype) + (1 - b2) * (g * g)}
    if amsgrad:
      new['nu_max'] = jnp.maximum(rows['nu_max'].astype(dtype), new['nu'])
    return new

  def step(g, stored, params, hyper: AdamHyper):
    del g, params
    m, v = stored['mu'], stored[_second_moment(amsgrad)]
    dtype = compute_dtype(m.dtype, v.dtype)
    correction = _bias_correction(hyper.b1, hyper.b2, hyper.count, dtype)
    denom = jnp.sqrt(v.astype(dtype) + hyper.eps_root) + hyper.eps
    return correction * m.astype(dtype) / denom

  if amsgrad:
    return fused.RowRule('amsgrad', new_rows, step, ('mu', 'nu', 'nu_max'),
                         'LazyOptaxAmsgrad', _kernel_hyper)
  return fused.RowRule('adam', new_rows, step, ('mu', 'nu'), 'LazyOptaxAdam',
                       _kernel_hyper)


def epsilon_hat_adam(
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    amsgrad: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """TensorFlow's Adam rule (epsilon hat), without the learning rate.

  What `lazy_adam`, `lazy_adamw` and `lazy_adam_cowclip` chain inside
  `lazy(...)`, and `scale_by_lazy_adam` returns (with its deprecated path):
  on a dense gradient it updates every entry; inside `lazy(...)` it updates
  the touched rows (see `fused`). Arguments as `scale_by_lazy_adam`'s.
  """
  fused.check_impl(impl, 'epsilon_hat_adam')
  rule = _adam_rule(amsgrad)

  def init_fn(params):
    zeros = optax.tree_utils.tree_zeros_like
    mu = zeros(params, dtype=mu_dtype)
    nu = zeros(params, dtype=nu_dtype)
    count = jnp.zeros([], jnp.int32)
    if amsgrad:
      return ScaleByLazyAMSGradState(count, mu, nu,
                                     zeros(params, dtype=nu_dtype))
    return ScaleByLazyAdamState(count, mu, nu)

  def update_fn(updates, state, params=None, **extra_args):
    del params
    count = optax.safe_increment(state.count)
    tables = {'mu': state.mu, 'nu': state.nu}
    if amsgrad:
      tables['nu_max'] = state.nu_max
    hyper = AdamHyper(b1=b1, b2=b2, eps=eps, eps_root=eps_root, count=count)
    new_updates, new = fused.apply_rule(
        rule, updates, tables, None, hyper, impl)
    if amsgrad:
      return new_updates, ScaleByLazyAMSGradState(count, **new)
    return new_updates, ScaleByLazyAdamState(count, **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_lazy_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    amsgrad: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Rescales updates by TensorFlow's lazy Adam rule, without learning rate.

  The bare rule, as `optax.scale_by_adam` is: inside `lazy(...)` only the
  touched rows of `mu` and `nu` change for a `SparseRows` gradient
  (duplicates summed first); a dense gradient updates every row, as
  TensorFlow's dense Adam does. The step count is global. Chain with
  `optax.scale_by_learning_rate` inside `lazy(...)`, or use `lazy_adam`.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to `sqrt(v)` ("epsilon hat": bias correction lives in the
      step size, as in TensorFlow's Adam; Keras used 1e-7, TF1 1e-8).
    eps_root: added to `v` inside the square root.
    mu_dtype: dtype of the first moment (e.g. `jnp.float32` for bfloat16
      tables); defaults to the parameter's dtype.
    nu_dtype: dtype of the second moment; defaults to the parameter's dtype.
    amsgrad: keep, per touched row, the maximum of `nu` seen so far and
      divide by its square root (lazy AMSGrad).
    impl: how the touched rows are updated: `'auto'` (the CPU kernel where
      it applies, see `lazy_optax.kernel_status`), `'generic'`, `'xla'` or
      `'cpu_kernel'` (raises where it cannot run).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByLazyAdamState(count, mu, nu)` (or `ScaleByLazyAMSGradState`).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy(optax.chain(lazy_optax.scale_by_lazy_adam(),
    ...                                  optax.scale_by_learning_rate(1e-3)))
    >>> state = tx.init({'table': jnp.zeros((100, 8))})
    >>> optax.tree_utils.tree_get(state, 'mu')['table'].shape
    (100, 8)
  """
  validate.hyperparameters(
      'scale_by_lazy_adam', beta=dict(b1=b1, b2=b2),
      non_negative=dict(eps=eps, eps_root=eps_root))
  return bare(epsilon_hat_adam(
      b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
      nu_dtype=nu_dtype, amsgrad=amsgrad, impl=impl),
      'scale_by_lazy_adam', impl)


def lazy_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    amsgrad: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """LazyAdam: TensorFlow's Adam rule (epsilon hat) on the touched rows.

  `SparseRows` gradients update only their rows of the parameter, `mu` and
  `nu`; dense gradients get TensorFlow's dense Adam. See the module docstring
  for the rule. The state is that of `lazy(optax.chain(epsilon-hat Adam,
  optax.scale_by_learning_rate(learning_rate)))`. On CPU, tables with
  float32 or bfloat16 moments on one device (or split over an Explicit mesh)
  are updated by a C++ kernel called through `jax.ffi`: moments updated in
  place, one pass over the touched rows, the same rule up to float32
  rounding. Elsewhere XLA updates the rows (`impl=` chooses; see
  `lazy_optax.kernel_status` and `lazy_optax.explain_update`).

  Args:
    learning_rate: a float or an optax schedule of the step count.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: "epsilon hat", added to `sqrt(v)`.
    eps_root: added to `v` inside the square root.
    mu_dtype: dtype of `mu` (default: the parameter's).
    nu_dtype: dtype of `nu` (default: the parameter's).
    amsgrad: lazy AMSGrad (running maximum of `nu` per touched row).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'` (see
      `scale_by_lazy_adam`).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((1000, 4))}
    >>> tx = lazy_optax.lazy_adam(1e-2)
    >>> state = tx.init(params)
    >>> grads = {'table': lazy_optax.SparseRows(jnp.array([3, 7, 3]),
    ...                                         jnp.ones((3, 4)), 1000)}
    >>> updates, state = tx.update(grads, state)
    >>> params = lazy_optax.apply_updates(params, updates)
    >>> float(params['table'][3, 0]), float(params['table'][4, 0])
    (-0.009999..., 0.0)
  """
  validate.hyperparameters(
      'lazy_adam', beta=dict(b1=b1, b2=b2),
      non_negative=dict(eps=eps, eps_root=eps_root))
  return lazy(optax.chain(
      epsilon_hat_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                       mu_dtype=mu_dtype, nu_dtype=nu_dtype, amsgrad=amsgrad,
                       impl=impl),
      optax.scale_by_learning_rate(learning_rate)), impl=impl)


def lazy_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: float = 1e-4,
    mask: Optional[Mask] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    amsgrad: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """LazyAdam with decoupled weight decay on the touched rows only.

  Each touched row moves by `-lr * (adam_step + weight_decay * p)`, as
  `optax.adamw` does for every entry; rows the batch did not touch do not
  decay. Needs `params` in `update`.

  Args:
    learning_rate: a float or an optax schedule.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: "epsilon hat", added to `sqrt(v)`.
    eps_root: added to `v` inside the square root.
    mu_dtype: dtype of `mu`.
    weight_decay: decoupled weight decay rate.
    mask: as in `optax.adamw`: a tree of bools or a callable saying which
      parameters decay.
    nu_dtype: dtype of `nu`.
    amsgrad: lazy AMSGrad.
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'` (see
      `scale_by_lazy_adam`).

  Returns:
    An `optax.GradientTransformationExtraArgs`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.ones((10, 2))}
    >>> tx = lazy_optax.lazy_adamw(0.1, weight_decay=0.5)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([0]), jnp.zeros((1, 2)),
    ...                                     10)}
    >>> updates, _ = tx.update(g, tx.init(params), params)
    >>> lazy_optax.apply_updates(params, updates)['table'][:2, 0]
    Array([0.95, 1.  ], dtype=float32)
  """
  validate.hyperparameters(
      'lazy_adamw', beta=dict(b1=b1, b2=b2),
      non_negative=dict(eps=eps, eps_root=eps_root, weight_decay=weight_decay))
  return lazy(optax.chain(
      epsilon_hat_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                       mu_dtype=mu_dtype, nu_dtype=nu_dtype, amsgrad=amsgrad,
                       impl=impl),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate)), impl=impl)
