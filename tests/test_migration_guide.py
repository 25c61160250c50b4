"""docs/migrating_from_tensorflow.md: its code runs, its table is complete."""

import pathlib
import re
import warnings

import lazy_optax

GUIDE = (pathlib.Path(__file__).resolve().parent.parent / 'docs' /
         'migrating_from_tensorflow.md')

# Every TensorFlow / Keras name the guide promises to map.
TF_NAMES = [
    'AdamOptimizer', 'LazyAdamOptimizer', 'LazyAdam', 'learning_rate',
    'beta1', 'beta2', 'beta_1', 'beta_2', 'epsilon', 'use_locking', 'name',
    'compute_gradients', 'apply_gradients', 'minimize', 'var_list',
    'grad_loss', 'GATE_NONE', 'GATE_OP', 'GATE_GRAPH', 'global_step',
    'iterations', 'get_slot', 'get_slot_names', 'pattern_lrs', 'clipnorm',
    'clipvalue', 'global_clipnorm', 'decay', 'amsgrad', 'IndexedSlices',
]


def _blocks():
  return re.findall(r'```python\n(.*?)```', GUIDE.read_text(), re.S)


def _table_rows():
  return [line for line in GUIDE.read_text().splitlines()
          if line.startswith('| ') and not line.startswith('| ---')]


def test_every_python_block_runs_in_order():
  blocks = _blocks()
  assert len(blocks) >= 12
  namespace = {}
  for i, code in enumerate(blocks):
    try:
      exec(compile(code, f'{GUIDE.name}[block {i}]', 'exec'), namespace)
    except Exception as e:
      raise AssertionError(f'guide block {i} failed:\n{code}') from e


def test_table_maps_every_tensorflow_name():
  first_column = ' '.join(row.split(' | ')[0] for row in _table_rows())
  missing = [n for n in TF_NAMES
             if not re.search(r'`[^`]*\b' + re.escape(n) + r'\b[^`]*`',
                              first_column)]
  assert not missing, f'names without a row in the table: {missing}'
  # Rows without an example say why the concept has no JAX equivalent.
  for row in _table_rows()[1:]:
    cells = [c.strip() for c in row.strip('|').split('|')]
    assert len(cells) == 3, row
    assert cells[1], row


def test_table_names_exist_in_lazy_optax():
  text = ' '.join(_table_rows())
  names = set(re.findall(r'lazy_optax\.([a-zA-Z_.]+[a-zA-Z_])', text))
  assert {'lazy_adam', 'compat.get_slot', 'compat.per_pattern_lr',
          'compat.clipnorm', 'adam_with_counter'} <= names
  for name in names:
    if name.split('.')[0] in ('flax', 'haiku', 'equinox'):
      continue
    obj = lazy_optax
    with warnings.catch_warnings():
      # A moved name still resolves, with a DeprecationWarning: the guide
      # must name the new place.
      warnings.simplefilter('error', DeprecationWarning)
      for part in name.split('.'):
        assert hasattr(obj, part), f'lazy_optax.{name} does not exist'
        obj = getattr(obj, part)
