"""TensorFlow's Adam rule with epsilon hat (`LazyAdamOptimizer`), made lazy.

Per step, for the rows the batch touched (duplicates summed first):

    t    <- t + 1                      (one global count for all rows)
    lr_t <- lr * sqrt(1 - b2^t) / (1 - b1^t)
    m    <- b1 * m + (1 - b1) * g
    v    <- b2 * v + (1 - b2) * g * g
    p    <- p - lr_t * m / (sqrt(v) + eps)          ("epsilon hat")

This differs from `optax.adam`, which bias-corrects `m` and `v` first and
adds `eps` to `sqrt(v_hat)`; the two agree as `eps -> 0`.

On one CPU device, float32 `SparseRows` leaves with float32 moments go
through `cpu_kernels.adam_rows` (one `jax.ffi` call per table), the rest of
the tree through `lazy(...)`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazy_optax._src import cpu_kernels
from lazy_optax._src import validate
from lazy_optax._src.lazy import check_sparse_leaf
from lazy_optax._src.lazy import lazy_with_rule
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import one_minus_power
from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import prepare
from lazy_optax._src.sparse_rows import SparseRows


class ScaleByLazyAdamState(NamedTuple):
  """State of `scale_by_lazy_adam`: global step and the two moments."""
  count: chex.Array  # int32 scalar, the global step
  mu: optax.Updates
  nu: optax.Updates


class ScaleByLazyAMSGradState(NamedTuple):
  """State of `scale_by_lazy_adam(amsgrad=True)`: also the running max of nu."""
  count: chex.Array
  mu: optax.Updates
  nu: optax.Updates
  nu_max: optax.Updates


def _bias_correction(b1: Any, b2: Any, count: Any, dtype: Any) -> Any:
  """TensorFlow's step-size correction `sqrt(1 - b2^t) / (1 - b1^t)`."""
  return (jnp.sqrt(one_minus_power(b2, count, dtype))
          / one_minus_power(b1, count, dtype))


def _epsilon_hat_updates(updates: Any, count: Any, mu: Any, nu: Any, *,
                         b1: float, b2: float, eps: float,
                         eps_root: float) -> Any:
  """The step `correction * m / (sqrt(v + eps_root) + eps)` of every leaf."""

  def step(g, m, v):
    dtype = compute_dtype(m.dtype, v.dtype)
    correction = _bias_correction(b1, b2, count, dtype)
    v = v.astype(dtype)
    denom = jnp.sqrt(v + eps_root) + eps
    return (correction * m.astype(dtype) / denom).astype(g.dtype)

  return jax.tree.map(step, updates, mu, nu)


def _kernel_leaf(grad: Any, mu: Any, nu: Any) -> bool:
  """Whether the CPU kernel can update this leaf's rows (float32 all along)."""
  if not isinstance(grad, SparseRows):
    return False
  f32 = jnp.dtype(jnp.float32)
  return (grad.values.dtype == f32 and grad.values.ndim >= 1
          and all(getattr(x, 'dtype', None) == f32 for x in (mu, nu))
          and tuple(mu.shape) == tuple(nu.shape) == grad.shape)


def _with_cpu_kernel(
    base: optax.GradientTransformationExtraArgs,
    adam_args: dict[str, Any],
    rest: Sequence[optax.GradientTransformation],
) -> optax.GradientTransformationExtraArgs:
  """`base`, with float32 `SparseRows` leaves updated by the CPU kernel.

  On one CPU device, where `cpu_kernels.available()`, each float32
  `SparseRows` leaf whose `mu` and `nu` are float32 goes through
  `cpu_kernels.adam_rows` (deduplication, moments updated in place, the
  step of each row: the same rule); the rest of the tree goes through `base`
  with those leaves masked out (`optax.MaskedNode`). `rest` must be
  transformations of the updates alone (the learning rate).
  """
  b1, b2 = adam_args['b1'], adam_args['b2']

  def update_fn(updates, state, params=None, **extra_args):
    if not cpu_kernels.usable():
      return base.update(updates, state, params, **extra_args)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        updates, is_leaf=is_sparse_rows)
    adam_state = state[0] if rest and isinstance(state, tuple) else state
    if not isinstance(adam_state, ScaleByLazyAdamState):
      # Not this transformation's state: `base` says what is wrong.
      return base.update(updates, state, params, **extra_args)
    try:
      mus = treedef.flatten_up_to(adam_state.mu)
      nus = treedef.flatten_up_to(adam_state.nu)
    except (ValueError, TypeError):
      return base.update(updates, state, params, **extra_args)
    picks = [i for i, (_, g) in enumerate(flat)
             if _kernel_leaf(g, mus[i], nus[i])]
    if not picks:
      return base.update(updates, state, params, **extra_args)
    param_leaves = ([None] * len(flat) if params is None
                    else treedef.flatten_up_to(params))

    def masked(leaves):
      return treedef.unflatten([optax.MaskedNode() if i in picks else x
                                for i, x in enumerate(leaves)])

    sub_adam = adam_state._replace(mu=masked(mus), nu=masked(nus))
    sub_state = (sub_adam,) + tuple(state[1:]) if rest else sub_adam
    sub_updates, new_sub_state = base.update(
        masked([g for _, g in flat]), sub_state,
        None if params is None else masked(param_leaves), **extra_args)

    correction = _bias_correction(
        b1, b2, optax.safe_increment(adam_state.count), jnp.float32)
    hyper = jnp.stack([jnp.asarray(x, jnp.float32) for x in (
        b1, 1 - b1, b2, 1 - b2, adam_args['eps'], adam_args['eps_root'],
        correction)])
    out = treedef.flatten_up_to(sub_updates)
    new_mus, new_nus = list(mus), list(nus)
    for i in picks:
      grad, name = flat[i][1], path_name(flat[i][0])
      check_sparse_leaf(grad, param_leaves[i], name)
      ids, values, num_rows = prepare(grad, f'parameter {name}')
      n, row_shape = values.shape[0], grad.row_shape
      width = int(np.prod(row_shape, dtype=np.int64))
      mu, nu, unique_ids, steps = cpu_kernels.adam_rows(
          ids.astype(jnp.int32), values.reshape(n, width), hyper,
          mus[i].reshape(num_rows, width), nus[i].reshape(num_rows, width))
      new_mus[i] = mu.reshape(mus[i].shape)
      new_nus[i] = nu.reshape(nus[i].shape)
      steps = steps.reshape((n,) + row_shape)
      for k, t in enumerate(rest, start=1):
        steps, _ = t.update(steps, state[k])
      out[i] = SparseRows.from_unique(unique_ids, steps, num_rows,
                                      distinct=True)
    new_adam = new_sub_state[0] if rest else new_sub_state
    mu_tree = treedef.flatten_up_to(new_adam.mu)
    nu_tree = treedef.flatten_up_to(new_adam.nu)
    for i in picks:
      mu_tree[i], nu_tree[i] = new_mus[i], new_nus[i]
    new_adam = new_adam._replace(mu=treedef.unflatten(mu_tree),
                                 nu=treedef.unflatten(nu_tree))
    new_state = ((new_adam,) + tuple(new_sub_state[1:]) if rest
                 else new_adam)
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init=base.init,
                                               update=update_fn)


def _lazy_epsilon_hat(
    adam_args: dict[str, Any],
    rest: Sequence[optax.GradientTransformation] = (),
    *,
    cpu_kernel: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """`lazy(chain(epsilon_hat_adam(**adam_args), *rest))`, fast path included.

  The same transformation and state as `lazy(...)` of that chain; the updates
  are computed from the new moments re-read at the touched rows after they
  were written (see `lazy_with_rule`): the same numbers, since the rule's
  step reads the new moments in their stored dtype, while XLA reads each
  moment's cold rows once instead of twice.
  """
  adam = epsilon_hat_adam(**adam_args)
  tx = optax.chain(adam, *rest) if rest else adam
  hyper = {k: adam_args[k] for k in ('b1', 'b2', 'eps', 'eps_root')}

  def updates_from_state(old_state, new_state, grads, params):
    adam_state = new_state[0] if rest else new_state
    nu = (adam_state.nu_max if adam_args['amsgrad'] else adam_state.nu)
    updates = _epsilon_hat_updates(grads, adam_state.count, adam_state.mu,
                                   nu, **hyper)
    for k, t in enumerate(rest, start=1):
      updates, _ = t.update(updates, old_state[k], params)
    return updates

  base = lazy_with_rule(tx, updates_from_state=updates_from_state)
  if cpu_kernel and not adam_args['amsgrad']:
    return _with_cpu_kernel(base, adam_args, rest)
  return base


def epsilon_hat_adam(
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
    amsgrad: bool = False,
) -> optax.GradientTransformation:
  """TensorFlow's Adam rule with epsilon hat on dense arrays (`AdamOptimizer`).

  The building block that `scale_by_lazy_adam` wraps with `lazy`: applied to
  a dense gradient it updates every entry.

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: "epsilon hat", added to `sqrt(v)` after bias correction moved to
      the step size.
    eps_root: added to `v` under the square root (0 in TensorFlow's Adam rule
      (epsilon hat)).
    mu_dtype: dtype of `mu` (default: the parameter's).
    nu_dtype: dtype of `nu` (default: the parameter's).
    amsgrad: divide by the running maximum of `nu` instead of `nu`.

  Returns:
    An `optax.GradientTransformation` whose updates still need the learning
    rate (and its sign) applied.

  Example:
    >>> import jax.numpy as jnp
    >>> from lazy_optax._src.adam import epsilon_hat_adam
    >>> tx = epsilon_hat_adam()
    >>> u, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
    >>> u.round(4)
    Array([1., 1.], dtype=float32)
  """

  def init_fn(params):
    def zeros(dtype):
      return lambda p: jnp.zeros(jnp.shape(p), dtype or jnp.asarray(p).dtype)
    mu = jax.tree.map(zeros(mu_dtype), params)
    nu = jax.tree.map(zeros(nu_dtype), params)
    count = jnp.zeros([], jnp.int32)
    if amsgrad:
      return ScaleByLazyAMSGradState(count, mu, nu,
                                     jax.tree.map(zeros(nu_dtype), params))
    return ScaleByLazyAdamState(count, mu, nu)

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)

    def moments(g, m, v):
      dtype = compute_dtype(g.dtype, m.dtype, v.dtype)
      g = g.astype(dtype)
      m_new = b1 * m.astype(dtype) + (1 - b1) * g
      v_new = b2 * v.astype(dtype) + (1 - b2) * (g * g)
      return m_new.astype(m.dtype), v_new.astype(v.dtype)

    pairs = jax.tree.map(moments, updates, state.mu, state.nu)
    # Split the pairs along the updates' structure: `is_leaf=tuple` would also
    # catch tuple-shaped params and optax.masked's empty `MaskedNode`s.
    mu = jax.tree.map(lambda _, p: p[0], updates, pairs)
    nu = jax.tree.map(lambda _, p: p[1], updates, pairs)
    nu_max = None
    if amsgrad:
      nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu)

    new_updates = _epsilon_hat_updates(
        updates, count, mu, nu_max if amsgrad else nu, b1=b1, b2=b2, eps=eps,
        eps_root=eps_root)
    if amsgrad:
      return new_updates, ScaleByLazyAMSGradState(count, mu, nu, nu_max)
    return new_updates, ScaleByLazyAdamState(count, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_lazy_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nu_dtype: Optional[Any] = None,
    amsgrad: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Rescales updates by TensorFlow's lazy Adam rule, without learning rate.

  For a `SparseRows` gradient only the touched rows of `mu` and `nu` change
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
  return _lazy_epsilon_hat(
      dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
           nu_dtype=nu_dtype, amsgrad=amsgrad), cpu_kernel=True)


def lazy_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    *,
    nu_dtype: Optional[Any] = None,
    amsgrad: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """LazyAdam: TensorFlow's Adam rule (epsilon hat) on the touched rows.

  `SparseRows` gradients update only their rows of the parameter, `mu` and
  `nu`; dense gradients get TensorFlow's dense Adam. See the module docstring
  for the rule. The state is that of `lazy(optax.chain(epsilon-hat Adam,
  optax.scale_by_learning_rate(learning_rate)))`. On one CPU device, float32
  tables with float32 moments are updated by a C++ kernel called through
  `jax.ffi` (built on first use; see the README's "CPU kernel"): duplicates
  summed, moments updated in place, one pass over the touched rows, the same
  rule up to float32 rounding. Elsewhere, for tables with rows of at least
  128 bytes on one device, the updates are computed from the new moments
  re-read after they were written (the same numbers up to rounding).

  Args:
    learning_rate: a float or an optax schedule of the step count.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: "epsilon hat", added to `sqrt(v)`.
    eps_root: added to `v` inside the square root.
    mu_dtype: dtype of `mu` (default: the parameter's).
    nu_dtype: dtype of `nu` (default: the parameter's).
    amsgrad: lazy AMSGrad (running maximum of `nu` per touched row).

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
  return _lazy_epsilon_hat(
      dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
           nu_dtype=nu_dtype, amsgrad=amsgrad),
      [optax.scale_by_learning_rate(learning_rate)], cpu_kernel=True)


def lazy_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[Any] = None,
    weight_decay: float = 1e-4,
    mask: Optional[Any] = None,
    *,
    nu_dtype: Optional[Any] = None,
    amsgrad: bool = False,
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
  return _lazy_epsilon_hat(
      dict(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
           nu_dtype=nu_dtype, amsgrad=amsgrad),
      [optax.add_decayed_weights(weight_decay, mask),
       optax.scale_by_learning_rate(learning_rate)])
