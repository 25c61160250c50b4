"""CowClip with the batch's true counts, row max-norm's bound, and their
refusals. The conformance suite (tests/optimizer_cases.py) runs both rules
on every property and implementation with one count per distinct id."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optimizer_cases import batches
import pytest
import reference

import lazy_optax
from lazy_optax import SparseRows

R, D = 40, 3
IMPLS = ('generic', 'xla', 'cpu_kernel')
_CLIP = dict(coef=0.8, lower_bound=0.5)


def _train(tx, table, data, dtype=jnp.float32):
  params = {'table': jnp.asarray(table, dtype)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, ids, values):
    grads = {'table': SparseRows(ids, values, R)}
    counts = {'table': lazy_optax.id_counts(ids, R)}
    updates, state = tx.update(grads, state, params, counts=counts)
    return lazy_optax.apply_updates(params, updates), state

  for ids, values in data:
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(values))
  return params, state


def _data():
  data = batches(4, R, (D,), steps=10, n_ids=16)
  # Padding and out-of-range ids count nowhere. The batch has the 16 slots of
  # the others (8 ids, then 8 more padding ids), so the jitted step compiles
  # once; its first 8 rows of values are those an 8-id batch would draw.
  ids = np.array([-1, 3, R, 3, 3, 7, -1, 1] + [-1, R] * 4, np.int32)
  rng = np.random.default_rng(5)
  return data + [(ids, rng.normal(size=(16, D)).astype(np.float32))]


@pytest.mark.parametrize('impl', IMPLS)
def test_cowclip_with_batch_counts_matches_the_float64_model(impl):
  table = np.random.default_rng(0).normal(size=(R, D))
  data = _data()
  model = reference.CowClip(reference.TFLazyAdam(table, lr=0.05), **_CLIP)
  for ids, values in data:
    model.step(ids, values)
  tx = lazy_optax.lazy_adam_cowclip(0.05, impl=impl, **_CLIP)
  params, state = _train(tx, table, data)
  np.testing.assert_allclose(params['table'], model.p, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(lazy_optax.compat.get_slot(state, 'table', 'm'),
                             model.m, rtol=2e-5, atol=1e-7)
  # Counts matter: the same steps with one count per distinct id differ.
  unit = reference.CowClip(reference.TFLazyAdam(table, lr=0.05),
                           counts='distinct', **_CLIP)
  for ids, values in data:
    unit.step(ids, values)
  assert np.abs(unit.p - model.p).max() > 1e-3


@pytest.mark.parametrize('impl', IMPLS)
def test_cowclip_and_max_norm_on_bfloat16_tables(impl):
  table = np.random.default_rng(1).normal(size=(R, D))
  data = _data()
  model = reference.CowClip(reference.TFLazyAdam(table, lr=0.05), **_CLIP)
  for ids, values in data:
    model.step(ids, values)
  tx = lazy_optax.lazy_adam_cowclip(0.05, mu_dtype=jnp.float32,
                                    nu_dtype=jnp.float32, impl=impl, **_CLIP)
  params, _ = _train(tx, table, data, jnp.bfloat16)
  assert params['table'].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(params['table'], np.float32), model.p,
                             rtol=3e-2, atol=3e-2)
  tx = lazy_optax.lazy(optax.chain(
      lazy_optax.scale_by_rowwise_adagrad(impl=impl),
      optax.scale_by_learning_rate(0.3),
      lazy_optax.row_max_norm(1.0)), impl=impl)
  params, _ = _train(tx, table, data, jnp.bfloat16)
  norms = np.linalg.norm(np.asarray(params['table'], np.float32), axis=1)
  touched = np.unique(np.concatenate([i for i, _ in data]))
  touched = touched[(touched >= 0) & (touched < R)]
  assert norms[touched].max() <= 1.0 + 1e-2


def test_cowclip_outside_lazy_clips_every_row_by_its_count():
  rng = np.random.default_rng(2)
  table = rng.normal(size=(6, 4))
  ids = np.array([0, 0, 0, 2, 5, 5], np.int32)
  values = rng.normal(size=(6, 4)) * 3
  dense = np.zeros((6, 4))
  np.add.at(dense, ids, values)
  model = reference.CowClip(reference.TFLazyAdam(table, lr=0.1), **_CLIP)
  model.step(ids, values)
  tx = optax.chain(lazy_optax.cowclip(**_CLIP),
                   lazy_optax.scale_by_lazy_adam(),
                   optax.scale_by_learning_rate(0.1))
  params = jnp.asarray(table, jnp.float32)
  # One program, not the update's ops dispatched one by one.
  u, _ = jax.jit(lambda g, s, p, c: tx.update(g, s, p, counts=c))(
      jnp.asarray(dense, jnp.float32), tx.init(params), params,
      lazy_optax.id_counts(ids, 6))
  np.testing.assert_allclose(params + u, model.p, rtol=2e-5, atol=1e-6)


def test_counts_from_value_and_grad_batch_ids():
  table = jnp.asarray(np.random.default_rng(3).normal(size=(R, D)),
                      jnp.float32)
  params = {'table': table, 'w': jnp.ones((D,))}
  tx = lazy_optax.lazy(optax.chain(
      lazy_optax.cowclip(coef=0.01, lower_bound=0.0),
      optax.scale_by_learning_rate(1.0)))

  def loss(params, ids):
    rows = lazy_optax.lookup(params['table'], ids)
    return jnp.sum(rows @ params['w']) * 100.0

  @jax.jit
  def step(params, state, ids):
    _, grads = lazy_optax.value_and_grad(loss)(params, ids)
    counts = {'table': lazy_optax.id_counts(ids, R), 'w': None}
    updates, state = tx.update(grads, state, params, counts=counts)
    return lazy_optax.apply_updates(params, updates), state

  ids = jnp.array([[1, 2, 1], [1, 9, 2]], jnp.int32)
  new, _ = step(params, tx.init(params), ids)
  moved = np.linalg.norm(np.asarray(new['table'] - table), axis=1)
  norms = np.linalg.norm(np.asarray(table), axis=1)
  # Each row moved by count * coef * ||w|| (the gradient is far larger).
  for row, count in ((1, 3), (2, 2), (9, 1)):
    np.testing.assert_allclose(moved[row], count * 0.01 * norms[row],
                               rtol=1e-4)
  assert (np.delete(moved, [1, 2, 9]) == 0).all()
  # `w` has no counts: it passes unclipped.
  assert np.abs(np.asarray(new['w']) - 1).max() > 1.0


_to_dense = jax.jit(SparseRows.to_dense)


def _one_step(tx, counts, ids=(1, 1, 4)):
  params = {'table': jnp.ones((R, D))}
  grads = {'table': SparseRows(jnp.array(ids), jnp.ones((len(ids), D)), R)}
  return jax.jit(lambda g, s, p, c: tx.update(g, s, p, counts=c))(
      grads, tx.init(params), params, counts)


def test_cowclip_refuses_missing_or_mismatched_counts():
  tx = lazy_optax.lazy(lazy_optax.cowclip())
  params = {'table': jnp.ones((R, D))}
  grads = {'table': SparseRows(jnp.array([1, 1, 4]), jnp.ones((3, D)), R)}
  with pytest.raises(ValueError, match='cowclip needs counts='):
    tx.update(grads, tx.init(params), params)
  with pytest.raises(ValueError, match='cowclip needs params'):
    lazy_optax.cowclip().update(grads, optax.EmptyState(), None, counts={})
  with pytest.raises(ValueError, match='hold 2 ids, its gradient 3'):
    _one_step(tx, {'table': lazy_optax.id_counts(jnp.array([1, 4]), R)})
  with pytest.raises(ValueError, match='num_rows=41'):
    _one_step(tx, {'table': lazy_optax.id_counts(jnp.array([1, 1, 4]), 41)})
  with pytest.raises(TypeError, match='SparseRows'):
    _one_step(tx, {'table': jnp.ones(3)})
  # The same number of ids, other ids: refused when the step runs.
  with pytest.raises(Exception, match='name other ids than its gradient'):
    jax.block_until_ready(_one_step(
        tx, {'table': lazy_optax.id_counts(jnp.array([1, 2, 4]), R)}))
  u, _ = _one_step(tx, {'table': lazy_optax.id_counts(jnp.array([4, 1, 1]),
                                                      R)})
  # Densified in one program (eagerly, decoding the ids is many small ops).
  assert np.asarray(_to_dense(u['table']))[1].sum() != 0
  with pytest.raises(ValueError, match='coef must be'):
    lazy_optax.cowclip(coef=-1.0)
  with pytest.raises(ValueError, match='max_norm must be'):
    lazy_optax.row_max_norm(0.0)


def test_cowclip_checks_every_tables_counts_in_one_check_naming_the_table():
  # One run-time check for the whole update: the error names the table
  # whose counts name other ids, and only that one.
  tx = lazy_optax.lazy(lazy_optax.cowclip())
  params = {'a': jnp.ones((R, D)), 'b': jnp.ones((R, D))}

  @jax.jit
  def step(ids, count_ids, state, params):
    grads = {k: SparseRows(ids, jnp.ones((3, D)), R) for k in params}
    counts = {k: lazy_optax.id_counts(count_ids[k], R) for k in params}
    return tx.update(grads, state, params, counts=counts)

  ids = jnp.array([1, 1, 4])
  with pytest.raises(Exception, match=r"\['b'\] \(2 slots differ\)") as e:
    jax.block_until_ready(step(ids, {'a': ids, 'b': jnp.array([1, 2, 4])},
                               tx.init(params), params))
  assert "['a']" not in str(e.value)
  same = {'a': ids, 'b': ids}
  text = step.lower(ids, same, tx.init(params), params).compile().as_text()
  assert len(re.findall(r'custom_call_target="[^"]*callback', text)) == 1
  u, _ = step(ids, same, tx.init(params), params)
  np.testing.assert_array_equal(np.asarray(_to_dense(u['a'])),
                                np.asarray(_to_dense(u['b'])))


def test_max_norm_bounds_written_rows_only_at_update_time():
  # A row above the bound that the batch does not touch stays as it is.
  table = jnp.asarray(np.full((R, D), 2.0), jnp.float32)
  tx = lazy_optax.lazy(optax.chain(optax.sgd(0.1),
                                   lazy_optax.row_max_norm(1.5)))
  params = {'table': table}
  grads = {'table': SparseRows(jnp.array([3, 3, 8]), jnp.ones((3, D)), R)}
  u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  # Added in one program (eagerly, decoding the ids is many small ops).
  new = np.asarray(jax.jit(lazy_optax.apply_updates)(params, u)['table'])
  norms = np.linalg.norm(new, axis=1)
  np.testing.assert_allclose(norms[[3, 8]], 1.5, rtol=1e-6)
  np.testing.assert_allclose(new[3] / norms[3], np.full(D, 3 ** -0.5),
                             rtol=1e-6)
  np.testing.assert_array_equal(np.delete(new, [3, 8], axis=0), 2.0)
  with pytest.raises(ValueError, match='row_max_norm needs params'):
    tx.update(grads, tx.init(params))


@functools.cache
def _max_norm_steps(table_dtype, update_dtype):
  """A max-norm step applied as a train step does, and with the update's
  rows added after a pytree round trip.

  Made once per pair of dtypes in a process: the tests that jit the same
  function reuse its trace and compiled program."""
  rows, width = 50, 19  # rows of 8 + 8 + 3 values: every loop of the kernel
  rng = np.random.default_rng(5)
  params = {'table': jnp.asarray(rng.normal(size=(rows, width)) * 0.3,
                                 table_dtype)}
  ids = jnp.asarray(rng.integers(0, rows, 40))
  values = jnp.asarray(rng.normal(size=(40, width)), update_dtype)
  tx = lazy_optax.lazy(optax.chain(
      lazy_optax.scale_by_rowwise_adagrad(),
      optax.scale_by_learning_rate(0.4),
      lazy_optax.row_max_norm(1.2)))
  state = tx.init(params)

  def update(params):
    grads = {'table': SparseRows(ids, values, rows)}
    return tx.update(grads, state, params)[0]

  def fused(params):
    return lazy_optax.apply_updates(params, update(params))

  def unfused(params):
    u = update(params)
    u = jax.tree.map(lambda x: x, u)  # a round trip keeps the rows
    return lazy_optax.apply_updates(params, u), u

  return params, ids, update, fused, unfused


@pytest.mark.parametrize('table_dtype,update_dtype', [
    (jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_max_norm_step_bounds_the_rows_it_writes(table_dtype, update_dtype):
  params, ids, _, fused, unfused = _max_norm_steps(table_dtype,
                                                   update_dtype)
  got = np.asarray(jax.jit(fused)(params)['table'].astype(jnp.float32))
  want, u = jax.jit(unfused)(params)
  np.testing.assert_array_equal(
      got, np.asarray(want['table'].astype(jnp.float32)))
  # And the float64 model: the old rows plus the update, touched rows within
  # the bound, some of them clipped.
  old = np.asarray(params['table'].astype(jnp.float32), np.float64)
  u64 = np.asarray(_to_dense(u['table']).astype(jnp.float32), np.float64)
  tol = 1e-2 if jnp.bfloat16 in (table_dtype, update_dtype) else 1e-6
  np.testing.assert_allclose(got, old + u64, rtol=tol, atol=tol)
  touched = np.unique(np.asarray(ids))
  norms = np.linalg.norm(got[touched].astype(np.float64), axis=1)
  assert norms.max() <= 1.2 * (1 + tol)
  assert np.sum(norms > 1.2 * (1 - tol)) >= 3
  untouched = np.setdiff1d(np.arange(old.shape[0]), touched)
  np.testing.assert_array_equal(got[untouched], old[untouched])


def test_max_norm_update_added_to_other_parameters_adds_its_rows():
  # The update read the rows of `params`; added to another array it is its
  # rows, as any update is (no clip against the other array's rows).
  params, _, update, _, unfused = _max_norm_steps(jnp.float32, jnp.float32)
  other = jnp.full(params['table'].shape, 3.0, jnp.float32)

  @jax.jit
  def onto_other(params, other):
    return lazy_optax.apply_updates({'table': other}, update(params))['table']

  got = np.asarray(onto_other(params, other))
  u = jax.jit(unfused)(params)[1]['table']
  np.testing.assert_array_equal(got, np.asarray(other + _to_dense(u)))
  assert np.abs(got - 3.0).max() > 0.1


@pytest.mark.parametrize('impl', IMPLS)
def test_explain_update_names_the_rule_with_tables(impl):
  # The clip has no table to update in place: XLA computes it on the rows,
  # and the report is the rule's whose tables lazy hands over.
  params = {'table': jnp.ones((R, 16))}
  grads = {'table': SparseRows(jnp.array([1]), jnp.ones((1, 16)), R)}
  tx = lazy_optax.lazy(optax.chain(
      lazy_optax.scale_by_rowwise_adagrad(impl=impl),
      lazy_optax.row_max_norm(1.0)), impl=impl)
  choice = lazy_optax.explain_update(tx, grads, tx.init(params), params)
  assert choice['table'].rule == 'rowwise_adagrad'
  assert choice['table'].impl == impl
  text = jax.jit(tx.update).lower(grads, tx.init(params),
                                  params).compile().as_text()
  assert ('LazyOptaxRowwiseAdagrad' in text) == (impl == 'cpu_kernel')


@pytest.mark.parametrize('impl', ['xla', 'generic', 'cpu_kernel'])
def test_impl_of_a_rule_without_state_is_deprecated(impl):
  with pytest.warns(DeprecationWarning, match='has no effect.*0.3'):
    lazy_optax.row_max_norm(1.0, impl=impl)
  with pytest.warns(DeprecationWarning, match='cowclip.*has no effect'):
    lazy_optax.cowclip(impl=impl)
  with pytest.raises(ValueError, match='impl'):
    lazy_optax.row_max_norm(1.0, impl='fast')
