"""The CPU kernels are a visible, safe choice: where they come from, and never
a file that cannot be trusted, a crash, or a build inside a trace.

Each case runs in a fresh process (the kernels load once per process) with
its own cache folder: a forked child of one process that imported jax and
lazy_optax and loaded no kernels (tests/fork_server.py), in the state of a
new `python -c`. The library is built once for the module, by three
processes starting together on an empty cache (one builds, the others wait
and load it; the compiler hands out the library this run already built,
if any, see `started_together`); a case that needs a cache already holding
it gets a copy. Where a case makes the package build again (a damaged or
untrusted library, an unusable folder), the package runs its whole build
(the compiler command, the temporary file, the checksum, the rename, the
load), but `$CXX` is a compiler cache: the same command line on the same
sources returns the library compiled first instead of compiling it again.
"""

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import fork_server
import pytest

from lazy_optax._src.cpu_kernels import build

_STATUS = textwrap.dedent('''
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format='LOG %(levelname)s %(message)s')
    import lazy_optax
    status = lazy_optax.kernel_status()['cpu_kernel']
    lazy_optax.kernel_status()          # a second look logs nothing more
    print('STATUS', status.available, status.detail)
''')


# The compiler the cases use: the system's, at -O0, behind a cache.
_COMPILER_CACHE = textwrap.dedent('''\
    #!{python}
    """A C++ compiler at -O0 that compiles each command once.

    A command that writes a file (-o) is keyed by its arguments, less the
    output's name, and the bytes of every argument that is a file (the
    sources); a command seen before copies the file it wrote then. With
    LAZY_OPTAX_TEST_CXX_FRESH=1 it always compiles (and records the result),
    unless LAZY_OPTAX_TEST_CXX_SEED names the library this very command
    already wrote (the package's own build, at its own -O3): it copies that.
    """
    import fcntl, hashlib, os, shutil, subprocess, sys
    REAL, STORE = {real!r}, {store!r}
    args = sys.argv[1:]
    if '-o' not in args:
      os.execv(REAL, [REAL, *args])
    out = args[args.index('-o') + 1]
    key = hashlib.sha256()
    for i, arg in enumerate(args):
      if i == args.index('-o') + 1:
        continue
      key.update(arg.encode() + b'\\0')
      if os.path.isfile(arg):
        with open(arg, 'rb') as f:
          key.update(f.read())
    kept = os.path.join(STORE, key.hexdigest() + '.so')
    with open(os.path.join(STORE, '.lock'), 'w') as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if (os.path.exists(kept)
          and os.environ.get('LAZY_OPTAX_TEST_CXX_FRESH') != '1'):
        shutil.copyfile(kept, out)
        sys.exit(0)
      seed = os.environ.get('LAZY_OPTAX_TEST_CXX_SEED')
      if seed:
        shutil.copyfile(seed, out)
        code = 0
      else:
        code = subprocess.run([REAL, *args, '-O0']).returncode
      if code == 0:
        shutil.copyfile(out, kept)
    sys.exit(code)
    ''')


@pytest.fixture(scope='module', autouse=True)
def _quick_compiler(tmp_path_factory):
  """`$CXX` for these tests: the system's compiler at -O0, with a cache.

  The cases check where a library comes from and when it is trusted, not
  its speed or its compilation; an unoptimized build takes a third of the
  time, and a build repeated on the same sources copies the first one. A
  case that sets `CXX` itself (no compiler, a broken one) still overrides
  it.
  """
  folder = tmp_path_factory.mktemp('quick_cxx')
  store = folder / 'compiled'
  store.mkdir()
  script = folder / 'c++'
  script.write_text(_COMPILER_CACHE.format(
      python=sys.executable, real=build.compiler(), store=str(store)))
  script.chmod(0o755)
  _QUICK_CXX['CXX'] = str(script)
  yield store
  _QUICK_CXX.clear()


_QUICK_CXX: dict = {}

# One worker runs the module: the library is compiled once.
pytestmark = pytest.mark.xdist_group('kernel_cache')


# The modules a case's process starts with: not orbax, whose import adds a
# handler to the root logger (a case's logging.basicConfig would do nothing).
_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')


def _scripts(code, cache, count, env):
  """`code` run by `count` fresh processes at once on `cache`.

  Each is a forked child of a process that imported jax and lazy_optax but
  loaded no kernels (tests/fork_server.py), as a new `python -c code` is:
  the variables below are set before lazy_optax reads them (when the
  kernels are first looked for, never at import).
  """
  environ = dict(LAZY_OPTAX_CACHE=str(cache), **_QUICK_CXX)
  environ.update(env)
  return fork_server.run_scripts([code] * count, environ,
                                 preloaded=_PRELOADED)


def _run(code, cache, **env):
  (done,) = _scripts(code, cache, 1, env)
  return done


def _status(done):
  assert done.returncode == 0, done.stderr[-3000:]
  line = [x for x in done.stdout.splitlines() if x.startswith('STATUS')][-1]
  _, available, detail = line.split(' ', 2)
  logs = [x for x in done.stdout.splitlines() if x.startswith('LOG')]
  return available == 'True', detail, logs


def _start_together(cache, n, **env):
  """Starts `n` processes on `cache` at once; their outputs."""
  return [done.stdout for done in _scripts(_STATUS, cache, n, env)]


@pytest.fixture(scope='module')
def started_together(tmp_path_factory):
  """Three processes starting together on an empty cache folder.

  The only build of the module that reaches the compiler (the compiler
  cache is bypassed): the library that the other cases copy, or that the
  compiler cache hands out where they make the package build it again.
  Where this run's kernels are already built (the kernel cache of the
  pytest process holds a verified library: the package compiled this very
  command there, at -O3), the compiler hands out that library instead of
  compiling the same sources again; the package's build around it (lock,
  temporary file, checksum, rename, load) runs all the same.
  """
  cache = tmp_path_factory.mktemp('kernel_cache')
  os.chmod(cache, 0o700)
  seed = {}
  found = build.find(build=False)   # looks, never builds
  if found.origin == 'cache':
    seed['LAZY_OPTAX_TEST_CXX_SEED'] = found.path
  return cache, _start_together(cache, 3, LAZY_OPTAX_TEST_CXX_FRESH='1',
                                **seed)


@pytest.fixture(scope='module')
def built(started_together):
  """A cache folder holding the library, built once for these tests."""
  cache, outs = started_together
  details = [x for out in outs for x in out.splitlines()
             if x.startswith('STATUS')]
  assert len(details) == 3 and all(
      x.startswith('STATUS True') for x in details), outs
  assert sum('(built)' in x for x in details) == 1, details
  return cache


def _copy_cache(built_cache, to):
  shutil.copytree(built_cache, to)
  os.chmod(to, 0o700)
  return to


def _library(cache):
  (lib,) = [p for p in pathlib.Path(cache).glob('rows_*.so')]
  return lib


def _evil_library(tmp_path, marker):
  """A library that writes `marker` when it is loaded."""
  source = tmp_path / 'evil.c'
  source.write_text(
      '#include <stdio.h>\n'
      '__attribute__((constructor)) static void run(void) {\n'
      f'  FILE* f = fopen("{marker}", "w"); if (f) fclose(f);\n'
      '}\n')
  out = tmp_path / 'evil.so'
  subprocess.run([build.compiler(), '-shared', '-fPIC', str(source), '-o',
                  str(out)], check=True)
  return out


def _plant(library, evil):
  """Puts `evil` where `library` was, with a checksum that matches it."""
  shutil.copyfile(evil, library)
  pathlib.Path(str(library) + '.sha256').write_text(
      hashlib.sha256(library.read_bytes()).hexdigest())


def test_the_cached_library_is_loaded_and_named(built, tmp_path):
  cache = _copy_cache(built, tmp_path / 'cache')
  available, detail, logs = _status(_run(_STATUS, cache))
  assert available
  assert str(_library(cache)) in detail and '(cache)' in detail
  assert not [x for x in logs if 'WARNING' in x], logs


@pytest.mark.parametrize('damage', ['truncated', 'empty'])
def test_a_damaged_library_is_rebuilt_never_loaded(built, tmp_path, damage):
  cache = _copy_cache(built, tmp_path / 'cache')
  lib = _library(cache)
  data = lib.read_bytes()
  if damage == 'truncated':  # once killed Python with SIGBUS when loaded
    lib.write_bytes(data[:len(data) // 2])
  else:
    lib.write_bytes(b'')
  available, detail, logs = _status(_run(_STATUS, cache))
  assert available and '(built)' in detail, detail
  assert any('SHA-256' in x for x in logs), logs
  assert lib.read_bytes() == data or len(lib.read_bytes()) > len(data) // 2


def test_a_library_owned_by_another_user_is_not_loaded(built, tmp_path):
  if os.getuid() != 0:
    pytest.skip('needs root to give a file to another user')
  cache = _copy_cache(built, tmp_path / 'cache')
  marker = tmp_path / 'evil_code_ran'
  lib = _library(cache)
  _plant(lib, _evil_library(tmp_path, marker))
  os.chown(lib, 12345, 12345)
  available, detail, logs = _status(_run(_STATUS, cache))
  assert not marker.exists()
  assert available and '(built)' in detail, detail
  assert any('owned by another user' in x for x in logs), logs


def test_a_cache_folder_writable_by_others_is_not_used(built, tmp_path):
  cache = _copy_cache(built, tmp_path / 'cache')
  marker = tmp_path / 'evil_code_ran'
  lib = _library(cache)
  _plant(lib, _evil_library(tmp_path, marker))  # checksum matches it
  os.chmod(cache, 0o777)
  available, detail, logs = _status(_run(_STATUS, cache))
  assert not marker.exists()
  assert available and str(cache) not in detail and '(built)' in detail
  assert any('writable by group or others' in x and 'private folder' in x
             for x in logs), logs


def test_leftovers_of_an_interrupted_build_are_removed(built, tmp_path):
  cache = _copy_cache(built, tmp_path / 'cache')
  leftover = cache / '.build-interrupted.so'
  leftover.write_bytes(b'half a library')
  available, _, _ = _status(_run(_STATUS, cache))
  assert available and not leftover.exists()


def test_an_uncreatable_cache_folder_builds_privately(built, tmp_path):
  del built  # the compiler cache holds its library
  available, detail, logs = _status(
      _run(_STATUS, '/proc/lazy_optax_cache_cannot_exist'))
  assert available and '(built)' in detail
  assert any('cannot be created' in x for x in logs), logs


_NO_KERNEL_STEP = _STATUS + textwrap.dedent('''
    import jax, jax.numpy as jnp
    tx = lazy_optax.lazy_adam(0.1)
    params = {'t': jnp.zeros((10, 2))}
    state = tx.init(params)
    g = {'t': lazy_optax.SparseRows(jnp.array([1, 1]), jnp.ones((2, 2)), 10)}
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return lazy_optax.apply_updates(p, u), s
    print('HLO', 'LazyOptax' in jax.jit(step).lower(params, state, g).as_text())
    print('ROW', [round(x, 4) for x in
                 jax.jit(step)(params, state, g)[0]['t'][1].tolist()])
    print('WHY', lazy_optax.explain_update(tx, g, state, params)['t'].reason)
    try:
      lazy_optax.lazy_adam(0.1, impl='cpu_kernel').update(g, state, params)
    except ValueError as e:
      print('REFUSED', e)
''')


@pytest.mark.parametrize('how', ['no compiler', 'broken compiler', 'off'])
def test_without_kernels_the_xla_path_runs_and_says_why(tmp_path, how):
  python_only = str(pathlib.Path(sys.executable).parent)
  env = {'no compiler': dict(PATH=python_only, CXX=''),
         'broken compiler': dict(CXX='/bin/false'),
         'off': dict(LAZY_OPTAX_CPU_KERNELS='0')}[how]
  done = _run(_NO_KERNEL_STEP, tmp_path / 'cache', **env)
  available, detail, logs = _status(done)
  assert not available
  expected = {'no compiler': 'no C++ compiler', 'broken compiler':
              'the build failed', 'off': 'LAZY_OPTAX_CPU_KERNELS=0'}[how]
  assert expected in detail, detail
  warnings = [x for x in logs if 'WARNING' in x]
  assert len(warnings) == (0 if how == 'off' else 1), logs  # logged once
  out = done.stdout
  assert 'HLO False' in out
  assert 'ROW [-0.1' in out  # the step ran on XLA's path
  assert expected in out.split('WHY', 1)[1].split('\n', 1)[0]
  assert 'REFUSED' in out and expected in out.split('REFUSED', 1)[1]


def test_nothing_is_built_or_loaded_inside_a_trace(tmp_path):
  code = textwrap.dedent('''
      import jax, jax.numpy as jnp
      import lazy_optax
      from lazy_optax._src import cpu_kernels
      tx = lazy_optax.lazy_adam(0.1)
      params = {'t': jnp.zeros((10, 2))}
      state = jax.jit(tx.init)(params)      # init traced: nothing loads
      g = {'t': lazy_optax.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 10)}
      def step(p, s, g):
        u, s = tx.update(g, s, p)
        return lazy_optax.apply_updates(p, u), s
      hlo = jax.jit(step).lower(params, state, g).as_text()
      print('TRACED', cpu_kernels.status(), 'LazyOptax' in hlo)
      print('WHY', lazy_optax.explain_update(tx, g, state, params)['t'].reason)
  ''')
  cache = tmp_path / 'cache'
  done = _run(code, cache)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'TRACED None False' in done.stdout
  assert 'not loaded yet' in done.stdout
  assert not cache.exists() or not list(cache.iterdir())
  # Said once, on the lazy_optax logger, how to get the kernels.
  assert done.stderr.count('CPU kernels are not loaded in this process') == 1
  assert 'tx.init outside jax.jit' in done.stderr


def test_a_prebuilt_library_serves_a_machine_without_compiler(built,
                                                              tmp_path):
  # What a platform wheel ships: the library and its checksum in prebuilt/.
  prebuilt = tmp_path / 'prebuilt'
  prebuilt.mkdir()
  shutil.copyfile(_library(built), prebuilt / build.LIBRARY_NAME)
  shutil.copyfile(str(_library(built)) + '.sha256',
                  prebuilt / (build.LIBRARY_NAME + '.sha256'))
  code = ('from lazy_optax._src.cpu_kernels import build\n'
          f'build.PREBUILT_DIR = {str(prebuilt)!r}\n') + _STATUS
  python_only = str(pathlib.Path(sys.executable).parent)
  available, detail, _ = _status(
      _run(code, tmp_path / 'cache', PATH=python_only, CXX=''))
  assert available and '(prebuilt)' in detail, detail
  (prebuilt / build.LIBRARY_NAME).write_bytes(b'not the library')
  available, detail, logs = _status(
      _run(code, tmp_path / 'cache', PATH=python_only, CXX=''))
  assert not available and 'SHA-256' in detail, detail


def test_processes_starting_together_build_once(started_together):
  cache, outs = started_together
  assert all('STATUS True' in out for out in outs), outs
  assert sum('building the CPU kernels' in out for out in outs) == 1, outs
  assert len(list(cache.glob('rows_*.so'))) == 1
