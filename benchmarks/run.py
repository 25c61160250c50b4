"""The benchmark harness's entry point: `python3 benchmarks/run.py --help`.

Runs `benchmarks/harness/run.py` (see its docstring): lazy_optax against
TensorFlow Addons, torch, FBGEMM and optax, side by side. Started as a
script, it runs itself again as the module `benchmarks.run` with the
repository root on `PYTHONPATH`, so that `python3 benchmarks/run.py ...` and
`python3 -m benchmarks.run ...` are the same command.
"""

import os
import sys

if __name__ == '__main__' and not __package__:
  _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  _env = dict(os.environ)
  _env['PYTHONPATH'] = os.pathsep.join(
      [_root] + ([_env['PYTHONPATH']] if _env.get('PYTHONPATH') else []))
  os.execve(sys.executable,
            [sys.executable, '-m', 'benchmarks.run', *sys.argv[1:]], _env)

from benchmarks.harness.run import main  # noqa: E402

if __name__ == '__main__':
  main()
