"""docs/migrating_to_collections.md: its code runs, its tables name real API."""

import pathlib
import re
import warnings

import pytest

import lazy_optax

pytest.importorskip('flax')   # the keras-rs section trains a Flax layer

GUIDE = (pathlib.Path(__file__).resolve().parent.parent / 'docs' /
         'migrating_to_collections.md')

# The peers' names each section promises to map.
TORCHREC = ['EmbeddingBagConfig', 'EmbeddingBagCollection', 'PoolingType',
            'EmbeddingConfig', 'KeyedJaggedTensor', 'is_weighted',
            'weight_init_max', 'data_type', 'fused_params',
            'apply_optimizer_in_backward', 'EXACT_ROWWISE_ADAGRAD',
            'state_dict']
KERAS_RS = ['TableConfig', 'FeatureConfig', 'combiner', 'sqrtn',
            'table_stacking', 'auto_stack_tables', 'AdamOptimizerSpec',
            'AdagradOptimizerSpec', 'max_ids_per_partition',
            'DistributedEmbedding', 'tpu_sparse_dense_matmul_grad']


def _section(title):
  text = GUIDE.read_text()
  start = text.index(f'## {title}')
  end = text.find('\n## ', start + 1)
  return text[start:end if end >= 0 else None]


def _table_rows(section):
  return [line for line in section.splitlines()
          if line.startswith('| ') and not line.startswith('| ---')][1:]


def test_every_python_block_runs_in_order():
  blocks = re.findall(r'```python\n(.*?)```', GUIDE.read_text(), re.S)
  assert len(blocks) == 6
  namespace = {}
  with warnings.catch_warnings():
    # Every step is donated: no lazy_optax warning, no unusable donation.
    warnings.filterwarnings('error', message='lazy_optax')
    warnings.filterwarnings('error', message='Some donated buffers')
    for i, code in enumerate(blocks):
      try:
        exec(compile(code, f'{GUIDE.name}[block {i}]', 'exec'), namespace)
      except Exception as e:
        raise AssertionError(f'guide block {i} failed:\n{code}') from e
  assert isinstance(namespace['coll'], lazy_optax.EmbeddingCollection)
  assert isinstance(namespace['keras_coll'], lazy_optax.EmbeddingCollection)


@pytest.mark.parametrize('title, names', [('From TorchRec', TORCHREC),
                                          ('From keras-rs', KERAS_RS)])
def test_each_mapping_table_maps_the_peer_names(title, names):
  rows = _table_rows(_section(title))
  first_column = ' '.join(row.split(' | ')[0] for row in rows)
  missing = [n for n in names if n not in first_column]
  assert not missing, f'{title}: names without a row: {missing}'
  for row in rows:
    cells = [c.strip() for c in row.strip('|').split('|')]
    assert len(cells) == 2 and all(cells), row


def test_the_lazy_optax_names_in_the_tables_exist():
  text = ' '.join(_table_rows(GUIDE.read_text()))
  names = set(re.findall(r'lazy_optax\.([a-zA-Z_.]+[a-zA-Z_])', text))
  assert {'rowwise_adagrad', 'lazy_adam', 'lazy', 'ftrl',
          'precision.apply_updates_stochastic'} <= names
  import lazy_optax.flax  # noqa: F401  (the layers the page names)
  with warnings.catch_warnings():
    warnings.simplefilter('error', DeprecationWarning)
    for name in names:
      obj = lazy_optax
      for part in name.split('.'):
        assert hasattr(obj, part), f'lazy_optax.{name} does not exist'
        obj = getattr(obj, part)
  methods = set(re.findall(r'collection\.([a-z_]+)\(', text))
  assert methods == {'describe', 'lookup', 'tables', 'params_from_tables',
                     'optimizer', 'state_tables', 'state_from_tables'}
  for method in methods:
    assert callable(getattr(lazy_optax.EmbeddingCollection, method)), method
