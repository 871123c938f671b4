"""Task defaults train; runs that do not are failures, never results.

* Each task whose data is here runs its DEFAULT settings (optimizers,
  learning rates, clipping, batch size) for a few rounds, with only the
  number of rounds, the cohort and the evaluated test clients reduced for
  speed, and its test loss must be finite and below the initial model's on
  the same test batches. Shakespeare also runs with 8-bit uniform upload
  quantization and PVT 40%, which diverged to perplexity ~1e300 with the
  old defaults (client SGD 1.0 without clipping).
* ``evaluation.training_failure`` / ``check_trained``: the worse-than-chance
  rule on hand-computed values.
* A diverging run ends with ``TrainingFailedError`` (exit 2 from the
  binary) after writing summary.json with status 'failed'.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from fedlite_jax import datasets
from fedlite_jax.training import RunConfig
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import evaluation
from fedlite_jax.training import run
from fedlite_jax.training import tasks

_REPO = pathlib.Path(__file__).resolve().parent.parent


def _data_dir_with(subdir: str) -> str:
  """FEDLITE_DATA_DIR if it holds ``subdir``, else skips the test."""
  root = os.environ.get('FEDLITE_DATA_DIR')
  if not root or not (pathlib.Path(root) / subdir).is_dir():
    pytest.skip(f'needs {subdir}/ under FEDLITE_DATA_DIR (now {root!r})')
  return root


def _initial_loss(config: RunConfig) -> float:
  """Test loss of the runner's initial model on the runner's eval batches."""
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  _, test_fd, info = task.load_data(config)
  model = task.build_model(config, info).model
  batches = evaluation.eval_batches(test_fd, config.eval_batch_size,
                                    config.eval_num_clients, config.seed)
  return evaluation.evaluate(model, model.init(jax.random.PRNGKey(config.seed)),
                             batches)['loss']


def _check_defaults_train(tmp_path, task_name, **overrides):
  """Runs ``task_name``'s defaults (plus ``overrides``) and checks the loss."""
  defaults = tasks.get_task(task_name).defaults
  for key in ('client_optimizer', 'client_lr', 'client_clip_norm',
              'server_optimizer', 'server_lr', 'server_eps',
              'client_batch_size', 'max_examples_per_client'):
    assert key not in overrides, key  # The settings under test.
  config = RunConfig(task=task_name, output_dir=str(tmp_path / task_name),
                     progress=False, **overrides)
  summary = run(config)
  final = summary['final_eval']
  initial = _initial_loss(config)
  assert summary['status'] == 'ok' and summary['failure'] is None
  assert math.isfinite(final['loss'])
  assert final['loss'] < initial, (final, initial)
  resolved = summary['flags']
  for key in ('client_lr', 'server_lr', 'server_optimizer', 'client_clip_norm'):
    if key in defaults:
      assert resolved[key] == defaults[key], key
  return summary, initial


def test_embedded_mnist_defaults_train(tmp_path):
  _check_defaults_train(tmp_path, 'embedded_mnist', num_rounds=2,
                        clients_per_round=5)


def test_emnist_defaults_train(tmp_path):
  _data_dir_with('femnist105')
  _check_defaults_train(tmp_path, 'emnist', num_rounds=2, clients_per_round=5,
                        eval_num_clients=20)


def test_shakespeare_defaults_train(tmp_path):
  _data_dir_with('shakespeare')
  summary, initial = _check_defaults_train(
      tmp_path, 'shakespeare', num_rounds=3, clients_per_round=5,
      eval_num_clients=40)
  ppl = summary['final_eval']['perplexity']
  assert ppl == pytest.approx(math.exp(summary['final_eval']['loss']),
                              rel=1e-6)
  assert ppl < math.exp(initial)


def test_shakespeare_defaults_train_with_8bit_upload_and_pvt(tmp_path):
  _data_dir_with('shakespeare')
  summary, _ = _check_defaults_train(
      tmp_path, 'shakespeare', num_rounds=3, clients_per_round=5,
      eval_num_clients=40,
      options={'upload': 'uniform_quantization:8', 'pvt_fraction': 0.4})
  # The compression was on: 8 of 32 bits on at most ~40% of the variables.
  assert summary['communication']['upload_compression'] > 4


# --- The worse-than-chance rule -------------------------------------------


def test_chance_loss_values():
  assert evaluation.chance_loss(10) == pytest.approx(2.302585093)
  assert evaluation.chance_loss(62) == pytest.approx(4.127134385)
  # 1,000 independent sigmoids at logit 0: 1000 * log 2.
  assert evaluation.chance_loss(1000, multilabel=True) == pytest.approx(
      693.1471806)
  with pytest.raises(ValueError, match='num_classes=1'):
    evaluation.chance_loss(1)


def _info(num_classes: int) -> tasks.LoadedInfo:
  return tasks.LoadedInfo(datasets.DatasetInfo(
      task='t', num_classes=num_classes, input_shape=(1,), x_dtype='int32',
      y_dtype='int32', num_train_clients=1, num_test_clients=1,
      format='embedded', source='test'), 'test')


def test_task_chance_loss_uses_output_classes():
  assert tasks.TASKS['shakespeare'].chance_loss(_info(10004)) == pytest.approx(
      math.log(10004))
  assert tasks.TASKS['emnist'].chance_loss(_info(62)) == pytest.approx(
      math.log(62))
  assert tasks.TASKS['stackoverflow_tag'].chance_loss(
      _info(1000)) == pytest.approx(1000 * math.log(2))


def test_chance_limit_values():
  # chance + max(1 nat, 10% of chance).
  assert evaluation.chance_limit(math.log(10)) == pytest.approx(3.302585093)
  assert evaluation.chance_limit(math.log(62)) == pytest.approx(5.127134385)
  assert evaluation.chance_limit(1000 * math.log(2)) == pytest.approx(
      762.4618986)
  with pytest.raises(ValueError, match='chance=0'):
    evaluation.chance_limit(0.0)


@pytest.mark.parametrize('metrics,passes', [
    # FedLite on FEMNIST after 2 rounds (tests/golden): below log 62.
    ({'loss': 4.090640068054199, 'accuracy': 0.05}, True),
    # A short run on label-skewed clients, somewhat above chance (4.127).
    ({'loss': 4.6, 'accuracy': 0.02}, True),
    # Limit log(62) + 1 = 5.12713: just below passes, just above fails.
    ({'loss': 5.1270, 'accuracy': 0.02}, True),
    ({'loss': 5.1273, 'accuracy': 0.02}, False),
    ({'loss': 9.2e9, 'accuracy': 0.02}, False),
    ({'loss': float('nan'), 'accuracy': 0.02}, False),
    ({'loss': 1.0, 'accuracy': float('nan')}, False),
    # Read back from metrics.jsonl, non-finite values are strings.
    ({'loss': 'inf', 'accuracy': 0.0}, False),
])
def test_training_failure_classification(metrics, passes):
  reason = evaluation.training_failure(metrics, math.log(62))
  assert (reason is None) == passes, reason


def test_training_failure_language_model_uses_perplexity():
  chance = math.log(10004)
  # The old Shakespeare defaults with 8-bit upload + PVT: ppl ~1e300.
  reason = evaluation.training_failure(
      {'loss': 9.2e9, 'perplexity': 1e300, 'accuracy': 0.01}, chance)
  assert reason is not None and '1e+300' in reason
  # Limit e * 10,004 = 27,193.7: ppl 27,150 passes, 27,250 fails, whatever
  # the 'loss' key holds (a per-sequence loss of 150 would fail the loss
  # rule).
  assert evaluation.training_failure(
      {'loss': 150.0, 'perplexity': 27150.0}, chance) is None
  reason = evaluation.training_failure(
      {'loss': 150.0, 'perplexity': 27250.0}, chance)
  assert reason is not None and '27193.7' in reason
  assert evaluation.training_failure(
      {'loss': 5.0, 'perplexity': 148.4}, chance) is None


def test_check_trained_raises_one_clear_line():
  evaluation.check_trained({'loss': 3.3}, math.log(10))
  with pytest.raises(evaluation.TrainingFailedError) as e:
    evaluation.check_trained({'loss': 8.0}, math.log(10), output_dir='/o')
  message = str(e.value)
  assert '\n' not in message
  assert 'test loss 8 ' in message and 'limit 3.30259' in message
  assert '/o' in message
  assert isinstance(e.value, FloatingPointError)


def test_training_failure_rejects_bad_arguments():
  with pytest.raises(ValueError, match='chance=0'):
    evaluation.training_failure({'loss': 1.0}, 0.0)
  with pytest.raises(ValueError, match='neither loss nor perplexity'):
    evaluation.training_failure({'accuracy': 0.5}, 1.0)


# --- A diverging run fails ------------------------------------------------

# Server SGD at 30 blows the CNN's weights up within two rounds: the test
# loss is finite (~8 nats) but far above the limit log(10) + 1 = 3.30, so no
# non-finite update stops the run earlier and only the final check catches
# it.
_DIVERGING = dict(task='embedded_mnist', num_clients=12, clients_per_round=3,
                  client_batch_size=32, num_rounds=2, server_lr=30.0, seed=3,
                  progress=False)


def test_diverging_run_fails_after_writing_its_outputs(tmp_path):
  out = tmp_path / 'diverged'
  flags = [f'--{k}={v}' for k, v in _DIVERGING.items()]
  proc = subprocess.run(
      [sys.executable, str(_REPO / 'experiments' / 'run_experiment.py'),
       *flags, f'--output_dir={out}'],
      capture_output=True, text=True, cwd=_REPO, timeout=900,
      env={**os.environ, 'PYTHONPATH': str(_REPO)})
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines() if 'error:' in l]
  assert len(lines) == 1, proc.stderr[-2000:]
  assert 'Training failed: test loss' in lines[0]
  assert 'worse than chance' in lines[0]
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['status'] == 'failed'
  assert 'worse than chance' in summary['failure']
  assert summary['final_eval']['loss'] > math.log(10) + 1
  assert (out / 'metrics.jsonl').exists()
