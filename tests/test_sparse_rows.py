"""SparseRows: validation, deduplication, densification, addition."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax
from lazy_optax import SparseRows
from lazy_optax.tree import deduplicate


def test_to_dense_sums_duplicates():
  g = SparseRows(jnp.array([1, 3, 1]), jnp.arange(6.).reshape(3, 2), 4)
  np.testing.assert_array_equal(
      g.to_dense(), [[0, 0], [4, 6], [0, 0], [2, 3]])


def test_under_jit_out_of_range_ids_touch_nothing():
  table = jnp.arange(12.).reshape(4, 3)

  @jax.jit
  def add(ids):
    return table + SparseRows(ids, jnp.ones((3, 3)), 4)

  out = add(jnp.array([-1, 4, 2]))
  expected = np.asarray(table).copy()
  expected[2] += 1
  np.testing.assert_array_equal(out, expected)


def test_type_and_shape_errors():
  with pytest.raises(TypeError, match='integer'):
    SparseRows(jnp.array([0.0, 1.0]), jnp.ones((2, 3)), 4)
  with pytest.raises(ValueError, match='one row per id'):
    SparseRows(jnp.array([0, 1]), jnp.ones((3, 3)), 4)
  with pytest.raises(ValueError, match='vector'):
    SparseRows(jnp.array([[0, 1]]), jnp.ones((2, 3)), 4)
  with pytest.raises(TypeError, match='num_rows'):
    SparseRows(jnp.array([0]), jnp.ones((1, 3)), 4.0)


def test_deduplicate_static_slots():
  g = SparseRows(jnp.array([5, 2, 5, 5, 0]), jnp.arange(5.)[:, None], 6)
  u = jax.jit(deduplicate)(g)
  assert u.ids.shape == (5,)
  # Read back once; the checks run in numpy, not as eager device ops.
  u_ids, u_values = np.asarray(u.ids), np.asarray(u.values)
  got = {int(i): float(v[0]) for i, v in zip(u_ids, u_values) if i < 6}
  assert got == {0: 4.0, 2: 1.0, 5: 0.0 + 2.0 + 3.0}
  assert int(np.sum(u_ids == 6)) == 2
  assert float(np.abs(u_values[u_ids == 6]).sum()) == 0.0


def test_numpy_array_plus_sparse_rows():
  table = np.zeros((3, 2), np.float32)
  out = table + SparseRows(jnp.array([2]), jnp.ones((1, 2)), 3)
  np.testing.assert_array_equal(out, [[0, 0], [0, 0], [1, 1]])


def test_empty_batch_changes_nothing():
  table = jnp.ones((3, 2))
  g = SparseRows(jnp.zeros((0,), jnp.int32), jnp.zeros((0, 2)), 3)
  np.testing.assert_array_equal(table + g, table)
  assert g.to_dense().shape == (3, 2)


def test_only_sparse_rows_touches_its_private_parts():
  # One owner of the form of a row-sparse gradient: no other module builds
  # one from private constructors or reads its private fields.
  root = pathlib.Path(lazy_optax.__file__).parent
  private = re.compile(r'SparseRows\._\w+|\._(ids|code|made|fill|'
                       r'with_values|from_code|set)\b')
  offenders = [
      f'{path.relative_to(root)}:{i}: {line.strip()}'
      for path in sorted(root.rglob('*.py'))
      if path.name != 'sparse_rows.py'
      for i, line in enumerate(path.read_text().splitlines(), 1)
      if private.search(line)]
  assert not offenders, offenders


def test_sparse_rows_holds_distinct_ids_from_construction():
  # Static shapes: N slots, distinct ids ascending, then num_rows and zeros;
  # the dense array it stands for is the sum of the rows given.
  rng = np.random.default_rng(3)
  ids = rng.integers(0, 6, 40)
  values = rng.normal(size=(40, 2)).astype(np.float32)
  g = SparseRows(jnp.asarray(ids), jnp.asarray(values), 6)
  want = np.zeros((6, 2), np.float64)
  np.add.at(want, ids, values.astype(np.float64))
  distinct = np.unique(ids)
  # Read back once; the checks run in numpy, not as eager device ops.
  g_ids, g_values = np.asarray(g.ids), np.asarray(g.values)
  np.testing.assert_array_equal(
      g_ids, np.concatenate([distinct, np.full(40 - distinct.size, 6)]))
  np.testing.assert_allclose(g_values[:distinct.size], want[distinct],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(g_values[distinct.size:], 0)
  # Flattening does no work but encoding: the leaves read back as they are.
  # (Flattened eagerly, as a jitted call does; rebuilt and decoded in one
  # program, not op by op.)
  code, leaf_values = jax.tree.leaves(g)
  np.testing.assert_array_equal(leaf_values, g_values)
  treedef = jax.tree.structure(g)
  np.testing.assert_array_equal(
      jax.jit(lambda c, v: jax.tree.unflatten(treedef, [c, v]).ids)(
          code, leaf_values),
      g_ids)


@pytest.mark.parametrize('ids', [
    [3, 1, 3, 0, 5, 1],            # in range (5 = num_rows names no row)
    [3, -1, 9, 1, -7, 3],          # out-of-range ids among them
    [-1, 6, 7, -2, 100, -5],       # all out of range
    [2, 2, 2, 2, 2, 6],
])
def test_out_of_range_ids_are_kept_alike_with_and_without_a_branch(ids):
  """The CPU keeps out-of-range ids under `lax.cond`; GPU and TPU always run
  the same writes (they drop when there is nothing to keep). Both give the
  reference's slots: distinct ids ascending, then the out-of-range ids in
  batch order, then `num_rows`."""
  import branch_versions
  from lazy_optax._src import distinct

  num_rows = 5
  ids = np.asarray(ids, np.int32)
  values = np.arange(ids.size * 2, dtype=np.float32).reshape(-1, 2)
  outside = (ids < 0) | (ids > num_rows)
  named = np.unique(ids[~outside & (ids < num_rows)])
  want = np.concatenate([named, ids[outside],
                         np.full(ids.size - named.size - outside.sum(),
                                 num_rows)])
  raw = distinct._from_ids.__wrapped__   # untraced: traced anew below
  got = {}
  for branch_free in (False, True):
    with branch_versions.forced(branch_free):
      # The program inspected is the one run (lowered and compiled once).
      lowered = jax.jit(lambda i, v: raw(i, v, num_rows, False)).lower(
          ids, values)
      text = lowered.as_text()
      got[branch_free] = lowered.compile()(ids, values)
    assert ('stablehlo.case' in text) != branch_free, text
    np.testing.assert_array_equal(got[branch_free][0], want)
  for a, b in zip(got[False], got[True]):
    np.testing.assert_array_equal(a, b)
  # The two versions called directly, on the deduplicated ids.
  for fn in (distinct.keep_out_of_range_skipping,
             distinct.keep_out_of_range_branch_free):
    out = jax.jit(fn, static_argnums=3)(
        np.concatenate([named, np.full(ids.size - named.size, num_rows)]
                       ).astype(np.int32), ids, outside, num_rows)
    np.testing.assert_array_equal(out, want)
