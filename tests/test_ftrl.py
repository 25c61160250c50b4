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
