"""Low-precision tables: unbiased stochastic rounding.

Updates added to bfloat16 or float16 tables with round-to-nearest lose every
step smaller than half a unit in the last place. `apply_updates_stochastic`
adds them in float32 and rounds each entry up or down at random, unbiased,
with bits reproducible from (key, step, parameter path, row id), so the
result does not depend on the batch order or the device count;
`stochastic_round` is the rounding alone.
"""

from lazy_optax._src.stochastic_rounding import apply_updates_stochastic
from lazy_optax._src.stochastic_rounding import stochastic_round

__all__ = (
    'apply_updates_stochastic',
    'stochastic_round',
)
