"""The memory-lean optimizers on row-sharded tables, 8 simulated CPU devices.

Run in a subprocess (XLA_FLAGS must name the device count before jax is
imported) by the tests, through `run_checks`:

    python3 tests/lean_sharded_checks.py MODE DIR

with MODE one of rowwise_adagrad, partial_rowwise_adam, ftrl, stochastic.

Each mode raises on a failed check and prints one JSON line.
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      ' --xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lean_reference  # pylint: disable=g-import-not-at-top

import lazy_optax  # pylint: disable=g-import-not-at-top

D = 3
NUM_ROWS, STEPS, N_IDS = 64, 6, 16

_MAKERS = {
    'rowwise_adagrad': (
        lambda: lazy_optax.rowwise_adagrad(0.1),
        lambda t: lean_reference.RowwiseAdagrad(t, lr=0.1),
        ('sum_of_squares',)),
    'partial_rowwise_adam': (
        lambda: lazy_optax.partial_rowwise_adam(0.05),
        lambda t: lean_reference.PartialRowwiseAdam(t, lr=0.05),
        ('mu', 'nu')),
    'ftrl': (
        lambda: lazy_optax.ftrl(0.1, l1=0.01),
        lambda t: lean_reference.Ftrl(t, lr=0.1, l1=0.01),
        ('accumulator', 'linear')),
}


def run_checks(mode, directory):
  """Runs one mode in a subprocess with 8 CPU devices; returns its JSON."""
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  env.pop('JAX_ENABLE_X64', None)
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), mode, str(directory)],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _mesh(axis_type=AxisType.Auto):
  assert len(jax.devices()) == 8, jax.devices()
  return jax.make_mesh((2, 4), ('data', 'rows'),
                       axis_types=(axis_type, axis_type))


def _batches(rng):
  half = N_IDS // 2
  for _ in range(STEPS):
    ids = rng.integers(0, NUM_ROWS, N_IDS)
    ids[1] = ids[0]            # duplicate inside data shard 0
    ids[half] = ids[0]         # the same id on data shard 1
    yield ids.astype(np.int32), rng.normal(size=(N_IDS, D)).astype(np.float32)


def _step(tx):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS),
             'w': jnp.sum(values, axis=0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


def check_optimizer(name, directory):
  """Sharded == one device == float64 model; shardings kept; orbax resume."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  make_tx, make_ref, slots = _MAKERS[name]
  rng = np.random.default_rng(0)
  table = rng.normal(size=(NUM_ROWS, D)).astype(np.float32)
  data = list(_batches(rng))

  tx = make_tx()
  dev0 = jax.devices()[0]
  params1 = jax.device_put({'table': table, 'w': np.zeros(D, np.float32)},
                           dev0)
  state1 = tx.init(params1)
  step1 = jax.jit(_step(tx))
  for ids, values in data:
    params1, state1 = step1(params1, state1, jax.device_put(ids, dev0),
                            jax.device_put(values, dev0))

  mesh = _mesh()
  row_sharded = NamedSharding(mesh, P('rows', None))

  def fresh():
    return {'table': jax.device_put(table, row_sharded),
            'w': jax.device_put(np.zeros(D, np.float32),
                                NamedSharding(mesh, P()))}

  step = jax.jit(_step(tx), donate_argnums=(0, 1))

  def go(params, state, part):
    for ids, values in part:
      params, state = step(
          params, state, jax.device_put(ids, NamedSharding(mesh, P('data'))),
          jax.device_put(values, NamedSharding(mesh, P('data', None))))
    return params, state

  params = fresh()
  state = lazy_optax.sharding.init_sharded(tx, params)
  for slot in slots:
    leaf = lazy_optax.compat.get_slot(state, 'table', slot)
    assert leaf.sharding.spec[0] == 'rows', (slot, leaf.sharding)
  params, state = go(params, state, data)
  for slot in slots:
    leaf = lazy_optax.compat.get_slot(state, 'table', slot)
    assert leaf.sharding.spec[0] == 'rows', (slot, leaf.sharding)
  for a, b in zip(jax.tree.leaves((params, state)),
                  jax.tree.leaves((params1, state1))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6,
                               atol=1e-7)
  ref = make_ref(table)
  for ids, values in data:
    ref.step(ids, values)
  np.testing.assert_allclose(np.asarray(params['table']), ref.p, rtol=2e-5,
                             atol=1e-6)

  # orbax: save after half the steps, restore into sharded targets, finish.
  half = STEPS // 2
  p, s = go(fresh(), lazy_optax.sharding.init_sharded(tx, fresh()), data[:half])
  path = os.path.join(directory, f'sharded_{name}')
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
  for slot in slots:
    leaf = lazy_optax.compat.get_slot(restored['opt_state'], 'table', slot)
    assert leaf.sharding.spec[0] == 'rows', (slot, leaf.sharding)
  resumed = go(restored['params'], restored['opt_state'], data[half:])
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves((params, state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return {'steps': STEPS, 'slots': list(slots)}


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
    return lazy_optax.precision.apply_updates_stochastic(params, updates, key=key,
                                               step=3)

  dev0 = jax.devices()[0]
  one = jax.jit(apply)(jax.device_put({'table': table, 'other': table}, dev0),
                       ids, values, dense)
  out = {}
  for axis_type in (AxisType.Auto, AxisType.Explicit):
    mesh = _mesh(axis_type)
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


def main(argv):
  mode, directory = argv[1], argv[2]
  if mode in _MAKERS:
    out = check_optimizer(mode, directory)
  elif mode == 'stochastic':
    out = check_stochastic(directory)
  else:
    raise SystemExit(f'unknown mode {mode!r}')
  print(json.dumps(out))


if __name__ == '__main__':
  main(sys.argv)
