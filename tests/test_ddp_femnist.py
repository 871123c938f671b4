"""experiments/ddp_femnist.py end to end at its smallest (FEMNIST-105 data):
one seed, 2 rounds of 3 clients, ddgauss and skellam on IGC (d = 4,096)
at B = 6 (epsilon unreachable) and 16, beside central DP and no DP, the
check and --report_only. The full model's rows are the same code with a
2^21-coordinate vector (tests/test_distributed_dp_runner.py trains one)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
EPSILON = 8.0


def _study(data_dir, tmp_path, *flags):
  env = {**os.environ, 'PYTHONPATH': str(_REPO),
         'FEDLITE_DATA_DIR': str(data_dir)}
  return subprocess.run(
      [sys.executable, 'experiments/ddp_femnist.py', '--rounds=2',
       '--seeds=0', '--clients_per_round=3', '--check_rounds=1',
       f'--epsilon={EPSILON:g}', f'--runs_dir={tmp_path / "runs"}',
       f'--output_dir={tmp_path / "out"}', *flags], cwd=_REPO, env=env,
      capture_output=True, text=True, timeout=900)


def test_tiny_study_rows_upload_bits_epsilon_and_check(data_dir, tmp_path):
  proc = _study(data_dir, tmp_path, '--models=igc',
                '--mechanisms=ddgauss,skellam', '--igc_bits=6,16')
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  out = tmp_path / 'out'
  data = json.loads((out / 'ddp_femnist.json').read_text())
  m = data['meta']
  assert (m['epsilon'], m['delta'], m['clients_per_round'], m['clip'],
          m['population']) == (EPSILON, 1e-6, 3, 0.1, 3400)
  rows = {r['run']: r for r in data['results']}
  # A row per (model, mechanism, B) cell; IGC first (the cheaper runs).
  assert list(rows) == ['igc_nodp', 'igc_gaussian', 'igc_ddgauss_b16',
                        'igc_skellam_b16']
  # No DP at its own server learning rate (unclipped updates).
  assert '--server_lr=1 ' in rows['igc_nodp']['runs'][0]['command'] + ' '
  assert '--server_lr=3 ' in rows['igc_gaussian']['runs'][0]['command'] + ' '
  # B = 6 cannot reach epsilon 8 for d = 4,096: listed, not trained.
  assert [(u['run'], u['model'], u['mechanism'], u['bits'])
          for u in data['unreachable']] == [
              ('igc_ddgauss_b6', 'igc', 'ddgauss', 6),
              ('igc_skellam_b6', 'igc', 'skellam', 6)]
  for u in data['unreachable']:
    assert 'unreachable' in u['reason'] and '--dp_bits=6' in u['command']
  for name, r in rows.items():
    assert r['seeds'] == [0] and r['accuracy']['n'] == 1
    assert 0 <= r['accuracy']['mean'] <= 1
    (run,) = r['runs']
    if r['bits'] is not None:  # Distributed: B * padded_dim bits per client.
      padded = 4096
      assert r['padded_dim'] == run['privacy']['padded_dim'] == padded, name
      assert r['upload_bits_per_client'] == r['bits'] * padded, name
      assert r['privacy_upload_bits_per_client'] == r['bits'] * padded
      assert run['privacy']['mechanism'] == r['mechanism']
      assert 0 <= r['wrapped_fraction_max'] < 0.01, name
    else:  # float32 uploads.
      assert r['upload_bits_per_client'] == 32 * 4096, name
    if r['mechanism'] == 'nodp':
      assert r['epsilon'] is None and run['privacy'] is None
    else:
      assert 0 < r['epsilon'] <= EPSILON * 1.001, name
      assert run['privacy']['epsilon'] <= EPSILON * 1.001, name
      assert r['noise_multiplier'] > 0, name
    assert '--dp_noise_cohort_size' not in run['command']
  assert rows['igc_gaussian']['runs'][0]['privacy']['mechanism'] == 'gaussian'
  # Each distributed row against its model's central DP; central vs no DP.
  assert [(c['a'], c['b'], c['n']) for c in data['comparisons']] == [
      ('igc_gaussian', 'igc_nodp', 1),
      ('igc_ddgauss_b16', 'igc_gaussian', 1),
      ('igc_skellam_b16', 'igc_gaussian', 1)]
  check = data['check']
  for flag in ('--algorithm=igc_static', '--dp_mechanism=ddgauss',
               '--dp_bits=16', '--num_rounds=1', '--dp_target_epsilon=8'):
    assert flag in check['command'], flag
  assert check['curve']
  md = (out / 'ddp_femnist.md').read_text()
  assert '| model | mechanism | B | z | epsilon |' in md
  assert ('| IGC static, d = 4,096 | distributed discrete Gaussian | 6 | - | '
          'unreachable |') in md
  assert '| IGC static, d = 4,096 | distributed discrete Gaussian | 16 |' in md
  assert f'{16 * 4096:,}' in md and f'{32 * 4096:,}' in md
  assert check['command'] in md and 'Supported by every seed' in md
  assert 'B = 16 (' in md  # The claim lines at B <= 16.
  assert 'Not run for this file: full model (`--models=full`)' in md
  assert (out / 'ddp_femnist.png').stat().st_size > 0
  # --report_only rewrites the same .md from the .json.
  (out / 'ddp_femnist.md').unlink()
  proc = _study(data_dir, tmp_path, '--report_only')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (out / 'ddp_femnist.md').read_text() == md

