"""How `lazy(...)`'s row context reaches the rules: optax's extra arguments.

`lazy` passes its context as the extra argument `lazy_optax_rows=`; the
wrappers that forward extra arguments (optax's) keep a rule fused, one that
drops them (a plain `optax.GradientTransformation`) leaves the rule its
arithmetic on the gathered rows, and `explain_update` says which and why.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import off_the_cpu
from reference import TFLazyAdam

import lazy_optax
from lazy_optax import SparseRows

ROWS_KEY = 'lazy_optax_rows'
V, D = 16, 32  # rows of 128 bytes: 'xla' is the rule's fused path here


def _params():
  rng = np.random.default_rng(0)
  return {'table': jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
          'w': jnp.asarray(rng.normal(size=(D,)), jnp.float32)}


def _grads(step):
  rng = np.random.default_rng(100 + step)
  ids = rng.integers(0, V, 6).astype(np.int32)
  ids[:2] = ids[-1]  # duplicates
  return {'table': SparseRows(jnp.asarray(ids),
                              jnp.asarray(rng.normal(size=(6, D)),
                                          jnp.float32), V),
          'w': jnp.asarray(rng.normal(size=(D,)), jnp.float32)}


def _train(tx, steps=3, **extra_args):
  params = _params()
  state = tx.init(params)
  for t in range(steps):
    updates, state = tx.update(_grads(t), state, params, **extra_args)
    params = lazy_optax.apply_updates(params, updates)
  return params


def _dense_adam(steps=3, lr=0.1):
  """An independent run: TensorFlow's LazyAdam in float64 numpy."""
  ref = TFLazyAdam(_params()['table'], lr=lr)
  for t in range(steps):
    g = _grads(t)['table']
    ref.step(g.ids, g.values)
  return ref.p


class _Dropping:
  """A hand-written wrapper whose update takes no extra arguments."""

  def __new__(cls, inner):
    return optax.GradientTransformation(
        inner.init, lambda u, s, p=None: inner.update(u, s, p))


class _Forwarding:
  """A hand-written wrapper that forwards optax's extra arguments."""

  def __new__(cls, inner):
    return optax.GradientTransformationExtraArgs(
        inner.init,
        lambda u, s, p=None, **extra: inner.update(u, s, p, **extra))


def _adam(wrap=lambda tx: tx):
  return lazy_optax.lazy(optax.chain(
      wrap(lazy_optax.scale_by_lazy_adam(impl='xla')),
      optax.scale_by_learning_rate(0.1)))


def _explain(tx, **extra_args):
  params = _params()
  return lazy_optax.explain_update(tx, _grads(0), tx.init(params), params,
                                   **extra_args)['table']


def test_a_wrapper_that_forwards_extra_args_keeps_the_rule_fused():
  choice = _explain(_adam(_Forwarding))
  assert (choice.rule, choice.impl) == ('adam', 'xla')
  np.testing.assert_allclose(_train(_adam(_Forwarding))['table'],
                             _dense_adam(), rtol=1e-5, atol=1e-6)


def test_a_wrapper_that_drops_extra_args_leaves_the_rule_generic():
  choice = _explain(_adam(_Dropping))
  assert (choice.rule, choice.impl) == ('tx', 'generic')
  assert ROWS_KEY in choice.reason
  assert 'dropped' in choice.reason
  assert 'plain optax.GradientTransformation' in choice.reason
  # Correct all the same: the rule's arithmetic on the gathered rows.
  dropped = _train(_adam(_Dropping))
  np.testing.assert_allclose(dropped['table'], _dense_adam(), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(dropped['table'], _train(_adam())['table'],
                             rtol=1e-6, atol=1e-7)


def test_the_rule_is_fused_only_where_the_context_arrives():
  assert _explain(_adam()).impl == 'xla'
  # The rule alone, given row blocks without a context, computes on them.
  rule = lazy_optax.scale_by_lazy_adam(impl='xla')
  rows = jnp.ones((4, D))
  u, _ = rule.update(rows, rule.init(rows))
  np.testing.assert_allclose(u, jnp.ones((4, D)), rtol=1e-5)


def test_a_user_transform_gets_its_extra_args_and_the_row_context_key():
  seen = []

  def update(updates, state, params=None, **extra_args):
    seen.append(dict(extra_args))
    return updates, state

  mine = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                               update)
  tx = lazy_optax.lazy(optax.chain(
      mine, lazy_optax.scale_by_lazy_adam(impl='xla'),
      optax.scale_by_learning_rate(0.1)))
  params = _train(tx, tag=7)
  assert seen and all(sorted(s) == sorted(['tag', ROWS_KEY]) for s in seen)
  assert all(s['tag'] == 7 for s in seen)
  np.testing.assert_allclose(params['table'], _dense_adam(), rtol=1e-5,
                             atol=1e-6)


def test_a_plain_user_transform_never_sees_the_keyword():
  calls = []

  def update(updates, state, params=None):  # a keyword would be a TypeError
    calls.append(1)
    return updates, state

  plain = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
  tx = lazy_optax.lazy(optax.chain(
      plain, lazy_optax.scale_by_lazy_adam(impl='xla'),
      optax.scale_by_learning_rate(0.1)))
  assert _explain(tx).impl == 'xla'
  params = _train(tx, tag=7)
  assert calls
  np.testing.assert_allclose(params['table'], _dense_adam(), rtol=1e-5,
                             atol=1e-6)


def test_nested_lazy_runs_the_inner_rule_on_the_outer_blocks():
  # The inner lazy gets row blocks (its dense path) and forwards the
  # outer context to its rule: fused, and the same numbers.
  inner = lazy_optax.lazy_adam(0.1, impl='xla')
  nested = lazy_optax.lazy(inner)
  choice = _explain(nested)
  assert (choice.rule, choice.impl) == ('adam', 'xla')
  assert _explain(inner) == choice
  got, want = _train(nested)['table'], _train(inner)['table']
  if not off_the_cpu(got):
    np.testing.assert_array_equal(got, want)
  else:
    # On a GPU the two programs sum the duplicate ids' rows in another
    # order (XLA's scatter-add): a last-bit difference (measured 1.5e-7).
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  np.testing.assert_allclose(_train(nested)['table'], _dense_adam(),
                             rtol=1e-5, atol=1e-6)


_LABELS = {'table': 'rows', 'w': 'rows'}


def _extra_args_of(multi_steps):
  return optax.GradientTransformationExtraArgs(multi_steps.init,
                                               multi_steps.update)

# optax's wrappers, inside lazy(...) around a rule: each forwards the extra
# arguments (what the rule then gets is in the semantics page's tables).
_INSIDE = {
    'chain': lambda tx: optax.chain(tx),
    'partition': lambda tx: optax.partition({'rows': tx}, _LABELS),
    'masked': lambda tx: optax.masked(tx, {'table': True, 'w': True}),
    'inject_hyperparams': lambda tx: optax.inject_hyperparams(
        lambda scale: optax.chain(tx, optax.scale(scale)))(scale=1.0),
    'apply_if_finite': lambda tx: optax.apply_if_finite(tx, 3),
    # Its own update forwards; its gradient_transformation() is a plain
    # GradientTransformation (optax 0.2.5 to 0.2.8), which drops them.
    'MultiSteps': lambda tx: _extra_args_of(optax.MultiSteps(tx, 1)),
    'conditionally_mask': lambda tx: optax.conditionally_mask(
        tx, lambda step: step >= 0),
}


@pytest.mark.parametrize('name', sorted(_INSIDE))
def test_optax_wrappers_inside_lazy_forward_the_context(name):
  seen = []

  def update(updates, state, params=None, **extra_args):
    seen.append(extra_args.get(ROWS_KEY))
    return updates, state

  probe = optax.GradientTransformationExtraArgs(
      lambda p: optax.EmptyState(), update)
  tx = lazy_optax.lazy(_INSIDE[name](optax.chain(
      probe, lazy_optax.scale_by_lazy_adam(impl='xla'),
      optax.scale_by_learning_rate(0.1))))
  choice = _explain(tx)
  assert seen and all(type(c).__name__ == 'RowContext' for c in seen)
  if name in ('chain', 'partition', 'masked', 'inject_hyperparams'):
    assert (choice.rule, choice.impl) == ('adam', 'xla')
  np.testing.assert_allclose(_train(tx)['table'], _dense_adam(), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize('wrap', [
    lambda tx: lazy_optax.wrappers.multi_steps(tx, 1, {'table': 6}),
    lambda tx: optax.apply_if_finite(tx, 3),
    lambda tx: optax.masked(tx, {'table': True, 'w': False}),
    lambda tx: optax.conditionally_mask(tx, lambda step: True),
    lambda tx: optax.chain(optax.clip_by_global_norm(1e3), tx),
], ids=['multi_steps', 'apply_if_finite', 'masked', 'conditionally_mask',
        'chain'])
def test_optax_wrappers_around_lazy_forward_the_explanation(wrap):
  choice = _explain(wrap(lazy_optax.lazy_adam(0.1, impl='xla')))
  assert (choice.rule, choice.impl) == ('adam', 'xla')


def test_explain_update_names_a_wrapper_that_drops_its_keyword():
  tx = _Dropping(lazy_optax.lazy_adam(0.1, impl='xla'))
  with pytest.raises(ValueError, match=f'{ROWS_KEY}=.*plain'):
    _explain(tx)


def test_the_context_is_not_a_jit_argument():
  # lazy's context is a Python object inside the trace, never an operand.
  tx = _adam()
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  u, _ = step(_grads(0), state, params)
  assert isinstance(u['table'], SparseRows)
