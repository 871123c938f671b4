"""A run folder never passes an old result off as new.

More ``--num_rounds`` continue a finished run; fewer are refused (or, with
a checkpoint at that round, its stored result is shown); a finished run
rerun trains and writes nothing. SIGINT / SIGTERM stop a run after its
round with a checkpoint, and the same command then gives the rows of an
uninterrupted run. Default folder names are readable.
"""

import json
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fedlite_jax.training import ConfigError
from fedlite_jax.training import RunConfig
from fedlite_jax.training import RunInterrupted
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import evaluation
from fedlite_jax.training import outputs
from fedlite_jax.training import run
from fedlite_jax.training import start
from fedlite_jax.training import state_io
from fedlite_jax.training import tasks
from fedlite_jax.training.hooks import Hook
from test_runner_resume import SETTINGS, _env, _metrics

# Sends $FEDLITE_SIGNAL_AT = '<signal name>:<round>' to the process itself
# once that round's metrics.jsonl row is written, then runs the binary.
_DRIVER = textwrap.dedent('''
    import os, runpy, signal, sys
    from fedlite_jax.training.hooks import metrics_file

    name, at = os.environ['FEDLITE_SIGNAL_AT'].split(':')
    real_write = metrics_file.MetricsFileHook.round_end
    def write(self, run, row):
      real_write(self, run, row)
      if row['round'] == int(at):
        os.kill(os.getpid(), getattr(signal, name))
    metrics_file.MetricsFileHook.round_end = write
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name='__main__')
''')


def _binary(repo_root, out, tmp_path=None, signal_at=None, **flags):
  settings = dict(SETTINGS, **flags)
  cmd = [str(repo_root / 'experiments' / 'run_experiment.py'),
         *[f'--{k}={v}' for k, v in settings.items()],
         f'--output_dir={out}', '--noprogress']
  env = _env(repo_root)
  if signal_at is not None:
    driver = tmp_path / 'signal_driver.py'
    driver.write_text(_DRIVER)
    cmd = [str(driver), *cmd]
    env = _env(repo_root, FEDLITE_SIGNAL_AT=signal_at)
  return subprocess.run([sys.executable, *cmd], capture_output=True,
                        text=True, env=env, timeout=300)


def _run(out, **flags):
  return run(RunConfig(output_dir=str(out), progress=False,
                       **dict(SETTINGS, **flags)))


def _files(out):
  """Every file of the folder (but the lock) and its bytes."""
  return {str(p.relative_to(out)): p.read_bytes()
          for p in sorted(out.rglob('*'))
          if p.is_file() and p.name != outputs.LOCK_FILE}


def _rounds(out):
  return [r['round'] for r in outputs.read_metrics(out / 'metrics.jsonl')]


def _summary(out):
  return json.loads((out / 'summary.json').read_text())


def _latest_round(out):
  return int(state_io.latest_checkpoint(out / 'checkpoints').name)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """An uninterrupted 5-round run, checkpointed every round (so the
  checkpoints of rounds 4 and 5 are kept)."""
  out = tmp_path_factory.mktemp('reference') / 'run'
  _run(out, checkpoint_every=1)
  return out


def test_more_rounds_continue_a_finished_run(repo_root, tmp_path, reference):
  out = tmp_path / 'run'
  _run(out, num_rounds=3)
  first = (out / 'metrics.jsonl').read_text().splitlines()
  assert _summary(out)['rounds'] == 3
  more = _binary(repo_root, out, num_rounds=5)
  assert more.returncode == 0, more.stderr[-2000:]
  assert 'Continuing from round 3 to 5' in more.stderr
  assert '5 rounds] test' in more.stdout
  assert _rounds(out) == [1, 2, 3, 4, 5]
  assert (out / 'metrics.jsonl').read_text().splitlines()[:3] == first
  assert _metrics(out) == _metrics(reference)  # Rows 4-5 trained now.
  assert (out / 'communication.csv').read_text() == \
      (reference / 'communication.csv').read_text()
  summary = _summary(out)
  assert summary['rounds'] == summary['flags']['num_rounds'] == 5
  assert summary['final_eval'] == _summary(reference)['final_eval']


def test_fewer_rounds_are_one_line(repo_root, tmp_path, reference):
  before = _files(reference)
  fewer = _binary(repo_root, reference, num_rounds=3, checkpoint_every=1)
  assert fewer.returncode == 2, fewer.stderr[-2000:]
  error = [l for l in fewer.stderr.splitlines() if 'error:' in l]
  assert len(error) == 1, fewer.stderr[-2000:]
  assert (f'{reference} holds 5 rounds; --num_rounds=3 is fewer: pass '
          '--num_rounds=5 for its result, more to continue') in error[0]
  assert 'Traceback' not in fewer.stderr and not fewer.stdout
  assert _files(reference) == before
  with pytest.raises(ConfigError, match='holds 5 rounds'):
    _run(reference, num_rounds=3, checkpoint_every=1)
  assert _files(reference) == before


def test_fewer_rounds_at_a_checkpoint_show_the_stored_result(
    repo_root, reference):
  before = _files(reference)
  row = outputs.read_metrics(reference / 'metrics.jsonl')[3]
  stored = _binary(repo_root, reference, num_rounds=4, checkpoint_every=1)
  assert stored.returncode == 0, stored.stderr[-2000:]
  lines = stored.stdout.splitlines()
  assert len(lines) == 1, stored.stdout
  assert 'result at round 4 (stored)' in lines[0]
  assert f'accuracy {row["eval/accuracy"]:.4f}' in lines[0]
  assert 'Resumed' not in stored.stderr and 'Round ' not in stored.stderr
  assert _files(reference) == before
  got = _run(reference, num_rounds=4, checkpoint_every=1)
  assert got['status'] == 'stored' and got['rounds'] == 4
  assert got['row'] == row
  assert _files(reference) == before


def test_finished_run_with_new_eval_every_runs_nothing(
    repo_root, reference):
  before = _files(reference)
  again = _binary(repo_root, reference, eval_every=2, checkpoint_every=1)
  assert again.returncode == 0, again.stderr[-2000:]
  assert again.stdout.splitlines() == [
      f'Nothing was run: {reference} holds all 5 rounds of this run; its '
      f'result is in {reference / "summary.json"}.']
  assert 'test accuracy' not in again.stdout + again.stderr
  assert _files(reference) == before


def test_overwrite_starts_over_a_folder_of_as_many_rounds_or_more(
    tmp_path):
  out = tmp_path / 'run'
  _run(out, num_rounds=2, checkpoint_every=1)
  summary = _run(out, num_rounds=1, checkpoint_every=1, overwrite=True)
  assert summary['rounds'] == 1 and _rounds(out) == [1]
  assert _latest_round(out) == 1
  _run(out, num_rounds=1, checkpoint_every=1, overwrite=True)
  assert _rounds(out) == [1]


def test_dp_target_epsilon_run_keeps_its_num_rounds(tmp_path):
  """z is calibrated to --num_rounds: such a run does not continue."""
  out = tmp_path / 'run'
  dp = dict(num_rounds=2, checkpoint_every=1,
            options={'dp_clip': 1.0, 'dp_target_epsilon': 50.0})
  try:
    _run(out, **dp)
  except evaluation.TrainingFailedError:
    pass  # Two noisy rounds may end worse than chance; the folder is kept.
  with pytest.raises(ConfigError, match=(
      r'calibrated to --num_rounds=2; pass --num_rounds=2')):
    _run(out, **dict(dp, num_rounds=3))
  assert _rounds(out) == [1, 2]


def test_eval_every_applies_to_the_rounds_still_to_run(tmp_path):
  out = tmp_path / 'run'
  _run(out, num_rounds=2, eval_every=5)
  _run(out, num_rounds=4, eval_every=1)
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  assert [r['round'] for r in rows if 'eval/accuracy' in r] == [2, 3, 4]


@pytest.fixture(scope='module')
def reference6(tmp_path_factory):
  out = tmp_path_factory.mktemp('reference6') / 'run'
  _run(out, num_rounds=6, checkpoint_every=4)
  return out


def test_sigint_stops_after_the_round_and_resumes_exactly(
    repo_root, tmp_path, reference6):
  out = tmp_path / 'run'
  flags = dict(num_rounds=6, checkpoint_every=4)
  stopped = _binary(repo_root, out, tmp_path, signal_at='SIGINT:3', **flags)
  assert stopped.returncode == 130, stopped.stderr[-2000:]
  assert 'Traceback' not in stopped.stderr
  assert 'KeyboardInterrupt' not in stopped.stderr
  assert ('Interrupted at round 3; checkpoint written; run the same command '
          'to resume') in stopped.stderr
  assert _rounds(out) == [1, 2, 3] and _latest_round(out) == 3
  assert not (out / 'summary.json').exists()
  rerun = _binary(repo_root, out, **flags)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  assert _metrics(out) == _metrics(reference6)
  assert (out / 'communication.csv').read_text() == \
      (reference6 / 'communication.csv').read_text()
  _, want = state_io.read_leaves(state_io.latest_checkpoint(
      reference6 / 'checkpoints'))
  _, got = state_io.read_leaves(state_io.latest_checkpoint(
      out / 'checkpoints'))
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)
  assert _summary(out)['communication'] == _summary(reference6)['communication']


def test_sigterm_exits_143(repo_root, tmp_path):
  out = tmp_path / 'run'
  stopped = _binary(repo_root, out, tmp_path, signal_at='SIGTERM:2',
                    num_rounds=4)
  assert stopped.returncode == 143, stopped.stderr[-2000:]
  assert 'Traceback' not in stopped.stderr
  assert 'Interrupted at round 2; checkpoint written' in stopped.stderr
  assert _rounds(out) == [1, 2] and _latest_round(out) == 2


class _SignalAt(Hook):

  def __init__(self, at):
    self.at = at

  def round_end(self, run, row):
    if row['round'] == self.at:
      signal.raise_signal(signal.SIGINT)


def test_run_raises_run_interrupted_and_restores_handlers(tmp_path):
  out = tmp_path / 'run'
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with pytest.raises(RunInterrupted) as e:
    run(RunConfig(output_dir=str(out), progress=False,
                  **dict(SETTINGS, num_rounds=4)), hooks=[_SignalAt(2)])
  assert e.value.signal_number == signal.SIGINT and e.value.round == 2
  assert (signal.getsignal(signal.SIGINT),
          signal.getsignal(signal.SIGTERM)) == before
  assert _rounds(out) == [1, 2] and _latest_round(out) == 2


def _default_dir(**settings):
  task = tasks.get_task(settings.get('task', 'emnist'))
  config = config_lib.resolve(RunConfig(**settings), task.defaults)
  return start.default_output_dir(config)


def test_default_folder_names_are_readable_and_distinct():
  base = _default_dir(task='emnist')
  igc = _default_dir(task='emnist', options={
      'upload': 'intrinsic_projection:4096,uniform_quantization:8'})
  dp = _default_dir(task='emnist', options={'dp_clip': 1.0,
                                            'dp_target_epsilon': 8.0})
  dpz = _default_dir(task='emnist', seed=2, options={
      'dp_clip': 1.0, 'dp_noise_multiplier': 0.5})
  down = _default_dir(task='emnist', options={
      'upload': 'top_k:5000,terngrad', 'download': 'uniform_quantization:16'})
  assert re.fullmatch(r'runs/emnist_fedavg_seed0_[0-9a-f]{8}', base), base
  assert re.fullmatch(r'runs/emnist_fedavg_up-igc4096-q8_seed0_[0-9a-f]{8}',
                      igc), igc
  assert re.fullmatch(r'runs/emnist_fedavg_dp-eps8_seed0_[0-9a-f]{8}', dp), dp
  assert re.fullmatch(r'runs/emnist_fedavg_dp-z0.5_seed2_[0-9a-f]{8}',
                      dpz), dpz
  assert re.fullmatch(
      r'runs/emnist_fedavg_up-topk5000-tern_down-q16_seed0_[0-9a-f]{8}',
      down), down
  assert len({base, igc, dp, dpz, down}) == 5
  # The hash is that of the result flags but the seed: seeds share it.
  assert _default_dir(task='emnist', seed=1)[-8:] == base[-8:]


def test_rerun_of_a_failed_run_stays_an_error(tmp_path):
  out = tmp_path / 'run'
  _run(out, num_rounds=1, checkpoint_every=1)
  summary = dict(_summary(out), status='failed', failure='test loss nan')
  (out / 'summary.json').write_text(json.dumps(summary))
  before = _files(out)
  with pytest.raises(evaluation.TrainingFailedError,
                     match=r'Nothing was run: .* \(status "failed": test '
                     r'loss nan\); pass --overwrite'):
    _run(out, num_rounds=1, checkpoint_every=1)
  assert _files(out) == before
