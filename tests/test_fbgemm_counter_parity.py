"""`rowwise_adagrad_with_counter` against FBGEMM's COUNTER mode, step by step.

`tests/data/fbgemm_rowwise_adagrad_counter.npz` holds, for six
configurations of FBGEMM's `EXACT_ROWWISE_ADAGRAD` with
`WeightDecayMode.COUNTER` (AdagradW with half-life -1 and -2 and a late
`adjustment_iter`, decoupled, L2 and no decay; the three learning-rate
modes; a ratio threshold), FBGEMM's tables and its three row states
(`momentum1`, `prev_iter`, `row_counter`) after each of 32 steps, made by
`tests/data/make_fbgemm_fixture.py --counter` with `fbgemm-gpu-cpu` 1.9.0:
hot rows duplicated in every step, rows absent for 6 steps at a time, rows
first seen in the second half, rows never looked up. The fixture test always
runs, on every implementation ('generic', 'xla', 'cpu_kernel'; eager and
jitted), with the same tolerances; where FBGEMM's interpreter is present a
live test makes a fresh case.

Measured over the fixture's 32 steps, the largest table error relative to
the row: 0 for the two configurations without decay, 1.4e-7 to 3.9e-7 for
the others ('generic' and 'xla' agree with each other, the kernel differs
from them in summation order), against the bound of 3e-6.

FBGEMM's CPU tables keep `max_counter` at 1 (it is refreshed from the device
copy of the counters, which host tables leave empty), so the replay passes
`max_counter_update_freq=0`, which keeps it at 1 too.
"""

import fbgemm_replay
import numpy as np
import pytest
import reference

import lazy_optax

FIXTURE = 'fbgemm_rowwise_adagrad_counter.npz'


def _configs():
  """The maker's configurations."""
  return fbgemm_replay.maker_module().COUNTER_CONFIGS


def _replay(data, kw, jit=True, impl='auto'):
  """lazy_optax on the fixture's inputs: tables and (G, last, counter)."""
  tx = lazy_optax.rowwise_adagrad_with_counter(
      float(data['learning_rate']), eps=float(data['eps']),
      max_counter_update_freq=0, impl=impl, **kw)
  got = fbgemm_replay.replay(tx, data, jit=jit, record=lambda state: {
      'states': np.stack([
          np.asarray(state.sum_of_squares['table']),
          np.asarray(state.last_step['table']).astype(np.float32),
          np.asarray(state.row_counter['table'])])})
  return got['tables'], got['states']


def _model(data, kw):
  """The float64 model (tests/reference.py) on the same inputs."""
  model = reference.RowwiseAdagradWithCounter(
      data['table0'], lr=float(data['learning_rate']), eps=float(data['eps']),
      max_counter_update_freq=0, **kw)
  tables = []
  for ids, grads in zip(data['ids'], data['grads']):
    model.step(ids, grads)
    tables.append(model.p.copy())
  return np.stack(tables), model


def _errors(tables, want):
  return fbgemm_replay.table_errors(tables, want,
                                    row_floor=1e-3)['table_rel_to_row']


def _compare(data, name, kw, jit=True, impl='auto'):
  tables, states = _replay(data, kw, jit, impl)
  want_t, want_s = data[f'{name}/tables'], data[f'{name}/states']
  # last step and counter: exact (integers, or the same float32 arithmetic
  # on the same integers), accumulator within float32 summation order.
  np.testing.assert_array_equal(states[:, 1], want_s[:, 1], err_msg=name)
  np.testing.assert_allclose(states[:, 2], want_s[:, 2], rtol=1e-6,
                             err_msg=name)
  np.testing.assert_allclose(states[:, 0], want_s[:, 0], rtol=2e-6,
                             atol=1e-9, err_msg=name)
  err = _errors(tables, want_t)
  assert err < 3e-6, (name, err)
  fbgemm_replay.assert_untouched(tables, data)
  return err


def test_fixture_is_a_hard_case():
  data = fbgemm_replay.load(FIXTURE)
  fbgemm_replay.assert_hard_case(data, min_steps=30, min_never=1)
  assert list(data['names']) == list(_configs())
  # A row absent for at least 6 steps in a row, then back.
  gaps = data['adagradw/states'][:, 1]  # prev_iter after each step
  back = np.diff(gaps, axis=0).max()
  assert back >= 6, back


@pytest.mark.parametrize('name', list(_configs()))
def test_fixture_follows_the_float64_model(name):
  """FBGEMM's outputs are the rule the model writes down (float64)."""
  data = fbgemm_replay.load(FIXTURE)
  kw = _configs()[name]
  tables, model = _model(data, kw)
  assert _errors(tables, data[f'{name}/tables']) < 2e-5, name
  final = data[f'{name}/states'][-1]
  np.testing.assert_allclose(model.g2, final[0], rtol=2e-6, atol=1e-9)
  np.testing.assert_array_equal(model.last_step, final[1])
  np.testing.assert_allclose(model.row_counter, final[2], rtol=1e-6)


# Every implementation, as `test_fbgemm_parity.py` does for ROWWISE_RMSPROP_AR.
@pytest.mark.parametrize('jit, impl', [(False, 'auto'), (True, 'generic'),
                                       (True, 'xla'), (True, 'cpu_kernel')])
@pytest.mark.parametrize('name', list(_configs()))
def test_rowwise_adagrad_with_counter_matches_fbgemm_fixture(name, jit, impl):
  if impl == 'cpu_kernel':
    assert lazy_optax.kernel_status()['cpu_kernel'].available
  data = fbgemm_replay.load(FIXTURE)
  if impl != 'auto':  # the implementation asked for is the one that runs
    tx = lazy_optax.rowwise_adagrad_with_counter(0.1, impl=impl,
                                                 **_configs()[name])
    params = {'table': np.asarray(data['table0'])}
    grads = {'table': lazy_optax.SparseRows(
        data['ids'][0], data['grads'][0], params['table'].shape[0])}
    chosen = lazy_optax.explain_update(tx, grads, tx.init(params), params)
    assert chosen['table'].impl == impl, chosen
  print(name, impl, _compare(data, name, _configs()[name], jit, impl))


LIVE = fbgemm_replay.live_case(
    '--counter', '--seed', '5', '--rows', '96', '--row', '8', '--ids', '40',
    '--steps', '40', '--learning-rate', '0.03')


@fbgemm_replay.live
@pytest.mark.xdist_group('fbgemm_live')   # one FBGEMM run makes every case
def test_rowwise_adagrad_with_counter_matches_live_fbgemm(tmp_path):
  data = fbgemm_replay.make_live(tmp_path, *LIVE)
  errors = {name: _compare(data, name, kw) for name, kw in _configs().items()}
  print(errors)
