"""Row-sharded tables: lazy_adam's collectives and state shardings.

The checks on 8 simulated CPU devices live in sharded_checks.py (run in a
subprocess: XLA_FLAGS must name the device count before jax is imported);
every optimizer's sharded step is checked in tests/test_conformance.py.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
from sharded_checks import run_checks

import lazy_optax


def test_an_id_on_both_data_shards_is_summed_before_the_update():
  # Auto and Explicit meshes: an id arriving on both data shards is updated
  # once, with the summed gradient (the float64 rule and the sign of the
  # summed gradient). Every optimizer on 8 devices: tests/test_conformance.py.
  out = run_checks('duplicates')
  assert set(out) == {'Auto', 'Explicit'}


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
