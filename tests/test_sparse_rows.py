"""SparseRows: validation, deduplication, densification, addition."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax
from lazy_optax import SparseRows
from lazy_optax._src import id_code
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
  # (`self._fused` and `self._backend` of other classes are their own.)
  private = re.compile(r'SparseRows\._\w+|\._(ids|code|made|fill|'
                       r'with_values|from_code|set)\b'
                       r'|(?<!self)\._(backend|fused|aux)\b')
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
  """Where ids and positions pack into one sort key, one sort keeps the
  out-of-range ids, with no conditional; elsewhere the CPU keeps them under
  `lax.cond`, and GPU and TPU always run the same writes (they drop when
  there is nothing to keep). Each gives the reference's slots: distinct ids
  ascending, then the out-of-range ids in batch order, then `num_rows`,
  with the named ids' values summed and zeros elsewhere."""
  import branch_versions
  from lazy_optax._src import dedup
  from lazy_optax._src import distinct

  ids = np.asarray(ids, np.int32)
  values = np.arange(ids.size * 2, dtype=np.float32).reshape(-1, 2)
  raw = distinct.from_ids   # packed keys below: its program has no branch
  num_rows = 5
  outside = (ids < 0) | (ids > num_rows)
  named = np.unique(ids[~outside & (ids < num_rows)])
  want = np.concatenate([named, ids[outside],
                         np.full(ids.size - named.size - outside.sum(),
                                 num_rows)])
  sums = np.zeros_like(values)
  for k, i in enumerate(named):
    sums[k] = values[ids == i].sum(0)
  packed = dedup.keeps_outside(num_rows, ids.size, ids.dtype)
  assert packed and not dedup.keeps_outside(2 ** 30, ids.size, ids.dtype)
  got = {}
  for branch_free in (False, True):
    with branch_versions.forced(branch_free):
      # The program inspected is the one run (lowered and compiled once).
      lowered = jax.jit(lambda i, v, n=num_rows: raw(i, v, n)).lower(
          ids, values)
      text = lowered.as_text()
      got[branch_free] = lowered.compile()(ids, values)
    assert ('stablehlo.case' in text) == (not packed and not branch_free)
    np.testing.assert_array_equal(got[branch_free][0], want)
    np.testing.assert_array_equal(got[branch_free][1], sums)
  # The two versions called directly, on the deduplicated ids.
  for fn in (distinct.keep_out_of_range_skipping,
             distinct.keep_out_of_range_branch_free):
    out = jax.jit(fn, static_argnums=3)(
        np.concatenate([named, np.full(ids.size - named.size, num_rows)]
                       ).astype(np.int32), ids, outside, num_rows)
    np.testing.assert_array_equal(out, want)


def test_tables_of_every_size_share_one_deduplication_program():
  """Ids that fit packed keys are deduplicated with the row count as data:
  building a `SparseRows` for a table of another size compiles nothing
  new, and the ids and sums are those of its own size."""
  compiled = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      compiled.append(event)

  ids = jnp.asarray([3, 1, 3, 0, 7, 1], jnp.int32)
  values = jnp.arange(12, dtype=jnp.float32).reshape(6, 2)
  SparseRows(ids, values, 40)   # compiles what a first table compiles
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    built = {n: SparseRows(ids, values, n) for n in (8, 57, 300)}
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiled, compiled
  v = np.asarray(values)
  for n, g in built.items():
    np.testing.assert_array_equal(g.ids, [0, 1, 3, 7, n, n])
    np.testing.assert_array_equal(
        g.values, [v[3], v[1] + v[5], v[0] + v[2], v[4], 0 * v[0],
                   0 * v[0]])


# -- the id code: NumPy for concrete arrays, jax.numpy for tracers ----------

def _codes_to_read(ids):
  """Intact, scaled, damaged and empty codes of `ids` (float32, `[N, C]`)."""
  rng = np.random.default_rng(len(ids))
  code = np.asarray(jax.jit(id_code.encode)(ids))   # the traced path
  n, width = code.shape
  other = np.roll(code, 1, axis=0)
  noisy = code * (1 + rng.normal(size=code.shape) * 1e-3)
  mixed = code.copy()
  if n:
    mixed[::3] = 0                                    # empty entries
    mixed[1::5, 2] = np.nan
    mixed[2::7, 0] = np.inf
    mixed[3::4] = rng.normal(size=mixed[3::4].shape) * 2.0 ** -50
  cases = [code, 3.0 * code, -0.5 * code, code * 2.0 ** -70,  # subnormal
           code * 2.0 ** -90, code + other, (code + other) / 2, noisy,
           code.astype(jnp.bfloat16).astype(np.float32), mixed,
           rng.normal(size=(n, width)), np.zeros((n, width))]
  return [np.asarray(c, np.float32) for c in cases]


def _same_bits_both_ways(id_dtype, ids):
  ids = np.asarray(ids, id_dtype)
  eager = np.asarray(id_code.encode(jnp.asarray(ids)))
  traced = np.asarray(jax.jit(id_code.encode)(jnp.asarray(ids)))
  assert eager.shape == (ids.size, id_code.code_width(id_dtype))
  np.testing.assert_array_equal(eager.view(np.uint32), traced.view(np.uint32))
  read = jax.jit(id_code.decode, static_argnums=1)
  for code in _codes_to_read(jnp.asarray(ids)):
    host = id_code.decode(jnp.asarray(code), id_dtype)
    device = read(jnp.asarray(code), id_dtype)
    for a, b in zip(host, device):
      assert np.asarray(a).dtype == np.asarray(b).dtype
      np.testing.assert_array_equal(a, b)
  # An intact code reads back every id (the reference: the ids themselves).
  back = id_code.decode(jnp.asarray(eager), id_dtype)
  np.testing.assert_array_equal(back.ids, ids)
  assert np.all(np.asarray(back.intact)) and not np.any(np.asarray(back.empty))


@pytest.mark.parametrize('n', [0, 1, 61])
def test_concrete_and_traced_id_codes_have_the_same_bits(n):
  rng = np.random.default_rng(n)
  edges = np.array([0, 1, -1, 2 ** 31 - 1, -2 ** 31, 65535, 65536])
  ids = np.concatenate([edges, rng.integers(-2 ** 31, 2 ** 31, 64)])[:n]
  _same_bits_both_ways(np.int32, ids)
  with jax.enable_x64(True):
    edges = np.array([2 ** 63 - 1, -2 ** 63, 2 ** 32 + 3, 2 ** 48, -5])
    ids = np.concatenate([edges, rng.integers(-2 ** 63, 2 ** 63 - 1, 64)])
    _same_bits_both_ways(np.int64, ids[:n])


def test_a_concrete_sparse_rows_flattens_and_reads_its_ids_without_xla():
  # Shapes no other test uses: an op-by-op program would compile here.
  # Host arrays (committed to the CPU on a GPU machine too): ids on an
  # accelerator are encoded by XLA, by design.
  host = jax.devices('cpu')[0]
  g = SparseRows(jax.device_put(jnp.arange(29) % 23, host),
                 jax.device_put(jnp.ones((29, 3)), host), 1009)
  scaled = jnp.asarray(2.0 ** -80, jnp.float32)   # flushes every code entry
  compiles = []

  def count(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    code, values = jax.tree.leaves(g)
    rebuilt = jax.tree.unflatten(jax.tree.structure(g), [code, values])
    ids, safe = rebuilt.ids, rebuilt.safe_ids()
    rebuilt.check()
    assert jax.tree.leaves(g)[0] is code     # encoded once, then kept
    seen = len(compiles)
    jax.jit(lambda c: c * 0.25)(scaled)      # the count can see a compile
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
  assert seen == 0 and len(compiles) >= 1, compiles
  want = np.concatenate([np.arange(23), np.full(6, 1009)])
  np.testing.assert_array_equal(ids, want)
  np.testing.assert_array_equal(safe, want)
  assert isinstance(code, jax.Array) and code.dtype == jnp.float32


def test_a_code_encoded_in_a_trace_is_not_kept():
  g = SparseRows(jnp.array([4, 1]), jnp.ones((2, 2)), 6)
  # Flattened first inside a trace (a closed-over gradient): that code
  # belongs to the trace, and the gradient keeps none of it.
  out = jax.jit(lambda x: x + jax.tree.leaves(g)[0].sum())(jnp.float32(0))
  code = jax.tree.leaves(g)[0]
  assert not isinstance(code, jax.core.Tracer)
  np.testing.assert_allclose(out, np.asarray(code).sum(), rtol=1e-6)
  # A kept code donated to a jitted call is encoded again when read.
  jax.jit(lambda c: c * 2, donate_argnums=0)(code)
  np.testing.assert_array_equal(jax.tree.leaves(g)[0],
                                jax.jit(id_code.encode)(g.ids))


# -- duplicates summed where a gradient is built ------------------------------

_V, _D = 7, 3
_PADDING = 2
# Repeated ids, ids outside [0, _V) (negative, _V itself, beyond), and the
# padding id of the lookups below.
_BATCH = np.array([3, -1, 9, 1, 3, _V, 2, 2, 0, 3, 12, 1, 5, 3], np.int32)
_IN_RANGE = np.array([3, 1, 2, 3, 6, 0, 3, 2, 1, 5, 0, 0], np.int32)


def _segment_sum(ids, values, skip=()):
  """float64 NumPy reference: the table-shaped sum of the rows of `values`
  whose ids lie in [0, _V) (and are not in `skip`), and those ids."""
  named = (ids >= 0) & (ids < _V) & ~np.isin(ids, skip)
  dense = np.zeros((_V, _D), np.float64)
  np.add.at(dense, ids[named], values[named].astype(np.float64))
  return dense, np.unique(ids[named])


def _check_summed(g, dense, distinct):
  """`g` names each in-range id once, with the reference's summed row, and
  its other slots write no row."""
  assert isinstance(g, SparseRows) and g.num_rows == _V
  g_ids, g_values = np.asarray(g.ids), np.asarray(g.values)
  named = (g_ids >= 0) & (g_ids < _V)
  np.testing.assert_array_equal(np.sort(g_ids[named]), distinct)
  np.testing.assert_allclose(g_values[named], dense[g_ids[named]],
                             rtol=1e-6, atol=1e-6)
  table = np.random.default_rng(9).normal(size=(_V, _D)).astype(np.float32)
  np.testing.assert_allclose(jax.jit(lambda t, g: t + g)(table, g),
                             table + dense, rtol=1e-6, atol=1e-6)


def _rows(n, seed):
  return np.random.default_rng(seed).normal(size=(n, _D)).astype(np.float32)


@pytest.mark.parametrize('jit', [False, True])
def test_sparse_rows_sums_duplicates_when_built(jit):
  # Eagerly an out-of-range id is a ValueError (test_type_and_shape_errors'
  # neighbours): the eager batch holds in-range ids only.
  ids = _BATCH if jit else _IN_RANGE
  values = _rows(ids.size, 0)
  build = lambda i, v: SparseRows(i, v, _V)
  g = (jax.jit(build) if jit else build)(jnp.asarray(ids), jnp.asarray(values))
  assert g.ids.shape == (ids.size,)
  _check_summed(g, *_segment_sum(ids, values))


@pytest.mark.parametrize('form', ['concatenate', 'plus'])
def test_concatenate_sums_duplicates_across_parts(form):
  # Ids repeated within each part and across the parts, ids outside the
  # table in each; the parts are built under jit (eagerly those are errors).
  parts_ids = [_BATCH[:8], _BATCH[8:], _IN_RANGE]
  parts_values = [_rows(i.size, s) for s, i in enumerate(parts_ids, 1)]

  @jax.jit
  def combine(ids, values):
    parts = [SparseRows(i, v, _V) for i, v in zip(ids, values)]
    if form == 'concatenate':
      return SparseRows.concatenate(parts)
    return parts[0] + parts[1] + parts[2]

  g = combine(parts_ids, parts_values)
  assert g.ids.shape == (sum(i.size for i in parts_ids),)
  _check_summed(g, *_segment_sum(np.concatenate(parts_ids),
                                 np.concatenate(parts_values)))


@pytest.mark.parametrize('jit', [False, True])
def test_value_and_grad_sums_duplicates_once_per_id(jit):
  # loss = sum(rows * W) + sum(rows**2) / 2: a looked-up slot's gradient is
  # W[b] + table[id_b]; a padding slot, or an id outside the table, none.
  ids = _BATCH if jit else _IN_RANGE
  table = np.random.default_rng(5).normal(size=(_V, _D)).astype(np.float32)
  weights = _rows(ids.size, 6)

  def loss(params, ids):
    rows = lazy_optax.lookup(params['table'], ids, padding_id=_PADDING)
    return jnp.sum(rows * weights) + 0.5 * jnp.sum(rows ** 2)

  f = lazy_optax.value_and_grad(loss)
  if jit:
    f = jax.jit(f)
  _, grads = f({'table': jnp.asarray(table)}, jnp.asarray(ids))
  named = (ids >= 0) & (ids < _V)
  per_slot = weights.astype(np.float64)
  per_slot[named] += table[ids[named]]
  _check_summed(grads['table'], *_segment_sum(ids, per_slot, skip=[_PADDING]))


# -- no hidden state: what a SparseRows carries is in its pytree -------------

def _round_trip(g):
  leaves, treedef = jax.tree_util.tree_flatten(g)
  return jax.tree_util.tree_unflatten(treedef, leaves), treedef


def _slots(x):
  return {name: getattr(x, name) for name in type(x).__slots__}


def test_a_gradient_carries_no_backend():
  # Nothing in a SparseRows says how a step moves its rows (lazy decides
  # that): impl= is deprecated and changes nothing, not even the tree
  # structure, so a jit cache has nothing to tell apart.
  ids, values = jnp.array([3, 1, 3]), jnp.ones((3, 2))
  auto = SparseRows(ids, values, 5)
  with pytest.warns(DeprecationWarning, match=r"SparseRows\(impl='xla'\)"):
    xla = SparseRows(ids, values, 5, impl='xla')
  with pytest.warns(DeprecationWarning, match='SparseRows.impl'):
    assert auto.impl == 'xla'
  assert jax.tree.structure(auto) == jax.tree.structure(xla)
  np.testing.assert_array_equal(auto.code, xla.code)
  np.testing.assert_array_equal(auto.values, xla.values)
  assert jax.tree.structure(auto) != jax.tree.structure(
      SparseRows(jnp.array([0]), jnp.zeros((1, 2)), 6))
  with pytest.raises(ValueError, match='impl must be one of'):
    SparseRows(ids, values, 5, impl='c++')


def test_round_trip_keeps_everything_it_carries():
  table = jnp.zeros((5, 2))
  for g in (SparseRows(jnp.array([3, 1, 3]), jnp.arange(6.).reshape(3, 2), 5),
            0.5 * SparseRows(jnp.array([4]), jnp.ones((1, 2)), 5)):
    back, treedef = _round_trip(g)
    assert jax.tree.structure(back) == treedef
    assert back.num_rows == g.num_rows
    np.testing.assert_array_equal(back.code, g.code)
    np.testing.assert_array_equal(back.ids, g.ids)
    np.testing.assert_array_equal(back.values, g.values)
    np.testing.assert_array_equal(table + back, table + g)


def test_lazy_update_has_its_gradients_structure():
  # A lax.cond between the gradient's zeros and the update
  # (optax.apply_if_finite) needs one tree structure.
  params = {'t': jnp.zeros((6, 2))}
  tx = optax.apply_if_finite(lazy_optax.lazy_adam(0.1), 2)
  g = {'t': SparseRows(jnp.array([1, 4]), jnp.ones((2, 2)), 6)}
  updates, _ = jax.jit(tx.update)(g, tx.init(params), params)
  assert jax.tree.structure(updates) == jax.tree.structure(g)
  np.testing.assert_array_equal(updates['t'].ids, [1, 4])


def test_reading_changes_nothing():
  for g in (SparseRows(jnp.array([2, 0]), jnp.ones((2, 3)), 4),
            _round_trip(SparseRows(jnp.array([2]), jnp.ones((1, 3)), 4))[0]):
    before = _slots(g), _slots(g._ids)
    _ = g.code, g.ids, g.decoded(), jax.tree.leaves(g), repr(g), g.to_dense()
    jax.jit(lambda g: g.ids)(g)
    after = _slots(g), _slots(g._ids)
    for old, new in zip(before, after):
      assert old.keys() == new.keys()
      assert all(old[k] is new[k] for k in old), (old, new)
    with pytest.raises(AttributeError):
      g._ids.leaf = None
