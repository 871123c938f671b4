"""SplitFed (FedLite, Section 3) equals mini-batch SGD on the whole model.

Independent reference: ``jax.grad`` of the whole ``fedjax.Model``'s mean
training loss over the concatenation of the sampled clients' batches (B |S|
examples), then plain SGD with ``eta_c`` on the client block and ``eta_s`` on
the server block (``eta_c = eta_s = eta`` is SGD(eta) on the whole model).
Batches are re-derived here with FedJAX's own ``shuffle_repeat_batch``.
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401
import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import batching
from fedlite_jax.rounds import engine
from fedlite_jax.algorithms import splitfed as sf

ETA_C = 0.05
ETA_S = 0.2


@pytest.fixture(scope='module')
def femnist(data_dir):
  train, _, _ = datasets.load_federated_data('emnist', str(data_dir))
  ids = list(train.client_ids())[:4]
  return [(cid, cds, jax.random.PRNGKey(10 + i))
          for i, (cid, cds) in enumerate(train.get_clients(ids))]


def _fedjax_batch(cds, batch_size, rng):
  """The client's batch, from FedJAX directly (see splitfed's docstring)."""
  hp = fedjax.ShuffleRepeatBatchHParams(
      batch_size=batch_size, num_epochs=None, num_steps=1,
      seed=batching.shuffle_seed_from_rng(rng))
  return next(iter(cds.shuffle_repeat_batch(hp)))


def _max_rel_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-12))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _sgd_reference(model, params, loss_fn):
  grads = jax.grad(loss_fn)(params)
  return {
      'client': jax.tree.map(lambda p, g: p - ETA_C * g, params['client'],
                             grads['client']),
      'server': jax.tree.map(lambda p, g: p - ETA_S * g, params['server'],
                             grads['server']),
  }


def _check_rounds(alg, params, clients, reference_step, rounds=2, tol=2e-5):
  """Each round from the same start, so float noise is not amplified."""
  state = alg.init(params)
  for _ in range(rounds):
    start = state.params
    state, diag = alg.apply(state, clients)
    expected = reference_step(start)
    assert _max_rel_diff(state.params, expected) < tol
    assert _max_rel_diff(state.params, start) > 1e-4  # Not vacuous.
  return diag


@pytest.mark.parametrize('execution', ['unroll', 'vmap'])
def test_cnn_without_dropout_equals_sgd_on_concatenated_batch(femnist,
                                                              execution):
  split_model = models.create_emnist_cnn(62, 0.0, 0.0)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(0))
  clients = femnist[:3]
  batch = {k: np.concatenate([_fedjax_batch(cds, 20, rng)[k]
                              for _, cds, rng in clients])
           for k in ('x', 'y')}
  assert batch['x'].shape[0] == 60

  def loss(p):
    preds = model.apply_for_train(p, batch, jax.random.PRNGKey(0))
    return jnp.mean(model.train_loss(batch, preds))

  alg = sf.splitfed(split_model, optax.sgd(ETA_C), optax.sgd(ETA_S), 20,
                    client_execution=execution)
  diag = _check_rounds(alg, params, clients,
                       lambda p: _sgd_reference(model, p, loss), rounds=1)
  for d in diag.values():
    assert d['num_examples'] == 20
    assert d['activation_bits'] == d['activation_bits_uncompressed'] == \
        32 * 20 * 9216


def test_cnn_with_dropout_equals_sgd_with_per_client_keys(femnist):
  # Dropout masks are drawn per client from fold_in(client key, 1), for the
  # client and the server part alike: the reference applies the whole model
  # to each client's batch with that key and averages the B |S| losses.
  split_model = models.create_emnist_cnn(62)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(1))
  clients = femnist[:3]
  parts = [(_fedjax_batch(cds, 20, rng), jax.random.fold_in(rng, 1))
           for _, cds, rng in clients]

  def loss(p):
    return jnp.mean(jnp.concatenate([
        model.train_loss(b, model.apply_for_train(p, b, k)) for b, k in parts
    ]))

  alg = sf.splitfed(split_model, optax.sgd(ETA_C), optax.sgd(ETA_S), 20)
  _check_rounds(alg, params, clients, lambda p: _sgd_reference(model, p, loss),
                rounds=2)


def test_lstm_nwp_equals_sgd(data_dir):
  train, _, info = datasets.load_federated_data(
      'shakespeare', str(data_dir), sequence_length=12)
  ids = list(train.client_ids())[:3]
  clients = [(cid, cds, jax.random.PRNGKey(i))
             for i, (cid, cds) in enumerate(train.get_clients(ids))]
  split_model = models.create_stackoverflow_lstm(
      vocab_size=info.vocab_size, embed_size=8, lstm_hidden_size=16,
      projection_size=8)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(2))
  batch = {k: np.concatenate([_fedjax_batch(cds, 4, rng)[k]
                              for _, cds, rng in clients])
           for k in ('x', 'y')}
  assert np.any(batch['y'] == 0)  # PAD positions are present.

  def loss(p):  # fedjax.model_grad's objective: mean of per-sequence sums.
    return jnp.mean(model.train_loss(batch, model.apply_for_train(p, batch)))

  alg = sf.splitfed(split_model, optax.sgd(ETA_C), optax.sgd(ETA_S), 4)
  diag = _check_rounds(alg, params, clients,
                       lambda p: _sgd_reference(model, p, loss), rounds=2)
  d = next(iter(diag.values()))
  # One vector per token position: N = B T = 48 vectors of d = 8.
  assert d['activation_bits'] == 32 * 4 * 12 * 8
  assert d['label_bits'] == 4 * 12 * np.ceil(np.log2(info.vocab_size + 4))


class _MlpClient(nn.Module):

  @nn.compact
  def __call__(self, batch, train):
    x = batch['x'].reshape((batch['x'].shape[0], -1))
    return jnp.tanh(nn.Dense(16, name='dense')(x))


class _MlpServer(nn.Module):

  @nn.compact
  def __call__(self, z, batch, train):
    del batch, train
    return nn.Dense(62, name='dense')(z)


def mlp_split_model() -> models.SplitModel:
  return models.build_split_model(
      client=_MlpClient(), server=_MlpServer(),
      sample_batch={'x': np.zeros((1, 28, 28, 1), np.float32),
                    'y': np.zeros((1,), np.int32)},
      train_loss=lambda b, p: optax.softmax_cross_entropy_with_integer_labels(
          p, b['y']),
      eval_metrics={'accuracy': fedjax.metrics.Accuracy()},
      cut_layer='dense', cut_size=16)


@pytest.mark.parametrize('lanes', [4, 3, 1])
def test_examples_weighting_equals_weighted_sgd(femnist, lanes):
  # 4 lanes (one call), 3 (4 clients: a padded second call) or 1 sum the
  # gradient over calls; the update is the same weighted SGD step.
  split_model = mlp_split_model()
  model = split_model.model
  params = model.init(jax.random.PRNGKey(3))
  clients = femnist[:4]
  parts = [(_fedjax_batch(cds, 10, rng), float(len(cds)))
           for _, cds, rng in clients]
  total = sum(w for _, w in parts)
  assert len({w for _, w in parts}) > 1  # Weights really differ.

  def loss(p):
    return sum(w / total * jnp.mean(model.train_loss(b, model.apply_for_eval(
        p, b))) for b, w in parts)

  alg = sf.splitfed(split_model, optax.sgd(ETA_C), optax.sgd(ETA_S), 10,
                    client_weighting='examples', lanes_per_device=lanes)
  with engine.recording_stats() as rec:
    _check_rounds(alg, params, clients,
                  lambda p: _sgd_reference(model, p, loss))
  stats = rec.totals()
  assert stats['clients'] == 8
  assert stats['segments'] == 2 * {4: 1, 3: 2, 1: 4}[lanes]
  assert stats['lanes'] == lanes


def test_fedlite_on_lanes_equals_one_call(femnist):
  """FedLite's quantizer and equation-5 correction are per client, with
  p_i normalised over the whole cohort: calls of fewer clients change only
  the order of the gradient sum."""
  split_model = mlp_split_model()
  params = split_model.model.init(jax.random.PRNGKey(5))
  quantizer = sf.QuantizerConfig(num_subvectors=4, num_groups=1,
                                 num_centroids=2, correction_lambda=1e-3)
  results = []
  for lanes in (4, 3):
    alg = sf.fedlite(split_model, optax.sgd(ETA_C), optax.sgd(ETA_S), 10,
                     quantizer=quantizer, client_weighting='examples',
                     lanes_per_device=lanes)
    state, diag = alg.apply(alg.init(params), femnist[:4])
    results.append((state.params, diag))
  assert _max_rel_diff(results[1][0], results[0][0]) < 1e-5
  assert _max_rel_diff(results[0][0], params) > 1e-4  # Not vacuous.
  for cid, d in results[0][1].items():
    np.testing.assert_allclose(results[1][1][cid]['loss'], d['loss'],
                               rtol=1e-6)
    assert results[1][1][cid]['upload_bits'] == d['upload_bits']


def test_adam_server_optimizer_gets_server_gradient(femnist):
  # With separate optimizers, each part follows its own optax rule applied
  # to its block of the whole-model gradient.
  split_model = mlp_split_model()
  model = split_model.model
  params = model.init(jax.random.PRNGKey(4))
  clients = femnist[:2]
  batch = {k: np.concatenate([_fedjax_batch(cds, 10, rng)[k]
                              for _, cds, rng in clients]) for k in ('x', 'y')}
  grads = jax.grad(lambda p: jnp.mean(model.train_loss(
      batch, model.apply_for_eval(p, batch))))(params)
  adam = optax.adam(1e-2)
  updates, _ = adam.update(grads['server'], adam.init(params['server']))
  expected_server = optax.apply_updates(params['server'], updates)
  expected_client = jax.tree.map(lambda p, g: p - ETA_C * g, params['client'],
                                 grads['client'])
  alg = sf.splitfed(split_model, optax.sgd(ETA_C), adam, 10)
  state, _ = alg.apply(alg.init(params), clients)
  assert _max_rel_diff(state.params['server'], expected_server) < 1e-5
  assert _max_rel_diff(state.params['client'], expected_client) < 1e-5


def test_batch_choice_is_deterministic_per_key(femnist):
  _, cds, rng = femnist[0]
  a = sf.client_batch(cds, 20, rng)
  b = sf.client_batch(cds, 20, rng)
  c = sf.client_batch(cds, 20, jax.random.PRNGKey(12345))
  np.testing.assert_array_equal(a['x'], b['x'])
  assert not np.array_equal(a['x'], c['x'])
  # Without replacement when the client has >= B examples.
  assert len(cds) >= 20
  assert len({x.tobytes() for x in a['x']}) == 20


def test_small_client_is_padded_by_resampling(femnist):
  _, cds, rng = femnist[0]
  small = cds[:7]
  b = sf.client_batch(small, 20, rng)
  assert b['x'].shape[0] == 20
  assert len({x.tobytes() for x in b['x']}) == 7


def test_bad_arguments_are_clear_errors(femnist):
  split_model = mlp_split_model()
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match='batch_size'):
    sf.splitfed(split_model, opt, opt, 0)
  with pytest.raises(ValueError, match='client_weighting'):
    sf.splitfed(split_model, opt, opt, 10, client_weighting='size')
  with pytest.raises(ValueError, match='client_execution'):
    sf.splitfed(split_model, opt, opt, 10, client_execution='pmap')
  with pytest.raises(ValueError, match='label_bits'):
    sf.splitfed(split_model, opt, opt, 10, label_bits=-3)
  alg = sf.splitfed(split_model, opt, opt, 10)
  with pytest.raises(ValueError, match='no examples'):
    cid, cds, rng = femnist[0]
    alg.apply(alg.init(split_model.model.init(jax.random.PRNGKey(0))),
              [(cid, cds[:0], rng)])


def test_divergence_is_a_clear_error(femnist):
  split_model = mlp_split_model()
  alg = sf.splitfed(split_model, optax.sgd(float('nan')), optax.sgd(0.1), 10)
  state = alg.init(split_model.model.init(jax.random.PRNGKey(0)))
  with pytest.raises(FloatingPointError, match='non-finite'):
    alg.apply(state, femnist[:2])


def test_one_weighting_vocabulary_across_algorithms():
  # Split learning's p_i and FedOpt's client weights take the same values;
  # the runner's --split_client_weighting offers exactly those.
  from fedlite_jax.algorithms import fedopt  # pylint: disable=g-import-not-at-top
  from fedlite_jax.training import algo_splitfed  # pylint: disable=g-import-not-at-top
  split_model = mlp_split_model()
  opt = optax.sgd(0.1)
  hp = fedopt.batch_hparams(10, 1)
  grad_fn = fedjax.model_grad(split_model.model)
  for value in ('examples', 'uniform'):
    sf.splitfed(split_model, opt, opt, 10, client_weighting=value)
    fedopt.federated_averaging(grad_fn, opt, opt, hp, weighting=value)
  for value in ('num_examples', 'size'):
    with pytest.raises(ValueError, match='allowed values are examples, uniform'):
      sf.splitfed(split_model, opt, opt, 10, client_weighting=value)
    with pytest.raises(ValueError, match='allowed values are examples, uniform'):
      fedopt.federated_averaging(grad_fn, opt, opt, hp, weighting=value)
  assert set(algo_splitfed.CLIENT_WEIGHTING.choices) == {'examples', 'uniform'}
