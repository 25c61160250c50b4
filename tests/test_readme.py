"""The README's commands and example stay true."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands():
  text = (ROOT / 'README.md').read_text()
  block = re.match(r'```bash\n(.*?)```', text, re.S)
  assert block, 'README.md must open with a bash block of two commands'
  return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_second():
  commands = _readme_commands()
  assert len(commands) == 2
  assert 'lazy_optax.demo' in commands[0]
  assert 'pytest' in commands[1]
  assert commands[1] in (ROOT / '.ci' / 'run').read_text()


def test_readme_example_runs():
  text = (ROOT / 'README.md').read_text()
  code = re.search(r'## Example\n\n```python\n(.*?)```', text, re.S).group(1)
  namespace = {}
  exec(compile(code.replace('1_000_000', '1_000'), 'README', 'exec'),
       namespace)
  table = namespace['params']['table']
  assert float(abs(table[3]).sum()) > 0
  assert float(abs(table[4]).sum()) == 0
