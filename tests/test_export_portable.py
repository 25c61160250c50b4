"""The documented train steps lower for GPU and TPU, on this CPU-only machine.

Every optimizer's step (the plain-JAX step of docs/train_steps.md; all but
`lazy_adam_cowclip`'s, see `_cowclip_step`), a hashed
step (docs/hashed_ids.md: `IdTable.assign` + `reset_rows` + `lookup` +
update) and a bag step (`lookup_bag`) is exported with
`jax.export.export(jax.jit(step), platforms=['cuda', 'tpu'])`: the StableHLO a
GPU or TPU would compile, produced without one. Each module must

- lower at all (`jax.export` also refuses any custom call whose target has
  no compatibility guarantee, which a C++ kernel target is not);
- hold no call to lazy_optax's C++ CPU kernels (`lazy_optax_LazyOptax...`
  targets) anywhere: those exist on the CPU only;
- hold no host callback (`xla_python_cpu_callback`, `xla_ffi_python_...`,
  any target naming a Python callback) outside a branch of a conditional;
- hold no run-time conditional (XLA:GPU copies each predicate to the host
  and waits for it, per step; a `platform_dependent`'s `case` on the
  platform's index is resolved before compiling and does not count), except
  one with a host callback in a branch (an error report).

How the callback check reads the module: it walks the text line by line,
tracking the braces of regions. A `stablehlo.case` or `stablehlo.if` opens
regions that run only when their branch is taken; a custom call met while
such a region is open counts as conditional. Calls into private functions
(`func.call` / `call @f`) are followed: a callback inside a function counts
as unconditional when some unconditional path of calls reaches it. The check
does not prove that a conditional branch is taken only on error (that is
the job of the error tests); it proves that no host round trip sits on the
path every step takes. Note that jax 0.10 cannot lower a host callback for
`cuda` or `tpu` on a CPU-only host at all ("multi-platform lowering for
python_callback"), so today a step holding one, even in an error branch,
already fails at the export: the check stands for the day it can.

The same walk counts the sorts, scatters, gathers and conditionals each
step compiles to (calls into private functions counted once per call, as
XLA inlines them), one lowering per platform; docs/performance.md's table
"What a GPU or TPU compiles" gives them. `python3
tests/test_export_portable.py` prints that table. Table sizes are small: the lowering does not depend on them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax

NUM_ROWS, DIM, BATCH, BAG = 64, 4, 8, 3
PLATFORMS = ('cuda', 'tpu')
COUNTED = ('sort', 'scatter', 'gather')

# Every test of the file on one worker: the steps' traces and each
# platform's export are cached in the process (`_step_and_args`,
# `exported`), so each step is traced once and exported once per set of
# platforms, not once again by each worker.
pytestmark = pytest.mark.xdist_group('export_portable')

_KERNEL = re.compile(r'lazy_optax_|LazyOptax')
_CALLBACK = re.compile(r'callback', re.IGNORECASE)
# Function names: `@name`, or quoted (`@"<lambda>"`).
_FUNC = re.compile(
    r'func\.func\s+(?:public\s+|private\s+)?@("[^"]+"|[\w.$-]+)')
_CALL = re.compile(r'(?<![\w.])(?:func\.)?call\s+@("[^"]+"|[\w.$-]+)')
_TARGET = re.compile(
    r'stablehlo\.custom_call\s+@([\w.$-]+)|call_target_name\s*=\s*"([^"]+)"')
_OP = re.compile(r'\bstablehlo\.(\w+)\b')
_CONDITIONAL = re.compile(r'\bstablehlo\.(?:case|if)\b')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_CONSTANT = re.compile(r'^\s*(%[\w#]+)\s*=\s*stablehlo\.constant\b')
_SELECTOR = re.compile(
    r'(%[\w]+)(?::\d+)?\s*=\s*"?stablehlo\.(case|if)"?\s*\(\s*(%[\w#]+)')


@dataclasses.dataclass
class _Branching:
  """One conditional decided at run time: what its branches hold."""
  targets: set = dataclasses.field(default_factory=set)
  calls: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Function:
  """What one function of a module holds, split by whether it runs always."""
  ops: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  targets: list = dataclasses.field(default_factory=list)  # (name, cond)
  calls: list = dataclasses.field(default_factory=list)    # (callee, cond)
  branchings: list = dataclasses.field(default_factory=list)  # _Branching


def read_module(text: str) -> dict[str, _Function]:
  """Parses StableHLO text roughly: functions, ops, custom calls, calls,
  whether each sits inside a region of a `case`/`if`, and which conditionals
  are decided at run time (`_Function.branchings`).

  A `jax.lax.platform_dependent` lowers to a `case` on a constant (the
  platform's index) and a `case` on its result: both are resolved before
  XLA compiles the module, so neither is a run-time conditional.
  """
  functions: dict[str, _Function] = {}
  current = _Function()
  depth = 0
  constants: set[str] = set()
  static: set[str] = set()            # constants and platform indices
  # (brace depth where each case/if began, its _Branching or None)
  open_conditionals: list[tuple[int, Any]] = []
  for line in text.splitlines():
    name = _FUNC.search(line)
    if name:
      current = functions.setdefault(name.group(1), _Function())
      constants, static = set(), set()
    conditional = bool(open_conditionals)
    inside = [b for _, b in open_conditionals if b is not None]
    for target in _TARGET.finditer(line):
      current.targets.append((target.group(1) or target.group(2), conditional))
      for b in inside:
        b.targets.add(target.group(1) or target.group(2))
    for callee in _CALL.finditer(line):
      current.calls.append((callee.group(1), conditional))
      for b in inside:
        b.calls.append(callee.group(1))
    code = _STRING.sub('""', line)
    for op in _OP.finditer(line):
      current.ops[op.group(1)] += 1
    constant = _CONSTANT.search(line)
    if constant:
      constants.add(constant.group(1))
      static.add(constant.group(1))
    if _CONDITIONAL.search(line):
      selector = _SELECTOR.search(line)
      branching = None
      if selector and selector.group(3) in static:
        if selector.group(3) in constants:
          static.add(selector.group(1))   # the platform's index
      else:
        branching = _Branching()
        current.branchings.append(branching)
      open_conditionals.append((depth, branching))
    depth += code.count('{') - code.count('}')
    while open_conditionals and depth <= open_conditionals[-1][0]:
      open_conditionals.pop()
  return functions


def unconditional_targets(functions: dict[str, _Function],
                          entry: str = 'main') -> set[str]:
  """Custom-call targets reached from `entry` outside any conditional."""
  found: set[str] = set()
  seen: set[str] = set()
  todo = [entry]
  while todo:
    name = todo.pop()
    if name in seen or name not in functions:
      continue
    seen.add(name)
    fn = functions[name]
    found.update(t for t, cond in fn.targets if not cond)
    todo.extend(c for c, cond in fn.calls if not cond)
  return found


def all_targets(functions: dict[str, _Function]) -> set[str]:
  return {t for fn in functions.values() for t, _ in fn.targets}


def op_counts(functions: dict[str, _Function],
              entry: str = 'main') -> collections.Counter:
  """Ops of `entry` with every called function's ops added once per call."""
  @functools.lru_cache(maxsize=None)
  def total(name: str) -> tuple:
    fn = functions.get(name)
    if fn is None:
      return ()
    counts = collections.Counter(fn.ops)
    for callee, _ in fn.calls:
      counts.update(dict(total(callee)))
    return tuple(sorted(counts.items()))
  return collections.Counter(dict(total(entry)))


def _reaches_callback(functions: dict[str, _Function], targets: set,
                      calls: list) -> bool:
  """Whether these targets, or the functions called, hold a host callback."""
  seen: set[str] = set()
  todo = list(calls)
  found = any(_CALLBACK.search(t) for t in targets)
  while todo and not found:
    name = todo.pop()
    if name in seen or name not in functions:
      continue
    seen.add(name)
    fn = functions[name]
    found = any(_CALLBACK.search(t) for t, _ in fn.targets)
    todo.extend(c for c, _ in fn.calls)
  return found


def conditional_counts(functions: dict[str, _Function],
                       entry: str = 'main') -> tuple[int, int]:
  """Run-time conditionals of `entry` (called functions' once per call):
  `(total, reporting)`, where `reporting` counts those with a host callback
  in a branch (an error report, never taken by a normal batch)."""
  @functools.lru_cache(maxsize=None)
  def total(name: str) -> tuple[int, int]:
    fn = functions.get(name)
    if fn is None:
      return 0, 0
    reporting = sum(_reaches_callback(functions, b.targets, b.calls)
                    for b in fn.branchings)
    counts = (len(fn.branchings), reporting)
    for callee, _ in fn.calls:
      sub = total(callee)
      counts = (counts[0] + sub[0], counts[1] + sub[1])
    return counts
  return total(entry)


# --- the documented steps ---------------------------------------------------

def _params():
  rng = np.random.default_rng(0)
  return {'table': jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)) * 0.1,
                               jnp.float32),
          'w': jnp.ones(DIM, jnp.float32)}


def _plain_step(tx):
  """docs/train_steps.md's plain-JAX step."""
  def train_step(params, opt_state, ids, y):
    def loss_fn(p):
      return jnp.mean((lazy_optax.lookup(p['table'], ids) @ p['w'] - y) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss
  params = _params()
  args = (params, tx.init(params), jnp.zeros(BATCH, jnp.int32),
          jnp.zeros(BATCH, jnp.float32))
  return train_step, args


def _cowclip_step():
  """docs/optimizers.md's CowClip step: the batch's counts beside the
  gradient, through optax's extra arguments.

  Not in STEPS: the check that the counts name the gradient's ids is a host
  callback in a `lax.cond` branch, and jax 0.10 refuses to lower it for
  `cuda` or `tpu` on a CPU-only host ("the platform for the specified
  backend cpu is different from the lowering platform cuda"). Add it to
  STEPS once that lowers (or the check lowers without a host callback)."""
  tx = lazy_optax.lazy_adam_cowclip(0.05)

  def train_step(params, opt_state, ids, y):
    def loss_fn(p):
      return jnp.mean((lazy_optax.lookup(p['table'], ids) @ p['w'] - y) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    counts = {'table': lazy_optax.id_counts(ids, NUM_ROWS), 'w': None}
    updates, opt_state = tx.update(grads, opt_state, params, counts=counts)
    return lazy_optax.apply_updates(params, updates), opt_state, loss
  params = _params()
  args = (params, tx.init(params), jnp.zeros(BATCH, jnp.int32),
          jnp.zeros(BATCH, jnp.float32))
  return train_step, args


def _bag_step():
  """A multi-hot feature: `lookup_bag` with lengths, mean pooling."""
  tx = lazy_optax.lazy_adam(0.05)

  def train_step(params, opt_state, ids, lengths, y):
    def loss_fn(p):
      pooled = lazy_optax.lookup_bag(p['table'], ids, lengths=lengths)
      return jnp.mean((pooled @ p['w'] - y) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss
  params = _params()
  args = (params, tx.init(params), jnp.zeros((BATCH, BAG), jnp.int32),
          jnp.full(BATCH, 2, jnp.int32), jnp.zeros(BATCH, jnp.float32))
  return train_step, args


def _hashed_step(batch=BATCH, eviction='lfu'):
  """docs/hashed_ids.md's step: assign + reset_rows + lookup + update."""
  table_ids = lazy_optax.IdTable(capacity=NUM_ROWS, probe=8, eviction=eviction)
  tx = lazy_optax.lazy_adam(1e-2)
  init = jax.nn.initializers.normal(0.01)
  key = jax.random.key(0)

  def train_step(params, opt_state, id_state, words, labels, step):
    slots, id_state, fresh = table_ids.assign(id_state, words, step=step)
    params, opt_state = lazy_optax.reset_rows(
        tx, params, opt_state, {'emb/table': fresh}, init=init, key=key)

    def loss_fn(params):
      rows = lazy_optax.lookup(params['emb']['table'], slots)
      return jnp.mean((rows @ params['w'] - labels) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (lazy_optax.apply_updates(params, updates), opt_state, id_state,
            loss)
  params = {'emb': {'table': jnp.zeros((NUM_ROWS, DIM))},
            'w': jnp.ones(DIM)}
  words = lazy_optax.split_ids(np.arange(batch, dtype=np.int64) * 7919)
  args = (params, tx.init(params), table_ids.init(), words,
          jnp.ones(batch, jnp.float32), 0)
  return train_step, args


STEPS: dict[str, Callable[[], tuple[Callable[..., Any], tuple]]] = {
    'lazy_adam': lambda: _plain_step(lazy_optax.lazy_adam(0.05)),
    'lazy_adamw': lambda: _plain_step(lazy_optax.lazy_adamw(0.05)),
    'adam_with_counter': lambda: _plain_step(
        lazy_optax.adam_with_counter(0.05)),
    'rowwise_adagrad': lambda: _plain_step(lazy_optax.rowwise_adagrad(0.1)),
    'partial_rowwise_adam': lambda: _plain_step(
        lazy_optax.partial_rowwise_adam(0.05)),
    'ftrl': lambda: _plain_step(lazy_optax.ftrl(0.1, l1=0.01)),
    'rowwise_adagrad_with_counter (adagradw)': lambda: _plain_step(
        lazy_optax.rowwise_adagrad_with_counter(
            0.1, weight_decay=0.01, counter_weight_decay_mode='adagradw')),
    'rowwise_rmsprop_ar': lambda: _plain_step(
        lazy_optax.rowwise_rmsprop_ar(0.1, ar_alpha=0.01)),

    'rowwise_adagrad + row_max_norm': lambda: _plain_step(lazy_optax.lazy(
        optax.chain(lazy_optax.scale_by_rowwise_adagrad(),
                    optax.scale_by_learning_rate(0.1),
                    lazy_optax.row_max_norm(1.0)))),
    'lazy(optax.adam)': lambda: _plain_step(lazy_optax.lazy(optax.adam(0.05))),
    'hashed step (lazy_adam)': _hashed_step,
    # Past 256 ids the CPU resets fresh rows in chunks; the eviction of
    # the default before.
    'hashed step, 1024 ids, lru': functools.partial(_hashed_step, 1024,
                                                    'lru'),
    'bag step (lazy_adam)': _bag_step,
}


def _export(step, args, platforms):
  try:
    return jax.export.export(jax.jit(step, donate_argnums=(0, 1)),
                             platforms=list(platforms))(*args)
  except (NotImplementedError, ValueError) as e:
    raise AssertionError(
        f'the step does not lower for {platforms}: {e}'[:2000]) from e


@functools.lru_cache(maxsize=None)
def _step_and_args(name: str) -> tuple[Callable[..., Any], tuple]:
  """One step function per name: its exports for each set of platforms
  reuse jax's trace of it (the same function, the same arguments), and only
  the lowering is done per platform."""
  return STEPS[name]()


@functools.lru_cache(maxsize=None)
def exported(name: str, platforms: tuple[str, ...]) -> dict[str, _Function]:
  """The parsed module of one step for `platforms`, lowered once."""
  step, args = _step_and_args(name)
  return read_module(_export(step, args, platforms).mlir_module())


# --- the checker itself is checked on modules that do hold what it rejects --

def _check(functions):
  kernels = sorted(t for t in all_targets(functions) if _KERNEL.search(t))
  callbacks = sorted(t for t in unconditional_targets(functions)
                     if _CALLBACK.search(t))
  return kernels, callbacks


def test_check_finds_callbacks_outside_conditionals_only():
  def cb(x):
    return x

  def always(x):
    return jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  def on_error(x):
    return jax.lax.cond(x[0] < 0, always, lambda x: x, x)

  def nested(x):   # the callback inside a private function under a cond
    return jax.lax.cond(x[0] < 0, jax.jit(always), lambda x: x, x)

  def called(x):   # the callback inside a private function, always called
    return jax.jit(always)(x) + 1

  x = jnp.ones(3)
  text = {f.__name__: jax.jit(f).lower(x).as_text()
          for f in (always, on_error, nested, called)}
  for name, rejected in (('always', True), ('on_error', False),
                         ('nested', False), ('called', True)):
    functions = read_module(text[name])
    assert any(_CALLBACK.search(t) for t in all_targets(functions)), name
    assert bool(_check(functions)[1]) == rejected, (name, text[name])


def test_check_counts_run_time_conditionals_only():
  """A `lax.cond` is a run-time conditional, one holding a callback is
  counted as a report too; a `platform_dependent` (resolved before XLA
  compiles) is not one."""
  def cb(x):
    return x

  def report(x):
    return jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

  def branch(x):
    return jax.lax.cond(x[0] < 0, jnp.abs, lambda x: x, x)

  def on_error(x):
    return jax.lax.cond(x[0] < 0, jax.jit(report), lambda x: x, x)

  def per_platform(x):
    return jax.lax.platform_dependent(x, cpu=jnp.abs, default=jnp.sin)

  def nested(x):   # a cond inside a platform_dependent branch, twice called
    inner = jax.jit(lambda x: jax.lax.platform_dependent(
        x, cpu=branch, default=branch))
    return inner(inner(x))

  x = jnp.ones(3)
  # on_error's callback cannot be exported for cuda or tpu (see above): its
  # CPU lowering, the same text for both, lowered once.
  on_error_text = jax.jit(on_error).lower(x).as_text()
  for fn, want in ((branch, (1, 0)), (on_error, (1, 1)),
                   (per_platform, (0, 0)), (nested, (2, 0))):
    for platform in PLATFORMS:
      text = jax.export.export(jax.jit(fn), platforms=[platform])(
          x).mlir_module() if fn is not on_error else on_error_text
      functions = read_module(text)
      assert conditional_counts(functions) == want, (fn.__name__, text)
      if fn is per_platform:
        assert op_counts(functions)['case'] >= 1, text


@pytest.mark.cpu_kernels
def test_check_finds_cpu_kernels():
  """On the CPU the same lazy_adam step calls the C++ kernel, and the check
  names it."""
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  step, args = _step_and_args('lazy_adam')   # the step exported below
  text = jax.jit(step, donate_argnums=(0, 1)).lower(*args).as_text()
  kernels, _ = _check(read_module(text))
  assert 'lazy_optax_LazyOptaxAdam' in kernels, kernels


# --- the steps --------------------------------------------------------------

@pytest.mark.parametrize('name', list(STEPS))
def test_step_lowers_for_gpu_and_tpu_without_kernels_or_callbacks(name):
  functions = exported(name, PLATFORMS)
  kernels, callbacks = _check(functions)
  assert not kernels, f'{name}: C++ kernel calls for {PLATFORMS}: {kernels}'
  assert not callbacks, (
      f'{name}: host callbacks outside a conditional: {callbacks}')
  counts = op_counts(functions)
  # A step that trains a table gathers its rows and scatters them back.
  assert counts['gather'] >= 1 and counts['scatter'] >= 1, counts


@pytest.mark.parametrize('name', list(STEPS))
@pytest.mark.parametrize('platform', PLATFORMS)
def test_step_holds_no_conditional_a_normal_batch_decides(name, platform):
  """XLA:GPU reads each conditional's predicate back to the host (a copy and
  a wait per step), and copies a table that one branch passes through while
  the other scatters into it: every documented step lowers for GPU and TPU
  without a run-time conditional. The only ones allowed hold a host
  callback in a branch (`damage.report`'s error report, taken only for a
  damaged id code); none of these steps holds one today."""
  functions = exported(name, (platform,))
  total, reporting = conditional_counts(functions)
  assert total == reporting == 0, (name, platform, total, reporting)


def op_count_table() -> str:
  """docs/performance.md's table: sorts / scatters / gathers / run-time
  conditionals per step and platform."""
  lines = ['| step | ' + ' | '.join(
               f'{p}: {", ".join(COUNTED)}, conditionals' for p in PLATFORMS)
           + ' |', '| --- |' + ' ---: |' * len(PLATFORMS)]
  for name in STEPS:
    cells = []
    for platform in PLATFORMS:
      functions = exported(name, (platform,))
      counts = op_counts(functions)
      cells.append(' / '.join(
          [str(counts[op]) for op in COUNTED]
          + [str(conditional_counts(functions)[0])]))
    lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def test_op_counts_per_platform(capsys):
  """Each platform's own lowering, counted; the table is printed (run with
  `-s`) for docs/performance.md."""
  table = op_count_table()
  with capsys.disabled():
    print('\n' + table)
  for name in STEPS:
    for platform in PLATFORMS:
      counts = op_counts(exported(name, (platform,)))
      assert counts['scatter'] >= 1, (name, platform, counts)


if __name__ == '__main__':
  print(op_count_table())
