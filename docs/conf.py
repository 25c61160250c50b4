"""Sphinx configuration of the lazy_optax documentation site.

Build it from the repository root:

    python3 -m pip install -e '.[docs]'
    python3 -m sphinx -W --keep-going -b html docs docs/_build/html

The landing page is the README, the guides are the `docs/*.md` pages (any new
one is picked up), the notebooks in `colabs/` are copied into
`docs/notebooks/` at build time and rendered with their stored outputs (no
execution), and the API reference is generated from `__all__` of
`lazy_optax` and of its optional modules (`docs/_ext/lazy_optax_docs.py`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / '_ext'))  # the local extensions, as Sphinx documents
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import lazy_optax  # noqa: E402  pylint: disable=wrong-import-position


def _copy_notebooks() -> None:
  """Copies `colabs/*.ipynb` into `docs/notebooks/` (a build-time copy)."""
  out = DOCS / 'notebooks'
  out.mkdir(exist_ok=True)
  wanted = {p.name: p for p in sorted((ROOT / 'colabs').glob('*.ipynb'))}
  for old in out.glob('*.ipynb'):
    if old.name not in wanted:
      old.unlink()
  for name, src in wanted.items():
    dst = out / name
    if not dst.exists() or dst.read_bytes() != src.read_bytes():
      shutil.copy2(src, dst)


_copy_notebooks()

project = 'lazy_optax'
author = 'lazy_optax developers'
copyright = '2026, lazy_optax developers'  # pylint: disable=redefined-builtin
release = lazy_optax.__version__
version = release

extensions = [
    'myst_nb',                 # Markdown (MyST) pages and .ipynb notebooks
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',     # Google-style docstrings (Args:, Returns:)
    'sphinx.ext.viewcode',
    'lazy_optax_docs',         # API entries from __all__, name checks
]

exclude_patterns = ['_build', '_ext', 'Thumbs.db', '.DS_Store',
                    '**.ipynb_checkpoints']
source_suffix = {'.md': 'myst-nb', '.ipynb': 'myst-nb'}
root_doc = 'index'

# MyST: anchors for headings (links such as `page.md#some-heading`), and the
# usual extensions.
myst_heading_anchors = 3
myst_enable_extensions = ['colon_fence', 'dollarmath', 'deflist']

# Notebooks are rendered with the outputs stored in them: never executed here
# (the test suite executes them).
nb_execution_mode = 'off'
nb_merge_streams = True

# Docstrings: backticks are Python names where they resolve, code otherwise.
default_role = 'py:obj'
autodoc_typehints = 'description'
autodoc_typehints_description_target = 'documented'
autodoc_member_order = 'bysource'
# Keep optax's and chex's aliases short in signatures instead of expanding
# them into long unions (the package uses `from __future__ import annotations`).
autodoc_type_aliases = {
    name: name for name in (
        'optax.ScalarOrSchedule', 'optax.Updates', 'optax.Params',
        'optax.OptState', 'optax.Schedule', 'chex.Array', 'chex.Numeric',
        'chex.ArrayTree', 'chex.PRNGKey')
}
autodoc_default_options = {'show-inheritance': False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
add_module_names = True
python_display_short_literal_types = True

html_theme = 'sphinx_book_theme'
html_title = f'lazy_optax {release}'
html_theme_options = {
    'show_toc_level': 2,
    'navigation_with_keys': False,
}
html_static_path: list[str] = []
