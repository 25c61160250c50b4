"""Finding, building and verifying the compiled CPU row kernels.

The kernels (`rows.cc` and `id_kernels.cc`, one library) come from one of
two places, tried in order:

1. **cache**: where a C++ compiler is found (`$CXX`, else `c++`, `g++`,
   `clang++`), the source is compiled once per machine for this CPU
   (`-march=native`: the Adam kernel ran 1.6x faster than for baseline
   x86-64) against the XLA FFI headers of the installed jaxlib
   (`jax.ffi.include_dir()`), into a cache folder (`$LAZY_OPTAX_CACHE`, else
   `~/.cache/lazy_optax`), keyed by the source, the jaxlib version, the
   compiler, its flags and the CPU's model and features;
2. **prebuilt**: without a compiler, the library that a platform wheel of
   lazy_optax carries in `prebuilt/` beside this file (built for the
   platform's baseline instruction set), with its SHA-256 in a `.sha256`
   file.

Nothing is loaded that cannot be trusted:

- the cache folder must be owned by the current user and not writable by
  group or others; if it is not, the library is built in a private temporary
  folder for this process instead (and a warning says why);
- a library is loaded only if it is a regular file owned by the current user
  (or root, for a prebuilt one), not writable by group or others, and its
  SHA-256 equals the one recorded when it was built: a damaged, truncated or
  empty file is rebuilt, never loaded;
- builds write to a temporary file and rename it into place under a lock, so
  concurrent processes build once; leftovers of interrupted builds are
  removed.

Every failure is logged once on the `lazy_optax` logger and leaves the
kernels off (the XLA path is used); nothing here raises to the caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from typing import Iterator, NamedTuple, Optional

LOGGER = logging.getLogger('lazy_optax')

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, 'rows.cc')
# Every source compiled into the one library (the row kernels, the id
# table's kernels).
SOURCES = (SOURCE, os.path.join(HERE, 'id_kernels.cc'))
PREBUILT_DIR = os.path.join(HERE, 'prebuilt')
LIBRARY_NAME = 'lazy_optax_rows.so'
# Measured on CPU only: -fno-math-errno (sqrt vectorizes) took the Adam
# kernel from 0.63 to 0.34 ms, -march=native from 0.13 to 0.08 ms.
FLAGS = ('-O3', '-fno-math-errno', '-std=c++17', '-shared', '-fPIC', '-w')
# Added for builds on the machine that runs them (not for platform wheels).
NATIVE_FLAGS = ('-march=native',)
_BUILD_PREFIX = '.build-'


class Found(NamedTuple):
  """Where the library came from: a verified path, or why there is none."""
  path: Optional[str]
  origin: str  # 'prebuilt', 'cache', 'built', or the reason for None


def cache_dir() -> str:
  return os.environ.get('LAZY_OPTAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'lazy_optax')


def compiler() -> Optional[str]:
  for name in (os.environ.get('CXX'), 'c++', 'g++', 'clang++'):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def sha256_of(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def untrusted(path: str, owners: tuple[int, ...], *, folder: bool) -> str:
  """Why `path` may not be trusted ('' when it may)."""
  try:
    st = os.stat(path)
  except OSError as e:
    return f'{path} cannot be read ({e.strerror})'
  if folder and not stat.S_ISDIR(st.st_mode):
    return f'{path} is not a folder'
  if not folder and not stat.S_ISREG(st.st_mode):
    return f'{path} is not a regular file'
  if st.st_uid not in owners:
    return f'{path} is owned by another user (uid {st.st_uid})'
  if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    return f'{path} is writable by group or others'
  return ''


def verified(path: str, owners: tuple[int, ...]) -> str:
  """Why the library at `path` may not be loaded ('' when it may)."""
  checksum = path + '.sha256'
  why = (untrusted(path, owners, folder=False)
         or untrusted(checksum, owners, folder=False))
  if why:
    return why
  with open(checksum, encoding='ascii') as f:
    recorded = f.read().strip()
  if sha256_of(path) != recorded:
    return f'{path} does not match its recorded SHA-256 (damaged or changed)'
  return ''


def _prebuilt() -> Found:
  path = os.path.join(PREBUILT_DIR, LIBRARY_NAME)
  if not os.path.exists(path):
    return Found(None, 'no prebuilt library in this installation')
  why = verified(path, (os.getuid(), 0))
  if why:
    LOGGER.warning('lazy_optax: not loading the prebuilt CPU kernels: %s.',
                   why)
    return Found(None, f'prebuilt library refused: {why}')
  return Found(path, 'prebuilt')


def _cpu() -> str:
  """The CPU's model and feature flags (a library built for it needs them)."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      lines = [line for line in f
               if line.startswith(('model name', 'flags', 'Features'))]
    return ''.join(sorted(set(lines)))
  except OSError:
    return platform.machine() + platform.processor()


def _key(cxx: str) -> Optional[str]:
  import jaxlib  # pylint: disable=g-import-not-at-top
  try:
    version = subprocess.run([cxx, '--version'], capture_output=True,
                             text=True, timeout=60, check=False).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  source = b''
  for path in SOURCES:
    with open(path, 'rb') as f:
      source += f.read()
  return hashlib.sha256(
      source + jaxlib.__version__.encode() + version.encode()
      + ' '.join(FLAGS + NATIVE_FLAGS).encode() + _cpu().encode()
      ).hexdigest()[:20]


def _usable_cache() -> tuple[str, str]:
  """A folder to build in, and a warning if it is not the configured one."""
  folder = cache_dir()
  if not os.path.exists(folder):
    try:
      os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as e:
      return tempfile.mkdtemp(prefix='lazy_optax-'), (
          f'the cache folder {folder} cannot be created ({e.strerror})')
  why = untrusted(folder, (os.getuid(),), folder=True)
  if why:
    return tempfile.mkdtemp(prefix='lazy_optax-'), why
  return folder, ''


@contextlib.contextmanager
def _locked(folder: str) -> Iterator[None]:
  fd = os.open(os.path.join(folder, '.lock'), os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _remove_leftovers(folder: str) -> None:
  # Called with the lock held: no other builder is writing these.
  for name in os.listdir(folder):
    if name.startswith(_BUILD_PREFIX):
      with contextlib.suppress(OSError):
        os.unlink(os.path.join(folder, name))


def _compile(cxx: str, folder: str, out: str,
             extra: tuple[str, ...] = ()) -> str:
  """Builds `out` (and its checksum); returns '' or why it failed."""
  import jax  # pylint: disable=g-import-not-at-top
  fd, tmp = tempfile.mkstemp(prefix=_BUILD_PREFIX, suffix='.so', dir=folder)
  os.close(fd)
  cmd = [cxx, *FLAGS, *extra, '-I', jax.ffi.include_dir(), *SOURCES, '-o',
         tmp]
  try:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          check=False)
  except (OSError, subprocess.SubprocessError) as e:
    os.unlink(tmp)
    return f'{cxx} could not be run ({e})'
  if done.returncode != 0:
    os.unlink(tmp)
    return (f'{cxx} failed with exit code {done.returncode}: '
            f'{done.stderr.strip()[-500:]}')
  os.chmod(tmp, 0o644)
  checksum_tmp = tmp + '.sha256'
  with open(checksum_tmp, 'w', encoding='ascii') as f:
    f.write(sha256_of(tmp))
  os.replace(checksum_tmp, out + '.sha256')
  os.replace(tmp, out)
  return ''


def _cached(build: bool) -> Found:
  cxx = compiler()
  if cxx is None:
    return Found(None, 'no C++ compiler on PATH ($CXX, c++, g++, clang++)')
  key = _key(cxx)
  if key is None:
    return Found(None, f'{cxx} --version could not be run')
  folder, warning = _usable_cache()
  if warning:
    LOGGER.warning('lazy_optax: not using the kernel cache: %s; building in '
                   'the private folder %s instead.', warning, folder)
  out = os.path.join(folder, f'rows_{key}.so')
  with _locked(folder):
    _remove_leftovers(folder)
    if os.path.exists(out):
      why = verified(out, (os.getuid(),))
      if not why:
        return Found(out, 'cache')
      LOGGER.warning('lazy_optax: rebuilding the CPU kernels: %s.', why)
      for stale in (out, out + '.sha256'):
        with contextlib.suppress(OSError):
          os.unlink(stale)
    if not build:
      return Found(None, 'not built yet')
    LOGGER.info('lazy_optax: building the CPU kernels with %s into %s.', cxx,
                folder)
    why = _compile(cxx, folder, out, NATIVE_FLAGS)
  if why:
    return Found(None, f'the build failed: {why}')
  return Found(out, 'built')


def find(build: bool = True) -> Found:
  """A verified kernel library: cached or built now, else prebuilt."""
  found = _cached(build)
  if found.path is not None:
    return found
  prebuilt = _prebuilt()
  if prebuilt.path is not None:
    return prebuilt
  return Found(None, f'{found.origin}; {prebuilt.origin}')


def build_into(folder: str) -> str:
  """Compiles the library into `folder` (for platform wheels); its path.

  Raises:
    RuntimeError: if there is no compiler or the build fails.
  """
  cxx = compiler()
  if cxx is None:
    raise RuntimeError('no C++ compiler on PATH ($CXX, c++, g++, clang++)')
  os.makedirs(folder, exist_ok=True)
  out = os.path.join(folder, LIBRARY_NAME)
  why = _compile(cxx, folder, out)
  if why:
    raise RuntimeError(why)
  return out
