"""The README and the documentation pages say true, runnable things.

* Every ```python block of README.md and of the pages under docs/ runs: the
  blocks of one file in order, in one namespace (the examples check their
  own results against independent expectations).
* README.md stays a manual: at most 260 lines, starting with exactly the
  two set-up commands, the second being .ci/run's test command.
* Every command in the README's ```bash blocks exists: scripts and files on
  disk, pip extras in setup.py, and each ``run_experiment.py`` line passes
  its own ``--validate_only`` check (flags, algorithm, stage strings).
* Every relative link of the README names a file in the repository.
* The API reference (docs/api/*.rst) documents every public module.
"""

from __future__ import annotations

import ast
import os
import pathlib
import pkgutil
import re
import shlex
import subprocess
import sys

import pytest

import fedlite_jax

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / 'README.md'
SETUP_COMMANDS = [
    'pip install -e . && python experiments/run_experiment.py',
    'pip install -e ".[test]" && python -m pytest -n 2 --nbmake tests notebooks',
]
# Folders under docs/ that the build fills with copies (docs/conf.py).
_BUILD_COPIES = ('_build', 'generated', 'notebooks')


def fenced_blocks(text: str, language: str) -> list[str]:
  """The bodies of the ```language fences of a Markdown text, in order."""
  return re.findall(rf'^```{language}\n(.*?)^```', text, re.S | re.M)


def doc_pages() -> list[pathlib.Path]:
  """README.md and the Markdown pages written for docs/ with Python blocks."""
  pages = [README] + sorted(
      p for p in (ROOT / 'docs').rglob('*.md')
      if p.relative_to(ROOT / 'docs').parts[0] not in _BUILD_COPIES)
  return [p for p in pages if fenced_blocks(p.read_text(), 'python')]


def test_fenced_blocks_reads_python_and_bash_fences():
  text = 'a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n'
  assert fenced_blocks(text, 'python') == ['x = 1\n', 'y = 2\n']
  assert fenced_blocks(text, 'bash') == ['ls\n']


def test_the_pages_with_examples_are_found():
  names = {p.relative_to(ROOT).as_posix() for p in doc_pages()}
  assert {'README.md', 'docs/transform_examples.md',
          'docs/library.md'} <= names


@pytest.mark.parametrize(
    'page', doc_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(page):
  namespace = {'__name__': '__docs__'}
  for i, block in enumerate(fenced_blocks(page.read_text(), 'python')):
    code = compile(block, f'{page.relative_to(ROOT)}, python block {i + 1}',
                   'exec')
    exec(code, namespace)  # pylint: disable=exec-used


def test_readme_is_short_and_starts_with_the_two_setup_commands():
  text = README.read_text()
  assert len(text.splitlines()) <= 260
  first = re.search(r'```bash\n(.*?)```', text, re.S).group(1)
  assert first.splitlines() == SETUP_COMMANDS
  assert text.index('```bash') < 40  # Right under the title.
  ci = (ROOT / '.ci' / 'run').read_text().splitlines()
  assert SETUP_COMMANDS[1] in ci


def _commands(block: str) -> list[list[str]]:
  """Each command of a bash block as argv (continuations joined, comments
  and ``&&`` chains split)."""
  text = block.replace('\\\n', ' ')
  out = []
  for line in text.splitlines():
    line = line.split('   #')[0].strip()
    for part in line.split('&&'):
      if part.strip():
        out.append(shlex.split(part))
  return out


def _extras() -> set[str]:
  tree = ast.parse((ROOT / 'setup.py').read_text())
  for node in ast.walk(tree):
    if (isinstance(node, ast.Assign) and
        getattr(node.targets[0], 'id', None) == 'EXTRAS_REQUIRE'):
      return set(ast.literal_eval(node.value))
  raise AssertionError('setup.py has no EXTRAS_REQUIRE')


def _check_command(argv: list[str], extras: set[str]) -> None:
  """Fails unless the command names things that exist."""
  tool = argv[0]
  if tool == 'pip' and argv[1:3] == ['install', '-U']:
    assert re.fullmatch(r'jax\[\w+\]==[\d.]+', argv[3]), argv  # JAX builds.
  elif tool == 'pip':
    assert argv[1:3] == ['install', '-e'], argv
    extra = re.fullmatch(r'\.(?:\[(\w+)\])?', argv[3])
    assert extra, argv
    assert extra.group(1) is None or extra.group(1) in extras, argv
  elif tool == 'python' and argv[1] == '-m':
    assert argv[2] == 'pytest', argv
    assert all((ROOT / a).exists() for a in argv[3:]
               if not a.startswith('-') and a != '2'), argv
  elif tool == 'python':
    script = ROOT / argv[1]
    assert script.is_file(), argv
    if argv[1] == 'experiments/run_experiment.py' and '--helpfull' not in argv:
      proc = subprocess.run(
          [sys.executable, *argv[1:], '--validate_only'], cwd=ROOT,
          capture_output=True, text=True, check=False)
      # Without the data on disk (no $FEDLITE_DATA_DIR) the check stops
      # at the data, after the flags passed.
      missing = ('federated dataset' in proc.stderr and
                 not os.environ.get('FEDLITE_DATA_DIR'))
      assert proc.returncode == 0 or missing, (argv, proc.stderr[-2000:])
  elif tool == 'jupyter':
    assert 'notebooks' in extras and (ROOT / argv[-1]).is_file(), argv
  elif tool == 'sphinx-build':
    assert 'docs' in extras and (ROOT / 'docs' / 'conf.py').is_file(), argv
  else:
    raise AssertionError(f'unknown command in the README: {argv}')


def test_every_readme_command_exists():
  extras = _extras()
  blocks = fenced_blocks(README.read_text(), 'bash')
  commands = [c for block in blocks for c in _commands(block)]
  assert len(commands) >= 6
  for argv in commands:
    _check_command(argv, extras)
  inline = re.findall(r'`((?:pip|sphinx-build|python) [^`]+)`',
                      README.read_text())
  for text in inline:
    for argv in _commands(text):
      _check_command(argv, extras)


def test_check_command_refuses_what_does_not_exist():
  extras = _extras()
  for argv in (['python', 'experiments/no_such_binary.py'],
               ['pip', 'install', '-e', '.[nope]'],
               ['python', 'experiments/run_experiment.py',
                '--algorithm=no_such_algorithm'],
               ['make', 'docs']):
    with pytest.raises(AssertionError):
      _check_command(argv, extras)


def test_readme_links_name_files_in_the_repository():
  links = re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', README.read_text())
  local = [l for l in links if not re.match(r'[a-z]+://', l)]
  assert len(local) > 20
  missing = [l for l in local if not (ROOT / l).exists()]
  assert not missing, f'README links to missing files: {missing}'


def test_the_api_reference_documents_every_public_module():
  documented = set()
  for page in (ROOT / 'docs' / 'api').glob('*.rst'):
    documented.update(re.findall(r'^\.\. automodule:: (\S+)$',
                                 page.read_text(), re.M))
  public = {'fedlite_jax'} | {
      m.name for m in pkgutil.walk_packages(fedlite_jax.__path__,
                                            'fedlite_jax.')
      if not any(p.startswith('_') for p in m.name.split('.'))}
  assert public - documented == set(), 'not in docs/api/*.rst'
  assert documented - public == set(), 'docs/api/*.rst names unknown modules'
