"""lazy_optax: LazyAdam and lazy (row-sparse) updates for any optax
optimizer.

The top level holds the core (`SparseRows`, `lazy`, `apply_updates`,
`lookup`, `lookup_bag`, `value_and_grad`), `EmbeddingCollection` (many
tables stacked by kind, with its `TableSpec`s and `FeatureSpec`s), the
optimizers with their `scale_by_*` transformations and states,
`kernel_status` and `explain_update` (which row-update implementation runs,
and why), and the hashed id tables (`IdTable`, `reset_rows`, `split_ids`).
The rest lives in submodules, one concept each: `lazy_optax.tree`
(gradient-tree arithmetic, paths and labels), `lazy_optax.checks` (the
checked mode), `lazy_optax.sharding` (row-sharded optimizer state),
`lazy_optax.perf` (donated train steps, huge pages), `lazy_optax.precision`
(stochastic rounding), `lazy_optax.wrappers` (`multi_steps`) and
`lazy_optax.compat` (TensorFlow/Keras helpers). The framework layers are
imported on request: `lazy_optax.flax`, `lazy_optax.haiku`,
`lazy_optax.equinox`.
"""

import operator as _operator
import sys as _sys

from lazy_optax import checks as checks
from lazy_optax import compat as compat
from lazy_optax import perf as perf
from lazy_optax import precision as precision
from lazy_optax import sharding as sharding
from lazy_optax import tree as tree
from lazy_optax import wrappers as wrappers
from lazy_optax._src import deprecations as _deprecations
from lazy_optax._src.adam import lazy_adam
from lazy_optax._src.adam import lazy_adamw
from lazy_optax._src.adam import scale_by_lazy_adam
from lazy_optax._src.adam import ScaleByLazyAdamState
from lazy_optax._src.adam import ScaleByLazyAMSGradState
from lazy_optax._src.adam_with_counter import adam_with_counter
from lazy_optax._src.adam_with_counter import scale_by_adam_with_counter
from lazy_optax._src.adam_with_counter import ScaleByAdamWithCounterState
from lazy_optax._src.apply import apply_updates
from lazy_optax._src.collection import EmbeddingCollection
from lazy_optax._src.collection_plan import FeatureSpec
from lazy_optax._src.collection_plan import TableSpec
from lazy_optax._src.cowclip import cowclip
from lazy_optax._src.cowclip import id_counts
from lazy_optax._src.cowclip_adam import lazy_adam_cowclip
from lazy_optax._src.ftrl import ftrl
from lazy_optax._src.ftrl import ScaleByFtrlState
from lazy_optax._src.grads import value_and_grad
from lazy_optax._src.impls import explain_update
from lazy_optax._src.impls import kernel_status
from lazy_optax._src.lazy import lazy
from lazy_optax._src.lookups import lookup
from lazy_optax._src.lookups import lookup_bag
from lazy_optax._src.partial_rowwise_adam import partial_rowwise_adam
from lazy_optax._src.partial_rowwise_adam import scale_by_partial_rowwise_adam
from lazy_optax._src.partial_rowwise_adam import ScaleByPartialRowwiseAdamState
from lazy_optax._src.row_max_norm import row_max_norm
from lazy_optax._src.rowwise_adagrad import rowwise_adagrad
from lazy_optax._src.rowwise_adagrad import scale_by_rowwise_adagrad
from lazy_optax._src.rowwise_adagrad import ScaleByRowwiseAdagradState
from lazy_optax._src.rowwise_adagrad_with_counter import (
    rowwise_adagrad_with_counter,
)
from lazy_optax._src.rowwise_adagrad_with_counter import (
    scale_by_rowwise_adagrad_with_counter,
)
from lazy_optax._src.rowwise_adagrad_with_counter import (
    ScaleByRowwiseAdagradWithCounterState,
)
from lazy_optax._src.rowwise_rmsprop_ar import rowwise_rmsprop_ar
from lazy_optax._src.rowwise_rmsprop_ar import ScaleByRowwiseRmspropArState
from lazy_optax._src.sparse_rows import SparseRows

# isort: split
# Hashed ids: collision-free tables for unbounded id spaces.
from lazy_optax._src.id_export import export_changes  # noqa: F401  (deprecated)
from lazy_optax._src.id_table import FreshRows
from lazy_optax._src.id_table import IdCounters
from lazy_optax._src.id_table import IdTable
from lazy_optax._src.id_table import IdTableState
from lazy_optax._src.id_words import split_ids
from lazy_optax._src.reset_rows import reset_rows

__version__ = '0.1.0'

__all__ = (
    # The core: row-sparse gradients and the lazy wrapper.
    'SparseRows',
    'lazy',
    'apply_updates',
    'lookup',
    'lookup_bag',
    'value_and_grad',
    # Many tables as one: stacked by kind, looked up and trained together.
    'EmbeddingCollection',
    'TableSpec',
    'FeatureSpec',
    # Optimizers, their scaling transformations and states.
    'lazy_adam',
    'lazy_adamw',
    'scale_by_lazy_adam',
    'ScaleByLazyAdamState',
    'ScaleByLazyAMSGradState',
    'adam_with_counter',
    'scale_by_adam_with_counter',
    'ScaleByAdamWithCounterState',
    'rowwise_adagrad',
    'scale_by_rowwise_adagrad',
    'ScaleByRowwiseAdagradState',
    'rowwise_adagrad_with_counter',
    'scale_by_rowwise_adagrad_with_counter',
    'ScaleByRowwiseAdagradWithCounterState',
    'partial_rowwise_adam',
    'scale_by_partial_rowwise_adam',
    'ScaleByPartialRowwiseAdamState',
    'ftrl',
    'ScaleByFtrlState',
    'rowwise_rmsprop_ar',
    'ScaleByRowwiseRmspropArState',
    # Row rules without state, placed in a chain inside lazy(...).
    'cowclip',
    'lazy_adam_cowclip',
    'id_counts',
    'row_max_norm',
    # Which row-update implementation runs where, and why.
    'kernel_status',
    'explain_update',
    # Hashed ids: collision-free rows for unbounded id spaces.
    'IdTable',
    'IdTableState',
    'IdCounters',
    'FreshRows',
    'reset_rows',
    'split_ids',
)

# Names that moved in 0.2. They keep working until 0.3, each use with a
# DeprecationWarning that names the new place; see CHANGELOG.md.
_MOVED = {
    old: _deprecations.Moved(f'lazy_optax.{new}', _operator.attrgetter(new)(
        _sys.modules[__name__]))
    for old, new in dict(
        tree_add='tree.add', tree_scale='tree.scale', tree_psum='tree.psum',
        tree_pmean='tree.pmean', row_adam='adam_with_counter',
        scale_by_row_adam='scale_by_adam_with_counter',
        ScaleByRowAdamState='ScaleByAdamWithCounterState',
        RowwiseAdagradWithCounterState='ScaleByRowwiseAdagradWithCounterState',
        RowwiseRmspropArState='ScaleByRowwiseRmspropArState',
        FtrlState='ScaleByFtrlState',
        # Names kept in a submodule; compat: TensorFlow/Keras helpers, 0.2.
        **{name: f'{module}.{name}' for module, names in (
            ('tree', 'is_sparse_rows deduplicate path_name path_labels'),
            ('checks', 'with_id_checks checked CheckError check_ids_in_range'),
            ('sharding', 'state_shardings init_sharded'),
            ('perf', 'make_train_step warn_if_not_donated advise_huge_pages'),
            ('precision', 'apply_updates_stochastic stochastic_round'),
            ('wrappers', 'multi_steps MultiStepsState'),
            ('compat', 'clipnorm clipvalue global_clipnorm get_slot '
             'get_slot_names global_step per_pattern_lr'),
        ) for name in names.split()}).items()
}

__getattr__ = _deprecations.moved_names_getattr(__name__, _MOVED)
