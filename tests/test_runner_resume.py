"""A run killed at any moment continues (or starts over) with the same command.

The binary ``experiments/run_experiment.py`` is SIGKILLed at chosen moments
(a driver makes the process kill itself there, so nothing of Python's
cleanup runs) and at a random one; the same command then completes, and
its final parameters, metrics.jsonl (all but the timings) and
communication.csv equal those of an uninterrupted run.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from fedlite_jax.training import state_io
from fedlite_jax.training import ConfigError
from fedlite_jax.training import RunConfig
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import outputs
from fedlite_jax.training import round_metrics
from fedlite_jax.training import run
from fedlite_jax.training import tasks

# embedded_mnist in 100 clients: 3 clients of 2 local steps per round.
# Evaluations every round; checkpoints after rounds 3 and 5 (the end).
SETTINGS = dict(task='embedded_mnist', num_clients=100, clients_per_round=3,
                client_batch_size=20, eval_num_clients=5, seed=3,
                num_rounds=5, eval_every=1, checkpoint_every=3)

# Kills the process (SIGKILL, no cleanup) at the moment named by
# $FEDLITE_KILL_AT = '<what>:<n>', then runs the binary.
_DRIVER = textwrap.dedent('''
    import json, os, runpy, signal, sys, tempfile

    def die():
      os.kill(os.getpid(), signal.SIGKILL)

    what, n = os.environ['FEDLITE_KILL_AT'].split(':')
    n, count = int(n), [0]

    def nth():
      count[0] += 1
      return count[0] == n

    if what == 'evaluate':  # before the n-th evaluation
      from fedlite_jax.training import evaluation
      real_evaluate = evaluation.evaluate
      def evaluate(*args, **kwargs):
        if nth():
          die()
        return real_evaluate(*args, **kwargs)
      evaluation.evaluate = evaluate
    elif what == 'checkpoint_write':  # the n-th checkpoint written, not
      # yet renamed into place (orbax's atomic rename, in its save thread)
      from orbax.checkpoint._src.path import atomicity
      real_finalize = atomicity.AtomicRenameTemporaryPath.finalize
      async def finalize(self):
        if self.get_final().name.isdigit() and nth():
          die()
        return await real_finalize(self)
      atomicity.AtomicRenameTemporaryPath.finalize = finalize
    elif what == 'metrics_line':  # amid the n-th metrics.jsonl line, once
      # the checkpoints saved so far are complete (they are written in the
      # background)
      import orbax.checkpoint as ocp
      from fedlite_jax.training.hooks import metrics_file
      managers = []
      real_init = ocp.CheckpointManager.__init__
      def init(self, *args, **kwargs):
        managers.append(self)
        real_init(self, *args, **kwargs)
      ocp.CheckpointManager.__init__ = init
      real_write = metrics_file.MetricsFileHook.round_end
      def write(self, run, row):
        if nth():
          for manager in managers:
            manager.wait_until_finished()
          with (run.scratch / 'metrics.jsonl').open('a') as f:
            f.write(json.dumps(row)[:25])
          with (run.scratch / 'communication.csv').open('a') as f:
            f.write('5,clie')
          die()
        real_write(self, run, row)
      metrics_file.MetricsFileHook.round_end = write
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name='__main__')
''')


def _flags(out_dir):
  return [f'--{k}={v}' for k, v in SETTINGS.items()] + [
      f'--output_dir={out_dir}', '--noprogress']


def _env(repo_root, **extra):
  return dict(os.environ, PYTHONPATH=str(repo_root), **extra)


def _binary(repo_root, out_dir, kill_at=None, tmp_path=None):
  script = str(repo_root / 'experiments' / 'run_experiment.py')
  if kill_at is None:
    cmd = [sys.executable, script, *_flags(out_dir)]
    env = _env(repo_root)
  else:
    driver = tmp_path / 'kill_driver.py'
    driver.write_text(_DRIVER)
    cmd = [sys.executable, str(driver), script, *_flags(out_dir)]
    env = _env(repo_root, FEDLITE_KILL_AT=kill_at)
  return subprocess.run(cmd, capture_output=True, text=True, env=env,
                        timeout=300)


def _final_leaves(out_dir):
  return state_io.read_leaves(
      state_io.latest_checkpoint(out_dir / 'checkpoints'))


def _partial_saves(out_dir):
  """Temporary directories of orbax saves killed mid-way."""
  return list((out_dir / 'checkpoints').glob('*.orbax-checkpoint-tmp*'))


def _metrics(out_dir):
  return [{k: v for k, v in json.loads(line).items()
           if not round_metrics.varies_between_runs(k)}
          for line in (out_dir / 'metrics.jsonl').read_text().splitlines()]


def _assert_equal_runs(reference, resumed):
  ref_round, ref_leaves = _final_leaves(reference)
  got_round, got_leaves = _final_leaves(resumed)
  assert got_round == ref_round == SETTINGS['num_rounds']
  assert len(got_leaves) == len(ref_leaves)
  for a, b in zip(ref_leaves, got_leaves):
    np.testing.assert_array_equal(a, b)
  assert _metrics(resumed) == _metrics(reference)
  assert (resumed / 'communication.csv').read_text() == \
      (reference / 'communication.csv').read_text()
  ref = json.loads((reference / 'summary.json').read_text())
  got = json.loads((resumed / 'summary.json').read_text())
  assert got['final_eval'] == ref['final_eval']
  assert got['communication'] == ref['communication']
  assert not _partial_saves(resumed)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The uninterrupted run (in this process; same flags as the binary)."""
  out = tmp_path_factory.mktemp('reference') / 'run'
  run(RunConfig(output_dir=str(out), progress=False, **SETTINGS))
  return out


@pytest.mark.parametrize('kill_at,expect', [
    # After the first evaluation, before the first checkpoint: no
    # checkpoint yet, so the rerun starts over from round 0.
    ('evaluate:2', dict(rows=1, checkpoint=None, partial=False)),
    # Amid the first checkpoint's save (written, not renamed): its
    # temporary directory is left behind.
    ('checkpoint_write:1', dict(rows=3, checkpoint=None, partial=True)),
    # Amid the round-4 metrics line (and a CSV row), after the round-3
    # checkpoint: resumes there and drops the partial lines.
    ('metrics_line:4', dict(rows=3, checkpoint=3, partial=False)),
])
def test_killed_binary_reruns_to_the_uninterrupted_result(
    repo_root, tmp_path, reference, kill_at, expect):
  out = tmp_path / 'run'
  killed = _binary(repo_root, out, kill_at, tmp_path)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  # The kill happened where intended.
  complete = (out / 'metrics.jsonl').read_text().split('\n')[:-1]
  assert len(complete) == expect['rows']
  latest = state_io.latest_checkpoint(out / 'checkpoints')
  assert (latest and _final_leaves(out)[0]) == expect['checkpoint']
  assert bool(_partial_saves(out)) == expect['partial']
  rerun = _binary(repo_root, out)
  assert rerun.returncode == 0, rerun.stderr[-2000:]
  _assert_equal_runs(reference, out)


def test_killed_after_a_random_delay(repo_root, tmp_path, reference):
  out = tmp_path / 'run'
  proc = subprocess.Popen(
      [sys.executable, str(repo_root / 'experiments' / 'run_experiment.py'),
       *_flags(out)], env=_env(repo_root), stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 240
    while not (out / 'metrics.jsonl').exists() and proc.poll() is None:
      assert time.monotonic() < deadline, 'no metrics within 240 s'
      time.sleep(0.05)
    delay = random.uniform(0.0, 3.0)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.wait(timeout=60)
  rerun = _binary(repo_root, out)
  assert rerun.returncode == 0, (delay, rerun.stderr[-2000:])
  _assert_equal_runs(reference, out)


def test_second_run_into_a_locked_output_dir_fails(repo_root, tmp_path):
  out = tmp_path / 'run'
  out.mkdir()
  holder = subprocess.Popen(
      [sys.executable, '-c', textwrap.dedent('''
          import sys
          from fedlite_jax.training import outputs
          with outputs.lock_output_dir(sys.argv[1]):
            print('locked', flush=True)
            sys.stdin.read()
      '''), str(out)],
      env=_env(repo_root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    second = _binary(repo_root, out)
  finally:
    holder.stdin.close()
    holder.wait(timeout=60)
  assert second.returncode == 2
  assert (f'--output_dir={out} is in use by another run (pid {holder.pid}'
          in second.stderr)
  assert 'Traceback' not in second.stderr
  assert not (out / 'metrics.jsonl').exists()


def test_locked_output_dir_in_process(tmp_path):
  out = tmp_path / 'run'
  out.mkdir()
  with outputs.lock_output_dir(out):
    with pytest.raises(ConfigError, match=f'pid {os.getpid()} holds'):
      run(RunConfig(output_dir=str(out), progress=False, **SETTINGS))
  # Released: the lock can be taken again.
  with outputs.lock_output_dir(out):
    pass


def test_run_identity_decides_between_restart_and_refusal(tmp_path):
  """Without a checkpoint, run.json tells this run's results from others'."""
  cfg = dict(SETTINGS, num_rounds=1, checkpoint_every=0, progress=False)
  resolved = config_lib.resolve(RunConfig(**cfg),
                                tasks.get_task(cfg['task']).defaults)
  out = tmp_path / 'run'
  out.mkdir()
  (out / 'metrics.jsonl').write_text('{"round": 1, "accuracy": 0.5}\n{"rou')
  (out / 'checkpoints' / '3.orbax-checkpoint-tmp').mkdir(parents=True)
  # Another run's identity: refused, naming the differing flag.
  outputs.write_run_identity(out, {**resolved.fingerprint(), 'client_lr': 0.5})
  with pytest.raises(ConfigError, match=r'client_lr: run.json=0.5 now=0.1'):
    run(RunConfig(output_dir=str(out), **cfg))
  # This run's identity (killed before its first checkpoint): starts over.
  outputs.write_run_identity(out, resolved.fingerprint())
  with pytest.raises(ConfigError, match='--noresume was given'):
    run(RunConfig(output_dir=str(out), resume=False, **cfg))
  run(RunConfig(output_dir=str(out), **cfg))
  assert [r['round'] for r in outputs.read_metrics(out / 'metrics.jsonl')] == [1]
  assert not _partial_saves(out)
  assert outputs.read_run_identity(out) == json.loads(
      json.dumps(resolved.fingerprint()))


def test_truncation_drops_partial_lines(tmp_path):
  metrics = tmp_path / 'metrics.jsonl'
  metrics.write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n{"round": 4, "lo')
  assert outputs.read_metrics(metrics) == [{'round': r} for r in (1, 2, 3, 4)][:3]
  assert outputs.truncate_metrics(metrics, 2) == [{'round': 1}, {'round': 2}]
  assert metrics.read_text() == '{"round": 1}\n{"round": 2}\n'
  csv = tmp_path / 'communication.csv'
  csv.write_text('round,client_id,upload_bits,download_bits\n'
                 '1,a,1,2\n2,a,1,2\n3,a,1,2\n4,a')
  outputs.truncate_csv(csv, 2)  # Rounds from 1, as in metrics.jsonl.
  assert csv.read_text() == ('round,client_id,upload_bits,download_bits\n'
                             '1,a,1,2\n2,a,1,2\n')
  csv.write_text('round,client_')  # killed amid the header
  outputs.truncate_csv(csv, 2)
  assert not csv.exists()


def test_msgpack_checkpoints_of_644e428_are_one_clear_line(repo_root, tmp_path):
  """A run directory of the earlier msgpack format: its rerun stops with
  one line naming what to do; --noresume --overwrite starts it over."""
  out = tmp_path / 'run'
  (out / 'checkpoints').mkdir(parents=True)
  legacy = repo_root / 'tests' / 'golden' / 'ckpt_00000002.msgpack'
  shutil.copy(legacy, out / 'checkpoints' / legacy.name)
  (out / 'metrics.jsonl').write_text('{"round": 2, "accuracy": 0.5}\n')
  rerun = _binary(repo_root, out)
  assert rerun.returncode == 2, rerun.stderr[-2000:]
  error = [l for l in rerun.stderr.splitlines() if 'error:' in l]
  assert len(error) == 1 and 'ckpt_00000002.msgpack' in error[0], error
  assert '644e428' in error[0] and '--noresume --overwrite' in error[0]
  assert 'Traceback' not in rerun.stderr
  run(RunConfig(output_dir=str(out), progress=False, resume=False,
                overwrite=True, **dict(SETTINGS, num_rounds=1)))
  assert not state_io.legacy_checkpoints(out / 'checkpoints')
  assert _final_leaves(out)[0] == 1
