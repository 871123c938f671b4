"""Tests for fedlite_jax.models: parameter counts, FedJAX parity, split pair.

Expectations are independent of the implementation: parameter counts from the
papers / FedJAX's own Haiku models, forward passes against FedJAX's models with
the same (copied) parameters, losses and metrics against NumPy.
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401  (must precede fedjax)
import fedjax
from fedjax.core import client_datasets
import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax import models
from fedlite_jax.models import stackoverflow
from fedlite_jax.models import stackoverflow_tag

MASK = client_datasets.EXAMPLE_MASK_KEY
# Small Stack Overflow LSTM for numerical tests: 20 words -> 24 outputs.
SMALL_LSTM = dict(vocab_size=20, embed_size=8, lstm_hidden_size=16)
SMALL_TAG = dict(num_words=50, num_tags=10, hidden_size=8)


def num_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def param_shapes(model: fedjax.Model):
  return jax.eval_shape(model.init, jax.random.key(0))


def log_softmax_np(logits: np.ndarray) -> np.ndarray:
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def emnist_batch(rng: np.random.Generator, n: int, num_classes: int = 62):
  return {
      'x': rng.uniform(size=(n, 28, 28, 1)).astype(np.float32),
      'y': rng.integers(0, num_classes, size=n).astype(np.int32),
  }


def lstm_batch(rng: np.random.Generator, n: int, t: int = 6,
               vocab_size: int = 20):
  """Token batch with trailing PAD, and some EOS / OOV targets."""
  x = rng.integers(1, vocab_size + 4, size=(n, t)).astype(np.int32)
  y = rng.integers(3, vocab_size + 4, size=(n, t)).astype(np.int32)
  lengths = rng.integers(1, t + 1, size=n)
  for i, length in enumerate(lengths):
    x[i, length:] = 0
    y[i, length:] = 0
    y[i, length - 1] = stackoverflow.EOS_ID
  return {'x': x, 'y': y}


def tag_batch(rng: np.random.Generator, n: int, num_words: int = 50,
              num_tags: int = 10):
  return {
      'x': rng.uniform(size=(n, num_words)).astype(np.float32),
      'y': (rng.uniform(size=(n, num_tags)) < 0.3).astype(np.float32),
  }


# name -> (builder, batch maker); small sizes where the size does not matter.
CASES = {
    'emnist': (models.create_emnist_cnn, emnist_batch),
    'lstm': (lambda: models.create_stackoverflow_lstm(**SMALL_LSTM),
             lstm_batch),
    'tag': (lambda: models.create_stackoverflow_tag_model(**SMALL_TAG),
            tag_batch),
}


@pytest.fixture(scope='module')
def built():
  """Each case built once: (split_model, params)."""
  out = {}
  for name, (builder, _) in CASES.items():
    split_model = builder()
    out[name] = (split_model, split_model.model.init(jax.random.key(0)))
  return out


# ---------------------------------------------------------------- counts ---


def test_emnist_param_counts():
  shapes = param_shapes(models.create_emnist_cnn().model)
  assert set(shapes) == {'client', 'server'}
  assert num_params(shapes['client']) == 18_816
  assert num_params(shapes['server']) == 1_187_774
  assert num_params(shapes) == 1_206_590
  fedjax_model = fedjax.models.emnist.create_conv_model(only_digits=False)
  assert num_params(param_shapes(fedjax_model)) == 1_206_590
  # Digits only: the last layer shrinks from 62 to 10 outputs.
  digits = param_shapes(models.create_emnist_cnn(num_classes=10).model)
  assert num_params(digits['server']) == 1_187_774 - 52 * 129
  assert num_params(digits) == num_params(
      param_shapes(fedjax.models.emnist.create_conv_model(only_digits=True)))


def test_stackoverflow_lstm_param_counts():
  shapes = param_shapes(models.create_stackoverflow_lstm().model)
  v, e, h = 10_004, 96, 670
  client = v * e + ((e + h) * 4 * h + 4 * h) + (h * e + e)
  server = e * v + v
  assert num_params(shapes['client']) == client == 3_080_360
  assert num_params(shapes['server']) == server == 970_388
  fedjax_model = fedjax.models.stackoverflow.create_lstm_model()
  assert num_params(param_shapes(fedjax_model)) == client + server == 4_050_748


def test_stackoverflow_lstm_param_counts_configurable():
  kwargs = dict(vocab_size=30, embed_size=5, lstm_hidden_size=7,
                lstm_num_layers=2)
  ours = param_shapes(models.create_stackoverflow_lstm(**kwargs).model)
  theirs = param_shapes(fedjax.models.stackoverflow.create_lstm_model(**kwargs))
  assert num_params(ours) == num_params(theirs)
  with_projection = param_shapes(
      models.create_stackoverflow_lstm(projection_size=11, **kwargs).model)
  assert with_projection['server']['logits']['kernel'].shape == (11, 34)


def test_tag_param_counts():
  shapes = param_shapes(models.create_stackoverflow_tag_model().model)
  assert num_params(shapes['client']) == 5000 * 2000 + 2000
  assert num_params(shapes['server']) == 2000 * 1000 + 1000
  assert num_params(shapes) == 12_003_000


def test_cut_sizes():
  assert models.create_emnist_cnn().cut_size == 9216
  assert models.create_emnist_cnn().cut_layer == 'flatten'
  assert models.create_stackoverflow_lstm().cut_size == 96
  assert models.create_stackoverflow_lstm(projection_size=32).cut_size == 32
  assert models.create_stackoverflow_tag_model().cut_size == 2000


# ---------------------------------------------------- parity with FedJAX ---


def test_emnist_matches_fedjax_with_same_params():
  fedjax_model = fedjax.models.emnist.create_conv_model(only_digits=False)
  hk_params = fedjax_model.init(jax.random.key(1))
  prefix = 'conv_dropout_module/'
  layer = lambda name: {'kernel': hk_params[prefix + name]['w'],
                        'bias': hk_params[prefix + name]['b']}
  params = {
      'client': {'conv1': layer('conv2_d'), 'conv2': layer('conv2_d_1')},
      'server': {'dense1': layer('linear'), 'dense2': layer('linear_1')},
  }
  split_model = models.create_emnist_cnn()
  batch = emnist_batch(np.random.default_rng(0), 5)
  ours = split_model.model.apply_for_eval(params, batch)
  theirs = fedjax_model.apply_for_eval(hk_params, batch)
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      split_model.model.train_loss(batch, ours),
      fedjax_model.train_loss(batch, theirs), rtol=1e-5, atol=1e-6)
  # The same metric definitions (FedJAX metrics are comparable dataclasses).
  assert split_model.model.eval_metrics == fedjax_model.eval_metrics
  results = fedjax.evaluate_model(split_model.model, params, [batch])
  labels = batch['y']
  np.testing.assert_allclose(
      results['accuracy'], np.mean(np.argmax(theirs, -1) == labels))
  np.testing.assert_allclose(
      results['loss'], np.mean(fedjax_model.train_loss(batch, theirs)),
      rtol=1e-5)


def test_stackoverflow_lstm_matches_fedjax_with_same_params():
  # Two layers check the naming of every layer (layer 0 is the 1-layer case).
  num_layers = 2
  kwargs = dict(lstm_num_layers=num_layers, **SMALL_LSTM)
  fedjax_model = fedjax.models.stackoverflow.create_lstm_model(**kwargs)
  hk_params = fedjax_model.init(jax.random.key(2))
  layer = lambda name: {'kernel': hk_params[name]['w'],
                        'bias': hk_params[name]['b']}
  # Haiku names: lstm, linear (projection), lstm_1, linear_1, ..., then the
  # output layer linear_{num_layers}.
  suffix = lambda k: '' if k == 0 else f'_{k}'
  client = {'embed': {'embedding': hk_params['embed']['embeddings']}}
  for k in range(num_layers):
    client[f'lstm_{k}'] = layer(f'lstm{suffix(k)}/linear')
    client[f'projection_{k}'] = layer(f'linear{suffix(k)}')
  params = {'client': client,
            'server': {'logits': layer(f'linear{suffix(num_layers)}')}}
  split_model = models.create_stackoverflow_lstm(**kwargs)
  batch = lstm_batch(np.random.default_rng(1), 4, t=7)
  ours = split_model.model.apply_for_eval(params, batch)
  theirs = fedjax_model.apply_for_eval(hk_params, batch)
  assert ours.shape == (4, 7, 24)
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      split_model.model.train_loss(batch, ours),
      fedjax_model.train_loss(batch, theirs), rtol=1e-5, atol=1e-5)
  # FedJAX's metric definitions, unchanged, plus 'loss' and 'accuracy'.
  ours_metrics = split_model.model.eval_metrics
  theirs_metrics = fedjax_model.eval_metrics
  assert set(ours_metrics) - set(theirs_metrics) == {'loss', 'accuracy'}
  for k in theirs_metrics:
    assert ours_metrics[k] == theirs_metrics[k], k
  assert ours_metrics['loss'] == theirs_metrics['token_loss']


def test_init_statistics_match_haiku(built):
  """Haiku's truncated-normal init: weight std = 0.8796 / sqrt(fan_in)."""
  _, params = built['emnist']
  kernel = np.asarray(params['server']['dense1']['kernel'])
  np.testing.assert_allclose(kernel.std() * np.sqrt(9216), 0.8796, rtol=0.01)
  assert np.abs(kernel).max() <= 2 / np.sqrt(9216) + 1e-7
  assert not np.any(np.asarray(params['server']['dense1']['bias']))


# ------------------------------------------------------------ split pair ---


@pytest.mark.parametrize('name', sorted(CASES))
def test_split_pair_equals_whole_model(built, name):
  split_model, params = built[name]
  model = split_model.model
  batch = CASES[name][1](np.random.default_rng(4), 3)
  client_params, server_params = split_model.split_params(params)
  assert jax.tree.structure(split_model.merge_params(
      client_params, server_params)) == jax.tree.structure(params)

  # Eval mode: rng None.
  z = split_model.client_apply(client_params, batch, None)
  expected_z_shape = (3, split_model.cut_size) if name != 'lstm' else (
      3, 6, split_model.cut_size)
  assert z.shape == expected_z_shape and z.dtype == jnp.float32
  preds = split_model.server_apply(server_params, z, batch, None)
  np.testing.assert_allclose(preds, model.apply_for_eval(params, batch),
                             rtol=1e-6, atol=1e-6)

  # Train mode: the same rng gives the same dropout masks.
  rng = jax.random.key(5)
  z = split_model.client_apply(client_params, batch, rng)
  preds = split_model.server_apply(server_params, z, batch, rng)
  np.testing.assert_allclose(preds, model.apply_for_train(params, batch, rng),
                             rtol=1e-6, atol=1e-6)


def test_emnist_output_shapes_and_dropout(built):
  split_model, params = built['emnist']
  model = split_model.model
  batch = emnist_batch(np.random.default_rng(6), 4)
  eval_preds = model.apply_for_eval(params, batch)
  assert eval_preds.shape == (4, 62)
  train_a = model.apply_for_train(params, batch, jax.random.key(0))
  train_b = model.apply_for_train(params, batch, jax.random.key(1))
  assert train_a.shape == (4, 62)
  assert not np.allclose(train_a, eval_preds)
  assert not np.allclose(train_a, train_b)
  np.testing.assert_array_equal(
      train_a, model.apply_for_train(params, batch, jax.random.key(0)))
  # Client dropout 0.25 on the activations: about a quarter are zeroed on top
  # of the ReLU zeros, and the kept ones are scaled by 1 / 0.75.
  z_eval = split_model.client_apply(params['client'], batch, None)
  z_train = split_model.client_apply(params['client'], batch,
                                     jax.random.key(2))
  kept = np.asarray(z_train) != 0
  np.testing.assert_allclose(
      np.asarray(z_train)[kept], np.asarray(z_eval)[kept] / 0.75, rtol=1e-5)
  live = np.asarray(z_eval) != 0
  assert 0.2 < 1 - kept[live].mean() < 0.3
  with pytest.raises(flax.errors.InvalidRngError):
    model.apply_for_train(params, batch, None)


def test_no_dropout_models_ignore_rng(built):
  for name in ('lstm', 'tag'):
    split_model, params = built[name]
    batch = CASES[name][1](np.random.default_rng(7), 2)
    np.testing.assert_allclose(
        split_model.model.apply_for_train(params, batch, jax.random.key(0)),
        split_model.model.apply_for_eval(params, batch), rtol=1e-6)
    np.testing.assert_allclose(
        split_model.model.apply_for_train(params, batch, None),
        split_model.model.apply_for_eval(params, batch), rtol=1e-6)


def test_split_gradients_equal_whole_model_gradients(built):
  """Back-propagating through server_apply then client_apply = model_grad."""
  split_model, params = built['tag']
  batch = tag_batch(np.random.default_rng(8), 4)

  def split_loss(client_params, server_params):
    z = split_model.client_apply(client_params, batch, None)
    preds = split_model.server_apply(server_params, z, batch, None)
    return jnp.mean(split_model.model.train_loss(batch, preds))

  client_params, server_params = split_model.split_params(params)
  grads = jax.grad(split_loss, argnums=(0, 1))(client_params, server_params)
  expected = fedjax.model_grad(split_model.model)(params, batch,
                                                  jax.random.key(0))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-7),
               split_model.merge_params(*grads), expected)


def test_split_params_rejects_other_trees(built):
  split_model, params = built['tag']
  with pytest.raises(ValueError, match='client'):
    split_model.split_params({'client': params['client']})
  with pytest.raises(ValueError, match='client'):
    split_model.split_params([params['client'], params['server']])


# ------------------------------------------------------- losses, metrics ---


def test_emnist_train_loss_is_softmax_cross_entropy():
  model = models.create_emnist_cnn(num_classes=10).model
  rng = np.random.default_rng(9)
  logits = rng.normal(size=(4, 10)).astype(np.float32)
  labels = np.array([0, 3, 9, 3], np.int32)
  loss = model.train_loss({'y': labels}, jnp.asarray(logits))
  expected = -log_softmax_np(logits)[np.arange(4), labels]
  assert loss.shape == (4,)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  # Hand case: logits (0, log 3) -> p(class 1) = 3/4.
  loss = model.train_loss({'y': np.array([1])},
                          jnp.array([[0.0, np.log(3.0)]]))
  np.testing.assert_allclose(loss, [-np.log(0.75)], rtol=1e-6)


def test_lstm_train_loss_masks_pad_and_sums_per_sequence():
  model = models.create_stackoverflow_lstm(**SMALL_LSTM).model
  rng = np.random.default_rng(10)
  logits = rng.normal(size=(2, 4, 24)).astype(np.float32)
  targets = np.array([[5, 7, 2, 0], [23, 0, 0, 0]], np.int32)
  token_nll = -np.take_along_axis(log_softmax_np(logits), targets[..., None],
                                  -1)[..., 0]
  expected = np.array([token_nll[0, :3].sum(), token_nll[1, 0]])
  loss = model.train_loss({'y': targets}, jnp.asarray(logits))
  assert loss.shape == (2,)
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  scaled = models.create_stackoverflow_lstm(expected_length=2.5,
                                            **SMALL_LSTM).model
  np.testing.assert_allclose(scaled.train_loss({'y': targets}, logits),
                             expected / 2.5, rtol=1e-5)
  # An all-PAD sequence has zero loss (and so zero gradient).
  np.testing.assert_allclose(
      model.train_loss({'y': np.zeros((1, 4), np.int32)}, logits[:1]), [0.0])


def test_lstm_loss_and_accuracy_metrics():
  vocab_size, oov, eos = 20, 23, stackoverflow.EOS_ID
  metrics = stackoverflow.eval_metrics(vocab_size)
  rng = np.random.default_rng(11)
  logits = rng.normal(size=(2, 5, 24)).astype(np.float32)
  targets = np.array([[5, 7, 9, eos, 0], [oov, 4, 6, 8, 0]], np.int32)
  # Make the argmax right at (0, 0), (0, 2), (1, 1) and at the OOV (1, 0) and
  # EOS (0, 3) targets, which 'accuracy' ignores; wrong elsewhere.
  for i, j in [(0, 0), (0, 2), (1, 1), (1, 0), (0, 3)]:
    logits[i, j, targets[i, j]] = 10.0
  for i, j in [(0, 1), (1, 2), (1, 3)]:
    logits[i, j, targets[i, j]] = -10.0
  batch = {'y': targets}

  def result(name):
    stat = fedjax.metrics.evaluate_batch(metrics[name], batch,
                                         jnp.asarray(logits))
    return float(stat.result())

  nll = -np.take_along_axis(log_softmax_np(logits), targets[..., None],
                            -1)[..., 0]
  not_pad = targets != 0
  np.testing.assert_allclose(result('loss'), nll[not_pad].mean(), rtol=1e-5)
  # Counted targets: 5, 7, 9 and 4, 6, 8 -> 3 right of 6.
  np.testing.assert_allclose(result('accuracy'), 3 / 6)
  # FedJAX's accuracy_no_eos counts OOV: 4 right of 7.
  np.testing.assert_allclose(result('accuracy_no_eos'), 4 / 7)
  # accuracy_in_vocab masks the OOV logit, so the OOV target is a mistake.
  np.testing.assert_allclose(result('accuracy_in_vocab'), 3 / 7)
  np.testing.assert_allclose(result('num_tokens'), 8)


def test_tag_loss_and_metrics_by_hand():
  split_model = models.create_stackoverflow_tag_model(num_words=3, num_tags=6,
                                                      hidden_size=2)
  model = split_model.model
  labels = np.array([
      [1, 0, 1, 0, 0, 0],   # top-1 tag 2: true; top 5 hold both true tags.
      [0, 0, 0, 0, 0, 1],   # top-1 tag 0: false; tag 5 is last: not in top 5.
      [1, 1, 1, 1, 1, 1],   # all true: top 5 holds 5 of 6.
  ], np.float32)
  logits = np.array([
      [1.0, -1.0, 3.0, 0.0, 0.5, -3.0],
      [4.0, 3.0, 2.0, 1.0, 0.0, -1.0],
      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
  ], np.float32)
  batch = {'x': np.zeros((3, 3), np.float32), 'y': labels}
  p = 1 / (1 + np.exp(-logits.astype(np.float64)))
  bce = -(labels * np.log(p) + (1 - labels) * np.log(1 - p))
  loss = model.train_loss(batch, jnp.asarray(logits))
  assert loss.shape == (3,)
  np.testing.assert_allclose(loss, bce.sum(-1), rtol=1e-5)
  mean_model = models.create_stackoverflow_tag_model(
      num_words=3, num_tags=6, hidden_size=2, loss_reduction='mean').model
  np.testing.assert_allclose(mean_model.train_loss(batch, logits),
                             bce.mean(-1), rtol=1e-5)

  def result(name):
    stat = fedjax.metrics.evaluate_batch(model.eval_metrics[name], batch,
                                         jnp.asarray(logits))
    return float(stat.result())

  np.testing.assert_allclose(result('loss'), bce.sum(-1).mean(), rtol=1e-5)
  np.testing.assert_allclose(result('accuracy'), 2 / 3)
  # Micro recall: (2 + 0 + 5) hits / (2 + 1 + 6) true tags.
  np.testing.assert_allclose(result('recall_at_5'), 7 / 9, rtol=1e-6)


@pytest.mark.parametrize('activation', [None, jax.nn.relu])
def test_tag_model_activation(activation):
  split_model = models.create_stackoverflow_tag_model(activation=activation,
                                                      **SMALL_TAG)
  params = split_model.model.init(jax.random.key(0))
  batch = tag_batch(np.random.default_rng(12), 8)
  z = np.asarray(split_model.client_apply(params['client'], batch, None))
  dense = params['client']['dense']
  linear = batch['x'] @ np.asarray(dense['kernel']) + np.asarray(dense['bias'])
  expected = linear if activation is None else np.maximum(linear, 0)
  np.testing.assert_allclose(z, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------- gradients with masks ---


def _padded(batch, pad_batch):
  """Appends pad_batch's rows to batch, with the FedJAX example mask."""
  n, m = len(batch['y']), len(pad_batch['y'])
  out = {k: np.concatenate([batch[k], pad_batch[k]]) for k in batch}
  out[MASK] = np.concatenate([np.ones(n, bool), np.zeros(m, bool)])
  return out


@pytest.mark.parametrize('name', sorted(CASES))
def test_model_grad_with_padded_batch(built, name):
  _, params = built[name]
  make_batch = CASES[name][1]
  if name == 'emnist':
    # Dropout masks depend on the batch shape, so compare without dropout.
    model = models.create_emnist_cnn(client_dropout_rate=0.0,
                                     server_dropout_rate=0.0).model
  else:
    model = built[name][0].model
  batch = make_batch(np.random.default_rng(13), 3)
  # Padded rows hold garbage (not zeros): only the mask can hide them.
  padded = _padded(batch, make_batch(np.random.default_rng(14), 2))
  grad_fn = fedjax.model_grad(model)
  rng = jax.random.key(0)
  expected = grad_fn(params, batch, rng)
  got = grad_fn(params, padded, rng)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-7),
               got, expected)
  unmasked = {k: v for k, v in padded.items() if k != MASK}
  leaves = zip(jax.tree.leaves(grad_fn(params, unmasked, rng)),
               jax.tree.leaves(expected))
  assert not all(np.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in leaves)


def test_model_grad_padded_rows_ignored_with_dropout(built):
  """With dropout on and a fixed shape, the padded rows' content is ignored."""
  split_model, params = built['emnist']
  rng_np = np.random.default_rng(15)
  batch = emnist_batch(rng_np, 3)
  zeros = {k: np.zeros_like(v[:2]) for k, v in batch.items()}
  a = _padded(batch, zeros)
  b = _padded(batch, emnist_batch(rng_np, 2))
  grad_fn = fedjax.model_grad(split_model.model)
  rng = jax.random.key(1)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5,
                                                       atol=1e-8),
               grad_fn(params, a, rng), grad_fn(params, b, rng))


# ------------------------------------------------------------------ errors ---


def test_input_validation(built):
  split_model, params = built['emnist']
  with pytest.raises(ValueError, match='28, 28, 1'):
    split_model.model.apply_for_eval(
        params, {'x': np.zeros((2, 28, 28), np.float32),
                 'y': np.zeros(2, np.int32)})
  split_model, params = built['lstm']
  with pytest.raises(ValueError, match='integer'):
    split_model.model.apply_for_eval(
        params, {'x': np.zeros((2, 3), np.float32),
                 'y': np.zeros((2, 3), np.int32)})
  with pytest.raises(ValueError):
    models.create_emnist_cnn(num_classes=1)
  with pytest.raises(ValueError):
    models.create_emnist_cnn(client_dropout_rate=1.0)
  with pytest.raises(ValueError):
    models.create_stackoverflow_lstm(lstm_hidden_size=0)
  with pytest.raises(ValueError):
    models.create_stackoverflow_tag_model(loss_reduction='max')
  with pytest.raises(ValueError):
    stackoverflow_tag.multilabel_loss(np.zeros(6), np.zeros(6), 'median')


def test_emnist_reshape_max_pool_equals_flax_max_pool():
  """The CNN's reshape-max pool: nn.max_pool's values and gradients."""
  from fedlite_jax.models import emnist as emnist_lib
  import flax.linen as nn
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 24, 24, 5)).astype(np.float32)
  cot = rng.standard_normal((3, 12, 12, 5)).astype(np.float32)
  ref = lambda v: nn.max_pool(v, (2, 2), strides=(2, 2), padding='VALID')
  ours = emnist_lib._max_pool_2x2  # pylint: disable=protected-access
  np.testing.assert_array_equal(ours(x), ref(x))
  g_ref = jax.vjp(ref, x)[1](cot)[0]
  g_ours = jax.vjp(ours, x)[1](cot)[0]
  np.testing.assert_array_equal(g_ours, g_ref)
  # Exactly one input per window receives the window's cotangent.
  assert int((np.asarray(g_ours) != 0).sum()) == cot.size
