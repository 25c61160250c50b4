"""The deduplication core (`lazy_optax._src.dedup`) against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import off_the_cpu

from lazy_optax._src import backend as backend_lib
from lazy_optax._src import dedup
from lazy_optax._src.placement import Placement

_XLA = backend_lib.Backend('xla', 'test', False, Placement('one'))


def _dense(ids, values, num_rows):
  # As a dict of rows: the tables here may be too large to hold densely.
  out = {}
  for i, v in zip(np.asarray(ids), np.asarray(values, np.float64)):
    if i < num_rows:
      out[int(i)] = out.get(int(i), 0) + v
  return out


@pytest.mark.parametrize('method', ['auto', 'packed', 'search'])
@pytest.mark.parametrize('num_rows', [10, 2 ** 30])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('n', [1, 7, 64, 3000])
def test_unique_rows_matches_numpy(method, num_rows, dtype, n):
  # 'auto': the kernel where it runs; 'packed', 'search': XLA's ways.
  backend = None if method == 'auto' else _XLA
  rng = np.random.default_rng(n)
  # Entries equal to num_rows stand for ids that touch no row.
  ids = rng.integers(0, min(num_rows, 50), n)
  ids[::5] = num_rows
  ids[1::7] = rng.integers(0, num_rows, len(ids[1::7]))
  ids = jnp.asarray(ids, jnp.int32)
  values = jnp.asarray(rng.normal(size=(n, 3)), dtype)
  unique_ids, summed = jax.jit(
      lambda i, v: dedup.unique_rows(i, v, num_rows, backend, method=method))(
          ids, values)
  assert unique_ids.shape == (n,) and summed.shape == (n, 3)
  assert summed.dtype == dtype
  real = np.asarray(unique_ids) < num_rows
  assert len(set(np.asarray(unique_ids)[real])) == int(real.sum())
  assert np.all(np.asarray(unique_ids)[~real] == num_rows)
  assert not np.asarray(summed, np.float32)[~real].any()
  want = _dense(ids, np.asarray(values, np.float32), num_rows)
  got = _dense(unique_ids, np.asarray(summed, np.float32), num_rows)
  tol = 1e-6 if dtype == jnp.float32 else 2e-2
  if dtype == jnp.float32 and off_the_cpu(summed):
    # XLA's scatter-add on a GPU sums a row's duplicates in another order
    # than NumPy: ~60 float32 terms of O(1) round differently, by up to
    # ~60 * 2**-24 * 60 ~ 1e-5 (measured 8e-6). Tight on the CPU.
    tol = 2e-5
  assert sorted(got) == sorted(want)
  for i in want:
    np.testing.assert_allclose(got[i], want[i], rtol=tol, atol=tol)


def test_packed_keys_are_used_where_they_fit():
  assert dedup.packs(1_000_000, 4096, jnp.int32)
  assert not dedup.packs(1_048_576, 4096, jnp.int32)
  assert dedup.packs(2 ** 21 - 1, 2048, jnp.int32)
  assert not dedup.packs(10, 16, jnp.int64)


def test_unique_rows_empty_batch():
  ids, values = dedup.unique_rows(jnp.zeros((0,), jnp.int32),
                                  jnp.zeros((0, 2)), 5)
  assert ids.shape == (0,) and values.shape == (0, 2)


def _kept_outside_model(ids, values, num_rows):
  """`unique_rows_keeping_outside` in numpy: the named ids ascending with
  their sums, then each out-of-range id in batch order, then `num_rows`."""
  ids = np.asarray(ids)
  values = np.asarray(values, np.float64)
  named = sorted(set(int(i) for i in ids if 0 <= i < num_rows))
  outside = [int(i) for i in ids if i < 0 or i > num_rows]
  want_ids = named + outside + [num_rows] * (len(ids) - len(named)
                                              - len(outside))
  want_values = np.zeros_like(values)
  for k, i in enumerate(named):
    want_values[k] = values[ids == i].sum(axis=0)
  return np.asarray(want_ids), want_values


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_tables_deduplicated_together_match_numpy_and_one_by_one(dtype):
  # Three tables' ids in one program, each with its own row count: repeats,
  # ids equal to num_rows (no row), negative and too large ones.
  rng = np.random.default_rng(3)
  num_rows = (10, 1000, 77)
  n = 64
  ids = np.stack([rng.integers(-3, r + 4, n) for r in num_rows])
  ids[:, :8] = ids[:, 8:16]
  ids = jnp.asarray(ids, jnp.int32)
  values = jnp.asarray(rng.normal(size=(3, n, 2)), dtype)
  got_ids, got_values = dedup.unique_rows_keeping_outside_stacked(
      ids, values, num_rows)
  assert got_ids.shape == (3, n) and got_values.dtype == dtype
  for t, r in enumerate(num_rows):
    want_ids, want_values = _kept_outside_model(ids[t], values[t], r)
    np.testing.assert_array_equal(got_ids[t], want_ids)
    np.testing.assert_allclose(np.asarray(got_values[t], np.float64),
                               want_values, rtol=1e-2, atol=1e-2)
    one_ids, one_values = jax.jit(dedup.unique_rows_keeping_outside,
                                  static_argnums=2)(ids[t], values[t], r)
    np.testing.assert_array_equal(got_ids[t], one_ids)
    np.testing.assert_array_equal(got_values[t], one_values)
