"""Row-wise Adagrad with per-row counters: FBGEMM's COUNTER mode (AdagradW).

FBGEMM's `EXACT_ROWWISE_ADAGRAD` with `WeightDecayMode.COUNTER` and a
`CounterBasedRegularizationDefinition` keeps, next to the accumulator `G_r`,
two numbers per row: `row_counter` (how often the row was seen, optionally
decayed with a half-life) and the step at which it was last touched. They
scale the learning rate of rare rows and let weight decay catch up on the
steps a row was absent (AdagradW). Per touched row `r` at global step `t`
(the first step is 1; duplicates summed first; `delta = 1` for a row never
touched before, else `t - last_step_r`):

    c_r <- 1 + 2**(-delta / halflife) * c_r     (counter_halflife > 0)
           1                                    (counter_halflife == 0)
           c_r + 1                              (counter_halflife < 0)
    g'  = g_r + wd * w_r ('l2'), else g_r
    G_r <- G_r + mean_over_row(g' * g')
    m   = lr / (sqrt(G_r) + eps)
    w_r <- corr * w_r - m_adj * g_r;  last_step_r <- t

`m_adj` is `m` adjusted by `learning_rate_mode` for rows with
`c_r > tail_id_threshold` (`'tail_id_lr_increase'`:
`m * clip((max_counter / (c_r + 1))**ub, 1, 10)`, `'tail_id_lr_decrease'`:
`m * clip(((c_r + 1) / max_counter)**ub, 0.1, 1)`, `'counter_sgd'`:
`lr / (sqrt(ub * c_r) + eps)`), and `corr` the decay:
`1 - (halflife / c_r) * wd * lr` ('decoupled'), `1 - (halflife / c_r) * wd *
m` ('l2'), or, for 'adagradw', `(1 - wd * lr)**k` with
`k = min(delta, t - adjustment_iter)` and `m_adj` first set to
`m * sqrt(c_r)` (halflife -1) or `min(lr * c_r, ub) / (sqrt(G_r) + eps)`
(halflife -2), then multiplied by `(1 - wd * lr)**(k - 1)`. Nothing is
adjusted or decayed until `t > adjustment_iter` (when it is positive).
`max_counter` is refreshed every `max_counter_update_freq` steps to one
plus the largest counter (docs/optimizers.md says how it differs from
FBGEMM's for `counter_halflife > 0`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Union

import chex
import jax
import jax.numpy as jnp
import optax

from lazy_optax._src import fused
from lazy_optax._src import validate
from lazy_optax._src.bare import bare
from lazy_optax._src.lazy import lazy
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.numerics import compute_dtype
from lazy_optax._src.numerics import Mask
from lazy_optax._src.numerics import mask_leaves
from lazy_optax._src.numerics import per_row_full
from lazy_optax._src.numerics import row_mean_square

COUNTER_WEIGHT_DECAY_MODES = ('none', 'l2', 'decoupled', 'adagradw')
LEARNING_RATE_MODES = ('equal', 'tail_id_lr_increase', 'tail_id_lr_decrease',
                       'counter_sgd')


class ScaleByRowwiseAdagradWithCounterState(NamedTuple):
  """State of `rowwise_adagrad_with_counter`."""
  count: chex.Array  # int32 scalar, the global step (FBGEMM's `iter`)
  sum_of_squares: optax.Updates  # [num_rows] per parameter
  row_counter: optax.Updates  # float32 [num_rows] per parameter
  last_step: optax.Updates  # int32 [num_rows]: step of the last update, 0
  max_counter: chex.Array  # float32 scalar, FBGEMM's `max_counter`
  counter_peak: chex.Array  # float32 scalar, the largest counter stored


fused.declare(ScaleByRowwiseAdagradWithCounterState, fused.RuleFacts(
    'rowwise_adagrad_with_counter',
    ('sum_of_squares', 'row_counter', 'last_step'),
    'LazyOptaxRowwiseAdagradWithCounter', ('last_step',)))


class RowwiseAdagradCounterHyper(NamedTuple):
  """The rule's hyperparameters at one step, for one leaf (`new_rows`,
  `step`); the others are the rule's `_Config`."""
  count: chex.Array  # int32 scalar, the new global step (FBGEMM's `iter`)
  lr: jax.typing.ArrayLike
  wd: jax.typing.ArrayLike  # the leaf's weight decay (0: the mask says no)
  max_counter: jax.Array  # float32 scalar


class RowwiseAdagradCounterKernelHyper(NamedTuple):
  """The kernel's record: rows.cc's `ROWWISE_ADAGRAD_COUNTER_FIELDS`, in
  order (`step` and `catch_up_cap` are its int32 fields), made by
  `_kernel_hyper`."""
  lr: jax.typing.ArrayLike
  eps: jax.typing.ArrayLike
  wd: jax.typing.ArrayLike
  log_rho: jax.Array
  halflife: jax.typing.ArrayLike
  enabled: jax.Array
  adjustment_ub: jax.typing.ArrayLike
  max_counter: jax.Array
  threshold: jax.Array
  decay_mode: float
  lr_mode: float
  step: jax.Array
  catch_up_cap: jax.Array


_DECAY_CODES = {'none': 0.0, 'l2': 1.0, 'decoupled': 2.0, 'adagradw': 3.0}
_LR_CODES = {'equal': -1.0, 'tail_id_lr_increase': 0.0,
             'tail_id_lr_decrease': 1.0, 'counter_sgd': 2.0}


class _Config(NamedTuple):
  """The rule's configuration (FBGEMM's optimizer args). The modes are
  static; the numbers may be arrays (`optax.inject_hyperparams`)."""
  eps: jax.typing.ArrayLike
  decay_mode: str
  halflife: Union[int, jax.Array]
  adjustment_iter: Union[int, jax.Array]
  adjustment_ub: jax.typing.ArrayLike
  lr_mode: str
  tail_id_threshold: jax.typing.ArrayLike
  threshold_is_ratio: Union[bool, jax.Array]


def _log_rho(halflife: jax.typing.ArrayLike) -> jax.Array:
  """`log(2) / halflife` in float32 (1 for a half-life that is not > 0)."""
  h = jnp.asarray(halflife, jnp.float32)
  return math.log(2.0) / jnp.where(h > 0, h, 1.0)


def _threshold(cfg: _Config, max_counter: jax.Array,
               dtype: jax.typing.DTypeLike) -> jax.Array:
  threshold = jnp.asarray(cfg.tail_id_threshold, dtype)
  return jnp.where(cfg.threshold_is_ratio,
                   jnp.floor(threshold * max_counter), threshold)


def _enabled(cfg: _Config, t: jax.Array) -> jax.Array:
  """FBGEMM's `adjustment_enabled`."""
  return jnp.asarray((cfg.adjustment_iter <= 0) | (t > cfg.adjustment_iter))


def _new_counter(c: jax.Array, delta: jax.Array,
                 halflife: jax.typing.ArrayLike) -> jax.Array:
  """The counter after one more appearance, `delta` steps after the last."""
  h = jnp.asarray(halflife, c.dtype)
  decay = jnp.exp(-delta * _log_rho(halflife).astype(c.dtype))
  return jnp.where(h > 0, 1.0 + decay * c,
                   jnp.where(h == 0, jnp.ones_like(c), c + 1.0))


def _gap(last_step: jax.Array, t: jax.Array,
         dtype: jax.typing.DTypeLike) -> jax.Array:
  """Steps since the row's last update (1 for a row never updated)."""
  return jnp.where(last_step == 0, 1, t - last_step).astype(dtype)


def _lr_adjusted(m, lr, c, max_counter, cfg: _Config, dtype):
  """`m` adjusted by the learning-rate mode for rows above the threshold."""
  if cfg.lr_mode == 'equal':
    return m
  ub = jnp.asarray(cfg.adjustment_ub, dtype)
  if cfg.lr_mode == 'tail_id_lr_increase':
    adj = m * jnp.clip((max_counter / (c + 1.0)) ** ub, 1.0, 10.0)
  elif cfg.lr_mode == 'tail_id_lr_decrease':
    adj = m * jnp.clip(((c + 1.0) / max_counter) ** ub, 0.1, 1.0)
  else:  # counter_sgd
    adj = lr / (jnp.sqrt(ub * c) + jnp.asarray(cfg.eps, dtype))
  return jnp.where(c > _threshold(cfg, max_counter, dtype), adj, m)


def _multipliers(g, stored, params, hyper: RowwiseAdagradCounterHyper, old,
                 cfg: _Config, dtype):
  """`(m_adj, corr)` per row: the step's scale and the weights' factor."""
  t = hyper.count
  lr = jnp.asarray(hyper.lr, dtype)
  wd = jnp.asarray(hyper.wd, dtype)
  max_counter = jnp.asarray(hyper.max_counter, dtype)
  acc = stored['sum_of_squares'].astype(dtype)
  c = stored['row_counter'].astype(dtype)
  denom = jnp.sqrt(acc) + jnp.asarray(cfg.eps, dtype)
  m = lr / denom
  enabled = _enabled(cfg, t)
  adj = jnp.where(enabled, _lr_adjusted(m, lr, c, max_counter, cfg, dtype),
                  m)
  one = jnp.ones_like(m)
  if cfg.decay_mode == 'adagradw':
    h = cfg.halflife
    capped = jnp.minimum(lr * c, jnp.asarray(cfg.adjustment_ub, dtype))
    scaled = jnp.where(h == -1, m * jnp.sqrt(c),
                       jnp.where(h == -2, capped / denom, adj))
    adj = jnp.where(enabled, scaled, adj)
    base = 1.0 - wd * lr
    k = jnp.minimum(_gap(old['last_step'], t, dtype),
                    jnp.asarray(t - cfg.adjustment_iter).astype(dtype))
    lazy_factor = base ** (k - 1.0)
    adj = jnp.where(enabled, adj * lazy_factor, adj)
    corr = jnp.where(enabled, base * lazy_factor, one)
  elif cfg.decay_mode in ('decoupled', 'l2'):
    freq = jnp.asarray(cfg.halflife, dtype) / c
    rate = lr if cfg.decay_mode == 'decoupled' else m
    corr = jnp.where(enabled, 1.0 - freq * wd * rate, one)
  else:
    corr = one
  return adj, corr


def _kernel_hyper(cfg: _Config, hyper: RowwiseAdagradCounterHyper
                  ) -> RowwiseAdagradCounterKernelHyper:
  """The kernel's record, from the rule's and its configuration."""
  t = hyper.count
  return RowwiseAdagradCounterKernelHyper(
      lr=hyper.lr, eps=cfg.eps, wd=hyper.wd, log_rho=_log_rho(cfg.halflife),
      halflife=cfg.halflife, enabled=_enabled(cfg, t).astype(jnp.float32),
      adjustment_ub=cfg.adjustment_ub, max_counter=hyper.max_counter,
      threshold=_threshold(cfg, hyper.max_counter, jnp.float32),
      decay_mode=_DECAY_CODES[cfg.decay_mode],
      lr_mode=_LR_CODES[cfg.lr_mode], step=t,
      catch_up_cap=jnp.asarray(t - cfg.adjustment_iter, jnp.int32))


def _rule(cfg: _Config) -> fused.RowRule:
  """The rule as a `RowRule` of a `RowwiseAdagradCounterHyper`.

  The step reads the old rows (the gap since a row's last update).
  """
  needs_params = cfg.decay_mode != 'none'

  def new_rows(g, rows, params, hyper: RowwiseAdagradCounterHyper):
    acc, c = rows['sum_of_squares'], rows['row_counter']
    dtype = compute_dtype(g.dtype, acc.dtype, c.dtype)
    t = hyper.count
    gap = _gap(rows['last_step'], t, dtype)
    g = g.astype(dtype)
    if cfg.decay_mode == 'l2':
      g = g + jnp.asarray(hyper.wd, dtype) * jnp.asarray(params).astype(dtype)
    return {'sum_of_squares': acc.astype(dtype) + row_mean_square(g),
            'row_counter': _new_counter(c.astype(dtype), gap, cfg.halflife),
            'last_step': jnp.broadcast_to(t, c.shape).astype(
                rows['last_step'].dtype)}

  def step(g, stored, params, hyper: RowwiseAdagradCounterHyper, rows):
    dtype = compute_dtype(g.dtype, stored['sum_of_squares'].dtype)
    adj, corr = _multipliers(g, stored, params, hyper, rows, cfg, dtype)
    update = -broadcast_rows(adj, g) * g.astype(dtype)
    if needs_params:
      w = jnp.asarray(params).astype(dtype)
      update = update + broadcast_rows(corr - 1.0, w) * w
    return update

  return fused.RowRule(
      'rowwise_adagrad_with_counter', new_rows, step,
      ('sum_of_squares', 'row_counter', 'last_step'),
      'LazyOptaxRowwiseAdagradWithCounter',
      functools.partial(_kernel_hyper, cfg),
      needs_params=needs_params, step_reads_old_rows=True,
      int_tables=('last_step',))


def _checked_config(fn, eps, weight_decay, counter_weight_decay_mode,
                    learning_rate_mode, counter_halflife, adjustment_iter,
                    adjustment_ub, tail_id_threshold,
                    tail_id_threshold_is_ratio, max_counter_update_freq,
                    impl) -> _Config:
  """The rule's `_Config`, its arguments checked (`fn` names the caller)."""
  if counter_weight_decay_mode not in COUNTER_WEIGHT_DECAY_MODES:
    raise ValueError(
        f'{fn}: counter_weight_decay_mode must be one of '
        f'{COUNTER_WEIGHT_DECAY_MODES}, got {counter_weight_decay_mode!r}.')
  if learning_rate_mode not in LEARNING_RATE_MODES:
    raise ValueError(
        f'{fn}: learning_rate_mode must be one of {LEARNING_RATE_MODES}, '
        f'got {learning_rate_mode!r}.')
  for name, value in (('counter_halflife', counter_halflife),
                      ('max_counter_update_freq', max_counter_update_freq)):
    if isinstance(value, (bool, float)):  # arrays: inject_hyperparams
      raise ValueError(f'{fn}: {name} must be an int, got {value!r}.')
  validate.hyperparameters(fn, non_negative=dict(
      eps=eps, weight_decay=weight_decay, adjustment_ub=adjustment_ub,
      tail_id_threshold=tail_id_threshold))
  if (counter_weight_decay_mode == 'none'
      and isinstance(weight_decay, (int, float)) and weight_decay != 0):
    raise ValueError(
        f'{fn}: weight_decay={weight_decay!r} has no effect with '
        "counter_weight_decay_mode='none': pass 'l2', 'decoupled' or "
        "'adagradw'.")
  fused.check_impl(impl, fn)
  return _Config(eps=eps, decay_mode=counter_weight_decay_mode,
                 halflife=counter_halflife, adjustment_iter=adjustment_iter,
                 adjustment_ub=adjustment_ub, lr_mode=learning_rate_mode,
                 tail_id_threshold=tail_id_threshold,
                 threshold_is_ratio=tail_id_threshold_is_ratio)


def _peak(row_counters: optax.Updates, peak: jax.Array) -> jax.Array:
  leaves = [jnp.max(c).astype(jnp.float32) for c in
            jax.tree.leaves(row_counters) if c.size]
  return jnp.maximum(peak, jnp.max(jnp.stack(leaves))) if leaves else peak


def _transform(learning_rate: optax.ScalarOrSchedule, cfg: _Config,
               weight_decay: jax.typing.ArrayLike, mask: Optional[Mask],
               accumulator_dtype: Optional[jax.typing.DTypeLike],
               max_counter_update_freq: int, impl: str
               ) -> optax.GradientTransformationExtraArgs:
  """The whole rule (its learning rate included), dense or fused."""
  rule = _rule(cfg)

  def init_fn(params):
    return ScaleByRowwiseAdagradWithCounterState(
        count=jnp.zeros([], jnp.int32),
        sum_of_squares=jax.tree.map(
            lambda p: per_row_full(p, accumulator_dtype), params),
        row_counter=jax.tree.map(
            lambda p: per_row_full(p, jnp.float32), params),
        last_step=jax.tree.map(lambda p: per_row_full(p, jnp.int32), params),
        max_counter=jnp.ones([], jnp.float32),
        counter_peak=jnp.ones([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    count = optax.safe_increment(state.count)
    lr = (learning_rate(state.count) if callable(learning_rate)
          else learning_rate)
    decays = None
    if rule.needs_params:
      if params is None:
        raise ValueError(
            'rowwise_adagrad_with_counter with counter_weight_decay_mode='
            f'{cfg.decay_mode!r} reads the weights: call '
            'tx.update(grads, state, params).')
      decays = mask_leaves(mask, params, jax.tree.structure(updates))

    def leaf_hyper(i: int, hyper: RowwiseAdagradCounterHyper
                   ) -> RowwiseAdagradCounterHyper:
      return hyper if decays is None or decays[i] else hyper._replace(wd=0.0)

    freq = max_counter_update_freq  # FBGEMM refreshes at its multiples
    due = (freq > 0) & (count % jnp.maximum(freq, 1) == 0)
    max_counter = jnp.where(due, state.counter_peak + 1.0,
                            state.max_counter).astype(jnp.float32)
    hyper = RowwiseAdagradCounterHyper(count=count, lr=lr, wd=weight_decay,
                                       max_counter=max_counter)
    new_updates, new = fused.apply_rule(
        rule, updates, {'sum_of_squares': state.sum_of_squares,
                        'row_counter': state.row_counter,
                        'last_step': state.last_step},
        params if rule.needs_params else None, hyper, impl,
        leaf_hyper=leaf_hyper)
    return new_updates, ScaleByRowwiseAdagradWithCounterState(
        count, max_counter=max_counter,
        counter_peak=_peak(fused.stored_rows(new['row_counter']),
                           state.counter_peak), **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def rowwise_adagrad_with_counter(
    learning_rate: optax.ScalarOrSchedule,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    counter_weight_decay_mode: str = 'none',
    mask: Optional[Mask] = None,
    *,
    counter_halflife: int = -1,
    adjustment_iter: int = -1,
    adjustment_ub: float = 1.0,
    learning_rate_mode: str = 'equal',
    tail_id_threshold: float = 0.0,
    tail_id_threshold_is_ratio: bool = False,
    max_counter_update_freq: int = 1000,
    accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Row-wise Adagrad with per-row counters (FBGEMM's COUNTER mode).

  The rule of FBGEMM's `EXACT_ROWWISE_ADAGRAD` with
  `WeightDecayMode.COUNTER` (module docstring): besides the accumulator,
  each row keeps a float32 counter of its appearances and the int32 step it
  was last updated at, 12 bytes a row in all. Use it for tables with a long
  tail: `'adagradw'` decays a rare row, when it comes back, as much as dense
  AdamW-style decay would have over the steps it was absent, and the
  learning-rate modes scale the step of rows by how often they were seen.
  Lazy on `SparseRows` gradients: untouched rows, their counters and last
  steps stay bit for bit.

  Args:
    learning_rate: a float or an optax schedule of the global step.
    eps: added to `sqrt(G_r)`.
    weight_decay: the decay rate, used as `counter_weight_decay_mode` says.
    counter_weight_decay_mode: `'none'`, `'l2'`, `'decoupled'` or
      `'adagradw'` (FBGEMM's `CounterWeightDecayMode`).
    mask: as in `optax.adamw`: which parameters decay.
    counter_halflife: `> 0`: the counter decays with this half-life in
      steps; `0`: it is 1 once seen; `< 0`: it counts appearances. With
      `'adagradw'`, -1 and -2 also choose how the counter scales the step.
    adjustment_iter: no adjustment or decay until the step exceeds it
      (`<= 0`: from the start).
    adjustment_ub: the exponent (tail modes) or factor (`'counter_sgd'`,
      `'adagradw'` with halflife -2) of the learning-rate adjustment.
    learning_rate_mode: `'equal'`, `'tail_id_lr_increase'`,
      `'tail_id_lr_decrease'` or `'counter_sgd'`.
    tail_id_threshold: rows whose counter exceeds it are adjusted.
    tail_id_threshold_is_ratio: the threshold is
      `floor(tail_id_threshold * max_counter)`.
    max_counter_update_freq: every this many steps, `max_counter` becomes
      one plus the largest counter (`<= 0`: it stays 1).
    accumulator_dtype: dtype of `G` (default float32).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'` (see
      `lazy_optax.kernel_status`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state holds a
    `ScaleByRowwiseAdagradWithCounterState`.

  Raises:
    ValueError: for an unknown mode, a negative rate, a non-integer
      half-life, or a non-zero `weight_decay` with mode `'none'`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((100, 4))}
    >>> tx = lazy_optax.rowwise_adagrad_with_counter(
    ...     0.1, weight_decay=0.01, counter_weight_decay_mode='adagradw')
    >>> state = tx.init(params)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([3, 7, 3]),
    ...                                     jnp.ones((3, 4)), 100)}
    >>> updates, state = tx.update(g, state, params)
    >>> state.row_counter['table'][jnp.array([3, 4, 7])]
    Array([1., 0., 1.], dtype=float32)
  """
  cfg = _checked_config(
      'rowwise_adagrad_with_counter', eps, weight_decay,
      counter_weight_decay_mode, learning_rate_mode, counter_halflife,
      adjustment_iter, adjustment_ub, tail_id_threshold,
      tail_id_threshold_is_ratio, max_counter_update_freq, impl)
  return lazy(_transform(learning_rate, cfg, weight_decay, mask,
                         accumulator_dtype, max_counter_update_freq, impl),
              impl=impl)


def scale_by_rowwise_adagrad_with_counter(
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    counter_weight_decay_mode: str = 'none',
    mask: Optional[Mask] = None,
    *,
    counter_halflife: int = -1,
    adjustment_iter: int = -1,
    adjustment_ub: float = 1.0,
    learning_rate_mode: str = 'equal',
    tail_id_threshold: float = 0.0,
    tail_id_threshold_is_ratio: bool = False,
    max_counter_update_freq: int = 1000,
    accumulator_dtype: Optional[jax.typing.DTypeLike] = None,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Rescales updates by row-wise Adagrad with per-row counters (no lr).

  The rule of `rowwise_adagrad_with_counter` (module docstring) without the
  learning rate: chained with `optax.scale_by_learning_rate(lr)` inside
  `lazy(...)` it gives the same parameters as
  `rowwise_adagrad_with_counter(lr, ...)` (its state sits in the chain's
  first slot). Every mode but `'adagradw'` has an update linear in the
  learning rate (`-lr` times a direction that does not depend on it), which
  is what this returns; `'adagradw'` decays a row by `(1 - wd lr)^k`, so it
  has no rate-free form and is refused here.

  Args:
    eps: added to `sqrt(G_r)`.
    weight_decay: the decay rate, used as `counter_weight_decay_mode` says.
    counter_weight_decay_mode: `'none'`, `'l2'` or `'decoupled'`.
    mask: as in `optax.adamw`: which parameters decay.
    counter_halflife: `> 0`: the counter decays with this half-life in
      steps; `0`: it is 1 once seen; `< 0`: it counts appearances.
    adjustment_iter: no adjustment or decay until the step exceeds it.
    adjustment_ub: the exponent (tail modes) or factor (`'counter_sgd'`) of
      the learning-rate adjustment.
    learning_rate_mode: `'equal'`, `'tail_id_lr_increase'`,
      `'tail_id_lr_decrease'` or `'counter_sgd'`.
    tail_id_threshold: rows whose counter exceeds it are adjusted.
    tail_id_threshold_is_ratio: the threshold is
      `floor(tail_id_threshold * max_counter)`.
    max_counter_update_freq: every this many steps, `max_counter` becomes
      one plus the largest counter.
    accumulator_dtype: dtype of `G` (default float32).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByRowwiseAdagradWithCounterState`; its `update` needs `params`
    in the `'l2'` and `'decoupled'` modes.

  Raises:
    ValueError: for `'adagradw'`, an unknown mode, a negative rate, a
      non-integer half-life, or a non-zero `weight_decay` with mode
      `'none'`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy(optax.chain(
    ...     lazy_optax.scale_by_rowwise_adagrad_with_counter(),
    ...     optax.scale_by_learning_rate(0.1)))
    >>> params = {'table': jnp.zeros((100, 4))}
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([3]), jnp.ones((1, 4)),
    ...                                     100)}
    >>> u, state = tx.update(g, tx.init(params), params)
    >>> lazy_optax.apply_updates(params, u)['table'][3]
    Array([-0.1, -0.1, -0.1, -0.1], dtype=float32)
  """
  fn = 'scale_by_rowwise_adagrad_with_counter'
  if counter_weight_decay_mode == 'adagradw':
    raise ValueError(
        f"{fn}: counter_weight_decay_mode='adagradw' decays a row by "
        '(1 - weight_decay * lr)^k, not linearly in the learning rate, so '
        'it has no form without one: use rowwise_adagrad_with_counter('
        'learning_rate, ...).')
  cfg = _checked_config(
      fn, eps, weight_decay, counter_weight_decay_mode, learning_rate_mode,
      counter_halflife, adjustment_iter, adjustment_ub, tail_id_threshold,
      tail_id_threshold_is_ratio, max_counter_update_freq, impl)
  # Linear in the learning rate: the rule at rate -1 is the direction that
  # `optax.scale_by_learning_rate(lr)` (a factor of -lr) makes the update.
  return bare(_transform(-1.0, cfg, weight_decay, mask, accumulator_dtype,
                         max_counter_update_freq, impl), fn, impl)
