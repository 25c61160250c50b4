"""The CPU kernels on row-sharded tables: 8 devices, and 2 processes x 2.

The checks live in kernel_shards.py and run in other processes, since the
device count must be set before JAX starts: the 8-device process of
tests/eight_devices.py, and two processes of 2 devices each.
"""

import os
import socket
import subprocess
import sys

import eight_devices

_SCRIPT = os.path.join(os.path.dirname(__file__), 'kernel_shards.py')


def _env():
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  return env


def test_each_device_updates_its_rows_with_the_kernel_equal_to_one_device():
  _, printed = eight_devices.call('kernel_shards', 'mesh_checks',
                                  with_stdout=True)
  ok = [line for line in printed.splitlines() if line.startswith('OK')]
  assert ok == ['OK lazy_adam', 'OK lazy_adam_amsgrad',
                'OK rowwise_adagrad_l2', 'OK partial_rowwise_adam',
                'OK ftrl', 'OK lookup on an Explicit mesh'], printed


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_two_processes_run_the_documented_multi_host_step_with_the_kernel():
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, _SCRIPT, 'process', str(i),
                             port], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=900) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  ok = sorted(line for out, _ in outs for line in out.splitlines()
              if line.startswith('OK'))
  assert ok == ['OK process 0 of 2 devices 4 cpu_kernel',
                'OK process 1 of 2 devices 4 cpu_kernel'], outs
