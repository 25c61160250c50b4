"""The CPU kernels on several devices and processes (run in subprocesses).

    python3 tests/kernel_shards.py mesh
        (or `mesh_checks()` in the 8-device process of tests/eight_devices.py)
        8 simulated devices, a data x rows mesh with Explicit axes: every
        optimizer's row update runs as the kernel on each device's own rows
        (inside jax.shard_map) and equals the same step on one device.
    python3 tests/kernel_shards.py process PROCESS_ID PORT
        (or `process_main(PROCESS_ID, PORT)` in a 2-device process of
        tests/fork_server.py)
        one of 2 processes x 2 CPU devices (gloo collectives on localhost)
        running docs/scaling.md's train step as written, through the kernel.

Each prints lines starting with `OK` for the test to read; any failure
raises.
"""

import os
import pathlib
import re
import sys

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '')
      + ' --xla_force_host_platform_device_count='
      + ('8' if sys.argv[1] == 'mesh' else '2'))

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from optimizer_cases import MESH_CASES

import lazy_optax

# The optimizers whose kernels run per device (tests/optimizer_cases.py).
OPTIMIZERS = {case.name: case.make for case in MESH_CASES}


def _train(tx, table, batches, mesh):
  params = {'table': table}
  state = (lazy_optax.sharding.init_sharded(tx, params) if mesh is not None
           else tx.init(params))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, table.shape[0])}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  hlo = None
  for ids, values in batches:
    if hlo is None:
      hlo = step.lower(params, state, ids, values).as_text()
    params, state = step(params, state, ids, values)
  return params, state, hlo


def mesh_check():
  mesh = jax.make_mesh((2, 4), ('data', 'rows'))
  rng = np.random.default_rng(0)
  num_rows, width = 64, 8
  table = rng.normal(size=(num_rows, width)).astype(np.float32)
  raw = [(rng.integers(0, num_rows, 16).astype(np.int32),
          rng.normal(size=(16, width)).astype(np.float32))
         for _ in range(4)]
  for name, make in OPTIMIZERS.items():
    one, _, _ = _train(make(), jnp.asarray(table),
                       [(jnp.asarray(i), jnp.asarray(v)) for i, v in raw],
                       None)
    with jax.sharding.set_mesh(mesh):
      sharded_table = jax.device_put(table, NamedSharding(mesh, P('rows')))
      batches = [(jax.device_put(i, NamedSharding(mesh, P('data'))),
                  jax.device_put(v, NamedSharding(mesh, P('data'))))
                 for i, v in raw]
      tx = make()
      choice = lazy_optax.explain_update(
          tx, {'table': lazy_optax.SparseRows(*batches[0], num_rows)},
          lazy_optax.sharding.init_sharded(tx, {'table': sharded_table}),
          {'table': sharded_table})['table']
      assert choice.impl == 'cpu_kernel', choice
      params, state, hlo = _train(tx, sharded_table, batches, mesh)
      assert 'lazy_optax_LazyOptax' in hlo, name
      assert params['table'].sharding.spec[0] == 'rows', (name, params['table'].sharding)
      for leaf in jax.tree.leaves(state):
        if leaf.ndim and leaf.shape[0] == num_rows:
          assert leaf.sharding.spec[0] == 'rows', (name, leaf.sharding)
    np.testing.assert_allclose(np.asarray(params['table']),
                               np.asarray(one['table']), rtol=2e-6,
                               atol=1e-7, err_msg=name)
    print('OK', name)


def lookup_check():
  """A whole step (lookup, value_and_grad, lazy_adam) on an Explicit mesh:
  the lookup's rows split like the ids, equal to one device."""
  mesh = jax.make_mesh((2, 4), ('data', 'rows'))
  rng = np.random.default_rng(1)
  table = rng.normal(size=(64, 8)).astype(np.float32)
  ids = rng.integers(0, 64, 16).astype(np.int32)
  w = np.ones((8,), np.float32)

  def loss(p, ids):
    return jnp.sum((lazy_optax.lookup(p['t'], ids) @ p['w'] - 1.0) ** 2)

  def train(params, ids, sharded):
    tx = lazy_optax.lazy_adam(0.05)
    state = (lazy_optax.sharding.init_sharded(tx, params) if sharded
             else tx.init(params))

    @jax.jit
    def step(p, s, ids):
      _, g = lazy_optax.value_and_grad(loss)(p, ids)
      u, s = tx.update(g, s, p)
      return lazy_optax.apply_updates(p, u), s

    for _ in range(3):
      params, state = step(params, state, ids)
    return params

  one = train({'t': jnp.asarray(table), 'w': jnp.asarray(w)},
              jnp.asarray(ids), False)
  with jax.sharding.set_mesh(mesh):
    params = {'t': jax.device_put(table, NamedSharding(mesh, P('rows'))),
              'w': jax.device_put(w, NamedSharding(mesh, P()))}
    got = train(params, jax.device_put(ids, NamedSharding(mesh, P('data'))),
                True)
    assert got['t'].sharding.spec[0] == 'rows', got['t'].sharding
  np.testing.assert_allclose(np.asarray(got['t']), np.asarray(one['t']),
                             rtol=2e-6, atol=1e-7)
  print('OK lookup on an Explicit mesh')


def process_check():
  guide = pathlib.Path(__file__).resolve().parent.parent / 'docs' / (
      'scaling.md')
  snippet = re.findall(r'```python\n(.*?)```', guide.read_text(), re.S)[0]
  namespace = {}
  exec(compile(snippet, 'docs/scaling.md', 'exec'), namespace)  # pylint: disable=exec-used
  tx, params = namespace['tx'], namespace['params']
  opt_state = namespace['opt_state']
  grads = {'table': lazy_optax.SparseRows(namespace['ids'],
                                          namespace['g_rows'],
                                          namespace['V'])}
  choice = lazy_optax.explain_update(tx, grads, opt_state, params)['table']
  assert choice.impl == 'cpu_kernel', choice
  hlo = namespace['train_step'].lower(params, opt_state, namespace['ids'],
                                      namespace['g_rows']).as_text()
  assert 'lazy_optax_LazyOptaxAdam' in hlo
  # Both processes fed ids 0, 1000, ..., 7000 with gradient rows of ones:
  # each touched row got a summed gradient of 2, and TensorFlow's Adam rule
  # moves it by exactly -lr on the first step; no other row moves.
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  table = np.asarray(multihost_utils.process_allgather(params['table'],
                                                       tiled=True))
  touched = np.arange(8) * 1000
  np.testing.assert_allclose(table[touched], -1e-3, rtol=1e-5)
  moved = np.flatnonzero(np.abs(table).sum(axis=1))
  np.testing.assert_array_equal(moved, touched)
  print('OK process', jax.process_index(), 'of', jax.process_count(),
        'devices', jax.device_count(), choice.impl)


def mesh_checks():
  mesh_check()
  lookup_check()


def process_main(process_id, port):
  """Process `process_id` of 2 (2 devices each), coordinated on `port`."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2,
                             process_id=process_id)
  process_check()
  jax.distributed.shutdown()  # as at exit, for a forked process too


if __name__ == '__main__':
  if sys.argv[1] == 'mesh':
    mesh_checks()
  else:
    process_main(int(sys.argv[2]), sys.argv[3])
