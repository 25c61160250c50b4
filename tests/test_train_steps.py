"""docs/train_steps.md runs; make_train_step and warn_if_not_donated."""

import importlib.util
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax

GUIDE = (pathlib.Path(__file__).resolve().parent.parent / 'docs' /
         'train_steps.md')


@pytest.mark.cpu_kernels
def test_every_python_block_of_the_guide_runs_in_order():
  blocks = re.findall(r'```python\n(.*?)```', GUIDE.read_text(), re.S)
  assert len(blocks) == 9
  # The Haiku block runs where Haiku is installed (an optional dependency);
  # elsewhere a stand-in draws its 51 batches, so that the next blocks
  # train on the same data.
  haiku = importlib.util.find_spec('haiku') is not None
  (i,) = [i for i, code in enumerate(blocks) if 'import haiku' in code]
  assert blocks[i].count('batch()') == 2 and 'range(50)' in blocks[i]
  if not haiku:
    blocks[i] = 'for _ in range(1 + 50):\n  batch()\n'
  namespace = {}
  with warnings.catch_warnings():
    # Every step in the guide is donated: no lazy_optax warning, and no
    # "donated buffers were not usable" from JAX.
    warnings.filterwarnings('error', message='lazy_optax')
    warnings.filterwarnings('error', message='Some donated buffers')
    for i, code in enumerate(blocks):
      try:
        exec(compile(code, f'{GUIDE.name}[block {i}]', 'exec'), namespace)
      except Exception as e:
        raise AssertionError(f'guide block {i} failed:\n{code}') from e
  for name in ('params', 'state', 'nnx_state', 'hk_params', 'eqx_model',
               'coll_params'):
    assert name in namespace or (name == 'hk_params' and not haiku), name
  # The steps trained: each framework's last loss is well below the first.
  assert float(namespace['loss']) < 1.0
  # The refused step named what happened and the fix on its first line,
  # and training went on from the state it handed back.
  assert namespace['refused'].startswith(
      'The row ids of parameter table were changed by arithmetic')
  assert 'lazy_optax.tree.add(g1, g2)' in namespace['refused']
  assert not namespace['params']['table'].is_deleted()
  assert float(namespace['coll_loss']) < 1.0
  # Every framework's step reaches the fused CPU row update of lazy_adam.
  ns, batch = namespace, namespace['batch']
  lowered = {
      'plain JAX': ns['step'].lower(ns['params'], ns['opt_state'], *batch()),
      'linen': ns['linen_step'].lower(ns['state'], *batch()),
      'nnx split/merge': ns['nnx_step'].lower(ns['nnx_state'], *batch()),
      'nnx.jit': ns['nnx_jit_step'].lower(ns['model'], ns['optimizer'],
                                          *batch()),
      'haiku': haiku and ns['haiku_step'].lower(
          ns['hk_params'], ns['hk_opt_state'], *batch()),
      'equinox': ns['eqx_step'].lower(batch(), ns['eqx_model'],
                                      ns['eqx_opt_state']),
      'collection': ns['coll_step'].lower(ns['coll_params'],
                                          ns['coll_opt_state'],
                                          *ns['coll_batch']()),
  }
  if not haiku:
    del lowered['haiku']
  for framework, step in lowered.items():
    assert 'lazy_optax_LazyOptaxAdam' in step.as_text(), framework


def _step_parts():
  tx = lazy_optax.lazy_adam(0.1)
  params = {'table': jnp.zeros((50, 4)), 'w': jnp.ones(4)}

  def train_step(params, opt_state, ids):
    def loss_fn(p):
      rows = lazy_optax.lookup(p['table'], ids)
      return jnp.sum((rows @ p['w'] - 1.0) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  return tx, params, train_step


def test_make_train_step_warns_once_without_donation():
  tx, params, train_step = _step_parts()
  opt_state = tx.init(params)
  step = lazy_optax.perf.make_train_step(train_step, donate_argnums=())
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for k in range(3):
      params, opt_state, _ = step(params, opt_state, jnp.array([k, 7]))
  messages = [str(w.message) for w in caught if 'lazy_optax' in str(w.message)]
  assert len(messages) == 1, messages
  assert "args[0]['table']" in messages[0]
  assert 'not donated' in messages[0]
  assert "args[1][0].mu['table']" in messages[0]


def test_make_train_step_is_silent_with_donation_and_trains():
  tx, params, train_step = _step_parts()
  before = np.asarray(params['table']).copy()
  opt_state = tx.init(params)
  traces = []

  def counted(*args):
    traces.append(1)
    return train_step(*args)

  step = lazy_optax.perf.make_train_step(counted)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    for k in range(3):
      params, opt_state, loss = step(params, opt_state, jnp.array([k, 7]))
  # Traced once: the check's lowering and the calls share jax.jit's cache.
  assert len(traces) == 1
  after = np.asarray(params['table'])
  np.testing.assert_array_equal(after[8:], before[8:])
  assert not np.array_equal(after[[0, 1, 2, 7]], before[[0, 1, 2, 7]])
  assert np.isfinite(float(loss))


def test_a_donated_table_that_is_not_aliased_is_reported():
  def cast_step(params, ids):   # returns the table in another dtype
    return {'t': params['t'].at[ids].add(1.0).astype(jnp.bfloat16)}

  params = {'t': jnp.zeros((64, 4))}
  step = jax.jit(cast_step, donate_argnums=0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    assert not lazy_optax.perf.warn_if_not_donated(step, params, jnp.array([1]))
  assert any('aliases only 0' in str(w.message) for w in caught), [
      str(w.message) for w in caught]


def test_warn_if_not_donated_needs_a_jitted_step():
  with pytest.raises(TypeError, match='jitted step'):
    lazy_optax.perf.warn_if_not_donated(lambda x: x, jnp.ones((2, 2)))


def _linear_step(helper):
  tx = lazy_optax.rowwise_adagrad(0.1)
  num_rows = 32_768   # 2 MiB: big enough to be reported

  def loss_of(rows, w):
    return jnp.sum(rows * w)   # linear in the rows: its gradient is w

  def train_step(params, opt_state, ids):
    if helper:
      loss, grads = lazy_optax.value_and_grad(
          lambda p: loss_of(lazy_optax.lookup(p['table'], ids), p['w']))(
              params)
    else:
      rows = params['table'][ids]
      loss, (g_rows, g_w) = jax.value_and_grad(loss_of, (0, 1))(
          rows, params['w'])
      grads = {'table': lazy_optax.SparseRows(ids, g_rows, num_rows),
               'w': g_w}
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  params = {'table': jnp.zeros((num_rows, 16)), 'w': jnp.ones((16,))}
  return (jax.jit(train_step, donate_argnums=(0, 1)), params,
          tx.init(params), jnp.arange(8, dtype=jnp.int32))


def _table_copies(step, *args):
  hlo = step.lower(*args).compile().as_text()
  return [line for line in hlo.splitlines()
          if ' copy(' in line and 'f32[32768,16]' in line]


def test_a_linear_loss_through_value_and_grad_copies_no_table():
  step, params, opt_state, ids = _linear_step(helper=True)
  assert not _table_copies(step, params, opt_state, ids)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert lazy_optax.perf.warn_if_not_donated(step, params, opt_state, ids)
  params, opt_state, _ = step(params, opt_state, ids)
  np.testing.assert_allclose(params['table'][:8], -0.1, rtol=1e-5)
  np.testing.assert_array_equal(params['table'][8:], 0.0)


@pytest.mark.cpu_kernels
def test_a_step_that_copies_a_donated_table_is_reported():
  # Rows looked up by hand with a linear loss: nothing orders the lookup
  # before the in-place update, and XLA copies the table inside the step.
  step, params, opt_state, ids = _linear_step(helper=False)
  copies = _table_copies(step, params, opt_state, ids)
  assert copies
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    assert not lazy_optax.perf.warn_if_not_donated(step, params, opt_state, ids)
  (message,) = [str(w.message) for w in caught if 'lazy_optax' in
                str(w.message)]
  assert "args[0]['table']" in message and 'copies' in message
  assert f'{2.0 * len(copies):.1f} MiB a step' in message, message
  assert 'lazy_optax.value_and_grad' in message
