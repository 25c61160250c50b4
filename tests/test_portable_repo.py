"""The repository runs on any machine: no path of one machine's layout.

Every tracked file (`git ls-files`; a walk of the tree where git is
absent), history files and committed results included, is scanned for
absolute paths of one machine's layout (a folder under the root named
`work`, `root`, `home` or `Users`) and for fixed names in the temp folder
(`/tmp/NAME`, `'/tmp'`, `tempfile.gettempdir()`): a benchmark or test
takes such a folder from `tempfile`, the user or an environment variable
(`LAZY_OPTAX_TF_PYTHON`, `LAZY_OPTAX_FBGEMM_PYTHON`: `benchmarks/peers.py`).
The package, the benchmarks and the tests import by package or by name,
never by editing `sys.path` (pyproject.toml's `pythonpath` puts `tests/` on
the path of the suite, `tests/conftest.py`'s `PYTHONPATH` on its
subprocesses'); only Sphinx's `docs/conf.py` adds its own extensions'
folder, as Sphinx documents.
"""

import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
THIS = pathlib.Path(__file__).resolve()

# Built by pieces, so that this file does not match itself.
_SLASH = '/'
MACHINE_PATH = re.compile(
    r'(?:^|[^A-Za-z0-9_.~$-])' + _SLASH +
    r'(?:work|root|home|Users)' + _SLASH + r'[\w.-]')
TEMP_NAME = re.compile(
    _SLASH + r'tmp' + _SLASH + r'[\w.$-]|[\'"]' + _SLASH + r'tmp[\'"]|'
    r'gettemp' + r'dir\(')
SYS_PATH_EDIT = re.compile(r'sys\.path\s*(?:\.\s*(?:insert|append|extend)'
                           r'\b|\+=|=[^=]|\[)')
# Where editing sys.path is no import trick of the package's.
SYS_PATH_SCOPE = ('lazy_optax/', 'benchmarks/', 'tests/')


def _tracked() -> list[str]:
  """The tracked files, relative to the root (a walk where git is absent)."""
  git = shutil.which('git')
  if git and (ROOT / '.git').exists():
    out = subprocess.run([git, 'ls-files', '-z'], cwd=ROOT, check=True,
                         capture_output=True).stdout
    return [p for p in out.decode().split('\0') if p]
  skip = {'.git', '__pycache__', 'build', 'dist', '_build', '.pytest_cache',
          '.hypothesis', '.ipynb_checkpoints'}
  files = []
  for folder, dirs, names in os.walk(ROOT):
    dirs[:] = [d for d in dirs if d not in skip and
               not d.endswith('.egg-info') and not d.startswith('tmp')]
    files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
  return files


def _texts():
  """(relative path, text) of every tracked text file but this one."""
  for rel in _tracked():
    path = ROOT / rel
    if path.resolve() == THIS or not path.is_file():
      continue
    data = path.read_bytes()
    if b'\0' in data[:8192]:
      continue  # binary: .npz fixtures, images
    yield rel.replace(os.sep, '/'), data.decode('utf-8', 'replace')


def _hits(pattern: re.Pattern, only=None) -> list[str]:
  found = []
  for rel, text in _texts():
    if only and not only(rel):
      continue
    for number, line in enumerate(text.splitlines(), 1):
      if pattern.search(line):
        found.append(f'{rel}:{number}: {line.strip()[:120]}')
  return found


def test_the_scan_sees_the_repository():
  files = _tracked()
  assert 'lazy_optax/__init__.py' in files and 'benchmarks/HISTORY.md' in files
  assert MACHINE_PATH.search('python ' + _SLASH + 'work/venvs/x')
  assert MACHINE_PATH.search('"' + _SLASH + 'root/.cache"')
  assert not MACHINE_PATH.search('benchmarks/work/x and $HOME' + _SLASH)
  assert TEMP_NAME.search("np.save('" + _SLASH + "tmp/ids.npy')")
  assert not TEMP_NAME.search('benchmarks/results/tmp_smoke')
  assert SYS_PATH_EDIT.search('sys.path.insert(0, root)')
  assert not SYS_PATH_EDIT.search('print(sys.path)')


def test_no_path_of_one_machine():
  assert _hits(MACHINE_PATH) == []


def test_no_fixed_temp_name():
  assert _hits(TEMP_NAME) == []


def test_no_sys_path_edits_in_the_package_the_benchmarks_or_the_tests():
  assert _hits(SYS_PATH_EDIT,
               lambda rel: rel.endswith('.py')
               and rel.startswith(SYS_PATH_SCOPE)) == []
