"""Checks in fresh processes on N simulated CPU devices, started fast.

Some checks need a process of their own: one with several CPU devices
(XLA_FLAGS names the count before jax is imported), or one where the CPU
kernels are not loaded yet. Instead of starting Python, jax and lazy_optax
anew for each check, every pytest process starts one server per kind (the
first time a test needs it) that imports them once, without creating any
device, and forks a child for each check: every check starts from the same
state as a new process (no devices created, no CPU kernels loaded, nothing
compiled or cached in memory), and nothing it does reaches the next one.

    out = fork_server.call('sharded_checks', 'run_mode', 'duplicates',
                           devices=8)

runs `sharded_checks.run_mode('duplicates')` (a module of tests/) in such a
child and returns what it returned, through JSON (tuples come back as
lists); with `with_stdout=True`, also what it printed. A check that raises
fails the test that sent it, with the check's traceback.

    runs = fork_server.run_scripts([code] * 3, {'CXX': '/bin/false'})

runs the Python source `code` in 3 such processes at once, with those
variables added to the environment, as `python -c code` would (their
outputs are the file descriptors 1 and 2); one `Script` each.

    python3 tests/fork_server.py DEVICES MODULE...

is such a server: it imports the modules, then reads one JSON request a
line on stdin and writes one answer a line on stdout (lines starting with
the marker below; anything else on stdout is skipped).
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
from typing import NamedTuple

import gc_tuning

_MARKER = '@@fork-server@@ '
_TIMEOUT_S = 900
# What the checks import, imported once by the forking process (importing
# them creates no device and starts no XLA thread).
PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'orbax.checkpoint',
             'lazy_optax')
_SERVERS: dict = {}


def environment(devices=1):
  """A server's environment: this one, on `devices` CPU devices (x64 off)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  if devices > 1:
    env['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                        + f' --xla_force_host_platform_device_count={devices}')
  env.pop('JAX_ENABLE_X64', None)
  return env


def _start(key):
  devices, preloaded = key
  log = tempfile.TemporaryFile(mode='a+')  # its stderr, for failures
  proc = subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), str(devices), *preloaded],
      env=environment(devices), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      stderr=log, text=True, bufsize=1)
  _SERVERS[key] = {'proc': proc, 'log': log}
  return proc


def _stop(key):
  server = _SERVERS.pop(key, {})
  proc = server.get('proc')
  if proc is not None:
    with contextlib.suppress(OSError):
      proc.stdin.close()
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    proc.stdout.close()
  if server.get('log') is not None:
    server['log'].close()


@atexit.register
def _stop_all():
  # Every server is told to end before any is waited for: they exit at once.
  for server in _SERVERS.values():
    with contextlib.suppress(OSError):
      server['proc'].stdin.close()
  for key in list(_SERVERS):
    _stop(key)


def _stderr_tail(key):
  log = _SERVERS[key]['log']
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


def call(module, function, *args, devices, with_stdout=False,
         preloaded=PRELOADED):
  """Runs `module.function(*args)` in a fresh process; returns its result.

  Args:
    module: the name of a module of tests/ (imported there).
    function: the name of a function of that module.
    *args: its arguments (JSON values).
    devices: the number of CPU devices of that process.
    with_stdout: also return what the function printed.
    preloaded: the modules imported before forking (one server per
      `devices` and `preloaded`).

  Returns:
    What the function returned, through JSON; with `with_stdout`, the pair
    (that, what it printed).

  Raises:
    AssertionError: the check failed (its traceback), or the process died
      or did not answer within 15 minutes (its stderr).
  """
  key = (devices, tuple(preloaded))
  proc = _SERVERS.get(key, {}).get('proc')
  if proc is None or proc.poll() is not None:
    _stop(key)
    proc = _start(key)
  proc.stdin.write(json.dumps([module, function, list(args)]) + '\n')
  proc.stdin.flush()
  answer = _answer(proc)
  where = f'{module}.{function}{tuple(args)} on {devices} device(s)'
  if answer is None:
    tail = _stderr_tail(key)
    proc.kill()
    _stop(key)
    raise AssertionError(f'the server died or hung in {where}:\n{tail}')
  if 'error' in answer:
    tail = _stderr_tail(key) if answer.get('crashed') else ''
    raise AssertionError(f'{where} failed:\n{answer["error"]}\n{tail}')
  if with_stdout:
    return answer['result'], answer['stdout']
  return answer['result']


class Script(NamedTuple):
  """How a script ended, as `subprocess.run(..., text=True)` tells it."""
  returncode: int
  stdout: str
  stderr: str


def run_scripts(codes, env, *, devices=1, preloaded=PRELOADED):
  """Runs each Python source of `codes` in a fresh process, all at once.

  Args:
    codes: Python sources, each run as `python -c code` runs it.
    env: variables added to (or replacing in) the environment of the runs.
    devices: the number of CPU devices of those processes.
    preloaded: the modules imported before forking.

  Returns:
    One `Script` per source.
  """
  runs = call('fork_server', '_scripts', list(codes), env, devices=devices,
              preloaded=preloaded)
  return [Script(*run) for run in runs]


def _script(code, env, out, err):
  """In a forked process: runs `code`, its outputs to `out` and `err`."""
  os.environ.update(env)
  for fd, path in ((1, out), (2, err)):
    target = os.open(path, os.O_WRONLY)
    os.dup2(target, fd)
    os.close(target)
  sys.stdout = open(1, 'w', closefd=False)  # pylint: disable=consider-using-with
  sys.stderr = open(2, 'w', closefd=False)  # pylint: disable=consider-using-with
  code_of_exit = 0
  try:
    exec(compile(code, '<string>', 'exec'), {'__name__': '__main__'})  # pylint: disable=exec-used
  except SystemExit as e:
    code_of_exit = e.code if isinstance(e.code, int) else 0 if (
        e.code is None) else 1
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code_of_exit = 1
  sys.stdout.flush()
  sys.stderr.flush()
  return code_of_exit


def _scripts(codes, env):
  """A forked process per code, all at once: [[exit code, out, err]...]."""
  with tempfile.TemporaryDirectory() as folder:
    paths, pids = [], []
    for i, code in enumerate(codes):
      out, err = (os.path.join(folder, f'{i}.{x}') for x in ('out', 'err'))
      for path in (out, err):
        open(path, 'w').close()  # pylint: disable=consider-using-with
      paths.append((out, err))
      pid = os.fork()
      if pid == 0:  # leave without the parent's atexit, as a process ends
        status = 1
        try:
          status = _script(code, env, out, err)
        finally:
          os._exit(status)  # pylint: disable=protected-access
      pids.append(pid)
    runs = []
    for pid, (out, err) in zip(pids, paths):
      _, status = os.waitpid(pid, 0)
      with open(out) as f, open(err) as g:
        runs.append([os.waitstatus_to_exitcode(status), f.read(), g.read()])
  return runs


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


def serve(preloaded):
  for name in preloaded:
    importlib.import_module(name)
  gc_tuning.fewer_collections()
  out = sys.stdout
  for request in sys.stdin:
    out.write(_MARKER + json.dumps(_in_child(request)) + '\n')
    out.flush()


if __name__ == '__main__':
  serve(sys.argv[2:])
