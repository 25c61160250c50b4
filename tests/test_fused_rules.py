"""The row kernels that every rule shares, and how `impl=` is chosen.

Each optimizer's rule on each implementation ('generic', 'xla',
'cpu_kernel') is checked by the conformance suite over the one registry of
optimizers (tests/optimizer_cases.py's `IMPL_CASES`). Here: optax's rules
through the C++ deduplication, gathers and scatter-adds against pure XLA,
dtypes the kernels refuse, and stochastic rounding in the kernel.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax._src import cpu_kernels

NUM_ROWS, ROW = 40, (2, 3)

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


def _table_scatters(hlo):
  """The operand types of the program's XLA scatters into a table.

  Batch-sized scatters (an error branch's bookkeeping of out-of-range ids)
  may stay; a table-shaped one means XLA, not the kernel, wrote the table.
  """
  found = []
  for part in hlo.split('"stablehlo.scatter"')[1:]:
    operand = part.split('}) : (', 1)[1].split(',', 1)[0]
    if operand.startswith(f'tensor<{NUM_ROWS}x'):
      found.append(operand)
  return found


def _initial_table(dtype):
  rng = np.random.default_rng(7)
  return jnp.asarray(rng.normal(size=(NUM_ROWS,) + ROW) * 0.1, dtype)


@pytest.mark.parametrize('make', [
    lambda: lazy_optax.lazy(optax.sgd(0.1)),
    lambda: lazy_optax.lazy(optax.sgd(0.1, momentum=0.9)),
    lambda: lazy_optax.lazy(optax.adagrad(0.1)),
    lambda: lazy_optax.lazy(optax.adam(0.1)),
], ids=['sgd', 'sgd_momentum', 'adagrad', 'optax_adam'])
@pytest.mark.cpu_kernels
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
  assert _table_scatters(hlo) == []
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


@pytest.mark.cpu_kernels
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


@pytest.mark.cpu_kernels
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
