"""A refused step keeps the train state: the cases of docs/semantics.md.

For every composition that docs/semantics.md puts in an error group, a
donated step built with `lazy_optax.perf.make_train_step` either fails at
trace time (nothing ran, nothing was donated) or raises a
`lazy_optax.checks.StepError` whose `outputs` hold the params and optimizer
state from before the step; resuming from them must equal, bit for bit, a
run that never met the bad step. `run_cases()` runs them on one device (in
the pytest process) or, where 8 devices exist, with the table sharded over
its rows (tests/eight_devices.py runs it there).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import lazy_optax
from lazy_optax import SparseRows

V, D, N = 16, 4, 6


def _raw_reduce(reduce):
  """Two devices' gradients combined leaf by leaf with a raw collective."""

  def change(g):
    stacked = jax.tree.map(lambda x: jnp.stack([x, x[::-1]]), g)
    reduced = jax.vmap(lambda h: reduce(h, 'd'), axis_name='d')(stacked)
    return jax.tree.map(lambda x: x[0], reduced)

  return change


def _zeros_like_accumulation(g):
  """Two microbatches accumulated into `jax.tree.map(jnp.zeros_like, g)`."""
  acc = jax.tree.map(jnp.zeros_like, g)
  acc = jax.tree.map(jnp.add, acc, g)
  return jax.tree.map(jnp.add, acc, _other(g))


def _other(g):
  return {'t': SparseRows(jnp.arange(N) % V, jnp.ones((N, D)), V),
          'w': jnp.ones_like(g['w'])}


# What the step does to the gradient dict before the update: each damages
# the table's ids, which only the running step can see.
WHEN_RUN = {
    'tree_add': lambda g: jax.tree.map(jnp.add, g, _other(g)),
    'optax_tree_add': lambda g: optax.tree.add(g, _other(g)),
    'scale_1e-30': lambda g: jax.tree.map(lambda x: x * 1e-30, g),
    'scale_2^-70': lambda g: jax.tree.map(lambda x: x * 2.0 ** -70, g),
    'add_noise': lambda g: optax.add_noise(0.1, 0.5, 0).update(
        g, optax.add_noise(0.1, 0.5, 0).init(g))[0],
    'centralize': lambda g: optax.centralize().update(
        g, optax.centralize().init(g))[0],
    'raw_psum': _raw_reduce(jax.lax.psum),
    'raw_pmean': _raw_reduce(jax.lax.pmean),
    'zeros_like_accumulation': _zeros_like_accumulation,
}

# Optimizers built wrong, refused at trace time.
AT_TRACE = {
    'scale_by_adam_before_lazy': lambda: optax.chain(
        optax.scale_by_adam(), lazy_optax.lazy(optax.sgd(0.1))),
    'add_decayed_weights_before_lazy': lambda: optax.chain(
        optax.add_decayed_weights(0.1), lazy_optax.lazy_adam(0.1)),
    'optax_multi_steps': lambda: optax.MultiSteps(lazy_optax.lazy_adam(0.1),
                                                  2),
    'partition_to_plain_optimizer': lambda: optax.partition(
        {'a': optax.adam(0.1), 'b': lazy_optax.lazy_adam(0.1)},
        {'t': 'a', 'w': 'b'}),
    'multi_steps_without_the_table': lambda: lazy_optax.wrappers.multi_steps(
        lazy_optax.lazy_adam(0.1), every_k=2, ids_per_step={}),
}


# Changes of the gradients refused at trace time.
AT_TRACE_CHANGES = {
    'cast_ids': lambda g: jax.tree.map(lambda x: x.astype(jnp.bfloat16), g),
    'zeros_like_params': lambda g: jax.tree.map(
        lambda a, b: a + b, {'t': jnp.zeros((V, D)), 'w': jnp.zeros((D,))},
        g, is_leaf=lazy_optax.tree.is_sparse_rows),
}


def _placed(params):
  """The params on one device, or the table split over 8 devices' rows."""
  if jax.device_count() < 8:
    return params
  mesh = jax.make_mesh((8,), ('rows',))
  return {'t': jax.device_put(params['t'], NamedSharding(mesh, P('rows'))),
          'w': jax.device_put(params['w'], NamedSharding(mesh, P()))}


def _fresh():
  rng = np.random.default_rng(0)
  return _placed({'t': jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
                  'w': jnp.asarray(rng.normal(size=(D,)), jnp.float32)})


def _batches():
  rng = np.random.default_rng(1)
  return [jnp.asarray(rng.integers(0, V, size=N), jnp.int32)
          for _ in range(3)]


def _make_step(tx, change=None):
  """A donated step; with `change` True, its argument `case` picks the
  change made to the gradients (0: none), one compiled program for every
  case of WHEN_RUN; with a function, that change."""
  changes = [lambda g: g] + [WHEN_RUN[name] for name in WHEN_RUN]
  if callable(change):
    changes = [change]

  def train_step(params, opt_state, ids, case):
    def loss_fn(p):
      rows = lazy_optax.lookup(p['t'], ids)
      return jnp.sum((rows @ p['w'] - 1.0) ** 2)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    if change is not None:
      grads = jax.lax.switch(case, changes, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  return lazy_optax.perf.make_train_step(train_step)


def _host(tree):
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _same(a, b):
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: np.array_equal(x, y) and x.dtype == y.dtype,
      _host(a), _host(b))))


_MEMO = {}


def _case(name):
  return jnp.asarray(1 + list(WHEN_RUN).index(name) if name else 0,
                     jnp.int32)


def _reference(step, tx):
  """Batches 0 and 2 only, as if batch 1 never came (once per step)."""
  if id(step) not in _MEMO:
    b = _batches()
    params = _fresh()
    state = tx.init(params)
    params, state, _ = step(params, state, b[0], _case(None))
    params, state, _ = step(params, state, b[2], _case(None))
    _MEMO[id(step)] = _host((params, state))
  return _MEMO[id(step)]


def _refused(step, tx, bad_ids=None, name=None):
  """Batch 0, a refused step (batch 1 changed by `name`, or `bad_ids`), then
  batch 2 from the state the error handed back."""
  b = _batches()
  params = _fresh()
  state = tx.init(params)
  params, state, _ = step(params, state, b[0], _case(None))
  before = _host((params, state))
  try:
    step(params, state, b[1] if bad_ids is None else bad_ids, _case(name))
  except lazy_optax.checks.StepError as e:
    error = e
  else:
    return {'error': 'the bad step was not refused'}
  deleted = params['t'].is_deleted()   # donated: consumed by the call
  params, state, _ = error.outputs
  kept = _same((params, state), before)
  params, state, _ = step(params, state, b[2], _case(None))
  return {'raised': type(error).__name__,
          'first_line': str(error).splitlines()[0],
          'donated': bool(deleted), 'kept': kept,
          'resumed': _same((params, state), _reference(step, tx))}


def _checked(tx):
  """Out-of-range ids in checked mode: CheckError, state kept."""
  checked_tx = lazy_optax.checks.with_id_checks(tx)
  step = _make_step(checked_tx)
  return _refused(step, checked_tx,
                  bad_ids=jnp.asarray([1, 2, V + 3, 4, -1, 5], jnp.int32))


def _at_trace(name):
  """Refused at trace time: the donated inputs are still there."""
  if name in AT_TRACE:
    tx = AT_TRACE[name]()
    step = _make_step(tx)
  else:
    tx = lazy_optax.lazy_adam(0.1)
    step = _make_step(tx, AT_TRACE_CHANGES[name])
  params = _fresh()
  try:
    state = tx.init(params)
    before = _host((params, state))
    step(params, state, _batches()[0], _case(None))
  except (ValueError, TypeError) as e:
    first_line = str(e).splitlines()[0]
  else:
    return {'error': 'not refused'}
  intact = not any(x.is_deleted() for x in jax.tree.leaves((params, state)))
  return {'first_line': first_line, 'intact': intact,
          'kept': intact and _same((params, state), before)}


def run_cases():
  """Every case; a dict of JSON-able results by case."""
  tx = lazy_optax.lazy_adam(0.1)
  _MEMO.clear()
  step = _make_step(tx, change=True)
  out = {name: _refused(step, tx, name=name) for name in WHEN_RUN}
  out['checked_out_of_range'] = _checked(tx)
  out.update({name: _at_trace(name)
              for name in list(AT_TRACE) + list(AT_TRACE_CHANGES)})
  out['devices'] = jax.device_count()
  return out
