"""Data parallelism with SparseRows on 8 simulated CPU devices.

Run by the test in the 8-device process of tests/eight_devices.py, or as a
script (XLA_FLAGS must be set before JAX starts). Each device differentiates
its slice of the batch; `lazy_optax.tree.psum`/`pmean` combine the gradients, and the step must equal
one device's step on the whole batch. A raw `lax.psum` of the same gradients
damages the ids: the step raises (with the warn-only opt-in, no row is
written).

`shard_map` runs with `check_vma=True` (its default) and `False`:
`value_and_grad` keeps the gradient rows per device either way. A
`SparseRows` whose values autodiff already summed across devices (the
gradient of a replicated input) while its ids stayed per device is refused
at trace time. The data-parallel snippet of docs/semantics.md runs as it is.
`explain_update`, asked inside the `shard_map` step, names what the
compiled program runs, and the donated step copies no table.
"""

import os

if __name__ == '__main__':  # not when pytest imports this file for doctests
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + ' --xla_force_host_platform_device_count=8')

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import lazy_optax  # noqa: E402

V, D, N = 50, 3, 32


def loss_fn(params, ids, targets):
  rows = lazy_optax.lookup(params['t'], ids)
  return jnp.sum((rows @ params['w'] - targets) ** 2)


def main():
  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(0)
  params = {'t': jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
            'w': jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
  ids = jnp.asarray(rng.integers(0, 12, N), jnp.int32)   # many duplicates
  targets = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
  tx = lazy_optax.lazy_adam(0.05)
  mesh = jax.make_mesh((8,), ('batch',))
  split = jax.sharding.NamedSharding(mesh, P('batch'))
  ids_split, targets_split = (jax.device_put(ids, split),
                              jax.device_put(targets, split))

  def local_step(combine, scale):
    def step(params, state, ids, targets):
      _, grads = lazy_optax.value_and_grad(loss_fn)(params, ids, targets)
      grads = combine(grads, 'batch')
      updates, state = tx.update(grads, state, params)
      return lazy_optax.apply_updates(params, updates), state
    return step

  for name, combine, scale in (('psum', lazy_optax.tree.psum, 1.0),
                               ('pmean', lazy_optax.tree.pmean, 1.0 / 8)):
    # One device, whole batch (the pmean loss is the mean of 8 slice sums).
    want, want_state = one_device_step(tx, loss_fn, params, (ids, targets),
                                       scale)

    for check_vma in (True, False):
      sharded = jax.jit(jax.shard_map(
          local_step(combine, scale), mesh=mesh,
          in_specs=(P(), P(), P('batch'), P('batch')), out_specs=(P(), P()),
          check_vma=check_vma))
      got, got_state = sharded(params, tx.init(params), ids_split,
                               targets_split)
      for key in ('t', 'w'):
        np.testing.assert_allclose(
            got[key], want[key], rtol=2e-6, atol=1e-7,
            err_msg=f'shard_map {name} check_vma={check_vma} {key}')
      np.testing.assert_allclose(got_state[0].nu['t'], want_state[0].nu['t'],
                                 rtol=2e-6, atol=1e-9)

    pmapped = jax.pmap(local_step(combine, scale), axis_name='batch',
                       in_axes=(None, None, 0, 0))
    got_p, _ = pmapped(params, tx.init(params), ids.reshape(8, -1),
                       targets.reshape(8, -1))
    np.testing.assert_allclose(got_p['t'][0], want['t'], rtol=2e-6,
                               atol=1e-7, err_msg=f'pmap {name}')

  # The raw collectives reach the ids: the step raises when it runs; with
  # the warn-only opt-in, nothing is written to the table.
  for raw in (jax.lax.psum, jax.lax.pmean):
    step = jax.jit(jax.shard_map(
        local_step(raw, 1.0), mesh=mesh,
        in_specs=(P(), P(), P('batch'), P('batch')), out_specs=(P(), P()),
        check_vma=False))
    try:
      jax.block_until_ready(
          step(params, tx.init(params), ids_split, targets_split))
      raise AssertionError(f'{raw} of the gradients did not stop the step')
    except (jax.errors.JaxRuntimeError, ValueError) as e:
      assert 'DamagedIdsError' in str(e), str(e)
    old = lazy_optax.checks.on_damaged_ids('warn')
    try:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        got, _ = step(params, tx.init(params), ids_split, targets_split)
        jax.block_until_ready(got)
    finally:
      lazy_optax.checks.on_damaged_ids(old)
    np.testing.assert_array_equal(got['t'], params['t'])
    assert any('changed by arithmetic' in str(w.message) for w in caught), (
        raw, [str(w.message) for w in caught])
  reduced_values_are_refused(mesh, params, ids_split)
  explain_update_tells_what_the_sharded_step_runs(mesh, params, ids_split,
                                                  targets_split)
  docs_snippet_runs()
  print('data parallel checks passed')


def _one_device_step(tx, loss, params, state, scale, *batch):
  whole = lambda p, *b: scale * loss(p, *b)
  _, grads = lazy_optax.value_and_grad(whole)(params, *batch)
  updates, state = tx.update(grads, state, params)
  return lazy_optax.apply_updates(params, updates), state


def one_device_step(tx, loss, params, batch, scale=1.0):
  """The reference: one step of `tx` on one device and the whole batch.

  Jitted (one program, the scale an argument of it), not an eager dispatch
  per operation; the state is made outside jit, as a training loop makes it.

  Args:
    tx: the optimizer.
    loss: the loss, `loss(params, *batch)`.
    params: the parameters.
    batch: the whole batch's arrays (on one device).
    scale: a number multiplying the loss.

  Returns:
    The new parameters and optimizer state.
  """
  step = jax.jit(_one_device_step, static_argnums=(0, 1))
  return step(tx, loss, params, tx.init(params), jnp.float32(scale), *batch)


def reduced_values_are_refused(mesh, params, ids_split):
  """Values summed across devices by autodiff, ids per device: refused."""

  def step(params, ids):
    zeros = jnp.zeros(ids.shape + (D,))         # replicated: not varying
    values = jax.grad(lambda z: jnp.sum((z + 1.0) ** 2))(zeros)
    g = {'t': lazy_optax.SparseRows(ids, values, V)}
    return lazy_optax.tree.pmean(g, 'batch')['t'].to_dense()

  sharded = jax.jit(jax.shard_map(step, mesh=mesh,
                                  in_specs=(P(), P('batch')), out_specs=P()))
  try:
    sharded(params, ids_split)
  except ValueError as e:
    assert "do not vary over the mesh axes ['batch']" in str(e), e
    assert 'lazy_optax.value_and_grad' in str(e), e
  else:
    raise AssertionError('reduced values were not refused')


def explain_update_tells_what_the_sharded_step_runs(mesh, params, ids_split,
                                                    targets_split):
  """`explain_update` inside the step, where `lazy(...)` decides: the
  compiled program calls the rule's kernel exactly when it says
  'cpu_kernel', and the donated step copies no table."""
  from lazy_optax._src import train_step  # pylint: disable=g-import-not-at-top
  tx = lazy_optax.lazy_adam(0.05)
  said = []

  def local(params, state, ids, targets):
    _, grads = lazy_optax.value_and_grad(loss_fn)(params, ids, targets)
    grads = lazy_optax.tree.pmean(grads, 'batch')
    said.append(lazy_optax.explain_update(tx, grads, state, params)['t'])
    updates, state = tx.update(grads, state, params)
    return lazy_optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P(), P('batch'), P('batch')),
      out_specs=(P(), P())), donate_argnums=(0, 1))
  state = tx.init(params)
  hlo = step.lower(params, state, ids_split, targets_split).compile(
      ).as_text()
  assert said, 'explain_update was not traced'
  calls = 'lazy_optax_LazyOptaxAdam' in hlo
  assert calls == (said[-1].impl == 'cpu_kernel'), (said[-1], calls)
  # The test's table is small: let warn_if_not_donated look at it.
  old, train_step.COPY_WARN_BYTES = train_step.COPY_WARN_BYTES, 1
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('error')
      assert lazy_optax.perf.warn_if_not_donated(step, params, state,
                                                 ids_split, targets_split)
  finally:
    train_step.COPY_WARN_BYTES = old


def docs_snippet_runs():
  """The data-parallel snippet of docs/semantics.md, run as it is."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  docs = pathlib.Path(__file__).resolve().parent.parent / 'docs'
  text = (docs / 'semantics.md').read_text()
  code = re.search(r'<!-- test: data-parallel-snippet -->\n```python\n(.*?)```',
                   text, re.S).group(1)
  namespace = {}
  exec(compile(code, 'docs/semantics.md', 'exec'), namespace)  # pylint: disable=exec-used
  # One device on the whole batch gives the same table.
  tx, loss_fn = namespace['tx'], namespace['loss_fn']
  params0 = {'table': jnp.zeros((1000, 16)), 'w': jnp.ones((16,))}
  ids = jnp.arange(64) % 100
  want, _ = one_device_step(tx, loss_fn, params0, (ids, jnp.ones(64)))
  np.testing.assert_allclose(namespace['params']['table'], want['table'],
                             rtol=2e-6, atol=1e-7)


if __name__ == '__main__':
  main()
