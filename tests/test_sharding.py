"""Row-sharded tables on 8 simulated CPU devices (run in a subprocess).

The checks live in sharded_checks.py, since XLA_FLAGS must name the device
count before jax is imported, and this process has imported jax already.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import lazy_optax

_SCRIPT = os.path.join(os.path.dirname(__file__), 'sharded_checks.py')


def run_checks(*args):
  env = dict(os.environ)
  env['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  env.pop('JAX_ENABLE_X64', None)
  proc = subprocess.run([sys.executable, _SCRIPT, *args], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sharded_step_matches_one_device_and_keeps_shardings():
  # Auto and Explicit meshes, lazy_adam and lazy(optax.adam): equal to one
  # device and to the float64 model; shardings equal after every step; an id
  # arriving on both data shards is summed before the update.
  out = run_checks('equivalence')
  assert set(out) == {'Auto lazy_adam', 'Auto lazy(optax.adam)',
                      'Auto duplicates', 'Explicit lazy_adam',
                      'Explicit duplicates'}


def test_per_device_traffic_grows_with_batch_not_table():
  out = run_checks('traffic')
  for axis_type in ('Auto', 'Explicit'):
    m = out[axis_type]
    small, big = m['16384x64 rows, 256 ids'], m['131072x64 rows, 256 ids']
    assert small['collective_bytes'] == big['collective_bytes']
    assert small['temp_bytes'] == big['temp_bytes']
    # Sent per device and step: about the ids, the gradient rows and the
    # gathered mu/nu rows: 3 x 256 x 64 float32, not a table.
    assert 3 * 256 * 64 * 4 <= small['collective_bytes'] < 4 * 256 * 64 * 4
    assert not any('all-to-all' in c for c in small['collectives'])
    larger_batch = m['131072x64 rows, 1024 ids']
    assert larger_batch['collective_bytes'] > 3.5 * big['collective_bytes']


def test_state_shardings_follow_params():
  mesh = jax.make_mesh((1,), ('rows',))
  rows = NamedSharding(mesh, P('rows', None))
  params = {'table': jax.device_put(jnp.zeros((6, 2)), rows),
            'bias': jax.device_put(jnp.zeros(2), NamedSharding(mesh, P()))}
  tx = lazy_optax.lazy_adam(1e-3, amsgrad=True)
  shardings = lazy_optax.sharding.state_shardings(tx, params)
  state = lazy_optax.sharding.init_sharded(tx, params)
  for name in ('mu', 'nu', 'nu_max'):
    leaf = optax.tree_utils.tree_get(state, name)['table']
    assert leaf.sharding == rows
    assert optax.tree_utils.tree_get(shardings, name)['table'] == rows
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
  assert optax.tree_utils.tree_get(state, 'count').sharding.spec == P()
  np.testing.assert_array_equal(
      np.asarray(optax.tree_utils.tree_get(state, 'mu')['table']), 0)


def test_state_shardings_errors():
  tx = lazy_optax.lazy_adam(1e-3)
  with pytest.raises(ValueError, match='no NamedSharding'):
    lazy_optax.sharding.state_shardings(
        tx, {'t': jnp.zeros((4, 2))},
        {'t': jax.sharding.SingleDeviceSharding(jax.devices()[0])})
  with pytest.raises(ValueError, match='tree structure of params'):
    lazy_optax.sharding.state_shardings(tx, {'t': jnp.zeros((4, 2))}, {'u': None})
  with pytest.raises(ValueError, match='has no sharding'):
    lazy_optax.sharding.state_shardings(tx, {'t': np.zeros((4, 2))})


def test_per_row_state_leaves_get_the_row_split():
  # adam_with_counter keeps [num_rows] counters beside [num_rows, D] moments: they take
  # the table's row split and drop the column part of its spec.
  mesh = jax.make_mesh((1,), ('rows',))
  table = jax.device_put(jnp.zeros((8, 2)), NamedSharding(mesh, P('rows', None)))
  tx = lazy_optax.adam_with_counter(1e-3)
  state = lazy_optax.sharding.init_sharded(tx, {'table': table})
  row_count = optax.tree_utils.tree_get(state, 'row_count')['table']
  assert row_count.shape == (8,)
  assert row_count.sharding.spec == P('rows')
  assert optax.tree_utils.tree_get(state, 'mu')['table'].sharding.spec == P(
      'rows', None)
