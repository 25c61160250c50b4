"""IdTable's CPU kernel: the same policy as the XLA path, bit for bit.

Hypothesis draws id streams (64-bit ids, duplicates, repeated and skipped
steps, invalid words); each call runs `assign` through the kernel and
through the XLA path from the same state, and every output and every leaf
of the new state must be equal (then both continue from their own state).
The kernel's slots, fresh slots and counters are also compared with
`id_table_reference`'s plain-Python model. The kernel must be what a CPU
step runs, and no part of a step exported for GPU or TPU.
"""

import functools
import os

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from id_table_reference import IdTableModel
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax
from lazy_optax._src import cpu_kernels
from lazy_optax._src import id_kernels
from lazy_optax._src import id_words

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    'id_kernel_ci', max_examples=6, derandomize=True, deadline=None,
    database=None, suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile(
    'id_kernel_dev', max_examples=200, deadline=None,
    suppress_health_check=_HEALTH, print_blob=True)
SETTINGS = settings.get_profile(
    'id_kernel_' + os.environ.get('LAZY_OPTAX_HYPOTHESIS_PROFILE', 'ci'))

# name -> (IdTable arguments, ids per call)
CONFIGS = {
    'lru': (dict(capacity=24, probe=4, eviction='lru'), 12),
    # (No sketch as narrow as the table, test_id_table.py's 'narrow_sketch':
    # a width is a number that both paths read alike, as in 'admit'.)
    'lfu': (dict(capacity=24, probe=4, eviction='lfu', lfu_period=3), 12),
    'none': (dict(capacity=20, probe=3, eviction='none'), 12),
    'admit': (dict(capacity=24, probe=4, eviction='lru', admit_after=2,
                   sketch_width=16, lfu_period=2), 12),
    'lru_always': (dict(capacity=24, probe=4, eviction='lru',
                        admission='always', eviction_log=5), 12),
    'none_admit': (dict(capacity=20, probe=3, eviction='none',
                        admit_after=2, eviction_log=0), 12),
    # One window for all ids: claims collide over several rounds.
    'crowded': (dict(capacity=16, probe=16, eviction='lru', rounds=3,
                     seed=7), 40),
    'lfu_rounds': (dict(capacity=30, probe=3, eviction='lfu', admit_after=3,
                        lfu_period=2, rounds=2, sketch_depth=3), 12),
}


def setup_module():
  status = cpu_kernels.ensure_loaded()
  assert status.loaded, f'the CPU kernels did not load: {status.detail}'


@functools.cache
def _compiled(name):
  """The table; the kernel's assign and find and XLA's, each jitted alone.

  The kernel's are `id_kernels`' calls themselves: `table._assign` would
  trace XLA's path twice more (its shapes, and the branch for other
  platforms) in a program that runs the kernel on the CPU (that a CPU step
  runs the kernel: test_a_cpu_step_runs_the_kernel_and_accelerators_do_not).
  """
  cfg, _ = CONFIGS[name]
  table = lazy_optax.IdTable(**cfg)

  def kernel(state, words, now):
    slots, state, fresh, room = id_kernels.assign(table, state, words, now)
    return slots, state, lazy_optax.FreshRows(fresh, words), room

  return (table, jax.jit(kernel), jax.jit(table._assign_xla),
          jax.jit(functools.partial(id_kernels.find, table)),
          jax.jit(table._find_xla))


def _streams(n):
  pool = st.lists(st.integers(0, 2 ** 63 - 1), min_size=4, max_size=60,
                  unique=True)
  steps = st.lists(
      st.tuples(st.integers(0, 3),
                st.lists(st.integers(0, 10 ** 6), min_size=n, max_size=n),
                st.integers(0, 2)),
      min_size=5, max_size=16)
  return st.tuples(pool, steps)


def _fresh_map(table, fresh):
  slots, words = np.asarray(fresh.slots), np.asarray(fresh.ids)
  keep = slots < table.capacity
  return dict(zip(slots[keep].tolist(),
                  id_words.join_words(words[keep]).tolist()))


def _assert_same(kernel_out, xla_out):
  k_leaves, k_tree = jax.tree.flatten(kernel_out)
  x_leaves, x_tree = jax.tree.flatten(xla_out)
  assert k_tree == x_tree
  for k, x in zip(k_leaves, x_leaves):
    assert k.dtype == x.dtype and k.shape == x.shape
    np.testing.assert_array_equal(np.asarray(k), np.asarray(x))


@pytest.mark.parametrize('name', sorted(CONFIGS))
@SETTINGS
@given(data=st.data())
def test_kernel_equals_the_xla_path_and_the_model(name, data):
  cfg, n = CONFIGS[name]
  pool, steps = data.draw(_streams(n))
  table, kernel, xla, find_k, find_x = _compiled(name)
  model = IdTableModel(**{k: v for k, v in cfg.items() if k != "eviction_log"})
  state = table.init()
  step = 0
  for gap, picks, invalid in steps:
    step += gap
    ids = np.array([pool[p % len(pool)] for p in picks], np.int64)
    words = np.array(lazy_optax.split_ids(ids))
    words[:invalid, 0] = np.uint32(2 ** 31 + 5)   # ids past 2**63 - 1
    now = np.int32(step)
    # Each path gets its own copy: the kernel updates its state in place.
    # (A host copy put back with device_put compiles nothing; jnp.copy
    # compiles a small program per leaf shape. One device_put of the whole
    # tree: one batched transfer, not one call per leaf.)
    want = xla(jax.device_put(jax.tree.map(np.array, state)), words, now)
    got = kernel(state, words, now)
    _assert_same(got, want)
    slots, state, fresh, _ = got
    model_ids = np.where(np.arange(n) < invalid, -1, ids)
    want_slots, want_fresh = model.assign(model_ids, step)
    np.testing.assert_array_equal(np.asarray(slots), want_slots)
    assert _fresh_map(table, fresh) == want_fresh
    stats = table.stats(state)
    assert {k: stats[k] for k in model.counters} == model.counters
    assert stats['live'] == model.live()
    assert not np.asarray(state.claims).any(), 'claim scratch not cleared'
    probe = np.array(lazy_optax.split_ids(np.concatenate(
        [ids[:4], np.array([pool[0] ^ 1, 2 ** 62 + step])])))
    _assert_same(find_k(state, probe), find_x(state, probe))


@pytest.mark.cpu_kernels
def test_a_cpu_step_runs_the_kernel_and_accelerators_do_not():
  table = lazy_optax.IdTable(capacity=1000, probe=8)
  state = table.init()
  words = jnp.zeros((64, 2), jnp.uint32)

  def step(state, words, now):
    slots, state, _ = table.assign(state, words, step=now)
    return slots, state, table.find(state, words)

  cpu = jax.jit(step).lower(state, words, jnp.int32(0)).as_text()
  assert 'LazyOptaxIdAssign' in cpu and 'LazyOptaxIdFind' in cpu
  for platform in ('cuda', 'tpu'):
    exported = jax.export.export(jax.jit(step), platforms=[platform])(
        state, words, jnp.int32(0))
    text = exported.mlir_module()
    assert 'LazyOptax' not in text and 'custom_call' not in text, platform


def test_tables_with_ttl_take_the_xla_path():
  table = lazy_optax.IdTable(capacity=100, probe=4, ttl=3)
  hlo = jax.jit(lambda s, w: table.assign(s, w, step=1)[0]).lower(
      table.init(), jnp.zeros((8, 2), jnp.uint32)).as_text()
  assert 'LazyOptaxIdAssign' not in hlo
  assert 'gather' in hlo   # the XLA path's probe windows


@pytest.mark.cpu_kernels
def test_donated_state_is_updated_in_place():
  capacity = 100_000
  table = lazy_optax.IdTable(capacity=capacity, probe=16)
  state = table.init()
  assign = jax.jit(lambda s, w, k: table.assign(s, w, step=k)[:2],
                   donate_argnums=0)
  words = lazy_optax.split_ids(np.arange(1, 513, dtype=np.int64) * 10 ** 9)
  compiled = assign.lower(state, words, jnp.int32(0)).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 4 * capacity, temp   # nothing table-sized is copied
  pointer = state.ids.unsafe_buffer_pointer()
  # The very program measured above runs (no second compile of the step).
  slots, state = compiled(state, words, jnp.int32(0))
  assert state.ids.unsafe_buffer_pointer() == pointer
  assert (np.asarray(slots) < capacity).all()
  assert table.stats(state)['live'] == 512
