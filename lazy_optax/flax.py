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

Only imported on request (`import lazy_optax.flax`), and only when Flax is
installed: `import lazy_optax` never imports Flax.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

try:
  import flax.linen as nn
  from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      'lazy_optax.flax needs Flax: pip install flax (or '
      "pip install 'lazy_optax[examples]').") from e
import jax.numpy as jnp

from lazy_optax._src.grads import lookup
from lazy_optax._src.grads import value_and_grad


def _check_ids(inputs: Any) -> Any:
  inputs = jnp.asarray(inputs)
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError('Input type must be an integer or unsigned integer.')
  return inputs


class Embed(nn.Embed):
  """`flax.linen.Embed` whose table gradient can arrive as `SparseRows`.

  Same attributes, parameter (`embedding`, `[num_embeddings, features]`),
  outputs and `attend` as `flax.linen.Embed`. Under
  `lazy_optax.value_and_grad` the lookups give the table a row-sparse
  gradient; under `jax.grad` the gradient is dense, as with `nn.Embed`.
  The rows are cast to `dtype` (when given) after the gather; a custom
  `promote_dtype` is used by `attend` only.

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

  def __call__(self, inputs: Any) -> Any:
    """Embeds the inputs along a new last dimension.

    Args:
      inputs: integer ids of any shape.

    Returns:
      An array of shape `inputs.shape + (features,)`.
    """
    inputs = _check_ids(inputs)
    if self.num_embeddings == 1:
      return super().__call__(inputs)
    return lookup(self.embedding, inputs, dtype=self.dtype)


class NnxEmbed(nnx.Embed):
  """`flax.nnx.Embed` whose table gradient can arrive as `SparseRows`.

  Same constructor, parameter (`embedding`), outputs and `attend` as
  `flax.nnx.Embed`. Differentiate with `nnx_value_and_grad` to get the
  table's gradient as a `SparseRows`; `nnx.grad` gives the dense one.

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

  def __call__(self, inputs: Any, out_sharding: Any = None) -> Any:
    """Embeds the inputs along a new last dimension.

    Args:
      inputs: integer ids of any shape.
      out_sharding: as in `flax.nnx.Embed` (given, the lookup is dense).

    Returns:
      An array of shape `inputs.shape + (features,)`.
    """
    inputs = _check_ids(inputs)
    if self.num_embeddings == 1 or out_sharding is not None:
      return super().__call__(inputs, out_sharding=out_sharding)
    return lookup(self.embedding[...], inputs, dtype=self.dtype)


def nnx_value_and_grad(
    fun: Callable[..., Any],
    *,
    has_aux: bool = False,
    tables: Optional[Sequence[str]] = None,
    wrt: Any = nnx.Param,
) -> Callable[..., Any]:
  """`nnx.value_and_grad` for a model, with row-sparse table gradients.

  `fun(model, *args, **kwargs)` returns the loss (and `aux` if `has_aux`).
  The gradients are taken with respect to the model's `wrt` variables and
  returned as an `nnx.State`, ready for `nnx.Optimizer.update(model, grads)`;
  a table read only through `NnxEmbed` lookups holds a `SparseRows`. Other
  state that `fun` changes (RNG counters, batch statistics) is written back
  to `model`, as `nnx.value_and_grad` does.

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


__all__ = ('Embed', 'NnxEmbed', 'nnx_value_and_grad', 'value_and_grad')
