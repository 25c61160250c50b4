"""Builds lazy_optax; `LAZY_OPTAX_PREBUILT_KERNELS=1` makes a platform wheel.

The metadata lives in pyproject.toml. A plain build gives the pure-Python
wheel, whose CPU kernels are compiled on the machine that uses them. With
`LAZY_OPTAX_PREBUILT_KERNELS=1` (and jax installed: `python3 -m build
--wheel --no-isolation`), the kernels are compiled for this platform's
baseline instruction set into `lazy_optax/_src/cpu_kernels/prebuilt/` with
their SHA-256, and the wheel is tagged for this platform: machines without
a C++ compiler then load them (see `cpu_kernels/build.py`).
"""

import importlib.util
import os

import setuptools
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

PREBUILT = os.environ.get('LAZY_OPTAX_PREBUILT_KERNELS') == '1'
BUILD_MODULE = os.path.join('lazy_optax', '_src', 'cpu_kernels', 'build.py')


class BuildPy(build_py):
  """Also compiles the CPU kernels into the wheel, for platform wheels."""

  def run(self):
    super().run()
    if PREBUILT:
      # build.py by its path: importing the package would need jax's import
      # here (the build itself needs only jax.ffi.include_dir()).
      spec = importlib.util.spec_from_file_location('kernel_build',
                                                    BUILD_MODULE)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      module.build_into(os.path.join(self.build_lib, 'lazy_optax', '_src',
                                     'cpu_kernels', 'prebuilt'))


class BdistWheel(bdist_wheel):
  """A platform wheel (any Python 3) when it carries the kernels."""

  def finalize_options(self):
    super().finalize_options()
    if PREBUILT:
      self.root_is_pure = False

  def get_tag(self):
    python, abi, platform = super().get_tag()
    return ('py3', 'none', platform) if PREBUILT else (python, abi, platform)


setuptools.setup(cmdclass={'build_py': BuildPy, 'bdist_wheel': BdistWheel})
