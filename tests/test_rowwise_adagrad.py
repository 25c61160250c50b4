"""rowwise_adagrad beyond the conformance suite (tests/test_conformance.py)."""

import jax.numpy as jnp
import numpy as np

import lazy_optax


def test_scalar_and_vector_parameters_each_entry_is_a_row():
  tx = lazy_optax.rowwise_adagrad(0.1)
  p = {'s': jnp.float32(1.0), 'v': jnp.ones(3)}
  s = tx.init(p)
  assert s[0].sum_of_squares['s'].shape == ()
  assert s[0].sum_of_squares['v'].shape == (3,)
  u, s = tx.update({'s': jnp.float32(2.0), 'v': jnp.array([1.0, 0.0, -3.0])},
                   s, p)
  np.testing.assert_allclose(u['v'], [-0.1, 0.0, 0.1], rtol=1e-6)
  np.testing.assert_allclose(s[0].sum_of_squares['v'], [1.0, 0.0, 9.0])
