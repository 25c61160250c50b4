"""docs/train_steps.md runs; make_train_step and warn_if_not_donated."""

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


def test_every_python_block_of_the_guide_runs_in_order():
  blocks = re.findall(r'```python\n(.*?)```', GUIDE.read_text(), re.S)
  assert len(blocks) == 6
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
  for name in ('params', 'state', 'nnx_state', 'hk_params', 'eqx_model'):
    assert name in namespace, name
  # The steps trained: each framework's last loss is well below the first.
  assert float(namespace['loss']) < 1.0


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
