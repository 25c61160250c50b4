"""lazy_adam's CPU kernel (`cpu_kernels.adam_rows`): used, right, optional."""

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
from reference import TFLazyAdam

import lazy_optax
from lazy_optax._src import cpu_kernels


def _step(tx, num_rows):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, state, ids, values, gw):
    grads = {'table': lazy_optax.SparseRows(ids, values, num_rows), 'w': gw}
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state
  return step


def test_built_here_and_used_by_lazy_adam():
  # This machine has a C++ compiler: the kernel must build and be called.
  assert cpu_kernels.available()
  tx = lazy_optax.lazy_adam(1e-3)
  params = {'table': jnp.zeros((100, 8)), 'w': jnp.zeros((8,))}
  hlo = _step(tx, 100).lower(
      params, tx.init(params), jnp.zeros((16,), jnp.int32),
      jnp.zeros((16, 8)), jnp.zeros((8,))).as_text()
  assert 'lazy_optax_adam_rows' in hlo
  # Dense leaves, AMSGrad and 16-bit moments keep the XLA path.
  tx = lazy_optax.lazy_adam(1e-3, amsgrad=True)
  hlo = _step(tx, 100).lower(
      params, tx.init(params), jnp.zeros((16,), jnp.int32),
      jnp.zeros((16, 8)), jnp.zeros((8,))).as_text()
  assert 'lazy_optax_adam_rows' not in hlo


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
    import sys
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
    print(cpu_kernels.available(), 'lazy_optax_adam_rows' in hlo)
    np.save(sys.argv[1], np.asarray(params['table']))
''')


def test_switched_off_by_environment_gives_the_same_table(tmp_path):
  out = {}
  for switch in ('1', '0'):
    env = dict(os.environ, LAZY_OPTAX_CPU_KERNELS=switch,
               JAX_PLATFORMS='cpu')
    path = tmp_path / f'table_{switch}.npy'
    done = subprocess.run([sys.executable, '-c', _SCRIPT, str(path)],
                          env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    out[switch] = (done.stdout.split()[-2:], np.load(path))
  assert out['1'][0] == ['True', 'True']
  assert out['0'][0] == ['False', 'False']
  np.testing.assert_allclose(out['1'][1], out['0'][1], rtol=1e-6, atol=1e-7)


def test_no_compiler_means_the_xla_path(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_kernels, '_compiler', lambda: None)
  monkeypatch.setenv('LAZY_OPTAX_CACHE', str(tmp_path))
  cpu_kernels.available.cache_clear()
  try:
    assert not cpu_kernels.available()
    assert not cpu_kernels.usable()
    tx = lazy_optax.lazy_adam(0.1)
    params = {'table': jnp.zeros((10, 2)), 'w': jnp.zeros((2,))}
    hlo = _step(tx, 10).lower(
        params, tx.init(params), jnp.array([1, 1], jnp.int32),
        jnp.ones((2, 2)), jnp.zeros((2,))).as_text()
    assert 'lazy_optax_adam_rows' not in hlo
    assert list(tmp_path.iterdir()) == []
  finally:
    monkeypatch.undo()
    cpu_kernels.available.cache_clear()
  assert cpu_kernels.available()


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


def test_vmapped_over_an_ensemble_equals_the_xla_path(monkeypatch):
  tx = lazy_optax.lazy_adam(0.1)

  def step(p, s, ids, vals):
    u, s = tx.update({'t': lazy_optax.SparseRows(ids, vals, 10)}, s, p)
    return lazy_optax.apply_updates(p, u), s

  params = {'t': jnp.ones((3, 10, 4))}
  state = jax.vmap(tx.init)(params)
  ids = jnp.array([[1, 2, 1], [3, 3, 3], [0, 9, 5]], jnp.int32)
  vals = jnp.arange(36, dtype=jnp.float32).reshape(3, 3, 4)
  lowered = jax.jit(jax.vmap(step)).lower(params, state, ids, vals)
  assert 'lazy_optax_adam_rows' in lowered.as_text()
  with_kernel = lowered.compile()(params, state, ids, vals)
  monkeypatch.setattr(cpu_kernels, 'usable', lambda: False)
  without = jax.jit(jax.vmap(step))(params, state, ids, vals)
  for a, b in zip(jax.tree.leaves(with_kernel), jax.tree.leaves(without)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # Member 1 summed its three ids into row 3 alone.
  table = np.asarray(with_kernel[0]['t'][1])
  assert (table[3] != 1).all() and (np.delete(table, 3, axis=0) == 1).all()
