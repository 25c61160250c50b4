"""Builds (or finds) lazy_optax's CPU kernels ahead of time, and says how.

    python3 -m lazy_optax.build_kernels

Prints each row-update implementation with its status and exits with 0 when
the CPU kernels are loaded, 1 when they are not (the reason is printed).
"""

import sys

from lazy_optax._src.impls import kernel_status


def main() -> int:
  """Loads the kernels, prints `kernel_status()`; 0 if the kernels load."""
  status = kernel_status()
  for name, impl in status.items():
    state = 'available' if impl.available else 'unavailable'
    print(f'{name:11s} {state:11s} {impl.detail}')
  return 0 if status['cpu_kernel'].available else 1


if __name__ == '__main__':
  sys.exit(main())
