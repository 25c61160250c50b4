"""Checks on 8 simulated CPU devices, each in a fresh process, started fast.

XLA_FLAGS must name the device count before jax is imported, so these checks
cannot run in the pytest process (one device). Instead of starting Python,
jax and lazy_optax anew for each check, every pytest process starts one
process with 8 CPU devices (the first time a test needs it) that imports
them once, without creating any device, and forks a child for each check:
every check starts from the same state as a new process (no devices
created, no CPU kernels loaded, nothing compiled or cached in memory), and
nothing it does reaches the next one.

    out = eight_devices.call('sharded_checks', 'run_mode', 'duplicates')

runs `sharded_checks.run_mode('duplicates')` (a module of tests/) in such a
child and returns what it returned, through JSON (tuples come back as
lists); with `with_stdout=True`, also what it printed. A check that raises
fails the test that sent it, with the check's traceback.

    python3 tests/eight_devices.py

is that process: one JSON request a line on stdin, one answer a line on
stdout (lines starting with the marker below; anything else on stdout is
skipped).
"""

import atexit
import contextlib
import importlib
import io
import json
import os
import select
import subprocess
import sys
import tempfile
import traceback

_MARKER = '@@eight-devices@@ '
_TIMEOUT_S = 900
# What every check imports, imported once by the forking process (importing
# them creates no device and starts no XLA thread).
_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'orbax.checkpoint',
              'lazy_optax')
_SERVER: dict = {}


def environment():
  """The 8-device process's environment: this one, with 8 CPU devices."""
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=os.environ.get('XLA_FLAGS', '')
             + ' --xla_force_host_platform_device_count=8')
  env.pop('JAX_ENABLE_X64', None)
  return env


def _start():
  log = tempfile.TemporaryFile(mode='a+')  # its stderr, for failures
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                          env=environment(), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=log, text=True,
                          bufsize=1)
  _SERVER.update(proc=proc, log=log)
  return proc


def _stop():
  proc = _SERVER.pop('proc', None)
  if proc is not None:
    with contextlib.suppress(OSError):
      proc.stdin.close()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    proc.stdout.close()
  log = _SERVER.pop('log', None)
  if log is not None:
    log.close()


atexit.register(_stop)


def _stderr_tail():
  log = _SERVER['log']
  log.flush()
  log.seek(0)
  return log.read()[-6000:]


def _answer(proc):
  """The next answer line of `proc`, or None if it died or timed out."""
  while True:
    ready, _, _ = select.select([proc.stdout], [], [], _TIMEOUT_S)
    line = proc.stdout.readline() if ready else ''
    if not line:
      return None
    if line.startswith(_MARKER):
      return json.loads(line[len(_MARKER):])


def call(module, function, *args, with_stdout=False):
  """Runs `module.function(*args)` on 8 devices; returns its result.

  Args:
    module: the name of a module of tests/ (imported there).
    function: the name of a function of that module.
    *args: its arguments (JSON values).
    with_stdout: also return what the function printed.

  Returns:
    What the function returned, through JSON; with `with_stdout`, the pair
    (that, what it printed).

  Raises:
    AssertionError: the check failed (its traceback), or the process died
      or did not answer within 15 minutes (its stderr).
  """
  proc = _SERVER.get('proc')
  if proc is None or proc.poll() is not None:
    _stop()
    proc = _start()
  proc.stdin.write(json.dumps([module, function, list(args)]) + '\n')
  proc.stdin.flush()
  answer = _answer(proc)
  if answer is None:
    tail = _stderr_tail()
    proc.kill()
    _stop()
    raise AssertionError(
        f'the 8-device process died or hung in {module}.{function}{args}:\n'
        + tail)
  if 'error' in answer:
    tail = _stderr_tail() if answer.get('crashed') else ''
    raise AssertionError(f'{module}.{function}{tuple(args)} failed on 8 '
                         f'devices:\n{answer["error"]}\n{tail}')
  if with_stdout:
    return answer['result'], answer['stdout']
  return answer['result']


def _run_one(request):
  module, function, args = json.loads(request)
  printed = io.StringIO()
  try:
    with contextlib.redirect_stdout(printed):
      result = getattr(importlib.import_module(module), function)(*args)
    return {'result': result, 'stdout': printed.getvalue()}
  except Exception:  # pylint: disable=broad-except
    return {'error': printed.getvalue()[-2000:] + traceback.format_exc()}


def _in_child(request):
  """`_run_one(request)` in a forked child: its answer."""
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # the child: answer, then leave without the parent's atexit
    os.close(read)
    try:
      with os.fdopen(write, 'w') as pipe:
        pipe.write(json.dumps(_run_one(request)))
    finally:
      os._exit(0)  # pylint: disable=protected-access
  os.close(write)
  with os.fdopen(read) as pipe:
    text = pipe.read()
  _, status = os.waitpid(pid, 0)
  if not text:
    return {'error': f'the check process ended without an answer (wait '
                     f'status {status})', 'crashed': True}
  return json.loads(text)


def serve():
  for name in _PRELOADED:
    importlib.import_module(name)
  out = sys.stdout
  for request in sys.stdin:
    out.write(_MARKER + json.dumps(_in_child(request)) + '\n')
    out.flush()


if __name__ == '__main__':
  serve()
