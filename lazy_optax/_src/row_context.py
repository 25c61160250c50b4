"""The row context: what `lazy(...)` and the rules inside it tell each other.

`lazy(tx)` gathers the touched rows of every table (the parameter and the
state leaves that mirror it) and runs `tx.update` on those row blocks. A
rule inside `tx` (a `fused.RowRule`) can update its tables better than by
computing on the blocks, if it knows which blocks are `lazy`'s and what
`lazy` decided for their table; `lazy`, in turn, must learn what each rule
asks for, which tables a rule wrote itself and how an update adds itself to
its table. A `RowContext` carries all of it, for one `update`, with the
call (no thread-local or other hidden state):

- `lazy` makes it and registers each gathered row block with its `Block`:
  its full table, the distinct ids, the parameter's name and the backends
  that `lazy` decided for the table (`lazy.py`), or none while `lazy`
  probes. It hands the context to `tx.update` as one of optax's extra
  arguments, under `ROWS_KEY` (`update(grads, state, params,
  lazy_optax_rows=context)`); `chain`, `partition`, `masked`,
  `inject_hyperparams`, `apply_if_finite` and `conditionally_mask` forward
  it, a plain `optax.GradientTransformation` around a rule drops it.
- A rule's `update` takes it with `context_of(extra_args)` and hands it to
  `fused.apply_rule`, which finds the rule's row blocks in it by object
  identity (`RowContext.find`), and nowhere else. The rule reports back
  the tables it wrote whole (`wrote`) and, while `lazy` probes, a `Request`
  per table (its `impl=`, and why its kernel cannot take these operands);
  in the traced step, the `Choice` it ran (`record`) and, for an update
  added in one pass, its `FusedAdd` (`fuse`).
- `lazy` reads the requests to decide each table's backend, takes the
  written tables back instead of writing the rows (`written`; `lost` names
  those that did not come back, as when `optax.apply_if_finite`'s
  `lax.cond` rebuilds the state), and puts each `FusedAdd` on the
  `SparseRows` update it returns (`fused_add`), for `apply_updates`.

A `lazy` nested in another (its update runs on the outer one's row blocks)
makes its own context with the outer one as `outer`, so its rules find the
outer blocks too. `explain_update` makes the outermost context, holding a
log that every context made inside shares: each `lazy` adds its choices
there once its update is traced (`publish`), so that its probe is never
reported.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax

from lazy_optax._src.backend import Backend

# The keyword under which `lazy(...)` hands its `RowContext` to `tx.update`
# (optax's extra arguments), and `explain_update` its log to `lazy`.
ROWS_KEY = 'lazy_optax_rows'


class FusedAdd(NamedTuple):
  """How an update made by `lazy(...)` adds itself to its parameter table.

  A rule whose update is a function of the parameter rows (row max-norm,
  or a rule whose update is linear in them, `RowRule.split_params`) can be
  applied where the rows are added, reading each row once: `add` gives
  `table + update` for the table the rows were computed from, equal to the
  scatter-add of `values` (`SparseRows.with_fused_add`).
  """
  table: Any  # the parameter table the update was computed from
  # (table, safe ids, values, the table's row-move backend) -> new table
  add: Callable[[jax.Array, jax.Array, jax.Array, Optional[Backend]],
                jax.Array]


class Block(NamedTuple):
  """A row block that `lazy` gathered: where it came from, how to update it."""
  table: jax.Array  # the full state (or parameter) leaf
  ids: jax.Array    # the distinct ids, unused slots `num_rows`
  name: str         # the parameter's path name, for messages
  # The decisions `lazy` made for this table, per rule name (None while
  # `lazy` probes what the rules ask for), and the table's own (row moves).
  backends: Optional[dict[str, Backend]] = None
  table_backend: Optional[Backend] = None


class Request(NamedTuple):
  """What a rule asks for one table, reported to `lazy` while it probes."""
  rule: str
  impl: str      # the rule's `impl=`
  refusal: str   # why its kernel cannot take these operands ('' if it can)


class Choice(NamedTuple):
  """The implementation one leaf got, and why."""
  parameter: str
  rule: str
  impl: str
  reason: str


class RowContext:
  """What `lazy` tells the rules inside one `update` about its row blocks.

  `lazy` hands it to `tx.update` under `ROWS_KEY`. A `lazy` nested in
  another (its update runs on the outer one's row blocks) makes its own
  with the outer one as `outer`, so its rules find the outer blocks too.
  `log`, shared by the nested contexts, collects the choices of every
  `lazy` inside `explain_update` (which makes the outermost context).
  """

  def __init__(self, outer: Optional[RowContext] = None,
               log: Optional[list[Choice]] = None) -> None:
    self.outer = outer
    self.log: Optional[list[Choice]] = log if outer is None else outer.log
    self._blocks: dict[int, tuple[Any, Block]] = {}
    self._written: dict[int, tuple[Any, jax.Array, str]] = {}
    self._taken: set[int] = set()  # written tables `lazy` took back
    self.chosen: set[str] = set()  # parameters a rule recorded a choice for
    self.choices: list[Choice] = []
    self.requests: dict[str, list[Request]] = {}  # by parameter, probing
    self._fused: dict[int, tuple[Any, FusedAdd]] = {}

  def register(self, rows: Any, block: Block) -> None:
    self._blocks[id(rows)] = (rows, block)

  def block(self, rows: Any) -> Optional[Block]:
    entry = self._blocks.get(id(rows))
    return entry[1] if entry is not None and entry[0] is rows else None

  def find(self, rows: Any) -> Optional[tuple[RowContext, Block]]:
    """The context (this one or an outer one) that gathered `rows`, and its
    `Block`; None where no `lazy` did."""
    context: Optional[RowContext] = self
    while context is not None:
      block = context.block(rows)
      if block is not None:
        return context, block
      context = context.outer
    return None

  def record(self, choice: Choice) -> None:
    """Logs `choice` for `explain_update` (published by `lazy` once its
    update is traced, so that its probe is never reported)."""
    self.chosen.add(choice.parameter)
    self.choices.append(choice)

  def publish(self) -> None:
    """Hands the recorded choices to `explain_update`'s log, if any."""
    if self.log is not None:
      self.log.extend(self.choices)

  def wrote(self, rows: Any, table: jax.Array, name: str = '') -> None:
    """The rule wrote `table` whole; `rows` is its row block, read back."""
    self._written[id(rows)] = (rows, table, name)

  def written(self, rows: Any) -> Optional[jax.Array]:
    """The table whose row block `rows` is, if a rule wrote it (and marks
    it taken)."""
    entry = self._written.get(id(rows))
    if entry is None or entry[0] is not rows:
      return None
    self._taken.add(id(rows))
    return entry[1]

  def lost(self) -> set[str]:
    """Parameters whose written tables did not come back to `lazy`."""
    return {name for key, (_, _, name) in self._written.items()
            if key not in self._taken}

  def request(self, name: str, request: Request) -> None:
    self.requests.setdefault(name, []).append(request)

  def fuse(self, rows: Any, how: FusedAdd) -> None:
    """`rows`, a rule's update rows, can be added by `how` (one pass)."""
    self._fused[id(rows)] = (rows, how)

  def fused_add(self, rows: Any) -> Optional[FusedAdd]:
    """How the update rows `rows` add themselves, if a rule said so."""
    entry = self._fused.get(id(rows))
    return entry[1] if entry is not None and entry[0] is rows else None


def context_of(extra_args: Mapping[str, Any]) -> Optional[RowContext]:
  """The `RowContext` that `lazy(...)` passed in a rule's extra arguments.

  Args:
    extra_args: the `**extra_args` of the rule's `update`.

  Returns:
    The context under `ROWS_KEY`, or None (outside `lazy`, or a wrapper
    between `lazy` and the rule dropped the extra arguments).

  Example:
    >>> from lazy_optax._src import row_context
    >>> context = row_context.RowContext()
    >>> row_context.context_of({row_context.ROWS_KEY: context}) is context
    True
    >>> row_context.context_of({'counts': None}) is None
    True
  """
  context = extra_args.get(ROWS_KEY)
  return context if isinstance(context, RowContext) else None
