"""Equinox embedding layers whose table gradients arrive row-sparse.

A one-line swap: `eqx.nn.Embedding` -> `lazy_optax.equinox.Embedding`. Same
fields (`num_embeddings`, `embedding_size`, `weight`) and constructor, so
`eqx.tree_serialise_leaves` checkpoints load either way. Unlike
`eqx.nn.Embedding`, it also takes a whole batch of ids at once (any shape):
call it on the batch, not under `jax.vmap`, since row-sparse gradients need
the lookups at the top level of the loss.

Differentiate with `lazy_optax.equinox.filter_value_and_grad` (the
counterpart of `eqx.filter_value_and_grad`): the table's gradient is a
`lazy_optax.SparseRows` of the looked-up rows, and non-array leaves of the
model (activation functions, Python numbers) get `None`, as in Equinox. Pair
it with any optax or lazy_optax optimizer on `eqx.filter(model,
eqx.is_array)`, and apply the updates with
`lazy_optax.equinox.apply_updates` (`eqx.apply_updates` does not know
`SparseRows`).

`EmbeddingBag` pools bags of ids (`lazy_optax.lookup_bag`: PyTorch's
`nn.EmbeddingBag`). `EmbeddingCollection` holds a
`lazy_optax.EmbeddingCollection`'s stacked tables (one array a stack) and
looks up all its features at once. Every layer takes a `padding_id` (the
collection: in each `FeatureSpec`) and follows
`lazy_optax.lookup`'s rule for ids outside the table: they read zero rows and
never produce a gradient row.

Only imported on request (`import lazy_optax.equinox`), and only when
Equinox is installed: `import lazy_optax` never imports Equinox.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

try:
  import equinox as eqx
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      'lazy_optax.equinox needs Equinox: pip install equinox (or '
      "pip install 'lazy_optax[examples]').") from e
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike
import optax

from lazy_optax._src import collection as _collection
from lazy_optax._src import lookups
from lazy_optax._src.apply import apply_updates as _apply_updates
from lazy_optax._src.grads import value_and_grad
from lazy_optax._src.id_table import check_id_table
from lazy_optax._src.id_table import IdTable
from lazy_optax._src.sparse_rows import is_sparse_rows

_Model = TypeVar('_Model')


class Embedding(eqx.nn.Embedding):
  """`eqx.nn.Embedding` whose table gradient can arrive as `SparseRows`.

  Same fields and constructor as `eqx.nn.Embedding`, plus the static
  `padding_id`; called on ids of any shape (a scalar id too), it returns
  `ids.shape + (embedding_size,)`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax.equinox
    >>> emb = lazy_optax.equinox.Embedding(100, 4, key=jax.random.key(0))
    >>> loss_fn = lambda model, ids: (model(ids) ** 2).sum()
    >>> loss, grads = lazy_optax.equinox.filter_value_and_grad(loss_fn)(
    ...     emb, jnp.array([[3, 5], [7, 3]]))
    >>> grads.weight
    SparseRows(num_rows=100, ids=4, row_shape=(4,), dtype=float32)
  """

  padding_id: Optional[int] = eqx.field(static=True, default=None)

  def __init__(self, num_embeddings: Optional[int] = None,
               embedding_size: Optional[int] = None,
               weight: Optional[jax.Array] = None,
               dtype: Optional[DTypeLike] = None, *,
               padding_id: Optional[int] = None,
               key: Optional[jax.Array] = None):
    """Builds the layer, from sizes and a key or from a `weight`.

    Args:
      num_embeddings: the number of rows.
      embedding_size: the row size.
      weight: an initial table `[num_embeddings, embedding_size]` (instead of
        the sizes and key).
      dtype: the table's dtype (as in `eqx.nn.Embedding`).
      padding_id: optional id whose slots read the padding row as it is and
        never produce a gradient row (`lazy_optax.lookup`'s `padding_id`).
      key: a `jax.random` key for the initial table.
    """
    super().__init__(num_embeddings, embedding_size, weight, dtype, key=key)
    self.padding_id = padding_id

  def __call__(self, x: ArrayLike, *,
               key: Optional[jax.Array] = None) -> jax.Array:
    """Looks up one row per id.

    Args:
      x: integer ids of any shape.
      key: ignored (Equinox's layer signature).

    Returns:
      An array `x.shape + (embedding_size,)`.
    """
    del key
    return lookups.lookup_rows(self.weight, x, padding_id=self.padding_id,
                               caller='lazy_optax.equinox.Embedding')


class EmbeddingBag(Embedding):
  """Bags of ids pooled by `lazy_optax.lookup_bag`, in Equinox.

  The fields of `eqx.nn.Embedding` plus the static `mode` and `padding_id`;
  the table (`weight`) moves between the two layers.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax.equinox
    >>> bag = lazy_optax.equinox.EmbeddingBag(100, 4, mode='sum',
    ...                                       key=jax.random.key(0))
    >>> bag(jnp.array([[3, 5], [9, 0]]), lengths=jnp.array([2, 1])).shape
    (2, 4)
  """

  mode: str = eqx.field(static=True, default='mean')

  def __init__(self, num_embeddings: Optional[int] = None,
               embedding_size: Optional[int] = None,
               weight: Optional[jax.Array] = None,
               dtype: Optional[DTypeLike] = None, *, mode: str = 'mean',
               padding_id: Optional[int] = None,
               key: Optional[jax.Array] = None):
    """Builds the layer.

    Args:
      num_embeddings: the number of rows.
      embedding_size: the row size.
      weight: an initial table (instead of the sizes and key).
      dtype: the table's dtype.
      mode: `'sum'`, `'mean'` (default) or `'max'`.
      padding_id: optional id whose slots are not part of any bag.
      key: a `jax.random` key for the initial table.
    """
    super().__init__(num_embeddings, embedding_size, weight, dtype,
                     padding_id=padding_id, key=key)
    self.mode = mode

  def __call__(self, x: ArrayLike, mask: Optional[ArrayLike] = None,
               lengths: Optional[ArrayLike] = None,
               per_sample_weights: Optional[ArrayLike] = None, *,
               key: Optional[jax.Array] = None) -> jax.Array:
    """Pools the rows of each bag.

    Args:
      x: integer ids `[batch, max_len]`.
      mask: optional boolean `[batch, max_len]`, True for real slots.
      lengths: optional integer `[batch]`, the real slots' count per bag.
      per_sample_weights: optional weights `[batch, max_len]`.
      key: ignored.

    Returns:
      An array `[batch, embedding_size]`.
    """
    del key
    return lookups.bag_rows(
        self.weight, x, mask=mask, lengths=lengths, mode=self.mode,
        per_sample_weights=per_sample_weights, padding_id=self.padding_id,
        caller='lazy_optax.equinox.EmbeddingBag')


def filter_value_and_grad(
    fun: Callable[..., object],
    *,
    has_aux: bool = False,
    tables: Optional[Sequence[str]] = None,
) -> Callable[..., Any]:
  """`eqx.filter_value_and_grad` with row-sparse table gradients.

  `fun(model, *args, **kwargs)` returns the loss (and `aux` if `has_aux`).
  The gradients are taken with respect to the floating-point arrays of
  `model` (`eqx.is_inexact_array`); other leaves get `None`, as in Equinox.
  A table read only through `Embedding`/`EmbeddingBag` (or
  `lazy_optax.lookup`) gets a `SparseRows`.

  Args:
    fun: the loss function; its first argument is the model (any pytree).
    has_aux: whether `fun` returns `(loss, aux)`.
    tables: as in `lazy_optax.value_and_grad` (names such as `'embed/weight'`
      or `'weight'`).

  Returns:
    A function of `(model, *args, **kwargs)` returning `(loss, grads)` or
    `((loss, aux), grads)`, where `grads` has the structure of
    `eqx.filter(model, eqx.is_inexact_array)`.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp, optax
    >>> import lazy_optax, lazy_optax.equinox
    >>> model = lazy_optax.equinox.Embedding(100, 4, key=jax.random.key(0))
    >>> tx = lazy_optax.lazy_adam(0.1)
    >>> opt_state = tx.init(eqx.filter(model, eqx.is_array))
    >>> loss_fn = lambda model, ids: (model(ids) ** 2).sum()
    >>> loss, grads = lazy_optax.equinox.filter_value_and_grad(loss_fn)(
    ...     model, jnp.array([3, 5]))
    >>> updates, opt_state = tx.update(grads, opt_state,
    ...                                eqx.filter(model, eqx.is_array))
    >>> model = lazy_optax.equinox.apply_updates(model, updates)
  """

  def wrapped(model, *args, **kwargs):
    diff, static = eqx.partition(model, eqx.is_inexact_array)

    def loss_fn(diff, *args, **kwargs):
      return fun(eqx.combine(diff, static), *args, **kwargs)

    return value_and_grad(loss_fn, has_aux=has_aux, tables=tables)(
        diff, *args, **kwargs)

  return wrapped


def apply_updates(model: _Model, updates: optax.Updates) -> _Model:
  """`eqx.apply_updates` that also adds `SparseRows` updates (their rows).

  Leaves whose update is `None` (non-array leaves, frozen parts) are kept as
  they are; a `SparseRows` update is a scatter-add onto its rows, so under
  `eqx.filter_jit` with the model donated the table is updated in place.

  Args:
    model: the model (any pytree).
    updates: a prefix of `model`, as `tx.update` returns it for the gradients
      of `filter_value_and_grad`.

  Returns:
    The updated model.

  Example:
    >>> import jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.equinox
    >>> model = {'table': jnp.zeros((4, 2)), 'act': jnp.tanh}
    >>> updates = {'table': lazy_optax.SparseRows(jnp.array([3]),
    ...                                           jnp.ones((1, 2)), 4),
    ...            'act': None}
    >>> lazy_optax.equinox.apply_updates(model, updates)['table'][3]
    Array([1., 1.], dtype=float32)
  """

  def add(update, leaf):
    return leaf if update is None else _apply_updates(leaf, update)

  return jax.tree.map(add, updates, model,
                      is_leaf=lambda x: x is None or is_sparse_rows(x))


# -- many tables as one (lazy_optax.EmbeddingCollection) ----------------------

def _checked_stacks(collection: _collection.EmbeddingCollection,
                    stacks: Mapping[str, ArrayLike], where: str
                    ) -> dict[str, jax.Array]:
  """`stacks` as arrays, each of its stack's shape and dtype."""
  names = [s.name for s in collection.plan]
  if not isinstance(stacks, Mapping) or sorted(stacks) != sorted(names):
    got = sorted(stacks) if isinstance(stacks, Mapping) else type(stacks)
    raise ValueError(f'{where}: stacks must be {{stack name: array}} for the '
                     f'stacks {names}, got {got}.')
  for s in collection.plan:
    a = stacks[s.name]
    if jnp.shape(a) != (s.rows, s.width) or jnp.result_type(a) != s.dtype:
      raise ValueError(f'{where}: stack {s.name!r} is {jnp.result_type(a)}'
                       f'{list(jnp.shape(a))}, its plan is {s.dtype}'
                       f'[{s.rows}, {s.width}].')
  return {s.name: jnp.asarray(stacks[s.name]) for s in collection.plan}


class EmbeddingCollection(eqx.Module):
  """A `lazy_optax.EmbeddingCollection`'s tables, in Equinox.

  `stacks` holds one array a stack of the collection's plan, named by the
  stack (`[stack rows, width]`), as `collection.init(key)` gives them; the
  collection is a static field. Called on `{feature: ids}` (whole batches,
  not under `jax.vmap`), it looks up every feature given with one read a
  stack: under `filter_value_and_grad` each stack's gradient is one
  `SparseRows`. Train with `collection.optimizer(...)` on
  `eqx.filter(model, eqx.is_array)` (a leaf belongs to the stack its last
  path key names) and `apply_updates`. `tables()` gives each table by name.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.equinox
    >>> coll = lazy_optax.EmbeddingCollection(
    ...     [lazy_optax.TableSpec('user', 100, 4),
    ...      lazy_optax.TableSpec('item', 50, 4)])
    >>> model = lazy_optax.equinox.EmbeddingCollection(
    ...     coll, key=jax.random.key(0))
    >>> tx = coll.optimizer({'default': lazy_optax.lazy_adam(0.1)})
    >>> opt_state = tx.init(eqx.filter(model, eqx.is_array))
    >>> ids = {'user': jnp.array([3, 7]), 'item': jnp.array([1, 1])}
    >>> loss_fn = lambda model, ids: jnp.sum(model(ids)['user'] ** 2)
    >>> loss, grads = lazy_optax.equinox.filter_value_and_grad(loss_fn)(
    ...     model, ids)
    >>> grads.stacks['default_float32_4']
    SparseRows(num_rows=150, ids=4, row_shape=(4,), dtype=float32)
    >>> updates, opt_state = tx.update(grads, opt_state,
    ...                                eqx.filter(model, eqx.is_array))
    >>> model = lazy_optax.equinox.apply_updates(model, updates)
    >>> model.tables()['item'].shape
    (50, 4)
  """

  stacks: dict[str, jax.Array]
  collection: _collection.EmbeddingCollection = eqx.field(static=True)

  def __init__(self, collection: _collection.EmbeddingCollection, *,
               stacks: Optional[Mapping[str, ArrayLike]] = None,
               key: Optional[jax.Array] = None):
    """Builds the layer, from a key or from its stacks.

    Args:
      collection: the `lazy_optax.EmbeddingCollection`.
      stacks: the initial stacks `{stack name: array}` (instead of the key;
        `collection.params_from_tables` makes them from separate tables).
      key: a `jax.random` key for `collection.init`.
    """
    where = 'lazy_optax.equinox.EmbeddingCollection'
    _collection.check_collection(collection, where)
    if stacks is None and key is not None:
      self.stacks = collection.init(key)
    elif stacks is not None and key is None:
      self.stacks = _checked_stacks(collection, stacks, where)
    else:
      raise ValueError(f'{where}: give either key or stacks.')
    self.collection = collection

  def __call__(self, ids_by_feature: Mapping[str, ArrayLike], *,
               lengths: Optional[Mapping[str, ArrayLike]] = None,
               masks: Optional[Mapping[str, ArrayLike]] = None,
               weights: Optional[Mapping[str, ArrayLike]] = None,
               key: Optional[jax.Array] = None) -> dict[str, jax.Array]:
    """Each feature's rows (`EmbeddingCollection.lookup`).

    Args:
      ids_by_feature: `{feature name: integer ids}`, for some or all
        features.
      lengths: optional `{bag feature: [batch] lengths}`.
      masks: optional `{bag feature: boolean [batch, max_len]}`.
      weights: optional `{bag feature: [batch, max_len] weights}`.
      key: ignored (Equinox's layer signature).

    Returns:
      `{feature name: array}`: `ids.shape + (width,)` for single ids,
      `[batch, width]` for bags.
    """
    del key
    return self.collection.lookup(self.stacks, ids_by_feature,
                                  lengths=lengths, masks=masks,
                                  weights=weights)

  def tables(self) -> dict[str, jax.Array]:
    """Each table by name (`EmbeddingCollection.tables`)."""
    return self.collection.tables(self.stacks)


# -- tables of hashed ids (lazy_optax.IdTable) ---------------------------------

class HashEmbedding(Embedding):
  """Rows of a `lazy_optax.IdTable`'s slots, in Equinox.

  An `Embedding` of `table.capacity` rows (`weight`) that takes the slots of
  `table.assign` (training) or `table.find` (serving); slot `capacity` (an
  id without a row) reads zeros and never produces a gradient row. The table
  is a static field. Reset the rows of fresh slots with
  `lazy_optax.reset_rows` (table path `'weight'` for a model that is this
  layer) before the step's forward pass.

  Example:
    >>> import jax, numpy as np
    >>> import lazy_optax, lazy_optax.equinox
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> emb = lazy_optax.equinox.HashEmbedding(table_ids, 4,
    ...                                        key=jax.random.key(0))
    >>> slots, _, _ = table_ids.assign(table_ids.init(), np.array([2**40]),
    ...                                step=0)
    >>> loss, grads = lazy_optax.equinox.filter_value_and_grad(
    ...     lambda m, s: (m(s) ** 2).sum())(emb, slots)
    >>> grads.weight
    SparseRows(num_rows=100, ids=1, row_shape=(4,), dtype=float32)
  """

  table: IdTable = eqx.field(static=True, default=None)

  def __init__(self, table: IdTable, embedding_size: Optional[int] = None,
               weight: Optional[jax.Array] = None,
               dtype: Optional[DTypeLike] = None, *,
               key: Optional[jax.Array] = None):
    """Builds the layer.

    Args:
      table: the `lazy_optax.IdTable` whose slots index the rows.
      embedding_size: the row size.
      weight: an initial table `[table.capacity, embedding_size]` (instead
        of the size and key).
      dtype: the table's dtype.
      key: a `jax.random` key for the initial table.
    """
    table = check_id_table(table, 'lazy_optax.equinox.HashEmbedding')
    super().__init__(None if weight is not None else table.capacity,
                     None if weight is not None else embedding_size, weight,
                     dtype, padding_id=table.capacity, key=key)
    self.table = table


class HashEmbeddingBag(EmbeddingBag):
  """Bags of slots of a `lazy_optax.IdTable`, in Equinox (`lookup_bag`).

  Slot `capacity` (an id without a row) is left out of its bag.

  Example:
    >>> import jax, numpy as np
    >>> import lazy_optax, lazy_optax.equinox
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> bag = lazy_optax.equinox.HashEmbeddingBag(table_ids, 4, mode='sum',
    ...                                           key=jax.random.key(0))
    >>> slots, _, _ = table_ids.assign(table_ids.init(),
    ...                                np.array([[3, 5], [9, 3]]), step=0)
    >>> bag(slots).shape
    (2, 4)
  """

  table: IdTable = eqx.field(static=True, default=None)

  def __init__(self, table: IdTable, embedding_size: Optional[int] = None,
               weight: Optional[jax.Array] = None,
               dtype: Optional[DTypeLike] = None, *, mode: str = 'mean',
               key: Optional[jax.Array] = None):
    """Builds the layer.

    Args:
      table: the `lazy_optax.IdTable` whose slots index the rows.
      embedding_size: the row size.
      weight: an initial table (instead of the size and key).
      dtype: the table's dtype.
      mode: `'sum'`, `'mean'` (default) or `'max'`.
      key: a `jax.random` key for the initial table.
    """
    table = check_id_table(table, 'lazy_optax.equinox.HashEmbeddingBag')
    super().__init__(None if weight is not None else table.capacity,
                     None if weight is not None else embedding_size, weight,
                     dtype, mode=mode, padding_id=table.capacity, key=key)
    self.table = table


__all__ = ('apply_updates', 'Embedding', 'EmbeddingBag',
           'filter_value_and_grad',
           # Many tables as one.
           'EmbeddingCollection',
           # Hashed ids.
           'HashEmbedding', 'HashEmbeddingBag')
