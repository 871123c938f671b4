"""The runner as a loop with hooks: a user's hook sees every round, every
evaluation and the end, resumes after a kill, and can stop a run; the three
output files agree key by key and round by round."""

import collections
import csv
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from fedlite_jax.training import RunConfig
from fedlite_jax.training import outputs
from fedlite_jax.training import round_metrics
from fedlite_jax.training import run
from fedlite_jax.training.hooks import Hook

SMALL = dict(task='embedded_mnist', num_clients=12, clients_per_round=3,
             client_batch_size=32, progress=False, seed=3)


class Killed(Exception):
  """A simulated kill, raised inside a round."""


class Recorder(Hook):
  """Records every call; adds ``user/loss_x2`` to each trained row; raises
  :class:`Killed` in ``round_end`` of round ``kill_at``."""

  def __init__(self, kill_at=None, stop_at=None):
    self.kill_at, self.stop_at = kill_at, stop_at
    self.calls = []

  def start(self, run):
    self.calls.append(('start', run.start_round,
                       [r['round'] for r in run.rows]))

  def round_start(self, run, round_num):
    self.calls.append(('round_start', round_num))

  def round_end(self, run, row):
    self.calls.append(('round_end', row['round'],
                       round_metrics.is_evaluation(row)))
    if row['round'] == self.kill_at:
      raise Killed()
    row['user/loss_x2'] = 2 * row['train/loss']
    if row['round'] == self.stop_at:
      run.request_stop('user hook: enough')

  def evaluation(self, run, row):
    self.calls.append(('evaluation', row['round']))

  def end(self, run, summary):
    self.calls.append(('end', summary['rounds'],
                       sorted(summary['final_eval'])))
    summary['user'] = {'rows_seen': len(run.rows)}

  def close(self):
    self.calls.append(('close',))


def test_user_hook_sees_rounds_evaluations_end_and_resumes(tmp_path):
  cfg = dict(num_rounds=6, eval_every=2, checkpoint_every=2, **SMALL)
  full_hook = Recorder()
  full = run(RunConfig(output_dir=str(tmp_path / 'full'), **cfg),
             hooks=[full_hook])
  assert full_hook.calls == (
      [('start', 0, [])] +
      [c for r in range(1, 7) for c in
       [('round_start', r), ('round_end', r, r % 2 == 0)] +
       ([('evaluation', r)] if r % 2 == 0 else [])] +
      [('end', 6, ['accuracy', 'loss']), ('close',)])
  assert full['user'] == {'rows_seen': 6}
  # Keys a user hook adds are written like the runner's.
  rows = outputs.read_metrics(tmp_path / 'full' / 'metrics.jsonl')
  assert [r['user/loss_x2'] for r in rows] == [2 * r['train/loss']
                                               for r in rows]

  # Killed inside round 5 (after round 4's checkpoint), then rerun.
  out = tmp_path / 'resumed'
  killed = Recorder(kill_at=5)
  with pytest.raises(Killed):
    run(RunConfig(output_dir=str(out), **cfg), hooks=[killed])
  assert killed.calls[-1] == ('close',)
  again = Recorder()
  resumed = run(RunConfig(output_dir=str(out), **cfg), hooks=[again])
  assert again.calls[0] == ('start', 4, [1, 2, 3, 4])
  assert [c[1] for c in again.calls if c[0] == 'round_end'] == [5, 6]
  assert [c[1] for c in again.calls if c[0] == 'evaluation'] == [6]
  assert resumed['final_eval'] == full['final_eval']
  assert resumed['communication'] == full['communication']
  assert [r['round'] for r in outputs.read_metrics(
      out / 'metrics.jsonl')] == [1, 2, 3, 4, 5, 6]


def test_a_hook_stops_the_run_checkpointed_and_summarized(tmp_path):
  out = tmp_path / 'stop'
  cfg = dict(num_rounds=6, eval_every=4, checkpoint_every=0, **SMALL)
  summary = run(RunConfig(output_dir=str(out), **cfg),
                hooks=[Recorder(stop_at=3)])
  assert summary['rounds'] == 3
  assert summary['stopped_early'] == 'user hook: enough'
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2, 3]
  # The stop came after round 3's evaluation hook: the summary evaluates
  # the final state, as an uninterrupted evaluation of round 3 would.
  assert math.isfinite(summary['final_eval']['loss'])
  # Checkpointed at the stop (checkpoint_every=0 saves only the end):
  # a rerun resumes there and trains on.
  hook = Recorder()
  resumed = run(RunConfig(output_dir=str(out), **cfg), hooks=[hook])
  assert hook.calls[0] == ('start', 3, [1, 2, 3])
  assert resumed['rounds'] == 6 and resumed['stopped_early'] is None


def test_metrics_tensorboard_and_csv_agree(tmp_path):
  out = tmp_path / 'run'
  summary = run(RunConfig(num_rounds=4, eval_every=2, output_dir=str(out),
                          **SMALL))
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  scalars, hparams = outputs.read_tensorboard(out / 'tb')
  # metrics.jsonl and TensorBoard: the same keys (TensorBoard: the finite
  # numbers), the same rounds, the same values (float32 in TensorBoard).
  numeric = collections.defaultdict(list)
  for r in rows:
    for k, v in r.items():
      if k != 'round' and isinstance(v, (int, float)) and math.isfinite(v):
        numeric[k].append((r['round'], v))
  assert set(numeric) == set(scalars)
  for k, points in numeric.items():
    assert [s for s, _ in scalars[k]] == [s for s, _ in points], k
    np.testing.assert_allclose([v for _, v in scalars[k]],
                               [v for _, v in points], rtol=1e-6, err_msg=k)
  assert hparams['seed'] == 3 and hparams['num_rounds'] == 4
  # communication.csv: rounds from 1; a round's client bits / 8 are the
  # row's bytes; its clients are the row's; running totals add up.
  with (out / 'communication.csv').open() as f:
    per_round = collections.defaultdict(list)
    for line in csv.DictReader(f):
      per_round[int(line['round'])].append(line)
  assert sorted(per_round) == [r['round'] for r in rows] == [1, 2, 3, 4]
  total = 0.0
  for r in rows:
    clients = per_round[r['round']]
    assert len(clients) == r['train/clients']
    assert sum(float(c['upload_bits']) for c in clients) / 8 == r[
        'comm/upload_bytes']
    assert sum(float(c['download_bits']) for c in clients) / 8 == r[
        'comm/download_bytes']
    total += r['comm/upload_bytes']
    assert r['comm/upload_bytes_total'] == total
  # summary.json: the last row's evaluation and totals.
  assert summary['final_eval'] == round_metrics.eval_metrics(rows[-1])
  assert summary['communication']['total_upload_bytes'] == total


def test_the_binary_says_what_it_does(repo_root, tmp_path):
  """Without a terminal: INFO lines for the data, the first round's
  compilation, each evaluation and a resume; no progress bar."""
  binary = [sys.executable, str(repo_root / 'experiments' /
                                'run_experiment.py'),
            '--num_clients=6', '--clients_per_round=2', '--eval_every=1',
            f'--output_dir={tmp_path / "run"}']
  env = dict(os.environ, PYTHONPATH=str(repo_root))
  first = subprocess.run(binary + ['--num_rounds=2'], capture_output=True,
                         text=True, env=env, timeout=600)
  assert first.returncode == 0, first.stderr[-2000:]
  for line in ('Data (--task=embedded_mnist): embedded_mnist: 6 train',
               'Round 1: compiling the client program',
               'Round 1/2: accuracy', 'Round 2/2: accuracy'):
    assert line in first.stderr, (line, first.stderr[-2000:])
  assert 'it/s' not in first.stderr and 'round/s' not in first.stderr
  more = subprocess.run(binary + ['--num_rounds=3'], capture_output=True,
                        text=True, env=env, timeout=600)
  assert more.returncode == 0, more.stderr[-2000:]
  assert 'Resumed from round 2' in more.stderr, more.stderr[-2000:]
  assert 'Round 3/3: accuracy' in more.stderr
