"""The checked mode: row-id problems reported under `jax.jit`.

Under `jax.jit` an out-of-range id touches no row and says nothing; an id
damaged by arithmetic on the gradient tree stops the step with
`DamagedIdsError` when it runs (`on_damaged_ids('warn')` opts out); where
ids are concrete both raise at once. `with_id_checks(tx)` checks every
gradient `tx` gets, `check_ids_in_range` checks a tree where it is called,
and `checked(step)` runs a (jitted) step with those checks and raises a
`CheckError` that carries the step's outputs. Both are a `StepError`:
from `lazy_optax.perf.make_train_step` the step wrote nothing, and the
exception's `outputs` hold the state from before it.
"""

from lazy_optax._src.checks import check_ids_in_range
from lazy_optax._src.checks import checked
from lazy_optax._src.checks import CheckError
from lazy_optax._src.checks import with_id_checks
from lazy_optax._src.damage import DamagedIdsError
from lazy_optax._src.damage import on_damaged_ids
from lazy_optax._src.damage import StepError

__all__ = (
    'with_id_checks',
    'checked',
    'CheckError',
    'check_ids_in_range',
    'DamagedIdsError',
    'on_damaged_ids',
    'StepError',
)
