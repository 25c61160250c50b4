"""The package is typed as optax is: few `Any`, array inputs as `ArrayLike`.

`Any` is counted where the code uses it (an `ast.Name` or `typing.Any`
attribute), not in prose; the limit is optax's own order of magnitude (about
10 per 1,000 lines). An array a public function reads is annotated
`jax.typing.ArrayLike`, as optax's are; a bare `jax.Array` parameter is kept
for PRNG keys, which must be arrays.
"""

import ast
import importlib
import inspect
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'lazy_optax'
MAX_ANY_PER_1000_LINES = 15
PUBLIC_MODULES = ('lazy_optax', 'lazy_optax.checks', 'lazy_optax.sharding',
                  'lazy_optax.perf', 'lazy_optax.tree')


def _any_uses(source: str) -> int:
  return sum(
      (isinstance(node, ast.Name) and node.id == 'Any')
      or (isinstance(node, ast.Attribute) and node.attr == 'Any')
      for node in ast.walk(ast.parse(source)))


def test_any_uses_are_counted_in_code_not_prose():
  source = ('from typing import Any\n'
            'import typing\n'
            'def f(x: Any, y: typing.Any) -> "Any":\n'
            '  """Any prose."""\n')
  assert _any_uses(source) == 2


def test_at_most_15_any_per_1000_lines():
  uses = lines = 0
  for path in sorted(PACKAGE.rglob('*.py')):
    source = path.read_text()
    uses += _any_uses(source)
    lines += source.count('\n')
  assert lines > 10_000, lines  # the whole package was read
  assert uses * 1000 <= MAX_ANY_PER_1000_LINES * lines, (
      f'{uses} uses of Any in {lines} lines: '
      f'{uses * 1000 / lines:.1f} per 1,000 (at most '
      f'{MAX_ANY_PER_1000_LINES})')


def _public_functions(module_name):
  module = importlib.import_module(module_name)
  for name in getattr(module, '__all__', ()):
    obj = getattr(module, name)
    if inspect.isfunction(obj):
      yield f'{module_name}.{name}', obj
    elif inspect.isclass(obj):
      for attr, value in vars(obj).items():
        if inspect.isfunction(value) and (
            not attr.startswith('_') or attr in ('__init__', '__call__')):
          yield f'{module_name}.{name}.{attr}', value


@pytest.mark.parametrize('module_name', PUBLIC_MODULES)
def test_array_inputs_are_array_like(module_name):
  functions = list(_public_functions(module_name))
  assert functions, f'{module_name}: no public function found in __all__'
  bare = [f'{where}({param.name})'
          for where, fn in functions
          for param in inspect.signature(fn).parameters.values()
          if param.annotation in ('jax.Array', 'jnp.ndarray', 'Array')
          and param.name != 'key']
  assert not bare, f'annotate these with jax.typing.ArrayLike: {bare}'
