"""Where an array lives, as far as a trace can see it.

The fused row updates choose their implementation per leaf from where the
arrays live, not from how many devices the process has. Under `jax.jit` the
array's type (`jax.typeof(x).sharding`) tells:

- an empty mesh: the computation runs on one device (its platform is known
  only when the step is lowered, so CPU-only code goes through
  `jax.lax.platform_dependent`);
- a mesh with Explicit axes: the partition spec says whether the rows are
  split, and over which axes;
- a mesh of several devices with Auto axes: the rows may be split, but the
  type does not say how (XLA's partitioner decides later);
- a mesh with Manual axes: the trace is a `jax.shard_map` body, whose
  values are each device's own (typed as varying over the manual axes or
  not, which a C++ call's results do not carry).

A concrete array (an eager call) says the same through its `sharding`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
from jax.typing import ArrayLike


class Placement(NamedTuple):
  """Where a table lives.

  kind: `'one'` (one device), `'explicit'` (a mesh with Explicit axes; the
    rows split over `row_axes`, or replicated when that is empty),
    `'auto'` (several devices, split unknown at trace time) or `'manual'`
    (inside `jax.shard_map`: each device's own values).
  platform: `'cpu'`, `'gpu'`, ... when known, else None (decided at
    lowering).
  mesh: the (abstract) mesh for `'explicit'`, else None.
  row_axes: the mesh axes the rows are split over (`'explicit'` only).
  split_within_rows: whether a dimension after the first is split
    (`'explicit'` only).
  """
  kind: str
  platform: Optional[str] = None
  mesh: Any = None
  row_axes: tuple[str, ...] = ()
  split_within_rows: bool = False


def _platform(mesh: object) -> Optional[str]:
  device = getattr(mesh, 'abstract_device', None)
  return getattr(device, 'platform', None)


def placement(x: ArrayLike) -> Placement:
  """Where `x` (a concrete array or a traced value) lives."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    devices = x.sharding.device_set
    if len(devices) == 1:
      device: Any = next(iter(devices))
      return Placement('one', device.platform)
  try:
    sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):
    return Placement('auto')
  mesh = getattr(sharding, 'mesh', None)
  if mesh is not None and jax.sharding.AxisType.Manual in tuple(
      getattr(mesh, 'axis_types', ())):
    return Placement('manual', _platform(mesh), mesh)
  if mesh is None or mesh.empty or mesh.size == 1:
    return Placement('one', _platform(mesh) if mesh is not None else None)
  if getattr(mesh, 'explicit_axes', ()):
    spec = tuple(sharding.spec)
    rows = spec[0] if spec else None  # the row axis' mesh axes
    row_axes = (() if rows is None else tuple(rows)
                if isinstance(rows, (tuple, list)) else (rows,))
    return Placement('explicit', _platform(mesh), mesh, row_axes,
                     any(axis is not None for axis in spec[1:]))
  return Placement('auto', _platform(mesh))
