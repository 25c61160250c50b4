"""Moved and renamed public names: each old name warns, names its new place,
and is the very object that lives there (CHANGELOG.md, "Moved and renamed")."""

import importlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import lazy_optax

# Old top-level name -> where it lives now (the CHANGELOG's table).
MOVED = {
    'tree_add': 'lazy_optax.tree.add',
    'tree_scale': 'lazy_optax.tree.scale',
    'tree_psum': 'lazy_optax.tree.psum',
    'tree_pmean': 'lazy_optax.tree.pmean',
    'is_sparse_rows': 'lazy_optax.tree.is_sparse_rows',
    'deduplicate': 'lazy_optax.tree.deduplicate',
    'path_name': 'lazy_optax.tree.path_name',
    'path_labels': 'lazy_optax.tree.path_labels',
    'with_id_checks': 'lazy_optax.checks.with_id_checks',
    'checked': 'lazy_optax.checks.checked',
    'CheckError': 'lazy_optax.checks.CheckError',
    'check_ids_in_range': 'lazy_optax.checks.check_ids_in_range',
    'state_shardings': 'lazy_optax.sharding.state_shardings',
    'init_sharded': 'lazy_optax.sharding.init_sharded',
    'make_train_step': 'lazy_optax.perf.make_train_step',
    'warn_if_not_donated': 'lazy_optax.perf.warn_if_not_donated',
    'advise_huge_pages': 'lazy_optax.perf.advise_huge_pages',
    'apply_updates_stochastic': 'lazy_optax.precision.apply_updates_stochastic',
    'stochastic_round': 'lazy_optax.precision.stochastic_round',
    'multi_steps': 'lazy_optax.wrappers.multi_steps',
    'MultiStepsState': 'lazy_optax.wrappers.MultiStepsState',
    'row_adam': 'lazy_optax.adam_with_counter',
    'scale_by_row_adam': 'lazy_optax.scale_by_adam_with_counter',
    'ScaleByRowAdamState': 'lazy_optax.ScaleByAdamWithCounterState',
    'RowwiseAdagradWithCounterState':
        'lazy_optax.ScaleByRowwiseAdagradWithCounterState',
    'RowwiseRmspropArState': 'lazy_optax.ScaleByRowwiseRmspropArState',
    'FtrlState': 'lazy_optax.ScaleByFtrlState',
    # Silent aliases in 0.1; they warn since 0.2.
    'clipnorm': 'lazy_optax.compat.clipnorm',
    'clipvalue': 'lazy_optax.compat.clipvalue',
    'global_clipnorm': 'lazy_optax.compat.global_clipnorm',
    'get_slot': 'lazy_optax.compat.get_slot',
    'get_slot_names': 'lazy_optax.compat.get_slot_names',
    'global_step': 'lazy_optax.compat.global_step',
    'per_pattern_lr': 'lazy_optax.compat.per_pattern_lr',
}

CORE = ('SparseRows', 'lazy', 'apply_updates', 'lookup', 'lookup_bag',
        'value_and_grad')


def _resolve(dotted):
  module, _, name = dotted.rpartition('.')
  return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize('old', sorted(MOVED))
def test_old_name_warns_names_new_place_and_is_the_same_object(old):
  new = MOVED[old]
  with pytest.warns(DeprecationWarning) as caught:
    obj = getattr(lazy_optax, old)
  assert len(caught) == 1
  message = str(caught[0].message)
  assert f'lazy_optax.{old} is deprecated' in message
  assert f'use {new}.' in message
  assert caught[0].filename == __file__  # points at the caller's line
  assert obj is _resolve(new)


@pytest.mark.parametrize('old', ['tree_add', 'row_adam', 'get_slot'])
def test_from_import_of_an_old_name_warns(old):
  with pytest.warns(DeprecationWarning, match=MOVED[old].replace('.', r'\.')):
    exec(f'from lazy_optax import {old}', {})  # pylint: disable=exec-used


def test_old_names_are_not_public_and_new_names_are():
  for old, new in MOVED.items():
    assert old not in lazy_optax.__all__
    module, _, name = new.rpartition('.')
    assert name in importlib.import_module(module).__all__, new
  assert set(CORE) <= set(lazy_optax.__all__)
  assert len(lazy_optax.__all__) == len(set(lazy_optax.__all__)) == 42


def test_unknown_name_is_an_attribute_error_without_warning():
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    with pytest.raises(AttributeError, match="has no attribute 'no_such'"):
      lazy_optax.no_such  # pylint: disable=pointless-statement
    assert not hasattr(lazy_optax, 'tree_subtract')


def test_importing_and_using_the_new_names_does_not_warn():
  code = ('import lazy_optax, jax.numpy as jnp\n'
          'g = lazy_optax.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)\n'
          'lazy_optax.tree.add(g, g)\n'
          'lazy_optax.adam_with_counter(0.1)\n'
          'lazy_optax.compat.get_slot_names\n'
          'lazy_optax.checks.checked, lazy_optax.perf.make_train_step\n')
  proc = subprocess.run(
      [sys.executable, '-W', 'error::DeprecationWarning', '-c', code],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]


def test_export_changes_function_warns_and_agrees_with_the_method():
  table = lazy_optax.IdTable(capacity=8, probe=4, ttl=2)
  state = table.init()
  # Batches of one length: the table's step compiles once.
  for k, ids in enumerate([[1, 2, 3], [4, 5, 6], [7, 8, 9]]):
    _, state, _ = table.assign(state, np.array(ids), step=3 * k)
  with pytest.warns(DeprecationWarning) as caught:
    old = lazy_optax.export_changes(state, since_step=1)
  assert len(caught) == 1 and caught[0].filename == __file__
  assert 'use lazy_optax.IdTable.export_changes.' in str(caught[0].message)
  new = table.export_changes(state, since_step=1)
  for a, b in zip(old, new):
    np.testing.assert_array_equal(a, b)
  # Ids 1 to 3 expired (ttl=2) at step 3: they are listed as evicted.
  assert {1, 2, 3} <= set(new[2].tolist())


def test_a_gradients_impl_warns_changes_nothing_and_points_at_lazy():
  # The gradient side moves its rows with XLA's ops whatever impl= says:
  # each deprecated form warns from the caller's line, gives what the form
  # without it gives, and says where the choice is made now.
  import jax.numpy as jnp
  ids, values = jnp.array([3, 1, 3]), jnp.ones((3, 2))
  params = {'t': jnp.arange(10.).reshape(5, 2)}

  def loss(p):
    return jnp.sum(lazy_optax.lookup(p['t'], ids) ** 2)

  forms = {
      'SparseRows': lambda impl: lazy_optax.SparseRows(ids, values, 5,
                                                       impl=impl),
      'SparseRows.from_unique': lambda impl: lazy_optax.SparseRows.from_unique(
          ids, values, 5, impl=impl),
      'value_and_grad': lambda impl: lazy_optax.value_and_grad(
          loss, impl=impl)(params)[1]['t'],
  }
  for where, make in forms.items():
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      plain = make('auto')
    with pytest.warns(DeprecationWarning) as caught:
      given = make('xla')
    (message,) = [w for w in caught if 'has no effect' in str(w.message)]
    assert str(message.message).startswith(f"{where}(impl='xla')")
    assert 'lazy(...)' in str(message.message) and '0.3' in str(
        message.message)
    assert message.filename == __file__, (where, message.filename)
    np.testing.assert_array_equal(given.ids, plain.ids)
    np.testing.assert_array_equal(given.values, plain.values)
