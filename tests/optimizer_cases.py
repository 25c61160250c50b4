"""The optimizers under test, each with its float64 model: the conformance
suite's parameter list (tests/test_conformance.py, tests/sharded_checks.py).

A `Case` names one optimizer configuration: how to build it, its float64
model (tests/reference.py), the state slots to compare with the model, and
the chain of `scale_by_...` transformations that must give the same rule.
`CASES` holds one case per optimizer (every property is checked on each);
`RULE_CASES` adds the other configurations whose rule is checked against the
model; `IMPL_CASES` runs each of those on every implementation its optimizer
offers (`impls`: 'generic', 'xla', 'cpu_kernel'; the other configurations
on those but 'xla', which moves their rows as their optimizer's case
checks, with the arithmetic that 'generic' runs). A new optimizer is one
more `Case` (and its `impls`); this is the only registry of optimizers the
tests keep.

Shared helpers: `batches` (ids with heavy duplicates and rows that go
absent), `run` (a jitted, donated training loop on one table; runs of one
optimizer object share its jitted step), `untouched`,
`run_dense`, `run_partitioned`, `assert_checkpoint_resumes` and
`assert_state_shardings_follow_rows`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import reference

import lazy_optax

NUM_ROWS, D = 40, 3


@dataclasses.dataclass(frozen=True)
class Slot:
  """A per-table state leaf (`lazy_optax.compat.get_slot` name) and the
  model attribute it must equal, within `rtol`/`atol`."""
  name: str
  model_attr: str
  rtol: float
  atol: float
  initial: float = 0.0   # its value in rows that were never touched


@dataclasses.dataclass(frozen=True)
class Dtypes:
  """A 16-bit configuration: table dtype, extra arguments, slot dtypes."""
  table: Any
  kwargs: dict
  slot_dtypes: dict
  atol: float


@dataclasses.dataclass(frozen=True)
class Case:
  """One optimizer configuration and its float64 model."""
  name: str
  fn: Callable[..., optax.GradientTransformation]
  lr: float
  kwargs: dict
  model: Callable[..., Any]           # model(table, lr) -> reference model
  slots: tuple[Slot, ...]
  slot_names: tuple[str, ...]         # compat.get_slot_names of the state
  chained: Optional[Callable[[], optax.GradientTransformation]] = None
  dtypes: tuple[Dtypes, ...] = ()
  rtol: float = 2e-5
  atol: float = 1e-6
  table_scale: float = 1.0            # ftrl starts from small weights
  steps: int = 12
  # The implementations the optimizer offers (its `impl=` values), and the
  # one this case asks for (None: the default, 'auto').
  impls: tuple[str, ...] = ()
  impl: Optional[str] = None
  # The rule modules of lazy_optax/_src (those that build a `fused.RowRule`)
  # whose rules this case runs against its model.
  rule_modules: tuple[str, ...] = ()
  # The optimizer's bare rule, `scale_by_...` (None: it has none).
  scale_by: Optional[Callable[..., optax.GradientTransformation]] = None
  # Whether its kernel runs on each device's rows of an Explicit mesh and is
  # checked there against one device (tests/kernel_shards.py).
  on_mesh: bool = False

  def make(self, lr: Any = None) -> optax.GradientTransformation:
    kwargs = dict(self.kwargs)
    if self.impl is not None:
      kwargs['impl'] = self.impl
    return self.fn(self.lr if lr is None else lr, **kwargs)

  def reference(self, table: Any, lr: Any = None) -> Any:
    return self.model(table, self.lr if lr is None else lr)

  def __str__(self) -> str:
    return self.name


def _scaled(scale_by: Callable[..., Any], lr: float, **kw: Any):
  return lambda: lazy_optax.lazy(optax.chain(
      optax.clip_by_global_norm(1e6), scale_by(**kw),
      optax.scale_by_learning_rate(lr)))


_ALL_IMPLS = ('generic', 'xla', 'cpu_kernel')
_ADAM_SLOTS = (Slot('m', 'm', 2e-5, 1e-7), Slot('v', 'v', 2e-5, 1e-9))
_BF16 = jnp.bfloat16

LAZY_ADAM = Case(
    'lazy_adam', lazy_optax.lazy_adam, 0.01, {},
    lambda t, lr: reference.TFLazyAdam(t, lr=lr), _ADAM_SLOTS, ('m', 'v'),
    chained=_scaled(lazy_optax.scale_by_lazy_adam, 0.01),
    dtypes=(Dtypes(_BF16, {}, {'m': _BF16, 'v': _BF16}, 3e-2),
            Dtypes(_BF16, dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32),
                   {'m': jnp.float32, 'v': jnp.float32}, 3e-2)),
    steps=25, impls=_ALL_IMPLS, rule_modules=('adam',),
    scale_by=lazy_optax.scale_by_lazy_adam, on_mesh=True)

ROWWISE_ADAGRAD = Case(
    'rowwise_adagrad', lazy_optax.rowwise_adagrad, 0.1, {},
    lambda t, lr: reference.RowwiseAdagrad(t, lr=lr),
    (Slot('sum_of_squares', 'g2', 1e-5, 1e-7),), ('sum_of_squares',),
    chained=_scaled(lazy_optax.scale_by_rowwise_adagrad, 0.1),
    dtypes=(Dtypes(_BF16, {}, {'sum_of_squares': jnp.float32}, 3e-2),
            Dtypes(jnp.float32, dict(accumulator_dtype=_BF16),
                   {'sum_of_squares': _BF16}, 2e-2)),
    rtol=1e-5, impls=_ALL_IMPLS, rule_modules=('rowwise_adagrad',),
    scale_by=lazy_optax.scale_by_rowwise_adagrad)

PARTIAL_ROWWISE_ADAM = Case(
    'partial_rowwise_adam', lazy_optax.partial_rowwise_adam, 0.05, {},
    lambda t, lr: reference.PartialRowwiseAdam(t, lr=lr),
    (Slot('mu', 'm', 2e-5, 1e-7), Slot('nu', 'v', 2e-5, 1e-9)), ('m', 'v'),
    chained=_scaled(lazy_optax.scale_by_partial_rowwise_adam, 0.05),
    dtypes=(Dtypes(_BF16, {}, {'mu': _BF16, 'nu': jnp.float32}, 3e-2),
            Dtypes(jnp.float32, dict(mu_dtype=_BF16, nu_dtype=_BF16),
                   {'mu': _BF16, 'nu': _BF16}, 1e-2)),
    steps=15, impls=_ALL_IMPLS, rule_modules=('partial_rowwise_adam',),
    scale_by=lazy_optax.scale_by_partial_rowwise_adam, on_mesh=True)

FTRL = Case(
    'ftrl', lazy_optax.ftrl, 0.1, dict(l1=0.01, beta=0.3),
    lambda t, lr: reference.Ftrl(t, lr=lr, l1=0.01, beta=0.3),
    (Slot('accumulator', 'n', 1e-6, 0.0, initial=0.1),
     Slot('linear', 'z', 1e-5, 1e-6)), ('accumulator', 'linear'),
    chained=lambda: lazy_optax.lazy(optax.chain(
        optax.clip_by_global_norm(1e6),
        lazy_optax.ftrl(0.1, l1=0.01, beta=0.3))),
    dtypes=(Dtypes(_BF16, dict(accumulator_dtype=jnp.float32,
                               linear_dtype=jnp.float32),
                   {'accumulator': jnp.float32, 'linear': jnp.float32}, 1e-2),
            Dtypes(jnp.float32, dict(accumulator_dtype=_BF16,
                                     linear_dtype=_BF16),
                   {'accumulator': _BF16, 'linear': _BF16}, 1e-2)),
    rtol=1e-5, table_scale=0.1, impls=_ALL_IMPLS, rule_modules=('ftrl',),
    on_mesh=True)

ADAM_WITH_COUNTER = Case(
    'adam_with_counter', lazy_optax.adam_with_counter, 0.05,
    dict(catch_up=True),
    lambda t, lr: reference.AdamWithCounter(t, lr=lr, catch_up=True),
    (Slot('m', 'm', 3e-5, 1e-7), Slot('v', 'v', 3e-5, 1e-9),
     Slot('row_count', 'row_count', 0, 0),
     Slot('last_step', 'last_step', 0, 0)),
    ('last_step', 'm', 'row_count', 'v'),
    chained=_scaled(lazy_optax.scale_by_adam_with_counter, 0.05,
                    catch_up=True),
    dtypes=(Dtypes(_BF16, dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32),
                   {'m': jnp.float32, 'v': jnp.float32,
                    'row_count': jnp.int32}, 3e-2),),
    rtol=3e-5, steps=14, impls=('generic', 'xla'),
    rule_modules=('adam_with_counter',),
    scale_by=lazy_optax.scale_by_adam_with_counter)

_COUNTER_ADAGRAD_KW = dict(weight_decay=0.1,
                          counter_weight_decay_mode='adagradw')
_COUNTER_ADAGRAD_SLOTS = (Slot('sum_of_squares', 'g2', 1e-5, 1e-7),
                          Slot('row_counter', 'row_counter', 1e-6, 0),
                          Slot('last_step', 'last_step', 0, 0))

ROWWISE_ADAGRAD_WITH_COUNTER = Case(
    'rowwise_adagrad_with_counter', lazy_optax.rowwise_adagrad_with_counter,
    0.1, _COUNTER_ADAGRAD_KW,
    lambda t, lr: reference.RowwiseAdagradWithCounter(
        t, lr=lr, **_COUNTER_ADAGRAD_KW),
    _COUNTER_ADAGRAD_SLOTS, ('last_step', 'row_counter', 'sum_of_squares'),
    chained=lambda: lazy_optax.lazy(optax.chain(
        optax.clip_by_global_norm(1e6),
        lazy_optax.rowwise_adagrad_with_counter(0.1, **_COUNTER_ADAGRAD_KW))),
    dtypes=(Dtypes(_BF16, {}, {'sum_of_squares': jnp.float32,
                               'row_counter': jnp.float32,
                               'last_step': jnp.int32}, 3e-2),
            Dtypes(jnp.float32, dict(accumulator_dtype=_BF16),
                   {'sum_of_squares': _BF16}, 2e-2)),
    rtol=2e-5, steps=16, impls=_ALL_IMPLS,
    rule_modules=('rowwise_adagrad_with_counter',),
    scale_by=lazy_optax.scale_by_rowwise_adagrad_with_counter)

ROWWISE_RMSPROP_AR = Case(
    'rowwise_rmsprop_ar', lazy_optax.rowwise_rmsprop_ar, 0.05,
    dict(ar_alpha=2.0, ema_beta=0.9),
    lambda t, lr: reference.RowwiseRmspropAr(t, lr=lr, ar_alpha=2.0,
                                             ema_beta=0.9),
    (Slot('nu', 'v', 1e-5, 1e-7), Slot('prev_iter', 'prev_iter', 0, 0)),
    ('prev_iter', 'v'),
    chained=lambda: lazy_optax.lazy(optax.chain(
        optax.clip_by_global_norm(1e6),
        lazy_optax.rowwise_rmsprop_ar(0.05, ar_alpha=2.0, ema_beta=0.9))),
    dtypes=(Dtypes(_BF16, {}, {'nu': jnp.float32, 'prev_iter': jnp.int32},
                   3e-2),
            Dtypes(jnp.float32, dict(accumulator_dtype=_BF16),
                   {'nu': _BF16, 'prev_iter': jnp.int32}, 2e-2)),
    rtol=1e-5, steps=14, impls=_ALL_IMPLS,
    rule_modules=('rowwise_rmsprop_ar',))

OPTAX_ADAM = Case(
    'lazy(optax.adam)',
    lambda learning_rate: lazy_optax.lazy(optax.adam(learning_rate)), 0.01, {},
    lambda t, lr: reference.OptaxAdam(t, lr=lr),
    (Slot('mu', 'm', 2e-5, 1e-7), Slot('nu', 'v', 2e-5, 1e-9)), ('m', 'v'),
    chained=lambda: lazy_optax.lazy(optax.chain(
        optax.clip_by_global_norm(1e6), optax.scale_by_adam(),
        optax.scale_by_learning_rate(0.01))),
    dtypes=(Dtypes(_BF16, dict(), {'mu': _BF16, 'nu': _BF16}, 3e-2),),
    steps=20)


def with_unit_counts(tx: optax.GradientTransformation
                     ) -> optax.GradientTransformationExtraArgs:
  """`tx` (CowClip inside) given `counts=` of one per distinct id.

  The suite calls `update(grads, state, params)`; CowClip also needs each
  id's count in the batch, which a `SparseRows` no longer holds. Here every
  distinct id of a `SparseRows` gradient (every row of a dense one) counts
  once, and the model (`reference.CowClip(counts='distinct')`) does the
  same; tests/test_cowclip.py passes the batch's true counts.
  """
  def counts_of(g):
    if isinstance(g, lazy_optax.SparseRows):
      return lazy_optax.id_counts(g.ids, g.num_rows)
    rows = jnp.shape(g)[0] if jnp.ndim(g) else 1
    return lazy_optax.id_counts(jnp.arange(rows), rows)

  def update(grads, state, params=None, **extra):
    counts = jax.tree.map(counts_of, grads,
                          is_leaf=lazy_optax.tree.is_sparse_rows)
    return tx.update(grads, state, params, counts=counts, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def lazy_adam_cowclip_unit_counts(learning_rate, coef=1.0, lower_bound=1e-5,
                                  *, mu_dtype=None, nu_dtype=None,
                                  impl='auto'):
  return with_unit_counts(lazy_optax.lazy_adam_cowclip(
      learning_rate, coef, lower_bound, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
      impl=impl))


def rowwise_adagrad_max_norm(learning_rate, max_norm=1.0, *,
                             accumulator_dtype=None, impl='auto'):
  """Row-wise Adagrad with every written row kept within `max_norm`."""
  return lazy_optax.lazy(optax.chain(
      lazy_optax.scale_by_rowwise_adagrad(
          accumulator_dtype=accumulator_dtype, impl=impl),
      optax.scale_by_learning_rate(learning_rate),
      lazy_optax.row_max_norm(max_norm)), impl=impl)


_COWCLIP = dict(coef=0.8, lower_bound=0.5)

LAZY_ADAM_COWCLIP = dataclasses.replace(
    LAZY_ADAM, name='lazy_adam+cowclip', fn=lazy_adam_cowclip_unit_counts,
    kwargs=_COWCLIP, lr=0.05,
    model=lambda t, lr: reference.CowClip(reference.TFLazyAdam(t, lr=lr),
                                          counts='distinct', **_COWCLIP),
    chained=lambda: with_unit_counts(lazy_optax.lazy(optax.chain(
        lazy_optax.cowclip(**_COWCLIP), lazy_optax.scale_by_lazy_adam(),
        optax.scale_by_learning_rate(0.05)))),
    dtypes=(Dtypes(_BF16, dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32),
                   {'m': jnp.float32, 'v': jnp.float32}, 3e-2),),
    rule_modules=('cowclip', 'adam'), scale_by=None, on_mesh=False)

ROWWISE_ADAGRAD_MAX_NORM = dataclasses.replace(
    ROWWISE_ADAGRAD, name='rowwise_adagrad+max_norm',
    fn=rowwise_adagrad_max_norm, kwargs=dict(max_norm=1.0), lr=0.3,
    model=lambda t, lr: reference.RowMaxNorm(
        reference.RowwiseAdagrad(t, lr=lr), max_norm=1.0),
    chained=lambda: lazy_optax.lazy(optax.chain(
        optax.clip_by_global_norm(1e6), lazy_optax.scale_by_rowwise_adagrad(),
        optax.scale_by_learning_rate(0.3), lazy_optax.row_max_norm(1.0))),
    dtypes=(Dtypes(_BF16, {}, {'sum_of_squares': jnp.float32}, 3e-2),),
    rule_modules=('rowwise_adagrad', 'row_max_norm'), scale_by=None)

# Every property is checked on each of these.
CASES = (LAZY_ADAM, ROWWISE_ADAGRAD, PARTIAL_ROWWISE_ADAM, FTRL,
         ADAM_WITH_COUNTER, ROWWISE_ADAGRAD_WITH_COUNTER, ROWWISE_RMSPROP_AR,
         OPTAX_ADAM, LAZY_ADAM_COWCLIP, ROWWISE_ADAGRAD_MAX_NORM)


def _variant(case: Case, name: str, model: Callable[..., Any],
             **kwargs: Any) -> Case:
  """`case` in another configuration (checked on one device only)."""
  return dataclasses.replace(case, name=f'{case.name}({name})',
                             kwargs=kwargs, model=model, on_mesh=False)


_FTRL_CONFIGS = {
    'defaults': {},
    'l1_l2_shrinkage_beta': dict(l1=0.05, l2=0.1, l2_shrinkage=0.2, beta=0.5),
    'power_-0.3': dict(lr_power=-0.3, l1=0.01),
    'fixed_rate': dict(lr_power=0.0, initial_accumulator_value=0.0, l2=0.1),
}


def _ftrl_variant(name: str, kw: dict) -> Case:
  args = dict(kw)
  if 'lr_power' in args:
    args['learning_rate_power'] = args.pop('lr_power')
  init = kw.get('initial_accumulator_value', 0.1)
  case = _variant(FTRL, name, lambda t, lr: reference.Ftrl(t, lr=lr, **kw),
                  **args)
  return dataclasses.replace(case, slots=(
      Slot('accumulator', 'n', 1e-6, 0.0, initial=init),
      Slot('linear', 'z', 1e-5, 1e-6)))


def _counter_variant(bias_correction: str, catch_up: bool,
                     decay: Optional[str]) -> Case:
  kw = dict(bias_correction=bias_correction, catch_up=catch_up,
            weight_decay=0.0 if decay is None else 0.3,
            decay_skipped_steps=decay == 'skipped')
  return _variant(
      ADAM_WITH_COUNTER, f'{bias_correction},catch_up={catch_up},'
      f'decay={decay}',
      lambda t, lr: reference.AdamWithCounter(t, lr=lr, **kw), **kw)


# FBGEMM's COUNTER configurations: decay modes, half-lives, learning-rate
# modes (a max_counter refreshed every 3 steps), a late adjustment start.
_COUNTER_ADAGRAD_CONFIGS = {
    'none,halflife=4': dict(counter_halflife=4),
    'l2,halflife=3': dict(weight_decay=0.2, counter_weight_decay_mode='l2',
                          counter_halflife=3),
    'decoupled,halflife=5': dict(weight_decay=0.2,
                                 counter_weight_decay_mode='decoupled',
                                 counter_halflife=5),
    'adagradw,halflife=-2': dict(weight_decay=0.3,
                                 counter_weight_decay_mode='adagradw',
                                 counter_halflife=-2, adjustment_ub=0.5),
    'adagradw,adjustment_iter=4': dict(
        weight_decay=0.3, counter_weight_decay_mode='adagradw',
        adjustment_iter=4),
    'tail_id_lr_increase': dict(
        learning_rate_mode='tail_id_lr_increase', adjustment_ub=0.7,
        tail_id_threshold=1.0, max_counter_update_freq=3),
    'tail_id_lr_decrease,ratio': dict(
        learning_rate_mode='tail_id_lr_decrease', adjustment_ub=0.5,
        tail_id_threshold=0.3, tail_id_threshold_is_ratio=True,
        max_counter_update_freq=3, counter_halflife=0),
    'counter_sgd,decoupled': dict(
        learning_rate_mode='counter_sgd', adjustment_ub=2.0,
        weight_decay=0.1, counter_weight_decay_mode='decoupled',
        counter_halflife=6),
}


def _counter_adagrad_variant(name: str, kw: dict) -> Case:
  return _variant(ROWWISE_ADAGRAD_WITH_COUNTER, name,
                  lambda t, lr: reference.RowwiseAdagradWithCounter(
                      t, lr=lr, **kw), **kw)


# The rule against the model: every optimizer, in each configuration.
RULE_CASES = CASES + (
    dataclasses.replace(_variant(
        LAZY_ADAM, 'amsgrad',
        lambda t, lr: reference.TFLazyAdam(t, lr=lr, amsgrad=True),
        amsgrad=True), on_mesh=True),
    dataclasses.replace(
        LAZY_ADAM, name='lazy_adamw', fn=lazy_optax.lazy_adamw,
        kwargs=dict(weight_decay=0.1),
        model=lambda t, lr: reference.TFLazyAdam(t, lr=lr, weight_decay=0.1),
        scale_by=None, on_mesh=False),
    dataclasses.replace(_variant(
        ROWWISE_ADAGRAD, 'l2',
        lambda t, lr: reference.RowwiseAdagrad(
            t, lr=lr, weight_decay=0.3, mode='l2'),
        weight_decay=0.3, weight_decay_mode='l2'), on_mesh=True),
    _variant(ROWWISE_ADAGRAD, 'decoupled',
             lambda t, lr: reference.RowwiseAdagrad(
                 t, lr=lr, weight_decay=0.3, mode='decoupled'),
             weight_decay=0.3, weight_decay_mode='decoupled'),
    _variant(PARTIAL_ROWWISE_ADAM, 'weight_decay',
             lambda t, lr: reference.PartialRowwiseAdam(
                 t, lr=lr, weight_decay=0.1),
             weight_decay=0.1),
    *(_ftrl_variant(name, kw) for name, kw in _FTRL_CONFIGS.items()),
    _variant(ROWWISE_RMSPROP_AR, 'plain_rmsprop',
             lambda t, lr: reference.RowwiseRmspropAr(t, lr=lr)),
    _variant(ROWWISE_RMSPROP_AR, 'min_shrinkage=0.5,eps=0.1',
             lambda t, lr: reference.RowwiseRmspropAr(
                 t, lr=lr, ar_alpha=0.3, ema_beta=0.5, min_shrinkage=0.5,
                 eps=0.1),
             ar_alpha=0.3, ema_beta=0.5, min_shrinkage=0.5, eps=0.1),
    *(_counter_variant(*config) for config in (
        ('per_row', False, None),
        ('per_row', False, 'skipped'),
        ('per_row', True, 'touched'),
        ('global', False, 'touched'),
        ('global', True, None),
        ('global', True, 'skipped'),
    )),
    *(_counter_adagrad_variant(name, kw)
      for name, kw in _COUNTER_ADAGRAD_CONFIGS.items()),
)

BY_NAME = {case.name: case for case in RULE_CASES}

# The configurations whose kernel is checked on an Explicit mesh of 8
# devices against one device (tests/kernel_shards.py).
MESH_CASES = tuple(case for case in RULE_CASES if case.on_mesh)


def with_impl(case: Case, impl: str) -> Case:
  """`case` asking for implementation `impl` (one of its `impls`)."""
  assert impl in case.impls, (case.name, impl)
  return dataclasses.replace(case, name=f'{case.name}[{impl}]', impl=impl)


# Every optimizer (CASES) on every implementation it offers; each other
# configuration on those but 'xla'. The configurations of one rule differ in
# its arithmetic alone: the rule's Python code, which 'generic' and 'xla'
# both run (they differ in how rows move, the same for every configuration:
# checked on the optimizer's case), and its C++ kernel ('cpu_kernel').
IMPL_CASES = tuple(with_impl(case, impl) for case in RULE_CASES
                   for impl in case.impls
                   if impl != 'xla' or case in CASES)


# -- helpers -----------------------------------------------------------------

def batches(seed, num_rows, row_shape, steps, n_ids):
  """Ids with heavy duplicates; rows seen early are absent later."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    lo = (t * num_rows) // (2 * steps)
    ids = rng.integers(lo, lo + num_rows // 3, n_ids)
    ids[: n_ids // 4] = ids[0]  # a quarter of the batch is one id
    out.append((ids.astype(np.int32),
                rng.normal(size=(n_ids, *row_shape)).astype(np.float32)))
  return out


def table_for(case: Case, seed: int = 0, num_rows: int = NUM_ROWS,
              d: int = D) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return case.table_scale * rng.normal(size=(num_rows, d))


def sparse_step(tx, num_rows):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


@functools.lru_cache(maxsize=8)
def jitted_step(tx, num_rows):
  """`sparse_step(tx, num_rows)` under `jax.jit`, donating params and state;
  the same function for the same `tx` (the last few are kept): a second run
  of one optimizer with batches of one shape reuses its program."""
  return jax.jit(sparse_step(tx, num_rows), donate_argnums=(0, 1))


def run(tx, table, data, jit=True, dtype=jnp.float32):
  """Trains {'table': table} on `data`; returns (params, state)."""
  params = {'table': jnp.asarray(table, dtype)}
  state = tx.init(params)
  if jit:
    step = jitted_step(tx, table.shape[0])
  else:
    step = sparse_step(tx, table.shape[0])
  for ids, values in data:
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(values))
  return params, state


def run_model(case: Case, table, data, lr=None):
  model = case.reference(table, lr)
  for ids, values in data:
    model.step(ids, values)
  return model


def run_dense(tx, table, grads):
  params = jnp.asarray(table, jnp.float32)
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
  return params, state


def untouched(data, num_rows):
  seen = set()
  for ids, _ in data:
    seen.update(int(i) for i in ids if 0 <= i < num_rows)
  return np.array([i for i in range(num_rows) if i not in seen])


def slot(state, name, path='table'):
  return lazy_optax.compat.get_slot(state, path, name)


def count_of(state):
  return int(lazy_optax.compat.global_step(state))


def assert_matches_model(case: Case, params, state, model, path='table'):
  """Table and every slot equal the model's, within the case's tolerances."""
  np.testing.assert_allclose(np.asarray(params[path]), model.p,
                             rtol=case.rtol, atol=case.atol)
  for s in case.slots:
    got = np.asarray(slot(state, s.name, path))
    want = getattr(model, s.model_attr)
    assert got.shape == want.shape, (s.name, got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=s.rtol, atol=s.atol,
                               err_msg=s.name)


def assert_checkpoint_resumes(tx, data, tmp_path, num_rows=40, d=3):
  """Saves after half the steps with orbax, restores into eval_shape
  targets, finishes: bit-for-bit equal to the uninterrupted run."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  # Params and state placed on the device, as the restored ones are: every
  # run passes the step the same placements (one program, compiled once).
  device = jax.devices()[0]

  def fresh():
    rng = np.random.default_rng(0)
    return jax.device_put(
        {'table': np.asarray(rng.normal(size=(num_rows, d)), np.float32),
         'bias': np.asarray(rng.normal(size=(d,)), np.float32)}, device)

  def init(params):
    return jax.device_put(tx.init(params), device)

  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows),
             'bias': jnp.sum(values, axis=0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  jitted = jax.jit(step, donate_argnums=(0, 1))  # traced once, for all runs

  def go(params, state, part):
    for ids, values in part:
      params, state = jitted(params, state, ids, values)
    return params, state

  params = fresh()
  straight = go(params, init(params), data)
  half = len(data) // 2
  params = fresh()
  params, state = go(params, init(params), data[:half])
  path = os.path.join(tmp_path, 'ckpt')
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {'params': params, 'opt_state': state})
  del params, state
  params_abs = jax.eval_shape(fresh)
  target = {'params': params_abs,
            'opt_state': jax.eval_shape(tx.init, params_abs)}
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, target)
  assert (jax.tree.structure(restored['opt_state'])
          == jax.tree.structure(target['opt_state']))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
  resumed = go(restored['params'], restored['opt_state'], data[half:])
  assert (jax.tree.structure(resumed) == jax.tree.structure(straight))
  for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  return resumed


def assert_state_shardings_follow_rows(tx, slot_names):
  """On a one-device mesh: per-row slots take the table's row sharding."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ('rows',))
  rows = NamedSharding(mesh, P('rows', None))
  params = {'table': jax.device_put(jnp.zeros((6, 4)), rows),
            'bias': jax.device_put(jnp.zeros(4), NamedSharding(mesh, P()))}
  shardings = lazy_optax.sharding.state_shardings(tx, params)
  state = lazy_optax.sharding.init_sharded(tx, params)
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
  for name in slot_names:
    leaf = lazy_optax.compat.get_slot(state, 'table', name)
    spec = lazy_optax.compat.get_slot(shardings, 'table', name).spec
    assert spec[0] == 'rows', (name, spec)
    assert leaf.sharding.spec[0] == 'rows', (name, leaf.sharding)
  assert lazy_optax.compat.global_step(state).sharding.spec == P()
  return state


def run_partitioned(table_tx, table, data, num_rows):
  """Trains `{'table', 'w'}` with `table_tx` on the table, optax.adam on `w`.

  An `optax.partition` labelled by `path_labels`, in a jitted step; `w`'s
  gradient is the sum of the batch's rows. Returns `(params, state)`.
  """
  tx = optax.partition(
      {'table': table_tx, 'rest': optax.adam(1e-2)},
      lazy_optax.tree.path_labels(lambda name: 'table' if name == 'table'
                                  else 'rest'))
  params = {'table': jnp.asarray(table, jnp.float32),
            'w': jnp.zeros(jnp.shape(table)[1:])}
  state = tx.init(params)

  @jax.jit
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows),
             'w': jnp.sum(values, 0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values in data:
    params, state = step(params, state, ids, values)
  return params, state
