"""The CPU kernels: every composition reaches them, right, optional."""

import collections
import functools
import textwrap

import fork_server
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import TFLazyAdam

import lazy_optax
from lazy_optax._src import cpu_kernels

KERNEL = 'lazy_optax_LazyOptaxAdam'


def _step(tx, num_rows):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids, values, gw):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows), 'w': gw}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


_LABELS = lazy_optax.tree.path_labels(
    lambda name: 'tables' if name == 'table' else 'rest')

# Every composition that the docs show around lazy_adam's rule.
COMPOSITIONS = {
    'lazy_adam': lambda lr, impl: lazy_optax.lazy_adam(lr, impl=impl),
    'lazy(chain(scale_by_lazy_adam, scale_by_learning_rate))':
        lambda lr, impl: lazy_optax.lazy(optax.chain(
            lazy_optax.scale_by_lazy_adam(impl=impl),
            optax.scale_by_learning_rate(lr))),
    'inject_hyperparams(lazy_adam)':
        lambda lr, impl: optax.inject_hyperparams(lazy_optax.lazy_adam)(
            learning_rate=lr, impl=impl),
    'chain(clip_by_global_norm, lazy_adam)':
        lambda lr, impl: optax.chain(optax.clip_by_global_norm(1.0),
                                     lazy_optax.lazy_adam(lr, impl=impl)),
    'partition(path_labels)':
        lambda lr, impl: optax.partition(
            {'tables': lazy_optax.lazy_adam(lr, impl=impl),
             'rest': optax.adam(lr)}, _LABELS),
}


@pytest.mark.parametrize('name', sorted(COMPOSITIONS))
def test_every_composition_reaches_the_kernel_and_equals_generic(name):
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  lr = optax.linear_schedule(0.05, 0.01, 4)
  num_rows = 30
  rng = np.random.default_rng(0)
  table = rng.normal(size=(num_rows, 4)).astype(np.float32)

  def train(tx):
    params = {'table': jnp.asarray(table), 'w': jnp.ones((4,))}
    state = tx.init(params)
    step = _step(tx, num_rows)
    data = np.random.default_rng(1)
    for _ in range(4):
      ids = jnp.asarray(data.integers(0, num_rows, 9), jnp.int32)
      values = jnp.asarray(data.normal(size=(9, 4)), jnp.float32)
      params, state = step(params, state, ids, values, jnp.ones((4,)))
    return params, state, step

  params, state, step = train(COMPOSITIONS[name](lr, 'auto'))
  args = (jnp.zeros((9,), jnp.int32), jnp.zeros((9, 4)), jnp.ones((4,)))
  hlo = step.lower(params, state, *args).compile().as_text()
  assert KERNEL in hlo
  # No table-shaped XLA scatter writes the moments: the kernel does. (The
  # gradient's deduplication and apply_updates' add are XLA's, outside
  # lazy; these test compiles expand the add into a loop.)
  assert not [line for line in hlo.splitlines()
              if ' scatter(' in line and f'[{num_rows},4]' in line]
  choice = lazy_optax.explain_update(
      COMPOSITIONS[name](lr, 'auto'), {'table': lazy_optax.SparseRows(
          args[0], args[1], num_rows), 'w': args[2]}, state, params)
  assert choice['table'].impl == 'cpu_kernel', choice
  expected, _, _ = train(COMPOSITIONS[name](lr, 'generic'))
  np.testing.assert_allclose(params['table'], expected['table'], rtol=2e-6,
                             atol=1e-7)


def _train_with_reference(table, lr, batches):
  """lazy_adam and the float64 TF rule on the same batches, step by step.

  Yields `(params, state, ref)` after each `(ids, values)` batch.
  """
  num_rows = table.shape[0]
  ref = TFLazyAdam(table.reshape(num_rows, -1), lr=lr)
  tx = lazy_optax.lazy_adam(lr)
  params = {'table': jnp.asarray(table, jnp.float32),
            'w': jnp.ones((3,), jnp.float32)}
  state = tx.init(params)
  step = _step(tx, num_rows)
  for ids, values in batches:
    ref.step(ids, values.reshape(len(ids), -1))
    params, state = step(params, state, jnp.asarray(ids, jnp.int32),
                         jnp.asarray(values, jnp.float32),
                         jnp.ones((3,), jnp.float32))
    yield params, state, ref


def test_matches_float64_rule_with_duplicates_and_bad_ids():
  rng = np.random.default_rng(0)
  num_rows, row = 30, (2, 3)
  table = rng.normal(size=(num_rows,) + row)

  def batches():
    for _ in range(12):
      ids = rng.integers(-3, num_rows + 3, 10)   # out of range on both sides
      ids[:4] = ids[4]                           # duplicates
      yield ids, rng.normal(size=(10,) + row)

  for t, (params, state, ref) in enumerate(
      _train_with_reference(table, 0.02, batches())):
    flat = np.asarray(params['table']).reshape(num_rows, -1)
    np.testing.assert_allclose(flat, ref.p, rtol=2e-5, atol=1e-6,
                               err_msg=str(t))
  mu = optax.tree_utils.tree_get(state, 'mu')['table']
  nu = optax.tree_utils.tree_get(state, 'nu')['table']
  np.testing.assert_allclose(np.asarray(mu).reshape(num_rows, -1), ref.m,
                             rtol=2e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(nu).reshape(num_rows, -1), ref.v,
                             rtol=2e-5, atol=1e-9)
  untouched = sorted(set(range(num_rows)) - set(
      int(i) for i in np.nonzero(ref.m.any(axis=1))[0]))
  np.testing.assert_array_equal(
      np.asarray(params['table'])[untouched],
      table.astype(np.float32)[untouched])


def test_empty_batch_and_traced_hyperparameters():
  # inject_hyperparams passes b1, b2 and eps as traced scalars.
  tx = optax.inject_hyperparams(lazy_optax.lazy_adam)(
      learning_rate=0.1, b1=0.5, b2=0.9, eps=1e-3)
  params = {'table': jnp.ones((8, 2)), 'w': jnp.ones((2,))}
  state = tx.init(params)
  step = _step(tx, 8)
  params, state = step(params, state, jnp.zeros((0,), jnp.int32),
                       jnp.zeros((0, 2)), jnp.zeros((2,)))
  np.testing.assert_array_equal(params['table'], np.ones((8, 2)))
  ref = TFLazyAdam(np.ones((8, 2)), lr=0.1, b1=0.5, b2=0.9, eps=1e-3)
  ref.t = 1  # the empty step counted
  ids, values = np.array([2, 5, 2]), np.array([[1., -2.], [3., 0.], [.5, 1.]])
  ref.step(ids, values)
  params, state = step(params, state, jnp.asarray(ids, jnp.int32),
                       jnp.asarray(values, jnp.float32), jnp.zeros((2,)))
  np.testing.assert_allclose(params['table'], ref.p, rtol=1e-6)


_SCRIPT = textwrap.dedent('''
    import os
    import jax, jax.numpy as jnp, numpy as np
    import lazy_optax
    from lazy_optax._src import cpu_kernels
    tx = lazy_optax.lazy_adam(0.05)
    params = {'table': jnp.asarray(np.linspace(-1, 1, 40 * 4).reshape(40, 4),
                                   jnp.float32)}
    state = tx.init(params)
    def step(p, s, ids, vals):
      u, s = tx.update({'table': lazy_optax.SparseRows(ids, vals, 40)}, s, p)
      return lazy_optax.apply_updates(p, u), s
    step = jax.jit(step)
    rng = np.random.default_rng(3)
    for _ in range(6):
      ids = jnp.asarray(rng.integers(0, 40, 12), jnp.int32)
      vals = jnp.asarray(rng.normal(size=(12, 4)), jnp.float32)
      params, state = step(params, state, ids, vals)
    hlo = jax.jit(step).lower(params, state, ids, vals).as_text()
    print(cpu_kernels.loaded(), 'lazy_optax_LazyOptax' in hlo)
    np.save(os.environ['TABLE_OUT'], np.asarray(params['table']))
''')


# The modules the forking process imports (the server tests/test_id_safety.py
# and tests/test_kernel_cache.py start, shared within a pytest process).
_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')


def test_switched_off_by_environment_gives_the_same_table(tmp_path):
  # Each in a fresh process (forked from one that imported jax and
  # lazy_optax and loaded no kernel: tests/fork_server.py), which reads the
  # switch when its first init loads the kernels.
  out = {}
  for switch in ('1', '0'):
    path = tmp_path / f'table_{switch}.npy'
    (done,) = fork_server.run_scripts(
        [_SCRIPT], {'LAZY_OPTAX_CPU_KERNELS': switch, 'TABLE_OUT': str(path)},
        preloaded=_PRELOADED)
    assert done.returncode == 0, done.stderr
    out[switch] = (done.stdout.split()[-2:], np.load(path))
  assert out['1'][0] == ['True', 'True']
  assert out['0'][0] == ['False', 'False']
  np.testing.assert_allclose(out['1'][1], out['0'][1], rtol=1e-6, atol=1e-7)


def test_large_batch_shared_over_threads_matches_float64_rule():
  # 4,096 ids drawn from 5,000 of 20,000 rows of 64: about 2,800 distinct
  # rows, enough values for the kernel to share its row updates over XLA's
  # thread pool.
  rng = np.random.default_rng(5)
  num_rows, width = 20_000, 64
  batches = [(rng.integers(0, num_rows // 4, 4096),
              rng.normal(size=(4096, width))) for _ in range(3)]
  *_, (params, state, ref) = _train_with_reference(
      rng.normal(size=(num_rows, width)), 0.01, batches)
  ids = batches[-1][0]
  assert len(np.unique(ids)) * width >= 2**16
  np.testing.assert_allclose(params['table'], ref.p, rtol=2e-5, atol=1e-6)
  nu = optax.tree_utils.tree_get(state, 'nu')['table']
  np.testing.assert_allclose(nu, ref.v, rtol=2e-5, atol=1e-9)


def test_vmapped_over_an_ensemble_equals_the_generic_path():
  def step(tx):
    def fn(p, s, ids, vals):
      u, s = tx.update({'t': lazy_optax.SparseRows(ids, vals, 10)}, s, p)
      return lazy_optax.apply_updates(p, u), s
    return jax.vmap(fn)

  params = {'t': jnp.ones((3, 10, 4))}
  tx = lazy_optax.lazy_adam(0.1)
  state = jax.vmap(tx.init)(params)
  ids = jnp.array([[1, 2, 1], [3, 3, 3], [0, 9, 5]], jnp.int32)
  vals = jnp.arange(36, dtype=jnp.float32).reshape(3, 3, 4)
  lowered = jax.jit(step(tx)).lower(params, state, ids, vals)
  assert KERNEL in lowered.as_text()
  with_kernel = lowered.compile()(params, state, ids, vals)
  without = jax.jit(step(lazy_optax.lazy_adam(0.1, impl='generic')))(
      params, state, ids, vals)
  for a, b in zip(jax.tree.leaves(with_kernel), jax.tree.leaves(without)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # Member 1 summed its three ids into row 3 alone.
  table = np.asarray(with_kernel[0]['t'][1])
  assert (table[3] != 1).all() and (np.delete(table, 3, axis=0) == 1).all()


def _rules_with_kernels():
  from lazy_optax._src import adam  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import ftrl  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import partial_rowwise_adam  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import rowwise_adagrad  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import rowwise_rmsprop_ar  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import rowwise_adagrad_with_counter as counter  # pylint: disable=g-import-not-at-top
  moments = adam.AdamHyper(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                           count=jnp.int32(3))
  return [
      (adam._adam_rule(False), moments),  # pylint: disable=protected-access
      (adam._adam_rule(True), moments),  # pylint: disable=protected-access
      (rowwise_adagrad._rule(True),  # pylint: disable=protected-access
       rowwise_adagrad.RowwiseAdagradKernelHyper(eps=1e-8, l2=0.1)),
      (partial_rowwise_adam._rule(),  # pylint: disable=protected-access
       partial_rowwise_adam.PartialRowwiseAdamHyper(*moments)),
      (ftrl._rule(), ftrl.FtrlKernelHyper(  # pylint: disable=protected-access
          lr=0.1, power=0.5, l1=0.0, l2=0.0, l2_shrinkage=0.0, beta=0.0)),
      (rowwise_rmsprop_ar._rule(),  # pylint: disable=protected-access
       rowwise_rmsprop_ar.RowwiseRmspropArKernelHyper(
           lr=0.1, ar_alpha=0.5, ema_beta=0.9, one_minus_beta=0.1,
           min_shrinkage=0.1, eps=1e-8, step=jnp.int32(3))),
      (counter._rule(counter._Config(  # pylint: disable=protected-access
          eps=1e-8, decay_mode='adagradw', halflife=-1, adjustment_iter=-1,
          adjustment_ub=1.0, lr_mode='counter_sgd', tail_id_threshold=0.0,
          threshold_is_ratio=False)),
       counter.RowwiseAdagradCounterHyper(
           count=jnp.int32(3), lr=0.1, wd=0.1,
           max_counter=jnp.float32(1.0))),
  ]


def test_each_rule_record_lists_its_kernel_struct_fields_in_order():
  # The Python record a rule builds and the C++ struct its kernel reads are
  # declared apart; the library exports the struct's field names.
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  rules = _rules_with_kernels()
  assert sorted(r.kernel for r, _ in rules) == sorted(cpu_kernels.RULES)
  for rule, hyper in rules:
    record = rule.kernel_hyper(hyper)
    assert type(record)._fields == cpu_kernels.fields(rule.kernel), rule.name
    assert cpu_kernels.pack(rule.kernel, record).shape == (len(record),)
    if len(record) < 2:  # one field: nothing to swap; another is refused
      other = collections.namedtuple('Other', ['other'])(*record)
      with pytest.raises(TypeError):
        cpu_kernels.pack(rule.kernel, other)
      continue
    # A record with two fields swapped is refused, naming both orders.
    names = list(type(record)._fields)
    names[0], names[1] = names[1], names[0]
    swapped = collections.namedtuple('Swapped', names)(*record)
    with pytest.raises(TypeError, match='same order'):
      cpu_kernels.pack(rule.kernel, swapped)


def test_a_rule_kernel_given_the_wrong_operands_says_which():
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  ids = jnp.array([0, 2], jnp.int32)
  g = jnp.ones((2, 4), jnp.float32)
  mu = jnp.zeros((5, 4), jnp.float32)
  h = jnp.zeros((7,), jnp.float32)
  with pytest.raises(Exception, match='LazyOptaxAdam: state tables'):
    jax.block_until_ready(cpu_kernels.rule('LazyOptaxAdam', ids, g, h, g,
                                           (mu,)))
  with pytest.raises(Exception, match='LazyOptaxAdam: hyperparameters'):
    jax.block_until_ready(cpu_kernels.rule(
        'LazyOptaxAdam', ids, g, h[:6], g, (mu, mu)))
  with pytest.raises(Exception, match='LazyOptaxRowwiseAdagrad: state table '
                     'shapes'):
    jax.block_until_ready(cpu_kernels.rule(
        'LazyOptaxRowwiseAdagrad', ids, g, h[:2], g, (mu,)))
  new, u = cpu_kernels.rule('LazyOptaxRowwiseAdagrad', ids, g,
                            jnp.array([1.0, 0.0]), g, (jnp.zeros(5),))
  np.testing.assert_allclose(np.asarray(new[0]), [1, 0, 1, 0, 0])
  np.testing.assert_allclose(np.asarray(u), np.full((2, 4), 0.5))


def _ar_model(w, g, v, prev, step, lr, alpha, beta, min_shrink, eps):
  """FBGEMM's ROWWISE_RMSPROP_AR on distinct rows, in float64 NumPy."""
  w, g, v = (np.asarray(x, np.float64) for x in (w, g, v))
  v = beta * v + (1 - beta) * np.mean(g * g, axis=1)
  gap = np.where(np.asarray(prev) == 0, 1, step - np.asarray(prev, np.int64))
  lam = np.clip(lr * alpha * gap, 0, 1)
  new_w = (np.maximum(min_shrink, 1 - lam)[:, None] * w
           - lr * g / (np.sqrt(v) + eps)[:, None])
  return new_w - w, v


@pytest.mark.parametrize('v_dtype', [jnp.float32, jnp.bfloat16])
def test_int32_counter_tables_are_read_and_written_exactly(v_dtype):
  # A rule's per-row counters are int32 tables next to float32 or bfloat16
  # ones, and its int32 hyperparameter (the global step) reaches the kernel
  # bit for bit: past 2**24, where float32 cannot tell step from step + 1
  # (the rows' gaps 1, 2, 5, 6 and 2**24 + 4 each shrink by their own
  # amount, and every touched row's counter becomes the step exactly).
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  from lazy_optax._src import rowwise_rmsprop_ar  # pylint: disable=g-import-not-at-top
  target = 'LazyOptaxRowwiseRmspropAr'
  assert cpu_kernels.int_fields(target) == {'step'}
  step = 2**24 + 7
  rng = np.random.default_rng(3)
  rows, w = 9, 4
  prev = np.array([0, step - 1, step - 2, step - 5, 2**24 + 1, 3, 0, 1, 2],
                  np.int32)
  v0 = rng.uniform(0.1, 1.0, rows).astype(np.float32)
  ids = jnp.array([1, 2, 3, 4, 5, 6, 9, 0], jnp.int32)  # 9 names no row
  g = rng.normal(size=(8, w)).astype(np.float32)
  p = rng.normal(size=(8, w)).astype(np.float32)
  hyper = rowwise_rmsprop_ar.RowwiseRmspropArKernelHyper(
      lr=1e-7, ar_alpha=2.0, ema_beta=0.9, one_minus_beta=0.1,
      min_shrinkage=0.1, eps=1e-8, step=jnp.int32(step))
  record = rowwise_rmsprop_ar._rule().kernel_hyper(hyper)  # pylint: disable=protected-access
  h = cpu_kernels.pack(target, record)
  assert h.dtype == jnp.uint32
  (v, prev_out), u = jax.jit(
      lambda *a: cpu_kernels.rule(target, *a[:4], a[4:]))(
          ids, jnp.asarray(g), h, jnp.asarray(p),
          jnp.asarray(v0).astype(v_dtype), jnp.asarray(prev))
  assert prev_out.dtype == jnp.int32
  touched = [1, 2, 3, 4, 5, 6, 0]
  want_prev = prev.copy()
  want_prev[touched] = step
  np.testing.assert_array_equal(np.asarray(prev_out), want_prev)
  named = np.array([True] * 6 + [False, True])
  v_in = np.asarray(jnp.asarray(v0).astype(v_dtype), np.float64)
  want_u, want_v = _ar_model(p[named], g[named], v_in[touched], prev[touched],
                             step, 1e-7, 2.0, 0.9, 0.1, 1e-8)
  tol = 1e-6 if v_dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(v, np.float64)[touched], want_v,
                             rtol=tol)
  np.testing.assert_allclose(np.asarray(u)[named], want_u, rtol=tol,
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(u)[~named], 0)


def test_int32_counter_tables_refuse_other_dtypes_by_position():
  assert lazy_optax.kernel_status()['cpu_kernel'].available
  target = 'LazyOptaxRowwiseRmspropAr'
  ids = jnp.array([0, 2], jnp.int32)
  g = jnp.ones((2, 4), jnp.float32)
  h = jnp.zeros((7,), jnp.uint32)
  with pytest.raises(Exception, match=f'{target}: state table 1 must be '
                     'int32'):
    jax.block_until_ready(cpu_kernels.rule(
        target, ids, g, h, g, (jnp.zeros(5), jnp.zeros(5))))
  with pytest.raises(Exception, match='float32 or bfloat16'):
    jax.block_until_ready(cpu_kernels.rule(
        target, ids, g, h, g, (jnp.zeros(5, jnp.int32),
                               jnp.zeros(5, jnp.int32))))
  from lazy_optax._src import rowwise_rmsprop_ar  # pylint: disable=g-import-not-at-top
  record = rowwise_rmsprop_ar.RowwiseRmspropArKernelHyper(
      0.1, 0.0, 0.9, 0.1, 0.1, 1e-8, 3.0)
  with pytest.raises(TypeError, match='int32 kernel field'):
    cpu_kernels.pack(target, record)
