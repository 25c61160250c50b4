"""Performance tooling: donated train steps and memory placement.

A lazy step costs O(touched rows) only when XLA updates the tables in place,
which needs the parameters and optimizer state donated: `make_train_step`
jits a step with them donated, and `warn_if_not_donated` says when a jitted
step would copy a table every call. `advise_huge_pages` asks the OS for
transparent huge pages under large CPU tables, which makes their random row
accesses cheaper. See docs/train_steps.md.
"""

from lazy_optax._src.huge_pages import advise_huge_pages
from lazy_optax._src.train_step import make_train_step
from lazy_optax._src.train_step import warn_if_not_donated

__all__ = (
    'make_train_step',
    'warn_if_not_donated',
    'advise_huge_pages',
)
