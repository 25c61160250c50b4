"""Checks on 8 simulated CPU devices, each in a fresh process, started fast.

XLA_FLAGS must name the device count before jax is imported, so these checks
cannot run in the pytest process (one device). They run in the forked
children of one pre-imported process with 8 CPU devices per pytest process
(tests/fork_server.py): every check starts from the same state as a new
process (no devices created, no CPU kernels loaded, nothing compiled or
cached in memory), and nothing it does reaches the next one.

    out = eight_devices.call('sharded_checks', 'run_mode', 'duplicates')

runs `sharded_checks.run_mode('duplicates')` (a module of tests/) in such a
child and returns what it returned, through JSON (tuples come back as
lists); with `with_stdout=True`, also what it printed. A check that raises
fails the test that sent it, with the check's traceback.
"""

import fork_server

DEVICES = 8


def environment():
  """The 8-device process's environment: this one, with 8 CPU devices."""
  return fork_server.environment(DEVICES)


def call(module, function, *args, with_stdout=False):
  """`fork_server.call(module, function, *args)` on 8 devices: its result
  (with `with_stdout`, and what it printed); a failed check raises there."""
  return fork_server.call(module, function, *args, devices=DEVICES,
                          with_stdout=with_stdout)
