"""Optimizer wrappers for row-sparse gradients.

Transformations that wrap another one, as optax's wrappers do, where the
optax original cannot take `SparseRows`: `multi_steps` accumulates k steps
of gradients in O(k x batch) memory and then updates once, the row-sparse
counterpart of `optax.MultiSteps`.
"""

from lazy_optax._src.multi_steps import multi_steps
from lazy_optax._src.multi_steps import MultiStepsState

__all__ = (
    'multi_steps',
    'MultiStepsState',
)
