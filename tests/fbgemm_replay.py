"""What the FBGEMM parity tests share: fixtures, the replay, the checks.

`tests/data/make_fbgemm_fixture.py` (run under FBGEMM's interpreter) writes
an `.npz` with the inputs (`table0`, per-step `ids` and `grads`, the
hyperparameters) and FBGEMM's outputs after each step. The tests replay the
same inputs through a lazy_optax transformation (`replay`) and compare;
a live test has FBGEMM make a fresh case first (`make_live`, skipped by
`live` where FBGEMM's interpreter is absent). Imported by the tests as
`tests/reference.py` is (`conftest.py` puts `tests/` on the path).
"""

import collections
import importlib.util
import json
import os
import pathlib
import subprocess
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lazy_optax

DATA = pathlib.Path(__file__).resolve().parent / 'data'
MAKER = DATA / 'make_fbgemm_fixture.py'
# FBGEMM's interpreter: `python3 benchmarks/peers.py setup DIR` makes it and
# prints the line that sets this variable (the benchmarks read it too).
FBGEMM_PYTHON = os.environ.get('LAZY_OPTAX_FBGEMM_PYTHON', '')
FBGEMM_VERSION = '1.9.0'   # the version that made the stored fixtures

live = pytest.mark.skipif(
    not os.access(FBGEMM_PYTHON, os.X_OK),
    reason=(f'no FBGEMM interpreter at {FBGEMM_PYTHON}' if FBGEMM_PYTHON
            else 'LAZY_OPTAX_FBGEMM_PYTHON is not set')
    + ' (`python3 benchmarks/peers.py setup DIR` makes the interpreter and '
    'prints the line that sets it); the fixture test still runs')


def load(name: str) -> Any:
  """The stored fixture `tests/data/NAME`."""
  return np.load(DATA / name)


# The live cases' maker arguments (`live_case`), made all at once by one
# run of FBGEMM's interpreter (importing torch and FBGEMM is most of a run's
# cost) the first time a test of this process asks for one.
_LIVE_CASES: list[tuple[str, ...]] = []
_LIVE_MADE: dict[tuple[str, ...], str] = {}
# Under FBGEMM's interpreter: the maker's `main` once per case, as if each
# were its own command line (argv[1]: the maker; argv[2]: [[out, args]...]).
_LIVE_DRIVER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location('maker', sys.argv[1])
maker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(maker)
for out, args in json.loads(sys.argv[2]):
  sys.argv = [spec.origin, '--out', out, *args]
  maker.main()
"""


def live_case(*args: str) -> tuple[str, ...]:
  """Declares a live case (the maker's arguments); returns them.

  Called at import by the test modules, so that the first `make_live` of a
  process makes every declared case in one run of FBGEMM's interpreter.
  """
  if args not in _LIVE_CASES:
    _LIVE_CASES.append(args)
  return args


def make_live(tmp_path: pathlib.Path, *args: str) -> Any:
  """Runs the maker under FBGEMM's interpreter with `args`; its output.

  Cases declared by `live_case` (and `args`) are made once per process,
  together, in a folder of the first caller's `tmp_path`.
  """
  if args not in _LIVE_MADE:
    todo = [a for a in _LIVE_CASES + [args] if a not in _LIVE_MADE]
    todo = list(dict.fromkeys(todo))
    jobs = [(str(tmp_path / f'live{len(_LIVE_MADE) + i}.npz'), list(a))
            for i, a in enumerate(todo)]
    proc = subprocess.run(
        [FBGEMM_PYTHON, '-c', _LIVE_DRIVER, str(MAKER), json.dumps(jobs)],
        capture_output=True, text=True, timeout=600, check=False,
        env=dict(os.environ, PYTHONPATH=''))
    assert proc.returncode == 0, proc.stderr[-2000:]
    _LIVE_MADE.update((a, out) for a, (out, _) in zip(todo, jobs))
  return np.load(_LIVE_MADE[args])


def maker_module() -> Any:
  """The maker as a module (it imports only numpy at module level)."""
  spec = importlib.util.spec_from_file_location('make_fbgemm_fixture', MAKER)
  assert spec is not None and spec.loader is not None
  maker = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(maker)
  return maker


def replay(tx: optax.GradientTransformation, data: Any,
           record: Callable[[Any], dict], jit: bool = True,
           before_step: Callable[[int, jax.Array], jax.Array] | None = None,
           ) -> dict[str, np.ndarray]:
  """Steps `tx` through the fixture's `(ids, grads)` on `table0`.

  Args:
    tx: the lazy_optax transformation under test.
    data: the fixture.
    record: `state -> {name: array}`, what to keep of the state after
      each step.
    jit: jit the step (donating parameters and state) or run it eagerly.
    before_step: `(t, table) -> table`, applied outside the optimizer
      before step `t` (counted from 1), or None.

  Returns:
    `{'tables': [steps, rows, dim], name: [steps, ...] per recorded name}`.
  """
  num_rows = data['table0'].shape[0]

  def step(params, state, ids, grads):
    g = {'table': lazy_optax.SparseRows(ids, grads, num_rows=num_rows)}
    updates, state = tx.update(g, state, params)
    return lazy_optax.apply_updates(params, updates), state

  if jit:
    step = jax.jit(step, donate_argnums=(0, 1))
  params = {'table': jnp.asarray(data['table0'])}
  state = tx.init(params)
  out = collections.defaultdict(list)
  for t, (ids, grads) in enumerate(zip(data['ids'], data['grads']), start=1):
    if before_step is not None:
      params = {'table': before_step(t, params['table'])}
    params, state = step(params, state, jnp.asarray(ids), jnp.asarray(grads))
    out['tables'].append(np.asarray(params['table']))
    for name, value in record(state).items():
      out[name].append(np.asarray(value))
  return {name: np.stack(values) for name, values in out.items()}


def dense_steps(data: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Each step's gradient, duplicates summed, as a float64 `[rows, dim]`
  array, and the step's distinct rows (for the float64 models)."""
  for ids, grads in zip(data['ids'], data['grads']):
    g = np.zeros(data['table0'].shape)
    np.add.at(g, ids, grads.astype(np.float64))
    yield g, np.unique(ids)


def never_seen(data: Any) -> np.ndarray:
  """The rows no step looks up."""
  return np.setdiff1d(np.arange(data['table0'].shape[0]), data['ids'])


def assert_untouched(tables: np.ndarray, data: Any) -> np.ndarray:
  """Asserts the rows never looked up stay bit for bit; returns them."""
  never = never_seen(data)
  assert never.size
  np.testing.assert_array_equal(tables[:, never], np.broadcast_to(
      data['table0'][never], tables[:, never].shape))
  return never


def assert_hard_case(data: Any, *, min_steps: int, min_never: int,
                     late_after: int = 1) -> None:
  """What every fixture must hold to be worth comparing against.

  At least `min_steps` steps, ids repeated within every step, at least
  `min_never` rows never looked up, rows of the last step that none of the
  first `late_after` steps saw (first seen late), and made by the FBGEMM
  version the tests were measured with.
  """
  ids = data['ids']
  assert ids.shape[0] >= min_steps, ids.shape
  assert all(np.unique(s).size < s.size for s in ids)
  assert never_seen(data).size >= min_never
  assert np.setdiff1d(ids[-1], ids[:late_after]).size > 0
  assert str(data['fbgemm_version']) == FBGEMM_VERSION


def table_errors(tables: np.ndarray, want: np.ndarray,
                 row_floor: float = 0.0) -> dict[str, float]:
  """The largest absolute error, and the largest relative to the row's
  largest entry of `want` (at least `row_floor`)."""
  diff = np.abs(tables - want)
  row_scale = np.maximum(np.abs(want).max(axis=-1, keepdims=True), row_floor)
  return {'table_abs': float(diff.max()),
          'table_rel_to_row': float((diff / row_scale).max())}


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
  """The largest error relative to each entry of `want`."""
  return float((np.abs(got - want)
                / np.maximum(np.abs(want), 1e-30)).max())


def assert_table_and_accumulators_within(tables: np.ndarray,
                                         accumulators: np.ndarray, data: Any,
                                         bound: float) -> dict[str, float]:
  """The tables (relative to each row's largest entry) and the row
  accumulators (relative to each entry) within `bound` of FBGEMM's
  (`data['tables']`, `data['accumulators']`); returns the errors."""
  errors = table_errors(tables, data['tables'])
  errors['acc_rel'] = rel_error(accumulators, data['accumulators'])
  print(errors)
  assert errors['table_rel_to_row'] < bound and errors['acc_rel'] < bound, (
      errors)
  return errors
