"""advise_huge_pages: values kept, huge pages where the kernel gives them."""

import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np

import lazy_optax
from lazy_optax._src import huge_pages

MiB = 2**20


def _thp_mode():
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      return re.search(r'\[(\w+)\]', f.read()).group(1)
  except OSError:
    return None


def _collapse_expected():
  """Linux >= 6.1 with transparent huge pages not `never`."""
  if not platform.system() == 'Linux' or _thp_mode() in (None, 'never'):
    return False
  major, minor = (int(x) for x in
                  re.match(r'(\d+)\.(\d+)', platform.release()).groups())
  return (major, minor) >= (6, 1)


def _huge_kib_around(address):
  """AnonHugePages (KiB) of the mapping of this process holding `address`."""
  with open(f'/proc/{os.getpid()}/smaps') as f:
    text = f.read()
  inside = False
  for line in text.splitlines():
    m = re.match(r'^([0-9a-f]+)-([0-9a-f]+) ', line)
    if m:
      inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
    elif inside and line.startswith('AnonHugePages:'):
      return int(line.split()[1])
  raise AssertionError(f'no mapping holds address {address:#x}')


def test_values_unchanged_and_pages_huge():
  rng = np.random.default_rng(0)
  host = rng.normal(size=(200_000, 16)).astype(np.float32)  # 12.2 MiB
  table = jnp.array(host)
  n = lazy_optax.perf.advise_huge_pages({'table': table})
  np.testing.assert_array_equal(np.asarray(table), host)
  if not _collapse_expected():
    assert n == 0
    return
  # Whole 2 MiB pages inside the buffer: at least 4 of the 6.1 possible.
  assert n % huge_pages.HUGE_PAGE_BYTES == 0
  assert 4 * huge_pages.HUGE_PAGE_BYTES <= n <= table.nbytes
  assert _huge_kib_around(table.unsafe_buffer_pointer() + table.nbytes // 2
                          ) * 1024 >= n


def test_small_arrays_tracers_and_deleted_arrays_are_left_alone():
  small = jnp.ones((1000, 16))
  assert lazy_optax.perf.advise_huge_pages([small, 3.0, None]) == 0
  big = jnp.ones((300_000, 16))
  assert lazy_optax.perf.advise_huge_pages(big, min_bytes=big.nbytes + 1) == 0

  @jax.jit
  def f(x):
    assert lazy_optax.perf.advise_huge_pages(x) == 0
    return x + 1

  np.testing.assert_array_equal(f(small), small + 1)
  big.delete()
  assert lazy_optax.perf.advise_huge_pages(big) == 0


def test_donated_lazy_adam_step_keeps_the_advised_buffers():
  # The advice belongs to the memory: a donated step must update the same
  # buffers in place, and the training must match a table left on 4 KiB
  # pages exactly (the pages hold the same numbers).
  v, d = 100_000, 32  # 12.2 MiB tables
  init = jnp.asarray(
      np.random.default_rng(1).normal(size=(v, d)).astype(np.float32))
  tx = lazy_optax.lazy_adam(1e-2)

  def step(params, state, ids, vals):
    grads = {'t': lazy_optax.SparseRows(ids, vals, v)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  runs = []
  for advise in (True, False):
    params = {'t': init + 0}
    state = tx.init(params)
    if advise:
      lazy_optax.perf.advise_huge_pages((params, state))
    pointers = [params['t'].unsafe_buffer_pointer(),
                state[0].mu['t'].unsafe_buffer_pointer()]
    rng = np.random.default_rng(2)
    for _ in range(5):
      ids = jnp.asarray(rng.integers(0, v, 64), jnp.int32)
      vals = jnp.asarray(rng.normal(size=(64, d)).astype(np.float32))
      params, state = step(params, state, ids, vals)
    assert [params['t'].unsafe_buffer_pointer(),
            state[0].mu['t'].unsafe_buffer_pointer()] == pointers
    runs.append(np.asarray(params['t']))
  np.testing.assert_array_equal(runs[0], runs[1])
  assert not np.array_equal(runs[0], np.asarray(init))


def test_elsewhere_it_does_nothing(monkeypatch):
  monkeypatch.setattr(huge_pages.sys, 'platform', 'darwin')
  huge_pages._madvise.cache_clear()
  try:
    assert lazy_optax.perf.advise_huge_pages(jnp.ones((300_000, 16))) == 0
  finally:
    monkeypatch.undo()
    huge_pages._madvise.cache_clear()
