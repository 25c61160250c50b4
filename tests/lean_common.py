"""Shared pieces of the tests of the memory-lean optimizers."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lazy_optax


def batches(seed, num_rows, row_shape, steps, n_ids):
  """Ids with heavy duplicates; rows seen early are absent later."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    lo = (t * num_rows) // (2 * steps)
    ids = rng.integers(lo, lo + num_rows // 3, n_ids)
    ids[: n_ids // 4] = ids[0]  # a quarter of the batch is one id
    out.append((ids.astype(np.int32),
                rng.normal(size=(n_ids, *row_shape)).astype(np.float32)))
  return out


def sparse_step(tx, num_rows):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


def run(tx, table, data, jit=True, dtype=jnp.float32):
  """Trains {'table': table} on `data`; returns (params, state)."""
  params = {'table': jnp.asarray(table, dtype)}
  state = tx.init(params)
  step = sparse_step(tx, table.shape[0])
  if jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  for ids, values in data:
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(values))
  return params, state


def run_dense(tx, table, grads):
  params = jnp.asarray(table, jnp.float32)
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for g in grads:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
  return params, state


def untouched(data, num_rows):
  seen = set()
  for ids, _ in data:
    seen.update(int(i) for i in ids if 0 <= i < num_rows)
  return np.array([i for i in range(num_rows) if i not in seen])


def assert_checkpoint_resumes(tx, data, tmp_path, num_rows=40, d=3):
  """Saves after half the steps with orbax, restores into eval_shape
  targets, finishes: bit-for-bit equal to the uninterrupted run."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  def fresh():
    rng = np.random.default_rng(0)
    return {'table': jnp.asarray(rng.normal(size=(num_rows, d)), jnp.float32),
            'bias': jnp.asarray(rng.normal(size=(d,)), jnp.float32)}

  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows),
             'bias': jnp.sum(values, axis=0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  def go(params, state, part):
    jitted = jax.jit(step, donate_argnums=(0, 1))
    for ids, values in part:
      params, state = jitted(params, state, ids, values)
    return params, state

  params = fresh()
  straight = go(params, tx.init(params), data)
  half = len(data) // 2
  params = fresh()
  params, state = go(params, tx.init(params), data[:half])
  path = os.path.join(tmp_path, 'ckpt')
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {'params': params, 'opt_state': state})
  del params, state
  params_abs = jax.eval_shape(fresh)
  target = {'params': params_abs,
            'opt_state': jax.eval_shape(tx.init, params_abs)}
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, target)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
  resumed = go(restored['params'], restored['opt_state'], data[half:])
  assert (jax.tree.structure(resumed) == jax.tree.structure(straight))
  for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  return resumed


def assert_state_shardings_follow_rows(tx, slot_names):
  """On a one-device mesh: per-row slots take the table's row sharding."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ('rows',))
  rows = NamedSharding(mesh, P('rows', None))
  params = {'table': jax.device_put(jnp.zeros((6, 4)), rows),
            'bias': jax.device_put(jnp.zeros(4), NamedSharding(mesh, P()))}
  shardings = lazy_optax.sharding.state_shardings(tx, params)
  state = lazy_optax.sharding.init_sharded(tx, params)
  assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
  for name in slot_names:
    leaf = lazy_optax.compat.get_slot(state, 'table', name)
    spec = lazy_optax.compat.get_slot(shardings, 'table', name).spec
    assert spec[0] == 'rows', (name, spec)
    assert leaf.sharding.spec[0] == 'rows', (name, leaf.sharding)
  assert lazy_optax.compat.global_step(state).sharding.spec == P()
  return state


def count_of(state):
  return int(lazy_optax.compat.global_step(state))


def run_partitioned(table_tx, table, data, num_rows):
  """Trains `{'table', 'w'}` with `table_tx` on the table, optax.adam on `w`.

  An `optax.partition` labelled by `path_labels`, in a jitted step; `w`'s
  gradient is the sum of the batch's rows. Returns `(params, state)`.
  """
  tx = optax.partition(
      {'table': table_tx, 'rest': optax.adam(1e-2)},
      lazy_optax.tree.path_labels(lambda name: 'table' if name == 'table'
                             else 'rest'))
  params = {'table': jnp.asarray(table, jnp.float32),
            'w': jnp.zeros(jnp.shape(table)[1:])}
  state = tx.init(params)

  @jax.jit
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows),
             'w': jnp.sum(values, 0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values in data:
    params, state = step(params, state, ids, values)
  return params, state
