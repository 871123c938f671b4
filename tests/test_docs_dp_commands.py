"""Every DP command of the docs (``run_experiment.py`` with ``--dp_*``, in
``docs/*.md`` and README.md, fenced or inline) passes ``--validate_only``
on the data it names: the data under ``$FEDLITE_DATA_DIR`` (skipped with
the reason when that task's data is not there).
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def dp_commands() -> list[tuple[str, list[str]]]:
  """``(page, argv after run_experiment.py)`` of every DP command."""
  out = []
  pages = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))
  for page in pages:
    text = page.read_text()
    spans = re.findall(r'^```(?:bash|sh)\n(.*?)^```', text, re.S | re.M)
    spans += re.findall(r'(?<!`)`([^`\n]*run_experiment\.py[^`\n]*)`', text)
    for span in spans:
      for line in span.replace('\\\n', ' ').splitlines():
        line = line.split(' #', 1)[0]
        if 'run_experiment.py' not in line or '--dp_' not in line:
          continue
        argv = shlex.split(line)
        i = next(i for i, a in enumerate(argv)
                 if a.endswith('run_experiment.py'))
        out.append((page.name, argv[i + 1:]))
  return out


def test_the_dp_commands_are_found():
  pages = {page for page, _ in dp_commands()}
  assert 'runner.md' in pages


@pytest.mark.parametrize('page,argv', dp_commands(),
                         ids=lambda x: x if isinstance(x, str) else None)
def test_dp_command_validates_on_its_data(page, argv, tmp_path):
  if not os.environ.get('FEDLITE_DATA_DIR'):
    pytest.skip('needs $FEDLITE_DATA_DIR')
  argv = [a for a in argv if not a.startswith('--output_dir')]
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'experiments' / 'run_experiment.py'),
       *argv, '--validate_only', f'--output_dir={tmp_path}/out'],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS='cpu'))
  if 'Could not find the' in proc.stderr:
    pytest.skip(f'{page}: the data of {argv} is not under '
                f'$FEDLITE_DATA_DIR: {proc.stderr.splitlines()[0]}')
  assert proc.returncode == 0, (page, argv, proc.stderr[-2000:])
  assert re.search(r'^  privacy: (gaussian|ddgauss|skellam), z=', proc.stdout,
                   re.M), proc.stdout
