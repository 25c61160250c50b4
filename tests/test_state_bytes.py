"""Optimizer state per table row, from the real state; per-row state leaves.

The bytes-per-row table of docs/optimizers.md ("Optimizer state per table
row") is checked against `tx.init` here.
"""

import pathlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optimizer_cases import assert_checkpoint_resumes
import pytest

import lazy_optax

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROWS, D = 1000, 64
BF16 = jnp.bfloat16

# Table name -> (float32 state, bfloat16 moments), each (tx, table dtype).
CONFIGS = {
    'lazy_adam': (
        (lazy_optax.lazy_adam(1e-3), jnp.float32),
        (lazy_optax.lazy_adam(1e-3, mu_dtype=BF16, nu_dtype=BF16),
         jnp.float32)),
    'lazy_adamw': (
        (lazy_optax.lazy_adamw(1e-3), jnp.float32),
        (lazy_optax.lazy_adamw(1e-3, mu_dtype=BF16, nu_dtype=BF16),
         jnp.float32)),
    'lazy_adam(amsgrad=True)': (
        (lazy_optax.lazy_adam(1e-3, amsgrad=True), jnp.float32),
        (lazy_optax.lazy_adam(1e-3, mu_dtype=BF16, nu_dtype=BF16,
                              amsgrad=True), jnp.float32)),
    'adam_with_counter': (
        (lazy_optax.adam_with_counter(1e-3), jnp.float32),
        (lazy_optax.adam_with_counter(1e-3, mu_dtype=BF16, nu_dtype=BF16),
         jnp.float32)),
    'partial_rowwise_adam': (
        (lazy_optax.partial_rowwise_adam(1e-3), jnp.float32),
        (lazy_optax.partial_rowwise_adam(1e-3, mu_dtype=BF16, nu_dtype=BF16),
         jnp.float32)),
    'rowwise_adagrad': (
        (lazy_optax.rowwise_adagrad(1e-2), jnp.float32),
        (lazy_optax.rowwise_adagrad(1e-2, accumulator_dtype=BF16),
         jnp.float32)),
    'rowwise_rmsprop_ar': (
        (lazy_optax.rowwise_rmsprop_ar(1e-2, ar_alpha=0.1), jnp.float32),
        (lazy_optax.rowwise_rmsprop_ar(1e-2, accumulator_dtype=BF16),
         jnp.float32)),
    'rowwise_adagrad_with_counter': (
        (lazy_optax.rowwise_adagrad_with_counter(1e-2), jnp.float32),
        (lazy_optax.rowwise_adagrad_with_counter(
            1e-2, accumulator_dtype=BF16), jnp.float32)),
    # optax.adagrad has no dtype option: its accumulator follows the table.
    'lazy(optax.adagrad)': (
        (lazy_optax.lazy(optax.adagrad(1e-2)), jnp.float32),
        (lazy_optax.lazy(optax.adagrad(1e-2)), BF16)),
    'ftrl': (
        (lazy_optax.ftrl(1e-2), jnp.float32),
        (lazy_optax.ftrl(1e-2, accumulator_dtype=BF16, linear_dtype=BF16),
         jnp.float32)),
    # Row rules without state: what they add to an optimizer's.
    'cowclip': (
        (lazy_optax.lazy(lazy_optax.cowclip()), jnp.float32),
        (lazy_optax.lazy(lazy_optax.cowclip()), BF16)),
    'row_max_norm': (
        (lazy_optax.lazy(lazy_optax.row_max_norm(1.0)), jnp.float32),
        (lazy_optax.lazy(lazy_optax.row_max_norm(1.0)), BF16)),
}

EXPECTED = {  # bytes per row at D = 64: (float32, bfloat16 moments)
    'lazy_adam': (512, 256),
    'lazy_adamw': (512, 256),
    'lazy_adam(amsgrad=True)': (768, 384),
    'adam_with_counter': (520, 264),
    'partial_rowwise_adam': (260, 130),
    'rowwise_adagrad': (4, 2),
    'rowwise_rmsprop_ar': (8, 6),  # v (float32 or bfloat16), int32 prev_iter
    # G (float32 or bfloat16), float32 row_counter, int32 last_step
    'rowwise_adagrad_with_counter': (12, 10),
    'lazy(optax.adagrad)': (256, 128),
    'ftrl': (512, 256),
    'cowclip': (0, 0),
    'row_max_norm': (0, 0),
}


def bytes_per_row(tx, dtype):
  """State bytes per table row, from the state `tx.init` really builds."""
  params = {'table': jnp.zeros((ROWS, D), dtype)}
  state = tx.init(params)
  per_row, other = 0, 0
  for leaf in jax.tree.leaves(state):
    if leaf.ndim and leaf.shape[0] == ROWS:
      per_row += leaf.nbytes
    else:
      other += leaf.nbytes
  assert other <= 64, other  # only scalars (counts) besides per-row leaves
  assert per_row % ROWS == 0
  return per_row // ROWS


@pytest.mark.parametrize('name', list(CONFIGS))
def test_state_bytes_per_row(name):
  got = tuple(bytes_per_row(tx, dtype) for tx, dtype in CONFIGS[name])
  assert got == EXPECTED[name]


def _docs_table():
  text = (ROOT / 'docs' / 'optimizers.md').read_text()
  section = re.search(r'## Optimizer state per table row\n(.*?)\n## ',
                      text + '\n## ', re.S)
  assert section, 'docs/optimizers.md lacks its state-per-row section'
  lines = section.group(1).splitlines()
  start = next(i for i, line in enumerate(lines)
               if line.startswith('|') and 'bytes per row' in line)
  rows = {}
  for line in lines[start:]:
    if not line.startswith('|'):
      break  # the end of the bytes-per-row table
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) < 3 or not cells[0].startswith('`'):
      continue
    numbers = [re.match(r'\d+', c) for c in cells[-2:]]
    if all(numbers):
      name = re.match(r'`([^`]*)`', cells[0]).group(1)
      rows[name] = tuple(int(m.group()) for m in numbers)
  return rows


def test_docs_table_matches_the_real_state():
  table = _docs_table()
  assert table == EXPECTED


# -- state leaves of one entry per row: [num_rows] and [num_rows, 1] ----------


class _RowState(NamedTuple):
  count: jax.Array
  flat: optax.Updates     # [num_rows]
  column: optax.Updates   # [num_rows, 1]


def _row_rule():
  """A toy rule with [num_rows] and [num_rows, 1] state: counts touches."""

  def init(params):
    return _RowState(
        jnp.zeros([], jnp.int32),
        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p)[:1]), params),
        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p)[:1] + (1,)), params))

  def update(updates, state, params=None):
    del params
    flat = jax.tree.map(
        lambda g, s: s + jnp.mean((g * g).reshape(g.shape[0], -1), axis=1),
        updates, state.flat)
    column = jax.tree.map(lambda g, s: s + 1, updates, state.column)
    out = jax.tree.map(
        lambda g, f: -g / (1 + f.reshape(f.shape + (1,) * (g.ndim - 1))),
        updates, flat)
    return out, _RowState(state.count + 1, flat, column)

  return optax.GradientTransformation(init, update)


def test_per_row_leaves_lazy_slots_and_shardings():
  tx = lazy_optax.lazy(_row_rule())
  table = jnp.asarray(np.random.default_rng(0).normal(size=(10, 3)),
                      jnp.float32)
  params = {'table': table}
  state = tx.init(params)
  g = lazy_optax.SparseRows(jnp.array([2, 7, 2]), jnp.ones((3, 3)), 10)
  updates, state = jax.jit(tx.update)({'table': g}, state, params)
  new = lazy_optax.apply_updates(params, updates)['table']
  np.testing.assert_allclose(state.flat['table'],
                             [0, 0, 4, 0, 0, 0, 0, 1, 0, 0])
  np.testing.assert_allclose(state.column['table'][:, 0],
                             [0, 0, 1, 0, 0, 0, 0, 1, 0, 0])
  np.testing.assert_allclose(new[2] - table[2], -2 / 5)
  np.testing.assert_array_equal(new[:2], table[:2])
  assert lazy_optax.compat.get_slot_names(state, params) == ['column', 'flat']
  assert lazy_optax.compat.get_slot(state, 'table', 'column').shape == (10, 1)

  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ('rows',))
  sharded = {'table': jax.device_put(table, NamedSharding(mesh,
                                                          P('rows', None)))}
  shardings = lazy_optax.sharding.state_shardings(tx, sharded)
  assert shardings.flat['table'].spec == P('rows')
  assert shardings.column['table'].spec == P('rows', None)
  assert shardings.count.spec == P()
  state = lazy_optax.sharding.init_sharded(tx, sharded)
  assert state.column['table'].sharding.spec[0] == 'rows'


def test_per_row_leaves_checkpoint(tmp_path):
  rng = np.random.default_rng(1)
  data = []
  for _ in range(4):
    ids = rng.integers(0, 20, 8).astype(np.int32)
    data.append((ids, rng.normal(size=(8, 3)).astype(np.float32)))
  tx = lazy_optax.lazy(_row_rule())
  _, state = assert_checkpoint_resumes(tx, data, tmp_path)
  assert state.column['table'].shape == (40, 1)
