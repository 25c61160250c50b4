"""lazy_optax: LazyAdam and lazy (row-sparse) updates for any optax
optimizer."""

from lazy_optax import compat
from lazy_optax._src.adam import lazy_adam
from lazy_optax._src.adam import lazy_adamw
from lazy_optax._src.adam import scale_by_lazy_adam
from lazy_optax._src.adam import ScaleByLazyAdamState
from lazy_optax._src.adam import ScaleByLazyAMSGradState
from lazy_optax._src.apply import apply_updates
from lazy_optax._src.checks import check_ids_in_range
from lazy_optax._src.checks import checked
from lazy_optax._src.checks import CheckError
from lazy_optax._src.checks import with_id_checks
from lazy_optax._src.ftrl import ftrl
from lazy_optax._src.ftrl import FtrlState
from lazy_optax._src.grads import value_and_grad
from lazy_optax._src.huge_pages import advise_huge_pages

# TensorFlow/Keras helpers, now in lazy_optax.compat; these top-level
# aliases remain for one release (0.2) and are not in __all__.
from lazy_optax._src.keras_clipping import clipnorm as clipnorm
from lazy_optax._src.keras_clipping import clipvalue as clipvalue
from lazy_optax._src.keras_clipping import global_clipnorm as global_clipnorm
from lazy_optax._src.labels import path_labels
from lazy_optax._src.labels import path_name
from lazy_optax._src.lazy import lazy
from lazy_optax._src.lookups import lookup
from lazy_optax._src.lookups import lookup_bag
from lazy_optax._src.multi_steps import multi_steps
from lazy_optax._src.multi_steps import MultiStepsState
from lazy_optax._src.partial_rowwise_adam import partial_rowwise_adam
from lazy_optax._src.partial_rowwise_adam import scale_by_partial_rowwise_adam
from lazy_optax._src.partial_rowwise_adam import ScaleByPartialRowwiseAdamState
from lazy_optax._src.per_pattern import per_pattern_lr as per_pattern_lr
from lazy_optax._src.row_adam import row_adam
from lazy_optax._src.row_adam import scale_by_row_adam
from lazy_optax._src.row_adam import ScaleByRowAdamState
from lazy_optax._src.rowwise_adagrad import rowwise_adagrad
from lazy_optax._src.rowwise_adagrad import scale_by_rowwise_adagrad
from lazy_optax._src.rowwise_adagrad import ScaleByRowwiseAdagradState
from lazy_optax._src.sharding import init_sharded
from lazy_optax._src.sharding import state_shardings
from lazy_optax._src.slots import get_slot as get_slot
from lazy_optax._src.slots import get_slot_names as get_slot_names
from lazy_optax._src.slots import global_step as global_step
from lazy_optax._src.sparse_rows import deduplicate
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows
from lazy_optax._src.stochastic_rounding import apply_updates_stochastic
from lazy_optax._src.stochastic_rounding import stochastic_round
from lazy_optax._src.train_step import make_train_step
from lazy_optax._src.train_step import warn_if_not_donated
from lazy_optax._src.tree_ops import tree_add
from lazy_optax._src.tree_ops import tree_pmean
from lazy_optax._src.tree_ops import tree_psum
from lazy_optax._src.tree_ops import tree_scale

# isort: split
# Hashed ids (issue 21): collision-free tables for unbounded id spaces.
from lazy_optax._src.id_export import export_changes
from lazy_optax._src.id_table import FreshRows
from lazy_optax._src.id_table import IdCounters
from lazy_optax._src.id_table import IdTable
from lazy_optax._src.id_table import IdTableState
from lazy_optax._src.id_words import split_ids
from lazy_optax._src.reset_rows import reset_rows

__version__ = '0.1.0'

__all__ = (
    'compat',
    'advise_huge_pages',
    'apply_updates',
    'apply_updates_stochastic',
    'check_ids_in_range',
    'checked',
    'CheckError',
    'deduplicate',
    'ftrl',
    'FtrlState',
    'init_sharded',
    'is_sparse_rows',
    'lazy',
    'lazy_adam',
    'lazy_adamw',
    'lookup',
    'lookup_bag',
    'make_train_step',
    'multi_steps',
    'MultiStepsState',
    'partial_rowwise_adam',
    'path_labels',
    'path_name',
    'row_adam',
    'rowwise_adagrad',
    'scale_by_lazy_adam',
    'scale_by_partial_rowwise_adam',
    'scale_by_row_adam',
    'scale_by_rowwise_adagrad',
    'ScaleByLazyAdamState',
    'ScaleByLazyAMSGradState',
    'ScaleByPartialRowwiseAdamState',
    'ScaleByRowAdamState',
    'ScaleByRowwiseAdagradState',
    'SparseRows',
    'state_shardings',
    'stochastic_round',
    'tree_add',
    'tree_pmean',
    'tree_psum',
    'tree_scale',
    'value_and_grad',
    'warn_if_not_donated',
    'with_id_checks',
    # Hashed ids (issue 21).
    'export_changes',
    'FreshRows',
    'IdCounters',
    'IdTable',
    'IdTableState',
    'reset_rows',
    'split_ids',
)
