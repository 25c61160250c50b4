"""A Haiku embedding layer whose table gradient arrives row-sparse.

A one-line swap: `hk.Embed` -> `lazy_optax.haiku.Embed`. Same constructor,
parameter (`embeddings`, `[vocab_size, embed_dim]`) and outputs, so
checkpoints load either way. Differentiate the loss with
`lazy_optax.value_and_grad` and the table's gradient is a
`lazy_optax.SparseRows` of the looked-up rows; `jax.grad` keeps giving the
ordinary dense gradient. Haiku's `opt.update(grads, opt_state)` (no params)
then `optax.apply_updates` take that gradient as it is.

Only imported on request (`import lazy_optax.haiku`), and only when Haiku is
installed: `import lazy_optax` never imports Haiku.
"""

from __future__ import annotations

from typing import Any, Optional

try:
  import haiku as hk
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      'lazy_optax.haiku needs Haiku: pip install dm-haiku (or '
      "pip install 'lazy_optax[examples]').") from e
import jax.numpy as jnp

from lazy_optax._src.grads import lookup


class Embed(hk.Embed):
  """`hk.Embed` whose table gradient can arrive as `SparseRows`.

  With the default `lookup_style='ARRAY_INDEX'` the rows are gathered by
  `lazy_optax.lookup`, so under `lazy_optax.value_and_grad` the gradient of
  `embeddings` is row-sparse. `'ONE_HOT'` multiplies a one-hot matrix by the
  whole table, as `hk.Embed` does, and its gradient is dense. Ids follow
  `jnp.take`: ids past the end read NaN rows (`hk.Embed` clamps them), so
  keep ids in `[0, vocab_size)`.

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

  def __call__(
      self,
      ids: Any,
      lookup_style: Optional[Any] = None,
      precision: Optional[Any] = None,
  ) -> Any:
    """Looks up one embedding row per id.

    Args:
      ids: integer array of any shape.
      lookup_style: overrides the constructor's lookup style.
      precision: used by `'ONE_HOT'` only.

    Returns:
      An array of shape `ids.shape + (embed_dim,)`.
    """
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(
          "lazy_optax.haiku.Embed's __call__ method must take an array of "
          f'integer dtype but was called with an array of {ids.dtype}')
    style = lookup_style or self.lookup_style
    if isinstance(style, str):
      style = getattr(hk.EmbedLookupStyle, style.upper())
    if style != hk.EmbedLookupStyle.ARRAY_INDEX:
      return super().__call__(ids, lookup_style=style, precision=precision)
    return lookup(self.embeddings, ids)


__all__ = ('Embed',)
