"""Checks of lazy_adam on row-sharded tables, on 8 simulated CPU devices.

Run by tests/test_sharding.py and tests/test_checkpoint.py in a subprocess,
since XLA_FLAGS must be set before jax is imported:

    python3 tests/sharded_checks.py equivalence|traffic|checkpoint DIR

Each mode raises on a failed check and prints one JSON line of measurements.
`traffic` prints, per device and per step, what the compiled program stores
(memory analysis) and sends (the collectives in its HLO).
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      ' --xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lazy_optax  # pylint: disable=g-import-not-at-top
from reference import TFLazyAdam  # pylint: disable=g-import-not-at-top

D = 3          # row size in the equivalence checks
DATA, ROWS = 2, 4


def make_mesh(axis_type):
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


def check_equivalence(axis_type, tx_name):
  """Sharded step == one-device step == float64 model; shardings kept."""
  num_rows, steps, n_ids = 64, 6, 16
  rng = np.random.default_rng(0)
  table = rng.normal(size=(num_rows, D)).astype(np.float32)
  data = list(batches(rng, num_rows, steps, n_ids))
  make_tx = {
      'lazy_adam': lambda: lazy_optax.lazy_adam(0.05),
      'lazy(optax.adam)': lambda: lazy_optax.lazy(optax.adam(0.05)),
  }[tx_name]

  # One device.
  tx = make_tx()
  dev0 = jax.devices()[0]
  params1 = jax.device_put({'table': table, 'w': np.zeros(D, np.float32)},
                           dev0)
  state1 = tx.init(params1)
  step1 = jax.jit(train_step(tx, num_rows))
  for ids, values in data:
    params1, state1 = step1(params1, state1, jax.device_put(ids, dev0),
                            jax.device_put(values, dev0))

  # Eight devices: table rows over 'rows', batch over 'data'.
  mesh = make_mesh(axis_type)
  row_sharded = NamedSharding(mesh, P('rows', None))
  replicated = NamedSharding(mesh, P())
  params = {'table': jax.device_put(table, row_sharded),
            'w': jax.device_put(np.zeros(D, np.float32), replicated)}
  tx = make_tx()
  state = lazy_optax.sharding.init_sharded(tx, params)
  mu = optax.tree_utils.tree_get(state, 'mu')['table']
  assert mu.sharding == row_sharded, mu.sharding
  assert optax.tree_utils.tree_get(state, 'count').sharding == replicated
  before = shardings_of((params, state))
  step = jax.jit(train_step(tx, num_rows), donate_argnums=(0, 1))
  for ids, values in data:
    ids = jax.device_put(ids, NamedSharding(mesh, P('data')))
    values = jax.device_put(values, NamedSharding(mesh, P('data', None)))
    params, state = step(params, state, ids, values)
    assert_same_shardings(before, shardings_of((params, state)))

  # float32 reduction order differs between the layouts: a few ulps.
  for a, b in zip(jax.tree.leaves((params, state)),
                  jax.tree.leaves((params1, state1))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6,
                               atol=1e-7)

  if tx_name == 'lazy_adam':
    ref = TFLazyAdam(table, lr=0.05)
    for ids, values in data:
      ref.step(ids, values)
    np.testing.assert_allclose(np.asarray(params['table']), ref.p, rtol=2e-5,
                               atol=1e-6)
    nu = optax.tree_utils.tree_get(state, 'nu')['table']
    np.testing.assert_allclose(np.asarray(nu), ref.v, rtol=2e-5, atol=1e-9)
  return {'steps': steps, 'ids_per_step': n_ids}


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


def check_checkpoint(directory):
  """Save a sharded state with orbax, restore into eval_shape, continue."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  num_rows, steps, n_ids = 64, 6, 16
  rng = np.random.default_rng(3)
  table = rng.normal(size=(num_rows, D)).astype(np.float32)
  data = list(batches(rng, num_rows, steps, n_ids))
  mesh = make_mesh(AxisType.Auto)
  row_sharded = NamedSharding(mesh, P('rows', None))

  def fresh():
    return {'table': jax.device_put(table, row_sharded),
            'w': jax.device_put(np.zeros(D, np.float32),
                                NamedSharding(mesh, P()))}

  tx = lazy_optax.lazy_adam(0.05)
  step = jax.jit(train_step(tx, num_rows))

  def run(params, state, batch_list):
    for ids, values in batch_list:
      params, state = step(
          params, state, jax.device_put(ids, NamedSharding(mesh, P('data'))),
          jax.device_put(values, NamedSharding(mesh, P('data', None))))
    return params, state

  params0 = fresh()
  straight = run(params0, lazy_optax.sharding.init_sharded(tx, params0), data)

  params, state = run(fresh(), lazy_optax.sharding.init_sharded(tx, fresh()),
                      data[:3])
  path = os.path.join(directory, 'sharded')
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {'params': params, 'opt_state': state})
  del params, state

  # Restore into abstract targets carrying the shardings.
  params_abs = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      fresh())
  state_abs = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
      jax.eval_shape(tx.init, params_abs),
      lazy_optax.sharding.state_shardings(tx, params_abs))
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, {'params': params_abs,
                                    'opt_state': state_abs})
  params, state = restored['params'], restored['opt_state']
  mu = optax.tree_utils.tree_get(state, 'mu')['table']
  assert mu.sharding.is_equivalent_to(row_sharded, 2), mu.sharding
  assert params['table'].sharding.is_equivalent_to(row_sharded, 2)
  resumed = run(params, state, data[3:])
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return {'steps_before': 3, 'steps_after': steps - 3}


def main(argv):
  mode = argv[1]
  if mode == 'equivalence':
    out = {}
    configs = ((AxisType.Auto, ('lazy_adam', 'lazy(optax.adam)')),
               (AxisType.Explicit, ('lazy_adam',)))
    for axis_type, names in configs:
      for name in names:
        out[f'{axis_type.name} {name}'] = check_equivalence(axis_type, name)
      out[f'{axis_type.name} duplicates'] = check_cross_shard_duplicates(
          axis_type)
  elif mode == 'traffic':
    out = {axis_type.name: check_traffic(axis_type)
           for axis_type in (AxisType.Auto, AxisType.Explicit)}
  elif mode == 'checkpoint':
    out = check_checkpoint(argv[2])
  else:
    raise SystemExit(f'unknown mode {mode!r}')
  print(json.dumps(out))


if __name__ == '__main__':
  main(sys.argv)
