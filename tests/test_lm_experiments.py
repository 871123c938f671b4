"""experiments/lm_experiments.py: the run list it hands to parallel workers,
its one-line error on a bad row, a tiny seeded study on real Shakespeare (2
seeds x 1 round of two rows), and ``--report_only`` on the committed JSON."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parent.parent
_SCRIPT = 'experiments/lm_experiments.py'
_RESULTS = _REPO / 'experiments' / 'results'
_PNGS = ('efficient_lm.png', 'efficient_lm_fig5.png')


def _run(*flags: str, data_dir=None, ok: bool = True):
  env = {**os.environ, 'PYTHONPATH': str(_REPO)}
  if data_dir is not None:
    env['FEDLITE_DATA_DIR'] = str(data_dir)
  proc = subprocess.run([sys.executable, _SCRIPT, *flags], cwd=_REPO,
                        env=env, capture_output=True, text=True, timeout=600)
  if ok:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc


def test_print_commands_lists_pretraining_then_every_run(tmp_path):
  lines = _run('--print_commands', f'--runs_dir={tmp_path}').stdout.split(
      '\n')
  lines = [line for line in lines if line]
  assert lines[0].startswith('python experiments/pretrain_centralized.py ')
  runs = lines[1:]
  # 24 rows x seeds 0, 1, 2, each once, each in its own folder.
  assert len(runs) == 72
  outs = [re.search(r'--output_dir=(\S+)', r).group(1) for r in runs]
  assert len(set(outs)) == 72
  for run, out in zip(runs, outs):
    assert run.startswith('python experiments/run_experiment.py '
                          '--flagfile=experiments/configs/'), run
    seed = re.search(r'--seed=(\d+)', run).group(1)
    assert out.endswith(f'_seed{seed}'), run
    pretrained = out.split('/')[-1].startswith(('pretrained_', 'efficient_'))
    assert ('--init_checkpoint=' in run) == pretrained, run


def test_a_bad_row_is_refused_in_one_line():
  proc = _run('--rows=fedadam,upload3', '--print_commands', ok=False)
  assert proc.returncode != 0
  assert 'upload3 not a row; rows: fedadam, upload8' in proc.stderr


def test_report_only_rewrites_the_committed_md(tmp_path):
  if not (_RESULTS / 'efficient_lm.json').exists():
    pytest.skip('no committed efficient_lm.json')
  shutil.copy(_RESULTS / 'efficient_lm.json', tmp_path)
  _run('--report_only', f'--output_dir={tmp_path}')
  for png in _PNGS:
    assert (tmp_path / png).stat().st_size > 0, png
  assert ((tmp_path / 'efficient_lm.md').read_text() ==
          (_RESULTS / 'efficient_lm.md').read_text())


def test_seeded_study_end_to_end(data_dir, tmp_path):
  out, runs_dir = tmp_path / 'out', tmp_path / 'runs'
  _run('--rows=fedadam,down16_up8', '--seeds=0,1', '--rounds=1',
       '--check_rounds=1', f'--output_dir={out}', f'--runs_dir={runs_dir}',
       data_dir=data_dir)
  data = json.loads((out / 'efficient_lm.json').read_text())
  assert data['provenance']['command'].startswith(f'python {_SCRIPT}')
  assert data['pretraining'] is None  # No pretrained row was asked for.
  rows = {r['run']: r for r in data['results']}
  assert list(rows) == ['fedadam', 'down16_up8']
  for row in rows.values():
    assert row['seeds'] == [0, 1] and row['perplexity']['n'] == 2
    for run in row['runs']:
      assert f'--output_dir={runs_dir}' in run['command']
      assert f'--seed={run["seed"]}' in run['command']
      # One evaluation: the tail mean is that evaluation.
      assert run['perplexity'] == run['curve'][-1]['perplexity']
  # FedAdam sends every float32 parameter each way.
  params = rows['fedadam']['runs'][0]['communication']['num_params']
  assert rows['fedadam']['upload_per_client_round'] == 4 * params
  assert rows['fedadam']['download_per_client_round'] == 4 * params
  down = rows['down16_up8']['download_per_client_round']
  up = rows['down16_up8']['upload_per_client_round']
  assert 2 * params <= down < 2.02 * params
  assert params <= up < 1.02 * params
  # The paired difference, by hand.
  comp = next(c for c in data['comparisons']
              if (c['a'], c['b']) == ('down16_up8', 'fedadam'))
  want = [a['perplexity'] - b['perplexity'] for a, b in
          zip(rows['down16_up8']['runs'], rows['fedadam']['runs'])]
  assert comp['diffs'] == pytest.approx(want, rel=1e-12)
  assert comp['n'] == 2 and comp['mean'] == pytest.approx(sum(want) / 2)
  assert '--download=uniform_quantization:16' in data['check']['command']
  assert '--num_rounds=1' in data['check']['command']
  text = (out / 'efficient_lm.md').read_text()
  assert '| 16-bit download, 8-bit uniform upload |' in text
  for png in _PNGS:
    assert (out / png).stat().st_size > 0, png
