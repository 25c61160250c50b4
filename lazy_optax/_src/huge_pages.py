"""`advise_huge_pages`: large CPU tables on transparent huge pages (Linux).

A lazy step reads and writes a few thousand rows scattered over tables of
hundreds of MB. With 4 KiB pages nearly every such row costs a TLB miss and
a page walk; with 2 MiB pages far fewer. XLA's CPU client allocates its
buffers with the C library's `malloc`, which on Linux does not ask for huge
pages unless the process was started with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (and where transparent huge pages
are set to `madvise`, as is common, no page is huge then). This module asks
the kernel for huge pages for arrays that already exist, through
`madvise(MADV_HUGEPAGE)` and `madvise(MADV_COLLAPSE)` on their buffers
(`jax.Array.unsafe_buffer_pointer()`): the contents stay as they are; only
the pages under them change. A donated train step updates its tables in
place, so the advice stays with them step after step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Callable, Optional

import chex
import jax

HUGE_PAGE_BYTES = 2 * 2**20
# Linux's <asm-generic/mman-common.h>.
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


@functools.lru_cache(maxsize=1)
def _madvise() -> Optional[Callable[[int, int, int], int]]:
  if not sys.platform.startswith('linux'):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or None, use_errno=True)
    fn = libc.madvise
  except (OSError, AttributeError):
    return None
  fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  fn.restype = ctypes.c_int
  return fn


def _cpu_buffers(tree: chex.ArrayTree) -> list[tuple[int, int]]:
  """(address, size) of every CPU buffer of the arrays in `tree`."""
  spans = []
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
      continue
    if leaf.is_deleted():
      continue
    for shard in leaf.addressable_shards:
      if shard.device.platform != 'cpu':
        continue
      data = shard.data
      # The buffer must hold its values before its pages are collapsed: a
      # copy still being written (`jnp.asarray` of a NumPy array) makes
      # `MADV_COLLAPSE` fail.
      data.block_until_ready()
      spans.append((data.unsafe_buffer_pointer(), data.nbytes))
  return spans


def advise_huge_pages(tree: chex.ArrayTree, *,
                      min_bytes: int = 4 * HUGE_PAGE_BYTES) -> int:
  """Puts the large CPU arrays of `tree` on transparent huge pages (Linux).

  For each CPU buffer of at least `min_bytes`, the whole 2 MiB pages inside
  it are advised `MADV_HUGEPAGE` and collapsed with `MADV_COLLAPSE` (Linux
  6.1 or newer; older kernels let `khugepaged` collapse them over time).
  Values are unchanged. Measured on a 1,000,000 x 64 float32 `lazy_adam`
  train step (interleaved in one process): 1.256 ms on 4 KiB pages, 0.999
  ms after `advise_huge_pages((params, opt_state))` on 1 thread, 1.078 and
  0.971 ms on 2; see `benchmarks/HISTORY.md`. Call it once after `init` (and
  after restoring a checkpoint) and donate params and optimizer state in the
  train step, so that XLA keeps updating the same buffers; a step that does
  not donate returns new buffers, which are not advised. Elsewhere (other
  systems, accelerators, transparent huge pages `never`) it does nothing.

  Starting the process with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` has the
  same effect for every large allocation, this one's included.

  Args:
    tree: a pytree of arrays, e.g. params or an optimizer state.
    min_bytes: smaller buffers are left alone.

  Returns:
    The number of bytes advised and collapsed (0 where nothing applies).

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.zeros((100_000, 64))}
    >>> n = lazy_optax.perf.advise_huge_pages(params)
    >>> n <= params['table'].nbytes
    True
  """
  madvise = _madvise()
  if madvise is None:
    return 0
  done = 0
  for address, size in _cpu_buffers(tree):
    if size < min_bytes:
      continue
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
      continue
    if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
      continue
    if madvise(start, end - start, _MADV_COLLAPSE) == 0:
      done += end - start
  return done
