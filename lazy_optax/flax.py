"""Flax embedding layers whose table gradients arrive row-sparse.

A one-line swap: `flax.linen.Embed` -> `lazy_optax.flax.Embed` and
`flax.nnx.Embed` -> `lazy_optax.flax.NnxEmbed`. The layers have the same
constructor arguments, parameter names (`embedding`), shapes, outputs and
`attend`, so checkpoints load either way. Differentiate the loss with
`lazy_optax.value_and_grad` (linen, Flax's `TrainState`) or
`lazy_optax.flax.nnx_value_and_grad` (nnx) and the table's gradient is a
`lazy_optax.SparseRows` of the looked-up rows; `jax.grad` and `nnx.grad` keep
giving the ordinary dense gradient. A table that the model also uses through
`attend` (tied input and output embeddings) gets a dense gradient holding both
parts, since its `[batch, num_embeddings]` logits touch every row anyway.

`EmbedBag` and `NnxEmbedBag` pool bags of ids (`lazy_optax.lookup_bag`:
PyTorch's `nn.EmbeddingBag`). `EmbedCollection` and `NnxEmbedCollection`
hold a `lazy_optax.EmbeddingCollection`'s stacked tables (one parameter a
stack) and look up all its features at once. Every layer takes a
`padding_id` (the collections: in each `FeatureSpec`), and follows
`lazy_optax.lookup`'s rule for ids outside the table: they read zero rows and
never produce a gradient row (`nn.Embed` reads NaN rows for them).

Only imported on request (`import lazy_optax.flax`), and only when Flax is
installed: `import lazy_optax` never imports Flax.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

try:
  from flax import nnx
  import flax.linen as nn
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      'lazy_optax.flax needs Flax: pip install flax (or '
      "pip install 'lazy_optax[examples]').") from e
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from lazy_optax._src import collection_layer
from lazy_optax._src import lookups
from lazy_optax._src.collection import check_collection
from lazy_optax._src.collection import EmbeddingCollection
from lazy_optax._src.collection_plan import default_initializer
from lazy_optax._src.grads import value_and_grad
from lazy_optax._src.id_table import check_id_table
from lazy_optax._src.id_table import FreshRows
from lazy_optax._src.id_table import IdTable
from lazy_optax._src.reset_rows import reset_rows


def _linen_path(module: nn.Module) -> Optional[str]:
  path = getattr(module.scope, 'path', None)
  return '/'.join(tuple(path) + ('embedding',)) if path is not None else None


class Embed(nn.Embed):
  """`flax.linen.Embed` whose table gradient can arrive as `SparseRows`.

  Same attributes, parameter (`embedding`, `[num_embeddings, features]`),
  outputs and `attend` as `flax.linen.Embed`, plus `padding_id`. Under
  `lazy_optax.value_and_grad` the lookups give the table a row-sparse
  gradient; under `jax.grad` the gradient is dense, as with `nn.Embed`.
  The rows are cast to `dtype` (when given) after the gather; a custom
  `promote_dtype` is used by `attend` only.

  Attributes:
    padding_id: optional id whose slots read the padding row as it is and
      never produce a gradient row (`lazy_optax.lookup`'s `padding_id`).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax.training import train_state
    >>> import lazy_optax, lazy_optax.flax
    >>> model = lazy_optax.flax.Embed(num_embeddings=100, features=4)
    >>> ids = jnp.array([[3, 5]])
    >>> state = train_state.TrainState.create(
    ...     apply_fn=model.apply,
    ...     params=model.init(jax.random.key(0), ids)['params'],
    ...     tx=lazy_optax.lazy_adam(0.1))
    >>> def loss_fn(params):
    ...   return jnp.sum(state.apply_fn({'params': params}, ids) ** 2)
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(state.params)
    >>> grads['embedding']
    SparseRows(num_rows=100, ids=2, row_shape=(4,), dtype=float32)
    >>> state = state.apply_gradients(grads=grads)
  """

  padding_id: Optional[int] = None

  def __call__(self, inputs: ArrayLike) -> jax.Array:
    """Embeds the inputs along a new last dimension.

    Args:
      inputs: integer ids of any shape.

    Returns:
      An array of shape `inputs.shape + (features,)`.
    """
    return lookups.lookup_rows(
        self.embedding, inputs, dtype=self.dtype, padding_id=self.padding_id,
        path=_linen_path(self), caller='lazy_optax.flax.Embed')


class EmbedBag(nn.Embed):
  """Bags of ids pooled by `lazy_optax.lookup_bag`, in Flax linen.

  The parameter is `nn.Embed`'s (`embedding`, `[num_embeddings, features]`,
  `attend` too), so a table trained here loads into `nn.Embed` and back.

  Attributes:
    mode: `'sum'`, `'mean'` (default) or `'max'`.
    padding_id: optional id whose slots are not part of any bag.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.flax
    >>> model = lazy_optax.flax.EmbedBag(100, 4, mode='sum', padding_id=0)
    >>> ids = jnp.array([[3, 5, 0], [7, 0, 0]])
    >>> params = model.init(jax.random.key(0), ids)['params']
    >>> def loss_fn(params):
    ...   return jnp.sum(model.apply({'params': params}, ids) ** 2)
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    >>> g = grads['embedding']
    >>> (g.ids < 100).sum()   # the 3 real ids; padding slots name no row
    Array(3, dtype=int32)
  """

  mode: str = 'mean'
  padding_id: Optional[int] = None

  def __call__(self, inputs: ArrayLike, mask: Optional[ArrayLike] = None,
               lengths: Optional[ArrayLike] = None,
               per_sample_weights: Optional[ArrayLike] = None) -> jax.Array:
    """Pools the rows of each bag.

    Args:
      inputs: integer ids `[batch, max_len]`.
      mask: optional boolean `[batch, max_len]`, True for real slots.
      lengths: optional integer `[batch]`, the real slots' count per bag.
      per_sample_weights: optional weights `[batch, max_len]`.

    Returns:
      An array `[batch, features]`.
    """
    return lookups.bag_rows(
        self.embedding, inputs, mask=mask, lengths=lengths, mode=self.mode,
        per_sample_weights=per_sample_weights, padding_id=self.padding_id,
        dtype=self.dtype, path=_linen_path(self),
        caller='lazy_optax.flax.EmbedBag')


class NnxEmbed(nnx.Embed):
  """`flax.nnx.Embed` whose table gradient can arrive as `SparseRows`.

  Same constructor, parameter (`embedding`), outputs and `attend` as
  `flax.nnx.Embed`, plus the keyword `padding_id` (`lazy_optax.lookup`'s).
  Differentiate with `nnx_value_and_grad` to get the table's gradient as a
  `SparseRows`; `nnx.grad` gives the dense one.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> model = lazy_optax.flax.NnxEmbed(100, 4, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, lazy_optax.lazy_adam(0.1),
    ...                           wrt=nnx.Param)
    >>> def loss_fn(model):
    ...   return jnp.sum(model(jnp.array([3, 5])) ** 2)
    >>> loss, grads = lazy_optax.flax.nnx_value_and_grad(loss_fn)(model)
    >>> grads['embedding'].get_value()
    SparseRows(num_rows=100, ids=2, row_shape=(4,), dtype=float32)
    >>> _ = optimizer.update(model, grads)
  """

  def __init__(self, num_embeddings: int, features: int, *,
               padding_id: Optional[int] = None, **kwargs: Any):
    """Builds the layer.

    Args:
      num_embeddings: the number of rows.
      features: the row size.
      padding_id: optional id whose slots read the padding row as it is and
        never produce a gradient row.
      **kwargs: `flax.nnx.Embed`'s other arguments (`rngs`, `dtype`, ...).
    """
    super().__init__(num_embeddings, features, **kwargs)
    self.padding_id = padding_id

  def __call__(
      self, inputs: ArrayLike,
      out_sharding: Optional[jax.sharding.NamedSharding
                             | jax.sharding.PartitionSpec] = None,
  ) -> jax.Array:
    """Embeds the inputs along a new last dimension.

    Args:
      inputs: integer ids of any shape.
      out_sharding: as in `flax.nnx.Embed` (given, the lookup is dense).

    Returns:
      An array of shape `inputs.shape + (features,)`.
    """
    caller = 'lazy_optax.flax.NnxEmbed'
    table = self.embedding[...]
    if out_sharding is None:
      return lookups.lookup_rows(table, inputs, dtype=self.dtype,
                                 padding_id=self.padding_id, caller=caller)
    ids = lookups.check_ids(inputs, caller, self.num_embeddings)
    padding_id = self.padding_id
    lookups.check_in_range(ids, lookups.not_padding(ids, padding_id, caller),
                           self.num_embeddings, caller)
    take = jax.sharding.auto_axes(
        lambda t, i: lookups.plain_rows(
            t, i, lookups.not_padding(i, padding_id, caller), self.dtype),
        out_sharding=out_sharding)
    return take(table, ids)


class NnxEmbedBag(NnxEmbed):
  """Bags of ids pooled by `lazy_optax.lookup_bag`, in Flax nnx.

  Same parameter as `flax.nnx.Embed` (`embedding`), so tables move between
  the two. Differentiate with `nnx_value_and_grad`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> model = lazy_optax.flax.NnxEmbedBag(100, 4, mode='max',
    ...                                     rngs=nnx.Rngs(0))
    >>> ids, lengths = jnp.array([[3, 5], [9, 0]]), jnp.array([2, 1])
    >>> model(ids, lengths=lengths).shape
    (2, 4)
  """

  def __init__(self, num_embeddings: int, features: int, *,
               mode: str = 'mean', padding_id: Optional[int] = None,
               **kwargs: Any):
    """Builds the layer.

    Args:
      num_embeddings: the number of rows.
      features: the row size.
      mode: `'sum'`, `'mean'` (default) or `'max'`.
      padding_id: optional id whose slots are not part of any bag.
      **kwargs: `flax.nnx.Embed`'s other arguments (`rngs`, `dtype`, ...).
    """
    super().__init__(num_embeddings, features, padding_id=padding_id,
                     **kwargs)
    self.mode = mode

  # A bag shares `NnxEmbed`'s parameter, not its call (`out_sharding`).
  def __call__(  # type: ignore[override]
      self, inputs: ArrayLike, mask: Optional[ArrayLike] = None,
      lengths: Optional[ArrayLike] = None,
      per_sample_weights: Optional[ArrayLike] = None) -> jax.Array:
    """Pools the rows of each bag.

    Args:
      inputs: integer ids `[batch, max_len]`.
      mask: optional boolean `[batch, max_len]`, True for real slots.
      lengths: optional integer `[batch]`, the real slots' count per bag.
      per_sample_weights: optional weights `[batch, max_len]`.

    Returns:
      An array `[batch, features]`.
    """
    return lookups.bag_rows(
        self.embedding[...], inputs, mask=mask, lengths=lengths,
        mode=self.mode, per_sample_weights=per_sample_weights,
        padding_id=self.padding_id, dtype=self.dtype,
        caller='lazy_optax.flax.NnxEmbedBag')


def nnx_value_and_grad(
    fun: Callable[..., object],
    *,
    has_aux: bool = False,
    tables: Optional[Sequence[str]] = None,
    wrt: nnx.filterlib.Filter = nnx.Param,
) -> Callable[..., Any]:
  """`nnx.value_and_grad` for a model, with row-sparse table gradients.

  `fun(model, *args, **kwargs)` returns the loss (and `aux` if `has_aux`).
  The gradients are taken with respect to the model's `wrt` variables and
  returned as an `nnx.State`, ready for `nnx.Optimizer.update(model, grads)`;
  a table read only through `NnxEmbed` (or `NnxEmbedBag`) lookups holds a
  `SparseRows`. Other state that `fun` changes (RNG counters, batch
  statistics) is written back to `model`, as `nnx.value_and_grad` does.

  Args:
    fun: the loss function; its first argument is an `nnx.Module`.
    has_aux: whether `fun` returns `(loss, aux)`.
    tables: as in `lazy_optax.value_and_grad` (names such as
      `'embed/embedding'` or `'embedding'`).
    wrt: the filter of the variables to differentiate (default
      `nnx.Param`).

  Returns:
    A function of `(model, *args, **kwargs)` returning `(loss, grads)` or
    `((loss, aux), grads)`.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> model = lazy_optax.flax.NnxEmbed(10, 2, rngs=nnx.Rngs(0))
    >>> loss, grads = lazy_optax.flax.nnx_value_and_grad(
    ...     lambda m: m(jnp.array([1, 2])).sum())(model)
    >>> grads['embedding'].get_value().ids
    Array([1, 2], dtype=int32)
  """

  def wrapped(model, *args, **kwargs):
    if not isinstance(model, nnx.Module):
      raise TypeError('nnx_value_and_grad: the first argument must be an '
                      f'nnx.Module, got {type(model).__name__}.')
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def loss_fn(params, *args, **kwargs):
      inner = nnx.merge(graphdef, params, rest, copy=True)
      out = fun(inner, *args, **kwargs)
      loss, aux = out if has_aux else (out, None)
      return loss, (aux, nnx.state(inner, nnx.Not(wrt)))

    (loss, (aux, new_rest)), grads = value_and_grad(
        loss_fn, has_aux=True, tables=tables)(params, *args, **kwargs)
    nnx.update(model, new_rest)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped


# -- many tables as one (lazy_optax.EmbeddingCollection) ----------------------

class EmbedCollection(nn.Module):
  """A `lazy_optax.EmbeddingCollection`'s tables, in Flax linen.

  One parameter a stack of the collection's plan, named by the stack
  (`[stack rows, width]`); `init` gives them as `collection.init(key)` does
  for the module's `'params'` key, so each table starts as its initializer
  gives it alone. Calling the module looks up every feature given, with one
  read a stack (`collection.lookup`): under `lazy_optax.value_and_grad`
  each stack's gradient is one `SparseRows`. Train the stacks with
  `collection.optimizer(...)`, alone or inside an `optax.partition` with
  the rest of the model (a leaf belongs to the stack its last path key
  names). `tables()` gives each table by name.

  Attributes:
    collection: the `lazy_optax.EmbeddingCollection`.
    dtype: optional dtype of the returned rows.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import lazy_optax, lazy_optax.flax
    >>> coll = lazy_optax.EmbeddingCollection(
    ...     [lazy_optax.TableSpec('user', 100, 4),
    ...      lazy_optax.TableSpec('item', 50, 4)])
    >>> model = lazy_optax.flax.EmbedCollection(coll)
    >>> ids = {'user': jnp.array([3, 7]), 'item': jnp.array([1, 1])}
    >>> params = model.init(jax.random.key(0), ids)['params']
    >>> jax.tree.map(jnp.shape, params)
    {'default_float32_4': (150, 4)}
    >>> tx = coll.optimizer({'default': lazy_optax.lazy_adam(0.1)})
    >>> def loss_fn(params):
    ...   out = model.apply({'params': params}, ids)
    ...   return jnp.sum(out['user'] * out['item'])
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    >>> grads['default_float32_4']
    SparseRows(num_rows=150, ids=4, row_shape=(4,), dtype=float32)
    >>> updates, opt_state = tx.update(grads, tx.init(params), params)
    >>> params = lazy_optax.apply_updates(params, updates)
    >>> tables = model.apply({'params': params}, method='tables')
    >>> tables['item'].shape
    (50, 4)
  """

  collection: EmbeddingCollection
  dtype: Optional[DTypeLike] = None

  def setup(self):
    coll = check_collection(self.collection,
                             'lazy_optax.flax.EmbedCollection')
    # One key for all stacks: each table's rows are those of
    # `collection.init(key)`, whatever the plan.
    values = (coll.init(self.make_rng('params'))
              if self.is_initializing() else None)

    def init(key, name):
      return (values if values is not None else coll.init(key))[name]

    self.stacks = {s.name: self.param(s.name, init, s.name)
                   for s in coll.plan}

  def _lookup_stacks(self) -> tuple[dict[str, jax.Array], Optional[DTypeLike]]:
    return self.stacks, self.dtype

  __call__ = collection_layer.lookup
  tables = collection_layer.tables  # apply(..., method='tables')


class NnxEmbedCollection(nnx.Module):
  """A `lazy_optax.EmbeddingCollection`'s tables, in Flax nnx.

  `stacks` holds one `nnx.Param` a stack of the collection's plan, named by
  the stack; they start as `collection.init(rngs.params())` gives them.
  Calling the module looks up every feature given, with one read a stack;
  differentiate with `nnx_value_and_grad` to get each stack's gradient as
  one `SparseRows`, and train with `nnx.Optimizer(model,
  collection.optimizer(...), wrt=nnx.Param)`. `tables()` gives each table
  by name.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> coll = lazy_optax.EmbeddingCollection(
    ...     [lazy_optax.TableSpec('user', 100, 4),
    ...      lazy_optax.TableSpec('item', 50, 8)])
    >>> model = lazy_optax.flax.NnxEmbedCollection(coll, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, coll.optimizer({'default': lazy_optax.lazy_adam(0.1)}),
    ...     wrt=nnx.Param)
    >>> def loss_fn(model):
    ...   out = model({'user': jnp.array([3]), 'item': jnp.array([[1, 2]])})
    ...   return jnp.sum(out['user'] ** 2) + jnp.sum(out['item'] ** 2)
    >>> loss, grads = lazy_optax.flax.nnx_value_and_grad(loss_fn)(model)
    >>> grads['stacks']['default_float32_8'].get_value()
    SparseRows(num_rows=50, ids=2, row_shape=(8,), dtype=float32)
    >>> _ = optimizer.update(model, grads)
    >>> model.tables()['item'].shape
    (50, 8)
  """

  def __init__(self, collection: EmbeddingCollection, *,
               dtype: Optional[DTypeLike] = None, rngs: nnx.Rngs):
    """Builds the layer.

    Args:
      collection: the `lazy_optax.EmbeddingCollection`.
      dtype: optional dtype of the returned rows.
      rngs: its `params` stream gives the key of `collection.init`.
    """
    self.collection = check_collection(
        collection, 'lazy_optax.flax.NnxEmbedCollection')
    self.dtype = dtype
    self.stacks = nnx.Dict({name: nnx.Param(value) for name, value in
                            collection.init(rngs.params()).items()})

  def _lookup_stacks(self) -> tuple[dict[str, jax.Array], Optional[DTypeLike]]:
    return {name: p[...] for name, p in self.stacks.items()}, self.dtype

  __call__ = collection_layer.lookup
  tables = collection_layer.tables


# -- tables of hashed ids (lazy_optax.IdTable) ---------------------------------

class _HashEmbedTable(nn.Module):
  """The `[table.capacity, features]` parameter of the hashed-id layers."""

  table: IdTable
  features: int
  dtype: Optional[DTypeLike] = None
  param_dtype: DTypeLike = jnp.float32
  embedding_init: Callable[..., jax.Array] = default_initializer

  def setup(self):
    check_id_table(self.table, 'lazy_optax.flax.HashEmbed')
    self.embedding = self.param('embedding', self.embedding_init,
                                (self.table.capacity, self.features),
                                self.param_dtype)


class HashEmbed(_HashEmbedTable):
  """Rows of a `lazy_optax.IdTable`'s slots, in Flax linen.

  The parameter `embedding` is `[table.capacity, features]`; the layer takes
  the slots that `table.assign` (training) or `table.find` (serving)
  returned for raw ids, so each live id reads its own row. Slot `capacity`
  (an id without a row) reads zeros and never produces a gradient row, also
  outside jit. Under `lazy_optax.value_and_grad` the table's gradient is a
  `SparseRows` of the slots. In the train step, before the model runs:
  `slots, id_state, fresh = table.assign(...)`, then
  `lazy_optax.reset_rows(tx, params, opt_state, {'<path>/embedding': fresh},
  init=..., key=...)` (docs/hashed_ids.md).

  Attributes:
    table: the `lazy_optax.IdTable` whose slots index the rows.
    features: the row size.
    dtype: optional dtype of the returned rows.
    param_dtype: the table's dtype.
    embedding_init: the initial table (rows are reset by `reset_rows` when
      an id gets them, so this matters only before).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import lazy_optax, lazy_optax.flax
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> model = lazy_optax.flax.HashEmbed(table_ids, features=4)
    >>> slots, id_state, fresh = table_ids.assign(
    ...     table_ids.init(), np.array([[2**40, 7]]), step=0)
    >>> params = model.init(jax.random.key(0), slots)['params']
    >>> loss_fn = lambda p: jnp.sum(model.apply({'params': p}, slots) ** 2)
    >>> loss, grads = lazy_optax.value_and_grad(loss_fn)(params)
    >>> grads['embedding']
    SparseRows(num_rows=100, ids=2, row_shape=(4,), dtype=float32)
  """

  def __call__(self, slots: ArrayLike) -> jax.Array:
    """Reads the rows of the slots.

    Args:
      slots: int32 slots of any shape, in `[0, table.capacity]`.

    Returns:
      An array of shape `slots.shape + (features,)`.
    """
    return lookups.lookup_rows(
        self.embedding, slots, dtype=self.dtype,
        padding_id=self.table.capacity, path=_linen_path(self),
        caller='lazy_optax.flax.HashEmbed')


class HashEmbedBag(_HashEmbedTable):
  """Bags of slots of a `lazy_optax.IdTable`, pooled by `lookup_bag`.

  As `HashEmbed` (same attributes and parameter), with `mode` (`'sum'`,
  `'mean'`, `'max'`); slot `capacity` (an id without a row) is left out of
  its bag.

  Example:
    >>> import jax, numpy as np
    >>> import lazy_optax, lazy_optax.flax
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> model = lazy_optax.flax.HashEmbedBag(table_ids, 4, mode='sum')
    >>> slots, _, _ = table_ids.assign(
    ...     table_ids.init(), np.array([[2**40, 7], [9, 9]]), step=0)
    >>> params = model.init(jax.random.key(0), slots)['params']
    >>> model.apply({'params': params}, slots).shape
    (2, 4)
  """

  mode: str = 'mean'

  def __call__(self, slots: ArrayLike, mask: Optional[ArrayLike] = None,
               lengths: Optional[ArrayLike] = None,
               per_sample_weights: Optional[ArrayLike] = None) -> jax.Array:
    """Pools the rows of each bag of slots.

    Args:
      slots: int32 slots `[batch, max_len]`.
      mask: optional boolean `[batch, max_len]`, True for real slots.
      lengths: optional integer `[batch]`, the real slots' count per bag.
      per_sample_weights: optional weights `[batch, max_len]`.

    Returns:
      An array `[batch, features]`.
    """
    return lookups.bag_rows(
        self.embedding, slots, mask=mask, lengths=lengths, mode=self.mode,
        per_sample_weights=per_sample_weights,
        padding_id=self.table.capacity, dtype=self.dtype,
        path=_linen_path(self), caller='lazy_optax.flax.HashEmbedBag')


class NnxHashEmbed(NnxEmbed):
  """Rows of a `lazy_optax.IdTable`'s slots, in Flax nnx.

  An `NnxEmbed` of `table.capacity` rows (parameter `embedding`) that takes
  the slots of `table.assign`/`table.find`; slot `capacity` reads zeros and
  never produces a gradient row. Differentiate with `nnx_value_and_grad`.

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> model = lazy_optax.flax.NnxHashEmbed(table_ids, 4, rngs=nnx.Rngs(0))
    >>> slots = table_ids.find(table_ids.init(), np.array([2**40]))
    >>> model(slots)                       # not assigned yet: a zero row
    Array([[0., 0., 0., 0.]], dtype=float32)
  """

  def __init__(self, table: IdTable, features: int, **kwargs: Any):
    """Builds the layer.

    Args:
      table: the `lazy_optax.IdTable` whose slots index the rows.
      features: the row size.
      **kwargs: `flax.nnx.Embed`'s other arguments (`rngs`, `dtype`,
        `embedding_init`...).
    """
    table = check_id_table(table, 'lazy_optax.flax.NnxHashEmbed')
    super().__init__(table.capacity, features, padding_id=table.capacity,
                     **kwargs)


class NnxHashEmbedBag(NnxEmbedBag):
  """Bags of slots of a `lazy_optax.IdTable`, in Flax nnx (`lookup_bag`).

  Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> table_ids = lazy_optax.IdTable(capacity=100, probe=8)
    >>> model = lazy_optax.flax.NnxHashEmbedBag(table_ids, 4,
    ...                                         rngs=nnx.Rngs(0))
    >>> slots, _, _ = table_ids.assign(table_ids.init(),
    ...                                np.array([[3, 5], [9, 3]]), step=0)
    >>> model(slots).shape
    (2, 4)
  """

  def __init__(self, table: IdTable, features: int, *, mode: str = 'mean',
               **kwargs: Any):
    """Builds the layer.

    Args:
      table: the `lazy_optax.IdTable` whose slots index the rows.
      features: the row size.
      mode: `'sum'`, `'mean'` (default) or `'max'`.
      **kwargs: `flax.nnx.Embed`'s other arguments (`rngs`, `dtype`, ...).
    """
    table = check_id_table(table, 'lazy_optax.flax.NnxHashEmbedBag')
    super().__init__(table.capacity, features, mode=mode,
                     padding_id=table.capacity, **kwargs)

def nnx_reset_rows(model: nnx.Module, optimizer: nnx.Optimizer,
                   fresh: Mapping[str, FreshRows], *,
                   init: Optional[Callable[..., jax.Array]],
                   key: Optional[jax.Array] = None) -> None:
  """`lazy_optax.reset_rows` for an nnx model and its `nnx.Optimizer`.

  Resets, in place, the rows of the slots in `fresh` (`{'<path>':
  FreshRows}`, paths as `nnx.state(model)` names them, e.g. `'embedding'`
  or `'items/embedding'`) in the model's parameters and in every
  optimizer-state leaf that mirrors them. Works eagerly and inside
  `nnx.jit`.

  Args:
    model: the nnx model holding the tables.
    optimizer: its `nnx.Optimizer`.
    fresh: `{table path: FreshRows}` from `IdTable.assign`.
    init: as for `lazy_optax.reset_rows`.
    key: as for `lazy_optax.reset_rows`.

  Example:
    >>> import jax, numpy as np
    >>> from flax import nnx
    >>> import lazy_optax, lazy_optax.flax
    >>> table_ids = lazy_optax.IdTable(capacity=16, probe=4)
    >>> model = lazy_optax.flax.NnxHashEmbed(table_ids, 2, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, lazy_optax.lazy_adam(0.1),
    ...                           wrt=nnx.Param)
    >>> slots, id_state, fresh = table_ids.assign(table_ids.init(),
    ...                                           np.array([7]), step=0)
    >>> lazy_optax.flax.nnx_reset_rows(
    ...     model, optimizer, {'embedding': fresh},
    ...     init=jax.nn.initializers.zeros, key=jax.random.key(0))
    >>> model(slots)
    Array([[0., 0.]], dtype=float32)
  """
  def is_variable(x):
    return isinstance(x, nnx.Variable)

  def values(tree):
    return jax.tree.map(lambda v: v.get_value() if is_variable(v) else v,
                        tree, is_leaf=is_variable)

  params = values(nnx.state(model, optimizer.wrt))
  new_params, new_state = reset_rows(
      optimizer.tx, params, values(optimizer.opt_state), fresh, init=init,
      key=key)
  nnx.update(model, new_params)
  jax.tree.map(lambda v, x: v.set_value(x), optimizer.opt_state, new_state,
               is_leaf=is_variable)


__all__ = ('Embed', 'EmbedBag', 'NnxEmbed', 'NnxEmbedBag',
           'nnx_value_and_grad',
           # Many tables as one.
           'EmbedCollection', 'NnxEmbedCollection',
           # Hashed ids.
           'HashEmbed', 'HashEmbedBag', 'NnxHashEmbed', 'NnxHashEmbedBag',
           'nnx_reset_rows')
