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
import collections
import pathlib
import subprocess
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


def _checks(node: ast.AST) -> int:
  n = 0
  for sub in ast.walk(node):
    if isinstance(sub, ast.Assert):
      n += 1
    elif isinstance(sub, ast.Call):
      name = _name(sub.func)
      if (name in ('pytest.raises', 'pytest.warns')
          or name.rsplit('.', 1)[-1].startswith('assert')):
        n += 1
  return n


def run_weighted(roots: list[str]) -> None:
  """Assertions per test function times the cases it was collected as."""
  out = subprocess.run(
      [sys.executable, '-m', 'pytest', '--collect-only', '-q',
       '-p', 'no:cacheprovider', *roots],
      capture_output=True, text=True, check=False).stdout
  cases: collections.Counter = collections.Counter()
  for line in out.splitlines():
    if '::' in line and not line.startswith(' '):
      path, _, rest = line.partition('::')
      cases[(path, rest.split('[')[0].split('::')[-1])] += 1
  total_cases = total_checks = 0
  for (path, func), n in cases.items():
    if not path.endswith('.py') or not pathlib.Path(path).exists():
      continue
    tree = ast.parse(pathlib.Path(path).read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef) and node.name == func:
        total_checks += n * _checks(node)
        total_cases += n
        break
  print(f'collected test cases of tests/: {total_cases}, assertions they run '
        f'(own statements x parametrizations): {total_checks}')


def main(argv: list[str]) -> None:
  verbose = '-v' in argv
  weighted = '--run' in argv
  roots = [a for a in argv if a not in ('-v', '--run')] or ['tests']
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
  if weighted:
    run_weighted(roots)


if __name__ == '__main__':
  main(sys.argv[1:])
