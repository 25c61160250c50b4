"""FTRL-Proximal as an optax transformation, dense and lazy.

The rule of TensorFlow's `ApplyFtrlV2` kernel (used by
`tf.compat.v1.train.FtrlOptimizer` and `tf.keras.optimizers.Ftrl`), per
entry, for every row a step touches (duplicates summed first), with
`p = -learning_rate_power` (0.5 by default):

    g_s    <- g + 2 * l2_shrinkage * w
    n_new  <- n + g * g
    sigma  <- (n_new^p - n^p) / lr
    z      <- z + g_s - sigma * w
    q      <- (beta + n_new^p) / lr + 2 * l2
    w      <- (sign(z) * l1 - z) / q    if |z| > l1    else 0
    n      <- n_new

`n` (`accumulator`, starting at `initial_accumulator_value`) and `z`
(`linear`) are kept per entry. FTRL computes the new weights from its state
rather than stepping from them, so its update is `w_new - w` and `update`
needs `params`. Untouched rows keep their weights and state bit-for-bit,
as TensorFlow's sparse FTRL does; a dense gradient updates every row.

Where it matches and differs:
- `beta` enters as Keras' `Ftrl` passes it to the kernel, an L2 strength of
  `l2 + beta / (2 * lr)`, which gives the `(beta + sqrt(n)) / lr` of
  McMahan et al. (2013).
- The accumulator adds the raw gradient's square, as `ApplyFtrlV2` documents
  (and TensorFlow's kernels do since 2.x); some older kernels accumulated the
  square of the shrinkage-adjusted gradient.
- TensorFlow's `multiply_linear_by_lr` variant is not offered, and the
  learning rate may be an optax schedule of the global step (TensorFlow
  reads its current value each step, which is what a schedule gives).
- TensorFlow computes in the variable's dtype; here the rule computes in at
  least float32 and stores the parameter's dtype (or `accumulator_dtype`,
  `linear_dtype` for the state).
- optax has no FTRL, so the dense form is new to JAX as well.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import fused
from lazy_optax._src import validate
from lazy_optax._src.lazy import lazy
from lazy_optax._src.numerics import compute_dtype


class ScaleByFtrlState(NamedTuple):
  """State of `ftrl`: step count, `n` and `z` per entry."""
  count: chex.Array  # int32 scalar, the global step
  accumulator: optax.Updates  # n: sum of squared gradients (+ initial value)
  linear: optax.Updates  # z: the linear term


fused.declare(ScaleByFtrlState, fused.RuleFacts(
    'ftrl', ('accumulator', 'linear'), 'LazyOptaxFtrl'))


class FtrlKernelHyper(NamedTuple):
  """The FTRL rule's hyperparameters, for `new_rows`, `step` and the kernel:
  rows.cc's `FTRL_FIELDS`, in order."""
  lr: jax.typing.ArrayLike
  power: jax.typing.ArrayLike  # -learning_rate_power
  l1: jax.typing.ArrayLike
  l2: jax.typing.ArrayLike
  l2_shrinkage: jax.typing.ArrayLike
  beta: jax.typing.ArrayLike


def _power(n: jax.Array, power: jax.typing.ArrayLike) -> jax.Array:
  """`n ** power`, with the square root for 0.5 and 1 for 0 (as TF does)."""
  if isinstance(power, (int, float)):
    if power == 0.5:
      return jnp.sqrt(n)
    if power == 0:
      return jnp.ones_like(n)
  return jnp.power(n, jnp.asarray(power, n.dtype))


def _rule() -> fused.RowRule:
  """FTRL-Proximal as a `RowRule` of an `FtrlKernelHyper`."""

  def new_rows(g, rows, params, hyper: FtrlKernelHyper):
    n, z = rows['accumulator'], rows['linear']
    w = jnp.asarray(params)
    dtype = compute_dtype(g.dtype, w.dtype, n.dtype, z.dtype)
    gd, wd = g.astype(dtype), w.astype(dtype)
    nd = n.astype(dtype)
    lr = jnp.asarray(hyper.lr, dtype)
    n_new = nd + gd * gd
    sigma = (_power(n_new, hyper.power) - _power(nd, hyper.power)) / lr
    shrunk = gd + 2 * jnp.asarray(hyper.l2_shrinkage, dtype) * wd
    return {'accumulator': n_new,
            'linear': z.astype(dtype) + shrunk - sigma * wd}

  def step(g, stored, params, hyper: FtrlKernelHyper):
    n, z = stored['accumulator'], stored['linear']
    w = jnp.asarray(params)
    dtype = compute_dtype(g.dtype, w.dtype, n.dtype, z.dtype)
    nd, zd, wd = n.astype(dtype), z.astype(dtype), w.astype(dtype)
    quadratic = ((jnp.asarray(hyper.beta, dtype) + _power(nd, hyper.power))
                 / jnp.asarray(hyper.lr, dtype)
                 + 2 * jnp.asarray(hyper.l2, dtype))
    # Unused padding slots of a lazy update read zeros everywhere: keep
    # their (discarded) result finite.
    quadratic = jnp.where(quadratic > 0, quadratic, jnp.ones_like(quadratic))
    l1 = jnp.asarray(hyper.l1, dtype)
    w_new = jnp.where(jnp.abs(zd) > l1, (jnp.sign(zd) * l1 - zd) / quadratic,
                      jnp.zeros_like(zd))
    return w_new - wd

  # The rule's record is the kernel's.
  return fused.RowRule('ftrl', new_rows, step, ('accumulator', 'linear'),
                       'LazyOptaxFtrl', lambda hyper: hyper,
                       needs_params=True)


def _ftrl_rule(
    *,
    learning_rate: optax.ScalarOrSchedule,
    learning_rate_power: float,
    initial_accumulator_value: float,
    l1: float,
    l2: float,
    l2_shrinkage: float,
    beta: float,
    accumulator_dtype: Optional[jax.typing.DTypeLike],
    linear_dtype: Optional[jax.typing.DTypeLike],
    impl: str,
) -> optax.GradientTransformationExtraArgs:
  """FTRL-Proximal, dense or fused inside `lazy(...)`."""
  rule = _rule()

  def init_fn(params):
    return ScaleByFtrlState(
        count=jnp.zeros([], jnp.int32),
        accumulator=optax.tree_utils.tree_full_like(
            params, initial_accumulator_value, dtype=accumulator_dtype),
        linear=optax.tree_utils.tree_zeros_like(params, dtype=linear_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          'ftrl computes the new weights from its accumulators (its update '
          'is w_new - w), so it needs the current params: call '
          'tx.update(grads, state, params).')
    lr = (learning_rate(state.count) if callable(learning_rate)
          else learning_rate)
    hyper = FtrlKernelHyper(lr=lr, power=-learning_rate_power, l1=l1, l2=l2,
                            l2_shrinkage=l2_shrinkage, beta=beta)
    new_updates, new = fused.apply_rule(
        rule, updates, {'accumulator': state.accumulator,
                        'linear': state.linear}, params, hyper, impl)
    return new_updates, ScaleByFtrlState(optax.safe_increment(state.count),
                                         **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def ftrl(
    learning_rate: optax.ScalarOrSchedule,
    learning_rate_power: float = -0.5,
    initial_accumulator_value: float = 0.1,
    l1: float = 0.0,
    l2: float = 0.0,
    l2_shrinkage: float = 0.0,
    beta: float = 0.0,
    *,
    accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
    linear_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """FTRL-Proximal (TensorFlow's `ApplyFtrlV2`), lazy on `SparseRows`.

  The optimizer of click-through-rate models with huge sparse feature
  spaces: per-entry adaptive rates, and L1 that sets weights exactly to
  zero. On a `SparseRows` gradient only the touched rows of the parameter,
  the accumulator and the linear term change; a dense gradient updates every
  entry, as TensorFlow's dense `FtrlOptimizer` does. `update` needs
  `params` (the new weights are computed from the state, and the update is
  `w_new - w`). The learning rate enters the step nonlinearly (through
  `sigma` and the proximal denominator), so there is no rate-free
  `scale_by_ftrl` to chain a learning rate after: use `ftrl` inside chains
  (`lazy(optax.chain(clip, ftrl(...)))`). TensorFlow's names map as
  `l1_regularization_strength -> l1`, `l2_regularization_strength -> l2`,
  `l2_shrinkage_regularization_strength -> l2_shrinkage`. See the module
  docstring for the rule.

  Args:
    learning_rate: a float or an optax schedule of the global step.
    learning_rate_power: how the per-entry rate falls with the accumulated
      squares, `<= 0` (-0.5: `lr / sqrt(n)`; 0: a fixed rate).
    initial_accumulator_value: the accumulator's starting value, `>= 0`
      (TensorFlow's default 0.1).
    l1: L1 regularization strength (entries with `|z| <= l1` become 0).
    l2: L2 regularization strength (in the proximal denominator).
    l2_shrinkage: L2 shrinkage strength (`2 * l2_shrinkage * w` added to the
      gradient in the linear term only).
    beta: Keras' `beta` from the FTRL-Proximal paper, added to `n^p`.
    accumulator_dtype: dtype of the accumulator (default: the parameter's).
    linear_dtype: dtype of the linear term (default: the parameter's).
    impl: how the touched rows are updated: `'auto'` (the CPU kernel where
      it applies, see `lazy_optax.kernel_status`), `'generic'`, `'xla'` or
      `'cpu_kernel'`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByFtrlState(count, accumulator, linear)`; `update` needs `params`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((1000, 2))}
    >>> tx = lazy_optax.ftrl(0.1, l1=0.01)
    >>> state = tx.init(params)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([5, 5]),
    ...                                     jnp.ones((2, 2)), 1000)}
    >>> updates, state = tx.update(g, state, params)
    >>> params = lazy_optax.apply_updates(params, updates)
    >>> params['table'][4:6]
    Array([[ 0.       ,  0.       ],
           [-0.0982791, -0.0982791]], dtype=float32)
  """
  validate.hyperparameters(
      'ftrl', positive=dict(learning_rate=learning_rate),
      non_positive=dict(learning_rate_power=learning_rate_power),
      non_negative=dict(initial_accumulator_value=initial_accumulator_value,
                        l1=l1, l2=l2, l2_shrinkage=l2_shrinkage, beta=beta))
  fused.check_impl(impl, 'ftrl')
  return lazy(_ftrl_rule(
      learning_rate=learning_rate, learning_rate_power=learning_rate_power,
      initial_accumulator_value=initial_accumulator_value, l1=l1, l2=l2,
      l2_shrinkage=l2_shrinkage, beta=beta,
      accumulator_dtype=accumulator_dtype, linear_dtype=linear_dtype,
      impl=impl), impl=impl)
