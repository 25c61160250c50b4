"""partial_rowwise_adam beyond the conformance suite
(tests/test_conformance.py)."""

import jax.numpy as jnp
import numpy as np
from optimizer_cases import batches
from optimizer_cases import run
import optax

import lazy_optax


def test_one_entry_rows_are_optax_adamw():
  # With one entry per row the row mean of g^2 is g^2: optax.adamw exactly.
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(20, 1)), jnp.float32)
  data = batches(4, 20, (1,), steps=8, n_ids=6)
  ours, _ = run(lazy_optax.partial_rowwise_adam(0.05, weight_decay=0.1),
                np.asarray(table), data)
  theirs, _ = run(lazy_optax.lazy(optax.adamw(0.05, weight_decay=0.1)),
                  np.asarray(table), data)
  # optax takes b^t in float32, this rule 1 - b^t from 1 - b: a few 1e-6.
  np.testing.assert_allclose(ours['table'], theirs['table'], rtol=2e-5,
                             atol=1e-6)
