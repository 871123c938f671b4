"""experiments/fedlite_experiments.py end to end: a tiny seeded study on
FEMNIST-105 (2 seeds x 2 iterations, Figure 3 on each seed's SplitFed
checkpoint) and ``--report_only`` on its JSON and on the committed one."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
_SCRIPT = 'experiments/fedlite_experiments.py'
_PNGS = ('fedlite_fig3.png', 'fedlite_fig4.png', 'fedlite_fig5_lambda.png',
         'fedlite_nwp.png')
_FEDLITE = 'femnist_fedlite_q1152_L2_lam0.001'


def _run(*flags: str, data_dir=None) -> str:
  env = {**os.environ, 'PYTHONPATH': str(_REPO)}
  if data_dir is not None:
    env['FEDLITE_DATA_DIR'] = str(data_dir)
  proc = subprocess.run([sys.executable, _SCRIPT, *flags], cwd=_REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout


def test_report_only_rewrites_the_committed_tables(tmp_path):
  results = _REPO / 'experiments' / 'results'
  shutil.copy(results / 'fedlite_results.json', tmp_path)
  _run('--report_only', f'--output_dir={tmp_path}')
  for png in _PNGS:
    assert (tmp_path / png).stat().st_size > 0, png
  assert ((tmp_path / 'fedlite_tables.md').read_text() ==
          (results / 'fedlite_tables.md').read_text())


def test_seeded_study_end_to_end(data_dir, tmp_path):
  out = tmp_path / 'out'
  _run('--seeds=0,1', '--iterations=2', '--check_iterations=2',
       '--parts=femnist,fig3', f'--runs=femnist_splitfed,{_FEDLITE}',
       f'--output_dir={out}', f'--runs_dir={tmp_path / "runs"}',
       data_dir=data_dir)
  data = json.loads((out / 'fedlite_results.json').read_text())
  assert data['provenance']['command'].startswith(f'python {_SCRIPT}')
  rows = {r['run']: r for r in data['results']}
  assert list(rows) == ['femnist_splitfed', _FEDLITE]
  for row in rows.values():
    assert row['seeds'] == [0, 1] and row['accuracy']['n'] == 2
    assert [r['seed'] for r in row['runs']] == [0, 1]
    assert row['same_bits_every_seed']
    for run in row['runs']:
      assert f'--output_dir={tmp_path / "runs"}' in run['command']
      assert f'--seed={run["seed"]}' in run['command']
      assert run['curve'] and run['commit']
  assert rows[_FEDLITE]['bits']['activation_compression'] > 400
  comps = {(c['kind'], c['b']): c for c in data['comparisons']}
  diff = comps['difference', 'femnist_splitfed']
  assert diff['seeds'] == [0, 1] and len(diff['diffs']) == 2
  ratio = comps['ratio', 'femnist_splitfed']
  assert ratio['seeds'] == [0, 1] and len(ratio['values']) == 2
  fig3 = data['fig3']
  assert fig3['seeds'] == [0, 1] and len(fig3['checkpoints']) == 2
  assert all(r['relative_error']['n'] == 2 for r in fig3['rows'])
  check = data['check']
  assert '--algorithm=fedlite' in check['command']
  assert '--num_rounds=2' in check['command'] and check['curve']
  md = (out / 'fedlite_tables.md').read_text()
  assert 'same sign in' in md and 'fedlite_fig3.png' in md
  assert (out / 'fedlite_fig3.png').exists()
  (out / 'fedlite_tables.md').unlink()
  _run('--report_only', f'--output_dir={out}')
  assert (out / 'fedlite_tables.md').read_text() == md
