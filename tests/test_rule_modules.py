"""Rule modules stand alone: no rule module imports another.

A rule module is one under `lazy_optax/_src` that builds a `fused.RowRule`
or a `fused.stateless_rule`. Rules share helpers through common modules
(`numerics`, `row_ops`, `fused`, ...) and compositions of rules live outside
them (`cowclip_adam`), so each rule can be read, changed and removed alone.
The imports are read with `ast`, at any depth (a function-level import
counts too), in every form: `import a.b`, `from a import b`, `from a.b
import c` and relative imports.
"""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / 'lazy_optax' / '_src'
PACKAGE = 'lazy_optax._src'
RULE_MAKERS = ('RowRule', 'stateless_rule')
# The rules as of this test's writing: the search below must find them all.
KNOWN_RULES = {
    'adam', 'adam_with_counter', 'cowclip', 'ftrl', 'partial_rowwise_adam',
    'row_max_norm', 'rowwise_adagrad', 'rowwise_adagrad_with_counter',
    'rowwise_rmsprop_ar',
}


def _tree(name):
  return ast.parse((SRC / f'{name}.py').read_text(), filename=f'{name}.py')


def _builds_a_rule(tree):
  for node in ast.walk(tree):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == 'fused'
        and node.func.attr in RULE_MAKERS):
      return True
  return False


def _rule_modules():
  return {p.stem for p in SRC.glob('*.py')
          if p.stem != 'fused' and _builds_a_rule(_tree(p.stem))}


def _imported_src_modules(tree):
  """Every `lazy_optax._src` module name an import in `tree` may bind."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith(PACKAGE + '.'):
          found.add(alias.name[len(PACKAGE) + 1:].split('.')[0])
    elif isinstance(node, ast.ImportFrom):
      module = node.module or ''
      if node.level:  # relative: a sibling module or the package itself
        base = module.split('.')[0] if module else None
      elif module == PACKAGE:
        base = None
      elif module.startswith(PACKAGE + '.'):
        base = module[len(PACKAGE) + 1:].split('.')[0]
      else:
        continue
      if base is not None:
        found.add(base)
      else:  # `from lazy_optax._src import adam`: the names are modules
        found.update(alias.name for alias in node.names)
  return found


def test_the_rule_search_finds_every_known_rule():
  assert KNOWN_RULES <= _rule_modules()


def test_no_rule_module_imports_another():
  rules = _rule_modules()
  offending = {
      name: sorted((_imported_src_modules(_tree(name)) & rules) - {name})
      for name in sorted(rules)}
  offending = {k: v for k, v in offending.items() if v}
  assert not offending, (
      f'rule modules import other rule modules: {offending}; move what they '
      'share into a common module (numerics.py, row_ops.py) and compositions '
      'of rules into a module of their own (as cowclip_adam.py)')


def test_the_import_reader_sees_every_form():
  source = '\n'.join([
      'import lazy_optax._src.ftrl',
      'from lazy_optax._src import adam as a, fused',
      'from lazy_optax._src.cowclip import row_norms',
      'from . import rowwise_adagrad',
      'from .row_max_norm import x',
      'def f():',
      '  from lazy_optax._src.partial_rowwise_adam import y',
      'import optax',
      'from numpy import ndarray',
  ])
  assert _imported_src_modules(ast.parse(source)) == {
      'ftrl', 'adam', 'fused', 'cowclip', 'rowwise_adagrad', 'row_max_norm',
      'partial_rowwise_adam'}
