"""adam_with_counter beyond the conformance suite (tests/test_conformance.py):
per-row bias correction, catch-up and decay against optax.adam(w) per row."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from reference import AdamWithCounter

import lazy_optax

B1, B2 = 0.9, 0.999


def _batches(seed, num_rows=20, steps=14, n_ids=6, row_shape=(3,)):
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    # Rows come and go: a drifting window, with duplicates.
    lo = (t * num_rows) // (2 * steps)
    ids = rng.integers(lo, lo + num_rows // 2, n_ids).astype(np.int32)
    ids[:2] = ids[2]
    out.append((ids, rng.normal(size=(n_ids, *row_shape))))
  return out


def _run(tx, table, batches, jit=True):
  params = {'table': jnp.asarray(table, jnp.float32)}
  state = tx.init(params)

  def step(params, state, ids, values):
    g = {'table': lazy_optax.SparseRows(ids, values, table.shape[0])}
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  if jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  history = []
  for ids, values in batches:
    params, state = step(params, state, jnp.asarray(ids),
                         jnp.asarray(values, jnp.float32))
    history.append(np.asarray(params['table']))
  return params, state, history


def test_late_row_first_step_is_lr_per_row_and_2_5x_global():
  """A row first seen at global step 1,000."""
  lr, num_rows = 0.01, 8
  g_other = jnp.ones((1, 2))
  g_new = jnp.array([[0.3, -2.0]])

  def late_step(tx):
    params = {'t': jnp.zeros((num_rows, 2))}
    state = tx.init(params)

    @jax.jit
    def warm(state):
      def body(state, _):
        g = {'t': lazy_optax.SparseRows(jnp.array([0]), g_other, num_rows)}
        return tx.update(g, state, params)[1], None
      return jax.lax.scan(body, state, None, length=999)[0]

    state = warm(state)
    g = {'t': lazy_optax.SparseRows(jnp.array([5]), g_new, num_rows)}
    # One program, not the update's ops dispatched one by one.
    updates, state = jax.jit(tx.update)(g, state, params)
    assert int(lazy_optax.compat.global_step(state)) == 1000
    return np.asarray(
        jax.jit(lazy_optax.apply_updates)(params, updates)['t'][5])

  # Per row: the first step of a fresh Adam, exactly -lr * sign(g).
  np.testing.assert_allclose(late_step(lazy_optax.adam_with_counter(lr)),
                             -lr * np.sign(g_new[0]), rtol=1e-5)
  # Global count (TensorFlow's Adam rule, epsilon hat):
  # sqrt(1-b2^t)/(1-b1^t) * (1-b1)/sqrt(1-b2)
  factor = np.sqrt(1 - B2 ** 1000) / (1 - B1 ** 1000) * (1 - B1) / np.sqrt(
      1 - B2)
  assert 2.4 < factor < 2.6
  for tx in (lazy_optax.adam_with_counter(lr, bias_correction='global'),
             lazy_optax.lazy_adam(lr)):
    np.testing.assert_allclose(late_step(tx), -lr * factor * np.sign(g_new[0]),
                               rtol=1e-4)


def _row_sequences(batches, num_rows):
  """Per row: list of (step, summed gradient) for the steps it was touched."""
  seqs = {i: [] for i in range(num_rows)}
  for t, (ids, values) in enumerate(batches, start=1):
    summed = {}
    for i, g in zip(ids, values):
      summed[int(i)] = summed.get(int(i), 0) + g
    for i, g in summed.items():
      seqs[i].append((t, g))
  return seqs


def test_per_row_equals_an_independent_adam_per_row():
  """Without catch-up each row is a fresh optax.adam that steps when touched."""
  rng = np.random.default_rng(5)
  table = rng.normal(size=(20, 3))
  batches = _batches(6)
  params, _, _ = _run(lazy_optax.adam_with_counter(0.05, eps=0.0), table,
                      batches)
  adam = optax.adam(0.05, eps=0.0)

  @jax.jit  # one step of the reference in one program, not op by op
  def adam_step(g, s, p):
    u, s = adam.update(g, s)
    return p + u, s

  for i, seq in _row_sequences(batches, 20).items():
    p = jnp.asarray(table[i], jnp.float32)
    s = adam.init(p)
    for _, g in seq:
      p, s = adam_step(jnp.asarray(g, jnp.float32), s, p)
    np.testing.assert_allclose(params['table'][i], p, rtol=2e-5, atol=1e-6)


def test_catch_up_equals_dense_adam_from_first_appearance():
  """With catch-up each row follows optax.adam started at its first step,
  fed zero gradients while absent; the row moves only when touched."""
  rng = np.random.default_rng(7)
  table = rng.normal(size=(20, 3))
  batches = _batches(8)
  tx = lazy_optax.adam_with_counter(0.05, eps=0.0, catch_up=True)
  params, _, _ = _run(tx, table, batches)
  adam = optax.adam(0.05, eps=0.0)
  adam_update = jax.jit(adam.update)  # one program, not op by op
  for i, seq in _row_sequences(batches, 20).items():
    if not seq:
      np.testing.assert_array_equal(params['table'][i], np.float32(table[i]))
      continue
    grads_at = dict(seq)
    p = jnp.asarray(table[i], jnp.float32)
    s = adam.init(p)
    for t in range(seq[0][0], seq[-1][0] + 1):
      g = grads_at.get(t, np.zeros(3))
      u, s = adam_update(jnp.asarray(g, jnp.float32), s)
      if t in grads_at:
        p = p + u
    np.testing.assert_allclose(params['table'][i], p, rtol=2e-5, atol=1e-6)


def test_catch_up_global_moments_equal_dense_adam_moments():
  rng = np.random.default_rng(9)
  table = rng.normal(size=(20, 3))
  batches = _batches(10)
  tx = lazy_optax.adam_with_counter(0.05, catch_up=True,
                                   bias_correction='global')
  _, state, _ = _run(tx, table, batches)
  dense = optax.scale_by_adam(B1, B2)
  dstate = dense.init(jnp.zeros((20, 3)))
  last = np.zeros(20, int)
  # The dense reference's step in one program, not op by op.
  dense_step = jax.jit(lambda ids, values, s: dense.update(
      lazy_optax.SparseRows(ids, values, 20).to_dense(), s)[1])
  for t, (ids, values) in enumerate(batches, start=1):
    dstate = dense_step(ids, jnp.asarray(values, jnp.float32), dstate)
    last[np.unique(ids)] = t
  # Rows last touched at the final step: their moments are dense Adam's.
  final = np.flatnonzero(last == len(batches))
  assert final.size
  np.testing.assert_allclose(
      lazy_optax.compat.get_slot(state, 'table', 'mu')[final], dstate.mu[final],
      rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(
      lazy_optax.compat.get_slot(state, 'table', 'nu')[final], dstate.nu[final],
      rtol=2e-5, atol=1e-9)


def test_dense_rows_every_step_equal_optax_adamw():
  """Every row touched every step: per-row counts equal the global one."""
  rng = np.random.default_rng(11)
  p0 = rng.normal(size=(4, 3)).astype(np.float32)
  params = {'w': jnp.asarray(p0), 'b': jnp.asarray(p0[0]),
            'scale': jnp.asarray(p0[0, 0])}
  ours = lazy_optax.adam_with_counter(0.05, eps=0.0, weight_decay=0.1,
                             decay_skipped_steps=True)
  ref = optax.adamw(0.05, eps=0.0, weight_decay=0.1)
  s_ours, s_ref = ours.init(params), ref.init(params)
  p_ours = p_ref = params

  @jax.jit  # both steps in one program, not op by op
  def steps(g, s_ours, p_ours, s_ref, p_ref):
    u, s_ours = ours.update(g, s_ours, p_ours)
    p_ours = lazy_optax.apply_updates(p_ours, u)
    u, s_ref = ref.update(g, s_ref, p_ref)
    return s_ours, p_ours, s_ref, optax.apply_updates(p_ref, u)

  for _ in range(6):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape),
                                           jnp.float32), params)
    s_ours, p_ours, s_ref, p_ref = steps(g, s_ours, p_ours, s_ref, p_ref)
  for k in params:
    np.testing.assert_allclose(p_ours[k], p_ref[k], rtol=2e-5, atol=1e-6)


def test_untouched_rows_bit_for_bit_and_state_shapes():
  table = np.arange(30, dtype=np.float32).reshape(10, 3)
  tx = lazy_optax.adam_with_counter(0.1, weight_decay=0.5,
                                    decay_skipped_steps=True, catch_up=True)
  batches = [(np.array([1, 4, 1], np.int32), np.ones((3, 3)))] * 3
  params, state, _ = _run(tx, table, batches)
  untouched = [i for i in range(10) if i not in (1, 4)]
  np.testing.assert_array_equal(params['table'][np.array(untouched)],
                                table[untouched])
  rc = lazy_optax.compat.get_slot(state, 'table', 'row_count')
  assert rc.shape == (10,) and rc.dtype == jnp.int32
  assert lazy_optax.compat.get_slot_names(state, params) == [
      'last_step', 'm', 'row_count', 'v']


def test_weight_decay_mask_and_schedule():
  rng = np.random.default_rng(12)
  table = rng.normal(size=(20, 3))
  batches = _batches(13, steps=5)
  sched = optax.linear_schedule(0.05, 0.01, 5)
  params = {'table': jnp.asarray(table, jnp.float32)}
  tx = lazy_optax.adam_with_counter(sched, weight_decay=0.3,
                           mask={'table': False})
  state = tx.init(params)
  model = AdamWithCounter(table, lr=None)

  @jax.jit  # one program, not the update's ops one by one
  def step(params, state, ids, values):
    g = {'table': lazy_optax.SparseRows(ids, values, 20)}
    u, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, u), state

  for t, (ids, values) in enumerate(batches):
    model.lr = float(sched(t))
    model.step(ids, values)
    params, state = step(params, state, ids,
                         jnp.asarray(values, jnp.float32))
  np.testing.assert_allclose(params['table'], model.p, rtol=3e-5, atol=1e-6)
