"""Property-based tests of the lazy rule against float64 numpy models.

For every optimizer, Hypothesis draws a layout of parameters (tables with
rows of rank 0, 1 and 2, each in float32 in one layout and bfloat16 in the
other, a one-row table, and a parameter with a dense gradient), the number of
steps, and for every step and table a batch: its size (up to larger than the
table), its id distribution (one id repeated, all distinct, heavy duplicates,
only the first and last rows, uniform), its values, and out-of-range padding
ids (negative ones too), which under jit must touch no row. Each step is
checked against a float64 numpy model of the optimizer's rule: the touched
rows follow the rule, every row the step did not touch is bit-for-bit
unchanged in the parameters and in every state leaf that mirrors them, and
`count` advances once per step.

Profiles: `LAZY_OPTAX_HYPOTHESIS_PROFILE=ci` (the default: 25 derandomized
examples per optimizer, bounded for CI) or `dev` (300 random examples per
optimizer and one more layout, for local runs).
"""

import functools
import os

from hypothesis import HealthCheck, given, settings, strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import SparseRows

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    'lazy_optax_ci', max_examples=25, derandomize=True, deadline=None,
    database=None, suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile(
    'lazy_optax_dev', max_examples=300, deadline=None,
    suppress_health_check=_HEALTH, print_blob=True)
PROFILE = os.environ.get('LAZY_OPTAX_HYPOTHESIS_PROFILE', 'ci')
SETTINGS = settings.get_profile(f'lazy_optax_{PROFILE}')

LR = 0.1
PAD = 12  # every batch is padded to this many slots with out-of-range ids
# Table layouts: name -> (shape, dtype). Rows of rank 0 ('r0'), 1 ('r1', a
# one-row table in the first layout) and 2 ('r2'), each rank once in float32
# and once in bfloat16 (one compiled step per optimizer and layout keeps the
# CI run short); PAD ids exceed every table.
# Each layout also has a parameter with a dense gradient, DENSE, which takes
# the dense rule (every row touched) in the same step.
DENSE = 'dense'
LAYOUTS = [
    {'r0': ((7,), 'float32'), 'r1': ((1, 3), 'bfloat16'),
     'r2': ((5, 2, 3), 'float32'), DENSE: ((4,), 'float32')},
    {'r0': ((3,), 'bfloat16'), 'r1': ((9, 2), 'float32'),
     'r2': ((2, 1, 4), 'bfloat16'), DENSE: ((2, 2), 'float32')},
]
if PROFILE != 'ci':
  LAYOUTS.append({'r0': ((11,), 'float32'), 'r1': ((4, 5), 'float32'),
                  'r2': ((1, 3, 2), 'bfloat16'), DENSE: ((3,), 'bfloat16')})

OPTIMIZERS = {
    'lazy_adam': lambda: lazy_optax.lazy_adam(LR),
    'lazy_adamw': lambda: lazy_optax.lazy_adamw(LR, weight_decay=0.2),
    'amsgrad': lambda: lazy_optax.lazy_adam(LR, amsgrad=True),
    'lazy(sgd+momentum)': lambda: lazy_optax.lazy(
        optax.sgd(LR, momentum=0.9)),
    'lazy(adagrad)': lambda: lazy_optax.lazy(optax.adagrad(LR)),
    'lazy(rmsprop)': lambda: lazy_optax.lazy(optax.rmsprop(LR)),
    'lazy(adam)': lambda: lazy_optax.lazy(optax.adam(LR)),
}


# -- float64 models of the rules, one touched row at a time -------------------

def _model_state(opt, shape):
  if opt == 'lazy(adagrad)':
    return {'s': np.full(shape, 0.1)}  # optax's initial_accumulator_value
  names = {'lazy(sgd+momentum)': ['trace'], 'lazy(rmsprop)': ['nu'],
           'amsgrad': ['m', 'v', 'vmax']}.get(opt, ['m', 'v'])
  return {n: np.zeros(shape) for n in names}


def _model_row(opt, t, p, g, s):
  """New parameter row of `opt` at global step `t`; updates `s` in place."""
  b1, b2, eps = 0.9, 0.999, 1e-8
  if opt in ('lazy_adam', 'lazy_adamw', 'amsgrad', 'lazy(adam)'):
    s['m'] = b1 * s['m'] + (1 - b1) * g
    s['v'] = b2 * s['v'] + (1 - b2) * g * g
    if opt == 'lazy(adam)':
      m_hat, v_hat = s['m'] / (1 - b1**t), s['v'] / (1 - b2**t)
      return p - LR * m_hat / (np.sqrt(v_hat) + eps)
    v = s['v']
    if opt == 'amsgrad':
      s['vmax'] = np.maximum(s['vmax'], s['v'])
      v = s['vmax']
    lr_t = LR * np.sqrt(1 - b2**t) / (1 - b1**t)
    step = lr_t * s['m'] / (np.sqrt(v) + eps)
    decay = LR * 0.2 * p if opt == 'lazy_adamw' else 0.0
    return p - step - decay
  if opt == 'lazy(sgd+momentum)':
    s['trace'] = g + 0.9 * s['trace']
    return p - LR * s['trace']
  if opt == 'lazy(adagrad)':
    s['s'] = s['s'] + g * g
    return p - LR * g / np.sqrt(s['s'] + 1e-7)
  if opt == 'lazy(rmsprop)':
    s['nu'] = 0.9 * s['nu'] + 0.1 * g * g
    return p - LR * g / np.sqrt(s['nu'] + 1e-8)
  raise AssertionError(opt)


def _round(x, dtype):
  return _to(x, dtype).astype(np.float64)


def _to(x, dtype):
  """`x` stored in `dtype` (a numpy array: no device computation)."""
  np_dtype = ml_dtypes.bfloat16 if dtype == 'bfloat16' else np.float32
  return np.asarray(x).astype(np_dtype)


class _TableModel:
  """One table and its state rows, in float64, stored in the table's dtype."""

  def __init__(self, opt, table, dtype):
    self.opt, self.dtype = opt, dtype
    self.p = np.array(table, np.float64)
    self.s = {k: _round(v, dtype) for k, v in
              _model_state(opt, self.p.shape).items()}

  def step(self, t, ids, values):
    n = self.p.shape[0]
    summed = {}
    for i, g in zip(ids, values):
      if 0 <= i < n:
        summed[int(i)] = summed.get(int(i), 0.0) + g
    for i, g in summed.items():
      row_state = {k: v[i].copy() for k, v in self.s.items()}
      new_p = _model_row(self.opt, t, self.p[i], g, row_state)
      self.p[i] = _round(new_p, self.dtype)
      for k, v in row_state.items():
        self.s[k][i] = _round(v, self.dtype)
    return sorted(summed)


# -- the system under test ----------------------------------------------------

@functools.lru_cache(maxsize=None)
def _compiled(opt, layout):
  """The initial state and a jitted step, built once per (opt, layout).

  The initial state of these optimizers depends on the parameters' shapes
  and dtypes only, so it is made once and reused.
  """
  tx = OPTIMIZERS[opt]()
  tables = LAYOUTS[layout]

  @jax.jit
  def step(params, state, ids, values):
    grads = {k: values[k] if k == DENSE else SparseRows(ids[k], values[k], s[0])
             for k, (s, _) in tables.items()}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  # Eager: its zeros are programs of a few shapes, which every optimizer
  # and layout shares (jitted, each init was a program of its own).
  init = tx.init({k: jnp.asarray(_to(np.zeros(s), d))
                  for k, (s, d) in tables.items()})
  return init, step


def _mirrors(state, table):
  """State leaves that hold one entry per row of `table`, by path."""
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    keys = [getattr(k, 'key', None) for k in path]
    if table in keys and np.ndim(leaf) >= 1:
      out.append((jax.tree_util.keystr(path), np.asarray(leaf)))
  return out


def _counts(state):
  return [int(c) for _, c in
          optax.tree_utils.tree_get_all_with_path(state, 'count')]


# -- strategies ---------------------------------------------------------------

KINDS = ['same', 'distinct', 'dups', 'edges', 'uniform']


@st.composite
def _batch(draw, num_rows):
  """Ids (padded to PAD with out-of-range ids) for one table and step."""
  kind = draw(st.sampled_from(KINDS))
  size = draw(st.integers(1, PAD))
  row = st.integers(0, num_rows - 1)
  if kind == 'same':
    ids = [draw(row)] * size
  elif kind == 'distinct':
    ids = draw(st.permutations(range(num_rows)))[:size]
  elif kind == 'dups':
    pool = draw(st.lists(row, min_size=1, max_size=2))
    ids = draw(st.lists(st.sampled_from(pool), min_size=size, max_size=size))
  elif kind == 'edges':
    ids = draw(st.lists(st.sampled_from([0, num_rows - 1]), min_size=size,
                        max_size=size))
  else:
    ids = draw(st.lists(row, min_size=size, max_size=size))
  bad = st.sampled_from([num_rows, num_rows + 3, -1, -num_rows, 2**30])
  ids = ids + draw(st.lists(bad, min_size=PAD - len(ids),
                            max_size=PAD - len(ids)))
  return draw(st.permutations(ids))


@st.composite
def _cases(draw):
  layout = draw(st.integers(0, len(LAYOUTS) - 1))
  tables = LAYOUTS[layout]
  steps = draw(st.integers(1, 4))
  batches = [{k: (list(range(s[0])) if k == DENSE else draw(_batch(s[0])))
              for k, (s, _) in tables.items()} for _ in range(steps)]
  return dict(layout=layout, batches=batches,
              seed=draw(st.integers(0, 2**31 - 1)))


# -- the properties -----------------------------------------------------------

def _tolerance(dtype, p):
  if dtype == 'float32':
    return dict(rtol=1e-4, atol=1e-5)
  # bfloat16 storage: a few roundings of 2^-8 relative per step.
  return dict(rtol=0, atol=2**-6 * (1 + np.max(np.abs(p), initial=0)))


@pytest.mark.parametrize('opt', sorted(OPTIMIZERS))
@SETTINGS
@given(case=_cases())
def test_touched_rows_follow_the_rule_untouched_rows_do_not_move(opt, case):
  tables = LAYOUTS[case['layout']]
  state, step = _compiled(opt, case['layout'])
  rng = np.random.default_rng(case['seed'])
  start = {k: _round(rng.normal(size=s), d) for k, (s, d) in tables.items()}
  params = {k: jnp.asarray(_to(v, tables[k][1])) for k, v in start.items()}
  models = {k: _TableModel(opt, v, tables[k][1]) for k, v in start.items()}

  for t, batch in enumerate(case['batches'], start=1):
    ids = {k: np.asarray(batch[k], np.int32) for k in tables}
    values = {k: _round(rng.normal(size=(len(ids[k]), *s[1:])), d)
              for k, (s, d) in tables.items()}
    new_params, new_state = step(
        params, state, {k: jnp.asarray(v) for k, v in ids.items()},
        {k: jnp.asarray(_to(v, tables[k][1])) for k, v in values.items()})
    for k, (shape, dtype) in tables.items():
      touched = models[k].step(t, ids[k], values[k])
      untouched = [r for r in range(shape[0]) if r not in touched]
      old = [('params', np.asarray(params[k]))] + _mirrors(state, k)
      new = [('params', np.asarray(new_params[k]))] + _mirrors(new_state, k)
      assert [n for n, _ in old] == [n for n, _ in new]
      assert len(new) > 1, f'{opt}: no state mirrors table {k}'
      for (name, a), (_, b) in zip(old, new):
        # Bit-for-bit: compare the raw bytes, so NaN payloads and -0.0 count.
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a[untouched].tobytes() == b[untouched].tobytes(), (
            f'step {t}: untouched rows of {name} ({k}) moved')
      got = np.asarray(new_params[k], np.float64)
      np.testing.assert_allclose(
          got[touched], models[k].p[touched], **_tolerance(dtype, got),
          err_msg=f'{opt}, step {t}, table {k}, touched rows {touched}')
      if dtype == 'float32':
        state_rows = dict(_mirrors(new_state, k))
        for name, model in models[k].s.items():
          leaf = _state_leaf(state_rows, opt, name)
          # float32 sums of duplicate ids may cancel: allow their rounding,
          # a few ulps of the leaf's scale.
          scale = np.max(np.abs(model), initial=0)
          np.testing.assert_allclose(leaf[touched], model[touched],
                                     rtol=1e-4, atol=4e-6 * scale,
                                     err_msg=f'{opt}: {name} of {k}, step {t}')
    assert all(c == t for c in _counts(new_state)), _counts(new_state)
    params, state = new_params, new_state
  if opt in ('lazy_adam', 'lazy_adamw', 'amsgrad', 'lazy(adam)'):
    assert _counts(state) == [len(case['batches'])]


_STATE_NAMES = {'m': 'mu', 'v': '.nu', 'vmax': 'nu_max', 'trace': 'trace',
                's': 'sum_of_squares', 'nu': '.nu'}


def _state_leaf(state_rows, opt, name):
  want = _STATE_NAMES[name]
  hits = [v for path, v in state_rows.items()
          if want in path and not (name == 'v' and 'nu_max' in path)]
  assert len(hits) == 1, (opt, name, list(state_rows))
  return np.asarray(hits[0], np.float64)


@pytest.mark.parametrize('opt', sorted(OPTIMIZERS))
def test_an_empty_batch_changes_nothing_but_the_count(opt):
  tables = LAYOUTS[0]
  tx = OPTIMIZERS[opt]()
  rng = np.random.default_rng(7)
  params = {k: jnp.asarray(_to(rng.normal(size=s), d))
            for k, (s, d) in tables.items()}
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = {k: SparseRows(np.zeros((0,), np.int32),
                           _to(np.zeros((0, *s[1:])), d), s[0])
             for k, (s, d) in tables.items()}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  new_params, new_state = step(params, state)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  old_rows = [x for x in jax.tree.leaves(state) if np.ndim(x) >= 1]
  new_rows = [x for x in jax.tree.leaves(new_state) if np.ndim(x) >= 1]
  assert len(old_rows) == len(new_rows) >= 3
  for a, b in zip(old_rows, new_rows):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert all(c == 1 for c in _counts(new_state))
