"""The row kernels that every rule shares, and how `impl=` is chosen.

Each optimizer's rule on each implementation ('generic', 'xla',
'cpu_kernel') is checked by the conformance suite over the one registry of
optimizers (tests/optimizer_cases.py's `IMPL_CASES`). Here: optax's rules
through the C++ gathers and write-backs against pure XLA, and dtypes the
kernels refuse.
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
  may stay; a table-shaped one means XLA, not the kernel, wrote a table.
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
  # lazy(optax.X) reaches the C++ row gathers and write-backs (the
  # gradient's deduplication and the update's scatter-add, outside lazy,
  # are XLA's); with the kernels hidden, XLA does all of it.
  table = _initial_table(dtype)
  tx = make()
  p_kernel, s_kernel, step = _train(tx, table, _batches(3))
  hlo = step.lower(p_kernel, s_kernel, jnp.zeros((12,), jnp.int32),
                   jnp.zeros((12,) + ROW, dtype)).as_text()
  # Every table of state is the kernels' to write: of the table-shaped
  # scatters only apply_updates' add of the update stays (sgd has no state
  # and no kernel call at all).
  stateful = any(jnp.ndim(x) for x in jax.tree.leaves(s_kernel))
  assert ('lazy_optax_LazyOptaxGather' in hlo) == stateful
  assert len(_table_scatters(hlo)) == 1, _table_scatters(hlo)
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
