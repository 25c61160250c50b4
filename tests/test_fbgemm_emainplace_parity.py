"""FBGEMM's `EMAINPLACE_ROWWISE_ADAGRAD` is `rowwise_adagrad` plus a blend of
the table's row halves outside the optimizer, step by step.

What FBGEMM 1.9.0 runs (its Python `ema_inplace` and the row-wise Adagrad
kernel it shares with `EXACT_ROWWISE_ADAGRAD`): at the start of every
training forward call `t` (counted from 1), if `t % step_ema == 0` and
`t >= step_start`, every row of the table, looked up or not, blends its
second half toward its first,

    w[:, D/2:] <- w[:, D/2:] + step_ema_coef * (w[:, :D/2] - w[:, D/2:]),

and then the step's rows take row-wise Adagrad (`momentum1` is Adagrad's
sum `G_r += mean_over_row(g_r^2)`, not a moving average):

    w_r <- w_r - lr * g_r / (sqrt(G_r) + eps).

So the optimizer part is `lazy_optax.rowwise_adagrad(lr, eps=eps)`, and the
blend is a dense table operation the caller runs before the step; it is not
`rowwise_rmsprop_ar(ar_alpha=0)` (row-wise RMSprop) for any `ema_beta`.

`tests/data/fbgemm_emainplace_rowwise_adagrad.npz` (`make_fbgemm_fixture.py
--emainplace --steps 40`): 40 steps of 32 ids into 48 x 8, lr 0.05,
step_ema 5, step_start 12, step_ema_coef 0.3, the AR fixture's kind of
stream (duplicates, rows seen every step, every 7th step, after a gap of 20
steps, first seen late, never). The fixture test always runs; the live test
where FBGEMM's interpreter is present (`$LAZY_OPTAX_FBGEMM_PYTHON`).
"""

import fbgemm_replay
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax

FIXTURE = 'fbgemm_emainplace_rowwise_adagrad.npz'

# float32: FBGEMM and lazy_optax sum duplicates and means in different orders.
RTOL = 2e-6
ATOL = 1e-7


def _fires(data, t):
  """Whether FBGEMM blends the halves before step `t` (from 1)."""
  return (t % int(data['step_ema']) == 0 and t >= int(data['step_start']))


def _blend(data):
  """The `before_step` of the replay: FBGEMM's blend, in float32 jnp."""
  coef = np.float32(data['step_ema_coef'])

  def before_step(t, table):
    if not _fires(data, t):
      return table
    half = table.shape[1] // 2
    fast, slow = table[:, :half], table[:, half:]
    return table.at[:, half:].set(slow + coef * (fast - slow))
  return before_step


def _accumulator(state, num_rows):
  """The one `[num_rows]` float leaf of a `rowwise_adagrad` state."""
  leaves = [x for x in jax.tree.leaves(state)
            if x.shape == (num_rows,) and jnp.issubdtype(x.dtype, jnp.floating)]
  assert len(leaves) == 1, [x.shape for x in jax.tree.leaves(state)]
  return leaves[0]


def _replay(data, jit, impl='auto', blend=True):
  """rowwise_adagrad (and the blend) on the inputs: tables, accumulators."""
  num_rows = data['table0'].shape[0]
  tx = lazy_optax.rowwise_adagrad(float(data['learning_rate']),
                                  eps=float(data['eps']), impl=impl)
  return fbgemm_replay.replay(
      tx, data, jit=jit, before_step=_blend(data) if blend else None,
      record=lambda state: {'accumulators': _accumulator(state, num_rows)})


def _float64(data):
  """FBGEMM's rule in float64 numpy: the blend, then row-wise Adagrad."""
  w = data['table0'].astype(np.float64)
  half = w.shape[1] // 2
  acc = np.zeros(w.shape[0])
  lr, eps = float(data['learning_rate']), float(data['eps'])
  coef = float(data['step_ema_coef'])
  tables, accumulators = [], []
  for t, (g, rows) in enumerate(fbgemm_replay.dense_steps(data), start=1):
    if _fires(data, t):
      w[:, half:] += coef * (w[:, :half] - w[:, half:])
    acc[rows] += np.mean(g[rows] ** 2, axis=1)
    w[rows] -= lr * g[rows] / (np.sqrt(acc[rows])[:, None] + eps)
    tables.append(w.copy())
    accumulators.append(acc.copy())
  return np.stack(tables), np.stack(accumulators)


def _compare(data, jit, impl='auto'):
  """Asserts lazy_optax equals FBGEMM's outputs; returns the max errors."""
  got = _replay(data, jit, impl)
  tables, accumulators = got['tables'], got['accumulators']
  np.testing.assert_allclose(tables, data['tables'], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(accumulators, data['accumulators'], rtol=RTOL,
                             atol=ATOL)
  # Rows never looked up: their first half stays bit for bit, and Adagrad's
  # sum stays 0; only the blend moves their second half.
  never = fbgemm_replay.never_seen(data)
  half = tables.shape[2] // 2
  np.testing.assert_array_equal(
      tables[:, never, :half],
      np.broadcast_to(data['table0'][never, :half],
                      tables[:, never, :half].shape))
  assert not accumulators[:, never].any()
  return fbgemm_replay.assert_table_and_accumulators_within(
      tables, accumulators, data, 2e-6)


def test_fixture_is_a_hard_case():
  """Many steps, duplicates, long gaps; the blend fires several times, once
  held back by `step_start`, and moves rows never looked up."""
  data = fbgemm_replay.load(FIXTURE)
  steps = data['ids'].shape[0]
  fbgemm_replay.assert_hard_case(data, min_steps=30, min_never=4,
                                 late_after=steps // 2)
  fired = [t for t in range(1, steps + 1) if _fires(data, t)]
  held = [t for t in range(1, steps + 1)
          if t % int(data['step_ema']) == 0 and not _fires(data, t)]
  assert len(fired) >= 3 and held, (fired, held)
  assert 0 < float(data['step_ema_coef']) < 0.5   # a blend, not a copy
  # The longest gap between two visits of a row spans a blend.
  last, longest = {}, 0
  for t, s in enumerate(data['ids'], start=1):
    for r in np.unique(s):
      longest = max(longest, t - last.get(int(r), t))
      last[int(r)] = t
  assert longest > int(data['step_ema'])
  # FBGEMM moved the second half of a never-seen row (the blend is dense).
  never = fbgemm_replay.never_seen(data)
  half = data['table0'].shape[1] // 2
  assert (np.abs(data['tables'][-1][never, half:]
                 - data['table0'][never, half:]) > 1e-3).all()


def test_fixture_follows_the_float64_rule():
  """FBGEMM's outputs are the blend then row-wise Adagrad (float64)."""
  data = fbgemm_replay.load(FIXTURE)
  tables, accumulators = _float64(data)
  np.testing.assert_allclose(data['tables'], tables, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(data['accumulators'], accumulators, rtol=1e-5,
                             atol=1e-9)


def test_momentum1_is_a_sum_not_a_moving_average():
  """FBGEMM's `momentum1` only grows (Adagrad), and row-wise RMSprop
  (`rowwise_rmsprop_ar` with `ar_alpha=0`), blend included, is far from
  FBGEMM's tables for every `ema_beta`; so is Adagrad without the blend."""
  data = fbgemm_replay.load(FIXTURE)
  acc = data['accumulators']
  assert (np.diff(acc, axis=0) >= 0).all()
  for t in range(1, acc.shape[0]):
    rows = np.unique(data['ids'][t])
    assert (acc[t, rows] > acc[t - 1, rows]).all(), t
  for beta in (0.5, 0.9, 0.99, 0.999):
    tx = lazy_optax.rowwise_rmsprop_ar(
        float(data['learning_rate']), ema_beta=beta, ar_alpha=0.0,
        eps=float(data['eps']))
    got = fbgemm_replay.replay(tx, data, record=lambda state: {},
                               before_step=_blend(data))
    rel = fbgemm_replay.table_errors(got['tables'],
                                     data['tables'])['table_rel_to_row']
    assert rel > 1e-2, (beta, rel)
  rel = fbgemm_replay.table_errors(_replay(data, True, blend=False)['tables'],
                                   data['tables'])['table_rel_to_row']
  assert rel > 1e-2, rel


@pytest.mark.parametrize('jit, impl', [(False, 'auto'), (True, 'generic'),
                                       (True, 'xla'), (True, 'cpu_kernel')])
def test_rowwise_adagrad_and_blend_match_fbgemm_fixture(jit, impl):
  if impl == 'cpu_kernel':
    assert lazy_optax.kernel_status()['cpu_kernel'].available
  _compare(fbgemm_replay.load(FIXTURE), jit, impl)


LIVE = fbgemm_replay.live_case(
    '--emainplace', '--seed', '7', '--rows', '400', '--row', '16', '--ids',
    '256', '--steps', '60', '--learning-rate', '0.02', '--step-ema', '7',
    '--step-start', '20', '--step-ema-coef', '0.6')


@fbgemm_replay.live
@pytest.mark.xdist_group('fbgemm_live')   # one FBGEMM run makes every case
def test_rowwise_adagrad_and_blend_match_live_fbgemm(tmp_path):
  _compare(fbgemm_replay.make_live(tmp_path, *LIVE), jit=True)
