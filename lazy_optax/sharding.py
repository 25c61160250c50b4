"""Optimizer state for tables whose rows are split across devices.

A train step with row-sharded tables is the ordinary step under `jax.jit`;
what it needs is the state's shardings, so that every state leaf that
mirrors a table (`mu`, `nu`, accumulators, per-row counters) keeps its rows
on the devices that hold the table's rows. `state_shardings` derives them
from the parameters, and `init_sharded` builds the state directly in them.
See docs/scaling.md.
"""

from lazy_optax._src.sharding import init_sharded
from lazy_optax._src.sharding import state_shardings

__all__ = (
    'state_shardings',
    'init_sharded',
)
