"""The peers' interpreters: TensorFlow Addons and FBGEMM, each in a venv.

TensorFlow 2.15 needs numpy < 2 and FBGEMM 1.9.0 needs torch 2.14.1, so
neither can share the interpreter that runs lazy_optax. One command builds
both virtual environments in a folder you choose (outside the repository;
about 7 GB on disk, 5.5 GB of it torch 2.14.1 and its CUDA libraries):

    python3 benchmarks/peers.py setup DIR

and prints the two environment variables that name them:

    export LAZY_OPTAX_TF_PYTHON=DIR/tf/bin/python
    export LAZY_OPTAX_FBGEMM_PYTHON=DIR/fbgemm/bin/python

The benchmarks (`benchmarks/run.py`, whose `--tf-python` and
`--fbgemm-python` flags override them) and the tests (the FBGEMM parity
tests) read these variables and nothing else. Where one is unset, what
needs that peer is left out with a note, and the rest runs.
`python3 benchmarks/peers.py check` says which peers are found.

Standard library only: the peers' interpreters import `benchmarks` too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# name: (environment variable, pip requirements, import that checks it)
PEERS = {
    'tf': ('LAZY_OPTAX_TF_PYTHON',
           ('tensorflow-cpu==2.15.1', 'tensorflow-addons==0.23.0',
            'numpy<2'),
           'import tensorflow, tensorflow_addons'),
    'fbgemm': ('LAZY_OPTAX_FBGEMM_PYTHON',
               ('torch==2.14.1', 'fbgemm-gpu-cpu==1.9.0', 'numpy'),
               'import torch, fbgemm_gpu'),
}


def python_for(peer: str, flag: str | None = None) -> str | None:
  """The interpreter of `peer` ('tf' or 'fbgemm'): `flag`, else its variable.

  Args:
    peer: a key of `PEERS`.
    flag: a path given on a command line, which wins over the variable.

  Returns:
    The path, or None where neither names one.

  Example:
    >>> python_for('tf', '/opt/tf/bin/python')
    '/opt/tf/bin/python'
  """
  return flag or os.environ.get(PEERS[peer][0]) or None


def why_unusable(python: str | None) -> str:
  """Why `python` cannot run a peer ('' where it can be started).

  Args:
    python: a path from `python_for`, or None.

  Returns:
    '' for an executable file, else the reason in a few words.
  """
  if not python:
    return 'not given'
  if not os.access(python, os.X_OK):
    return f'{python} is not an executable'
  return ''


def setup(folder: str) -> list[str]:
  """Builds the venv of each peer in `folder/<peer>`; returns export lines.

  Args:
    folder: where the environments go (created if missing), outside the
      repository.

  Returns:
    One `export VARIABLE=PATH` line a peer.
  """
  folder = os.path.abspath(folder)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.commonpath([folder, root]) == root:
    raise SystemExit(f'{folder} is inside the repository: choose a folder '
                     'outside it (the environments must not be committed)')
  lines = []
  for peer, (var, reqs, check) in PEERS.items():
    env_dir = os.path.join(folder, peer)
    python = os.path.join(env_dir, 'bin', 'python')
    if not os.access(python, os.X_OK):
      subprocess.run([sys.executable, '-m', 'venv', env_dir], check=True)
    subprocess.run([python, '-m', 'pip', 'install', '-q', '--upgrade',
                    'pip'], check=True)
    subprocess.run([python, '-m', 'pip', 'install', *reqs], check=True)
    subprocess.run([python, '-c', check], check=True)
    lines.append(f'export {var}={python}')
  return lines


def check() -> list[str]:
  """One line a peer: the interpreter found and whether it imports the peer."""
  out = []
  for peer, (var, _, imports) in PEERS.items():
    python = python_for(peer)
    why = why_unusable(python)
    if not why:
      proc = subprocess.run([python, '-c', imports], capture_output=True,
                            text=True, check=False)
      why = '' if proc.returncode == 0 else proc.stderr.strip()[-200:]
    out.append(f'{peer}: {var}={python or ""} '
               f'{"ok" if not why else "unusable: " + why}')
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  sub = parser.add_subparsers(dest='command', required=True)
  p = sub.add_parser('setup', help='build the peers\' venvs in DIR')
  p.add_argument('dir')
  sub.add_parser('check', help='say which peers the variables name')
  args = parser.parse_args()
  lines = setup(args.dir) if args.command == 'setup' else check()
  print('\n'.join(lines))


if __name__ == '__main__':
  main()
