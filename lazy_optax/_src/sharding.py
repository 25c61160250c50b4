"""Shardings for optimizer states whose tables are split across devices.

lazy_optax adds no communication of its own: a train step with row-sharded
tables is the ordinary step under `jax.jit`, and XLA's partitioner turns the
gathers and scatters of touched rows into batch-sized collectives. What a
user needs is the state's shardings, so that `mu`, `nu` (and any other leaf
that mirrors a parameter) live on the same devices as the parameter's rows
and keep those shardings from step to step. `state_shardings` derives them
from the parameters with optax's own `tree_utils.tree_map_params`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from jax.typing import ArrayLike
import optax

from lazy_optax._src import cpu_kernels


def explicit_mesh(x: ArrayLike) -> Optional[jax.sharding.AbstractMesh]:
  """The abstract mesh of `x`'s type when it has Explicit axes, else None."""
  typeof = getattr(jax, 'typeof', None)  # JAX versions before Explicit axes
  if typeof is None:
    return None
  try:
    sharding = getattr(typeof(x), 'sharding', None)
  except TypeError:
    return None
  mesh = getattr(sharding, 'mesh', None)
  if mesh is None or mesh.empty or not getattr(mesh, 'explicit_axes', ()):
    return None
  return mesh


def varying_axes(x: ArrayLike) -> frozenset:
  """The mesh axes that `x` varies over inside `jax.shard_map`.

  Empty outside `shard_map` and with `check_vma=False`. Read from the value's
  type (`jax.typeof`): `manual_axis_type.varying`, or `vma` where JAX names it
  so. The tests check that a replicated input's gradient shows no axis while
  the ids show theirs, so a JAX release that hides both fails them.
  """
  aval = jax.typeof(x)
  manual = getattr(aval, 'manual_axis_type', None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, 'vma', ()))


def replicate_if_explicit(x: jax.Array) -> jax.Array:
  """`x` resharded to replicated when its type carries Explicit sharding.

  Deduplicating a batch is about the global batch (ids that arrive on
  different data shards are summed), so under an Explicit mesh the ids and
  their rows are gathered to every device first: batch-sized traffic. Under
  Auto axes (or no mesh) `x` is returned as it is and XLA's partitioner
  decides.
  """
  mesh = explicit_mesh(x)
  if mesh is None:
    return x
  return jax.sharding.reshard(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def gather_kwargs(table: jax.Array) -> dict[str, Any]:
  """Keyword arguments for `table.at[ids].get`: replicated rows if Explicit."""
  mesh = explicit_mesh(table)
  if mesh is None:
    return {}
  return {'out_sharding': jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec())}


def scatter_kwargs(table: jax.Array) -> dict[str, Any]:
  """Keyword arguments for `table.at[ids].set/add`: keep `table`'s sharding."""
  if explicit_mesh(table) is None:
    return {}
  return {'out_sharding': jax.typeof(table).sharding}


def _sharding_of(x: object) -> jax.sharding.Sharding:
  sharding = getattr(x, 'sharding', None)
  if sharding is None:
    raise ValueError(
        f'Parameter leaf {type(x).__name__} has no sharding: pass committed '
        'jax.Arrays (jax.device_put(x, sharding)) or give param_shardings.')
  return sharding


def _follow_rows(leaf: object,
                 sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The parameter's sharding, cut to the rank of a per-row state leaf.

  Per-row leaves (a `[num_rows]` step counter for a `[num_rows, D]` table)
  keep the split of the rows and drop the rest of the spec.
  """
  ndim = len(getattr(leaf, 'shape', ()))
  if (isinstance(sharding, jax.sharding.NamedSharding)
      and len(sharding.spec) > ndim):
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[:ndim]))
  return sharding


def state_shardings(
    tx: optax.GradientTransformation,
    params: optax.Params,
    param_shardings: Optional[optax.Params] = None,
    *,
    replicated: Optional[jax.sharding.Sharding] = None,
) -> optax.OptState:
  """Shardings for `tx.init(params)` that follow the parameters' shardings.

  Every state leaf that mirrors a parameter (`mu`, `nu`, traces,
  accumulators) gets that parameter's sharding, so a row-sharded table keeps
  its moments' rows on the devices that hold its own rows; every other leaf
  (`count`, hyperparameters) is replicated. Use the result as
  `out_shardings` of a jitted `tx.init` (or see `init_sharded`) and as the
  state's shardings of a train step.

  Args:
    tx: the optimizer, for example `lazy_optax.lazy_adam(1e-3)`.
    params: the parameters (arrays or `jax.ShapeDtypeStruct` values).
    param_shardings: a tree of `jax.sharding.Sharding` objects with the
      structure of `params`; defaults to the `.sharding` of each parameter.
    replicated: the sharding of non-parameter leaves; defaults to a fully
      replicated `NamedSharding` over the parameters' mesh.

  Returns:
    A tree of shardings with the structure of `tx.init(params)`.

  Raises:
    ValueError: when shardings are missing, or no mesh is known for the
      replicated leaves.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import lazy_optax
    >>> mesh = jax.make_mesh((1,), ('rows',))
    >>> params = {'table': jax.device_put(jnp.zeros((8, 2)),
    ...                                   NamedSharding(mesh, P('rows')))}
    >>> shardings = lazy_optax.sharding.state_shardings(
    ...     lazy_optax.lazy_adam(1e-3), params)
    >>> shardings[0].mu['table'].spec == P('rows')
    True
    >>> shardings[0].count.spec == P()
    True
  """
  if param_shardings is None:
    param_shardings = jax.tree.map(_sharding_of, params)
  else:
    try:
      jax.tree.structure(params).flatten_up_to(  # type: ignore[attr-defined]
          param_shardings)
    except (ValueError, TypeError) as e:
      raise ValueError(
          'param_shardings must have the tree structure of params.') from e
  if replicated is None:
    mesh = next((s.mesh for s in jax.tree.leaves(param_shardings)
                 if isinstance(s, jax.sharding.NamedSharding)), None)
    if mesh is None:
      raise ValueError(
          'state_shardings: no NamedSharding among the parameters, so no mesh '
          'to replicate the non-parameter state leaves over: pass '
          '`replicated=`.')
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state_shapes = jax.eval_shape(tx.init, params)
  return optax.tree_utils.tree_map_params(
      tx,
      _follow_rows,
      state_shapes,
      param_shardings,
      transform_non_params=lambda _: replicated,
  )


def init_sharded(
    tx: optax.GradientTransformation,
    params: optax.Params,
    param_shardings: Optional[optax.Params] = None,
) -> optax.OptState:
  """`tx.init(params)`, built directly in the shardings of `state_shardings`.

  Each device allocates only its own rows of `mu` and `nu`: the whole state
  never exists on one device.

  Args:
    tx: the optimizer.
    params: the parameters, sharded (or with `param_shardings` given).
    param_shardings: as in `state_shardings`.

  Returns:
    The optimizer state, with the shardings of `state_shardings`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import lazy_optax
    >>> mesh = jax.make_mesh((1,), ('rows',))
    >>> params = {'table': jax.device_put(jnp.zeros((8, 2)),
    ...                                   NamedSharding(mesh, P('rows')))}
    >>> state = lazy_optax.sharding.init_sharded(lazy_optax.lazy_adam(1e-3),
    ...                                          params)
    >>> state[0].nu['table'].sharding.spec == P('rows')
    True
  """
  cpu_kernels.load_for(params)  # outside the jit below: never in a trace
  shardings = state_shardings(tx, params, param_shardings)
  return jax.jit(tx.init, out_shardings=shardings)(params)
