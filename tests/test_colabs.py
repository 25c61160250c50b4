"""The notebooks in colabs/ run top to bottom (at small sizes) and carry outputs."""

import pathlib

import nbformat
import notebook_kernels
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / 'colabs').glob('*.ipynb'))


def test_there_are_five_notebooks():
  names = [p.name for p in NOTEBOOKS]
  assert len(names) == 5, names


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_notebook_carries_its_outputs(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert code and all(c.execution_count for c in code), 'not executed'
  outputs = [o for c in code for o in c.outputs]
  assert not [o for o in outputs if o.output_type == 'error']
  assert any('image/png' in o.get('data', {}) for o in outputs), 'no plot'
  assert 'LAZY_OPTAX_COLAB_SMALL' in code[0].source


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_at_small_sizes(path, monkeypatch, tmp_path_factory):
  monkeypatch.setenv('LAZY_OPTAX_COLAB_SMALL', '1')
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  # A kernel of its own: IPython's, in a fresh process forked from one that
  # imported jax and lazy_optax (tests/notebook_kernels.py).
  kernel, jupyter_path = notebook_kernels.start(
      tmp_path_factory.getbasetemp())
  monkeypatch.setenv('JUPYTER_PATH', jupyter_path)
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name=kernel,
                 resources={'metadata': {'path': str(ROOT)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == 'code' for o in c.outputs]
  assert not [o for o in outputs if o.output_type == 'error']
  text = ''.join(o.get('text', '') for o in outputs)
  assert 'Traceback' not in text
