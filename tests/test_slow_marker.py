"""The fast inner loop (`pytest -m 'not slow'`) leaves out what
`tests/slow_tests.py` names: each name must still name a test, or a renamed
slow test would silently join the fast loop."""

import pathlib
import re
import tomllib

import slow_tests

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_slow_file_and_test_exists():
  missing = [f for f in slow_tests.SLOW_FILES if not (ROOT / f).is_file()]
  for path, names in slow_tests.SLOW_TESTS.items():
    text = (ROOT / path).read_text()
    missing += [f'{path}::{name}' for name in names
                if not re.search(rf'^\s*(def|class) {re.escape(name)}\b', text,
                                 re.MULTILINE)]
  assert not missing, missing


def test_slow_marker_is_registered_and_the_default_run_keeps_it():
  options = tomllib.loads((ROOT / 'pyproject.toml').read_text())
  pytest_options = options['tool']['pytest']['ini_options']
  assert any(m.startswith('slow:') for m in pytest_options['markers'])
  # The README's command (what CI runs) selects no marker: it runs them all.
  assert '-m' not in pytest_options['addopts'].split()


def test_is_slow_by_file_and_by_name():
  path, names = next(iter(slow_tests.SLOW_TESTS.items()))
  assert slow_tests.is_slow(path, names[0])
  assert not slow_tests.is_slow(path, 'a_name_no_test_has')
  assert slow_tests.is_slow(next(iter(slow_tests.SLOW_FILES)), 'any')
