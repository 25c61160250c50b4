"""The README's commands, example and links stay true, and it stays short."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'


def _readme_commands():
  text = README.read_text()
  block = re.search(r'```bash\n(.*?)```', text, re.S)
  assert block, 'README.md must have a bash block of two commands'
  return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_opens_with_the_title_then_two_commands_ci_runs_the_second():
  text = README.read_text()
  assert text.startswith('# lazy_optax\n')
  assert text.index('```bash') < text.index('## Example')
  commands = _readme_commands()
  assert commands == [
      'python3 -m pip install -e . && python3 -m lazy_optax.demo',
      "python3 -m pip install -e '.[test]' && python3 -m pytest -q"]
  assert commands[1] in (ROOT / '.ci' / 'run').read_text().splitlines()


def test_readme_is_a_front_page_of_at_most_160_lines():
  assert len(README.read_text().splitlines()) <= 160


def test_readme_links_resolve_and_reach_every_guide():
  text = README.read_text()
  targets = [t.split('#')[0] for t in re.findall(r'\]\(([^)\s]+)\)', text)
             if not t.startswith(('http://', 'https://', '#'))]
  assert targets
  missing = [t for t in targets if not (ROOT / t).exists()]
  assert not missing, missing
  guides = {p.relative_to(ROOT).as_posix()
            for p in (ROOT / 'docs').glob('*.md') if p.name != 'index.md'}
  unlinked = guides - set(targets)
  assert not unlinked, f'docs pages the README does not link: {unlinked}'


def test_readme_example_runs():
  text = README.read_text()
  code = re.search(r'## Example\n\n```python\n(.*?)```', text, re.S).group(1)
  namespace = {}
  exec(compile(code.replace('1_000_000', '1_000'), 'README', 'exec'),
       namespace)
  table = namespace['params']['table']
  assert float(abs(table[3]).sum()) > 0
  assert float(abs(table[4]).sum()) == 0
