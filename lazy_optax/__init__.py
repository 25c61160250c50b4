"""lazy_optax: LazyAdam and lazy (row-sparse) updates for any optax optimizer."""

from lazy_optax._src.adam import lazy_adam
from lazy_optax._src.adam import lazy_adamw
from lazy_optax._src.adam import scale_by_lazy_adam
from lazy_optax._src.adam import ScaleByLazyAdamState
from lazy_optax._src.adam import ScaleByLazyAMSGradState
from lazy_optax._src.apply import apply_updates
from lazy_optax._src.lazy import lazy
from lazy_optax._src.sparse_rows import deduplicate
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.sparse_rows import SparseRows

__version__ = '0.1.0'

__all__ = (
    'SparseRows',
    'ScaleByLazyAMSGradState',
    'ScaleByLazyAdamState',
    'apply_updates',
    'deduplicate',
    'is_sparse_rows',
    'lazy',
    'lazy_adam',
    'lazy_adamw',
    'scale_by_lazy_adam',
)
