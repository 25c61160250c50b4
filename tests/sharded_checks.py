"""Checks on row-sharded tables, on 8 simulated CPU devices.

Run by the tests in the 8-device process of tests/eight_devices.py (XLA_FLAGS
must name the device count before jax is imported), through `run_checks`,
or as a script:

    python3 tests/sharded_checks.py MODE [DIR]

MODE is one of
  conformance  every optimizer of tests/optimizer_cases.py (CASES): the
               sharded step equals the one-device step and the float64
               model, keeps its shardings (Auto and Explicit meshes), and
               resumes bit for bit from a sharded orbax checkpoint. Prints
               one JSON object with a result (or the error) per optimizer.
  duplicates   an id sent by both data shards is summed before the update.
  traffic      per device and step, what the compiled program stores
               (memory analysis) and sends (the collectives in its HLO).
  stochastic   stochastic rounding gives the same bits as on one device.

Each mode prints one JSON line (and raises on a failed check, except
`conformance`, which reports each optimizer's failure in its JSON).
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      ' --xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import re
import sys
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import optimizer_cases  # pylint: disable=g-import-not-at-top
from reference import TFLazyAdam  # pylint: disable=g-import-not-at-top

import lazy_optax  # pylint: disable=g-import-not-at-top

D = 3          # row size in the equivalence checks
DATA, ROWS = 2, 4
NUM_ROWS, STEPS, N_IDS = 64, 6, 16


def run_checks(mode, directory=''):
  """Runs one mode on 8 CPU devices (tests/eight_devices.py); its result."""
  import eight_devices  # pylint: disable=g-import-not-at-top
  return eight_devices.call('sharded_checks', 'run_mode', mode,
                            str(directory))


def make_mesh(axis_type=AxisType.Auto):
  assert len(jax.devices()) == 8, jax.devices()
  return jax.make_mesh((DATA, ROWS), ('data', 'rows'),
                       axis_types=(axis_type, axis_type))


def train_step(tx, num_rows):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows),
             'w': jnp.sum(values, axis=0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


def batches(rng, num_rows, steps, n_ids):
  """Ids with duplicates inside a data shard and across the two shards."""
  half = n_ids // DATA
  for _ in range(steps):
    ids = rng.integers(0, num_rows, n_ids)
    ids[1] = ids[0]            # duplicate inside shard 0
    ids[half] = ids[0]         # the same id on shard 1
    ids[half + 2] = ids[3]     # another id on both shards
    yield ids.astype(np.int32), rng.normal(size=(n_ids, D)).astype(np.float32)


def shardings_of(tree):
  """(type-level spec, concrete sharding, ndim) of each leaf."""
  return [(jax.typeof(x).sharding.spec, x.sharding, x.ndim)
          for x in jax.tree.leaves(tree)]


def assert_same_shardings(before, after):
  assert len(before) == len(after)
  for (t0, s0, ndim), (t1, s1, _) in zip(before, after):
    assert t0 == t1, (t0, t1)
    # P() and P(None,) are the same placement of a vector.
    assert s0.is_equivalent_to(s1, ndim), (s0, s1)


def _put_batch(mesh, ids, values):
  return (jax.device_put(ids, NamedSharding(mesh, P('data'))),
          jax.device_put(values, NamedSharding(mesh, P('data', None))))


# The one-device run of each case, which both mesh types are compared with
# (the same table and batches): trained once per process.
_ONE_DEVICE = {}


def _one_device_run(case, table, data):
  """`case` trained on `table` and `data` on one device: (params, state)."""
  if case.name in _ONE_DEVICE:
    return _ONE_DEVICE[case.name]
  tx = case.make()
  dev0 = jax.devices()[0]
  params1 = jax.device_put({'table': table, 'w': np.zeros(D, np.float32)},
                           dev0)
  # The state on that device too, as the step's outputs are: every step
  # sees the same placements (one program, compiled once).
  state1 = jax.device_put(tx.init(params1), dev0)
  step1 = jax.jit(train_step(tx, NUM_ROWS))
  for ids, values in data:
    params1, state1 = step1(params1, state1, jax.device_put(ids, dev0),
                            jax.device_put(values, dev0))
  _ONE_DEVICE[case.name] = params1, state1
  return params1, state1


def check_optimizer(case, axis_type, directory):
  """Sharded == one device == float64 model; shardings kept; orbax resume."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  slots = [s.name for s in case.slots]
  rng = np.random.default_rng(0)
  table = (case.table_scale * rng.normal(size=(NUM_ROWS, D))).astype(
      np.float32)
  data = list(batches(rng, NUM_ROWS, STEPS, N_IDS))

  params1, state1 = _one_device_run(case, table, data)

  # Eight devices: table rows over 'rows', batch over 'data'.
  mesh = make_mesh(axis_type)
  row_sharded = NamedSharding(mesh, P('rows', None))

  def fresh():
    return {'table': jax.device_put(table, row_sharded),
            'w': jax.device_put(np.zeros(D, np.float32),
                                NamedSharding(mesh, P()))}

  tx = case.make()
  step = jax.jit(train_step(tx, NUM_ROWS), donate_argnums=(0, 1))

  def go(params, state, part, keep_shardings=False):
    before = shardings_of((params, state))
    for ids, values in part:
      params, state = step(params, state, *_put_batch(mesh, ids, values))
      if keep_shardings:
        assert_same_shardings(before, shardings_of((params, state)))
    return params, state

  params = fresh()
  state = lazy_optax.sharding.init_sharded(tx, params)
  for name in slots:
    leaf = lazy_optax.compat.get_slot(state, 'table', name)
    assert leaf.sharding.spec[0] == 'rows', (name, leaf.sharding)
  assert lazy_optax.compat.global_step(state).sharding.spec == P()
  params, state = go(params, state, data, keep_shardings=True)
  for name in slots:
    leaf = lazy_optax.compat.get_slot(state, 'table', name)
    assert leaf.sharding.spec[0] == 'rows', (name, leaf.sharding)
  # float32 reduction order differs between the layouts: a few ulps.
  for a, b in zip(jax.tree.leaves((params, state)),
                  jax.tree.leaves((params1, state1))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6,
                               atol=1e-7)
  model = case.reference(table)
  for ids, values in data:
    model.step(ids, values)
  optimizer_cases.assert_matches_model(case, params, state, model)
  if axis_type != AxisType.Auto:
    return {'steps': STEPS, 'slots': slots}

  # orbax: save after half the steps, restore into sharded targets, finish.
  half = STEPS // 2
  p, s = go(fresh(), lazy_optax.sharding.init_sharded(tx, fresh()),
            data[:half])
  path = os.path.join(directory,
                      'sharded_' + re.sub(r'\W', '_', case.name))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {'params': p, 'opt_state': s})
  del p, s
  params_abs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      fresh())
  state_abs = jax.tree.map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
      jax.eval_shape(tx.init, params_abs),
      lazy_optax.sharding.state_shardings(tx, params_abs))
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, {'params': params_abs,
                                    'opt_state': state_abs})
  for name in slots:
    leaf = lazy_optax.compat.get_slot(restored['opt_state'], 'table', name)
    assert leaf.sharding.spec[0] == 'rows', (name, leaf.sharding)
  assert restored['params']['table'].sharding.is_equivalent_to(row_sharded, 2)
  resumed = go(restored['params'], restored['opt_state'], data[half:])
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves((params, state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return {'steps': STEPS, 'slots': slots, 'resumed_after': half}


def check_conformance(directory):
  """Every case of optimizer_cases.CASES, on Auto and Explicit meshes."""
  out = {}
  for case in optimizer_cases.CASES:
    for axis_type in (AxisType.Auto, AxisType.Explicit):
      key = f'{case.name} {axis_type.name}'
      try:
        out[key] = check_optimizer(case, axis_type, directory)
      except Exception:  # pylint: disable=broad-except
        out[key] = {'error': traceback.format_exc()[-4000:]}
  return out


def check_cross_shard_duplicates(axis_type):
  """An id sent by both data shards is updated once, with the summed grad."""
  num_rows = 64
  mesh = make_mesh(axis_type)
  table = np.linspace(-1, 1, num_rows * D, dtype=np.float32).reshape(-1, D)
  params = {'table': jax.device_put(table, NamedSharding(mesh, P('rows'))),
            'w': jax.device_put(np.zeros(D, np.float32),
                                NamedSharding(mesh, P()))}
  tx = lazy_optax.lazy_adam(0.1)
  state = lazy_optax.sharding.init_sharded(tx, params)
  # Shard 0 holds ids [0..7], shard 1 holds [8..15]; id 41 is on both, with
  # gradients of opposite sign and different size, id 9 only on shard 0.
  ids = np.array([41, 9, 2, 3, 4, 5, 6, 7, 41, 10, 11, 12, 13, 14, 15, 16],
                 np.int32)
  values = np.zeros((16, D), np.float32)
  values[0] = [1.0, -2.0, 0.5]
  values[8] = [-3.0, 1.0, 0.5]
  values[1] = [0.25, 0.25, 0.25]
  ids_s = jax.device_put(ids, NamedSharding(mesh, P('data')))
  assert ids_s.addressable_shards[0].data.shape == (8,)
  params, state = jax.jit(train_step(tx, num_rows))(
      params, state, ids_s,
      jax.device_put(values, NamedSharding(mesh, P('data', None))))
  ref = TFLazyAdam(table, lr=0.1)
  ref.step(ids, values)
  np.testing.assert_allclose(np.asarray(params['table']), ref.p, rtol=1e-6,
                             atol=1e-7)
  # Summed first: the sign of row 41's update follows g0 + g1 = [-2, -1, 1].
  moved = np.sign(np.asarray(params['table'])[41] - table[41])
  np.testing.assert_array_equal(moved, [1.0, 1.0, -1.0])
  mu = np.asarray(optax.tree_utils.tree_get(state, 'mu')['table'])
  np.testing.assert_allclose(mu[41], 0.1 * (values[0] + values[8]), rtol=1e-6)
  return {}


def check_stochastic(directory):
  """Stochastic rounding gives the same bits on 8 devices as on one."""
  del directory
  num_rows, d = 64, 8
  rng = np.random.default_rng(1)
  table = (1 + rng.random((num_rows, d))).astype(jnp.bfloat16)
  ids = rng.permutation(num_rows)[:16].astype(np.int32)
  values = (1e-3 * rng.normal(size=(16, d))).astype(np.float32)
  dense = (1e-3 * rng.normal(size=(num_rows, d))).astype(np.float32)
  key = jax.random.key(7)

  def apply(params, ids, values, dense):
    updates = {'table': lazy_optax.SparseRows(ids, values, num_rows),
               'other': dense}
    return lazy_optax.precision.apply_updates_stochastic(
        params, updates, key=key, step=3)

  dev0 = jax.devices()[0]
  one = jax.jit(apply)(jax.device_put({'table': table, 'other': table}, dev0),
                       ids, values, dense)
  out = {}
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = make_mesh(axis_type)
    rows = NamedSharding(mesh, P('rows', None))
    params = {'table': jax.device_put(table, rows),
              'other': jax.device_put(table, rows)}
    many = jax.jit(apply, donate_argnums=0)(
        params, jax.device_put(ids, NamedSharding(mesh, P('data'))),
        jax.device_put(values, NamedSharding(mesh, P('data', None))),
        jax.device_put(dense, rows))
    for name in ('table', 'other'):
      np.testing.assert_array_equal(
          np.asarray(many[name]).view(np.uint16),
          np.asarray(one[name]).view(np.uint16))
      assert many[name].sharding.spec[0] == 'rows', many[name].sharding
    changed = int(np.sum(np.asarray(many['table'] != table).any(axis=1)))
    out[axis_type.name] = {'rows_changed': changed}
    assert changed <= 16
  return out


# -- what the compiled program sends and stores --------------------------------

_COLLECTIVES = ('all-gather', 'all-reduce', 'all-to-all',
                'collective-permute', 'reduce-scatter', 'collective-broadcast',
                'ragged-all-to-all')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2,
                'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8,
                'f64': 8}


def collectives(hlo_text):
  """[(kind, [shapes], bytes)] of every collective in an HLO module's text."""
  found = []
  pattern = re.compile(r'^\s*(?:ROOT )?%\S+ = (.+?) (' +
                       '|'.join(_COLLECTIVES) + r')(?:-start)?\(')
  for line in hlo_text.splitlines():
    m = pattern.match(line)
    if not m:
      continue
    shapes = re.findall(r'(\w+)\[([\d,]*)\]', m.group(1))
    total = 0
    for dtype, dims in shapes:
      size = int(np.prod([int(d) for d in dims.split(',') if d]))
      total += size * _DTYPE_BYTES[dtype]
    found.append((m.group(2), [f'{t}[{d}]' for t, d in shapes], total))
  return found


def compiled_step(axis_type, num_rows, n_ids, row_size=64):
  mesh = make_mesh(axis_type)
  table = jax.ShapeDtypeStruct((num_rows, row_size), jnp.float32,
                               sharding=NamedSharding(mesh, P('rows', None)))
  params = {'table': table,
            'w': jax.ShapeDtypeStruct((row_size,), jnp.float32,
                                      sharding=NamedSharding(mesh, P()))}
  tx = lazy_optax.lazy_adam(1e-3)
  shardings = lazy_optax.sharding.state_shardings(tx, params)
  state = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      jax.eval_shape(tx.init, params), shardings)
  ids = jax.ShapeDtypeStruct((n_ids,), jnp.int32,
                             sharding=NamedSharding(mesh, P('data')))
  values = jax.ShapeDtypeStruct((n_ids, row_size), jnp.float32,
                                sharding=NamedSharding(mesh, P('data', None)))
  step = jax.jit(train_step(tx, num_rows), donate_argnums=(0, 1))
  return step.lower(params, state, ids, values).compile()


def measure(axis_type, num_rows, n_ids):
  compiled = compiled_step(axis_type, num_rows, n_ids)
  mem = compiled.memory_analysis()
  colls = collectives(compiled.as_text())
  return {
      'num_rows': num_rows, 'ids': n_ids,
      'argument_bytes': int(mem.argument_size_in_bytes),
      'alias_bytes': int(mem.alias_size_in_bytes),
      'temp_bytes': int(mem.temp_size_in_bytes),
      'collective_bytes': sum(c[2] for c in colls),
      'collectives': [f'{k} {" ".join(s)}' for k, s, _ in colls],
  }


def check_traffic(axis_type):
  """Per-device traffic and temporaries follow the batch, not the table."""
  small, big = 1 << 14, 1 << 17    # rows: 16,384 and 131,072 (x 64 floats)
  rows = {}
  for num_rows in (small, big):
    for n_ids in (256, 1024):
      rows[(num_rows, n_ids)] = measure(axis_type, num_rows, n_ids)
  for n_ids in (256, 1024):
    a, b = rows[(small, n_ids)], rows[(big, n_ids)]
    assert a['collective_bytes'] == b['collective_bytes'], (a, b)
    assert a['temp_bytes'] == b['temp_bytes'], (a, b)
    assert a['collectives'] == b['collectives'], (a, b)
    # Stored per device: this device's rows of table, mu and nu (1/4 each).
    shard = 3 * (big - small) // ROWS * 64 * 4
    assert b['argument_bytes'] - a['argument_bytes'] == shard, (a, b)
    assert b['alias_bytes'] >= 3 * big // ROWS * 64 * 4, b  # donated
  for num_rows in (small, big):
    a, b = rows[(num_rows, 256)], rows[(num_rows, 1024)]
    assert 3.5 < b['collective_bytes'] / a['collective_bytes'] < 4.5, (a, b)
    # No collective carries a table-sized operand.
    for m in (a, b):
      assert m['collective_bytes'] < 64 * m['ids'] * 4 * 8, m
      for c in m['collectives']:
        assert str(num_rows) not in c and str(num_rows // ROWS) not in c, c
  return {f'{k[0]}x64 rows, {k[1]} ids': v for k, v in rows.items()}


def run_mode(mode, directory=''):
  """The result of one MODE (see the module's docstring)."""
  if mode == 'conformance':
    out = check_conformance(directory)
  elif mode == 'duplicates':
    out = {axis_type.name: check_cross_shard_duplicates(axis_type)
           for axis_type in (AxisType.Auto, AxisType.Explicit)}
  elif mode == 'traffic':
    out = {axis_type.name: check_traffic(axis_type)
           for axis_type in (AxisType.Auto, AxisType.Explicit)}
  elif mode == 'stochastic':
    out = check_stochastic(directory)
  else:
    raise ValueError(f'unknown mode {mode!r}')
  return out


def main(argv):
  print(json.dumps(run_mode(argv[1], argv[2] if len(argv) > 2 else '')))


if __name__ == '__main__':
  main(sys.argv)
