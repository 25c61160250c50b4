"""Names that moved: a module `__getattr__` that still serves them, warning.

A public name that moves or is renamed keeps working for one release: the
module that held it lists it in a table of old name -> (new place, object)
and installs `moved_names_getattr(...)` as its `__getattr__`, which Python
calls only for names the module does not define. Each access warns with a
`DeprecationWarning` naming the new place, and returns the very object that
lives there.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping
import warnings

REMOVED_AFTER = '0.2'


class Moved:
  """Where an old name lives now, and the object it names."""

  __slots__ = ('new_name', 'obj')

  def __init__(self, new_name: str, obj: object):
    self.new_name = new_name
    self.obj = obj


def message(old_name: str, new_name: str) -> str:
  """The warning for a use of `old_name`, naming `new_name`.

  Args:
    old_name: the dotted name that was used (`'lazy_optax.tree_add'`).
    new_name: the dotted name to use instead (`'lazy_optax.tree.add'`).

  Returns:
    One sentence naming both and the release after which the old one goes.

  Example:
    >>> from lazy_optax._src.deprecations import message
    >>> print(message('lazy_optax.f', 'lazy_optax.sub.f'))
    lazy_optax.f is deprecated and will be removed after lazy_optax 0.2: use
    lazy_optax.sub.f.
  """
  return (f'{old_name} is deprecated and will be removed after lazy_optax '
          f'{REMOVED_AFTER}: use {new_name}.')


def moved_names_getattr(
    module_name: str, moved: Mapping[str, Moved],
) -> Callable[[str], Any]:
  """A module `__getattr__` serving `moved` names with a `DeprecationWarning`.

  Args:
    module_name: the module's `__name__`, for messages.
    moved: old name -> `Moved(new dotted name, object)`.

  Returns:
    A function to assign to the module's `__getattr__`.

  Example:
    >>> import warnings
    >>> from lazy_optax._src.deprecations import Moved, moved_names_getattr
    >>> getattr_ = moved_names_getattr('pkg', {'old': Moved('pkg.sub.new', 1)})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   value = getattr_('old')
    >>> value, caught[0].category.__name__
    (1, 'DeprecationWarning')
  """

  def __getattr__(name: str) -> Any:
    entry = moved.get(name)
    if entry is None:
      raise AttributeError(
          f'module {module_name!r} has no attribute {name!r}')
    warnings.warn(message(f'{module_name}.{name}', entry.new_name),
                  DeprecationWarning, stacklevel=2)
    return entry.obj

  return __getattr__
