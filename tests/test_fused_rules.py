"""Every optimizer's fused row update: the float64 rule, and the generic path.

For each optimizer a table uses, the CPU kernel (`impl='cpu_kernel'`) and
XLA's row update (`impl='xla'`) train a table as the generic path
(`impl='generic'`: `lazy(...)` gathers, runs the rule on the row blocks,
writes back) does, and as the float64 NumPy model of the rule does: the
touched rows to float32 rounding, the untouched rows bit for bit. Tables and
moments in float32 and bfloat16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import Ftrl
from reference import PartialRowwiseAdam
from reference import RowwiseAdagrad
from reference import TFLazyAdam

import lazy_optax
from lazy_optax._src import cpu_kernels

NUM_ROWS, ROW = 40, (2, 3)
LR = 0.05

# name: (make the optimizer given impl=..., float64 model given the table).
OPTIMIZERS = {
    'lazy_adam': (
        lambda **kw: lazy_optax.lazy_adam(LR, **kw),
        lambda t: TFLazyAdam(t, lr=LR)),
    'lazy_adam_amsgrad': (
        lambda **kw: lazy_optax.lazy_adam(LR, amsgrad=True, **kw),
        lambda t: TFLazyAdam(t, lr=LR, amsgrad=True)),
    'lazy_adamw': (
        lambda **kw: lazy_optax.lazy_adamw(LR, weight_decay=0.1, **kw),
        lambda t: TFLazyAdam(t, lr=LR, weight_decay=0.1)),
    'rowwise_adagrad': (
        lambda **kw: lazy_optax.rowwise_adagrad(LR, **kw),
        lambda t: RowwiseAdagrad(t, lr=LR)),
    'rowwise_adagrad_l2': (
        lambda **kw: lazy_optax.rowwise_adagrad(
            LR, weight_decay=0.1, weight_decay_mode='l2', **kw),
        lambda t: RowwiseAdagrad(t, lr=LR, weight_decay=0.1, mode='l2')),
    'rowwise_adagrad_decoupled': (
        lambda **kw: lazy_optax.rowwise_adagrad(
            LR, weight_decay=0.1, weight_decay_mode='decoupled', **kw),
        lambda t: RowwiseAdagrad(t, lr=LR, weight_decay=0.1,
                                 mode='decoupled')),
    'partial_rowwise_adam': (
        lambda **kw: lazy_optax.partial_rowwise_adam(LR, **kw),
        lambda t: PartialRowwiseAdam(t, lr=LR)),
    'ftrl': (
        lambda **kw: lazy_optax.ftrl(LR, l1=0.001, l2=0.01, **kw),
        lambda t: Ftrl(t, lr=LR, l1=0.001, l2=0.01)),
}

# (table dtype, state dtype keyword arguments per optimizer family).
DTYPES = {
    'f32': (jnp.float32, {}),
    'bf16_table': (jnp.bfloat16, 'f32_state'),
    'bf16_state': (jnp.float32, 'bf16_state'),
}


def _state_dtypes(name, kind):
  """The keyword arguments that make `name`'s state float32 or bfloat16."""
  if kind in ({}, None):
    return {}
  dtype = jnp.float32 if kind == 'f32_state' else jnp.bfloat16
  if name.startswith(('lazy_adam', 'partial')):
    return {'mu_dtype': dtype, 'nu_dtype': dtype}
  if name.startswith('rowwise'):
    return {'accumulator_dtype': dtype}
  return {'accumulator_dtype': dtype, 'linear_dtype': dtype}


def _batches(seed, steps=6):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = rng.integers(-2, NUM_ROWS + 2, 12)  # out of range on both sides
    ids[:4] = ids[4]                            # duplicates
    yield ids, rng.normal(size=(12,) + ROW)


def _train(tx, table, batches):
  # A copy: the step donates the parameters.
  params = {'table': jnp.array(table, copy=True),
            'w': jnp.ones((3,), jnp.float32)}
  state = tx.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS),
             'w': jnp.ones((3,), jnp.float32)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values in batches:
    params, state = step(params, state, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(values, table.dtype))
  return params, state, step


def _initial_table(dtype):
  rng = np.random.default_rng(7)
  return jnp.asarray(rng.normal(size=(NUM_ROWS,) + ROW) * 0.1, dtype)


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
@pytest.mark.parametrize('impl', ['cpu_kernel', 'xla'])
@pytest.mark.parametrize('dtypes', sorted(DTYPES))
def test_fused_equals_generic_and_untouched_rows_stay(name, impl, dtypes):
  table_dtype, state_kind = DTYPES[dtypes]
  make, _ = OPTIMIZERS[name]
  kw = _state_dtypes(name, state_kind)
  table = _initial_table(table_dtype)
  fused_tx, generic_tx = make(impl=impl, **kw), make(impl='generic', **kw)
  choice = lazy_optax.explain_update(
      fused_tx, {'table': lazy_optax.SparseRows(
          jnp.zeros((12,), jnp.int32), jnp.zeros((12,) + ROW, table_dtype),
          NUM_ROWS), 'w': jnp.zeros((3,))},
      fused_tx.init({'table': table, 'w': jnp.ones((3,))}),
      {'table': table, 'w': jnp.ones((3,))})['table']
  assert choice.impl == impl, choice
  p_fused, s_fused, step = _train(fused_tx, table, _batches(1))
  p_generic, s_generic, _ = _train(generic_tx, table, _batches(1))
  if impl == 'cpu_kernel':
    hlo = step.lower(p_fused, s_fused, jnp.zeros((12,), jnp.int32),
                     jnp.zeros((12,) + ROW, table_dtype)).as_text()
    assert 'lazy_optax_LazyOptax' in hlo
  touched = sorted({int(i) for ids, _ in _batches(1) for i in ids
                    if 0 <= i < NUM_ROWS})
  untouched = sorted(set(range(NUM_ROWS)) - set(touched))
  assert untouched
  for a, b in zip(jax.tree.leaves((p_fused, s_fused)),
                  jax.tree.leaves((p_generic, s_generic))):
    assert a.dtype == b.dtype and a.shape == b.shape
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.ndim and a.shape[0] == NUM_ROWS:
      np.testing.assert_array_equal(a32[untouched], b32[untouched])
    # Rounding differences between the paths (contracted multiply-adds, the
    # order of the summed duplicates) may move a bfloat16 value by one step.
    tol = (2e-2, 1e-2) if jnp.bfloat16 in (a.dtype, table_dtype) else (
        2e-5, 1e-6)
    np.testing.assert_allclose(a32, b32, rtol=tol[0], atol=tol[1],
                               err_msg=name)
  # Untouched rows are exactly the starting rows.
  np.testing.assert_array_equal(
      np.asarray(p_fused['table'], np.float32)[untouched],
      np.asarray(table, np.float32)[untouched])


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_cpu_kernel_matches_float64_model(name):
  make, model = OPTIMIZERS[name]
  table = _initial_table(jnp.float32)
  ref = model(np.asarray(table, np.float64).reshape(NUM_ROWS, -1))
  tx = make(impl='cpu_kernel')
  params = {'table': table, 'w': jnp.ones((3,), jnp.float32)}
  state = tx.init(params)
  step = jax.jit(lambda p, s, ids, v: (lambda u, s: (
      lazy_optax.apply_updates(p, u), s))(*tx.update(
          {'table': lazy_optax.SparseRows(ids, v, NUM_ROWS),
           'w': jnp.zeros((3,))}, s, p)))
  for t, (ids, values) in enumerate(_batches(2, steps=20)):
    ref.step(ids, values.reshape(len(ids), -1))
    params, state = step(params, state, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(values, jnp.float32))
    np.testing.assert_allclose(
        np.asarray(params['table'], np.float64).reshape(NUM_ROWS, -1),
        ref.p, rtol=5e-5, atol=2e-6, err_msg=f'{name} step {t}')


@pytest.mark.parametrize('make', [
    lambda: lazy_optax.lazy(optax.sgd(0.1)),
    lambda: lazy_optax.lazy(optax.sgd(0.1, momentum=0.9)),
    lambda: lazy_optax.lazy(optax.adagrad(0.1)),
    lambda: lazy_optax.lazy(optax.adam(0.1)),
], ids=['sgd', 'sgd_momentum', 'adagrad', 'optax_adam'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_optax_rules_through_the_kernels_equal_pure_xla(make, dtype,
                                                         monkeypatch):
  # lazy(optax.X) reaches the C++ deduplication, row gathers, write-backs
  # and scatter-adds; with the kernels hidden, XLA does all of it.
  table = _initial_table(dtype)
  tx = make()
  p_kernel, s_kernel, step = _train(tx, table, _batches(3))
  hlo = step.lower(p_kernel, s_kernel, jnp.zeros((12,), jnp.int32),
                   jnp.zeros((12,) + ROW, dtype)).as_text()
  assert 'lazy_optax_LazyOptaxDedup' in hlo
  assert 'lazy_optax_LazyOptaxScatterAdd' in hlo
  assert ' scatter(' not in hlo and 'stablehlo.scatter' not in hlo
  monkeypatch.setattr(cpu_kernels, 'loaded', lambda: False)
  p_xla, s_xla, step = _train(make(), table, _batches(3))
  hlo = step.lower(p_xla, s_xla, jnp.zeros((12,), jnp.int32),
                   jnp.zeros((12,) + ROW, dtype)).as_text()
  assert 'lazy_optax_LazyOptax' not in hlo
  for a, b in zip(jax.tree.leaves((p_kernel, s_kernel)),
                  jax.tree.leaves((p_xla, s_xla))):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    tol = (2e-2, 1e-2) if dtype == jnp.bfloat16 else (2e-6, 1e-7)
    np.testing.assert_allclose(a32, b32, rtol=tol[0], atol=tol[1])


def test_unsupported_dtypes_fall_back_and_cpu_kernel_refuses_them():
  # The kernels store float32 and bfloat16; float16 moments take XLA's path.
  tx = lazy_optax.lazy_adam(0.1)
  table = jnp.zeros((NUM_ROWS, 3), jnp.float16)
  grads = {'table': lazy_optax.SparseRows(jnp.array([1, 2]),
                                          jnp.ones((2, 3), jnp.float16),
                                          NUM_ROWS)}
  choice = lazy_optax.explain_update(tx, grads, tx.init({'table': table}))
  assert choice['table'].impl == 'generic', choice
  assert 'float16' in choice['table'].reason
  strict = lazy_optax.lazy_adam(0.1, impl='cpu_kernel')
  with pytest.raises(ValueError, match='float16'):
    strict.update(grads, strict.init({'table': table}))


def test_unknown_impl_is_refused():
  with pytest.raises(ValueError, match="impl must be one of"):
    lazy_optax.rowwise_adagrad(0.1, impl='gpu')


def test_stochastic_rounding_in_the_kernel_draws_the_same_bits(monkeypatch):
  # apply_updates_stochastic into a bfloat16 table: the C++ kernel (JAX's
  # threefry bits drawn in C++) and XLA's path agree bit for bit, with
  # overflow to the largest finite value, signed zeros, NaN and infinity.
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  rng = np.random.default_rng(0)
  num_rows, width = 300, 40
  base = rng.normal(size=(num_rows, width)).astype(np.float32)
  base[0, :4] = [3.3895e38, -3.3895e38, 0.0, -0.0]
  base = jnp.asarray(base, jnp.bfloat16)
  ids = jnp.asarray(rng.integers(0, num_rows, 64), jnp.int32).at[:3].set(0)
  values = jnp.asarray(rng.normal(size=(64, width)) * 1e-3, jnp.float32)
  values = (values.at[0, 0].set(1e38).at[0, 1].set(-1e38)
            .at[1, 2].set(1e-45).at[2, 3].set(-1e-45)
            .at[5, 5].set(jnp.nan).at[6, 6].set(jnp.inf))

  def apply(table, ids, values, step):
    updates = {'t': lazy_optax.SparseRows(ids, values, num_rows)}
    return lazy_optax.precision.apply_updates_stochastic(
        {'t': table}, updates, key=jax.random.key(42), step=step)['t']

  kernel = jax.jit(apply)
  assert 'LazyOptaxAddStochastic' in kernel.lower(base, ids, values,
                                                  0).as_text()
  got = [kernel(base, ids, values, step) for step in range(3)]
  monkeypatch.setattr(cpu_kernels, 'loaded', lambda: False)
  xla = jax.jit(lambda *args: apply(*args))
  assert 'LazyOptax' not in xla.lower(base, ids, values, 0).as_text()
  for step, table in enumerate(got):
    expected = xla(base, ids, values, step)
    a = np.asarray(table, np.float32)
    b = np.asarray(expected, np.float32)
    assert ((np.asarray(table).view(np.uint16)
             == np.asarray(expected).view(np.uint16))
            | (np.isnan(a) & np.isnan(b))).all(), step
    # Rows the update did not name are untouched; the steps draw new bits.
    untouched = np.setdiff1d(np.arange(num_rows), np.asarray(ids))
    np.testing.assert_array_equal(a[untouched],
                                  np.asarray(base, np.float32)[untouched])
  assert not np.array_equal(np.asarray(got[0], np.float32),
                            np.asarray(got[1], np.float32))
