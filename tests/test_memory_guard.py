"""The sparse train step's temporary memory is O(batch), not O(table).

The train step is compiled for abstract shapes (no table is allocated) with
parameters and optimizer state donated, and XLA's own accounting of the
temporary buffers is compared between a 10,000-row and a 1,000,000-row
table. The dense-gradient `optax.adam` step serves as the control: its
temporaries do grow with the table, so the measure can tell them apart.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import lazy_optax

ROW, IDS = 32, 512
SMALL, BIG = 10_000, 1_000_000


def _loss(rows, w):
  return jnp.mean((rows @ w - 1.0) ** 2)


def _sparse_step(tx, num_rows):
  def step(params, state, ids):
    rows = params['table'].at[ids].get(mode='clip')
    loss, (g_rows, g_w) = jax.value_and_grad(_loss, (0, 1))(rows, params['w'])
    grads = {'table': lazy_optax.SparseRows(ids, g_rows, num_rows),
             'w': g_w}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state, loss
  return step


def _dense_step(tx, num_rows):
  del num_rows

  def step(params, state, ids):
    loss, grads = jax.value_and_grad(
        lambda p: _loss(p['table'][ids], p['w']))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return step


def _memory(make_tx, make_step, num_rows):
  """XLA's compiled memory statistics for one table size, shapes only."""
  tx = make_tx()
  params = {'table': jax.ShapeDtypeStruct((num_rows, ROW), jnp.float32),
            'w': jax.ShapeDtypeStruct((ROW,), jnp.float32)}
  state = jax.eval_shape(tx.init, params)
  ids = jax.ShapeDtypeStruct((IDS,), jnp.int32)
  step = jax.jit(make_step(tx, num_rows), donate_argnums=(0, 1))
  return step.lower(params, state, ids).compile().memory_analysis()


SPARSE_OPTIMIZERS = {
    'lazy_adam': lambda: lazy_optax.lazy_adam(1e-3),
    'lazy_adamw': lambda: lazy_optax.lazy_adamw(1e-3, weight_decay=1e-2),
    'lazy(optax.adam)': lambda: lazy_optax.lazy(optax.adam(1e-3)),
}


@pytest.mark.parametrize('name', sorted(SPARSE_OPTIMIZERS))
def test_sparse_step_temporaries_do_not_grow_with_the_table(name):
  make_tx = SPARSE_OPTIMIZERS[name]
  small = _memory(make_tx, _sparse_step, SMALL)
  big = _memory(make_tx, _sparse_step, BIG)
  if small is None or big is None:
    pytest.fail('this backend gives no compiled memory statistics')
  table_bytes = BIG * ROW * 4
  # The same O(batch) temporaries for a table 100x larger, and no temporary
  # anywhere near the size of a table.
  assert big.temp_size_in_bytes <= small.temp_size_in_bytes + 4096, (
      small.temp_size_in_bytes, big.temp_size_in_bytes)
  assert big.temp_size_in_bytes < table_bytes / 20
  # Donation: every table (params, mu, nu) is updated in place.
  assert big.alias_size_in_bytes >= 3 * table_bytes


def test_dense_gradient_step_temporaries_grow_with_the_table():
  # The control: a dense [num_rows, ROW] gradient is a temporary of table
  # size, and the same measure sees it.
  make_tx = functools.partial(optax.adam, 1e-3)
  small = _memory(make_tx, _dense_step, SMALL)
  big = _memory(make_tx, _dense_step, BIG)
  assert big.temp_size_in_bytes >= small.temp_size_in_bytes + (
      (BIG - SMALL) * ROW * 4)
