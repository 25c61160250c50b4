"""Row max-norm: the rows a step writes kept within a maximum L2 norm.

Applied at update time, as FBGEMM's `max_norm` does (its CPU build, 1.9.0,
accepts the option but did not apply it: an updated row came out at norm
1.41 with `max_norm=0.5`): placed last in a chain, it turns the update `u`
of each row into

    u <- (w + u) * min(1, max_norm / ||w + u||) - w

so that the row after `apply_updates` has norm at most `max_norm` (up to
the table's rounding), and leaves `u` as it is where `w + u` is short
enough. Inside `lazy(...)` only the rows the batch touched are read and
changed. torch's `nn.Embedding(max_norm=)` instead rescales rows where they
are looked up, writing to the table during the forward pass; the update-time
form keeps the optimizer a pure function and lookups free of writes, and it
differs only for rows that are read but whose norm was set elsewhere (a
checkpoint, an initializer: rescale those once with the same rule). The
state is empty (0 bytes per row).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import fused
from lazy_optax._src import validate
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import row_norms


class RowMaxNormHyper(NamedTuple):
  """The rule's hyperparameter, as `step` reads it."""
  max_norm: jax.typing.ArrayLike


def _rule() -> fused.RowRule:
  """Row max-norm of `params + updates`, as a `RowRule` without state."""

  def step(g, params, hyper: RowMaxNormHyper):
    dtype = compute_dtype(g.dtype)
    u = g.astype(dtype)
    w = jnp.asarray(params).astype(dtype)
    new = w + u
    norm = row_norms(new)
    max_norm = jnp.asarray(hyper.max_norm, dtype)
    over = norm > max_norm
    scale = max_norm / jnp.where(over, norm, 1)
    clipped = new * broadcast_rows(scale, new) - w
    return jnp.where(broadcast_rows(over, u), clipped, u)

  return fused.stateless_rule('row_max_norm', step)


def row_max_norm(
    max_norm: float,
    *,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Keeps every row that an update writes within L2 norm `max_norm`.

  Place it last in the chain, after the learning rate, inside `lazy(...)`:
  `lazy(optax.chain(scale_by_rowwise_adagrad(), optax.scale_by_learning_rate
  (lr), row_max_norm(1.0)))`. It works with any lazy optimizer (its update
  rows and the parameter rows are all it reads); XLA computes it on those
  rows. Every leaf it sees is treated as rows along its first axis: keep
  dense layers out with `optax.masked` or `optax.partition`.

  Args:
    max_norm: the largest L2 norm a written row may have (> 0).
    impl: deprecated, no effect (XLA computes the clip on the rows; the
      tables' implementation is `lazy(..., impl=)`'s).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose `update` needs `params`.
    State: `optax.EmptyState()`.

  Example:
    >>> import jax.numpy as jnp, optax, lazy_optax
    >>> params = {'table': jnp.zeros((4, 2))}
    >>> tx = lazy_optax.lazy(optax.chain(optax.sgd(1.0),
    ...                                  lazy_optax.row_max_norm(0.5)))
    >>> grads = {'table': lazy_optax.SparseRows(jnp.array([1]),
    ...                                         jnp.array([[-3., -4.]]), 4)}
    >>> u, _ = tx.update(grads, tx.init(params), params)
    >>> lazy_optax.apply_updates(params, u)['table'][1]
    Array([0.3, 0.4], dtype=float32)
  """
  validate.hyperparameters('row_max_norm', positive=dict(max_norm=max_norm))
  fused.unused_impl(impl, 'row_max_norm')
  rule = _rule()
  hyper = RowMaxNormHyper(max_norm=max_norm)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError('row_max_norm needs params (the rows it bounds): call '
                       'update(grads, state, params).')
    return fused.apply_stateless(rule, updates, params, hyper), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
