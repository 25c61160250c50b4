"""Save (`save DIR`) or restore (`restore DIR`) IdTable states with orbax.

Run twice by tests/test_id_table_checkpoint.py, each time in a new process
with 8 simulated CPU devices (XLA_FLAGS must be set before jax is imported):

    python3 tests/id_table_checkpoint_checks.py save DIR
    python3 tests/id_table_checkpoint_checks.py restore DIR

`save` drives every configuration (eviction x admit_after x ttl;
admission 'always' where it drops the sketch; without an eviction log)
through a few `assign` calls, places one of those states sharded over the
8 devices, saves all the states in one checkpoint with
`orbax.checkpoint.StandardCheckpointer`, and writes each state's arrays to
a NumPy file. `restore` restores the checkpoint into the tables' `init()`
structures (the sharded one with its shardings) and checks every leaf bit
for bit against the saved arrays, and the shardings. Prints one JSON line:
each configuration's stats, or its error.
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (
      os.environ.get('XLA_FLAGS', '') +
      ' --xla_force_host_platform_device_count=8')

import itertools  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
import sys


import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import lazy_optax  # pylint: disable=g-import-not-at-top

CAP, PROBE, N = 32, 4, 24


def configs():
  """name -> (IdTable, sharded?)."""
  out = {}
  for eviction, admit_after, ttl in itertools.product(
      ('lru', 'lfu', 'none'), (1, 2), (None, 3)):
    name = f'{eviction}-admit{admit_after}-ttl{ttl}'
    out[name] = (lazy_optax.IdTable(
        capacity=CAP, probe=PROBE, eviction=eviction,
        admit_after=admit_after, ttl=ttl, lfu_period=2, rounds=1), False)
  out['lru-no-log'] = (lazy_optax.IdTable(capacity=CAP, probe=PROBE,
                                          eviction='lru', eviction_log=0,
                                          rounds=1), False)
  for eviction in ('lru', 'lfu'):   # no sketch: admission='always'
    out[f'{eviction}-always'] = (lazy_optax.IdTable(
        capacity=CAP, probe=PROBE, eviction=eviction, admission='always',
        rounds=1), False)
  # The table of 'lfu-admit2-ttl3', its state sharded over the 8 devices.
  out['sharded-lfu-ttl'] = (out['lfu-admit2-ttl3'][0], True)
  return out


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()), ('rows',))


def _batches():
  rng = np.random.default_rng(0)
  pool = rng.integers(0, 2 ** 62, 80, dtype=np.int64)
  return [lazy_optax.split_ids(pool[np.minimum(rng.zipf(1.3, N), 80) - 1])
          for _ in range(6)]


def _arrays(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _targets(sharded_too=True):
  out = {}
  for name, (table, sharded) in configs().items():
    state = table.init()
    if sharded and sharded_too:
      # From the host: placing a device array's shards compiles a slicing
      # program per leaf shape; host arrays are copied as they are.
      state = jax.device_put(jax.tree.map(np.asarray, state),
                             table.shardings(_mesh(), 'rows'))
    out[name] = state
  return out


def _save(root):
  batches = _batches()
  states = _targets(sharded_too=False)
  stepped = {}   # table -> its state after the batches
  for name, (table, sharded) in configs().items():
    if table not in stepped:
      assign = jax.jit(lambda s, w, k, table=table: table.assign(s, w,
                                                                  step=k))
      state = states[name]
      for k, words in enumerate(batches):
        _, state, _ = assign(state, words, 2 * k)
      stepped[table] = state
    states[name] = stepped[table]
    if sharded:
      # The same steps' state (the steps on 8 devices are
      # test_id_table.py's sharded check), saved from its shards.
      states[name] = jax.device_put(jax.tree.map(np.asarray, states[name]),
                                    table.shardings(_mesh(), 'rows'))
    for leaf in jax.tree.leaves(states[name]):
      assert leaf.size > 0, f'{name}: a zero-size leaf {leaf.shape}'
    np.savez(os.path.join(root, f'{name}.npz'), *_arrays(states[name]))
  with ocp.StandardCheckpointer() as ckptr:     # one checkpoint for all
    ckptr.save(os.path.join(root, 'states'), states)
  return {'saved': len(states)}


def _restore(root):
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      _targets())
  with ocp.StandardCheckpointer() as ckptr:
    states = ckptr.restore(os.path.join(root, 'states'), target)
  out = {}
  for name, (table, sharded) in configs().items():
    try:
      out[name] = _check(root, name, table, sharded, states[name])
    except Exception as e:  # pylint: disable=broad-except
      out[name] = f'{type(e).__name__}: {e}'[:2000]
  return out


def _check(root, name, table, sharded, state):
  assert isinstance(state, lazy_optax.IdTableState), type(state)
  saved = np.load(os.path.join(root, f'{name}.npz'))
  leaves = _arrays(state)
  assert len(leaves) == len(saved.files), name
  for i, leaf in enumerate(leaves):
    want = saved[f'arr_{i}']
    assert leaf.dtype == want.dtype and leaf.shape == want.shape, name
    np.testing.assert_array_equal(leaf, want, err_msg=name)
  if sharded:
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(
        table.shardings(_mesh(), 'rows'))):
      assert got.sharding.is_equivalent_to(want, got.ndim), name
  return table.stats(state)


def run(mode, root):
  """Saves (`mode` 'save') or restores every configuration under `root`."""
  assert len(jax.devices()) == 8, jax.devices()
  jnp.zeros(())  # the backend, before orbax
  return _save(root) if mode == 'save' else _restore(root)


def main():
  print(json.dumps(run(sys.argv[1], sys.argv[2])))


if __name__ == '__main__':
  main()
