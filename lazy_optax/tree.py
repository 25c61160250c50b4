"""Gradient trees that hold `SparseRows`: arithmetic, paths and labels.

A `SparseRows` is a pytree, so `jax.tree.map(jnp.add, g1, g2)` or
`lax.psum(grads, axis)` would reach its row ids. The functions here do what
those meant, for trees where a table's leaf may be a `SparseRows`: `add`,
`scale`, `psum` and `pmean` (the row-sparse counterparts of `optax.tree.add`,
`optax.tree.scale`, `lax.psum` and `lax.pmean`), `is_sparse_rows` (the
`is_leaf` of a tree map), `deduplicate` (one slot per distinct id), and the
parameter path names (`path_name`) and labels (`path_labels`, for
`optax.partition`) that the rest of the API takes.
"""

from lazy_optax._src.distinct import deduplicate
from lazy_optax._src.labels import path_labels
from lazy_optax._src.paths import path_name
from lazy_optax._src.sparse_rows import is_sparse_rows
from lazy_optax._src.tree_ops import add
from lazy_optax._src.tree_ops import pmean
from lazy_optax._src.tree_ops import psum
from lazy_optax._src.tree_ops import scale

__all__ = (
    'add',
    'scale',
    'psum',
    'pmean',
    'is_sparse_rows',
    'deduplicate',
    'path_name',
    'path_labels',
)
