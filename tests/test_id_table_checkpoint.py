"""Every IdTable configuration checkpoints: orbax save, restore elsewhere.

One fresh process (8 simulated CPU devices, a forked child of the 8-device
process of tests/eight_devices.py) saves every configuration's state after
a few steps, and a second, new one restores them all (one of
them sharded over the 8 devices), checking each leaf bit for bit against
what the first wrote, and the shardings: see
`id_table_checkpoint_checks.py`. Two processes for all configurations keep
the run short; each configuration is then its own test case.
"""

import functools

import pytest

import eight_devices
import id_table_checkpoint_checks

NAMES = sorted(id_table_checkpoint_checks.configs())

# One worker runs the two processes for every case (the cache is per process).
pytestmark = pytest.mark.xdist_group('id_table_checkpoint')


def _child(mode, root):
  # A fresh process of 8 devices: a forked child of the 8-device process
  # (tests/eight_devices.py), the save's and the restore's each their own.
  return eight_devices.call('id_table_checkpoint_checks', 'run', mode, root)


@functools.cache
def _restored(root):
  assert _child('save', root) == {'saved': len(NAMES)}
  return _child('restore', root)


@pytest.fixture(scope='module')
def restored(tmp_path_factory):
  return _restored(str(tmp_path_factory.mktemp('id_checkpoints')))


def test_every_combination_is_covered():
  tables = id_table_checkpoint_checks.configs().values()
  combos = {(t.eviction, t.admit_after > 1, t.ttl is None)
            for t, _ in tables}
  assert len(combos) == 3 * 2 * 2
  assert any(sharded for _, sharded in tables)
  assert any(t.eviction_log == 0 for t, _ in tables)
  assert {t.admission for t, _ in tables} == {'frequency', 'always'}


@pytest.mark.parametrize('name', NAMES)
def test_state_restores_bit_for_bit_in_a_new_process(restored, name):
  outcome = restored[name]
  assert isinstance(outcome, dict), outcome      # else: the error message
  assert outcome['admissions'] > 0
