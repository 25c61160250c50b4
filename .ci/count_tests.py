"""Counts test functions and assertion statements under tests/.

A test function is a `def test_*` (module level or in a class). An assertion
is an `assert` statement, a call of a function or method whose name starts
with `assert` (`np.testing.assert_allclose`, `chex.assert_trees_all_close`,
a helper `assert_matches_model`), or a `pytest.raises` / `pytest.warns`
call (as a context manager or a call). Usage:

    python3 .ci/count_tests.py [tests]    # totals
    python3 .ci/count_tests.py -v [tests]  # per file too
"""

import ast
import pathlib
import sys


def _name(func: ast.expr) -> str:
  if isinstance(func, ast.Attribute):
    base = _name(func.value)
    return f'{base}.{func.attr}' if base else func.attr
  if isinstance(func, ast.Name):
    return func.id
  return ''


def count(path: pathlib.Path) -> dict[str, int]:
  tree = ast.parse(path.read_text(), str(path))
  out = {'tests': 0, 'assert': 0, 'assert_*': 0, 'pytest.raises': 0}
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
        node.name.startswith('test_')):
      out['tests'] += 1
    elif isinstance(node, ast.Assert):
      out['assert'] += 1
    elif isinstance(node, ast.Call):
      name = _name(node.func)
      last = name.rsplit('.', 1)[-1]
      if name in ('pytest.raises', 'pytest.warns'):
        out['pytest.raises'] += 1
      elif last.startswith('assert'):
        out['assert_*'] += 1
  return out


def main(argv: list[str]) -> None:
  verbose = '-v' in argv
  roots = [a for a in argv if a != '-v'] or ['tests']
  files = sorted(p for r in roots for p in pathlib.Path(r).rglob('*.py'))
  total = {'tests': 0, 'assert': 0, 'assert_*': 0, 'pytest.raises': 0}
  for f in files:
    c = count(f)
    for k in total:
      total[k] += c[k]
    if verbose:
      print(f'{str(f):45s}', ' '.join(f'{k}={v}' for k, v in c.items()))
  checks = total['assert'] + total['assert_*'] + total['pytest.raises']
  print(f'{len(files)} files: {total["tests"]} test functions, '
        f'{checks} assertions ({total["assert"]} assert, '
        f'{total["assert_*"]} assert_* calls, '
        f'{total["pytest.raises"]} pytest.raises/warns)')


if __name__ == '__main__':
  main(sys.argv[1:])
