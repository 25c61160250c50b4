"""The call and `tables` shared by the Flax and Haiku collection layers."""

from __future__ import annotations

from typing import Mapping, Optional, Protocol

import jax
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from lazy_optax._src.collection import EmbeddingCollection


class Layer(Protocol):
  """A layer holding an `EmbeddingCollection`'s stacks."""
  collection: EmbeddingCollection

  def _lookup_stacks(
      self) -> tuple[dict[str, jax.Array], Optional[DTypeLike]]: ...


def lookup(self: Layer, ids_by_feature: Mapping[str, ArrayLike], *,
           lengths: Optional[Mapping[str, ArrayLike]] = None,
           masks: Optional[Mapping[str, ArrayLike]] = None,
           weights: Optional[Mapping[str, ArrayLike]] = None
           ) -> dict[str, jax.Array]:
  """Each feature's rows (`EmbeddingCollection.lookup`).

  Args:
    ids_by_feature: `{feature name: integer ids}`, for some or all features.
    lengths: optional `{bag feature: [batch] lengths}`.
    masks: optional `{bag feature: boolean [batch, max_len]}`.
    weights: optional `{bag feature: [batch, max_len] weights}`.

  Returns:
    `{feature name: array}`: `ids.shape + (width,)` for single ids,
    `[batch, width]` for bags.
  """
  stacks, dtype = self._lookup_stacks()  # pylint: disable=protected-access
  return self.collection.lookup(stacks, ids_by_feature, lengths=lengths,
                                masks=masks, weights=weights, dtype=dtype)


def tables(self: Layer) -> dict[str, jax.Array]:
  """Each table by name (`EmbeddingCollection.tables`)."""
  stacks, _ = self._lookup_stacks()  # pylint: disable=protected-access
  return self.collection.tables(stacks)
