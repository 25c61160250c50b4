"""How `lazy(...)` decides and how its rules get their tables.

A rule's state type is declared (`fused.declare`): `lazy` finds it in the
abstract state, decides each table's backend before its one trace of
`update`, and hands the rule its tables whole in its state
(`fused.TableRows`). Wrappers between `lazy` and the rule need forward
nothing; one that rebuilds the state under a `lax.cond`
(`optax.apply_if_finite`, `MultiSteps`, `conditionally_mask`) leaves the
rule its arithmetic on the row blocks. The extra argument
`lazy_optax_rows=` carries the row ids and `explain_update`'s log.
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


def test_a_wrapper_that_drops_extra_args_keeps_the_rule_in_place():
  # The tables travel in the rule's own state, not in the extra arguments.
  choice = _explain(_adam(_Dropping))
  assert (choice.rule, choice.impl) == ('adam', 'xla')
  dropped = _train(_adam(_Dropping))
  np.testing.assert_allclose(dropped['table'], _dense_adam(), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(dropped['table'], _train(_adam())['table'])


def test_the_rule_alone_computes_on_what_it_is_given():
  assert _explain(_adam()).impl == 'xla'
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
  # The inner lazy gets row blocks and the tables the outer one handed over
  # (its dense path); its impl='xla' narrows what its rule runs, and the
  # outer lazy (impl='auto') moves the rows: the same numbers.
  inner = lazy_optax.lazy_adam(0.1, impl='xla')
  nested = lazy_optax.lazy(inner)
  choice = _explain(nested)
  assert (choice.rule, choice.impl) == ('adam', 'xla')
  alone = _explain(inner)
  assert (alone.rule, alone.impl) == ('adam', 'xla')
  assert 'rows moved by XLA' in alone.reason
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
def test_optax_wrappers_inside_lazy_keep_or_rebuild_the_tables(name):
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
  assert seen and all(type(c).__name__ == 'Rows' for c in seen)
  if name in ('chain', 'partition', 'masked', 'inject_hyperparams'):
    assert (choice.rule, choice.impl) == ('adam', 'xla')
  else:  # the state rebuilt under a lax.cond: no table written in place
    assert (choice.rule, choice.impl) == ('adam', 'generic'), choice
    assert 'rebuilds' in choice.reason
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


def test_the_extra_argument_is_not_a_jit_argument():
  # lazy's `Rows` is a Python object inside the trace, never an operand.
  tx = _adam()
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  u, _ = step(_grads(0), state, params)
  assert isinstance(u['table'], SparseRows)


class _Counting:
  """A transformation that counts the traces of its init and update."""

  def __init__(self, inner):
    self.inits = self.updates = 0
    self.inner = inner

  def transformation(self):
    def init(params):
      self.inits += 1
      return self.inner.init(params)

    def update(updates, state, params=None, **extra_args):
      self.updates += 1
      return self.inner.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.parametrize('impl', ['auto', 'xla', 'generic'])
def test_one_trace_of_update_and_one_of_init_per_step_signature(impl):
  counting = _Counting(optax.chain(
      lazy_optax.scale_by_lazy_adam(impl=impl),
      optax.scale_by_learning_rate(0.1)))
  tx = lazy_optax.lazy(counting.transformation(), impl=impl)
  params = _params()
  state = tx.init(params)
  assert (counting.inits, counting.updates) == (1, 0)
  step = jax.jit(lambda g, s, p: tx.update(g, s, p))
  for t in range(3):  # one signature: traced once
    updates, state = step(_grads(t), state, params)
    params = lazy_optax.apply_updates(params, updates)
  # `update` once; `init` once more, abstractly, for the state leaves that
  # mirror each table (`row_state.row_owners`).
  assert (counting.inits, counting.updates) == (2, 1)
  np.testing.assert_allclose(params['table'], _dense_adam(), rtol=1e-5,
                             atol=1e-6)


def test_tables_handed_over_differ_in_structure_by_their_backend():
  from lazy_optax._src import backend as backend_lib
  from lazy_optax._src import fused
  table, ids = jnp.zeros((V, D)), jnp.arange(4)
  where = backend_lib.Placement('one')
  xla = backend_lib.Backend('xla', 'asked', False, where)
  kernel = backend_lib.Backend('cpu_kernel', 'asked', True, where)
  a = fused.TableRows(table, ids, xla, 'adam', 'table')
  b = fused.TableRows(table, ids, kernel, 'adam', 'table')
  c = fused.TableRows(table + 1, ids, xla, 'adam', 'table')
  assert jax.tree.structure(a) != jax.tree.structure(b)
  assert jax.tree.structure(a) == jax.tree.structure(c)
  leaves, treedef = jax.tree.flatten(a)
  back = jax.tree.unflatten(treedef, leaves)
  assert (back.backend, back.rule, back.name) == (xla, 'adam', 'table')
  assert back.table is table and back.ids is ids
  with pytest.raises(AttributeError, match='immutable'):
    a.table = table

