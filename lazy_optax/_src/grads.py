"""Row-sparse gradients from embedding lookups: `lookup` and `value_and_grad`.

`jax.grad` of `table[ids]` is a dense `[num_rows, ...]` array, which already
costs O(table) before any optimizer runs. `value_and_grad` differentiates
with respect to the looked-up rows instead: inside it, every `lookup` of a
table gathers the rows under `stop_gradient` and adds a zero perturbation of
the batch's actual shape; the loss is differentiated with respect to the
ordinary parameters and those perturbations, and the table's gradient is
`SparseRows(ids, d loss / d perturbation, num_rows)`.

The pieces here are framework-agnostic; the Flax and Haiku embedding layers
(`lazy_optax.flax`, `lazy_optax.haiku`) call `lookup`, so a model built with
them gets row-sparse gradients from `value_and_grad` and ordinary dense
gradients from `jax.grad`.

Before differentiating, `value_and_grad` traces the loss once more (at trace
time only, never at run time) to learn the shapes of the lookups and whether
a table is also used outside them (tied output embeddings via `attend`, a
regularizer). Such a table gets an ordinary dense gradient, which includes
its lookups' part: correct, and as costly as a dense gradient is anyway.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from lazy_optax._src.labels import path_name
from lazy_optax._src.sparse_rows import SparseRows

_LOCAL = threading.local()


def _trace_state() -> Any:
  """An opaque token of the current JAX trace (None where JAX has none)."""
  try:
    from jax._src import core  # pylint: disable=g-import-not-at-top
    return core.get_opaque_trace_state(convention='flax')
  except (ImportError, AttributeError, TypeError):  # pragma: no cover
    return None


class _Recorder:
  """Collects the lookups of the tables of one `value_and_grad` trace."""

  def __init__(self, mode: str, tables: dict[int, Any],
               perturbations: Optional[dict[int, list[Any]]] = None):
    self.mode = mode                   # 'probe' or 'grad'
    self.tables = tables               # position -> the traced table leaf
    self.perturbations = perturbations or {}
    self.rows: dict[int, list[jax.ShapeDtypeStruct]] = {}
    self.ids: dict[int, list[jax.Array]] = {}
    self.trace = _trace_state()

  def position_of(self, table: Any) -> Optional[int]:
    for pos, leaf in self.tables.items():
      if leaf is table:
        return pos
    return None


def _active() -> Optional[_Recorder]:
  stack = getattr(_LOCAL, 'stack', None)
  return stack[-1] if stack else None


@contextlib.contextmanager
def _recording(recorder: _Recorder):
  stack = getattr(_LOCAL, 'stack', None)
  if stack is None:
    stack = _LOCAL.stack = []
  stack.append(recorder)
  try:
    yield recorder
  finally:
    stack.pop()


def _gather(table: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
  rows = jnp.take(table, ids, axis=0)
  return rows if dtype is None else rows.astype(dtype)


def lookup(table: Any, ids: Any, dtype: Any = None) -> jax.Array:
  """Rows `table[ids]`, whose gradient `value_and_grad` returns row-sparse.

  Outside `value_and_grad` this is `jnp.take(table, ids, axis=0)` (then cast
  to `dtype`), so `jax.grad` gives the usual dense gradient. Inside it, the
  table's gradient arrives as a `SparseRows` holding one row per id. Ids
  follow `jnp.take`: negative ids count from the end and ids past the end
  read NaN rows (and, under `jax.jit`, update nothing).

  Args:
    table: the parameter array `[num_rows, *row_shape]`, exactly as the loss
      function received it (not a copy or a cast of it).
    ids: integer array of any shape.
    dtype: optional dtype of the returned rows.

  Returns:
    An array of shape `ids.shape + table.shape[1:]`.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax
    >>> lazy_optax.lookup(jnp.arange(6.).reshape(3, 2), jnp.array([2, 0]))
    Array([[4., 5.],
           [0., 1.]], dtype=float32)
  """
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f'lookup: ids must be integers, got dtype {ids.dtype}.')
  if jnp.ndim(table) < 1:
    raise ValueError(
        f'lookup: the table must have at least one dimension (its rows), got '
        f'shape {jnp.shape(table)}.')
  recorder = _active()
  pos = None if recorder is None else recorder.position_of(table)
  if pos is None:
    return _gather(table, ids, dtype)
  if _trace_state() != recorder.trace:
    raise ValueError(
        'lookup: a table was looked up inside jax.lax.scan, jax.vmap, '
        'jax.checkpoint or a nested jax.jit within the loss given to '
        'lazy_optax.value_and_grad; row-sparse gradients need the lookups at '
        'the top level of the loss. Gather the ids first and look them up '
        'once, or use jax.value_and_grad for a dense gradient.')
  if recorder.mode == 'probe':
    rows = _gather(jax.lax.stop_gradient(table), ids, dtype)
    recorder.rows.setdefault(pos, []).append(
        jax.ShapeDtypeStruct(rows.shape, rows.dtype))
    return rows
  pending = recorder.perturbations.get(pos)
  if pending is None:   # a table used outside lookups: dense gradient
    return _gather(table, ids, dtype)
  rows = _gather(jax.lax.stop_gradient(table), ids, dtype)
  if not pending or pending[0].shape != rows.shape:
    raise ValueError(
        'lookup: the loss function looked up its tables with other shapes '
        'when it was traced a second time; value_and_grad needs a loss whose '
        'lookups depend only on the shapes of its inputs.')
  perturbation = pending.pop(0)
  num_rows = jnp.shape(table)[0]
  flat = ids.reshape(-1)
  flat = jnp.where(flat < 0, flat + num_rows, flat)  # as jnp.take reads them
  recorder.ids.setdefault(pos, []).append(flat)
  return rows + perturbation.astype(rows.dtype)


def _is_table(leaf: Any) -> bool:
  return (hasattr(leaf, 'shape') and hasattr(leaf, 'dtype')
          and len(leaf.shape) >= 1
          and jnp.issubdtype(leaf.dtype, jnp.inexact))


def _unused_inputs(jaxpr: Any) -> list[bool]:
  """For each input of a closed jaxpr, whether no equation or output uses it."""
  used = set()
  for eqn in jaxpr.jaxpr.eqns:
    used.update(id(v) for v in eqn.invars)
  used.update(id(v) for v in jaxpr.jaxpr.outvars)
  return [id(v) not in used for v in jaxpr.jaxpr.invars]


def value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    tables: Optional[Sequence[str]] = None,
) -> Callable[..., Any]:
  """Like `jax.value_and_grad`, with row-sparse gradients for looked-up tables.

  `fun(params, *args, **kwargs)` returns a scalar loss (and an auxiliary
  value if `has_aux`). Every table that `fun` reads only through
  `lazy_optax.lookup` (or the lazy_optax embedding layers) gets its gradient
  as a `SparseRows` with one row per looked-up id, computed in O(ids) without
  any table-sized array; every other parameter gets its ordinary dense
  gradient. A table that `fun` also uses outside lookups (tied output
  embeddings, a norm penalty) gets a dense gradient holding both parts.

  The gradients are differentiated with respect to `params` only (the first
  argument). Call it under `jax.jit` as usual; it traces `fun` twice.

  Args:
    fun: the loss function; its first argument is the parameter tree.
    has_aux: whether `fun` returns `(loss, aux)`.
    tables: optional names of the tables that must get row-sparse gradients:
      a parameter path joined with `/` (`'params/embed/embedding'`) or its
      last part (`'embedding'`). Other parameters then get dense gradients
      even when looked up. A named table that `fun` never passes to `lookup`,
      or also uses densely, is an error. By default every looked-up table
      that is used only through lookups is row-sparse.

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
  if isinstance(tables, str):
    tables = (tables,)
  wanted = None if tables is None else tuple(tables)

  def call(params, args, kwargs):
    out = fun(params, *args, **kwargs)
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            'value_and_grad(has_aux=True): fun must return a pair '
            f'(loss, aux), got {type(out).__name__}.')
      return out
    return out, None

  def wrapped(params, *args, **kwargs):
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in flat]
    names = [path_name(path) for path, _ in flat]

    def named(i):
      return wanted is None or any(
          names[i] == w or names[i].endswith('/' + w) for w in wanted)

    candidates = [i for i, leaf in enumerate(leaves)
                  if _is_table(leaf) and named(i)]
    if wanted is not None:
      for w in wanted:
        if not any(names[i] == w or names[i].endswith('/' + w)
                   for i in candidates):
          raise ValueError(
              f'value_and_grad: no floating-point parameter of at least one '
              f'dimension is named {w!r}; parameters: {names}.')

    # Pass 1 (trace only): shapes of the lookups, and which tables are also
    # used outside lookups (their tangents reach the loss).
    probe = _Recorder('probe', {})

    def probe_fn(*tangents):
      def primal(*values):
        full = list(leaves)
        for i, v in zip(candidates, values):
          full[i] = v
        probe.tables = dict(zip(candidates, values))
        probe.trace = _trace_state()
        with _recording(probe):
          loss, _ = call(treedef.unflatten(full), args, kwargs)
        return loss
      return jax.jvp(primal, tuple(leaves[i] for i in candidates),
                     tangents)[1]

    structs = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
               for i in candidates]
    unused = _unused_inputs(jax.make_jaxpr(probe_fn)(*structs))
    sparse = []
    for i, free in zip(candidates, unused):
      looked_up = i in probe.rows
      if wanted is not None and not looked_up:
        raise ValueError(
            f'value_and_grad: table {names[i]} was named in tables= but the '
            'loss never looked it up with lazy_optax.lookup (or a lazy_optax '
            'embedding layer); plain indexing gives no row-sparse gradient.')
      if wanted is not None and not free:
        raise ValueError(
            f'value_and_grad: table {names[i]} was named in tables= but the '
            'loss also uses it outside lookups (for example a tied output '
            'layer via attend); its gradient is dense. Leave it out of '
            'tables= to get that dense gradient.')
      if looked_up and free:
        sparse.append(i)

    # Pass 2: differentiate w.r.t. the other parameters and perturbations.
    dense = [i for i in range(len(leaves)) if i not in sparse]
    zeros = {i: [jnp.zeros(s.shape, s.dtype) for s in probe.rows[i]]
             for i in sparse}

    def grad_fn(dense_values, perturbations):
      full = list(leaves)
      for i, v in zip(dense, dense_values):
        full[i] = v
      recorder = _Recorder('grad', {i: leaves[i] for i in sparse},
                           {i: list(p) for i, p in perturbations.items()})
      with _recording(recorder):
        loss, aux = call(treedef.unflatten(full), args, kwargs)
      for i in sparse:
        if recorder.perturbations[i] or i not in recorder.ids:
          raise ValueError(
              'value_and_grad: the loss function looked up its tables a '
              'different number of times when traced a second time; it must '
              'look them up the same way on every call.')
      ids = {i: jnp.concatenate(recorder.ids[i]) for i in sparse}
      return loss, (aux, ids)

    (loss, (aux, ids)), (g_dense, g_rows) = jax.value_and_grad(
        grad_fn, argnums=(0, 1), has_aux=True)(
            [leaves[i] for i in dense], zeros)
    grads: list[Any] = [None] * len(leaves)
    for i, g in zip(dense, g_dense):
      grads[i] = g
    for i in sparse:
      table = leaves[i]
      values = jnp.concatenate(
          [g.reshape((-1,) + tuple(table.shape[1:])) for g in g_rows[i]])
      grads[i] = SparseRows(ids[i], values.astype(table.dtype),
                            num_rows=table.shape[0])
    grads = treedef.unflatten(grads)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped
