"""Row-sparse gradients from lookups: `value_and_grad` and its recorders.

`value_and_grad` differentiates with respect to the looked-up rows, not the
table, in three steps (docs/design.md): probe the lookups (`_probe`),
classify the tables (`_classify`), differentiate (`_differentiate`).

Lookups inside `jax.lax.scan`, `jax.vmap`, `jax.checkpoint` (Flax's
`nn.remat`) or a nested `jax.jit` cannot give row-sparse gradients. They are
detected with public JAX only, by comparing tracers: at the top level of the
loss, the rows plus the perturbation are traced by the perturbation's own
trace (the sum has the perturbation's tracer type), inside a transformation
by another one; and a table that crossed a transformation boundary as an
argument is a different object from the parameter the loss was handed (the
probe records such lookups, and the table's tangent reaches the loss through
the transformation).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Callable, Literal, Optional, overload, Sequence, TypeVar
import weakref

import jax
from jax.extend.core import ClosedJaxpr
import jax.numpy as jnp
from jax.typing import ArrayLike
import optax

from lazy_optax._src import distinct
from lazy_optax._src import row_ops
from lazy_optax._src import sharding as _sharding
from lazy_optax._src import validate
from lazy_optax._src.id_code import index_dtype
from lazy_optax._src.numerics import broadcast_rows
from lazy_optax._src.paths import path_name
from lazy_optax._src.row_reads import in_range
from lazy_optax._src.row_reads import read_rows
from lazy_optax._src.row_reads import Recorder
from lazy_optax._src.row_reads import recording
from lazy_optax._src.sparse_rows import SparseRows

_Aux = TypeVar('_Aux')
# The loss function as `value_and_grad` calls it: `params` to `(loss, aux)`.
_Call = Callable[[optax.Params], tuple[ArrayLike, object]]

_TOP_LEVEL = (
    'row-sparse gradients need the lookups at the top level of the loss given '
    'to lazy_optax.value_and_grad, not inside jax.lax.scan, jax.vmap, '
    'jax.checkpoint (flax.linen.remat, nnx.remat) or a nested jax.jit. Look '
    'the rows up once at the top level (gather all ids first, or call the '
    'embedding layer on the whole batch) and pass the rows in; or name the '
    'row-sparse tables with tables=... to give this one a dense gradient; or '
    'use jax.value_and_grad for dense gradients.')


class _Probe(Recorder):
  """Step 1: records the shapes of the lookups (traced, never run)."""

  def __init__(self, tables: dict[int, ArrayLike], names: Sequence[str]):
    super().__init__(tables, names)
    self.rows: dict[int, list[jax.ShapeDtypeStruct]] = {}
    # The mesh axes each lookup's rows vary over inside `jax.shard_map`.
    self.varying: dict[int, list[tuple[Hashable, ...]]] = {}
    self.foreign_shapes: set[tuple[int, ...]] = set()

  def take(self, table, ids, active, dtype):
    pos = self.position_of(table)
    if pos is None:
      # A traced table that is not a parameter as the loss was handed it:
      # one that crossed a transformation boundary as an argument (checkpoint,
      # remat, nested jit, scan carry), a cast or copy of a parameter, or an
      # unrelated traced array. Which one is told by the table's tangent.
      if isinstance(table, jax.core.Tracer):
        self.foreign_shapes.add(tuple(jnp.shape(table)))
      return None
    rows = read_rows(jax.lax.stop_gradient(table), ids, dtype)
    self.rows.setdefault(pos, []).append(
        jax.ShapeDtypeStruct(rows.shape, rows.dtype))
    self.varying.setdefault(pos, []).append(
        tuple(sorted(_sharding.varying_axes(rows))))
    return rows


class _Differentiate(Recorder):
  """Step 3: adds the perturbations and records the ids of the gradient."""

  def __init__(self, tables: dict[int, ArrayLike], names: Sequence[str],
               perturbations: dict[int, list[jax.Array]]):
    super().__init__(tables, names)
    self.pending = {pos: list(p) for pos, p in perturbations.items()}
    self.ids: dict[int, list[jax.Array]] = {}
    self.reads: dict[int, list[jax.Array]] = {}  # the rows looked up

  def take(self, table, ids, active, dtype):
    pos = self.position_of(table)
    if pos is None:
      return None
    rows = read_rows(jax.lax.stop_gradient(table), ids, dtype)
    pending = self.pending[pos]
    if not pending or pending[0].shape != rows.shape:
      raise ValueError(
          f'lookup of table {self.names[pos]}: the loss function looked its '
          'tables up with other shapes or another number of times when it was '
          'traced a second time; value_and_grad needs a loss whose lookups '
          'depend only on the shapes of its inputs.')
    perturbation = pending.pop(0)
    if not isinstance(perturbation, jax.core.Tracer):
      raise RuntimeError(
          'lazy_optax.value_and_grad: the perturbation of a lookup is not '
          'traced by jax.value_and_grad; this JAX version differentiates in a '
          'way lazy_optax does not know. Please report it.')
    num_rows = jnp.shape(table)[0]
    ids = ids.astype(index_dtype(num_rows))
    keep = in_range(ids, num_rows)
    if active is not None:
      keep = keep & active
    out = rows + jnp.where(broadcast_rows(keep, rows), perturbation,
                           jnp.zeros_like(perturbation))
    # At the top level of the loss, the sum is traced by the perturbation's
    # trace; inside scan, vmap, checkpoint or a nested jit, by another one.
    if type(out) is not type(perturbation):  # pylint: disable=unidiomatic-typecheck
      raise ValueError(f'lookup of table {self.names[pos]}: {_TOP_LEVEL}')
    # Padding and masked slots name row num_rows (no row, never reported);
    # out-of-range ids stay as they are: they touch no row either, and the
    # checked mode (with_id_checks) reports them.
    named = ids if active is None else jnp.where(active, ids, num_rows)
    self.ids.setdefault(pos, []).append(named.reshape(-1))
    self.reads.setdefault(pos, []).append(rows)
    return out


def _is_table(leaf: object) -> bool:
  return (hasattr(leaf, 'shape') and hasattr(leaf, 'dtype')
          and len(leaf.shape) >= 1
          and jnp.issubdtype(leaf.dtype, jnp.inexact))


def _matches(name: str, wanted: str) -> bool:
  """Whether parameter `name` is the one `tables=` names as `wanted`."""
  return name == wanted or name.endswith('/' + wanted)


def _unused_inputs(jaxpr: ClosedJaxpr) -> list[bool]:
  """For each input of a closed jaxpr, whether no equation or output uses it."""
  used: set[int] = set()
  for eqn in jaxpr.jaxpr.eqns:
    used.update(id(v) for v in eqn.invars)
  used.update(id(v) for v in jaxpr.jaxpr.outvars)
  return [id(v) not in used for v in jaxpr.jaxpr.invars]


class _Params:
  """The flattened parameters of one call, with their path names."""

  def __init__(self, params: optax.Params):
    flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    self.leaves = [leaf for _, leaf in flat]
    self.names = [path_name(path) for path, _ in flat]

  def with_values(self, positions: Sequence[int],
                  values: Sequence[ArrayLike]) -> optax.Params:
    full = list(self.leaves)
    for i, v in zip(positions, values):
      full[i] = v
    return jax.tree_util.tree_unflatten(self.treedef, full)


def _probe(call: _Call, params: _Params,
           candidates: list[int]) -> tuple[_Probe, list[bool]]:
  """Step 1: the lookups' shapes, and which candidates reach the loss."""
  probe = _Probe({}, params.names)

  def probe_fn(*tangents):
    def primal(*values):
      probe.tables = dict(zip(candidates, values))
      with recording(probe):
        loss, _ = call(params.with_values(candidates, values))
      return loss
    primals = tuple(params.leaves[i] for i in candidates)
    return jax.jvp(primal, primals, tangents)[1]

  structs = [jax.ShapeDtypeStruct(jnp.shape(params.leaves[i]),
                                  params.leaves[i].dtype) for i in candidates]
  unused = _unused_inputs(jax.make_jaxpr(probe_fn)(*structs))
  return probe, unused


def _classify(probe: _Probe, unused: list[bool], params: _Params,
              candidates: list[int], named: bool) -> list[int]:
  """Step 2: the positions of the tables that get row-sparse gradients."""
  sparse = []
  for i, free in zip(candidates, unused):
    name = params.names[i]
    looked_up = i in probe.rows
    if not free and tuple(jnp.shape(params.leaves[i])) in probe.foreign_shapes:
      raise ValueError(
          f'value_and_grad: table {name} reaches the loss outside its lookups, '
          'and a lookup received a table of its shape that is not the '
          'parameter as the loss was handed it: a table passed as an argument '
          'into a transformation, or computed from the parameter (a cast, a '
          f'copy). Look up the parameter itself; {_TOP_LEVEL}')
    if named and not looked_up:
      raise ValueError(
          f'value_and_grad: table {name} was named in tables= but the loss '
          'never looked it up with lazy_optax.lookup (or a lazy_optax '
          'embedding layer); plain indexing gives no row-sparse gradient.')
    if named and not free:
      raise ValueError(
          f'value_and_grad: table {name} was named in tables= but the loss '
          'also uses it outside lookups (for example a tied output layer via '
          'attend); its gradient is dense. Leave it out of tables= to get '
          'that dense gradient.')
    if looked_up and free:
      sparse.append(i)
  return sparse


# The tables `value_and_grad` gave a `SparseRows` gradient, by identity of
# the parameter it was given (an array, or a tracer of the step's trace),
# held weakly: `lazy(...)` refuses a dense gradient for one of them.
_ROW_SPARSE: dict[int, weakref.ref[object]] = {}


def _mark_row_sparse(table: object) -> None:
  key = id(table)
  try:
    _ROW_SPARSE[key] = weakref.ref(table,
                                   lambda _: _ROW_SPARSE.pop(key, None))
  except TypeError:  # not weakly referenceable: not remembered
    pass


def had_row_sparse_gradient(table: object) -> bool:
  """Whether `value_and_grad` gave this very parameter a `SparseRows`
  gradient (its lookups read it)."""
  ref = _ROW_SPARSE.get(id(table))
  return ref is not None and ref() is table


def _zeros(struct: jax.ShapeDtypeStruct,
           axes: tuple[Hashable, ...]) -> jax.Array:
  zeros = jnp.zeros(struct.shape, struct.dtype)
  if not axes:
    return zeros
  pcast = getattr(jax.lax, 'pcast', None)
  if pcast is None:  # older JAX names it jax.lax.pvary
    return jax.lax.pvary(zeros, axes)  # type: ignore[attr-defined]
  return pcast(zeros, axes, to='varying')


def _flat(parts: list[jax.Array], row_shape: tuple[int, ...]) -> jax.Array:
  """The rows of `parts` (any leading shapes) as one `[N, *row_shape]`."""
  return jnp.concatenate([p.reshape((-1,) + row_shape) for p in parts])


def _differentiate(call: _Call, params: _Params, sparse: list[int],
                   probe: _Probe) -> tuple[jax.Array, object, optax.Updates]:
  """Step 3: loss, aux and gradients, row-sparse for the `sparse` tables."""
  dense = [i for i in range(len(params.leaves)) if i not in sparse]
  # Inside `jax.shard_map` the perturbations vary over the mesh axes that
  # their rows vary over: autodiff then keeps their cotangents (the values
  # of the row-sparse gradient) per device, like the ids, instead of summing
  # them across devices as it does for a replicated input.
  zeros = {i: [_zeros(s, axes)
               for s, axes in zip(probe.rows[i], probe.varying[i])]
           for i in sparse}

  def grad_fn(dense_values, perturbations):
    recorder = _Differentiate({i: params.leaves[i] for i in sparse},
                              params.names, perturbations)
    with recording(recorder):
      loss, aux = call(params.with_values(dense, dense_values))
    for i in sparse:
      if recorder.pending[i] or i not in recorder.ids:
        raise ValueError(
            f'value_and_grad: the loss function looked table '
            f'{params.names[i]} up a different number of times when traced a '
            'second time; it must look its tables up the same way on every '
            'call.')
    ids = {i: jnp.concatenate(recorder.ids[i]) for i in sparse}
    return loss, (aux, ids, recorder.reads)

  (loss, (aux, ids, reads)), (g_dense, g_rows) = jax.value_and_grad(
      grad_fn, argnums=(0, 1), has_aux=True)(
          [params.leaves[i] for i in dense], zeros)
  grads: list[Optional[jax.Array | SparseRows]] = [None] * len(params.leaves)
  for i, g in zip(dense, g_dense):
    grads[i] = g
  parts = []
  for i in sparse:
    table = params.leaves[i]
    row_shape = tuple(jnp.shape(table)[1:])
    # The gradient of a loss linear in the rows does not depend on them, and
    # then nothing orders the lookup before the table's in-place update: XLA
    # would copy the whole donated table every step. The gradient is made
    # to read the rows (O(ids)).
    values = row_ops.after(_flat(g_rows[i], row_shape),
                           _flat(reads[i], row_shape))
    num_rows = jnp.shape(table)[0]
    parts.append((ids[i].astype(index_dtype(num_rows)),
                  values.astype(table.dtype), num_rows))
  # Repeated ids are summed here, where the gradient is built, the tables
  # alike in one program; slots may name `num_rows` (padding: no row).
  for i, (kept, summed), (_, _, num_rows) in zip(
      sparse, distinct.from_ids_of_tables(parts), parts):
    grads[i] = SparseRows.from_unique(kept, summed, num_rows, distinct=True)
  return loss, aux, jax.tree_util.tree_unflatten(params.treedef, grads)


@overload
def value_and_grad(
    fun: Callable[..., ArrayLike], *, has_aux: Literal[False] = False,
    tables: Optional[Sequence[str]] = None, impl: str = 'auto',
) -> Callable[..., tuple[jax.Array, optax.Updates]]: ...


@overload
def value_and_grad(
    fun: Callable[..., tuple[ArrayLike, _Aux]], *, has_aux: Literal[True],
    tables: Optional[Sequence[str]] = None, impl: str = 'auto',
) -> Callable[..., tuple[tuple[jax.Array, _Aux], optax.Updates]]: ...


@overload
def value_and_grad(
    fun: Callable[..., object], *, has_aux: bool,
    tables: Optional[Sequence[str]] = None, impl: str = 'auto',
) -> Callable[..., tuple[jax.Array | tuple[jax.Array, object],
                         optax.Updates]]: ...


def value_and_grad(
    fun: Callable[..., object],
    *,
    has_aux: bool = False,
    tables: Optional[Sequence[str]] = None,
    impl: str = 'auto',
) -> Callable[..., tuple[object, optax.Updates]]:
  """Like `jax.value_and_grad`, with row-sparse gradients for looked-up tables.

  `fun(params, *args, **kwargs)` returns a scalar loss (and an auxiliary
  value if `has_aux`). Every table that `fun` reads only through
  `lazy_optax.lookup`, `lazy_optax.lookup_bag` (or the lazy_optax embedding
  layers) gets its gradient as a `SparseRows` with one slot per looked-up
  id, computed in O(ids) without any table-sized array; every other
  parameter gets its ordinary dense gradient. A table that `fun` also uses
  outside lookups (tied output embeddings, a norm penalty) gets a dense
  gradient holding both parts.

  Slots of padding ids, masked bag slots and ids outside `[0, num_rows)`
  hold id `num_rows` and zero values: they name no row, and every scatter
  drops them.

  Lookups must sit at the top level of `fun`: one inside `jax.lax.scan`,
  `jax.vmap`, `jax.checkpoint` (Flax's `nn.remat`, `nnx.remat`) or a nested
  `jax.jit` raises `ValueError` (look the rows up first and pass them in).

  The gradients are taken with respect to `params` only (the first
  argument). Call it under `jax.jit` as usual; it traces `fun` twice.

  Args:
    fun: the loss function; its first argument is the parameter tree.
    has_aux: whether `fun` returns `(loss, aux)`.
    tables: optional names of the tables that must get row-sparse gradients:
      a parameter path joined with `/` (`'params/embed/embedding'`) or its
      last parts (`'embedding'`, `'embed/embedding'`). Other parameters then
      get dense gradients even when looked up. A named table that `fun` never
      passes to `lookup`, or also uses densely, is an error. By default every
      looked-up table that is used only through lookups is row-sparse.
    impl: deprecated, no effect: the rows are read and the gradient's
      repeated ids summed with XLA's ops, before `lazy(...)` decides how
      each table's rows move (its `impl=`). Goes in lazy_optax 0.3.

  Returns:
    A function with `fun`'s signature returning `(loss, grads)`, or
    `((loss, aux), grads)` if `has_aux`, where `grads` has the structure of
    `params`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> params = {'table': jnp.ones((1000, 4)), 'w': jnp.ones(4)}
    >>> def loss_fn(params, ids):
    ...   rows = lazy_optax.lookup(params['table'], ids)
    ...   return jnp.sum(rows @ params['w'])
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(params,
    ...                                                  jnp.array([3, 7]))
    >>> grads['table']
    SparseRows(num_rows=1000, ids=2, row_shape=(4,), dtype=float32)
    >>> grads['w']
    Array([2., 2., 2., 2.], dtype=float32)
  """
  if not callable(fun):
    raise TypeError(f'value_and_grad: fun must be callable, got {fun!r}.')
  validate.ignored_impl(impl, 'value_and_grad', validate.GRADIENT_MOVES,
                        stacklevel=3)
  if isinstance(tables, str):
    tables = (tables,)
  wanted = None if tables is None else tuple(tables)

  def wrapped(params, *args, **kwargs):
    def call(p):
      out = fun(p, *args, **kwargs)
      if not has_aux:
        return out, None
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            'value_and_grad(has_aux=True): fun must return a pair '
            f'(loss, aux), got {type(out).__name__}.')
      return out

    flat = _Params(params)
    candidates = [i for i, leaf in enumerate(flat.leaves) if _is_table(leaf)
                  and (wanted is None
                       or any(_matches(flat.names[i], w) for w in wanted))]
    for w in wanted or ():
      if not any(_matches(flat.names[i], w) for i in candidates):
        raise ValueError(
            f'value_and_grad: no floating-point parameter of at least one '
            f'dimension is named {w!r}; parameters: {flat.names}.')
    probe, unused = _probe(call, flat, candidates)
    sparse = _classify(probe, unused, flat, candidates, wanted is not None)
    for i in sparse:
      _mark_row_sparse(flat.leaves[i])
    loss, aux, grads = _differentiate(call, flat, sparse, probe)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped
