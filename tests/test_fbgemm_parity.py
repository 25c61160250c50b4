"""`rowwise_adagrad` against FBGEMM's `EXACT_ROWWISE_ADAGRAD`, step by step.

`tests/data/fbgemm_rowwise_adagrad.npz` holds FBGEMM's own tables and
row accumulators after each of 6 steps (ids repeated within a step, rows
never looked up, rows first seen late, a row whose tiny gradients put `eps`
where it matters), made by `tests/data/make_fbgemm_fixture.py` with
`fbgemm-gpu-cpu` 1.9.0. The fixture test always runs. Where FBGEMM's
interpreter is named (`$LAZY_OPTAX_FBGEMM_PYTHON`, which `python3
benchmarks/peers.py setup DIR` prints), a live test makes a fresh, larger
case with FBGEMM and compares it the same way.

Measured (float32; FBGEMM and lazy_optax sum in different orders): over the
fixture's 6 steps the tables differ from FBGEMM's by at most 2.2e-8 (3.0e-8
jitted), 1.4e-7 (1.9e-7) of the row's largest entry, and the accumulators
by 0 eager and 1.5e-7 relative jitted; the live case (400 x 16, 256 ids, 8
steps) by 3.0e-8, 1.6e-7 of the row, and 2.2e-7 relative.
"""

import fbgemm_replay
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax

FIXTURE = 'fbgemm_rowwise_adagrad.npz'

# float32: FBGEMM and lazy_optax sum duplicates and means in different orders.
RTOL = 2e-6
ATOL = 1e-7


def _accumulator(state, num_rows):
  """The one `[num_rows]` float leaf of a `rowwise_adagrad` state."""
  leaves = [x for x in jax.tree.leaves(state)
            if x.shape == (num_rows,) and jnp.issubdtype(x.dtype, jnp.floating)]
  assert len(leaves) == 1, [x.shape for x in jax.tree.leaves(state)]
  return leaves[0]


def _replay(data, jit):
  """rowwise_adagrad on the fixture's inputs: its tables and accumulators."""
  num_rows = data['table0'].shape[0]
  tx = lazy_optax.rowwise_adagrad(float(data['learning_rate']),
                                  eps=float(data['eps']))
  return fbgemm_replay.replay(tx, data, jit=jit, record=lambda state: {
      'accumulators': _accumulator(state, num_rows)})


def _float64_rule(data):
  """FBGEMM's documented rule in float64 numpy (an independent check)."""
  w = data['table0'].astype(np.float64)
  acc = np.zeros(w.shape[0])
  lr, eps = float(data['learning_rate']), float(data['eps'])
  tables, accumulators = [], []
  for g, rows in fbgemm_replay.dense_steps(data):
    acc[rows] += np.mean(g[rows] ** 2, axis=1)
    w[rows] -= lr * g[rows] / (np.sqrt(acc[rows])[:, None] + eps)
    tables.append(w.copy())
    accumulators.append(acc.copy())
  return np.stack(tables), np.stack(accumulators)


def _compare(data, jit):
  """Asserts lazy_optax equals FBGEMM's outputs; returns the max errors."""
  got = _replay(data, jit)
  tables, accumulators = got['tables'], got['accumulators']
  np.testing.assert_allclose(tables, data['tables'], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(accumulators, data['accumulators'], rtol=RTOL,
                             atol=ATOL)
  # Rows never looked up stay bit for bit, in the table and in G.
  never = fbgemm_replay.assert_untouched(tables, data)
  assert not accumulators[:, never].any()
  return fbgemm_replay.assert_table_and_accumulators_within(
      tables, accumulators, data, 1e-6)


def test_fixture_is_a_hard_case():
  """Duplicates, untouched rows, late rows, tiny gradients; rows moved."""
  data = fbgemm_replay.load(FIXTURE)
  ids, table0, tables = data['ids'], data['table0'], data['tables']
  fbgemm_replay.assert_hard_case(data, min_steps=5,
                                 min_never=table0.shape[0] // 4)
  touched = np.unique(ids)
  assert (np.abs(tables[-1][touched] - table0[touched]).max(axis=1) > 0).all()
  # The tiny-gradient row: sqrt(G) within 100x of eps, so eps shows.
  g_small = data['accumulators'][-1][data['accumulators'][-1] > 0].min()
  assert np.sqrt(g_small) < 100 * float(data['eps'])


def test_fixture_follows_the_float64_rule():
  """FBGEMM's outputs are the rule lazy_optax documents (a float64 model)."""
  data = fbgemm_replay.load(FIXTURE)
  tables, accumulators = _float64_rule(data)
  np.testing.assert_allclose(data['tables'], tables, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(data['accumulators'], accumulators, rtol=1e-5,
                             atol=1e-12)


@pytest.mark.parametrize('jit', [False, True], ids=['eager', 'jit'])
def test_rowwise_adagrad_matches_fbgemm_fixture(jit):
  _compare(fbgemm_replay.load(FIXTURE), jit)


LIVE = fbgemm_replay.live_case(
    '--seed', '7', '--rows', '400', '--row', '16', '--ids', '256', '--steps',
    '8', '--learning-rate', '0.02')


@fbgemm_replay.live
@pytest.mark.xdist_group('fbgemm_live')   # one FBGEMM run makes every case
def test_rowwise_adagrad_matches_live_fbgemm(tmp_path):
  _compare(fbgemm_replay.make_live(tmp_path, *LIVE), jit=True)


# -- ROWWISE_RMSPROP_AR --------------------------------------------------------
#
# `tests/data/fbgemm_rowwise_rmsprop_ar.npz` (`make_fbgemm_fixture.py
# --rowwise-rmsprop-ar`): 40 steps of 32 ids into 48 x 8, ar_alpha 1, ema_beta
# 0.9, lr 0.05, with rows seen every step, every few steps, after gaps of 20
# steps and more (the shrink reaches min_shrinkage), first seen late, never.
# FBGEMM keeps `prev_iter` as float32; lazy_optax as int32 (equal here).

AR_FIXTURE = 'fbgemm_rowwise_rmsprop_ar.npz'


def _ar_replay(data, jit, impl='auto'):
  """rowwise_rmsprop_ar on the inputs: its tables, v and prev_iter."""
  tx = lazy_optax.rowwise_rmsprop_ar(
      float(data['learning_rate']), ar_alpha=float(data['ar_alpha']),
      ema_beta=float(data['ema_beta']),
      min_shrinkage=float(data['min_shrinkage']), eps=float(data['eps']),
      impl=impl)
  return fbgemm_replay.replay(tx, data, jit=jit, record=lambda state: {
      'momentum': state.nu['table'], 'prev_iter': state.prev_iter['table']})


def _ar_compare(data, jit, impl='auto'):
  """Asserts lazy_optax equals FBGEMM's AR outputs; returns the max errors."""
  got = _ar_replay(data, jit, impl)
  assert got['prev_iter'].dtype == np.int32
  np.testing.assert_array_equal(got['prev_iter'], data['prev_iter'])
  np.testing.assert_allclose(got['tables'], data['tables'], rtol=RTOL,
                             atol=ATOL)
  np.testing.assert_allclose(got['momentum'], data['momentum'], rtol=RTOL,
                             atol=ATOL)
  fbgemm_replay.assert_untouched(got['tables'], data)
  errors = fbgemm_replay.table_errors(got['tables'], data['tables'])
  errors['v_rel'] = fbgemm_replay.rel_error(got['momentum'], data['momentum'])
  print(errors)
  assert errors['table_rel_to_row'] < 2e-6 and errors['v_rel'] < 2e-6, errors
  return errors


def _ar_float64(data):
  """The documented AR rule in float64 numpy: tables, v, prev_iter."""
  w = data['table0'].astype(np.float64)
  v = np.zeros(w.shape[0])
  prev = np.zeros(w.shape[0], np.int64)
  lr, eps = float(data['learning_rate']), float(data['eps'])
  alpha, beta = float(data['ar_alpha']), float(data['ema_beta'])
  floor = float(data['min_shrinkage'])
  tables, vs, prevs = [], [], []
  for t, (g, rows) in enumerate(fbgemm_replay.dense_steps(data), start=1):
    v[rows] = beta * v[rows] + (1 - beta) * np.mean(g[rows] ** 2, axis=1)
    gap = np.where(prev[rows] == 0, 1, t - prev[rows])
    keep = np.maximum(floor, 1 - np.clip(lr * alpha * gap, 0, 1))
    w[rows] = (keep[:, None] * w[rows]
               - lr * g[rows] / (np.sqrt(v[rows])[:, None] + eps))
    prev[rows] = t
    tables.append(w.copy())
    vs.append(v.copy())
    prevs.append(prev.copy())
  return np.stack(tables), np.stack(vs), np.stack(prevs)


def test_ar_fixture_is_a_hard_case():
  """Many steps, duplicates, long gaps that reach min_shrinkage."""
  data = fbgemm_replay.load(AR_FIXTURE)
  ids = data['ids']
  fbgemm_replay.assert_hard_case(data, min_steps=30, min_never=4,
                                 late_after=ids.shape[0] // 2)
  assert float(data['ar_alpha']) > 0
  # The longest gap between two visits of a row: past the clip at 1, so the
  # shrink is min_shrinkage there.
  last, longest = {}, 0
  for t, s in enumerate(ids, start=1):
    for r in np.unique(s):
      longest = max(longest, t - last.get(int(r), t))
      last[int(r)] = t
  lr, alpha = float(data['learning_rate']), float(data['ar_alpha'])
  assert lr * alpha * longest > 1 - float(data['min_shrinkage'])


def test_ar_fixture_follows_the_float64_rule():
  """FBGEMM's outputs are the rule lazy_optax documents, exactly so: the
  step counter from 1, I = 1 for a new row, eps outside the root."""
  data = fbgemm_replay.load(AR_FIXTURE)
  tables, vs, prevs = _ar_float64(data)
  np.testing.assert_allclose(data['tables'], tables, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(data['momentum'], vs, rtol=1e-5, atol=1e-9)
  np.testing.assert_array_equal(data['prev_iter'], prevs)


@pytest.mark.parametrize('jit, impl', [(False, 'auto'), (True, 'generic'),
                                       (True, 'xla'), (True, 'cpu_kernel')])
def test_rowwise_rmsprop_ar_matches_fbgemm_fixture(jit, impl):
  if impl == 'cpu_kernel':
    assert lazy_optax.kernel_status()['cpu_kernel'].available
  _ar_compare(fbgemm_replay.load(AR_FIXTURE), jit, impl)


AR_LIVE = fbgemm_replay.live_case(
    '--rowwise-rmsprop-ar', '--seed', '7', '--rows', '400', '--row', '16',
    '--ids', '256', '--steps', '60', '--learning-rate', '0.02', '--ar-alpha',
    '1.5', '--ema-beta', '0.99', '--min-shrinkage', '0.2')


@fbgemm_replay.live
@pytest.mark.xdist_group('fbgemm_live')   # one FBGEMM run makes every case
def test_rowwise_rmsprop_ar_matches_live_fbgemm(tmp_path):
  _ar_compare(fbgemm_replay.make_live(tmp_path, *AR_LIVE), jit=True)
