"""experiments/dp_femnist.py end to end at its smallest: one seed, one round,
the IGC rows without DP, with clipping alone and with DP, and its check (FEMNIST-105 data)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent


def test_tiny_study_writes_rows_comparisons_and_check(data_dir, tmp_path):
  out = tmp_path / 'out'
  env = {**os.environ, 'PYTHONPATH': str(_REPO),
         'FEDLITE_DATA_DIR': str(data_dir)}
  proc = subprocess.run(
      [sys.executable, 'experiments/dp_femnist.py', '--rounds=1',
       '--seeds=0', '--compressions=igc4096', '--epsilons=inf,clip,8',
       '--check_rounds=1', f'--runs_dir={tmp_path / "runs"}',
       f'--output_dir={out}'], cwd=_REPO, env=env, capture_output=True,
      text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  data = json.loads((out / 'dp_femnist.json').read_text())
  assert data['meta']['delta'] == 1e-6 and data['meta']['cohort'] == 100
  rows = {r['run']: r for r in data['results']}
  assert list(rows) == ['igc4096_epsinf', 'igc4096_epsclip', 'igc4096_eps8']
  no_dp, clip, dp = rows.values()
  assert no_dp['noise_multiplier'] is None and dp['noise_multiplier'] > 0
  assert clip['noise_multiplier'] == 0
  assert float(clip['runs'][0]['privacy']['epsilon']) == float('inf')
  assert dp['runs'][0]['privacy']['epsilon'] <= 8.0 * 1.001
  for r in rows.values():
    assert r['seeds'] == [0] and r['accuracy']['n'] == 1
    assert 0 <= r['accuracy']['mean'] <= 1
    # d = 4,096 float32 coordinates per client, 10 clients.
    assert r['upload_bits_per_round'] == 10 * 32 * 4096
  assert [(c['a'], c['b'], c['n']) for c in data['comparisons']] == [
      ('igc4096_epsclip', 'igc4096_epsinf', 1),
      ('igc4096_eps8', 'igc4096_epsinf', 1),
      ('igc4096_eps8', 'igc4096_epsclip', 1)]
  assert 'IGC static, d = 4,096: epsilon 8 - clip only' in (
      c['label'] for c in data['comparisons'])
  assert '--dp_target_epsilon=8' in data['check']['command']
  assert data['check']['curve']
  md = (out / 'dp_femnist.md').read_text()
  assert 'Supported by every seed' in md and (out / 'dp_femnist.png').exists()
