"""The CPU kernels on row-sharded tables: 8 devices, and 2 processes x 2.

The checks live in kernel_shards.py and run in other processes, since the
device count must be set before JAX starts: the 8-device process of
tests/eight_devices.py, and two processes of 2 devices each (forked children
of the one-device process of tests/fork_server.py, each naming its 2
devices before its backend starts).
"""

import socket

import eight_devices
import fork_server
from optimizer_cases import MESH_CASES

# What the two processes start with (they need neither orbax nor more).
_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')


def test_each_device_updates_its_rows_with_the_kernel_equal_to_one_device():
  _, printed = eight_devices.call('kernel_shards', 'mesh_checks',
                                  with_stdout=True)
  ok = [line for line in printed.splitlines() if line.startswith('OK')]
  assert ok == [f'OK {case.name}' for case in MESH_CASES] + [
      'OK lookup on an Explicit mesh'], printed
  assert len(MESH_CASES) >= 5


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_run_the_documented_multi_host_step_with_the_kernel():
  # Two fresh processes of 2 devices each, started together: forked
  # children of the one-device process that imported jax and lazy_optax
  # once (tests/fork_server.py; the preloaded modules of
  # tests/test_kernel_cache.py's, so one server serves both). No backend
  # exists there yet: each child names its 2 CPU devices before it starts
  # one (jax's `jax_num_cpu_devices`, as XLA_FLAGS would).
  port = _free_port()
  runs = fork_server.run_scripts(
      ['import jax\njax.config.update("jax_num_cpu_devices", 2)\n'
       f'import kernel_shards\nkernel_shards.process_main({i}, {port})'
       for i in range(2)], {}, preloaded=_PRELOADED)
  for run in runs:
    assert run.returncode == 0, run.stderr[-4000:]
  ok = sorted(line for run in runs for line in run.stdout.splitlines()
              if line.startswith('OK'))
  assert ok == ['OK process 0 of 2 devices 4 cpu_kernel',
                'OK process 1 of 2 devices 4 cpu_kernel'], runs
