"""ftrl beyond the conformance suite (tests/test_conformance.py)."""

import numpy as np
from optimizer_cases import batches
from optimizer_cases import D
from optimizer_cases import NUM_ROWS
from optimizer_cases import run
from reference import Ftrl

import lazy_optax


def test_l1_gives_exact_zeros():
  data = batches(3, NUM_ROWS, (D,), steps=10, n_ids=16)
  params, _ = run(lazy_optax.ftrl(0.1, l1=1.0), np.zeros((NUM_ROWS, D)), data)
  table = np.asarray(params['table'])
  ref = Ftrl(np.zeros((NUM_ROWS, D)), lr=0.1, l1=1.0)
  for ids, values in data:
    ref.step(ids, values)
  assert np.sum(table == 0) == np.sum(ref.p == 0) > NUM_ROWS * D // 2
  assert np.sum(table != 0) > 0


def test_one_step_of_the_documented_formula():
  # docs/optimizers.md's lines, written out for one touched row (id 1, seen
  # twice: its gradients summed), every hyperparameter in play; the float64
  # model and ftrl must both give them. Row 0 is not touched.
  lr, power, l1, l2, shrink, beta, n0 = 0.5, 0.3, 0.02, 0.1, 0.2, 0.3, 0.1
  table = np.array([[0.4, -0.1, 0.2, 0.0], [0.3, -0.2, 0.05, 0.0]])
  ids = np.array([1, 1])
  values = np.array([[0.5, 0.25, -0.01, -1.0], [0.25, -0.5, 0.0, 0.5]])
  g = values.sum(0)
  w, n, z = table[1], np.full(4, n0), np.zeros(4)
  g_s = g + 2 * shrink * w
  n_new = n + g * g
  sigma = (n_new ** power - n ** power) / lr
  z = z + g_s - sigma * w
  q = (beta + n_new ** power) / lr + 2 * l2
  expected = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / q, 0.0)
  assert expected[2] == 0.0 and np.all(expected[[0, 1, 3]] != 0.0)

  kw = dict(l1=l1, l2=l2, l2_shrinkage=shrink, beta=beta,
            initial_accumulator_value=n0)
  model = Ftrl(table, lr=lr, lr_power=-power, **kw)
  model.step(ids, values)
  np.testing.assert_allclose(model.p[1], expected, rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(model.n[1], n_new, rtol=1e-12)
  np.testing.assert_allclose(model.z[1], z, rtol=1e-12)

  tx = lazy_optax.ftrl(lr, learning_rate_power=-power, **kw)
  params, state = run(tx, table, [(ids, values)])
  got = np.asarray(params['table'])
  np.testing.assert_allclose(got[1], expected, rtol=2e-6, atol=1e-7)
  assert got[1, 2] == 0.0
  np.testing.assert_array_equal(got[0], table[0].astype(np.float32))
  np.testing.assert_allclose(np.asarray(state.accumulator['table'])[1], n_new,
                             rtol=1e-6)
