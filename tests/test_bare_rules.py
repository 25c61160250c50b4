"""`scale_by_X` is the bare rule (as `optax.scale_by_adam` is), not a `lazy`.

Inside `lazy(...)` it is the rule the conformance suite checks against its
float64 model (`optimizer_cases.py`'s `chained` forms); here: on a dense
gradient it updates every row as the rule does on rows all touched once, and
a `SparseRows` gradient that reaches it outside `lazy(...)` takes the old
path (`lazy(rule)`) with a `DeprecationWarning` until 0.3.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax
from optimizer_cases import RULE_CASES

SCALE_BYS = sorted({c.scale_by for c in RULE_CASES if c.scale_by is not None},
                   key=lambda f: f.__name__)
ROWS, WIDTH = 8, 3


def _gradient(ids):
  values = np.arange(1, 1 + len(ids) * WIDTH, dtype=np.float32)
  return lazy_optax.SparseRows(jnp.asarray(ids), jnp.asarray(
      values.reshape(len(ids), WIDTH) / 7.0), ROWS)


@pytest.mark.parametrize('scale_by', SCALE_BYS, ids=lambda f: f.__name__)
def test_scale_by_is_the_bare_rule(scale_by):
  params = {'t': jnp.linspace(-1.0, 1.0, ROWS * WIDTH).reshape(ROWS, WIDTH)}
  tx, wrapped = scale_by(), lazy_optax.lazy(scale_by())
  state = tx.init(params)
  every, some = _gradient(list(range(ROWS))), _gradient([1, 4, 1])
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    rows, _ = wrapped.update({'t': every}, state, params)
    dense, _ = tx.update({'t': every.to_dense()}, state, params)
    want, _ = wrapped.update({'t': some}, state, params)
  # A dense gradient: every row, as the rule on rows all touched once.
  assert not isinstance(dense['t'], lazy_optax.SparseRows)
  np.testing.assert_allclose(dense['t'], rows['t'].to_dense(), rtol=1e-6,
                             atol=1e-7)
  # A SparseRows gradient outside lazy(...): the old lazy path, deprecated.
  with pytest.warns(DeprecationWarning, match=scale_by.__name__):
    got, _ = tx.update({'t': some}, state, params)
  np.testing.assert_array_equal(got['t'].to_dense(), want['t'].to_dense())
  untouched = np.delete(np.asarray(got['t'].to_dense()), [1, 4], axis=0)
  assert not untouched.any() and np.asarray(got['t'].to_dense()).any()
