import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Subprocesses (the 8-device checks, the guides' snippets) import the package
# of this checkout, as this process does, not whichever copy is installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ['PYTHONPATH'] = os.pathsep.join(
    p for p in (_ROOT, os.environ.get('PYTHONPATH')) if p)


_XLA_FLAGS = os.environ.get('XLA_FLAGS', '')


def pytest_collection_finish(session):
  """The suite runs in one process on one CPU device; the multi-device checks
  run in subprocesses of their own. A helper module that set XLA_FLAGS when
  imported (pytest imports every module for doctests) would silently move
  every test onto 8 simulated devices, off the single-device paths such as
  lazy_adam's CPU kernel."""
  del session
  assert os.environ.get('XLA_FLAGS', '') == _XLA_FLAGS, (
      'a module imported by pytest changed XLA_FLAGS')
  assert '--xla_force_host_platform_device_count' not in os.environ.get(
      'XLA_FLAGS', ''), 'XLA_FLAGS asks for several devices in the main process'
