import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import gc_tuning  # (tests/, on the path by pyproject.toml's pythonpath)
import pytest
import slow_tests

# Subprocesses (the 8-device checks, the guides' snippets) import the package
# of this checkout, as this process does, not whichever copy is installed,
# and the helpers of tests/ by name.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ['PYTHONPATH'] = os.pathsep.join(
    p for p in (_ROOT, os.path.join(_ROOT, 'tests'),
                os.environ.get('PYTHONPATH')) if p)


# Each xdist worker keeps to its own share of the CPUs (worker k of W takes
# every W-th one from the k-th), before jax starts its threads; what it
# starts (the servers of the multi-device and new-process checks, the
# notebooks' kernels) runs there too, while it waits for them. A process
# free to use both cores of a 2-core machine spent 5.6 to 5.9 CPU s on 4.5
# to 4.8 s of compiling that took 4.8 CPU s on one core, in the same time:
# CPU the other worker then lacks. The whole suite, two pairs of runs
# (unpinned, pinned): 409 -> 368 s and 423 -> 388 s; CPU 789 -> 724 s and
# 817 -> 765 s.
def _keep_to_own_cpus(worker: str, workers: str) -> None:
  if not (worker.startswith('gw') and workers.isdigit()):
    return
  cpus = sorted(os.sched_getaffinity(0))
  mine = cpus[int(worker[2:])::int(workers)]
  if mine:
    os.sched_setaffinity(0, mine)


if hasattr(os, 'sched_setaffinity'):
  _keep_to_own_cpus(os.environ.get('PYTEST_XDIST_WORKER', ''),
                    os.environ.get('PYTEST_XDIST_WORKER_COUNT', ''))


# Programs compiled for checking, not for speed. The suite checks what the
# library computes and which programs it builds (which kernels, copies,
# donations, conditionals); how well XLA optimizes their machine code changes
# none of that, and was half of the suite's CPU time (2,131 -> 1,119 CPU s).
# So every process of the run (they inherit the environment) compiles with
# jax's `jax_disable_most_optimizations` and, where this jaxlib knows the
# flags (one probe per run), XLA's CPU fusion emitters off and each program's
# machine code emitted as one LLVM module (XLA splits it in parts to compile
# them on several threads: for the suite's small programs the split costs
# more than it saves, 40% of the CPU time of XLA's compilations; the code is
# the same). The benchmarks, the demo and the wheel's kernel check in .ci/run
# compile as users do; LAZY_OPTAX_TEST_OPTIMIZED=1 runs the suite that way
# too.
_CHEAP_COMPILES = ('--xla_cpu_use_fusion_emitters=false',
                   '--xla_cpu_parallel_codegen_split_count=1')


def _xla_knows(flags: str) -> bool:
  """Whether this jaxlib starts with `flags` (XLA aborts on unknown flags)."""
  probe = 'import jax.numpy as jnp; jnp.zeros(1).block_until_ready()'
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}")
  return subprocess.run([sys.executable, '-c', probe], env=env,
                        capture_output=True, check=False).returncode == 0


def _known(flags: list[str]) -> list[str]:
  """Those of `flags` this jaxlib knows: one probe when it knows them all."""
  if not flags or _xla_knows(' '.join(flags)):
    return flags
  return [flag for flag in flags if _xla_knows(flag)]


# Bit-for-bit reruns (test_checkpoint_resumes_bit_for_bit): on a GPU XLA's
# scatter-add of duplicate ids is deterministic only with this flag (its
# atomic adds sum them in any order otherwise); a CPU jaxlib knows it too,
# and it changes nothing there. Every run sets it, optimized or not.
_DETERMINISTIC = ('--xla_gpu_deterministic_ops=true',)

_wanted = list(_DETERMINISTIC)
if os.environ.get('LAZY_OPTAX_TEST_OPTIMIZED') != '1':
  os.environ.setdefault('JAX_DISABLE_MOST_OPTIMIZATIONS', '1')
  _wanted += _CHEAP_COMPILES
_flags = os.environ.get('XLA_FLAGS', '')
# A flag the caller set already (any value) stays as set.
_added = _known([f for f in _wanted if f.split('=')[0] not in _flags])
if _added:
  os.environ['XLA_FLAGS'] = ' '.join([_flags, *_added]).strip()


# JAX's persistent compilation cache, shared by every process of the run
# (the xdist workers, the multi-device and new-process checks' servers, the
# notebooks' kernels: they inherit the environment): a program one of them
# compiled, the same HLO for the same devices and options, is read from it
# by the others instead of compiled again. About a quarter of the suite's
# compilations are such repeats (most of them the same small programs
# compiled by each worker). In the directory the caller names
# (JAX_COMPILATION_CACHE_DIR: .ci/run shares one between its run of the
# suite and its run on the oldest versions, which compiles many of the same
# programs), else in one of the run's own, removed when the run ends. Every
# program is written, however short its compilation.
if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(
      prefix='lazy_optax_jax_cache_')
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'],
                  ignore_errors=True)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')

import jax  # noqa: E402  (after the variables above, which it reads)


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
  gc_tuning.fewer_collections()  # the tests' modules are imported now


def pytest_unconfigure(config):
  """A worker process (pytest-xdist) leaves as soon as it is done.

  By then its results have reached the main process. What Python would still
  do before exiting is tear the process down: jax's exit handler frees every
  compiled program and cached trace (6 to 7 s a worker after the full
  suite, on the run's critical path: the main process waits for the last
  worker). The servers it started end by themselves when it is gone (their
  stdin closes; the notebooks' checks for its process).
  """
  del config
  if os.environ.get('PYTEST_XDIST_WORKER'):
    atexit.register(_leave_now)  # registered last: runs first


def _leave_now():
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


# --- The CPU kernels on a machine whose default backend is not the CPU ------
#
# Tables kept in host memory on a GPU machine are a real use: the CPU kernels
# must be tested there too. A test of the kernels (marked `cpu_kernels`, or
# parametrized with an id naming `cpu_kernel`) makes its arrays on the
# default device and compiles its jitted steps for it: where that is not the
# CPU, the test runs under `jax.default_device(the CPU)`, so its arrays live
# on the host, `init` loads the kernels and its steps compile for the CPU. On
# a CPU machine this changes nothing.


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'cpu_kernels: the test runs or inspects the CPU kernels: '
      'where the default backend is not the CPU it runs on the CPU device')


def runs_cpu_kernels(item) -> bool:
  """Whether `item` tests the CPU kernels (its marker or its parameters)."""
  callspec = getattr(item, 'callspec', None)
  return (item.get_closest_marker('cpu_kernels') is not None
          or (callspec is not None and 'cpu_kernel' in callspec.id))


@pytest.fixture(autouse=True)
def _cpu_kernels_on_the_cpu(request):
  if jax.default_backend() == 'cpu' or not runs_cpu_kernels(request.node):
    yield
    return
  with jax.default_device(jax.devices('cpu')[0]):
    yield


# --- The fast inner loop ------------------------------------------------------
#
# `python3 -m pytest -m 'not slow'` leaves out the tests that
# `tests/slow_tests.py` names (measured: the slowest of the suite); the
# README's `python3 -m pytest -q` runs everything. The marker is registered
# in pyproject.toml.


def pytest_collection_modifyitems(config, items):
  del config
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for item in items:
    path = os.path.relpath(str(item.path), root).replace(os.sep, '/')
    name = getattr(item, 'originalname', None) or item.name.split('.')[-1]
    if slow_tests.is_slow(path, name):
      item.add_marker(pytest.mark.slow)
