"""One backend per table: decided by `lazy(...)`, followed, and told truly.

- `impl='xla'` compiles to a step without a single C++ call, on CPU with the
  kernels loaded (deduplication, gathers, rule, write-back, scatter-add,
  stochastic rounding);
- for every composition that docs/semantics.md lists around a rule,
  `explain_update` says 'cpu_kernel' exactly when the compiled step calls
  the rule's kernel, with the kernels present and hidden, the donated step
  copies no table, and the parameters equal TensorFlow's rule in float64.
"""

import functools
import operator
import re
from typing import Any, Callable, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
from optimizer_cases import CASES
from optimizer_cases import with_impl
import pytest
from reference import TFLazyAdam

import lazy_optax
from lazy_optax._src import cpu_kernels
from lazy_optax._src import train_step

NUM_ROWS, D, N = 500, 64, 24
LR = 0.01
ADAM_KERNEL = 'lazy_optax_LazyOptaxAdam'

pytestmark = pytest.mark.cpu_kernels


def _targets(hlo):
  """The project's FFI targets that a compiled program calls."""
  return sorted(set(re.findall(r'lazy_optax_LazyOptax\w+', hlo)))


def _table_copies(hlo):
  shape = f'[{NUM_ROWS},{D}]'
  return [line for line in hlo.splitlines()
          if (' copy(' in line or ' copy-start(' in line) and shape in line]


def _batches(steps, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    ids = rng.integers(0, 60, N)
    ids[:5] = ids[5]  # duplicates
    yield (jnp.asarray(ids, jnp.int32),
           jnp.asarray(rng.normal(size=(N, D)), jnp.float32))


def _table():
  rng = np.random.default_rng(42)
  return rng.normal(size=(NUM_ROWS, D)).astype(np.float32)


# --- impl='xla': no C++ call at all ----------------------------------------

XLA_OPTIMIZERS = {
    # Every optimizer of tests/optimizer_cases.py that offers impl='xla'.
    **{case.name: with_impl(case, 'xla').make for case in CASES
       if 'xla' in case.impls},
    'lazy(optax.adam, impl=xla)': lambda: lazy_optax.lazy(
        optax.adam(LR), impl='xla'),
    'lazy(chain(scale_by_lazy_adam))': lambda: lazy_optax.lazy(optax.chain(
        lazy_optax.scale_by_lazy_adam(impl='xla'),
        optax.scale_by_learning_rate(LR))),
    'chain(clip_by_global_norm, lazy_adam)': lambda: optax.chain(
        optax.clip_by_global_norm(1e6), lazy_optax.lazy_adam(LR, impl='xla')),
    'inject_hyperparams(lazy_adam)': lambda: optax.inject_hyperparams(
        lazy_optax.lazy_adam)(learning_rate=LR, impl='xla'),
    'apply_if_finite(lazy_adam)': lambda: optax.apply_if_finite(
        lazy_optax.lazy_adam(LR, impl='xla'), 3),
}


# A known gap that the registry's cases show (each fails today; strict, so
# that a fix is noticed): under multi_steps the int32 per-row counter table
# of these rules (last_step, prev_iter) is copied once per step.
_COPIES_A_COUNTER_TABLE = {'adam_with_counter', 'rowwise_adagrad_with_counter',
                           'rowwise_rmsprop_ar'}


def _known_gap(names, reason):
  return [pytest.param(name, marks=pytest.mark.xfail(strict=True,
                                                      reason=reason))
          if name in names else name for name in sorted(XLA_OPTIMIZERS)]


def _loss(params, ids):
  rows = lazy_optax.lookup(params['table'], ids)
  return jnp.mean((rows - 1.0) ** 2)


@pytest.mark.parametrize('name', sorted(XLA_OPTIMIZERS))
def test_impl_xla_compiles_to_a_step_without_cpp_calls(name):
  """The optimizer's impl='xla' decides the whole step: the gradient, from
  value_and_grad as it comes (its lookups, ordering and deduplication), and
  apply_updates do no C++ work of their own."""
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  tx = XLA_OPTIMIZERS[name]()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids):
    _, grads = lazy_optax.value_and_grad(_loss)(params, ids)
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  params = {'table': jnp.asarray(_table())}
  state = tx.init(params)
  ids = jnp.zeros((N,), jnp.int32)
  hlo = step.lower(params, state, ids).compile().as_text()
  assert _targets(hlo) == []
  if name != 'lazy_adam':
    return
  # The same step with lazy_adam's impl='auto' calls its kernel: the check
  # can fail. Its lowered module names it as the compiled one does (a custom
  # call keeps its target), without a second compile; that compiled text
  # names the kernel it calls is checked below (explain_update's tests).
  auto_tx = lazy_optax.lazy_adam(LR)
  auto = jax.jit(lambda p, s, i: auto_tx.update(
      lazy_optax.value_and_grad(_loss)(p, i)[1], s, p))
  assert _targets(auto.lower(params, auto_tx.init(params), ids).as_text())


@pytest.mark.parametrize('name', _known_gap(
    _COPIES_A_COUNTER_TABLE, 'the int32 counter table is copied'))
def test_multi_steps_on_xla_path_copies_no_table(name):
  """multi_steps over a rule on XLA's path compiles to a step that copies no
  table (the rule runs at every step, branch-free): a lax.cond that skipped
  the rule copied the table-sized state and the table, since one branch
  wrote the buffers that the other kept. lazy's generic write-back copies
  nothing under the lax.cond that the CPU keeps for it; apply_if_finite's
  own lax.cond still copies."""
  rows = 100_000
  tx = lazy_optax.wrappers.multi_steps(XLA_OPTIMIZERS[name](), every_k=4,
                                       ids_per_step={'table': N})

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, rows),
             'w': jnp.ones((3,))}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  params = {'table': jax.ShapeDtypeStruct((rows, D), jnp.float32),
            'w': jax.ShapeDtypeStruct((3,), jnp.float32)}
  state = jax.eval_shape(tx.init, params)
  hlo = step.lower(params, state, jax.ShapeDtypeStruct((N,), jnp.int32),
                   jax.ShapeDtypeStruct((N, D), jnp.float32)
                   ).compile().as_text()
  copies = [line for line in hlo.splitlines()
            if re.search(r' copy(-start)?\(', line)
            and re.search(rf'\[{rows}[,\]]', line)]
  assert bool(copies) == name.startswith('apply_if_finite'), copies


def test_impl_xla_step_equals_tensorflow_rule():
  tx = lazy_optax.lazy_adam(LR, impl='xla')
  table = _table()

  @jax.jit
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  params = {'table': jnp.asarray(table)}
  state = tx.init(params)
  ref = TFLazyAdam(table, lr=LR)
  for ids, values in _batches(3):
    params, state = step(params, state, ids, values)
    ref.step(np.asarray(ids), np.asarray(values))
  assert _targets(step.lower(params, state, ids, values).as_text()) == []
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)


def test_outside_lazy_rows_move_with_xla():
  """A gradient built by `SparseRows(...)`, `lazy(...)`'s update of it (its
  table on the C++ path) and what adds that update to the table
  (`apply_updates`, `apply_updates_stochastic` into bfloat16) compile to no
  C++ call: only `lazy(...)` decides where a table's rows move. The update
  has its gradient's tree structure (what `optax.apply_if_finite`'s
  `lax.cond` needs); a `SparseRows` carries no backend."""
  ids, values = next(_batches(1))
  tx = lazy_optax.lazy(optax.sgd(LR))
  for table in (_table(), jnp.asarray(_table(), jnp.bfloat16)):
    params = {'t': jnp.asarray(table)}
    grads = {'t': lazy_optax.SparseRows(ids, values, NUM_ROWS)}
    updates, _ = tx.update(grads, tx.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(grads)
    built = jax.jit(lambda i, v: lazy_optax.SparseRows(i, v, NUM_ROWS))
    assert _targets(built.lower(ids, values).as_text()) == []
    add = (jax.jit(lazy_optax.apply_updates) if table.dtype == np.float32
           else jax.jit(lambda p, u: lazy_optax.precision
                        .apply_updates_stochastic(p, u, key=jax.random.key(0),
                                                  step=1)))
    assert _targets(add.lower(params, updates).as_text()) == []
    np.testing.assert_allclose(
        np.asarray(add(params, updates)['t'], np.float32),
        np.asarray(lazy_optax.apply_updates(params, updates)['t'],
                   np.float32), atol=0.02)


# --- explain_update against the compiled program ----------------------------

_LABELS = lazy_optax.tree.path_labels(
    lambda name: 'tables' if name == 'table' else 'rest')

# The compositions of docs/semantics.md around lazy_adam's rule, each equal
# to TensorFlow's rule on these batches (the clipping bounds are not met,
# every gradient is finite).
COMPOSITIONS = {
    'lazy_adam': lambda: lazy_optax.lazy_adam(LR),
    'lazy_adam(schedule)': lambda: lazy_optax.lazy_adam(
        optax.constant_schedule(LR)),
    'lazy(chain(scale_by_lazy_adam, scale_by_learning_rate))':
        lambda: lazy_optax.lazy(optax.chain(
            lazy_optax.scale_by_lazy_adam(),
            optax.scale_by_learning_rate(LR))),
    'inject_hyperparams(lazy_adam)': lambda: optax.inject_hyperparams(
        lazy_optax.lazy_adam)(learning_rate=LR),
    'chain(clip_by_global_norm, lazy_adam)': lambda: optax.chain(
        optax.clip_by_global_norm(1e6), lazy_optax.lazy_adam(LR)),
    'chain(clip, lazy_adam)': lambda: optax.chain(
        optax.clip(1e6), lazy_optax.lazy_adam(LR)),
    'chain(scale(1), lazy_adam)': lambda: optax.chain(
        optax.scale(1.0), lazy_optax.lazy_adam(LR)),
    'chain(zero_nans, lazy_adam)': lambda: optax.chain(
        optax.zero_nans(), lazy_optax.lazy_adam(LR)),
    'apply_if_finite(chain(clip, lazy_adam))': lambda: optax.apply_if_finite(
        optax.chain(optax.clip_by_global_norm(1e6), lazy_optax.lazy_adam(LR)),
        3),
    'lazy(apply_if_finite(lazy_adam))': lambda: lazy_optax.lazy(
        optax.apply_if_finite(lazy_optax.lazy_adam(LR), 3)),
    'masked(lazy_adam)': lambda: optax.masked(
        lazy_optax.lazy_adam(LR), {'table': True, 'w': False}),
    'partition(path_labels)': lambda: optax.partition(
        {'tables': lazy_optax.lazy_adam(LR), 'rest': optax.adam(LR)},
        _LABELS),
}


class _Around(NamedTuple):
  """What a composition does around the optimizer: to the gradient tree
  before `tx.update` (traced), and the same to the batches of the float64
  rule."""
  grads: Callable[[Any], Any] = lambda g: g
  build: Callable[..., Any] = lambda ids, values: lazy_optax.SparseRows(
      ids, values, NUM_ROWS)    # the table's gradient from the batch
  batches: Callable[[list], list] = lambda b: b
  needs: Optional[str] = None     # an optional extra the composition uses
  # The smallest copy warn_if_not_donated reports (the test's tables are
  # small: by default it looks at every 2-D argument).
  copy_bytes: int = 1
  eps: float = 1e-8               # the rule's epsilon
  apply: Callable[[Any, Any], Any] = lazy_optax.apply_updates
  scan: int = 0                   # batches per call, in a lax.scan
  shard_map: bool = False         # the step on a one-device mesh 'batch'


def _halves(ids, values):
  """The batch as two microbatches' gradients (ids repeat across them)."""
  half = ids.shape[0] // 2
  return (lazy_optax.SparseRows(ids[:half], values[:half], NUM_ROWS),
          lazy_optax.SparseRows(ids[half:], values[half:], NUM_ROWS))


def _tree_add_halves(ids, values):
  first, second = _halves(ids, values)
  return lazy_optax.tree.add({'t': first}, {'t': second})['t']


def _normalized(batches, eps=1e-6):
  """normalize_by_update_norm on the float64 rule's batches: the norm of
  the duplicate-summed rows (the dense leaf's gradient is zero)."""
  out = []
  for ids, values in batches:
    dense = np.zeros((NUM_ROWS, D))
    np.add.at(dense, ids, np.asarray(values, np.float64))
    out.append((ids, values / (np.sqrt(np.sum(dense ** 2)) + eps)))
  return out


def _jmp_unscale(grads):
  import jmp  # an optional extra: the case is skipped without it
  return jmp.DynamicLossScale(jnp.float32(2.0 ** 10)).unscale(grads)


def _scaled(s):
  return lambda batches: [(i, v * s) for i, v in batches]


def _every_second_mean(batches):
  """multi_steps(every_k=2): the rule runs on the mean of two batches."""
  return [(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]) / 2)
          for a, b in zip(batches[::2], batches[1::2])]


# Compositions that act on the gradient tree outside the optimizer, or run
# the step around it (docs/semantics.md's "equal" group). With an epsilon
# this large the rule is not invariant to the gradient's scale: a scaling
# done wrong shows in the parameters.
EPS = 1e-3
AROUND = {
    'chain(normalize_by_update_norm, lazy_adam)': (
        lambda: optax.chain(optax.normalize_by_update_norm(),
                            lazy_optax.lazy_adam(LR, eps=EPS)),
        _Around(eps=EPS, batches=_normalized)),
    'jmp unscale, lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, grads=_jmp_unscale, batches=_scaled(2.0 ** -10),
                needs='jmp')),
    'jax.tree.map(g * s), lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, batches=_scaled(0.5),
                grads=lambda g: jax.tree.map(lambda x: x * 0.5, g))),
    'lazy_optax.tree.scale, lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, grads=lambda g: lazy_optax.tree.scale(g, 0.25),
                batches=_scaled(0.25))),
    'g1 + g2, lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, build=lambda i, v: operator.add(*_halves(i, v)))),
    'lazy_optax.tree.add, lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, build=_tree_add_halves)),
    # explain_update reports the last of several rules on a table: here
    # the one with a kernel.
    'chain(lazy(clip), lazy_adam)': (
        lambda: optax.chain(lazy_optax.lazy(optax.clip(1e6)),
                            lazy_optax.lazy_adam(LR, eps=EPS)),
        _Around(eps=EPS)),
    'lax.scan of 2 steps, lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, scan=2)),
    'lazy_adam, optax.apply_updates': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, apply=optax.apply_updates)),
    'shard_map + tree.psum, lazy_adam': (
        lambda: lazy_optax.lazy_adam(LR, eps=EPS),
        _Around(eps=EPS, grads=lambda g: lazy_optax.tree.psum(g, 'batch'),
                shard_map=True)),
    # Its k x B buffer of rows is copied each step (O(batch)): the check is
    # on table-sized copies.
    'multi_steps(lazy_adam, every_k=2)': (
        lambda: lazy_optax.wrappers.multi_steps(
            lazy_optax.lazy_adam(LR, eps=EPS), every_k=2,
            ids_per_step={'table': N}),
        _Around(eps=EPS, batches=_every_second_mean,
                copy_bytes=NUM_ROWS * D * 4)),
}

# Every composition, and what it does around the optimizer.
CASES = {**{name: (make, _Around()) for name, make in COMPOSITIONS.items()},
         **AROUND}


def _donated_step(tx, with_params=True, around=_Around()):
  # The values come flat: warn_if_not_donated looks at every 2-D argument.
  def body(params, state, ids, flat_values):
    values = flat_values.reshape(ids.shape[0], D)
    grads = around.grads({'table': around.build(ids, values),
                          'w': jnp.zeros_like(params['w'])})
    updates, state = tx.update(grads, state,
                               params if with_params else None)
    return around.apply(params, updates), state

  if around.scan:
    plain = body

    def body(params, state, ids, flat_values):
      def one(carry, batch):
        return plain(*carry, *batch), None
      values = flat_values.reshape(ids.shape[0], -1)
      return jax.lax.scan(one, (params, state), (ids, values))[0]

  if around.shard_map:
    mesh = jax.sharding.Mesh(jax.devices()[:1], ('batch',))
    body = jax.shard_map(body, mesh=mesh,
                         in_specs=(P(), P(), P('batch'), P('batch')),
                         out_specs=(P(), P()))
  return jax.jit(body, donate_argnums=(0, 1))


def _step_args(around, batches):
  """The step's arguments for its first batches, and the batches left."""
  if not around.scan:
    (ids, values), *rest = batches
    return (ids, values.ravel()), rest
  take, rest = batches[:around.scan], batches[around.scan:]
  return (np.stack([i for i, _ in take]),
          np.concatenate([v.ravel() for _, v in take])), rest


def _explained_in_shard_map(tx, params, state, ids, values, around,
                            with_params):
  """`explain_update` asked where `lazy(...)` decides: inside the
  `shard_map` body (outside it, the arrays say nothing of the mesh)."""
  said = []

  def body(params, state, ids, flat_values):
    values = flat_values.reshape(ids.shape[0], -1)
    grads = around.grads({'table': around.build(ids, values),
                          'w': jnp.zeros((3,))})
    said.append(lazy_optax.explain_update(
        tx, grads, state, params if with_params else None)['table'])
    return params

  mesh = jax.sharding.Mesh(jax.devices()[:1], ('batch',))
  jax.jit(jax.shard_map(body, mesh=mesh,
                        in_specs=(P(), P(), P('batch'), P('batch')),
                        out_specs=P())).lower(params, state, ids,
                                              values.ravel())
  assert len(said) == 1, said
  return said[0]


def _check_composition(tx, with_params=True, around=_Around()):
  table = _table()
  params = {'table': jnp.asarray(table), 'w': jnp.ones((3,))}
  state = tx.init(params)
  step = _donated_step(tx, with_params, around)
  batches = [(np.asarray(i), np.asarray(v)) for i, v in _batches(4)]
  ids, values = batches[0]
  if around.shard_map:
    choice = _explained_in_shard_map(tx, params, state, ids, values, around,
                                     with_params)
  else:
    grads = around.grads({'table': around.build(ids, values),
                          'w': jnp.zeros((3,))})
    choice = lazy_optax.explain_update(tx, grads, state,
                                       params if with_params else None)
    choice = choice['table']
  args, _ = _step_args(around, batches)
  hlo = step.lower(params, state, *args).compile().as_text()
  assert (ADAM_KERNEL in hlo) == (choice.impl == 'cpu_kernel'), (
      choice, _targets(hlo))
  if _table_copies(hlo):
    # Then warn_if_not_donated must name the true cause: tables written
    # inside apply_if_finite's lax.cond, whose other branch keeps them.
    with pytest.warns(UserWarning, match='inside a lax.cond branch'):
      assert not lazy_optax.perf.warn_if_not_donated(
          step, params, state, *args)
    return choice, True
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert lazy_optax.perf.warn_if_not_donated(step, params, state, *args)
  ref = TFLazyAdam(table, lr=LR, eps=around.eps)
  left = batches
  while left:
    args, left = _step_args(around, left)
    params, state = step(params, state, *args)
  for ids, values in around.batches(batches):
    ref.step(ids, values)
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)
  return choice, False


# XLA's scatter into a table inside a lax.cond branch copies it (the other
# branch keeps the old table); the kernel's aliased call does not.
# multi_steps runs its rule at every step, branch-free, on XLA's path (the
# steps that do not emit give it no row), so it copies no table.
_COPIES_IN_A_COND = {('apply_if_finite(chain(clip, lazy_adam))', 'hidden')}


# _check_composition's result for each composition with the kernels present,
# kept for the tests below that ask about the same composition (each process
# checks it once).
_CHECKED_WITH_KERNELS = {}


def _checked_with_kernels(name, monkeypatch):
  if name not in _CHECKED_WITH_KERNELS:
    make, around = CASES[name]
    # The test's tables are small: let warn_if_not_donated look at them.
    monkeypatch.setattr(train_step, 'COPY_WARN_BYTES', around.copy_bytes)
    _CHECKED_WITH_KERNELS[name] = _check_composition(make(), around=around)
  return _CHECKED_WITH_KERNELS[name]


@pytest.mark.parametrize('kernels', ['present', 'hidden'])
@pytest.mark.parametrize('name', sorted(CASES))
def test_explain_update_tells_what_the_compiled_step_runs(name, kernels,
                                                          monkeypatch):
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  make, around = CASES[name]
  if around.needs:
    pytest.importorskip(around.needs)
  if kernels == 'present':
    choice, copies = _checked_with_kernels(name, monkeypatch)
  else:
    monkeypatch.setattr(cpu_kernels, 'loaded', lambda: False)
    # The test's tables are small: let warn_if_not_donated look at them.
    monkeypatch.setattr(train_step, 'COPY_WARN_BYTES', around.copy_bytes)
    choice, copies = _check_composition(make(), around=around)
  assert copies == ((name, kernels) in _COPIES_IN_A_COND), choice
  if kernels == 'hidden':
    assert choice.impl != 'cpu_kernel', choice


def test_update_without_params_tells_what_runs():
  choice, _ = _check_composition(lazy_optax.lazy_adam(LR),
                                 with_params=False)
  assert choice.impl == 'cpu_kernel', choice


def test_a_rule_whose_writes_a_wrapper_rebuilds_is_reported_generic(
    monkeypatch):
  # apply_if_finite's lax.cond rebuilds the state: the kernel's in-place
  # tables would not reach lazy(...), and ran on copies of mu and nu.
  choice, _ = _checked_with_kernels('lazy(apply_if_finite(lazy_adam))',
                                    monkeypatch)
  assert choice.impl == 'generic', choice
  assert 'apply_if_finite' in choice.reason


def _auto_step():
  """A lazy_adam step's state and two probes: what `explain_update` says of
  the table, and whether a fresh jit of the donated step calls the kernel."""
  tx = lazy_optax.lazy_adam(LR)
  params = {'table': jnp.asarray(_table()), 'w': jnp.ones((3,))}
  state = tx.init(params)
  ids, values = next(_batches(1))
  grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS),
           'w': jnp.zeros((3,))}

  def choice():
    return lazy_optax.explain_update(tx, grads, state, params)['table']

  def calls_the_kernel():  # a fresh jit each time: no trace is reused
    return ADAM_KERNEL in _donated_step(tx).lower(
        params, state, ids, values.ravel()).as_text()

  return params, grads, choice, calls_the_kernel


def test_auto_where_the_default_backend_is_not_the_cpu_reports_xla(
    monkeypatch):
  # A jitted step names no device: it compiles for the default backend. On
  # a GPU machine (the default backend faked here) 'auto' must neither name
  # the CPU kernel in explain_update nor lower a call that a GPU compile
  # would drop; the same step on the CPU default keeps the kernel.
  params, grads, choice, calls_the_kernel = _auto_step()
  on_cpu = choice()
  assert on_cpu.impl == 'cpu_kernel' and calls_the_kernel(), on_cpu
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  # No default device (on a GPU machine this test runs under the CPU's).
  with jax.default_device(None):
    on_gpu = choice()
    assert on_gpu.impl == 'xla', on_gpu
    assert 'compiles for gpu, the default backend' in on_gpu.reason
    assert not calls_the_kernel()
    # An explicit request keeps its kernel: the caller may compile for CPU.
    explicit = lazy_optax.lazy_adam(LR, impl='cpu_kernel')
    assert lazy_optax.explain_update(
        explicit, grads, explicit.init(params), params)['table'].impl == (
            'cpu_kernel')


@pytest.mark.parametrize('device', ['the CPU device', "'cpu'"])
def test_auto_under_a_cpu_default_device_keeps_the_kernel(monkeypatch,
                                                          device):
  # Host-resident tables on a GPU machine (faked here): under
  # jax.default_device(the CPU) a jitted step compiles for the CPU, and
  # 'auto' reports and lowers the kernel, naming what decided.
  _, _, choice, calls_the_kernel = _auto_step()
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  cpu = jax.devices('cpu')[0] if device == 'the CPU device' else 'cpu'
  with jax.default_device(cpu):
    on_cpu = choice()
    assert on_cpu.impl == 'cpu_kernel', on_cpu
    assert 'compiles for cpu, the default device' in on_cpu.reason
    assert calls_the_kernel()
  with jax.default_device(None):
    assert choice().impl == 'xla'
    assert not calls_the_kernel()



# --- lazy's decision and apply_updates --------------------------------------

def test_lazy_impl_xla_with_a_sparse_rows_gradient_calls_no_cpp():
  """A gradient built by `SparseRows(...)`, `lazy_adam(impl='xla')` and
  `apply_updates`: the compiled step calls no C++ kernel (the gradient's
  deduplication and the update's scatter-add are XLA's, as every row move
  outside `lazy(...)`)."""
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  tx = lazy_optax.lazy_adam(LR, impl='xla')

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, NUM_ROWS)}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  params = {'table': jnp.asarray(_table())}
  ids, values = next(_batches(1))
  hlo = step.lower(params, tx.init(params), ids, values).compile().as_text()
  assert _targets(hlo) == [], _targets(hlo)
