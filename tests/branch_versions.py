"""Tracing one version of every `branching.per_platform` site, for tests.

The library lowers the skipping version for the CPU and the branch-free one
elsewhere; a test on the CPU patches `per_platform` to trace the version it
names, on every platform, and compares the two.
"""

from unittest import mock

from lazy_optax._src import branching


def forced(branch_free: bool):
  """A context in which `per_platform` traces `branch_free`'s version (only
  functions traced inside it see it: a jitted function keeps its trace)."""
  def pick(skipping, free, *args):
    return (free if branch_free else skipping)(*args)
  return mock.patch.object(branching, 'per_platform', pick)
