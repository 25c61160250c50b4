"""Donated train steps: `make_train_step` and `warn_if_not_donated`.

Without buffer donation XLA copies every table (and its optimizer state) on
each step: the lazy step then costs O(table) again. `make_train_step` also
keeps the train state when it refuses a step: JAX deletes donated inputs
when a computation fails, so the step returns its checks as data
(`damage.recording`) and the helper raises on the host, with the state from
before the step (docs/design.md, "A refused step keeps the train state").
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, ParamSpec, Sequence, TypeVar, Union
import warnings
import weakref

import chex
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from lazy_optax._src import damage

_P = ParamSpec('_P')
_T = TypeVar('_T')

_WARNED: 'weakref.WeakSet[Callable[..., object]]' = weakref.WeakSet()
_WARNED_IDS: set[int] = set()


def _first_time(step: Callable[..., object]) -> bool:
  """True the first time `step` is seen (warn once per step function)."""
  try:
    if step in _WARNED:
      return False
    _WARNED.add(step)
  except TypeError:   # not weakly referenceable
    if id(step) in _WARNED_IDS:
      return False
    _WARNED_IDS.add(id(step))
  return True


def _lowered(step: Callable[..., object], args: Sequence[object],
             kwargs: dict[str, object]) -> jax.stages.Lowered:
  lower = getattr(step, 'lower', None)
  if lower is None:
    raise TypeError(
        'warn_if_not_donated needs a jitted step with a .lower method '
        '(jax.jit, nnx.jit, eqx.filter_jit), got '
        f'{type(step).__name__}.')
  lowered = lower(*args, **kwargs)
  if not isinstance(lowered, jax.stages.Lowered):
    lowered = getattr(lowered, 'lowered', lowered)   # eqx.filter_jit's
  if not isinstance(lowered, jax.stages.Lowered):
    raise TypeError(
        f'{type(step).__name__}.lower(...) gave {type(lowered).__name__}, not '
        'a jax.stages.Lowered.')
  return lowered


def _nbytes(info: jax.stages.ArgInfo) -> int:
  size = 1
  for d in info.shape:
    size *= int(d)
  return size * jnp.dtype(info.dtype).itemsize


def _size(nbytes: int) -> str:
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if nbytes >= scale:
      return f'{nbytes / scale:.1f} {unit}'
  return f'{nbytes} bytes'


def _arg_name(path: jax.tree_util.KeyPath) -> str:
  """`args[0]['table']` for a path into `Lowered.args_info`'s (args, kwargs)."""
  if path and isinstance(path[0], jax.tree_util.SequenceKey) and (
      path[0].idx in (0, 1)):
    return ('args', 'kwargs')[path[0].idx] + jax.tree_util.keystr(path[1:])
  return 'args' + jax.tree_util.keystr(path)


_HLO_TYPES = {'float32': 'f32', 'bfloat16': 'bf16', 'float16': 'f16',
              'float64': 'f64', 'complex64': 'c64', 'complex128': 'c128'}


# Copies of smaller arrays (a layout change of a small kernel) are not
# worth a warning.
COPY_WARN_BYTES = 2**20


def _table_copies(hlo: str, tables: Sequence[tuple[str, jax.stages.ArgInfo]]
                  ) -> list[tuple[str, int, bool]]:
  """Per table-sized copy: the table, its bytes, whether in a cond branch.

  A `copy` (or `copy-start`) instruction whose result has a table's shape
  and dtype copies that table (or another argument of the same shape: all
  of them are named). Tables under `COPY_WARN_BYTES` are left out.
  """
  by_shape: dict[str, list[tuple[str, int]]] = {}
  for name, info in tables:
    if _nbytes(info) >= COPY_WARN_BYTES:
      dtype = jnp.dtype(info.dtype).name
      dims = ','.join(str(int(d)) for d in info.shape)
      by_shape.setdefault(f'{_HLO_TYPES.get(dtype, dtype)}[{dims}]',
                          []).append((name, _nbytes(info)))
  found = []
  for line, in_branch in _copies(hlo):
    result = line.split('=', 1)[-1].strip().split('{', 1)[0].split(' ')[0]
    for name, nbytes in by_shape.get(result.strip('()'), []):
      found.append((name, nbytes, in_branch))
  return found


def _copies(hlo: str) -> list[tuple[str, bool]]:
  """Each copy instruction, and whether it lies in a `lax.cond` branch."""
  branches: set[str] = set()
  for part in hlo.split('branch_computations={')[1:]:
    branches.update(c.strip().lstrip('%')
                    for c in part.split('}', 1)[0].split(','))
  found, computation = [], ''
  for line in hlo.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith('{'):
      computation = line.split()[1 if line.startswith('ENTRY') else 0]
      computation = computation.lstrip('%').split('(', 1)[0]
    elif ' copy(' in line or ' copy-start(' in line:
      found.append((line, computation in branches))
  return found


_COND_CAUSE = (
    'The copies lie inside a lax.cond branch: the step writes the tables '
    'inside a lax.cond whose other branch keeps the old ones, as '
    'optax.apply_if_finite(lazy_optax.lazy_adam(...)) does (it returns the '
    'old state when a step is skipped). Put the condition inside lazy(...): '
    'lazy_optax.lazy(optax.apply_if_finite(tx, ...)) runs it on the touched '
    'rows and writes the tables outside it.')
_LINEAR_CAUSE = (
    'The step reads a table after updating it in place. The usual cause is '
    'a loss linear in the looked-up rows (its gradient does not depend '
    'on them, so nothing orders the lookup before the update): look '
    'the rows up with lazy_optax.lookup inside lazy_optax.value_and_grad '
    '(or its Flax, Haiku and Equinox forms), which orders them; or '
    'return nothing that reads the old table.')


_ADVICE = (
    'Without donation XLA copies every table on each step, and the lazy step '
    'becomes slower than dense Adam. Donate the parameters and optimizer '
    'state: jax.jit(step, donate_argnums=(0, 1)), nnx.jit(step, '
    'donate_argnums=...), eqx.filter_jit(step, donate=...), or build the '
    'step with lazy_optax.perf.make_train_step.')


def warn_if_not_donated(step: Callable[..., object], *args: object,
                        **kwargs: object) -> bool:
  """Warns once if a jitted train step does not update its tables in place.

  Lowers and compiles `step` for these arguments (nothing runs) and checks,
  with public JAX, that every floating-point argument array of two or more
  dimensions (embedding tables, their optimizer moments, kernels) is donated
  (`Lowered.args_info`), that the compiled program does not copy one of them
  whole (a table-sized `copy` in `Compiled.as_text()`: XLA does that when the
  step reads a table after its in-place update, as with a loss linear in
  rows looked up outside `lazy_optax.value_and_grad`; the warning names the
  table and the bytes copied per step), and that the compiled step aliases
  at least that many bytes of its inputs to its outputs
  (`Compiled.memory_analysis()`). The warning (a `UserWarning`) is given
  once per `step`.

  Args:
    step: a function jitted with `jax.jit`, `nnx.jit` or `eqx.filter_jit`.
    *args: example arguments of a step (arrays or `jax.ShapeDtypeStruct`).
    **kwargs: example keyword arguments.

  Returns:
    Whether the tables are donated and aliased.

  Example:
    >>> import warnings, jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> def step(params, ids):
    ...   return {'t': params['t'].at[ids].add(1.0)}
    >>> params = {'t': jnp.zeros((100, 4))}
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   lazy_optax.perf.warn_if_not_donated(jax.jit(step), params,
    ...                                       jnp.array([1]))
    False
    >>> 'not donated' in str(caught[0].message)
    True
    >>> lazy_optax.perf.warn_if_not_donated(
    ...     jax.jit(step, donate_argnums=0), params, jnp.array([1]))
    True
  """
  lowered = _lowered(step, args, kwargs)
  flat = jax.tree_util.tree_flatten_with_path(
      lowered.args_info, is_leaf=lambda x: isinstance(x, jax.stages.ArgInfo))[0]
  tables = [(_arg_name(path), info) for path, info in flat  # 2+-d floats
            if isinstance(info, jax.stages.ArgInfo) and len(info.shape) >= 2
            and jnp.issubdtype(info.dtype, jnp.inexact)]
  missing = [(name, info) for name, info in tables if not info.donated]
  if missing:
    if _first_time(step):
      names = ', '.join(name for name, _ in missing[:4])
      more = f' and {len(missing) - 4} more' if len(missing) > 4 else ''
      size = _size(sum(_nbytes(info) for _, info in missing))
      warnings.warn(
          f'lazy_optax: this train step does not donate {len(missing)} '
          f'floating-point array(s) of 2+ dimensions ({size}): '
          f'{names}{more} are not donated. {_ADVICE}', UserWarning,
          stacklevel=2)
    return False
  compiled = lowered.compile()
  copies = _table_copies(compiled.as_text() or '', tables)
  if copies:
    if _first_time(step):
      names = ', '.join(dict.fromkeys(name for name, _, _ in copies))
      size = _size(sum(nbytes for _, nbytes, _ in copies))
      cause = (_COND_CAUSE if all(branch for _, _, branch in copies)
               else _LINEAR_CAUSE)
      warnings.warn(
          f'lazy_optax: this train step donates its tables, but XLA copies '
          f'{names} in full inside the compiled step ({size} a step). '
          + cause, UserWarning, stacklevel=2)
    return False
  stats = compiled.memory_analysis()
  needed = sum(_nbytes(info) for _, info in tables)
  aliased = getattr(stats, 'alias_size_in_bytes', None)
  if aliased is not None and aliased < needed:
    if _first_time(step):
      warnings.warn(
          f'lazy_optax: this train step donates its tables, but the compiled '
          f'step aliases only {aliased} of their {needed} bytes to its '
          'outputs: XLA copies the rest on each step. Return every donated '
          'table (and optimizer state) with its shape, dtype and sharding '
          'unchanged.', UserWarning, stacklevel=2)
    return False
  return True


def make_train_step(
    fun: Callable[_P, _T],
    *,
    donate_argnums: Union[int, Sequence[int]] = (0, 1),
    **jit_kwargs: Any,
) -> Callable[_P, _T]:
  """`jax.jit(fun, donate_argnums=...)` that checks its donation once, and
  keeps the train state when a step is refused.

  The train step of plain JAX, Flax linen and Haiku is
  `step(params, opt_state, *batch) -> (params, opt_state, ...)`: its first
  two arguments are donated by default, so XLA updates the tables and their
  optimizer state in place. On the first call, `warn_if_not_donated` checks
  the compiled step (one extra compilation) and warns once if tables are not
  donated (other `donate_argnums`) or not aliased (a table returned with
  another dtype or sharding).

  A step that lazy_optax refuses when it runs (row ids damaged by arithmetic
  on the gradient tree: `lazy_optax.checks.DamagedIdsError`; a check of the
  checked mode, `with_id_checks` or `IdTable(checked=True)`:
  `lazy_optax.checks.CheckError`) writes nothing, and the helper raises
  that error (a `lazy_optax.checks.StepError`) with `outputs`: what the step
  returned, where each donated argument's position holds that argument as it
  was before the step. Training resumes from them bit for bit. For this the
  step returns each donated argument's new value at the argument's position
  (output 0 for argument 0, ...). Checks inside `jax.vmap`, `lax.scan` or a
  `shard_map` body of the step keep their host callback, which loses
  donated inputs.

  Args:
    fun: the train step.
    donate_argnums: the positions of the arguments to donate (default:
      params and optimizer state).
    **jit_kwargs: other `jax.jit` arguments (`static_argnums`, ...).

  Returns:
    The jitted step, with `lower` (`jax.jit`'s, of the program that runs:
    its outputs are the pair `(step's outputs, its checks' flags or None)`).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax
    >>> tx = lazy_optax.lazy_adam(0.1)
    >>> params = {'table': jnp.zeros((100, 4))}
    >>> opt_state = tx.init(params)
    >>> def train_step(params, opt_state, ids):
    ...   def loss_fn(p):
    ...     return jnp.sum((lazy_optax.lookup(p['table'], ids) - 1.0) ** 2)
    ...   loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return lazy_optax.apply_updates(params, updates), opt_state, loss
    >>> step = lazy_optax.perf.make_train_step(train_step)
    >>> params, opt_state, loss = step(params, opt_state, jnp.array([3, 5]))
    >>> float(loss)
    8.0
  """
  donated = ((donate_argnums,) if isinstance(donate_argnums, int)
             else tuple(donate_argnums))

  def traced(*args: _P.args,
             **kwargs: _P.kwargs) -> tuple[chex.ArrayTree, Optional[_Refused]]:
    with damage.recording() as refusals:
      out = fun(*args, **kwargs)
    failed = refusals.failed()
    if failed is None:
      return out, None
    return (_kept_when_failed(out, args, donated, failed, refusals),
            _Refused.of(refusals))

  jitted = jax.jit(traced, donate_argnums=donate_argnums, **jit_kwargs)
  checked: list[bool] = []

  @functools.wraps(fun)
  def step(*args: _P.args, **kwargs: _P.kwargs) -> _T:
    if not checked:
      checked.append(True)
      warn_if_not_donated(jitted, *args, **kwargs)
    out, refused = jitted(*args, **kwargs)
    if refused is not None:
      refused.raise_if_failed(out)
    return out

  step.lower = jitted.lower  # type: ignore[attr-defined]
  return step


_NOT_IN_PLACE = (
    'make_train_step: this step can be refused when it runs (its gradients '
    'carry row ids that are checked then), and to hand back the state from '
    'before a refused step it must return the new value of each donated '
    'argument at that argument\'s position, with its structure, shapes and '
    'dtypes (step(params, opt_state, *batch) -> (params, opt_state, ...)); '
    '{problem}. Return it there, or set donate_argnums to the arguments it '
    'returns.')


def _kept_when_failed(out: chex.ArrayTree, args: tuple[object, ...],
                      donated: tuple[int, ...], failed: jax.Array,
                      refusals: damage.Refusals) -> chex.ArrayTree:
  """`out` whose donated arguments' entries are the arguments when `failed`.

  Output `k` holds argument `k`'s new value (a step that donates one
  argument may return that value alone). Leaves that only lazy_optax's
  gated writes changed are kept as they are (they already equal the
  argument); the others are chosen with a `where`.
  """
  single = not isinstance(out, (tuple, list)) or (
      len(donated) == 1 and _same_structure(out, args[donated[0]]))
  outs = [out] if single else list(out)
  for k in donated:
    at = 0 if single else k
    if at >= len(outs) or (single and len(donated) > 1):
      raise TypeError(_NOT_IN_PLACE.format(
          problem=f'it returns {len(outs)} value(s), none for argument {k}'))
    if not _same_structure(outs[at], args[k]):
      raise TypeError(_NOT_IN_PLACE.format(
          problem=f'output {at} has another tree structure than argument '
          f'{k}'))
    outs[at] = jax.tree.map(
        functools.partial(_keep, k=k, failed=failed, refusals=refusals),
        outs[at], args[k])
  if single:
    return outs[0]
  if hasattr(out, '_fields'):  # a NamedTuple of outputs
    return type(out)(*outs)
  return type(out)(outs)


def _same_structure(a: chex.ArrayTree, b: chex.ArrayTree) -> bool:
  structures: list[jax.tree_util.PyTreeDef] = [jax.tree.structure(a),
                                               jax.tree.structure(b)]
  return structures[0] == structures[1]


def _keep(new: ArrayLike, old: ArrayLike, k: int, failed: jax.Array,
          refusals: damage.Refusals) -> ArrayLike:
  """A leaf of output `k`: `old` when `failed` (argument `k`'s leaf)."""
  if refusals.unchanged_when_failed(new, old):
    return new
  if (jnp.shape(new) != jnp.shape(old)
      or jnp.result_type(new) != jnp.result_type(old)):
    raise TypeError(_NOT_IN_PLACE.format(
        problem=f'a leaf of output {k} has shape {jnp.shape(new)}, '
        f'{jnp.result_type(new)} where argument {k} has '
        f'{jnp.shape(old)}, {jnp.result_type(old)}'))
  return jnp.where(failed, old, new)


@jax.tree_util.register_pytree_node_class
class _Refused:
  """A step's checks as data: which failed, and their fields (leaves); the
  errors and messages (static, so they survive in jit's cache)."""

  def __init__(self, leaves: list[tuple[jax.Array, dict[str, jax.Array]]],
               static: tuple[tuple[type, Callable[..., str]], ...]):
    self.leaves, self.static = leaves, static

  @classmethod
  def of(cls, refusals: damage.Refusals) -> '_Refused':
    leaves = [(r.bad, r.fields) for r in refusals.reports]
    static = tuple((r.error, r.message) for r in refusals.reports)
    return cls(leaves, static)

  def tree_flatten(self):
    return (self.leaves,), self.static

  @classmethod
  def tree_unflatten(cls, static, children):
    return cls(children[0], static)

  def raise_if_failed(self, outputs: chex.ArrayTree) -> None:
    """Raises the first failed check's error, carrying `outputs`."""
    bads = np.asarray(jax.device_get([bad for bad, _ in self.leaves]))
    for failed, (_, fields), (error, message) in zip(bads, self.leaves,
                                                     self.static):
      if np.any(failed):
        values = {k: np.asarray(jax.device_get(v)).tolist()
                  for k, v in fields.items()}
        raise error(message(**values) + '\n' + _KEPT, outputs)


_KEPT = (
    'The step wrote nothing: e.outputs holds what it returned, with the '
    'params and optimizer state from before it at the donated positions; '
    'resume from them.')
