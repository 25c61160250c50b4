"""A small Sphinx extension for the lazy_optax site.

1. API entries from `__all__`. A page line of the form

       <!-- lazy_optax_api: MODULE [optional] -->

   is replaced, when the page is read, by a summary table and one section per
   name in `MODULE.__all__` (`autofunction`, `autoclass` or `autodata`), in
   the order of `__all__`. A module marked `optional` that does not exist is
   left out; one that exists but cannot be imported (its framework is not
   installed) is a warning. A public name without a docstring is a warning.
   So the reference follows the code: a renamed, added or removed name needs
   no edit here.

2. Names in code are checked. Every `lazy_optax.X.Y` in inline code and in
   Python code blocks of every page (the README, the guides, the notebooks)
   must import or resolve as an attribute without a `DeprecationWarning`, or
   the build warns (and `-W` makes that an error): a renamed function, or a
   page still using the old name of a moved one, fails the docs build.

3. Inline code that names a documented object (`lazy_optax.lazy_adam`)
   links to its API entry.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
from typing import Any, Optional
import warnings

from docutils import nodes
from sphinx.util import logging

_LOG = logging.getLogger(__name__)
_MARKER = re.compile(
    r'^<!--\s*lazy_optax_api:\s*([\w.]+)((?:\s+\w+)*)\s*-->\s*$', re.M)
_NAME = re.compile(r'(?<![\w.])(lazy_optax(?:\.[A-Za-z_]\w*)+)')
_API_PAGES: set[str] = set()
_CODE_LANGUAGES = ('python', 'python3', 'py', 'ipython', 'ipython3', 'pycon',
                   'default')


def _first_line(obj: Any) -> str:
  doc = inspect.getdoc(obj) or ''
  line = doc.strip().split('\n\n')[0].replace('\n', ' ').strip()
  return line.replace('|', '\\|')


def _is_namedtuple(obj: Any) -> bool:
  return isinstance(obj, type) and issubclass(obj, tuple) and hasattr(
      obj, '_fields')


def _entry(module: str, name: str, obj: Any) -> str:
  """The MyST text of one API entry."""
  full = f'{module}.{name}'
  # autodoc writes reStructuredText, so its directives go inside eval-rst.
  if isinstance(obj, type) and issubclass(obj, BaseException):
    rst = f'.. autoexception:: {full}\n   :members:'
  elif _is_namedtuple(obj):
    rst = f'.. autoclass:: {full}'
  elif isinstance(obj, type):
    rst = f'.. autoclass:: {full}\n   :members:'
  elif callable(obj):
    rst = f'.. autofunction:: {full}'
  else:
    rst = f'.. autodata:: {full}'
  return f'### `{name}`\n\n```{{eval-rst}}\n{rst}\n```\n'


def _api_text(module: str, flags: set[str], docname: str) -> str:
  """The MyST text that replaces one API marker."""
  optional = 'optional' in flags
  if optional:
    try:
      spec = importlib.util.find_spec(module)
    except ImportError:
      spec = None
    if spec is None:
      return ''
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    _LOG.warning('API reference: cannot import %s (%s); install the docs '
                 "extra: pip install -e '.[docs]'", module, e,
                 location=docname)
    return ''
  names = getattr(mod, '__all__', None)
  if names is None:
    _LOG.warning('API reference: %s has no __all__', module, location=docname)
    return ''
  doc = inspect.getdoc(mod) or ''
  intro = doc.strip().split('\n\n')[0]
  lines = [f'## `{module}`', '', intro, '', '| name | summary |',
           '| --- | --- |']
  entries = []
  for name in names:
    if not hasattr(mod, name):
      _LOG.warning('API reference: %s.__all__ names %r, which it does not '
                   'define', module, name, location=docname)
      continue
    obj = getattr(mod, name)
    if not (inspect.getdoc(obj) or '').strip():
      _LOG.warning('API reference: public name %s.%s has no docstring',
                   module, name, location=docname)
    lines.append(f'| {{py:obj}}`~{module}.{name}` | {_first_line(obj)} |')
    entries.append(_entry(module, name, obj))
  return '\n'.join(lines) + '\n\n' + '\n'.join(entries)


def _on_source_read(app, docname: str, source: list[str]) -> None:
  del app

  def replace(m: re.Match) -> str:
    return _api_text(m.group(1), set(m.group(2).split()), docname)

  if 'lazy_optax_api:' in source[0]:
    _API_PAGES.add(docname)
    source[0] = _MARKER.sub(replace, source[0])


def _on_env_get_outdated(app, env, added, changed, removed) -> list[str]:
  """Re-reads the API pages on every build: `__all__` may have changed."""
  del app, added, changed, removed
  return [d for d in sorted(_API_PAGES) if d in env.found_docs]


@functools.lru_cache(maxsize=None)
def _problem(name: str) -> Optional[str]:
  """What is wrong with a dotted `lazy_optax...` name, or None if nothing.

  The name must be a module or an attribute, reached without a
  `DeprecationWarning` (a moved name still resolves, with a warning that
  names its new place).
  """
  parts = name.split('.')
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module('.'.join(parts[:cut]))
    except ImportError:
      continue
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      try:
        for attr in parts[cut:]:
          obj = getattr(obj, attr)
      except AttributeError:
        return 'which does not exist in the package'
    for w in caught:
      if issubclass(w.category, DeprecationWarning):
        return f'which is deprecated ({w.message})'
    return None
  return 'which does not exist in the package'


def _is_code_block(node: nodes.Node) -> bool:
  if not isinstance(node, nodes.literal_block):
    return False
  language = node.get('language', 'default')
  return language in _CODE_LANGUAGES and 'output' not in ' '.join(
      node.parent.get('classes', []) if node.parent else [])


def _on_doctree_read(app, doctree: nodes.document) -> None:
  """Warns about `lazy_optax.X` names in code that do not resolve.

  Pages that record history (`lazy_optax_history_pages`: the changelog) may
  name deprecated names; names that do not exist are errors everywhere.
  """
  docname = app.env.docname
  history = docname in app.config.lazy_optax_history_pages
  for node in doctree.findall(
      lambda n: isinstance(n, nodes.literal) or _is_code_block(n)):
    for name in set(_NAME.findall(node.astext())):
      name = name.rstrip('.')
      problem = _problem(name)
      if problem and history and problem.startswith('which is deprecated'):
        continue
      if problem:
        _LOG.warning('%s names %r, %s', docname, name, problem,
                     location=node, type='lazy_optax', subtype='name')


def _on_doctree_resolved(app, doctree: nodes.document, docname: str) -> None:
  """Links inline code that names a documented object to its entry."""
  objects = app.env.get_domain('py').objects
  builder = app.builder
  for node in list(doctree.findall(nodes.literal)):
    if isinstance(node.parent, (nodes.reference, nodes.literal)):
      continue
    if node.get('classes') and 'xref' in node['classes']:
      continue
    m = re.fullmatch(r'(lazy_optax(?:\.\w+)+)(\(.*\))?', node.astext(), re.S)
    if not m or m.group(1) not in objects:
      continue
    entry = objects[m.group(1)]
    try:
      uri = builder.get_relative_uri(docname, entry.docname)
    except Exception:  # pylint: disable=broad-except
      continue
    ref = nodes.reference('', '', internal=True,
                          refuri=f'{uri}#{entry.node_id}',
                          reftitle=m.group(1))
    node.replace_self(ref)
    ref.append(node)


def setup(app) -> dict[str, Any]:
  """Registers the extension's event handlers."""
  app.add_config_value('lazy_optax_history_pages', ('reference/changelog',),
                       'env')
  app.connect('source-read', _on_source_read)
  app.connect('env-get-outdated', _on_env_get_outdated)
  app.connect('doctree-read', _on_doctree_read)
  app.connect('doctree-resolved', _on_doctree_resolved)
  return {'version': '1', 'parallel_read_safe': True,
          'parallel_write_safe': True}
