"""What `lazy(...)` decides for each table, before it traces `tx.update`.

From the gradient (which leaves are `SparseRows`), the abstract state (the
leaves that mirror each table, `row_state`, and the rules declared in it by
type, `fused.declare`), where each table lives and `impl=`, `decide` makes
a `Plan`: each table's row moves and each declared rule's backend. The
trace that follows reads the plan and decides nothing (`lazy.py`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import jax
import optax

from lazy_optax._src import backend as _backend
from lazy_optax._src import fused
from lazy_optax._src import row_context
from lazy_optax._src.id_code import index_dtype
from lazy_optax._src.sparse_rows import SparseRows

_NO_RULE = ('no lazy_optax rule declares these state rows (tx holds no '
            'lazy_optax rule for this table): lazy(...) ran tx on the '
            'gathered rows')

_LOST = ('its state sits in a wrapper that rebuilds it (optax.apply_if_finite '
         'or MultiSteps under a lax.cond): the rule computes on the row '
         'blocks and lazy(...) writes them back')

# Wrappers whose update rebuilds the inner state under a `lax.cond`: a
# table written in place there would be copied, so their rules compute on
# the row blocks.
REBUILT = (optax.ApplyIfFiniteState, optax.MultiStepsState,
           optax.ConditionallyMaskState, optax.ConditionallyTransformState)


class RuleLeaf(NamedTuple):
  """A state leaf that a declared rule's table holds (`fused.declare`)."""
  facts: fused.RuleFacts
  field: str
  instance: int  # which declared state, in the state's leaf order
  lost: bool     # inside a wrapper of `REBUILT`


def rule_leaves(state: optax.OptState) -> list[Optional[RuleLeaf]]:
  """Per leaf of `state`, the declared rule table it belongs to, if any.

  Args:
    state: an optimizer state (arrays or shape structs).

  Returns:
    One entry per leaf of `jax.tree.leaves(state)`.

  Example:
    >>> import jax.numpy as jnp, lazy_optax
    >>> from lazy_optax._src import table_plan
    >>> state = lazy_optax.scale_by_lazy_adam().init(jnp.zeros((3, 2)))
    >>> [r and (r.facts.name, r.field) for r in table_plan.rule_leaves(state)]
    [None, ('adam', 'mu'), ('adam', 'nu')]
  """
  out: list[Optional[RuleLeaf]] = []

  def stop(node: object) -> Callable[[object], bool]:
    return lambda x: x is not node and (fused.facts_of(x) is not None
                                        or isinstance(x, REBUILT))

  def walk(node: object, lost: bool) -> None:
    for sub in jax.tree.leaves(node, is_leaf=stop(node)):
      facts = fused.facts_of(sub)
      if isinstance(sub, REBUILT):
        walk(sub, True)
      elif facts is None:
        out.append(None)
      else:
        instance = len({r.instance for r in out if r is not None})
        for field in sub._fields:
          leaf = (RuleLeaf(facts, field, instance, lost)
                  if field in facts.tables else None)
          out.extend(leaf for _ in jax.tree.leaves(getattr(sub, field)))

  walk([state], False)
  return out


class Plan(NamedTuple):
  """What `lazy` decided for one update, before tracing it."""
  moves: dict[int, _backend.Backend]    # per table position: row moves
  # per state leaf handed whole: its backend and its rule's name
  tabled: dict[int, tuple[_backend.Backend, str]]
  choices: dict[tuple[int, int], row_context.Choice]  # (position, rule)


class Table(NamedTuple):
  """One row-sparse leaf, as `decide` reads it."""
  name: str
  grad: SparseRows
  param: Optional[jax.Array]


def moves_note(move: _backend.Backend) -> str:
  """How a table's rows move, in words (for `explain_update`)."""
  return (' (rows moved by the C++ kernels on CPU)' if move.row_kernels
          else ' (rows moved by XLA)')


def _placed(pos: int, table: Table, state_leaves: Sequence[jax.Array],
            owners: Sequence[Optional[int]]) -> jax.Array:
  """The array whose placement decides the table at `pos`."""
  if table.param is not None:
    return table.param
  for leaf, owner in zip(state_leaves, owners):
    if owner == pos:
      return leaf
  return table.grad.values


def _decide_rule(array: jax.Array, table: Table, impl: str,
                 held: dict[str, jax.Array], rule: RuleLeaf
                 ) -> _backend.Backend:
  """The backend of one declared rule's tables of one parameter."""
  if rule.lost:
    return _backend.Backend('generic', _LOST, False,
                            _backend.placement(array))
  why = fused.refusal(rule.facts, held, table.grad.dtype,
                      index_dtype(table.grad.num_rows))
  return _backend.decide(array, impl, refusal=why, subject=rule.facts.name,
                         name=table.name)


def _groups(pos: int, owners: Sequence[Optional[int]],
            rules: Sequence[Optional[RuleLeaf]]) -> dict[int, list[int]]:
  """The state leaves of each declared rule that mirror the table at `pos`."""
  groups: dict[int, list[int]] = {}
  for i, (owner, rule) in enumerate(zip(owners, rules)):
    if owner == pos and rule is not None:
      groups.setdefault(rule.instance, []).append(i)
  return groups


def decide(tables: dict[int, Table], state: optax.OptState,
           owners: Sequence[Optional[int]], impl: str) -> Plan:
  """Every table's row moves and every declared rule's backend.

  Args:
    tables: the row-sparse leaves, by position in the gradient tree.
    state: the optimizer state.
    owners: per state leaf, the position of the table it mirrors.
    impl: `lazy(..., impl=)`.

  Returns:
    The `Plan`.
  """
  state_leaves = jax.tree.leaves(state)
  rules = rule_leaves(state)
  plan = Plan({}, {}, {})
  for pos, table in tables.items():
    array = _placed(pos, table, state_leaves, owners)
    kernels = (impl not in ('xla', 'generic')
               and _backend.row_kernels_allowed(_backend.placement(array)))
    move = plan.moves[pos] = _backend.Backend(
        'generic', 'lazy(...) moves the rows', kernels,
        _backend.placement(array))
    groups = _groups(pos, owners, rules)
    for instance, held in groups.items():
      rule = rules[held[0]]
      assert rule is not None
      fields = {}
      for i in held:
        leaf = rules[i]
        assert leaf is not None
        fields[leaf.field] = state_leaves[i]
      decided = _decide_rule(array, table, impl, fields,
                             rule)._replace(row_kernels=kernels)
      plan.choices[pos, instance] = row_context.Choice(
          table.name, rule.facts.name, decided.kind,
          decided.reason + moves_note(move))
      if not rule.lost:
        plan.tabled.update((i, (decided, rule.facts.name)) for i in held)
    if not groups:
      plan.choices[pos, -1] = row_context.Choice(
          table.name, 'tx', 'generic',
          (_NO_RULE if pos in owners else 'no state rows: only the update '
           'rows') + moves_note(move))
  return plan


def report(plan: Plan, new_row_state: optax.OptState,
           log: list[row_context.Choice]) -> None:
  """Adds each table's choice to `explain_update`'s log: as decided, or as
  the rule ran it (a rule's own `impl=`, or a nested `lazy`'s, narrows the
  decision for its tables; the row moves stay this `lazy`'s)."""
  ran = {(t.name, t.rule): t.backend for t in jax.tree.leaves(
      new_row_state, is_leaf=fused.is_table_rows)
         if isinstance(t, fused.TableRows)}
  for (pos, _), choice in plan.choices.items():
    backend = ran.get((choice.parameter, choice.rule))
    if backend is not None and backend.kind != choice.impl:
      choice = choice._replace(
          impl=backend.kind,
          reason=backend.reason + moves_note(plan.moves[pos]))
    log.append(choice)
