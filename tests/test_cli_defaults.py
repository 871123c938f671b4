"""What a user sees at the command line of ``experiments/run_experiment.py``.

* ``--helpfull`` shows every flag's default (the task defaults per task for
  the flags that take them) and no flag of the libraries it imports.
* ``--validate_only`` prints ``--num_rounds`` and no flag the task refuses;
  its flags line is accepted back by the binary.
* Missing data: ``--validate_only`` and the run print the same message,
  naming CLI flags (``--allow_download``), not Python arguments.
* A DP run shows epsilon on its evaluation lines and in its final lines;
  a DP run worse than chance names the noise std on the mean.
* ``RunConfig`` takes algorithm options as keywords; ``--plot_format``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import evaluation
from fedlite_jax.training import plots
from fedlite_jax.training import tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
BINARY = ROOT / 'experiments' / 'run_experiment.py'
EMB = ['--num_clients=5', '--clients_per_round=2',
       '--max_examples_per_client=10']


def _run(args, tmp_path, **env):
  full_env = dict(os.environ, **env)
  full_env.setdefault('JAX_PLATFORMS', 'cpu')
  return subprocess.run([sys.executable, str(BINARY), *args],
                        capture_output=True, text=True, timeout=900,
                        cwd=tmp_path, env=full_env)


def _flag_blocks(helpfull: str) -> dict[str, str]:
  """``{flag: its help block}`` of the binary's own section."""
  own = helpfull.split('run_experiment.py:\n', 1)[1].split('\nabsl.flags:')[0]
  blocks = re.split(r'\n  (?=--)', '\n' + own)
  out = {}
  for block in blocks:
    m = re.match(r'--(?:\[no\])?(\w+)', block.strip())
    if m:
      out[m[1]] = block
  return out


def test_helpfull_shows_defaults_and_only_our_flags(tmp_path):
  proc = _run(['--helpfull'], tmp_path)
  text = proc.stdout
  assert '--num_rounds' in text, proc.stderr[-2000:]
  for foreign in ('--xml_output_file', '--test_srcdir', '--test_tmpdir',
                  'orbax', '--log_dir', '--only_check_args'):
    assert foreign not in text, foreign
  assert '--flagfile' in text
  blocks = _flag_blocks(text)
  assert len(blocks) > 60, sorted(blocks)
  missing = [n for n, b in blocks.items() if 'default' not in b]
  assert not missing, missing
  rounds = ' '.join(blocks['num_rounds'].split())
  assert 'task default: embedded_mnist 100;' in rounds, rounds
  for name, task in tasks.TASKS.items():  # Each task's own value.
    value = task.defaults['num_rounds']
    assert re.search(rf'{name}[\w, ]* {value}\b', rounds), (name, rounds)
  assert 'task default:' in blocks['client_lr']
  assert 'task default:' in blocks['clients_per_round']


def _validate_flags(proc) -> str:
  line = [l for l in proc.stdout.splitlines() if l.startswith('  flags: ')]
  assert len(line) == 1, proc.stdout + proc.stderr[-2000:]
  return line[0][len('  flags: '):]


@pytest.mark.parametrize('task', ['embedded_mnist', 'emnist'])
def test_validate_only_prints_num_rounds_and_no_refused_flag(task, tmp_path):
  if task == 'emnist' and not os.environ.get('FEDLITE_DATA_DIR'):
    pytest.skip('emnist needs $FEDLITE_DATA_DIR')
  proc = _run([f'--task={task}', '--validate_only',
               f'--output_dir={tmp_path}/out'], tmp_path)
  if task == 'emnist' and "Could not find the 'emnist'" in proc.stderr:
    pytest.skip('no EMNIST under $FEDLITE_DATA_DIR')
  assert proc.returncode == 0, proc.stderr[-2000:]
  flags = _validate_flags(proc)
  rounds = tasks.TASKS[task].defaults['num_rounds']
  assert f'--num_rounds={rounds} ' in flags, flags
  assert '=None' not in flags, flags
  if task == 'emnist':
    assert '--num_clients' not in flags and '--dirichlet_alpha' not in flags
  assert '--server_beta1' not in flags  # server SGD: refused.
  # Every printed flag is one the binary takes for this task.
  again = _run(['--validate_only', f'--output_dir={tmp_path}/out',
                *flags.split()], tmp_path)
  assert again.returncode == 0, again.stderr[-2000:]
  assert _validate_flags(again) == flags


def _error_lines(stderr: str) -> list[str]:
  lines = stderr.splitlines()
  first = next(i for i, l in enumerate(lines)
               if l.startswith('run_experiment.py: error:'))
  return lines[first:]


def test_missing_data_message_is_the_runs_with_cli_flags(tmp_path):
  empty = tmp_path / 'data'
  empty.mkdir()
  env = dict(FEDLITE_DATA_DIR=str(empty), HOME=str(tmp_path / 'home'))
  args = ['--task=emnist', '--num_rounds=1', '--noprogress',
          f'--output_dir={tmp_path}/out']
  check = _run(args + ['--validate_only'], tmp_path, **env)
  run = _run(args, tmp_path, **env)
  assert check.returncode == run.returncode == 2, run.stderr[-2000:]
  lines = _error_lines(check.stderr)
  assert lines == _error_lines(run.stderr)
  text = '\n'.join(lines)
  assert 'Searched, in order:' in text and str(empty) in text, text
  assert 'pass --allow_download' in text, text
  assert 'allow_download=True' not in text and 'data_dir argument' not in text


def test_dp_run_shows_epsilon_on_eval_and_final_lines(tmp_path):
  out = tmp_path / 'out'
  proc = _run(['--clients_per_round=5', '--num_rounds=2', '--eval_every=1',
               '--dp_clip=1',
                     '--dp_noise_multiplier=0.01', '--noprogress',
                     '--plot_format=svg', f'--output_dir={out}'], tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  evals = [l for l in proc.stderr.splitlines()
           if re.search(r'Round \d/2: .*accuracy', l)]
  assert len(evals) == 2 and all('eps=' in l and 'delta=1e-06' in l
                                 for l in evals), proc.stderr[-3000:]
  final = [l for l in proc.stdout.splitlines() if l.startswith('privacy: ')]
  assert len(final) == 1 and 'eps=' in final[0], proc.stdout
  assert 'noise std 0.002 per coordinate' in final[0], final  # 0.01*1/5
  assert (out / 'curves.svg').exists() and not (out / 'curves.png').exists()


def test_dp_failure_names_the_noise_on_the_mean():
  config = config_lib.resolve(
      config_lib.RunConfig(clients_per_round=5, dp_clip=1.0,
                           dp_noise_multiplier=1.0),
      tasks.TASKS['embedded_mnist'].defaults)
  dp = dp_options.resolve(config, 50, 1000)
  privacy = {**dp.describe(2), 'final_clip_norm': 1.0}
  assert evaluation.mean_noise_std(privacy) == pytest.approx(0.2)
  with pytest.raises(evaluation.TrainingFailedError) as e:
    evaluation.check_trained({'loss': 9.0}, 2.3, '/tmp/x', privacy=privacy)
  text = str(e.value)
  assert '\n' not in text
  for part in ('z*C/M = 1*1/5 = 0.2', 'eps=', '--clients_per_round',
               '--dp_noise_cohort_size', '--server_lr', '/tmp/x'):
    assert part in text, (part, text)
  with pytest.raises(evaluation.TrainingFailedError, match='--client_lr'):
    evaluation.check_trained({'loss': 9.0}, 2.3)


def test_run_config_takes_options_as_keywords():
  a = config_lib.RunConfig(upload='uniform_quantization:8', dp_clip=0.5,
                           options={'download': 'uniform_quantization:16'})
  assert a.options == {'upload': 'uniform_quantization:8', 'dp_clip': 0.5,
                       'download': 'uniform_quantization:16'}
  assert a == config_lib.RunConfig(options=dict(a.options))
  with pytest.raises(TypeError, match="'uplod'.*options="):
    config_lib.RunConfig(uplod='uniform_quantization:8')


def test_plot_format_is_checked_at_parse_time(tmp_path):
  assert config_lib.PLOT_FORMATS == plots.FORMATS
  assert 'plot_format' in config_lib.RunConfig.NON_RESULT_FIELDS
  proc = _run(EMB + ['--plot_format=jpg', '--validate_only'], tmp_path)
  assert proc.returncode != 0
  errors = [l for l in proc.stderr.splitlines() if 'plot_format' in l]
  assert errors and 'png' in errors[0] and 'svg' in errors[0], proc.stderr
  with pytest.raises(config_lib.ConfigError, match='--plot_format'):
    config_lib.resolve(config_lib.RunConfig(plot_format='jpg'),
                       tasks.TASKS['embedded_mnist'].defaults)
