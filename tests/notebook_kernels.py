"""Jupyter kernels for the notebooks' tests, forked from a pre-imported process.

Each notebook runs in a kernel of its own, a fresh process: starting
Python, IPython's kernel, jax and lazy_optax anew for each was most of a
small notebook's cost. Instead, each pytest process starts one server (the
first time a notebook runs) that imports them once, without creating any
device or starting any thread, and forks a child for each kernel, which then
starts IPython's kernel as `python -m ipykernel_launcher -f FILE` does:
every notebook starts from the same state as in a new kernel (no devices
created, no CPU kernels loaded, nothing compiled or cached in memory, its
own variables only), and nothing it does reaches the next one.

    name, jupyter_path = notebook_kernels.start(base_folder)
    # with JUPYTER_PATH=jupyter_path:
    client = NotebookClient(nb, kernel_name=name, ...)

`start` writes the kernel spec (in a folder to put on JUPYTER_PATH) whose
command is a small launcher: it asks the server for a kernel on the
connection file that Jupyter gave it, forwards the signals it gets to that
kernel, and exits with it.

    python3 tests/notebook_kernels.py serve SOCKET
    python3 tests/notebook_kernels.py launch SOCKET CONNECTION_FILE

are the server and the launcher (the launcher imports nothing else).
"""

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time

NAME = 'lazy_optax_forked_python3'
# What the notebooks import, imported once by the forking process (importing
# them creates no device and starts no thread). matplotlib reads its
# backend from MPLBACKEND when imported: the server's environment names the
# one IPython's kernel sets (where none is set) before the notebook runs.
PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'matplotlib',
             'lazy_optax', 'ipykernel.kernelapp')
INLINE = 'module://matplotlib_inline.backend_inline'
_SERVER: dict = {}


def start(base):
  """Starts this process's server (once); the kernel spec to use.

  Args:
    base: a folder of this pytest process (its socket, its kernel spec and
      its log go in `notebook_kernels/` there).

  Returns:
    `(name, jupyter_path)`: with `jupyter_path` on JUPYTER_PATH, the kernel
    spec `name` starts kernels that the server forks.
  """
  import atexit  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  folder = os.path.join(str(base), 'notebook_kernels')
  jupyter = os.path.join(folder, 'jupyter')
  if 'proc' not in _SERVER or _SERVER['proc'].poll() is not None:
    spec = os.path.join(jupyter, 'kernels', NAME)
    os.makedirs(spec, exist_ok=True)
    path = os.path.join(folder, 'kernels.sock')
    with open(os.path.join(spec, 'kernel.json'), 'w', encoding='utf-8') as f:
      json.dump({'argv': [sys.executable, os.path.abspath(__file__), 'launch',
                          path, '{connection_file}'],
                 'display_name': 'Python 3 (forked)', 'language': 'python',
                 'interrupt_mode': 'signal'}, f)
    env = dict(os.environ)
    env.setdefault('MPLBACKEND', INLINE)
    with open(os.path.join(folder, 'server.log'), 'ab') as log:
      _SERVER['proc'] = subprocess.Popen(  # pylint: disable=consider-using-with
          [sys.executable, os.path.abspath(__file__), 'serve', path],
          env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    atexit.register(_stop)
  return NAME, jupyter


def _stop():
  proc = _SERVER.pop('proc', None)
  if proc is not None and proc.poll() is None:
    proc.terminate()
    proc.wait(timeout=60)


def _lines(conn):
  """The lines `conn` sends, as they come."""
  buffer = b''
  while True:
    data = conn.recv(65536)
    if not data:
      return
    buffer += data
    while b'\n' in buffer:
      line, buffer = buffer.split(b'\n', 1)
      yield json.loads(line)


def _watch(pid):
  """Ends this kernel if its launcher (`pid`) is gone (killed)."""
  while True:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      os._exit(1)  # pylint: disable=protected-access
    time.sleep(1)


def _kernel(request):
  """In the forked child: IPython's kernel, as ipykernel_launcher runs it."""
  # A session of its own, as Jupyter starts a kernel: ipykernel interrupts
  # by signalling its process group, which would otherwise be the pytest
  # process's own (the server's).
  os.setsid()
  os.chdir(request['cwd'])
  os.environ.clear()
  os.environ.update(request['env'])
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  threading.Thread(target=_watch, args=(request['launcher'],),
                   daemon=True).start()
  from ipykernel import kernelapp  # pylint: disable=g-import-not-at-top
  # The parent that Jupyter named, as a kernel reads it from its variables
  # when ipykernel is imported (here, before they were set).
  parent = int(os.environ.get('JPY_PARENT_PID') or 0)
  sys.argv = [sys.argv[0], '-f', request['connection_file'],
              f'--IPKernelApp.parent_handle={parent}']
  kernelapp.IPKernelApp.launch_instance()


def serve(path):
  """Forks a kernel per connection to the socket `path`, one at a time."""
  import importlib  # pylint: disable=g-import-not-at-top
  for name in PRELOADED:
    importlib.import_module(name)
  import gc_tuning  # pylint: disable=g-import-not-at-top  (tests/)
  gc_tuning.fewer_collections()
  server = socket.socket(socket.AF_UNIX)
  if os.path.exists(path):  # left by a server that died
    os.unlink(path)
  server.bind(path)
  server.listen()
  # It ends with the pytest process that started it: an xdist worker leaves
  # with os._exit, without running the atexit hook that stops it. (No
  # thread watches: this process forks.)
  parent = os.getppid()
  server.settimeout(2.0)
  while True:
    try:
      conn, _ = server.accept()
    except TimeoutError:
      if os.getppid() != parent:
        return
      continue
    conn.settimeout(None)
    with conn:
      request = next(_lines(conn))
      pid = os.fork()
      if pid == 0:  # the kernel: runs, then leaves without atexit
        code = 1
        try:
          server.close()
          conn.close()
          _kernel(request)
          code = 0
        except SystemExit as e:
          code = e.code if isinstance(e.code, int) else int(bool(e.code))
        finally:
          sys.stdout.flush()
          sys.stderr.flush()
          os._exit(code)  # pylint: disable=protected-access
      try:
        conn.sendall(json.dumps({'pid': pid}).encode() + b'\n')
      finally:
        _, status = os.waitpid(pid, 0)
      with contextlib.suppress(OSError):  # a launcher killed meanwhile
        conn.sendall(json.dumps(
            {'exit': os.waitstatus_to_exitcode(status)}).encode() + b'\n')


def launch(path, connection_file):
  """The kernel spec's command: a forked kernel, signals passed on."""
  conn = socket.socket(socket.AF_UNIX)
  for _ in range(600):  # the server may still be importing
    try:
      conn.connect(path)
      break
    except (FileNotFoundError, ConnectionRefusedError):
      time.sleep(0.1)
  else:
    conn.connect(path)
  conn.sendall(json.dumps({
      'connection_file': os.path.abspath(connection_file),
      'cwd': os.getcwd(), 'env': dict(os.environ),
      'launcher': os.getpid()}).encode() + b'\n')
  answers = _lines(conn)
  pid = next(answers)['pid']
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
    signal.signal(sig, lambda s, _: os.kill(pid, s))
  code = next(answers)['exit']
  sys.exit(code if code >= 0 else 128 - code)


if __name__ == '__main__':
  if sys.argv[1] == 'serve':
    serve(sys.argv[2])
  else:
    launch(sys.argv[2], sys.argv[3])
