"""CPU row kernels, called through JAX's public `jax.ffi`.

`rows.cc` holds the kernels (deduplication, row gather, scatter and
scatter-add, and the fused row update of each lazy_optax rule),
`id_kernels.cc` those of `IdTable` (wrapped by `lazy_optax._src.id_kernels`);
`build.py`
finds or builds the compiled library and refuses files it cannot trust.

Every rule kernel is called the same way (`rule`): its hyperparameters are
a record (a NamedTuple in the rule's module) whose fields are those of the
rule's `Hyper` struct in `rows.cc`, in the same order; the library exports
each struct's field names (`<target>Fields`), and `pack` refuses a record
that does not list them. Fields are float32, but for the int32 ones the
library marks `name:int32` (a global step, exact past 2**24); `pack` keeps
the bits of each (uint32 words), so the kernel reads every field exactly.

State tables are float32 or bfloat16 (`STORAGE_DTYPES`), and a rule's
per-row counters int32 (`COUNTER_DTYPE`, whatever the table's dtype).

The library is loaded eagerly, never inside a trace: by the first `init` of a
lazy transformation on concrete parameters, by `lazy_optax.kernel_status()`,
or ahead of time with `python3 -m lazy_optax.build_kernels`. Until then, and
wherever it is missing (no compiler, a failed build, a refused file, or
`LAZY_OPTAX_CPU_KERNELS=0`), `loaded()` is False and the pure-XLA paths are
used: the same rules, the same numbers up to float32 rounding.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from lazy_optax._src.cpu_kernels import build

ENV_SWITCH = 'LAZY_OPTAX_CPU_KERNELS'
# The rule kernels (rows.cc's LAZY_OPTAX_RULE), all called through `rule`.
RULES = ('LazyOptaxAdam', 'LazyOptaxAmsgrad', 'LazyOptaxRowwiseAdagrad',
         'LazyOptaxPartialRowwiseAdam', 'LazyOptaxFtrl',
         'LazyOptaxRowwiseRmspropAr', 'LazyOptaxRowwiseAdagradWithCounter')
TARGETS = ('LazyOptaxDedup', 'LazyOptaxGather', 'LazyOptaxScatter',
           'LazyOptaxIdAssign', 'LazyOptaxIdFind') + RULES
# Storage dtypes the kernels read and write (tables, moments, accumulators).
STORAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The dtype of a rule's counter tables (its C++ `kInt32`), read exactly.
COUNTER_DTYPE = jnp.dtype(jnp.int32)
_INT_MARK = ':int32'


class Status(NamedTuple):
  """Whether the kernels are loaded, and from where or why not."""
  loaded: bool
  detail: str  # the library's path and origin, or the reason it is missing


_lock = threading.Lock()
_status: Optional[Status] = None
# Each rule kernel's hyperparameter fields, as the loaded library declares
# (int32 fields marked `name:int32`).
_fields: dict[str, tuple[str, ...]] = {}


def _words(value: Any, is_int: bool) -> jax.Array:
  """One hyperparameter as the uint32 word the kernel reads: the bits of
  its float32 value, or of its int32 value for an int32 field."""
  if is_int:
    x = jnp.asarray(value)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f'an int32 kernel field was given a {x.dtype} value')
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
  return jax.lax.bitcast_convert_type(jnp.asarray(value, jnp.float32),
                                      jnp.uint32)


def _load() -> Status:
  if os.environ.get(ENV_SWITCH, '1') == '0':
    return Status(False, f'switched off by {ENV_SWITCH}=0')
  found = build.find()
  if found.path is None:
    build.LOGGER.warning(
        'lazy_optax: CPU kernels unavailable (%s); the XLA path is used.',
        found.origin)
    return Status(False, found.origin)
  try:
    lib = ctypes.cdll.LoadLibrary(found.path)
    fields = {}
    for name in RULES:
      read = getattr(lib, f'{name}Fields')
      read.restype = ctypes.c_char_p
      fields[name] = tuple(read().decode('ascii').rstrip(',').split(','))
    for name in TARGETS:
      jax.ffi.register_ffi_target(
          f'lazy_optax_{name}', jax.ffi.pycapsule(getattr(lib, name)),
          platform='cpu')
  except (OSError, AttributeError, ValueError, RuntimeError) as e:
    build.LOGGER.warning(
        'lazy_optax: the CPU kernels at %s could not be loaded (%s); the XLA '
        'path is used.', found.path, e)
    return Status(False, f'{found.path} could not be loaded: {e}')
  _fields.update(fields)
  return Status(True, f'{found.path} ({found.origin})')


def ensure_loaded() -> Status:
  """Loads the kernels once per process (building them if needed).

  Call it eagerly, never inside a trace. Never raises: a failure is logged
  once and recorded in the returned status.

  Returns:
    The `Status`.
  """
  global _status
  with _lock:
    if _status is None:
      try:
        _status = _load()
      except Exception as e:  # pylint: disable=broad-except
        build.LOGGER.warning('lazy_optax: CPU kernels unavailable (%r).', e)
        _status = Status(False, f'unexpected error: {e!r}')
    return _status


def load_for(tree: Any) -> None:
  """Loads the kernels for an eager call on concrete CPU arrays.

  Called by `init` (and `init_sharded`): does nothing inside a trace, for
  arrays on other platforms, or once loading was tried.
  """
  if _status is not None:
    return
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.core.Tracer):
      return
    if isinstance(leaf, jax.Array) and any(
        getattr(d, 'platform', None) == 'cpu'
        for d in leaf.sharding.device_set):
      ensure_loaded()
      return


def status() -> Optional[Status]:
  """The status if loading was attempted, else None (no side effects)."""
  return _status


_told_not_loaded = False


def loaded() -> bool:
  """Whether the kernels are registered with XLA (never loads them).

  Asked while a step is traced. If loading was never tried in this process
  (the optimizer's `init` ran inside `jax.jit`, or not here) on a CPU
  backend, this says so once on the `lazy_optax` logger: the step then runs
  XLA's row updates.
  """
  global _told_not_loaded
  if (_status is None and not _told_not_loaded
      and os.environ.get(ENV_SWITCH, '1') != '0'
      and jax.default_backend() == 'cpu'):
    _told_not_loaded = True
    build.LOGGER.warning(
        'lazy_optax: the CPU kernels are not loaded in this process (they '
        'load at the first init of an optimizer on concrete CPU arrays, '
        'never inside jax.jit), so this step uses XLA\'s row updates. Call '
        'tx.init outside jax.jit, or lazy_optax.kernel_status(), before '
        'tracing the step (python3 -m lazy_optax.build_kernels builds them '
        'ahead of time).')
  return _status is not None and _status.loaded


def _call(name: str, results, aliases=None):
  return jax.ffi.ffi_call(f'lazy_optax_{name}', results,
                          input_output_aliases=aliases or {},
                          vmap_method='sequential')


def _like(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def dedup(ids: jax.Array, values: jax.Array, num_rows: int
          ) -> tuple[jax.Array, jax.Array]:
  """Distinct ids in ascending order (then `num_rows`) and their summed rows.

  Ids outside `[0, num_rows)` are dropped; sums are taken in float32.
  """
  n = ids.shape[0]
  call = _call('LazyOptaxDedup', (jax.ShapeDtypeStruct((n,), jnp.int32),
                                  _like(values)))
  return call(ids.astype(jnp.int32), values, num_rows=int(num_rows))


def gather(table: jax.Array, ids: jax.Array) -> jax.Array:
  """`table[ids]`, zero rows for ids outside `[0, rows)`."""
  shape = (ids.shape[0],) + tuple(table.shape[1:])
  call = _call('LazyOptaxGather', jax.ShapeDtypeStruct(shape, table.dtype))
  return call(table, ids.astype(jnp.int32))


def scatter(table: jax.Array, ids: jax.Array, rows: jax.Array) -> jax.Array:
  """`table` with rows `ids` set to `rows` (distinct ids; others dropped)."""
  call = _call('LazyOptaxScatter', _like(table), {0: 0})
  return call(table, ids.astype(jnp.int32), rows.astype(table.dtype))


def fields(target: str) -> tuple[str, ...]:
  """The hyperparameter fields of rule kernel `target`, in the library's
  order (its `Hyper` struct in rows.cc).

  Args:
    target: one of `RULES`.

  Returns:
    The field names, or `()` while the kernels are not loaded.

  Example:
    >>> from lazy_optax._src import cpu_kernels
    >>> cpu_kernels.fields('LazyOptaxRowwiseAdagrad') in ((), ('eps', 'l2'))
    True
  """
  if target not in RULES:
    raise ValueError(f'fields: target must be one of {RULES}, got {target!r}.')
  return tuple(f.removesuffix(_INT_MARK) for f in _fields.get(target, ()))


def int_fields(target: str) -> frozenset[str]:
  """The int32 fields of rule kernel `target`'s record (`()` while the
  kernels are not loaded)."""
  return frozenset(f.removesuffix(_INT_MARK) for f in _fields.get(target, ())
                   if f.endswith(_INT_MARK))


def pack(target: str, hyper: Any) -> jax.Array:
  """A rule's hyperparameter record as the kernel's vector of words.

  Args:
    target: one of `RULES`.
    hyper: a NamedTuple whose fields are `fields(target)`, in order (the
      `int_fields(target)` given integer values).

  Returns:
    The uint32 vector of its values' bits: float32 values, and int32 ones
    for the int32 fields.

  Raises:
    TypeError: where the record's fields are not the kernel's (a rule whose
      Python record and C++ struct disagree would read one hyperparameter
      as another).
  """
  expected = fields(target)
  got = tuple(getattr(type(hyper), '_fields', ()))
  if expected and got != expected:
    raise TypeError(
        f'{target}: the hyperparameter record {type(hyper).__name__}{got} '
        f'does not list the kernel\'s fields {expected} in the same order '
        '(rows.cc and the rule\'s module must agree).')
  ints = int_fields(target)
  names = getattr(type(hyper), '_fields', ()) or ('',) * len(hyper)
  return jnp.stack([_words(x, name in ints) for name, x in zip(names, hyper)])


def rule(target: str, ids: jax.Array, grads: jax.Array, hyper: jax.Array,
         params: jax.Array, tables: tuple[jax.Array, ...]
         ) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """Runs rule kernel `target`: updates `tables` in place at `ids`' rows.

  Args:
    target: one of `RULES`.
    ids: the distinct int ids `[N]` (ids outside the tables name no row).
    grads: the gradient rows `[N, ...]`.
    hyper: `pack(target, record)` (a float32 vector is taken as its bits,
      for records of float32 fields only).
    params: the parameter rows, shaped as `grads` (rules that read none get
      `grads`).
    tables: the rule's state tables, in the order of its C++ `kPerRow`
      (float32 or bfloat16; int32 for the tables its `kInt32` marks).

  Returns:
    `(new tables, updates)`: the tables (aliased to the inputs) and the
    float32 update rows (zeros for ids that name no row).
  """
  call = _call(
      target, (jax.ShapeDtypeStruct(grads.shape, jnp.float32),)
      + tuple(_like(t) for t in tables),
      {4 + k: 1 + k for k in range(len(tables))})
  if jnp.dtype(hyper.dtype) != jnp.dtype(jnp.uint32):
    hyper = jax.lax.bitcast_convert_type(hyper.astype(jnp.float32),
                                         jnp.uint32)
  out = call(ids.astype(jnp.int32), grads.astype(jnp.float32), hyper,
             params.astype(jnp.float32), *tables)
  return tuple(out[1:]), out[0]

