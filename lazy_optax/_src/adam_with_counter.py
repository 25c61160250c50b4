"""Adam with a step counter per row: bias correction and catch-up per row.

`lazy_adam` keeps one global step count, as TensorFlow, Keras and PyTorch's
`SparseAdam` do, so a row first seen at global step 1,000 is bias-corrected
with t = 1,000: its first step is about 2.5x the learning rate (with the
default betas), where a fresh dense Adam's first step is exactly `lr`. And a
row that comes back after k absent steps keeps the moments it left with,
where dense Adam would have decayed them by `b1^k` and `b2^k`.

`scale_by_adam_with_counter` and `adam_with_counter` (named `row_adam` before
0.2) keep two step counters per row next to `mu` and `nu`, each a
`[num_rows]` int32 array per parameter (a scalar for a scalar parameter),
built by mapping over the parameters so that `lazy(...)` gathers and scatters
them with the other row state:

- `last_step`: the global step at which the row was last updated (0: never);
- `row_count`: how many updates the row has had, or, with `catch_up=True`,
  how many steps have passed since its first update (its age).

Per touched row, with t the global step after this update and
k = t - last_step - 1 the steps the row was absent:

    catch_up:  m <- b1^k * m;  v <- b2^k * v             (O(1) per row)
    m <- b1 * m + (1 - b1) * g;  v <- b2 * v + (1 - b2) * g * g
    n <- row_count (bias_correction='per_row') or t ('global')
    step <- sqrt(1 - b2^n) / (1 - b1^n) * m / (sqrt(v + eps_root) + eps)

With `catch_up=True` and `bias_correction='global'` the moments of a row
equal dense Adam's (zero gradient while absent) whenever it is touched; its
parameter still does not move while absent. Decoupled weight decay
(`adam_with_counter(weight_decay=...)`) applies to touched rows; with
`decay_skipped_steps=True` it compounds over the steps since the row's last
update, `p <- (1 - lr * wd)^(t - last_step) * p`, as dense AdamW's decay
would have (at the current learning rate).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

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
from lazy_optax._src.numerics import one_minus_power
from lazy_optax._src.numerics import per_row_full
from lazy_optax._src.numerics import power

_BIAS_CORRECTIONS = ('per_row', 'global')


class ScaleByAdamWithCounterState(NamedTuple):
  """State of `scale_by_adam_with_counter` / `adam_with_counter`."""
  count: chex.Array  # int32 scalar, the global step
  mu: optax.Updates
  nu: optax.Updates
  row_count: optax.Updates  # int32 [num_rows] per parameter
  last_step: optax.Updates  # int32 [num_rows] per parameter


fused.declare(ScaleByAdamWithCounterState, fused.RuleFacts(
    'adam_with_counter', ('mu', 'nu', 'row_count', 'last_step')))


def _no_decay(weight_decay: jax.typing.ArrayLike) -> bool:
  """Whether weight decay is off: a Python 0 (an array, such as one that
  `optax.inject_hyperparams` passes, may change, so it counts as on)."""
  return isinstance(weight_decay, (int, float)) and weight_decay == 0


class _Config(NamedTuple):
  """The hyperparameters of the per-row rule, but the learning rate."""
  b1: float
  b2: float
  eps: float
  eps_root: float
  bias_correction: str
  catch_up: bool
  weight_decay: float
  decay_skipped_steps: bool


class AdamWithCounterHyper(NamedTuple):
  """The rule's hyperparameters at one step, for one leaf (`new_rows`,
  `step`); the others are the rule's `_Config`."""
  count: chex.Array  # int32 scalar, the new global step
  lr: Optional[jax.typing.ArrayLike]  # None: no learning rate applied
  decay: bool  # whether this leaf decays


class _RowLeaf(NamedTuple):
  """One parameter's gradient, state rows and (for weight decay) rows."""
  grad: jax.Array
  mu: jax.Array
  nu: jax.Array
  row_count: jax.Array
  last_step: jax.Array
  param: Optional[jax.Array]  # None where the rule reads no params
  decay: bool


def _moments(leaf: _RowLeaf, count: jax.Array, cfg: _Config,
             dtype: jax.typing.DTypeLike
             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """New moments and row count, after catching up on absent steps."""
  g, m, v = (x.astype(dtype) for x in (leaf.grad, leaf.mu, leaf.nu))
  seen = leaf.row_count > 0
  since = count - leaf.last_step  # steps since the last update, this one too
  if cfg.catch_up:
    absent = jnp.where(seen, since - 1, 0)
    m = m * broadcast_rows(power(cfg.b1, absent, dtype), m)
    v = v * broadcast_rows(power(cfg.b2, absent, dtype), v)
    row_count = jnp.where(seen, leaf.row_count + since, 1)
  else:
    row_count = leaf.row_count + 1
  m = cfg.b1 * m + (1 - cfg.b1) * g
  v = cfg.b2 * v + (1 - cfg.b2) * (g * g)
  return m, v, row_count, since


def _scaled_step(m: jax.Array, v: jax.Array, steps: jax.Array, cfg: _Config,
                 dtype: jax.typing.DTypeLike) -> jax.Array:
  """The bias-corrected Adam direction with epsilon hat."""
  correction = (jnp.sqrt(one_minus_power(cfg.b2, steps, dtype))
                / one_minus_power(cfg.b1, steps, dtype))
  return broadcast_rows(correction, m) * m / (jnp.sqrt(v + cfg.eps_root)
                                              + cfg.eps)


def _apply_lr_and_decay(step: jax.Array, leaf: _RowLeaf,
                        lr: jax.typing.ArrayLike,
                        since: jax.Array, cfg: _Config,
                        dtype: jax.typing.DTypeLike) -> jax.Array:
  """`-lr * step`, minus decoupled weight decay (over skipped steps too)."""
  lr_d = jnp.asarray(lr, dtype)
  step = -lr_d * step
  if _no_decay(cfg.weight_decay) or not leaf.decay:
    return step
  p = jnp.asarray(leaf.param).astype(dtype)
  rate = jnp.asarray(cfg.weight_decay, dtype) * lr_d
  if cfg.decay_skipped_steps:
    shrink = -jnp.expm1(since.astype(dtype) * jnp.log1p(-rate))
    return step - broadcast_rows(shrink, p) * p
  return step - rate * p


def _update_leaf(leaf: _RowLeaf, count: jax.Array,
                 lr: Optional[jax.typing.ArrayLike], cfg: _Config
                 ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """One parameter's update and new state leaves (mu, nu, counts)."""
  dtype = compute_dtype(leaf.grad.dtype, leaf.mu.dtype, leaf.nu.dtype)
  m, v, row_count, since = _moments(leaf, count, cfg, dtype)
  steps = row_count if cfg.bias_correction == 'per_row' else count
  step = _scaled_step(m, v, steps, cfg, dtype)
  if lr is not None:
    step = _apply_lr_and_decay(step, leaf, lr, since, cfg, dtype)
  rc, ls = leaf.row_count, leaf.last_step
  return step.astype(leaf.grad.dtype), (
      m.astype(leaf.mu.dtype), v.astype(leaf.nu.dtype),
      jnp.broadcast_to(row_count, rc.shape).astype(rc.dtype),
      jnp.broadcast_to(count, ls.shape).astype(ls.dtype))


def _row_rule(cfg: _Config, needs_params: bool) -> fused.RowRule:
  """The per-row rule as a `RowRule` of an `AdamWithCounterHyper` (no CPU
  kernel: 'generic' or 'xla').

  The step reads the old rows (the steps since a row's last update, and the
  moments before they are rounded to their dtypes).
  """

  def leaf(g, rows, params, hyper: AdamWithCounterHyper) -> _RowLeaf:
    return _RowLeaf(grad=g, mu=rows['mu'], nu=rows['nu'],
                    row_count=rows['row_count'],
                    last_step=rows['last_step'], param=params,
                    decay=hyper.decay)

  def new_rows(g, rows, params, hyper: AdamWithCounterHyper):
    _, (mu, nu, row_count, last_step) = _update_leaf(
        leaf(g, rows, params, hyper), hyper.count, None, cfg)
    return {'mu': mu, 'nu': nu, 'row_count': row_count,
            'last_step': last_step}

  def step(g, stored, params, hyper: AdamWithCounterHyper, rows):
    del stored
    return _update_leaf(leaf(g, rows, params, hyper), hyper.count,
                        hyper.lr, cfg)[0]

  return fused.RowRule('adam_with_counter', new_rows, step,
                       ('mu', 'nu', 'row_count', 'last_step'),
                       needs_params=needs_params, step_reads_old_rows=True)


def _adam_with_counter_rule(
    *,
    b1: float,
    b2: float,
    eps: float,
    eps_root: float,
    mu_dtype: Optional[jax.typing.DTypeLike],
    nu_dtype: Optional[jax.typing.DTypeLike],
    bias_correction: str,
    catch_up: bool,
    learning_rate: Optional[optax.ScalarOrSchedule] = None,
    weight_decay: float = 0.0,
    mask: Optional[Mask] = None,
    decay_skipped_steps: bool = False,
    impl: str = 'auto',
    fn: str = 'scale_by_adam_with_counter',
) -> optax.GradientTransformationExtraArgs:
  """The per-row rule, dense or fused inside `lazy(...)`."""
  if bias_correction not in _BIAS_CORRECTIONS:
    raise ValueError(
        f'{fn}: bias_correction must be one of {_BIAS_CORRECTIONS}, got '
        f'{bias_correction!r}.')
  validate.hyperparameters(
      fn, beta=dict(b1=b1, b2=b2), non_negative=dict(
          eps=eps, eps_root=eps_root, weight_decay=weight_decay))
  fused.check_impl(impl, fn)
  cfg = _Config(b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                bias_correction=bias_correction, catch_up=catch_up,
                weight_decay=weight_decay,
                decay_skipped_steps=decay_skipped_steps)
  decays_on = not _no_decay(weight_decay)
  rule = _row_rule(cfg, needs_params=decays_on)

  def init_fn(params):
    return ScaleByAdamWithCounterState(
        count=jnp.zeros([], jnp.int32),
        mu=optax.tree_utils.tree_zeros_like(params, dtype=mu_dtype),
        nu=optax.tree_utils.tree_zeros_like(params, dtype=nu_dtype),
        row_count=jax.tree.map(lambda p: per_row_full(p, jnp.int32), params),
        last_step=jax.tree.map(lambda p: per_row_full(p, jnp.int32), params))

  def update_fn(updates, state, params=None, **extra_args):
    count = optax.safe_increment(state.count)
    lr = (learning_rate(state.count) if callable(learning_rate)
          else learning_rate)  # None: no learning rate applied
    decays = None
    if decays_on:
      if params is None:
        raise ValueError(
            'adam_with_counter with weight_decay needs params in '
            'update(grads, state, params).')
      decays = mask_leaves(mask, params, jax.tree.structure(updates))

    def leaf_hyper(i: int, hyper: AdamWithCounterHyper
                   ) -> AdamWithCounterHyper:
      return hyper._replace(decay=decays is not None and bool(decays[i]))

    new_updates, new = fused.apply_rule(
        rule, updates, {'mu': state.mu, 'nu': state.nu,
                        'row_count': state.row_count,
                        'last_step': state.last_step},
        params if decays_on else None,
        AdamWithCounterHyper(count=count, lr=lr, decay=False), impl,
        leaf_hyper=leaf_hyper)
    return new_updates, ScaleByAdamWithCounterState(count, **new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_adam_with_counter(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    bias_correction: str = 'per_row',
    catch_up: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Lazy Adam scaling with per-row bias correction and catch-up (no lr).

  Use it when rows appear at very different times (new ids in a
  recommender, a vocabulary that grows, long-tail items): with the global
  count of `scale_by_lazy_adam`, a row first seen late takes a first step
  of about 2.5x the learning rate; per row it takes exactly `lr`. Use
  `catch_up=True` when you want a returning row's moments to be what dense
  Adam would have had (momentum from long ago forgotten), at O(1) per row.
  The rule is in the module docstring; epsilon is "epsilon hat" as in
  `lazy_adam`. Put the whole chain inside `lazy(...)`, as in the example, so
  that the learning-rate scaling also sees row blocks (or use
  `adam_with_counter`).

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to `sqrt(v)` after the bias correction.
    eps_root: added to `v` inside the square root.
    mu_dtype: dtype of `mu` (default: the parameter's).
    nu_dtype: dtype of `nu` (default: the parameter's).
    bias_correction: `'per_row'` (each row's own count) or `'global'` (the
      global step, as `lazy_adam`).
    catch_up: decay a returning row's moments by `b1^k`, `b2^k` for its k
      absent steps; `row_count` then counts steps since the row's first
      update.
    impl: how the touched rows are updated inside `lazy(...)`: `'auto'`,
      `'generic'` or `'xla'` (the rule has no CPU kernel, so
      `'cpu_kernel'` raises; see `lazy_optax.explain_update`).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByAdamWithCounterState(count, mu, nu, row_count, last_step)`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy(optax.chain(
    ...     lazy_optax.scale_by_adam_with_counter(),
    ...     optax.scale_by_learning_rate(1e-3)))
    >>> state = tx.init({'table': jnp.zeros((100, 8))})
    >>> lazy_optax.compat.get_slot(state, 'table', 'row_count').shape
    (100,)
  """
  return bare(_adam_with_counter_rule(
      b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
      nu_dtype=nu_dtype, bias_correction=bias_correction, catch_up=catch_up,
      impl=impl), 'scale_by_adam_with_counter', impl)


def adam_with_counter(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Optional[jax.typing.DTypeLike] = None,
    weight_decay: float = 0.0,
    mask: Optional[Mask] = None,
    *,
    nu_dtype: Optional[jax.typing.DTypeLike] = None,
    bias_correction: str = 'per_row',
    catch_up: bool = False,
    decay_skipped_steps: bool = False,
    impl: str = 'auto',
) -> optax.GradientTransformationExtraArgs:
  """Lazy Adam(W) with a step counter per row.

  See `scale_by_adam_with_counter` for the rule.

  Touched rows move by `-lr * step`, and with `weight_decay` also by
  `-lr * weight_decay * p` (decoupled, touched rows only, as `lazy_adamw`).
  Use `decay_skipped_steps=True` when untouched rows should not escape
  weight decay: a row updated again after `s` steps decays by
  `1 - (1 - lr * weight_decay)^s` of itself, what `s` steps of dense AdamW's
  decay would have removed.

  Args:
    learning_rate: a float or an optax schedule of the global step.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: "epsilon hat", added to `sqrt(v)`.
    eps_root: added to `v` inside the square root.
    mu_dtype: dtype of `mu`.
    weight_decay: decoupled weight decay rate (0 for none).
    mask: as in `optax.adamw`: a tree of bools, or a function of the params
      giving one, saying which parameters decay.
    nu_dtype: dtype of `nu`.
    bias_correction: `'per_row'` or `'global'`.
    catch_up: decay returning rows' moments for their absent steps.
    decay_skipped_steps: compound weight decay over the steps since the
      row's last update.
    impl: `'auto'`, `'generic'` or `'xla'` (see
      `scale_by_adam_with_counter`).

  Returns:
    An `optax.GradientTransformationExtraArgs` with state
    `ScaleByAdamWithCounterState`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((10, 2))}
    >>> tx = lazy_optax.adam_with_counter(0.1)
    >>> state = tx.init(params)
    >>> g = {'table': lazy_optax.SparseRows(jnp.array([7]), jnp.ones((1, 2)),
    ...                                     10)}
    >>> for _ in range(3):  # row 7 takes a first step of exactly lr
    ...   _, state = tx.update({'table': lazy_optax.SparseRows(
    ...       jnp.array([1]), jnp.ones((1, 2)), 10)}, state, params)
    >>> updates, state = tx.update(g, state, params)
    >>> lazy_optax.apply_updates(params, updates)['table'][7]
    Array([-0.1, -0.1], dtype=float32)
  """
  if _no_decay(weight_decay) and decay_skipped_steps:
    raise ValueError(
        'adam_with_counter: decay_skipped_steps=True needs weight_decay > 0.')
  return lazy(_adam_with_counter_rule(
      b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
      nu_dtype=nu_dtype, bias_correction=bias_correction, catch_up=catch_up,
      learning_rate=learning_rate, weight_decay=weight_decay, mask=mask,
      decay_skipped_steps=decay_skipped_steps, impl=impl,
      fn='adam_with_counter'), impl=impl)
