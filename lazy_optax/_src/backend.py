"""One backend per table: which code moves and updates its rows, and why.

`lazy(...)` decides a table's `Backend` once per traced update, from the
`impl=` asked for (its own and its rule's) and from where the table lives
(`placement.py`), and hands it, as a value, to everything that touches the
table's rows: the deduplication of ids read back from a code, the gathers,
the rule's update and the write-back.

- `'cpu_kernel'`: the rule's C++ kernel updates the tables in place; on one
  CPU device the row moves (dedup, gather, write-back, scatter-add,
  stochastic rounding) are C++ calls too (`row_kernels`). On a mesh with
  Explicit axes the rule's kernel runs per shard and the row moves are
  XLA's, which the partitioner splits.
- `'xla'`: XLA's ops only, the rule's rows written and read back.
- `'generic'`: XLA's ops only, the transformation on the gathered rows and
  `lazy(...)`'s write-back.

Code that touches rows outside `lazy(...)` uses XLA's ops (`OUTSIDE_LAZY`):
the gradient's lookups, ordering and deduplication (`value_and_grad`,
`SparseRows(...)`, tree arithmetic) and `apply_updates` of an update. They
run before `lazy(...)` decides or after it returns, so none of them can
follow its decision; a `SparseRows` carries no backend. The C++ kernels run
where `lazy(...)` decides (`decide`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from lazy_optax._src import cpu_kernels
from lazy_optax._src.placement import Placement
from lazy_optax._src.placement import placement

__all__ = ('Backend', 'OUTSIDE_LAZY', 'Placement', 'placement', 'decide')

# Measured on CPU only: lazy_adam steps, 1,000,000-row float32 tables, 4,096
# ids, 1 thread (XLA path): rows of 64 floats 1.03 vs 1.60 ms with the rows
# read back, 32 floats 0.53 vs 0.59 ms, 16 floats 0.42 vs 0.33 ms (slower).
REGATHER_MIN_ROW_BYTES = 128

# A table as the backend reads it: an array with a shape and a dtype (a
# traced value is a `jax.Array`).
Table = jax.Array | np.ndarray


class Backend(NamedTuple):
  """How one table's rows are moved and updated (immutable).

  Attributes:
    kind: `'cpu_kernel'`, `'xla'` or `'generic'`: the rule's update.
    reason: why, in words (what `explain_update` reports).
    row_kernels: whether the row moves (dedup, gather, write-back,
      scatter-add, stochastic rounding) are the C++ kernels' (on CPU;
      `jax.lax.platform_dependent` keeps XLA's for other platforms).
    where: the table's `Placement`.
  """
  kind: str
  reason: str
  row_kernels: bool
  where: Placement


# The row moves of a gradient or update outside `lazy(...)`: XLA's.
OUTSIDE_LAZY = Backend('xla', "a SparseRows' rows outside lazy(...)", False,
                       Placement('one'))


def row_bytes(x: Table) -> int:
  """Bytes of one row of `x` (its entries after the first dimension)."""
  size = jnp.dtype(x.dtype).itemsize
  for d in x.shape[1:]:
    size *= d
  return size


def row_kernels_allowed(where: Placement) -> bool:
  """Whether the row-move kernels may run: loaded, one CPU (or unknown)."""
  return (cpu_kernels.loaded() and where.kind == 'one'
          and where.platform in (None, 'cpu'))


def placement_refusal(table: Table, where: Placement) -> str:
  """Why no CPU kernel can update `table` where it lives ('' if one can)."""
  status = cpu_kernels.status()
  if status is None:
    return ('the CPU kernels are not loaded yet: they load at the first '
            'init on concrete parameters, or with lazy_optax.kernel_status()')
  if not status.loaded:
    return f'the CPU kernels are unavailable: {status.detail}'
  if not cpu_kernels.loaded():
    return 'the CPU kernels are not registered with XLA'
  if where.platform not in (None, 'cpu'):
    return f'the table lives on {where.platform}'
  if where.kind == 'auto':
    return ('the table lives on several devices with Auto axes, whose row '
            'split a trace cannot see (use Explicit axes)')
  if where.kind == 'manual':
    return ('the step runs inside jax.shard_map, whose per-device typing '
            '(manual axes) a C++ call does not carry')
  if where.split_within_rows:
    return 'the table is split within its rows (only row splits run per shard)'
  if where.kind == 'explicit' and where.row_axes:
    shards = 1
    for axis in where.row_axes:
      shards *= where.mesh.shape[axis]
    if table.shape[0] % shards:
      return f'{table.shape[0]} rows do not split evenly over {shards} devices'
  return ''


def _default_device() -> Optional[jax.Device | str]:
  """`jax.config.jax_default_device`: a device, a platform name or None."""
  # Read by name: jax's type stubs of `jax.config` list no option.
  return getattr(jax.config, 'jax_default_device', None)


def default_platform() -> tuple[str, str]:
  """The platform a step whose trace names no device compiles for, and what
  chose it.

  `jax.jit` of arrays that are not committed to a device compiles for JAX's
  default device: `jax.config.jax_default_device` where it is set (a device
  or a platform name, as `jax.default_device(...)` sets it), else the
  default backend's first device.

  Returns:
    The platform (`'cpu'`, `'gpu'`, ...) and, in words, what chose it.
  """
  device = _default_device()
  if device is None:
    return jax.default_backend(), 'the default backend'
  platform = device if isinstance(device, str) else device.platform
  return platform.lower(), 'the default device (jax_default_device)'


def lowering_refusal(where: Placement) -> str:
  """Why a table whose trace names no platform gets no kernel: the step
  compiles for the default device's platform, and it is not the CPU (''
  where it is).

  Such a step (`jax.jit` of arrays on one device) lowers its kernel calls
  under `jax.lax.platform_dependent`, so a GPU or TPU compile drops them:
  `'auto'` reports and lowers the XLA path there instead of naming a kernel
  that would not run. Under `jax.default_device(jax.devices('cpu')[0])` on
  a GPU machine, the step compiles for the CPU and keeps its kernels.
  """
  if where.platform is not None:
    return ''
  platform, chooser = default_platform()
  if platform == 'cpu':
    return ''
  return f'the step compiles for {platform}, {chooser}'


def _kernel_reason(impl: str, where: Placement) -> str:
  """Why the CPU kernel runs, for `impl` ('auto' or 'cpu_kernel')."""
  if impl == 'cpu_kernel':
    return "impl='cpu_kernel' was asked for"
  reason = ('the CPU kernel updates the rows in place (on another platform, '
            'the xla path)')
  if where.platform is None and _default_device() is not None:
    reason += f'; the step compiles for cpu, {default_platform()[1]}'
  return reason


def without_kernel(table: Table, where: Placement, why: str) -> Backend:
  """The XLA backend of a table no kernel updates: 'xla' or 'generic'."""
  kind = ('xla' if where.kind in ('one', 'explicit') and not where.row_axes
          and row_bytes(table) >= REGATHER_MIN_ROW_BYTES else 'generic')
  return Backend(kind, f'no CPU kernel: {why}', row_kernels_allowed(where),
                 where)


def decide(table: Table, impl: str, *, refusal: str = '',
           subject: str = 'lazy', name: str = '') -> Backend:
  """The backend of `table` for `impl`, where it lives.

  Args:
    table: the parameter (an array or a traced value).
    impl: `'auto'`, `'generic'`, `'xla'` or `'cpu_kernel'`.
    refusal: why the rule cannot run its kernel on this table ('' if it
      can), from its own operands (dtypes, ids).
    subject: who asked, for messages (`'lazy_adam'`).
    name: the parameter's path name, for messages.

  Returns:
    A `Backend`.

  Raises:
    ValueError: `impl='cpu_kernel'` where no kernel can run.
  """
  where = placement(table)
  if impl in ('generic', 'xla'):
    return Backend(impl, f"impl='{impl}' was asked for", False, where)
  refusal = (placement_refusal(table, where)
             or (lowering_refusal(where) if impl == 'auto' else '')
             or refusal)
  if refusal:
    if impl == 'cpu_kernel':
      raise ValueError(
          f"{subject}(impl='cpu_kernel') cannot update parameter {name}: "
          f"{refusal}. Use impl='auto'.")
    return without_kernel(table, where, refusal)
  return Backend('cpu_kernel', _kernel_reason(impl, where),
                 row_kernels_allowed(where), where)
