"""Training on hashed ids: the whole step against float64 models.

* 1,000 steps of a Zipf stream with more distinct ids than slots: `assign`
  + `reset_rows` + `lookup` + `value_and_grad` + `lazy_adam`, jitted and
  donated, equals the policy model (`id_table_reference`) and TensorFlow's
  LazyAdam rule in float64 (`reference.TFLazyAdam`).
* `reset_rows` gives every optimizer-state leaf that mirrors a table what
  `tx.init` gives a fresh row (FTRL, row-wise Adagrad, adam_with_counter's per-row
  counts, chains, partitions, injected hyperparameters), keys rows by raw
  id, and leaves every other row bit for bit alone.
* orbax: a run saved and restored midway (id state, params, optimizer
  state) continues bit for bit.
"""

import os

from id_table_reference import IdTableModel
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from reference import TFLazyAdam

import lazy_optax
from lazy_optax._src import id_words
from lazy_optax._src import reset_rows as reset_module

CAP, PROBE, D, N = 48, 6, 4, 16
LR = 0.05
W = np.array([0.5, -1.0, 0.25, 2.0])
INIT = jax.nn.initializers.uniform(0.2)
KEY = jax.random.key(7)
# The initial rows `reset_rows` must give (the rule of
# `reset_rows.fresh_rows`), jitted: one small program per batch shape,
# not a dozen eager ops each compiled for it.
FRESH_ROWS = jax.jit(reset_module.fresh_rows, static_argnums=(0, 3, 4, 5))


def _stream(steps, universe=300, seed=0):
  rng = np.random.default_rng(seed)
  pool = rng.integers(0, 2 ** 63 - 1, universe, dtype=np.int64)
  ranks = np.minimum(rng.zipf(1.3, (steps, N)), universe) - 1
  ids = pool[ranks]
  # Planted per-id targets.
  targets = np.sin(ids % 1000).astype(np.float32)
  return ids, targets


def _make_step(table_ids, tx):
  def step(params, opt_state, id_state, words, targets, k):
    slots, id_state, fresh = table_ids.assign(id_state, words, step=k)
    params, opt_state = lazy_optax.reset_rows(
        tx, params, opt_state, {'emb': fresh}, init=INIT, key=KEY)

    def loss_fn(params):
      rows = lazy_optax.lookup(params['emb'], slots)
      return jnp.mean((rows @ jnp.asarray(W, jnp.float32) - targets) ** 2)

    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (lazy_optax.apply_updates(params, updates), opt_state, id_state,
            slots, loss)
  return jax.jit(step, donate_argnums=(0, 1, 2))


def test_1000_steps_equal_the_float64_model_of_policy_and_rule():
  steps = 1000
  ids, targets = _stream(steps)
  assert len(np.unique(ids)) > 3 * CAP
  # Eviction of any victim (admission='always'): many evictions and returns.
  table_ids = lazy_optax.IdTable(capacity=CAP, probe=PROBE, eviction='lru',
                                 eviction_log=0, admission='always')
  tx = lazy_optax.lazy_adam(LR)
  step = _make_step(table_ids, tx)
  params = {'emb': jnp.zeros((CAP, D), jnp.float32)}
  opt_state = tx.init(params)
  id_state = table_ids.init()

  # Each id's initial row, computed once per distinct id from its raw id.
  distinct = np.unique(ids)
  rows0 = np.asarray(FRESH_ROWS(
      INIT, KEY, jax.device_put(lazy_optax.split_ids(distinct)), (D,),
      jnp.float32, 'emb'), np.float64)
  start = dict(zip(distinct.tolist(), rows0))

  model = IdTableModel(capacity=CAP, probe=PROBE, eviction='lru',
                       admission='always')
  adam = TFLazyAdam(np.zeros((CAP, D)), lr=LR)
  words = lazy_optax.split_ids(ids)
  admitted_twice = 0
  evicted, logged = set(), 0   # every id the model has evicted so far
  for k in range(steps):
    params, opt_state, id_state, slots, _ = step(
        params, opt_state, id_state, words[k], targets[k], k)
    want, fresh = model.assign(ids[k], k)
    np.testing.assert_array_equal(np.asarray(slots), want)
    for s, x in fresh.items():                       # reset_rows
      adam.p[s], adam.m[s], adam.v[s] = start[x], 0.0, 0.0
    evicted.update(y for y, _ in model.evicted_at[logged:])
    logged = len(model.evicted_at)
    admitted_twice += sum(x in evicted for x in fresh.values())
    rows = np.where((want < CAP)[:, None], adam.p[np.minimum(want, CAP - 1)],
                    0.0)
    err = rows @ W - targets[k]
    grads = 2.0 / N * err[:, None] * W[None, :]
    adam.step(np.where(want < CAP, want, -1), grads)
    if k % 250 == 249 or k == steps - 1:
      np.testing.assert_allclose(np.asarray(params['emb']), adam.p,
                                 rtol=2e-4, atol=2e-5)
      mu = optax.tree.get(opt_state, 'mu')['emb']
      np.testing.assert_allclose(np.asarray(mu), adam.m, rtol=2e-4, atol=2e-6)
  # Evicted ids came back many times, each from its own initial row.
  assert admitted_twice > 100
  assert lazy_optax.IdTable.stats(table_ids, id_state)['evictions'] > 500


def test_a_returning_evicted_id_starts_fresh():
  table_ids = lazy_optax.IdTable(capacity=4, probe=4, eviction='lru',
                                 admission='always')
  tx = lazy_optax.lazy_adam(0.1)
  step = _make_step(table_ids, tx)
  params = {'emb': jnp.zeros((4, D), jnp.float32)}
  opt_state, id_state = tx.init(params), table_ids.init()
  x = 2 ** 62 + 99
  batch = np.full(N, x, np.int64)
  params, opt_state, id_state, slots, _ = step(
      params, opt_state, id_state, lazy_optax.split_ids(batch),
      np.ones(N, np.float32), 0)
  first = int(slots[0])
  row0 = np.asarray(FRESH_ROWS(INIT, KEY, jax.device_put(
      lazy_optax.split_ids(np.array([x]))), (D,), jnp.float32, 'emb'))[0]
  assert not np.allclose(np.asarray(params['emb'])[first], row0)  # trained
  # Four other ids take every slot; x is evicted.
  others = np.repeat(np.arange(1, 5, dtype=np.int64), N // 4)
  params, opt_state, id_state, _, _ = step(
      params, opt_state, id_state, lazy_optax.split_ids(others),
      np.ones(N, np.float32), 1)
  assert int(table_ids.find(id_state, np.array([x]))[0]) == 4
  # x returns: its row is its initial row again, its moments start at zero.
  slots, id_state, fresh = table_ids.assign(id_state, batch, step=2)
  params, opt_state = lazy_optax.reset_rows(
      tx, params, opt_state, {'emb': fresh}, init=INIT, key=KEY)
  s = int(slots[0])
  np.testing.assert_array_equal(np.asarray(params['emb'])[s], row0)
  assert not np.asarray(optax.tree.get(opt_state, 'mu')['emb'])[s].any()
  assert not np.asarray(optax.tree.get(opt_state, 'nu')['emb'])[s].any()


def _fresh(slots, ids, capacity):
  # device_put of NumPy arrays compiles nothing (jnp.asarray would compile
  # a small copy per new shape).
  return lazy_optax.FreshRows(
      jax.device_put(np.asarray(slots, np.int32)),
      jax.device_put(lazy_optax.split_ids(np.asarray(ids, np.int64))))


@pytest.mark.parametrize('name', ['ftrl', 'rowwise_adagrad', 'adam_with_counter',
                                  'rowwise_rmsprop_ar',
                                  'chain_partition_inject', 'lazy_adamw'])
def test_reset_rows_gives_what_init_gives_a_fresh_row(name):
  params = {'emb': jax.device_put(np.arange(40.0, dtype=np.float32)
                                  .reshape(10, 4)),
             'w': jax.device_put(np.ones(3, np.float32))}
  txs = {
      'ftrl': lambda: lazy_optax.ftrl(0.1, initial_accumulator_value=0.1),
      'rowwise_adagrad': lambda: lazy_optax.rowwise_adagrad(
          0.1, initial_accumulator_value=0.3),
      'adam_with_counter': lambda: lazy_optax.adam_with_counter(0.1),
      'rowwise_rmsprop_ar': lambda: lazy_optax.rowwise_rmsprop_ar(
          0.1, ar_alpha=0.5),
      'chain_partition_inject': lambda: optax.partition(
          {'emb': lazy_optax.lazy(optax.chain(
              optax.clip_by_global_norm(1.0),
              optax.inject_hyperparams(optax.adagrad)(
                  learning_rate=0.1, initial_accumulator_value=0.7))),
           'w': optax.adam(0.1)}, lazy_optax.tree.path_labels(lambda name: name)),
      'lazy_adamw': lambda: lazy_optax.lazy(optax.adamw(0.1, nesterov=True)),
  }
  tx = txs[name]()
  init_state = tx.init(params)
  # Train a few steps so that every state row has moved (one jitted step,
  # not each optimizer op dispatched on its own).
  @jax.jit
  def train(state, p, k):
    g = {'emb': lazy_optax.SparseRows(jnp.arange(10) % 10,
                                      jnp.full((10, 4), 1.0 + k), 10),
         'w': jnp.ones(3)}
    updates, state = tx.update(g, state, p)
    return state, lazy_optax.apply_updates(p, updates)

  state, p = init_state, params
  for k in range(3):
    state, p = train(state, p, jnp.float32(k))
  before = jax.tree.map(np.asarray, (p, state))
  fresh = _fresh([3, 10, 7, 10], np.array([11, 0, 2 ** 50, 5]), 10)
  new_p, new_state = lazy_optax.reset_rows(
      tx, p, state, {'emb': fresh}, init=INIT, key=KEY)
  reset = np.array([3, 7])
  kept = np.setdiff1d(np.arange(10), reset)
  row_init = np.asarray(FRESH_ROWS(INIT, KEY, fresh.ids, (4,), jnp.float32,
                                  'emb'))
  np.testing.assert_array_equal(np.asarray(new_p['emb'])[reset],
                                row_init[np.array([0, 2])])
  np.testing.assert_array_equal(np.asarray(new_p['emb'])[kept],
                                before[0]['emb'][kept])
  np.testing.assert_array_equal(new_p['w'], before[0]['w'])
  # Leaves mirroring the table: rows as init gives them, others untouched;
  # init here sees the fresh rows as the table (adam_with_counter/ftrl start from 0,
  # accumulators from their initial value).
  fresh_init = tx.init({'emb': jax.device_put(row_init[np.array([0, 2])]),
                        'w': params['w']})
  for new, old, ref_new, ref_old in zip(
      jax.tree.leaves(new_state), jax.tree.leaves(before[1]),
      jax.tree.leaves(fresh_init), jax.tree.leaves(init_state)):
    new, old = np.asarray(new), np.asarray(old)
    if new.shape[:1] == (10,) and np.shape(ref_old)[:1] == (10,):
      np.testing.assert_array_equal(new[reset], np.asarray(ref_new))
      np.testing.assert_array_equal(new[kept], old[kept])
      assert (old[reset] != np.asarray(ref_new)).any() or name == 'ftrl'
    else:
      np.testing.assert_array_equal(new, old)      # count, w's state


def test_reset_rows_makes_a_rowwise_rmsprop_ar_row_never_touched():
  # A fresh slot's row must not inherit the old owner's last step: its
  # prev_iter is "never updated" (0) and its v is 0, so its next update
  # shrinks it by one step's worth (I = 1), not by the old owner's gap.
  lr, alpha, beta = 0.1, 2.0, 0.9
  tx = lazy_optax.rowwise_rmsprop_ar(lr, ar_alpha=alpha, ema_beta=beta)
  params = {'emb': jnp.ones((10, 4), jnp.float32)}
  state = tx.init(params)
  step = jax.jit(lambda p, s, ids: _ar_step(tx, p, s, ids))
  params, state = step(params, state, jnp.array([3, 7], jnp.int32))
  for _ in range(3):  # rows 3 and 7 go unseen for three steps
    params, state = step(params, state, jnp.array([1], jnp.int32))
  fresh = _fresh([3, 10], np.array([2 ** 40, 9]), 10)
  params, state = lazy_optax.reset_rows(tx, params, state, {'emb': fresh},
                                        init=INIT, key=KEY)
  np.testing.assert_array_equal(np.asarray(state.prev_iter['emb']),
                                [0, 4, 0, 0, 0, 0, 0, 1, 0, 0])
  assert float(state.nu['emb'][3]) == 0.0 and float(state.nu['emb'][7]) > 0
  w3 = np.asarray(params['emb'][3], np.float64)
  w7 = np.asarray(params['emb'][7], np.float64)
  v7 = float(state.nu['emb'][7])
  params, state = step(params, state, jnp.array([3, 7], jnp.int32))
  g = np.ones(4)  # _ar_step's gradient rows
  # Step 5: row 3 is new (I = 1), row 7 was last updated at step 1 (I = 4).
  want3 = (1 - lr * alpha) * w3 - lr * g / np.sqrt((1 - beta) * 1.0)
  v7 = beta * v7 + (1 - beta) * 1.0
  want7 = max(0.1, 1 - lr * alpha * 4) * w7 - lr * g / np.sqrt(v7)
  np.testing.assert_allclose(np.asarray(params['emb'][3]), want3, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(params['emb'][7]), want7, rtol=1e-5)
  assert int(state.prev_iter['emb'][3]) == 5


def _ar_step(tx, params, state, ids):
  g = {'emb': lazy_optax.SparseRows(ids, jnp.ones((ids.shape[0], 4)), 10)}
  updates, state = tx.update(g, state, params)
  return lazy_optax.apply_updates(params, updates), state


def test_reset_rows_keys_rows_by_raw_id_and_table():
  params = {'a': jnp.zeros((6, 3)), 'b': jnp.zeros((6, 3))}
  tx = lazy_optax.lazy_adam(0.1)
  state = tx.init(params)
  x = 2 ** 45 + 3
  normal = jax.nn.initializers.normal(1.0)   # one initializer: one program
  p, _ = lazy_optax.reset_rows(
      tx, params, state, {'a': _fresh([1, 6], np.array([x, 9]), 6),
                          'b': _fresh([4, 6], np.array([x, 9]), 6)},
      init=normal, key=KEY)
  # The same tables and batch shapes as above (one compiled reset): x
  # takes slot 5 of 'a'; 9, and every id of 'b', get no row (slot 6).
  q, _ = lazy_optax.reset_rows(
      tx, params, state, {'a': _fresh([5, 6], np.array([x, 9]), 6),
                          'b': _fresh([6, 6], np.array([x, 9]), 6)},
      init=normal, key=KEY)
  pa, pb, qa = np.asarray(p['a']), np.asarray(p['b']), np.asarray(q['a'])
  np.testing.assert_array_equal(pa[1], qa[5])            # same id, same row
  assert not np.asarray(q['b']).any()                    # no row reset
  assert not np.allclose(pa[1], pb[4])                   # another table
  # Rows look like draws of the initializer: many ids, mean 0, std 1.
  many = np.arange(4000, dtype=np.int64) * 1000003
  rows = np.asarray(FRESH_ROWS(
      normal, KEY, jax.device_put(lazy_optax.split_ids(many)), (8,),
      jnp.float32, 'a'))
  assert abs(rows.mean()) < 0.02 and abs(rows.std() - 1) < 0.02
  corr = np.corrcoef(rows[:, 0], rows[:, 1])[0, 1]
  assert abs(corr) < 0.05


def test_reset_rows_jitted_equals_eager_and_is_batch_sized():
  cap = 4096
  params = {'emb': jnp.ones((cap, 8)), 'w': jnp.ones(2)}
  tx = lazy_optax.lazy_adam(0.1)
  state = tx.init(params)
  rng = np.random.default_rng(0)
  slots = np.where(rng.random(600) < 0.3, rng.permutation(cap)[:600], cap)
  fresh = _fresh(slots, rng.integers(0, 2 ** 62, 600), cap)

  def reset(p, s, f):
    return lazy_optax.reset_rows(tx, p, s, {'emb': f}, init=INIT, key=KEY)

  eager = reset(params, state, fresh)
  jitted = jax.jit(reset, donate_argnums=(0, 1))
  compiled = jitted.lower(params, state, fresh).compile()
  # The very program whose text is read below runs (one trace and compile).
  out = compiled(jax.tree.map(jnp.copy, params),
                 jax.tree.map(jnp.copy, state), fresh)
  jax.tree.map(np.testing.assert_array_equal, eager, out)
  text = compiled.as_text()
  assert 'copy(' not in ''.join(
      line for line in text.splitlines() if f'[{cap},' in line)


# The chunked-reset test's optimizer, and its two compiled resets (the CPU's
# skipping one, the branch-free one), shared by its cases: every share has
# the same shapes, so one trace and compile of each per process.
CHUNK_TX = lazy_optax.lazy_adam(0.1)
_CHUNK_RESETS = {}


def _chunk_reset(branch_free, params, state, fresh):
  """(text, compiled) of `_reset` traced under `branch_free`'s version:
  the text read is that of the very program that runs."""
  import branch_versions

  if branch_free not in _CHUNK_RESETS:
    with branch_versions.forced(branch_free):
      lowered = jax.jit(lambda p, s, f: reset_module._reset(
          CHUNK_TX, INIT, p, s, {'emb': f}, KEY)).lower(params, state, fresh)
    _CHUNK_RESETS[branch_free] = (lowered.as_text(), lowered.compile())
  return _CHUNK_RESETS[branch_free]


@pytest.mark.parametrize('share', [0.0, 0.3, 1.0])
def test_reset_rows_in_chunks_equals_one_branch_free_reset(share):
  """Past 256 fresh entries the CPU resets in chunks, skipping (`lax.cond`)
  those past the fresh count; GPU and TPU reset every entry at once (those
  past the count name no row). Both give the same bits, and what
  `fresh_rows` gives the fresh slots."""
  cap, n = 4096, 600
  rng = np.random.default_rng(1)
  params = {'emb': jax.device_put(rng.normal(size=(cap, 8)).astype(np.float32)),
            'w': jax.device_put(np.ones(2, np.float32))}
  tx = CHUNK_TX
  state = jax.tree.map(lambda x: x + 1 if jnp.ndim(x) == 2 else x,
                       tx.init(params))
  chosen = rng.random(n) < share
  slots = np.where(chosen, rng.permutation(cap)[:n], cap)
  fresh = _fresh(slots, rng.integers(0, 2 ** 62, n), cap)
  assert reset_module._chunk_size(n) < n
  out = {}
  for branch_free in (False, True):
    text, compiled = _chunk_reset(branch_free, params, state, fresh)
    out[branch_free] = compiled(params, state, fresh)
    assert ('stablehlo.case' in text) != branch_free
  jax.tree.map(np.testing.assert_array_equal, out[False], out[True])
  new_p, new_state = out[True]
  rows = np.asarray(FRESH_ROWS(INIT, KEY, fresh.ids, (8,), jnp.float32,
                              'emb'))
  kept = np.setdiff1d(np.arange(cap), slots[chosen])
  np.testing.assert_array_equal(np.asarray(new_p['emb'])[slots[chosen]],
                                rows[chosen])
  np.testing.assert_array_equal(np.asarray(new_p['emb'])[kept],
                                np.asarray(params['emb'])[kept])
  for new, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
    if np.ndim(old) == 2:      # mu, nu of the table: zero where fresh
      np.testing.assert_array_equal(np.asarray(new)[slots[chosen]], 0)
      np.testing.assert_array_equal(np.asarray(new)[kept],
                                    np.asarray(old)[kept])


def test_reset_rows_bad_input():
  params = {'emb': jnp.zeros((4, 2))}
  tx = lazy_optax.lazy_adam(0.1)
  state = tx.init(params)
  fresh = _fresh([1], np.array([5]), 4)
  with pytest.raises(KeyError, match="no parameter named 'table'"):
    lazy_optax.reset_rows(tx, params, state, {'table': fresh}, init=INIT,
                          key=KEY)
  with pytest.raises(TypeError, match='FreshRows'):
    lazy_optax.reset_rows(tx, params, state, {'emb': jnp.array([1])},
                          init=INIT, key=KEY)
  with pytest.raises(ValueError, match='give a key'):
    lazy_optax.reset_rows(tx, params, state, {'emb': fresh}, init=INIT)
  with pytest.raises(ValueError, match='structure'):
    lazy_optax.reset_rows(lazy_optax.rowwise_adagrad(0.1), params, state,
                          {'emb': fresh}, init=INIT, key=KEY)
  p, _ = lazy_optax.reset_rows(tx, params, state, {'emb': fresh}, init=None)
  assert not np.asarray(p['emb']).any()


def test_orbax_resume_continues_bit_for_bit(tmp_path):
  ids, targets = _stream(24, seed=3)
  table_ids = lazy_optax.IdTable(capacity=CAP, probe=PROBE, eviction='lfu',
                                 ttl=5, admit_after=2, lfu_period=4)
  tx = lazy_optax.lazy_adam(LR)
  step = _make_step(table_ids, tx)
  words = lazy_optax.split_ids(ids)

  def fresh_run():
    params = {'emb': jnp.zeros((CAP, D), jnp.float32)}
    return params, tx.init(params), table_ids.init()

  def run(state, ks):
    for k in ks:
      *state, _, _ = step(*state, words[k], targets[k], k)
    return tuple(state)

  straight = run(fresh_run(), range(24))
  half = run(fresh_run(), range(12))
  path = os.path.join(tmp_path, 'ckpt')
  tree = {'params': half[0], 'opt_state': half[1], 'id_state': half[2]}
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree)
  target = jax.tree.map(np.zeros_like, tree)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, target)
  resumed = run((restored['params'], restored['opt_state'],
                 restored['id_state']), range(12, 24))
  jax.tree.map(np.testing.assert_array_equal, straight, resumed)
  assert isinstance(restored['id_state'], lazy_optax.IdTableState)
  changed_ids, _, _ = table_ids.export_changes(resumed[2], since_step=20)
  assert set(changed_ids.tolist()) <= set(ids[20:].ravel().tolist())
  assert id_words.join_words(np.asarray(resumed[2].ids)).shape == (CAP,)
