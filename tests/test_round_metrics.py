"""Per-round training metrics: one metrics.jsonl row and one TensorBoard
point per round, evaluations merged in, the run's hparams in TensorBoard.

Independent expectations: round 1's training loss recomputed by a plain
Python loop over the same clients, keys and batches (FedJAX's model and
optax, no round engine); ``fedjax.model_grad``'s gradients; hand-computed
weighted means; the event files read back.
"""

from __future__ import annotations

import math

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import models
from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import rounds_common
from fedlite_jax.training import RunConfig
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import outputs
from fedlite_jax.training import round_metrics
from fedlite_jax.training import run
from fedlite_jax.training import runner
from fedlite_jax.training import tasks

TINY = dict(task='embedded_mnist', num_clients=20, clients_per_round=3,
            client_batch_size=20, max_examples_per_client=60,
            eval_num_clients=4, progress=False, seed=5, checkpoint_every=0)


def _batch(n, masked):
  rng = np.random.RandomState(0)
  batch = {'x': rng.rand(n, 28, 28, 1).astype(np.float32),
           'y': rng.randint(0, 10, n).astype(np.int32)}
  if masked:
    batch[fedjax.EXAMPLE_MASK_KEY] = np.arange(n) < n - 3
  return batch


@pytest.mark.parametrize('masked', [False, True])
def test_train_grad_gives_model_grads_and_the_batch_loss(masked):
  model = models.create_emnist_cnn(num_classes=10).model
  params = model.init(jax.random.PRNGKey(0))
  batch = _batch(8, masked)
  rng = jax.random.PRNGKey(1)
  fn = rounds_common.train_grad(model)
  want = fedjax.model_grad(model)(params, batch, rng)
  grads, stats = fn.with_stats(params, batch, rng)
  # value_and_grad of the same loss: the same gradients, to the bit.
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(fn(params, batch,
                                                            rng))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The loss and accuracy of the real examples, from the logits by hand.
  logits = np.asarray(model.apply_for_train(params, batch, rng), np.float64)
  real = (batch[fedjax.EXAMPLE_MASK_KEY] if masked
          else np.ones(8, bool))
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  losses = -logp[np.arange(8), batch['y']]
  assert float(stats['loss'].weight) == real.sum()
  np.testing.assert_allclose(float(stats['loss'].result()),
                             losses[real].mean(), rtol=1e-5)
  correct = logits.argmax(-1) == batch['y']
  np.testing.assert_allclose(float(stats['accuracy'].result()),
                             correct[real].mean(), rtol=1e-6)


def test_train_metrics_weight_by_examples_and_drop_skipped_clients():
  diags = {
      b'a': {'train_loss': 1.0, 'train_accuracy': 0.5, 'train_examples': 30,
             'delta_l2_norm': 2.0, 'num_examples': 99},
      b'b': {'train_loss': 4.0, 'train_accuracy': 0.0, 'train_examples': 10,
             'delta_l2_norm': 5.0},
      b'c': {'train_loss': float('nan'), 'delta_l2_norm': 0.0,
             'skipped': True},
      # Split learning reports no train_examples: num_examples weighs.
  }
  got = round_metrics.train_metrics(diags)
  assert got == {'train/loss': (30 * 1.0 + 10 * 4.0) / 40,
                 'train/accuracy': 30 * 0.5 / 40,
                 'train/delta_norm_mean': 3.5, 'train/delta_norm_max': 5.0}
  split = round_metrics.train_metrics(
      {b'a': {'train_loss': 2.0, 'num_examples': 3.0},
       b'b': {'train_loss': 6.0, 'num_examples': 1.0}})
  assert split == {'train/loss': 3.0}
  assert round_metrics.train_metrics({b'a': {'upload_bits': 1.0}}) == {}


def test_engine_counts_flow_through_whatever_their_names():
  counts = {'name': 'vmap', 'lanes': 4, 'segment_steps': 4, 'slots': 2,
            'clients': 3, 'useful_steps': 9, 'segments': 2,
            'longest_client_steps': 5, 'compilations': 1}
  row = round_metrics.engine_metrics(counts)
  assert row == {'engine/clients': 3, 'engine/useful_steps': 9,
                 'engine/segments': 2, 'engine/longest_client_steps': 5,
                 'engine/compilations': 1}
  assert [k for k in row if round_metrics.varies_between_runs(k)] == [
      'engine/compilations']
  assert round_metrics.varies_between_runs('time/train_seconds')
  assert round_metrics.varies_between_runs(
      'engine/client_program_compilations')
  assert round_metrics.varies_between_runs('engine/compile_seconds')
  assert not round_metrics.varies_between_runs('engine/segments')
  assert not round_metrics.varies_between_runs('train/loss')
  # Sums, but the longest client is a maximum over the rounds.
  assert round_metrics.engine_totals(
      [row, {'engine/segments': 5, 'engine/longest_client_steps': 3},
       {'round': 0}]) == {'clients': 3, 'useful_steps': 9, 'segments': 7,
                          'longest_client_steps': 5, 'compilations': 1}


def test_one_schema_and_rows_written_before_it():
  train_row = {'round': 3, 'train/loss': 1.0, 'comm/upload_bytes': 8.0}
  eval_row = {**train_row, 'eval/accuracy': 0.5, 'eval/loss': 1.2,
              'comm/upload_bytes_total': 24.0}
  assert not round_metrics.is_evaluation(train_row)
  assert round_metrics.is_evaluation(eval_row)
  assert round_metrics.evaluations([train_row, eval_row]) == [eval_row]
  assert round_metrics.eval_metrics(eval_row) == {'accuracy': 0.5,
                                                  'loss': 1.2}
  assert round_metrics.eval_row({'loss': 2.0}) == {'eval/loss': 2.0}
  # Current rows read back unchanged; rows of earlier schemas: flat test
  # metrics and cumulative bytes (evaluations), comm/total_* (per round).
  assert round_metrics.normalize_row(eval_row) == eval_row
  assert round_metrics.normalize_row(
      {'round': 2, 'accuracy': 0.4, 'loss': 1.5, 'upload_bytes': 4.0,
       'download_bytes': 6.0, 'comm/total_upload_bytes': 4.0}) == {
           'round': 2, 'eval/accuracy': 0.4, 'eval/loss': 1.5,
           'comm/upload_bytes_total': 4.0, 'comm/download_bytes_total': 6.0}


def test_hparams_flatten_the_options():
  fingerprint = {'client_lr': 0.1, 'model': None, 'seed': 0,
                 'options': {'intrinsic_dim': 1024, 'upload': ''}}
  assert round_metrics.hparams(fingerprint, num_rounds=20) == {
      'client_lr': 0.1, 'intrinsic_dim': 1024, 'model': 'None',
      'num_rounds': 20, 'seed': 0, 'upload': ''}


def _plain_round_one_metrics(config):
  """Round 1's example-weighted training loss and accuracy of FedAvg with
  client SGD, recomputed with FedJAX's model in a Python loop."""
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  train, _, info = task.load_data(config)
  model = task.build_model(config, info).model
  params = model.init(jax.random.PRNGKey(config.seed))
  cohort = fedjax.client_samplers.UniformGetClientSampler(
      train, config.clients_per_round, config.seed, 0).sample()
  hparams = fedjax.ShuffleRepeatBatchHParams(
      batch_size=config.client_batch_size, num_epochs=1)
  opt = optax.sgd(config.client_lr)

  def loss_fn(p, batch, rng):
    preds = model.apply_for_train(p, batch, rng)
    return jnp.mean(model.train_loss(batch, preds)), preds

  loss_sum = correct = examples = 0.0
  for cid, cds, _ in cohort:
    rng = runner.client_rng(config.seed, 0, cid)
    cds = cds[:config.max_examples_per_client]
    p, opt_state = params, opt.init(params)
    for batch in batching.client_batches(cds, hparams, rng):
      rng, use_rng = jax.random.split(rng)
      (loss, preds), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          p, batch, use_rng)
      n = len(batch['y'])
      loss_sum += float(loss) * n
      correct += float(np.sum(np.argmax(preds, -1) == batch['y']))
      examples += n
      updates, opt_state = opt.update(grads, opt_state, p)
      p = optax.apply_updates(p, updates)
  return loss_sum / examples, correct / examples


def test_round_one_train_loss_equals_a_plain_loop(tmp_path):
  config = RunConfig(algorithm='fedavg', num_rounds=2, eval_every=2,
                     output_dir=str(tmp_path / 'run'), **TINY)
  run(config)
  rows = outputs.read_metrics(tmp_path / 'run' / 'metrics.jsonl')
  loss, accuracy = _plain_round_one_metrics(config)
  assert rows[0]['round'] == 1
  assert rows[0]['train/loss'] == pytest.approx(loss, rel=1e-5)
  assert rows[0]['train/accuracy'] == pytest.approx(accuracy, abs=1e-6)


def test_splitfed_reports_its_server_side_training_loss(tmp_path):
  out = tmp_path / 'split'
  run(RunConfig(algorithm='splitfed', num_rounds=2, eval_every=2,
                output_dir=str(out), **TINY))
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2]
  # The untrained 10-class CNN starts near chance: ln 10.
  assert rows[0]['train/loss'] == pytest.approx(math.log(10), abs=0.3)
  assert all(math.isfinite(r['train/loss']) for r in rows)
  assert 'train/delta_norm_mean' not in rows[0]  # No deltas are sent.
  scalars, _ = outputs.read_tensorboard(out / 'tb')
  assert [s for s, _ in scalars['train/loss']] == [1, 2]


def test_femnist_rows_tensorboard_and_hparams(data_dir, tmp_path):
  """20 rounds of FedAvg on FEMNIST, evaluated every 10 rounds."""
  out = tmp_path / 'femnist'
  summary = run(RunConfig(
      task='emnist', algorithm='fedavg', num_rounds=20, eval_every=10,
      clients_per_round=3, max_examples_per_client=60, eval_num_clients=4,
      checkpoint_every=0, progress=False, seed=0, data_dir=str(data_dir),
      output_dir=str(out)))
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  assert [r['round'] for r in rows] == list(range(1, 21))
  assert all(math.isfinite(r['train/loss']) for r in rows)
  evals = round_metrics.evaluations(rows)
  assert [r['round'] for r in evals] == [10, 20]
  assert evals[-1]['eval/accuracy'] == summary['final_eval']['accuracy']
  # Per round: 3 clients, FedAvg's 32 bits per parameter each way.
  n = summary['communication']['num_params']
  for r in rows:
    assert r['train/clients'] == 3 and r['train/skipped_clients'] == 0
    assert r['comm/upload_bytes'] == r['comm/download_bytes'] == 3 * 4 * n
    assert r['comm/upload_bytes_total'] == r['round'] * 3 * 4 * n
    assert r['engine/clients'] == 3 and r['engine/useful_steps'] >= 3
    assert r['train/delta_norm_max'] >= r['train/delta_norm_mean'] > 0
  assert summary['engine']['useful_steps'] == sum(
      r['engine/useful_steps'] for r in rows)
  scalars, hparams = outputs.read_tensorboard(out / 'tb')
  assert [s for s, _ in scalars['train/loss']] == list(range(1, 21))
  np.testing.assert_allclose([v for _, v in scalars['train/loss']],
                             [r['train/loss'] for r in rows], rtol=1e-6)
  assert [s for s, _ in scalars['eval/accuracy']] == [10, 20]
  for tag in ('comm/upload_bytes', 'time/train_seconds',
              'engine/useful_steps', 'train/delta_norm_mean'):
    assert len(scalars[tag]) == 20, tag
  assert 'accuracy' not in scalars and 'upload_bytes' not in scalars
  assert hparams['algorithm'] == 'fedavg' and hparams['task'] == 'emnist'
  assert hparams['client_lr'] == pytest.approx(0.1)
  assert hparams['num_rounds'] == 20
  assert (out / 'curves.png').stat().st_size > 0


def test_two_runs_compare_by_hparams(tmp_path):
  """Two runs' tb/ directories: different hparams, the same metric tags."""
  got = []
  for lr in (0.1, 0.05):
    out = tmp_path / f'lr{lr}'
    run(RunConfig(algorithm='fedavg', num_rounds=1, eval_every=1,
                  client_lr=lr, output_dir=str(out), **TINY))
    got.append(outputs.read_tensorboard(out / 'tb'))
  (s1, h1), (s2, h2) = got
  assert h1['client_lr'] == pytest.approx(0.1)
  assert h2['client_lr'] == pytest.approx(0.05)
  assert {k for k in h1 if h1[k] != h2[k]} == {'client_lr'}
  assert set(s1) == set(s2) and 'eval/loss' in s1

