"""What `lazy(...)` hands the transformation it wraps, beside the row blocks.

`lazy(tx)` runs `tx.update` on the touched rows. Two things ride with the
call, as one of optax's extra arguments under `ROWS_KEY`, in a `Rows`
(immutable, no state kept between calls):

- `ids`: a tree like the gradients with a `TableIds` for each table's row
  blocks (None for dense leaves), for a rule that must relate its own
  row-sparse inputs to them (CowClip's counts);
- `log`: where `explain_update` collects each table's `Choice` (None
  elsewhere, and for a `lazy` nested in another: the outermost one reports).

The state tables that a rule updates in place reach it in its state, as
`fused.TableRows`, not here.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

import jax
import optax

# The keyword under which `lazy(...)` hands its `Rows` to `tx.update`
# (optax's extra arguments), and `explain_update` its log to `lazy`.
ROWS_KEY = 'lazy_optax_rows'


class Choice(NamedTuple):
  """The implementation one leaf got, and why."""
  parameter: str
  rule: str
  impl: str
  reason: str


class TableIds(NamedTuple):
  """The distinct ids of one table's row blocks (unused slots `num_rows`)."""
  ids: jax.Array
  num_rows: int


class Rows(NamedTuple):
  """What `lazy(...)` tells `tx.update` about its row blocks (see module)."""
  ids: Optional[optax.Updates] = None
  log: Optional[list[Choice]] = None


def rows_of(extra_args: Mapping[str, object]) -> Optional[Rows]:
  """The `Rows` that `lazy(...)` (or `explain_update`) passed, or None.

  Args:
    extra_args: the `**extra_args` of an `update`.

  Returns:
    The `Rows` under `ROWS_KEY`, or None.

  Example:
    >>> from lazy_optax._src import row_context
    >>> rows = row_context.Rows(log=[])
    >>> row_context.rows_of({row_context.ROWS_KEY: rows}) is rows
    True
    >>> row_context.rows_of({'counts': None}) is None
    True
  """
  rows = extra_args.get(ROWS_KEY)
  return rows if isinstance(rows, Rows) else None

