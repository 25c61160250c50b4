"""IdTable: the policy against a plain-Python model, and its invariants.

Hypothesis draws id streams (64-bit ids, duplicates, repeated and skipped
steps); every call of `assign` is compared with `id_table_reference`'s model
(slots, fresh slots, counters, live ids, `find`, `export_changes`), and the
invariants of the issue are checked on every state. One compiled `assign`
per table configuration keeps the run short.

Profiles: `LAZY_OPTAX_HYPOTHESIS_PROFILE=ci` (default: few derandomized
examples) or `dev` (many random ones).
"""

import functools
import json
import os
import re

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from id_table_reference import IdTableModel
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import branch_versions
import eight_devices
import lazy_optax
from lazy_optax._src import id_table
from lazy_optax._src import id_words

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    'id_table_ci', max_examples=5, derandomize=True, deadline=None,
    database=None, suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile(
    'id_table_dev', max_examples=200, deadline=None,
    suppress_health_check=_HEALTH, print_blob=True)
PROFILE = os.environ.get('LAZY_OPTAX_HYPOTHESIS_PROFILE', 'ci')
SETTINGS = settings.get_profile(f'id_table_{PROFILE}')

# name -> (IdTable arguments, ids per call)
CONFIGS = {
    'lru': (dict(capacity=24, probe=4, eviction='lru'), 12),
    # The sketch as narrow as the table (the default before).
    'narrow_sketch': (dict(capacity=24, probe=4, eviction='lru',
                           sketch_width=24), 12),
    'lfu': (dict(capacity=24, probe=4, eviction='lfu', lfu_period=3), 12),
    'none': (dict(capacity=20, probe=3, eviction='none'), 12),
    'ttl': (dict(capacity=24, probe=5, eviction='lru', ttl=3), 12),
    'admit': (dict(capacity=24, probe=4, eviction='lru', admit_after=2,
                   sketch_width=16), 12),
    # The eviction of any live victim, without the frequency guard.
    'lru_always': (dict(capacity=24, probe=4, eviction='lru',
                        admission='always'), 12),
    'lfu_always_ttl': (dict(capacity=24, probe=4, eviction='lfu',
                            admission='always', ttl=3, lfu_period=3), 12),
    # One window for all ids: claims collide, more than `few` ids are left
    # after the first round, so the later rounds take every row.
    'crowded': (dict(capacity=16, probe=16, eviction='lru', rounds=3), 64),
    'mixed': (dict(capacity=30, probe=3, eviction='lfu', ttl=2,
                   admit_after=3, lfu_period=2, rounds=2), 12),
}
LOG = 4096
# One small table and batch shape for the eager tests: one compiled assign.
T8 = lazy_optax.IdTable(capacity=8, probe=4, eviction='lru', eviction_log=3,
                        admission='always')


@functools.cache
def _compiled(name):
  """The table, a jitted assign and a jitted find. The model tests call
  `table.assign` itself (eagerly: the library's own jitted program for the
  table and batch shape, which the branch test below shares for 'mixed');
  the jitted assign takes steps that go back (clamped under jit)."""
  cfg, _ = CONFIGS[name]
  table = lazy_optax.IdTable(eviction_log=LOG, **cfg)
  assign = jax.jit(lambda s, w, step: table.assign(s, w, step=step))
  find = jax.jit(table.find)
  return table, assign, find


def _streams(n):
  pool = st.lists(st.integers(0, 2 ** 63 - 1), min_size=4, max_size=70,
                  unique=True)
  steps = st.lists(
      st.tuples(st.integers(0, 3),
                st.lists(st.integers(0, 10 ** 6), min_size=n, max_size=n)),
      min_size=5, max_size=20)
  return st.tuples(pool, steps, st.integers(0, 2 ** 31))


def _fresh_map(table, fresh):
  slots = np.asarray(fresh.slots)
  words = np.asarray(fresh.ids)
  keep = slots < table.capacity
  out = dict(zip(slots[keep].tolist(),
                 id_words.join_words(words[keep]).tolist()))
  assert len(out) == int(keep.sum()), 'a fresh slot listed twice'
  return out


def _live(table, state):
  """Live (slot, id) pairs from a scan of the state."""
  ids = np.asarray(state.ids)
  seen = np.asarray(state.last_seen)
  step = int(state.step)
  alive = ids[:, 0] != id_words.EMPTY_WORD
  if table.ttl is not None:
    alive &= seen >= step - table.ttl
  slots = np.flatnonzero(alive)
  return slots, id_words.join_words(ids[slots])


def _check_invariants(table, state):
  slots, ids = _live(table, state)
  assert len(set(ids.tolist())) == len(ids), 'two slots hold one live id'
  assert len(ids) <= table.capacity
  assert int(state.live) == len(ids)
  assert not np.asarray(state.claims).any(), 'claim scratch not cleared'
  return dict(zip(ids.tolist(), slots.tolist()))


@pytest.mark.parametrize('name', sorted(CONFIGS))
@SETTINGS
@given(data=st.data())
def test_assign_follows_the_model(name, data):
  cfg, n = CONFIGS[name]
  pool, steps, seed = data.draw(_streams(n))
  table, _, find = _compiled(name)
  model = IdTableModel(**cfg)
  rng = np.random.default_rng(seed)
  state, step = table.init(), 0
  for gap, picks in steps:
    step += gap
    ids = np.array([pool[p % len(pool)] for p in picks], np.int64)
    slots, state, fresh = table.assign(state, lazy_optax.split_ids(ids),
                                       step=step)
    want, want_fresh = model.assign(ids, step)
    np.testing.assert_array_equal(np.asarray(slots), want)
    assert _fresh_map(table, fresh) == want_fresh
    stats = table.stats(state)
    assert {k: stats[k] for k in model.counters} == model.counters
    assert stats['live'] == model.live()
    live = _check_invariants(table, state)
    # Every id that got a slot holds it now; the rest are absent.
    for x, s in zip(ids.tolist(), np.asarray(slots).tolist()):
      assert (live.get(x) == s) if s < table.capacity else (x not in live)
    probe_ids = np.concatenate([ids[:3], rng.integers(0, 2 ** 62, 3)])
    np.testing.assert_array_equal(
        np.asarray(find(state, lazy_optax.split_ids(probe_ids))),
        [model.find(int(x)) for x in probe_ids])
    since = int(rng.integers(0, step + 2))
    changed_ids, changed_slots, evicted = table.export_changes(
        state, since_step=since)
    want_changed, want_evicted = model.export(since)
    assert dict(zip(changed_slots.tolist(), changed_ids.tolist())) == (
        want_changed)
    assert evicted.tolist() == want_evicted


@functools.cache
def _xla_assigns(name):
  """XLA's assign traced twice: with the skipping `lax.cond`s (the CPU's
  lowering) and with the branch-free versions (GPU's and TPU's).

  Under `ttl` the CPU runs XLA's path (no kernel): the skipping version is
  then the library's own jitted assign, the program that `table.assign`
  runs in test_assign_follows_the_model (the same program: jax compiles it
  once per process and the call reuses it)."""
  cfg, n = CONFIGS[name]
  table = lazy_optax.IdTable(eviction_log=LOG, **cfg)
  args = (table.init(), jnp.zeros((n, 2), jnp.uint32), jnp.int32(0))
  out = {}
  for branch_free in (False, True):
    if table.ttl is not None and not branch_free:
      lowered = id_table._assign_jit.lower(table, *args)
      compiled = lowered.compile()
      out[branch_free] = (lambda *a, c=compiled: c(*a),
                          lowered.as_text().count('stablehlo.case'))
      continue
    with branch_versions.forced(branch_free):
      fn = jax.jit(lambda s, w, now: table._assign_xla(s, w, now))
      lowered = fn.lower(*args)
    out[branch_free] = (lowered.compile(),
                        lowered.as_text().count('stablehlo.case'))
  return table, out


# The configurations whose assign takes the branches in question: the
# sketch's halving ('lfu', 'mixed') and later claim rounds that take every
# row ('crowded', 'mixed'); each costs two compiles of the XLA path.
BRANCH_CONFIGS = ('crowded', 'lfu', 'mixed')


@pytest.mark.parametrize('name', BRANCH_CONFIGS)
@SETTINGS
@given(data=st.data())
def test_branch_free_assign_equals_the_skipping_one_and_the_model(name, data):
  """The claim rounds and the sketch's halving skip work under `lax.cond` on
  the CPU only; elsewhere they run branch-free. From the same state, both
  give every output and state leaf bit for bit, and the model's slots."""
  cfg, n = CONFIGS[name]
  pool, steps, _ = data.draw(_streams(n))
  table, versions = _xla_assigns(name)
  (skipping, conds), (branch_free, no_conds) = versions[False], versions[True]
  assert conds > 0 and no_conds == 0, (conds, no_conds)
  model = IdTableModel(**cfg)
  state, step = table.init(), 0
  for gap, picks in steps:
    step += gap
    ids = np.array([pool[p % len(pool)] for p in picks], np.int64)
    words, now = lazy_optax.split_ids(ids), jnp.int32(step)
    want = skipping(state, words, now)
    got = branch_free(state, words, now)
    want_leaves, want_tree = jax.tree.flatten(want)
    got_leaves, got_tree = jax.tree.flatten(got)
    assert want_tree == got_tree
    for w, g in zip(want_leaves, got_leaves):
      assert w.dtype == g.dtype
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    slots, state, fresh, _ = got
    want_slots, want_fresh = model.assign(ids, step)
    np.testing.assert_array_equal(np.asarray(slots), want_slots)
    assert _fresh_map(table, fresh) == want_fresh
    stats = table.stats(state)
    assert {k: stats[k] for k in model.counters} == model.counters
    _check_invariants(table, state)


_SCATTER = re.compile(
    r'"stablehlo\.scatter"\(.*?\^bb0\((%\w+): [^,]*, (%\w+): [^)]*\):'
    r'(.*?)stablehlo\.return (%\w+)', re.S)
_COMBINE = re.compile(r'^\s*(%\w+) = stablehlo\.(\w+) (%\w+), (%\w+)')


def _scatter_combiners(text):
  """How each scatter of a StableHLO program combines: 'replace', an
  associative op's name, or the body's text when it is neither."""
  kinds = []
  for old, new, body, result in _SCATTER.findall(text):
    lines = [ln for ln in body.splitlines() if ln.strip()]
    match = _COMBINE.match(lines[0]) if len(lines) == 1 else None
    if not lines and result == new:
      kinds.append('replace')
    elif (match and match.group(1) == result
          and {match.group(3), match.group(4)} == {old, new}
          and match.group(2) in ('add', 'minimum', 'maximum', 'or', 'and')):
      kinds.append(match.group(2))
    else:
      kinds.append(body.strip())
  return kinds


@pytest.mark.parametrize('name', ['admit', 'mixed', 'lfu_always_ttl'])
def test_every_scatter_of_xla_assign_combines_associatively(name):
  """Batches repeat ids, so the scatters of XLA's assign meet repeated
  cells. A deterministic GPU scatter (`--xla_gpu_deterministic_ops`)
  combines a cell's updates first and applies the result once: a body
  that is not an associative op of its two arguments (or a plain
  replacement) then counts differently from the CPU, as a saturating
  increment once did for the admission sketch."""
  cfg, n = CONFIGS[name]
  table = lazy_optax.IdTable(eviction_log=LOG, **cfg)
  fn = jax.jit(lambda s, w, now: table._assign_xla(s, w, now))
  text = fn.lower(table.init(), jnp.zeros((n, 2), jnp.uint32),
                  jnp.int32(0)).as_text()
  kinds = _scatter_combiners(text)
  assert len(kinds) == text.count('"stablehlo.scatter"') > 0
  odd = [k for k in kinds if k not in ('replace', 'add', 'minimum',
                                       'maximum', 'or', 'and')]
  assert not odd, odd



@SETTINGS
@given(data=st.data())
def test_batch_order_and_duplicates_do_not_change_the_mapping(data):
  cfg, n = CONFIGS['crowded']
  table, _, _ = _compiled('crowded')
  pool, steps, seed = data.draw(_streams(n))
  rng = np.random.default_rng(seed)
  a = b = lazy_optax.IdTable(eviction_log=LOG, **cfg).init()
  for k, (_, picks) in enumerate(steps):
    ids = np.array([pool[p % len(pool)] for p in picks], np.int64)
    ids[-1] = ids[0]                       # a duplicate, at least
    perm = rng.permutation(ids)
    slots_a, a, _ = table.assign(a, lazy_optax.split_ids(ids), step=k)
    slots_b, b, _ = table.assign(b, lazy_optax.split_ids(perm), step=k)
    map_a = dict(zip(ids.tolist(), np.asarray(slots_a).tolist()))
    map_b = dict(zip(perm.tolist(), np.asarray(slots_b).tolist()))
    assert {x: map_a[x] for x in map_b} == map_b
    # The same table afterwards (the eviction log's order may differ).
    for field in ('ids', 'last_seen', 'step', 'live'):
      np.testing.assert_array_equal(np.asarray(getattr(a, field)),
                                    np.asarray(getattr(b, field)))


@SETTINGS
@given(data=st.data())
def test_an_id_seen_every_step_keeps_its_slot(data):
  cfg, n = CONFIGS['lru']
  table, assign, _ = _compiled('lru')
  pool, steps, _ = data.draw(_streams(n))
  hot = 0          # the smallest id wins every claim: a slot at step 0
  state, slot = table.init(), None
  for k, (gap, picks) in enumerate(steps):
    ids = np.array([hot] + [pool[p % len(pool)] for p in picks[1:]],
                   np.int64)
    slots, state, _ = assign(state, lazy_optax.split_ids(ids), k * 2 + gap)
    first = int(np.asarray(slots)[0])
    assert first < cfg['capacity']
    assert slot is None or first == slot
    slot = first


def test_find_never_inserts_or_moves_anything():
  table, _, find = _compiled('ttl')
  ids = np.array([5, 6, 7, 8] * 3, np.int64)
  _, state, _ = table.assign(table.init(), lazy_optax.split_ids(ids), step=0)
  before = jax.tree.map(np.asarray, state)
  # Six probes (the three twice), the shape the model test's find runs.
  slots = find(state, lazy_optax.split_ids(np.array([5, 9, 2 ** 60] * 2)))
  assert int(slots[1]) == int(slots[2]) == table.capacity
  np.testing.assert_array_equal(slots[:3], slots[3:])
  after = jax.tree.map(np.asarray, state)
  jax.tree.map(np.testing.assert_array_equal, before, after)
  # find is read-only even under ttl: an id past its ttl reads as absent.
  _, state, _ = table.assign(state, lazy_optax.split_ids(np.array([9] * 12)),
                             step=4)
  assert int(find(state, lazy_optax.split_ids(np.array([5] * 6)))[0]) == (
      table.capacity)


def test_concrete_int32_and_int64_ids_give_the_same_slots():
  table = T8
  ids = np.array([3, 70000, 3, 12], np.int64)
  a = table.assign(table.init(), ids, step=0)[0]
  b = table.assign(table.init(), ids.astype(np.int32), step=0)[0]
  c = table.assign(table.init(), jnp.asarray(ids, jnp.int32), step=0)[0]
  d = table.assign(table.init(), lazy_optax.split_ids(ids), step=0)[0]
  for x in (b, c, d):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(x))


def test_slots_keep_the_ids_shape_and_default_step_advances():
  table = T8
  ids = np.arange(4, dtype=np.int64).reshape(2, 2) * 10 ** 15
  slots, state, fresh = table.assign(table.init(), ids)
  assert slots.shape == (2, 2) and int(state.step) == 0
  assert fresh.slots.shape == (4,) and fresh.ids.shape == (4, 2)
  _, state, _ = table.assign(state, ids)
  assert int(state.step) == 1


def test_eviction_log_overflow_is_refused_not_guessed():
  table = T8                                       # a ring of 3 evictions
  state = table.init()
  for k in range(4):
    _, state, _ = table.assign(state, np.arange(4 * k, 4 * k + 4), step=k)
  assert table.stats(state)['evictions'] > 3
  with pytest.raises(ValueError, match='eviction_log'):
    table.export_changes(state, since_step=1)
  # A window with no evictions yet is exact.
  changed, _, evicted = table.export_changes(state, since_step=4)
  assert changed.tolist() == evicted.tolist() == []


def test_counters_do_not_wrap_around():
  table = T8
  state = table.init()
  near = np.array([0, 2 ** 32 - 3], np.uint32)
  state = state._replace(counters=state.counters._replace(admissions=near))
  _, state, _ = table.assign(state, np.arange(4), step=0)
  assert table.stats(state)['admissions'] == 2 ** 32 + 1


def test_checked_mode_reports_a_full_table():
  table = lazy_optax.IdTable(capacity=4, probe=4, eviction='none',
                             checked=True)
  step = jax.jit(lambda s, ids, k: table.assign(s, ids, step=k,
                                                ids_are_32bit=True))
  # Ids 0-3 fill the table; a batch of 6 (0 and 1 repeated) as below, so
  # one program runs both calls.
  # NumPy ids put with device_put: no copy program compiled for them.
  slots, state, _ = lazy_optax.checks.checked(step)(
      table.init(), jax.device_put(np.arange(6, dtype=np.int32) % 4), 0)
  assert int(state.live) == 4
  with pytest.raises(lazy_optax.checks.CheckError, match='4 looked-up ids got no'
                     ' row') as e:
    lazy_optax.checks.checked(step)(
        state, jax.device_put(np.arange(2, 8, dtype=np.int32)), 1)
  slots, state, _ = e.value.outputs
  # The full table was not corrupted: the old ids keep their slots.
  np.testing.assert_array_equal(np.asarray(slots)[:2],
                                np.asarray(table.find(state, np.arange(2, 4))))
  assert (np.asarray(slots)[2:] == 4).all() and int(state.live) == 4


def test_traced_invalid_ids_get_no_row_and_change_nothing():
  # T8 and batches of 4 ids, as the eager tests above: the inner assign's
  # trace for that table and shape is reused (5 repeated, to make 4).
  table = T8
  assign = jax.jit(lambda s, ids: table.assign(s, ids, step=0,
                                                ids_are_32bit=True))
  slots, state, fresh = assign(
      table.init(), jax.device_put(np.array([-3, 5, -1, 5], np.int32)))
  slots = np.asarray(slots).tolist()
  assert slots[0::2] == [8, 8] and slots[1] == slots[3] < 8
  assert int(state.live) == 1
  assert int((np.asarray(fresh.slots) < 8).sum()) == 1
  # A high word past 2**31 - 1 (an id past 2**63 - 1): no row; the valid
  # ids (7 twice) get one.
  words = jax.device_put(np.array([[2 ** 31, 0], [0, 7], [2 ** 31 + 5, 7],
                                   [0, 7]], np.uint32))
  slots = jax.jit(lambda s, w: table.assign(s, w, step=1)[0])(state, words)
  slots = np.asarray(slots).tolist()
  assert slots[0] == slots[2] == 8 and slots[1] == slots[3] < 8


def test_split_ids_round_trips_64_bit_ids():
  ids = np.array([0, 1, 2 ** 31, 2 ** 32 + 5, 2 ** 63 - 1], np.int64)
  words = lazy_optax.split_ids(ids)
  assert words.dtype == np.uint32 and words.shape == (5, 2)
  np.testing.assert_array_equal(id_words.join_words(words), ids)
  np.testing.assert_array_equal(lazy_optax.split_ids([5, 2 ** 40]),
                                lazy_optax.split_ids(np.array([5, 2 ** 40])))
  from_jax = lazy_optax.split_ids(jnp.array([7, 9], jnp.int32))
  np.testing.assert_array_equal(np.asarray(from_jax), [[0, 7], [0, 9]])
  traced = jax.jit(lambda i: lazy_optax.split_ids(i, ids_are_32bit=True))(
      jnp.array([-1, 3], jnp.int32))
  assert int(traced[0, 0]) == id_words.EMPTY_WORD   # invalid: no slot


@pytest.mark.parametrize('bad, error, match', [
    (np.array([3, -2], np.int64), ValueError, 'got -2 at flat position 1'),
    ([1, -1], ValueError, 'raw_ids must lie in'),
    (np.array([1.0, 2.0]), TypeError, 'integer dtype, got float64'),
    (jnp.array([1.5]), TypeError, 'integer dtype'),
    (np.array([True]), TypeError, r'booleans \(dtype bool\)'),
    (np.array([2 ** 63], np.uint64), ValueError, r'\[0, 2\*\*63 - 1\]'),
    (np.array([1, 2, 3], np.uint32), ValueError, 'last dimension of 2'),
    (np.array([[2 ** 31, 1]], np.uint32), ValueError, 'high word'),
    ([2 ** 70], ValueError, 'outside 64 bits'),
])
def test_bad_raw_ids_are_refused_with_a_clear_error(bad, error, match):
  table = lazy_optax.IdTable(capacity=8, probe=4)
  with pytest.raises(error, match=match):
    table.assign(table.init(), bad, step=0)
  with pytest.raises(error, match=match):
    table.find(table.init(), bad)


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(capacity=0), ValueError, r'capacity must lie in \[1, 2147483646\]'),
    (dict(capacity=2 ** 31), ValueError, 'capacity must lie in'),
    (dict(capacity=10.0), TypeError, 'capacity must be a Python int'),
    (dict(capacity=8, probe=9), ValueError,
     r'probe \(with capacity=8\) must lie in \[1, 8\]'),
    (dict(capacity=8, probe=0), ValueError, 'probe'),
    (dict(capacity=8, eviction='fifo'), ValueError, 'eviction must be one'),
    (dict(capacity=8, ttl=-1), ValueError, 'ttl must lie in'),
    (dict(capacity=8, admit_after=0), ValueError, 'admit_after'),
    (dict(capacity=8, checked=1), TypeError, 'checked must be a bool'),
])
def test_bad_table_arguments(kwargs, error, match):
  kwargs.setdefault('probe', 4)
  with pytest.raises(error, match=match):
    lazy_optax.IdTable(**kwargs)


def test_bad_steps_and_states():
  table = T8
  _, state, _ = table.assign(table.init(), np.arange(4), step=5)
  with pytest.raises(ValueError, match='step 4 is before the state'):
    table.assign(state, np.arange(4), step=4)
  with pytest.raises(ValueError, match='step must lie in'):
    table.assign(table.init(), np.array([1]), step=-1)
  with pytest.raises(TypeError, match='step must be an integer'):
    table.assign(table.init(), np.array([1]), step=1.5)
  other = lazy_optax.IdTable(capacity=16, probe=4, eviction_log=3).init()
  with pytest.raises(ValueError, match='state.ids has uint32'):
    table.assign(other, np.array([1]), step=0)
  with pytest.raises(TypeError, match='IdTableState'):
    table.find({'ids': 1}, np.array([1]))
  with pytest.raises(TypeError, match='IdTableState'):
    table.export_changes({'ids': 1}, since_step=0)
  with pytest.raises(TypeError, match='since_step must be an int'):
    table.export_changes(table.init(), since_step=1.0)


def test_sharded_over_8_devices_equals_one_device():
  # Auto axes: the whole hashed train step; Explicit axes: assign,
  # reset_rows and the lazy update. Same slots, counters and id state as on
  # one device, parameters to float32 rounding, shardings kept. The check
  # (id_table_sharded_checks.main) runs in a fresh 8-device process: a
  # forked child of tests/eight_devices.py's server, which imported jax
  # once for every such check (a failed check raises here, with its
  # traceback).
  _, printed = eight_devices.call('id_table_sharded_checks', 'main',
                                  with_stdout=True)
  out = json.loads(printed.strip().splitlines()[-1])
  assert set(out) == {str(jax.sharding.AxisType.Auto),
                      str(jax.sharding.AxisType.Explicit)}, out
  for run in out.values():
    # Victims were met (evicted, or kept by the frequency guard), ids expired.
    stats = run['stats']
    assert stats['evictions'] + stats['declined'] > 0, stats
    assert stats['expirations'] > 0, stats


def test_every_python_block_of_the_guide_runs_in_order():
  guide = os.path.join(os.path.dirname(__file__), '..', 'docs',
                       'hashed_ids.md')
  with open(guide) as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  assert len(blocks) == 3      # the train step, Equinox's, serving
  namespace = {}
  for i, code in enumerate(blocks):
    exec(compile(code, f'hashed_ids.md[block {i}]', 'exec'), namespace)
  # The Equinox step ran 5 steps and was traced (so compiled) once.
  assert namespace['traces'] == 1
  assert namespace['item_ids'].stats(namespace['item_state'])['live'] == 320
  stats = namespace['table_ids'].stats(namespace['id_state'])
  # Ids that never recur: once windows fill, newcomers are declined (the
  # frequency guard) or find their window taken at this step.
  assert stats['admissions'] + stats['declined'] + stats['overflows'] == (
      20 * 64)
  assert stats['declined'] > 0 and stats['admissions'] > stats['live'] / 2
  assert stats['live'] + stats['evictions'] == stats['admissions']
  assert 0 < len(namespace['changed_ids']) <= 10 * 64


def test_the_default_keeps_recurring_ids_instead_of_thrashing():
  # A closed catalogue (every id recurs) at half the table's capacity:
  # without the frequency guard every newcomer evicts someone.
  rng = np.random.default_rng(0)
  ids = rng.choice(2 ** 62, 400, replace=False).astype(np.int64)
  p = np.arange(1, 401) ** -0.8
  stream = ids[rng.choice(400, (300, 64), p=p / p.sum())]
  words = lazy_optax.split_ids(stream)
  seen, counts = np.unique(stream, return_counts=True)
  hot = seen[np.argsort(-counts, kind='stable')[:50]]   # counted in NumPy
  default = lazy_optax.IdTable(capacity=200)
  assert (default.eviction, default.admission) == ('lfu', 'frequency')
  tables = {
      'default': default,
      'lfu_always': lazy_optax.IdTable(capacity=200, admission='always'),
      'lru_always': lazy_optax.IdTable(capacity=200, eviction='lru',
                                       admission='always'),
  }
  out = {}
  for name, table in tables.items():
    assign = jax.jit(lambda s, w, k, t=table: t.assign(s, w, step=k))
    state = table.init()
    for k in range(len(stream)):
      _, state, _ = assign(state, words[k], k)
    out[name] = table.stats(state)
    out[name]['hot'] = float(np.mean(
        np.asarray(table.find(state, hot)) < 200))
  for unguarded in ('lfu_always', 'lru_always'):
    assert out['default']['evictions'] * 10 < out[unguarded]['evictions']
    assert out[unguarded]['declined'] == 0
  assert out['default']['declined'] > 0
  assert out['default']['hot'] >= 0.9


def test_the_default_sketch_is_wide_and_keeps_more_of_a_heavy_tail():
  # Zipf(1.1) over 20,000 ids: ~2,800 distinct ids for 100 slots. A sketch
  # as narrow as the table (the default before) counts them with many
  # collisions, so the guard lets fewer of the ids that recur in.
  rng = np.random.default_rng(0)
  ranks = np.minimum(rng.zipf(1.1, (300, 64)), 20_000) - 1
  stream = ranks.astype(np.int64) * 7919 + 10 ** 12
  held = np.minimum(np.random.default_rng(99).zipf(1.1, 2000), 20_000) - 1
  held = held.astype(np.int64) * 7919 + 10 ** 12
  hit = {}
  for name, kwargs in (('wide', {}), ('narrow', dict(sketch_width=100))):
    table = lazy_optax.IdTable(capacity=100, probe=16, eviction_log=0,
                               **kwargs)
    model = IdTableModel(capacity=100, probe=16, **kwargs)
    assign = jax.jit(lambda s, w, k, t=table: t.assign(s, w, step=k))
    state = table.init()
    for k in range(len(stream)):
      slots, state, _ = assign(state, lazy_optax.split_ids(stream[k]), k)
      want, _ = model.assign(stream[k], k)
      np.testing.assert_array_equal(np.asarray(slots), want, err_msg=name)
    assert table.stats(state)['declined'] == model.counters['declined'] > 0
    hit[name] = float(np.mean(np.asarray(table.find(state, held)) < 100))
  assert lazy_optax.IdTable(capacity=100).init().sketch.shape == (2, 1600)
  assert hit['wide'] > hit['narrow'] + 0.02, hit


def test_a_state_with_the_narrow_sketch_of_before_is_named():
  old = lazy_optax.IdTable(capacity=8, sketch_width=8).init()
  with pytest.raises(ValueError, match=r'state\.sketch.*sketch_width=8'):
    lazy_optax.IdTable(capacity=8).assign(old, np.array([1, 2]), step=0)
  slots, _, _ = lazy_optax.IdTable(capacity=8, sketch_width=8).assign(
      old, np.array([1, 2]), step=0)
  assert (np.asarray(slots) < 8).all()


def test_a_state_of_the_lru_default_of_before_is_named():
  old = lazy_optax.IdTable(capacity=8, eviction='lru').init()
  assert old.counts is None
  with pytest.raises(ValueError,
                     match=r"state\.counts is None.*pass eviction='lru'"):
    lazy_optax.IdTable(capacity=8).assign(old, np.array([1, 2]), step=0)
  slots, _, _ = lazy_optax.IdTable(capacity=8, eviction='lru').assign(
      old, np.array([1, 2]), step=0)
  assert (np.asarray(slots) < 8).all()


def test_checked_table_outside_checked_names_the_fix():
  table = lazy_optax.IdTable(capacity=4, probe=4, eviction='none',
                             checked=True)
  step = jax.jit(lambda s, ids: table.assign(s, ids, step=0,
                                             ids_are_32bit=True))
  with pytest.raises(ValueError) as e:
    step(table.init(), jax.device_put(np.arange(2, dtype=np.int32)))
  first = str(e.value).splitlines()[0]
  assert first.startswith('IdTable(checked=True) records checks that only a '
                          'checked step can run')
  assert 'lazy_optax.checks.checked(jax.jit(step))' in first
  assert 'lazy_optax.perf.make_train_step(step)' in first
  assert 'drop checked=True' in first


def test_checked_table_in_make_train_step_keeps_its_state():
  table = lazy_optax.IdTable(capacity=4, probe=4, eviction='none',
                             checked=True)

  def assign(state, ids, k):
    slots, state, _ = table.assign(state, ids, step=k, ids_are_32bit=True)
    return state, slots

  step = lazy_optax.perf.make_train_step(assign, donate_argnums=0)
  state, _ = step(table.init(), jax.device_put(np.arange(4, dtype=np.int32)),
                  0)
  before = jax.tree.map(lambda x: np.array(x, copy=True), state)
  with pytest.raises(lazy_optax.checks.CheckError,
                     match='^IdTable: 2 looked-up ids got no row') as e:
    step(state, jax.device_put(np.arange(2, 6, dtype=np.int32)), 1)
  kept, _ = e.value.outputs   # the table as it was before the step
  jax.tree.map(np.testing.assert_array_equal, kept, before)
