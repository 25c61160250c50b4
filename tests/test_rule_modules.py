"""Rule modules stand alone, declare their kernel records as rows.cc does,
and each has a case in tests/optimizer_cases.py.

Rule modules stand alone: no rule module imports another.

A rule module is one under `lazy_optax/_src` that builds a `fused.RowRule`
or a `fused.stateless_rule`. Rules share helpers through common modules
(`numerics`, `row_ops`, `fused`, ...) and compositions of rules live outside
them (`cowclip_adam`), so each rule can be read, changed and removed alone.
The imports are read with `ast`, at any depth (a function-level import
counts too), in every form: `import a.b`, `from a import b`, `from a.b
import c` and relative imports.
"""

import ast
import collections
import importlib
import pathlib
import re

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


# -- the kernel records against rows.cc, read from the source ----------------

ROWS_CC = SRC / 'cpu_kernels' / 'rows.cc'
_FIELDS_NAMED = re.compile(r"rows\.cc's `(\w+_FIELDS)`")


def _cc_field_lists(source):
  """`{X_FIELDS: (field, ...)}` for every FIELDS X-macro that a rule's
  `LAZY_OPTAX_HYPER` declares, its int32 fields (`LAZY_OPTAX_INT`) too."""
  source = source.replace('\\\n', ' ')
  used = set(re.findall(r'LAZY_OPTAX_HYPER\((\w+)\)\s*\n', source))
  lists = {}
  for name, body in re.findall(r'#define (\w+_FIELDS)\(F\)(.*)', source):
    lists[name] = tuple(
        m.group(1) or m.group(2) for m in re.finditer(
            r'\bF\((\w+)\)|LAZY_OPTAX_INT\(F,\s*(\w+)\)', body))
  return {name: lists[name] for name in used}


def _python_records():
  """`{X_FIELDS: [record class, ...]}`: the NamedTuples of the rule modules
  whose docstring says they are rows.cc's `X_FIELDS`."""
  records = collections.defaultdict(list)
  for name in sorted(_rule_modules()):
    module = importlib.import_module(f'{PACKAGE}.{name}')
    for value in vars(module).values():
      if (isinstance(value, type) and issubclass(value, tuple)
          and hasattr(value, '_fields') and value.__module__ == module.__name__):
        for macro in _FIELDS_NAMED.findall(' '.join((value.__doc__ or '')
                                                    .split())):
          records[macro].append(value)
  return records


def test_each_kernel_record_has_the_fields_of_its_x_macro_in_order():
  # Read from the sources, so that it holds without a built library
  # (tests/test_cpu_kernel.py checks the loaded library's field names).
  cc = _cc_field_lists(ROWS_CC.read_text())
  assert len(cc) >= 6 and all(cc.values()), cc
  records = _python_records()
  assert sorted(records) == sorted(cc), (
      'every Hyper X-macro of rows.cc needs one Python record whose docstring '
      "names it (rows.cc's `X_FIELDS`)")
  for macro, classes in records.items():
    for cls in classes:
      assert cls._fields == cc[macro], (cls.__qualname__, macro)


def test_the_x_macro_reader_reads_int_fields_and_continued_lines():
  source = ('#define A_FIELDS(F) F(b1) F(one_minus_b1) \\\n'
            '  F(eps) LAZY_OPTAX_INT(F, step)\n'
            'struct R {\n  LAZY_OPTAX_HYPER(A_FIELDS)\n};\n'
            '#define UNUSED_FIELDS(F) F(x)\n')
  assert _cc_field_lists(source) == {
      'A_FIELDS': ('b1', 'one_minus_b1', 'eps', 'step')}


# -- every rule has a case in the one registry of optimizers -----------------

def test_every_rule_module_has_a_case_with_a_float64_model():
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optimizer_cases  # pylint: disable=g-import-not-at-top
  covered = {}
  for case in optimizer_cases.RULE_CASES:
    for name in case.rule_modules:
      covered.setdefault(name, case)
  missing = sorted(_rule_modules() - set(covered))
  assert not missing, (
      f'rule modules without a Case in tests/optimizer_cases.py: {missing} '
      '(add one, with its float64 model in tests/reference.py, and name the '
      'module in its rule_modules)')
  assert set(covered) <= _rule_modules(), sorted(set(covered)
                                                 - _rule_modules())
  table = np.ones((4, 3), np.float32)
  for name, case in covered.items():
    model = case.reference(table)
    assert type(model).__module__ == 'reference', (name, type(model))
    assert np.asarray(model.p).dtype == np.float64, name


def _calls(tree, attr):
  return [node for node in ast.walk(tree)
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and isinstance(node.func.value, ast.Name)
          and node.func.value.id == 'fused' and node.func.attr == attr]


def test_every_rule_with_tables_declares_its_state_type():
  # `lazy` finds a rule's tables through its state type's declaration
  # (`fused.declare`); a rule with tables and no declaration would get
  # `lazy`'s generic path without a word.
  missing = sorted(name for name in _rule_modules()
                   if _calls(_tree(name), 'RowRule')
                   and not _calls(_tree(name), 'declare'))
  assert not missing, missing
  declared = {name for name in _rule_modules() if _calls(_tree(name),
                                                         'declare')}
  assert {'adam', 'ftrl', 'rowwise_adagrad'} <= declared
