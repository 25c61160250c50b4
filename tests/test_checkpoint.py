"""Switching between lazy and dense Adam through an orbax checkpoint.

Every optimizer's state resuming bit for bit from a checkpoint, on one device
and on 8: tests/test_conformance.py.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from reference import optax_adam_rows

import lazy_optax

NUM_ROWS, D = 40, 3


def _batches(seed, steps, n_ids=12):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    ids = rng.integers(0, NUM_ROWS // 2, n_ids).astype(np.int32)
    ids[1] = ids[0]
    out.append((ids, rng.normal(size=(n_ids, D)).astype(np.float32)))
  return out


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {'table': jnp.asarray(rng.normal(size=(NUM_ROWS, D)), jnp.float32),
          'bias': jnp.asarray(rng.normal(size=(D,)), jnp.float32)}


def _sparse_step(tx):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS),
             'bias': jnp.sum(values, axis=0)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def _save(path, tree):
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree)


def _restore(path, target):
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(path, target)


def _dense_grad(ids, values):
  dense = np.zeros((NUM_ROWS, D), np.float32)
  np.add.at(dense, ids, values)
  return dense


class _Float64Adam:
  """optax.adam's rule in float64: lazy steps touch rows, dense steps all."""

  def __init__(self, params, lr):
    self.p = np.asarray(params['table'], np.float64)
    self.b = np.asarray(params['bias'], np.float64)
    self.m, self.v = np.zeros_like(self.p), np.zeros_like(self.p)
    self.mb, self.vb = np.zeros_like(self.b), np.zeros_like(self.b)
    self.t, self.lr = 0, lr

  def step(self, ids, values, lazy):
    self.t += 1
    g = _dense_grad(ids, values).astype(np.float64)
    rows = np.unique(ids) if lazy else np.arange(NUM_ROWS)
    self.p[rows], self.m[rows], self.v[rows] = optax_adam_rows(
        self.p[rows], self.m[rows], self.v[rows], self.t, g[rows], self.lr)
    self.b, self.mb, self.vb = optax_adam_rows(
        self.b, self.mb, self.vb, self.t,
        np.asarray(values, np.float64).sum(0), self.lr)


@pytest.mark.parametrize('lazy_first', [True, False])
def test_switch_between_lazy_and_dense_adam(tmp_path, lazy_first):
  lr = 0.05
  lazy_tx, dense_tx = lazy_optax.lazy(optax.adam(lr)), optax.adam(lr)
  params_abs = jax.eval_shape(_params)
  lazy_abs = jax.eval_shape(lazy_tx.init, params_abs)
  dense_abs = jax.eval_shape(dense_tx.init, params_abs)
  assert jax.tree.structure(lazy_abs) == jax.tree.structure(dense_abs)
  assert jax.tree.leaves(lazy_abs) == jax.tree.leaves(dense_abs)

  def dense_step(params, state, ids, values):
    grads = {'table': jnp.asarray(_dense_grad(ids, values)),
             'bias': jnp.sum(values, axis=0)}
    updates, state = dense_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  lazy_step = _sparse_step(lazy_tx)
  first, second = _batches(2, 3), _batches(3, 3)
  params = _params()
  ref = _Float64Adam(params, lr)
  phases = [(lazy_step, lazy_abs, True), (dense_step, dense_abs, False)]
  if not lazy_first:
    phases.reverse()

  step, _, is_lazy = phases[0]
  state = (lazy_tx if is_lazy else dense_tx).init(params)
  for ids, values in first:
    params, state = step(params, state, ids, values)
    ref.step(ids, values, is_lazy)
  path = os.path.join(tmp_path, 'switch')
  _save(path, {'params': params, 'opt_state': state})
  del params, state

  step, state_abs, is_lazy = phases[1]
  restored = _restore(path, {'params': params_abs, 'opt_state': state_abs})
  params, state = restored['params'], restored['opt_state']
  for ids, values in second:
    params, state = step(params, state, ids, values)
    ref.step(ids, values, is_lazy)

  assert int(optax.tree_utils.tree_get(state, 'count')) == 6
  mu = optax.tree_utils.tree_get(state, 'mu')
  nu = optax.tree_utils.tree_get(state, 'nu')
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(params['bias'], ref.b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mu['table'], ref.m, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(nu['table'], ref.v, rtol=1e-5, atol=1e-9)
