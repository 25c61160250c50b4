"""CPU kernels behind public `jax.ffi` calls, built on first use.

XLA CPU reads rows that are not in cache about 3x slower in its gathers and
scatters than a plain row copy does (benchmarks/README.md), and a lazy Adam
step is mostly such reads: the moments of the touched rows. `adam_rows.cc`
does the whole row update of `lazy_adam` (duplicates summed, moments updated
in place, the step of each row) in one pass over the rows, as TensorFlow's
and torch's kernels do.

The source ships with the package and is compiled once per machine with the
system's C++ compiler (`$CXX`, else `c++`/`g++`) against the XLA FFI headers
of the installed jaxlib (`jax.ffi.include_dir()`), into a cache folder
(`$LAZY_OPTAX_CACHE`, else `~/.cache/lazy_optax`), keyed by the source, the
jaxlib version and the compiler. Where any of that is missing or fails, or
with `LAZY_OPTAX_CPU_KERNELS=0`, `available()` is False and `lazy_adam`
keeps its pure-XLA path: the same numbers up to float32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, 'adam_rows.cc')
_TARGET = 'lazy_optax_adam_rows'
ENV_SWITCH = 'LAZY_OPTAX_CPU_KERNELS'


def _cache_dir() -> str:
  return os.environ.get('LAZY_OPTAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'lazy_optax')


def _compiler() -> Optional[str]:
  for name in (os.environ.get('CXX'), 'c++', 'g++', 'clang++'):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _build() -> Optional[str]:
  """Path of the compiled library, building it if needed; None on failure."""
  cxx = _compiler()
  if cxx is None:
    return None
  import jaxlib  # pylint: disable=g-import-not-at-top
  with open(_SOURCE, 'rb') as f:
    source = f.read()
  try:
    version = subprocess.run([cxx, '--version'], capture_output=True,
                             text=True, timeout=60, check=False).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  flags = ['-O3', '-fno-math-errno', '-std=c++17', '-shared', '-fPIC']
  key = hashlib.sha256(source + jaxlib.__version__.encode() + version.encode()
                       + ' '.join(flags).encode()).hexdigest()[:20]
  out = os.path.join(_cache_dir(), f'adam_rows_{key}.so')
  if os.path.exists(out):
    return out
  os.makedirs(_cache_dir(), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix='.so', dir=_cache_dir())
  os.close(fd)
  cmd = [cxx, *flags, '-I', jax.ffi.include_dir(), _SOURCE, '-o', tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          check=False)
  except (OSError, subprocess.SubprocessError):
    done = None
  if done is None or done.returncode != 0:
    os.unlink(tmp)
    return None
  os.replace(tmp, out)  # atomic: concurrent builders agree on one file
  return out


@functools.lru_cache(maxsize=1)
def available() -> bool:
  """Whether the CPU kernels are built, loaded and registered with XLA."""
  if os.environ.get(ENV_SWITCH, '1') == '0':
    return False
  try:
    path = _build()
    if path is None:
      return False
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(
        _TARGET, jax.ffi.pycapsule(lib.LazyOptaxAdamRows), platform='cpu')
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def usable() -> bool:
  """The kernels apply: built, and the computation runs on one CPU device."""
  return (jax.default_backend() == 'cpu' and jax.device_count() == 1
          and available())


def adam_rows(ids: jax.Array, grads: jax.Array, hyper: jax.Array,
              mu: jax.Array, nu: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """lazy_adam's row update: see `adam_rows.cc`.

  Args:
    ids: int32 `[N]`; ids outside `[0, R)` touch no row.
    grads: float32 `[N, D]`.
    hyper: float32 `[7]`: `b1, 1 - b1, b2, 1 - b2, eps, eps_root` and the
      step's bias correction `sqrt(1 - b2^t) / (1 - b1^t)`.
    mu: float32 `[R, D]`, updated in place when donated.
    nu: float32 `[R, D]`, likewise.

  Returns:
    `(mu, nu, unique_ids, updates)`: the new moment tables, `[N]` distinct
    ids (unused slots hold `R`) and `[N, D]` updates (zeros in unused slots),
    before the learning rate.
  """
  if not available():
    raise RuntimeError(
        'lazy_optax CPU kernels are not available (no C++ compiler, a '
        f'failed build, or {ENV_SWITCH}=0).')
  n, d = grads.shape
  call = jax.ffi.ffi_call(
      _TARGET,
      (jax.ShapeDtypeStruct(mu.shape, jnp.float32),
       jax.ShapeDtypeStruct(nu.shape, jnp.float32),
       jax.ShapeDtypeStruct((n,), jnp.int32),
       jax.ShapeDtypeStruct((n, d), jnp.float32)),
      input_output_aliases={3: 0, 4: 1},
      vmap_method='sequential')
  new_mu, new_nu, unique_ids, updates = call(ids, grads, hyper, mu, nu)
  return new_mu, new_nu, unique_ids, updates
