"""Haiku embedding layers whose table gradients arrive row-sparse.

A one-line swap: `hk.Embed` -> `lazy_optax.haiku.Embed`. Same constructor,
parameter (`embeddings`, `[vocab_size, embed_dim]`) and outputs for ids in
the table, so checkpoints load either way. Differentiate the loss with
`lazy_optax.value_and_grad` and the table's gradient is a
`lazy_optax.SparseRows` of the looked-up rows; `jax.grad` keeps giving the
ordinary dense gradient. Haiku's `opt.update(grads, opt_state)` (no params)
then `optax.apply_updates` take that gradient as it is.

`EmbedBag` pools bags of ids (`lazy_optax.lookup_bag`: PyTorch's
`nn.EmbeddingBag`). `EmbedCollection` holds a
`lazy_optax.EmbeddingCollection`'s stacked tables (one parameter a stack) and
looks up all its features at once. Every layer takes a `padding_id` (the
collection: in each `FeatureSpec`), and follows
`lazy_optax.lookup`'s rule for ids outside the table: they read zero rows and
never produce a gradient row (`hk.Embed` clamps them onto the last row).

Only imported on request (`import lazy_optax.haiku`), and only when Haiku is
installed: `import lazy_optax` never imports Haiku.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

try:
  import haiku as hk
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      'lazy_optax.haiku needs Haiku: pip install dm-haiku (or '
      "pip install 'lazy_optax[examples]').") from e
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from lazy_optax._src import collection_layer
from lazy_optax._src import lookups
from lazy_optax._src.collection import check_collection
from lazy_optax._src.collection import EmbeddingCollection
from lazy_optax._src.id_table import check_id_table
from lazy_optax._src.id_table import IdTable


class Embed(hk.Embed):
  """`hk.Embed` whose table gradient can arrive as `SparseRows`.

  With the default `lookup_style='ARRAY_INDEX'` the rows are gathered by
  `lazy_optax.lookup`, so under `lazy_optax.value_and_grad` the gradient of
  `embeddings` is row-sparse. `'ONE_HOT'` multiplies a one-hot matrix by the
  whole table, as `hk.Embed` does, and its gradient is dense (ids outside the
  table and `padding_id` follow the same rule).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.haiku
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda ids: lazy_optax.haiku.Embed(100, 4)(ids)))
    >>> ids = jnp.array([3, 5])
    >>> params = f.init(jax.random.key(0), ids)
    >>> loss_fn = lambda params: jnp.sum(f.apply(params, ids) ** 2)
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    >>> grads['embed']['embeddings']
    SparseRows(num_rows=100, ids=2, row_shape=(4,), dtype=float32)
  """

  def __init__(self, *args: Any, padding_id: Optional[int] = None,
               **kwargs: Any):
    """Builds the layer.

    Args:
      *args: `hk.Embed`'s arguments (`vocab_size`, `embed_dim`, ...).
      padding_id: optional id whose slots read the padding row as it is and
        never produce a gradient row (`lazy_optax.lookup`'s `padding_id`).
      **kwargs: `hk.Embed`'s keyword arguments (`name`, `w_init`, ...).
    """
    super().__init__(*args, **kwargs)
    self.padding_id = padding_id

  def _path(self) -> str:
    return f'{self.module_name}/embeddings'

  def __call__(
      self,
      ids: ArrayLike | Sequence[int],
      lookup_style: Optional[str | hk.EmbedLookupStyle] = None,
      precision: Optional[jax.lax.Precision] = None,
  ) -> jax.Array:
    """Looks up one embedding row per id.

    Args:
      ids: integer array of any shape.
      lookup_style: overrides the constructor's lookup style.
      precision: used by `'ONE_HOT'` only.

    Returns:
      An array of shape `ids.shape + (embed_dim,)`.
    """
    caller = 'lazy_optax.haiku.Embed'
    style = lookup_style or self.lookup_style
    if isinstance(style, str):
      style = getattr(hk.EmbedLookupStyle, style.upper())
    if style != hk.EmbedLookupStyle.ARRAY_INDEX:
      # A one-hot product: a dense gradient, but the same rule for ids.
      where = lookups.where_of(caller, self._path())
      ids = lookups.check_ids(ids, where, self.embeddings.shape[0])
      active = lookups.not_padding(ids, self.padding_id, where)
      lookups.check_in_range(ids, active, self.embeddings.shape[0], where)
      out = super().__call__(ids, lookup_style=style, precision=precision)
      if active is None:
        return out
      return jnp.where(active[..., None], out, jax.lax.stop_gradient(out))
    return lookups.lookup_rows(self.embeddings, ids,
                               padding_id=self.padding_id, path=self._path(),
                               caller=caller)


class EmbedBag(Embed):
  """Bags of ids pooled by `lazy_optax.lookup_bag`, in Haiku.

  The parameter is `hk.Embed`'s (`embeddings`, `[vocab_size, embed_dim]`).

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.haiku
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda ids, n: lazy_optax.haiku.EmbedBag(100, 4)(ids, lengths=n)))
    >>> ids, lengths = jnp.array([[3, 5], [9, 0]]), jnp.array([2, 1])
    >>> params = f.init(jax.random.key(0), ids, lengths)
    >>> f.apply(params, ids, lengths).shape
    (2, 4)
  """

  def __init__(self, *args: Any, mode: str = 'mean',
               padding_id: Optional[int] = None, **kwargs: Any):
    """Builds the layer.

    Args:
      *args: `hk.Embed`'s arguments (`vocab_size`, `embed_dim`, ...).
      mode: `'sum'`, `'mean'` (default) or `'max'`.
      padding_id: optional id whose slots are not part of any bag.
      **kwargs: `hk.Embed`'s keyword arguments (`name`, `w_init`, ...).
    """
    super().__init__(*args, padding_id=padding_id, **kwargs)
    self.mode = mode

  # A bag shares `Embed`'s parameter, not its call (`lookup_style`).
  def __call__(  # type: ignore[override]
      self, ids: ArrayLike | Sequence[int],
      mask: Optional[ArrayLike] = None,
      lengths: Optional[ArrayLike] = None,
      per_sample_weights: Optional[ArrayLike] = None) -> jax.Array:
    """Pools the rows of each bag.

    Args:
      ids: integer ids `[batch, max_len]`.
      mask: optional boolean `[batch, max_len]`, True for real slots.
      lengths: optional integer `[batch]`, the real slots' count per bag.
      per_sample_weights: optional weights `[batch, max_len]`.

    Returns:
      An array `[batch, embed_dim]`.
    """
    return lookups.bag_rows(
        self.embeddings, ids, mask=mask, lengths=lengths, mode=self.mode,
        per_sample_weights=per_sample_weights, padding_id=self.padding_id,
        path=self._path(), caller='lazy_optax.haiku.EmbedBag')


# -- many tables as one (lazy_optax.EmbeddingCollection) ----------------------

class EmbedCollection(hk.Module):
  """A `lazy_optax.EmbeddingCollection`'s tables, in Haiku.

  One parameter a stack of the collection's plan, named by the stack
  (`[stack rows, width]`); `init` gives them as `collection.init(key)` does
  for one key of the module, so each table starts as its initializer gives
  it alone. Calling the module looks up every feature given, with one read
  a stack (`collection.lookup`): under `lazy_optax.value_and_grad` each
  stack's gradient is one `SparseRows`. Train the stacks with
  `collection.optimizer(...)`, alone or inside an `optax.partition` with
  the rest of the model (a leaf belongs to the stack its last path key
  names). `tables()` gives each table by name.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.haiku
    >>> coll = lazy_optax.EmbeddingCollection(
    ...     [lazy_optax.TableSpec('user', 100, 4),
    ...      lazy_optax.TableSpec('item', 50, 4)])
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda ids: lazy_optax.haiku.EmbedCollection(coll)(ids)))
    >>> ids = {'user': jnp.array([3, 7]), 'item': jnp.array([1, 1])}
    >>> params = f.init(jax.random.key(0), ids)
    >>> jax.tree.map(jnp.shape, params)
    {'embed_collection': {'default_float32_4': (150, 4)}}
    >>> loss_fn = lambda p: jnp.sum(f.apply(p, ids)['user'] ** 2)
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    >>> grads['embed_collection']['default_float32_4']
    SparseRows(num_rows=150, ids=4, row_shape=(4,), dtype=float32)
  """

  def __init__(self, collection: EmbeddingCollection,
               name: Optional[str] = None):
    """Builds the layer.

    Args:
      collection: the `lazy_optax.EmbeddingCollection`.
      name: the module's name (default `'embed_collection'`).
    """
    super().__init__(name=name)
    self.collection = check_collection(collection,
                                       'lazy_optax.haiku.EmbedCollection')

  def _lookup_stacks(self) -> tuple[dict[str, jax.Array], None]:
    # One key for all stacks: each table's rows are those of
    # `collection.init(key)`, whatever the plan.
    values = (self.collection.init(hk.next_rng_key()) if hk.running_init()
              else {})

    def init(name: str) -> Callable[..., jax.Array]:
      return lambda shape, dtype: values[name]

    return {s.name: hk.get_parameter(s.name, (s.rows, s.width), s.dtype,
                                     init=init(s.name))
            for s in self.collection.plan}, None

  __call__ = collection_layer.lookup
  tables = collection_layer.tables


# -- tables of hashed ids (lazy_optax.IdTable) ---------------------------------

class HashEmbed(Embed):
  """Rows of a `lazy_optax.IdTable`'s slots, in Haiku.

  An `Embed` of `table.capacity` rows (parameter `embeddings`) that takes
  the slots of `table.assign` (training) or `table.find` (serving); slot
  `capacity` (an id without a row) reads zeros and never produces a gradient
  row. Reset the rows of fresh slots with `lazy_optax.reset_rows` (table
  path `'<module>/embeddings'`) before the step's forward pass.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, numpy as np
    >>> import lazy_optax, lazy_optax.haiku
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda s: lazy_optax.haiku.HashEmbed(table_ids, 4)(s)))
    >>> slots, _, _ = table_ids.assign(table_ids.init(), np.array([2**40]),
    ...                                step=0)
    >>> params = f.init(jax.random.key(0), slots)
    >>> loss, grads = lazy_optax.value_and_grad(
    ...     lambda p: jnp.sum(f.apply(p, slots) ** 2))(params)
    >>> grads['hash_embed']['embeddings']
    SparseRows(num_rows=100, ids=1, row_shape=(4,), dtype=float32)
  """

  def __init__(self, table: IdTable, embed_dim: int, **kwargs: Any):
    """Builds the layer.

    Args:
      table: the `lazy_optax.IdTable` whose slots index the rows.
      embed_dim: the row size.
      **kwargs: `hk.Embed`'s keyword arguments (`name`, `w_init`, ...).
    """
    table = check_id_table(table, 'lazy_optax.haiku.HashEmbed')
    super().__init__(table.capacity, embed_dim, padding_id=table.capacity,
                     **kwargs)


class HashEmbedBag(EmbedBag):
  """Bags of slots of a `lazy_optax.IdTable`, in Haiku (`lookup_bag`).

  Slot `capacity` (an id without a row) is left out of its bag.

  Example:
    >>> import haiku as hk, jax, numpy as np
    >>> import lazy_optax, lazy_optax.haiku
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda s: lazy_optax.haiku.HashEmbedBag(table_ids, 4)(s)))
    >>> slots, _, _ = table_ids.assign(table_ids.init(),
    ...                                np.array([[3, 5], [9, 3]]), step=0)
    >>> f.apply(f.init(jax.random.key(0), slots), slots).shape
    (2, 4)
  """

  def __init__(self, table: IdTable, embed_dim: int, *, mode: str = 'mean',
               **kwargs: Any):
    """Builds the layer.

    Args:
      table: the `lazy_optax.IdTable` whose slots index the rows.
      embed_dim: the row size.
      mode: `'sum'`, `'mean'` (default) or `'max'`.
      **kwargs: `hk.Embed`'s keyword arguments (`name`, `w_init`, ...).
    """
    table = check_id_table(table, 'lazy_optax.haiku.HashEmbedBag')
    super().__init__(table.capacity, embed_dim, mode=mode,
                     padding_id=table.capacity, **kwargs)


__all__ = ('Embed', 'EmbedBag',
           # Many tables as one.
           'EmbedCollection',
           # Hashed ids.
           'HashEmbed', 'HashEmbedBag')
