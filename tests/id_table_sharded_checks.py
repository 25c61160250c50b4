"""IdTable training sharded over 8 simulated CPU devices, against 1 device.

Run by tests/test_id_table.py in a subprocess, since XLA_FLAGS must be set
before jax is imported:

    python3 tests/id_table_sharded_checks.py

The id state's slot arrays, the table and its Adam moments are split by
slot (row) over an 8-device mesh (hash buckets are contiguous slot ranges,
so each device holds a range of buckets); the hashed train step (assign,
reset_rows, lookup, value_and_grad, lazy_adam) runs under jit with the
state donated. It must give the same slots, fresh rows, counters and id
state as the same step on one device, parameters equal to float32 rounding,
and keep every sharding from step to step. Raises on a failed check and
prints one JSON line.
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      ' --xla_force_host_platform_device_count=8')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import lazy_optax  # pylint: disable=g-import-not-at-top

CAP, PROBE, D, N, STEPS = 128, 8, 4, 64, 16


def _stream():
  rng = np.random.default_rng(0)
  pool = rng.integers(0, 2 ** 63 - 1, 3000, dtype=np.int64)
  ids = pool[np.minimum(rng.zipf(1.2, (STEPS, N)), 3000) - 1]
  return lazy_optax.split_ids(ids), np.cos(ids % 97).astype(np.float32)


def _step_fn(table_ids, tx, lookup):
  def step(params, opt_state, id_state, words, targets, k):
    slots, id_state, fresh = table_ids.assign(id_state, words, step=k)
    params, opt_state = lazy_optax.reset_rows(
        tx, params, opt_state, {'emb': fresh},
        init=jax.nn.initializers.normal(0.3), key=jax.random.key(1))
    if lookup:
      def loss_fn(params):
        rows = lazy_optax.lookup(params['emb'], slots)
        return jnp.mean((rows.sum(axis=1) - targets) ** 2)

      loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    else:
      # A row-sparse gradient built directly (lookup's forward gather under
      # Explicit axes is outside this check).
      loss = jnp.sum(targets)
      grads = {'emb': lazy_optax.SparseRows(
          slots, targets[:, None] * jnp.ones((1, D)), CAP)}
    updates, opt_state = tx.update(grads, opt_state, params)
    return (lazy_optax.apply_updates(params, updates), opt_state, id_state,
            slots, fresh.slots, loss)
  return step


def run(mesh, lookup):
  # A sketch as narrow as the table: its collisions admit enough of the
  # stream's ids (seen twice) to fill windows, so victims are met.
  table_ids = lazy_optax.IdTable(capacity=CAP, probe=PROBE, ttl=8,
                                 eviction='lfu', lfu_period=5, admit_after=2,
                                 sketch_width=CAP)
  tx = lazy_optax.lazy_adam(0.05)
  params = {'emb': jnp.zeros((CAP, D), jnp.float32)}
  opt_state = tx.init(params)
  id_state = table_ids.init()
  step = _step_fn(table_ids, tx, lookup)
  if mesh is not None:
    rows = NamedSharding(mesh, P('rows'))
    # From the host (the same values): placing a device array's shards
    # compiles a slicing program per leaf shape.
    params = jax.device_put(jax.tree.map(np.asarray, params), {'emb': rows})
    opt_state = lazy_optax.sharding.init_sharded(tx, params)
    id_shardings = table_ids.shardings(mesh, 'rows')
    id_state = jax.device_put(jax.tree.map(np.asarray, id_state),
                              id_shardings)
    before = [x.sharding for x in jax.tree.leaves((params, opt_state,
                                                   id_state))]
  jitted = jax.jit(step, donate_argnums=(0, 1, 2))
  words, targets = _stream()
  out = []
  for k in range(STEPS):
    params, opt_state, id_state, slots, fresh, loss = jitted(
        params, opt_state, id_state, words[k], targets[k], k)
    out.append((np.asarray(slots), np.asarray(fresh), float(loss)))
  if mesh is not None:
    after = [x.sharding for x in jax.tree.leaves((params, opt_state,
                                                  id_state))]
    for b, a, x in zip(before, after, jax.tree.leaves(
        (params, opt_state, id_state))):
      assert b.is_equivalent_to(a, x.ndim), (b, a)
    assert id_state.ids.sharding.spec[0] == 'rows', id_state.ids.sharding
    assert len(id_state.ids.sharding.device_set) == 8
  return out, jax.tree.map(np.asarray, (params, opt_state, id_state)), (
      table_ids.stats(id_state))


def main():
  assert len(jax.devices()) == 8, jax.devices()
  out = {}
  for axis_type, lookup in ((AxisType.Auto, True), (AxisType.Explicit, False)):
    one, one_state, one_stats = run(None, lookup)
    mesh = jax.make_mesh((8,), ('rows',), axis_types=(axis_type,))
    eight, eight_state, eight_stats = run(mesh, lookup)
    _compare(one, one_state, one_stats, eight, eight_state, eight_stats)
    losses = [loss for _, _, loss in eight]
    out[str(axis_type)] = {
        'stats': eight_stats, 'first_loss': losses[0],
        'last_loss': losses[-1],
        'no_row': int(sum((s == CAP).sum() for s, _, _ in eight))}
  print(json.dumps(out))


def _compare(one, one_state, one_stats, eight, eight_state, eight_stats):
  for k, ((s1, f1, _), (s8, f8, _)) in enumerate(zip(one, eight)):
    np.testing.assert_array_equal(s1, s8, err_msg=f'slots, step {k}')
    np.testing.assert_array_equal(f1, f8, err_msg=f'fresh, step {k}')
  assert one_stats == eight_stats, (one_stats, eight_stats)
  jax.tree.map(np.testing.assert_array_equal, one_state[2], eight_state[2])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               one_state[:2], eight_state[:2])


if __name__ == '__main__':
  main()
