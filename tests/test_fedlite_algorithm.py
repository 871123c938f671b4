"""FedLite (Section 4): bit accounting, quantized upload, corrected gradient.

Independent expectations: the paper's printed ratios (Sections 4.1 and 5),
SplitFed (already checked against mini-batch SGD in test_splitfed.py) for the
lossless case, and the surrogate loss of Appendix A differentiated with
``jax.grad`` for the corrected client gradient (equation 5).
"""

from __future__ import annotations

import dataclasses
import json

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
from fedlite_jax.algorithms import split_accounting as acc
from fedlite_jax.algorithms import splitfed as sf
from fedlite_jax.training import algo_splitfed
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import registry
from fedlite_jax.training import runner
from fedlite_jax.training import tasks
from fedlite_jax.transforms import pq
from fedlite_jax.models import vq_layer

ETA = 0.05


@pytest.fixture(scope='module')
def femnist(data_dir):
  train, test, _ = datasets.load_federated_data('emnist', str(data_dir))
  ids = list(train.client_ids())[:10]
  clients = [(cid, cds, jax.random.PRNGKey(100 + i))
             for i, (cid, cds) in enumerate(train.get_clients(ids))]
  return clients, test


def _sum_diags(diags):
  totals = {}
  for d in diags.values():
    for k in acc.BIT_KEYS:
      totals[k] = totals.get(k, 0.0) + d[k]
  return totals


# ---------------------------------------------------------------- accounting


@pytest.mark.parametrize('d,n,q,L,printed', [
    (9216, 20, 1152, 2, '490.2'),     # FEMNIST
    (2000, 100, 125, 10, '247'),      # SO Tag
    (96, 3840, 24, 30, '51.3'),       # SO NWP: 128 sequences x 30 tokens
])
def test_paper_activation_ratios(d, n, q, L, printed):
  bits = acc.iteration_bits(cut_size=d, num_vectors=n, num_client_params=1,
                            num_params=2, quantizer=acc.PQShape(q, 1, L),
                            phi=64)
  # phi d B / (phi d R L / q + B q log2 L), by hand.
  by_hand = 64 * d * n / (64 * d * L / q + n * q * np.log2(L))
  assert bits.activation_compression == pytest.approx(by_hand, rel=1e-12)
  # Equal to the paper's number at the precision it prints.
  decimals = len(printed.split('.')[1]) if '.' in printed else 0
  assert f'{bits.activation_compression:.{decimals}f}' == printed


def test_ledger_uses_32_bit_floats_and_counts_labels():
  bits = acc.iteration_bits(cut_size=9216, num_vectors=20,
                            num_client_params=18816, num_params=1206590,
                            quantizer=acc.PQShape(1152, 1, 2), phi=64,
                            label_elements=20, bits_per_label=6)
  assert bits.activation_bits == 32 * 9216 * 2 / 1152 + 20 * 1152
  assert bits.upload_bits == bits.activation_bits + 120 + 32 * 18816
  assert bits.download_bits == 32 * 20 * 9216 + 32 * 18816
  assert bits.activation_bits_uncompressed / bits.activation_bits == \
      pytest.approx(250.43, abs=0.01)


def test_accounting_rejects_bad_sizes():
  with pytest.raises(ValueError, match='q'):
    acc.iteration_bits(cut_size=100, num_vectors=20, num_client_params=1,
                       num_params=2, quantizer=acc.PQShape(7, 1, 2))
  with pytest.raises(ValueError, match='L'):
    acc.iteration_bits(cut_size=16, num_vectors=2, num_client_params=1,
                       num_params=2, quantizer=acc.PQShape(1, 1, 3))
  with pytest.raises(ValueError, match='num_client_params'):
    acc.iteration_bits(cut_size=16, num_vectors=2, num_client_params=3,
                       num_params=2)


def test_femnist_upload_ratios_through_the_algorithm(femnist):
  clients, _ = femnist
  split_model = models.create_emnist_cnn(62)
  params = split_model.model.init(jax.random.PRNGKey(0))
  wc, _ = split_model.split_params(params)
  n_c = sum(x.size for x in jax.tree.leaves(wc))
  n = sum(x.size for x in jax.tree.leaves(params))
  assert (n_c, n) == (18_816, 1_206_590)
  alg = sf.fedlite(split_model, optax.sgd(0.03), optax.sgd(0.03), 20,
                   sf.QuantizerConfig(1152, 1, 2, correction_lambda=5e-5),
                   phi=64)
  _, diags = alg.apply(alg.init(params), clients)
  summary = acc.communication_summary(_sum_diags(diags))
  assert f"{summary['activation_compression']:.4g}" == '490.2'
  assert f"{summary['upload_compression_vs_splitfed']:.3g}" == '10.6'
  assert f"{summary['upload_compression_vs_fedavg']:.3g}" == '62.9'
  d = next(iter(diags.values()))
  assert d['label_bits'] == 20 * 6  # ceil(log2 62) bits per label.
  assert d['upload_bits'] == 32 * 9216 * 2 / 1152 + 20 * 1152 + 120 + \
      32 * 18_816
  assert 0 < d['relative_quantization_error'] < 1


def test_so_tag_ratio_through_the_algorithm():
  # FedLite's SO Tag model (5,000 -> 2,000 -> 1,000) on synthetic bag-of-words
  # clients (no StackOverflow files needed): 247x at B = 100,
  # q = 125, L = 10; multi-hot labels cost 1 bit per tag.
  split_model = models.create_stackoverflow_tag_model()
  rng = np.random.RandomState(0)
  clients = [(b'c%d' % i, fedjax.ClientDataset({
      'x': (rng.rand(120, 5000) < 0.01).astype(np.float32),
      'y': (rng.rand(120, 1000) < 0.005).astype(np.float32)}),
              jax.random.PRNGKey(i)) for i in range(2)]
  alg = sf.fedlite(split_model, optax.adagrad(0.316), optax.adagrad(0.316),
                   100, sf.QuantizerConfig(125, 1, 10, correction_lambda=5e-3))
  params = split_model.model.init(jax.random.PRNGKey(0))
  _, diags = alg.apply(alg.init(params), clients)
  summary = acc.communication_summary(_sum_diags(diags))
  assert f"{summary['activation_compression']:.0f}" == '247'
  assert next(iter(diags.values()))['label_bits'] == 100 * 1000


# ------------------------------------------------- lossless = SplitFed


class _OneHotClient(nn.Module):
  """z = W[x]: at most K distinct activation vectors."""

  @nn.compact
  def __call__(self, batch, train):
    return nn.Dense(4, name='dense')(jax.nn.one_hot(batch['x'], 3))


class _Server(nn.Module):

  @nn.compact
  def __call__(self, z, batch, train):
    return nn.Dense(5, name='dense')(jnp.tanh(z))


def _one_hot_model():
  return models.build_split_model(
      client=_OneHotClient(), server=_Server(),
      sample_batch={'x': np.zeros((1,), np.int32),
                    'y': np.zeros((1,), np.int32)},
      train_loss=lambda b, p: optax.softmax_cross_entropy_with_integer_labels(
          p, b['y']),
      eval_metrics={}, cut_layer='dense', cut_size=4)


def _one_hot_clients(num_clients=3, n=12):
  rng = np.random.RandomState(0)
  return [(b'c%d' % i, fedjax.ClientDataset({
      'x': rng.randint(0, 3, n).astype(np.int32),
      'y': rng.randint(0, 5, n).astype(np.int32)}), jax.random.PRNGKey(i))
          for i in range(num_clients)]


def _max_abs_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize('q,R,L', [(1, 1, 3), (2, 1, 6), (2, 2, 3)])
def test_enough_centroids_equals_splitfed(q, R, L):
  # 3 distinct vectors -> at most 3 q distinct subvectors overall and 3 per
  # subvector index: L covers every group's distinct subvectors.
  split_model = _one_hot_model()
  params = split_model.model.init(jax.random.PRNGKey(0))
  clients = _one_hot_clients()
  ref = sf.splitfed(split_model, optax.sgd(0.5), optax.sgd(0.5), 8)
  ours = sf.fedlite(split_model, optax.sgd(0.5), optax.sgd(0.5), 8,
                    sf.QuantizerConfig(q, R, L, correction_lambda=0.3,
                                       kmeans_iters=L))
  s_ref, s_ours = ref.init(params), ours.init(params)
  for _ in range(3):
    s_ref, _ = ref.apply(s_ref, clients)
    s_ours, diags = ours.apply(s_ours, clients)
    assert _max_abs_diff(s_ref.params, s_ours.params) < 1e-6
    assert all(d['quantization_error'] < 1e-10 for d in diags.values())
  assert _max_abs_diff(s_ours.params, params) > 1e-2


def test_real_femnist_with_one_centroid_per_subvector_equals_splitfed(femnist):
  # Vanilla PQ (R = q): a group holds the B subvectors of one index, so
  # L = B reproduces real CNN activations exactly.
  clients, _ = femnist
  split_model = models.create_emnist_cnn(62, 0.0, 0.0)
  params = split_model.model.init(jax.random.PRNGKey(0))
  ref = sf.splitfed(split_model, optax.sgd(ETA), optax.sgd(ETA), 10)
  ours = sf.fedlite(split_model, optax.sgd(ETA), optax.sgd(ETA), 10,
                    sf.QuantizerConfig(1152, 1152, 10, correction_lambda=1e-2,
                                       kmeans_iters=2))
  s_ref, _ = ref.apply(ref.init(params), clients[:2])
  s_ours, diags = ours.apply(ours.init(params), clients[:2])
  assert _max_abs_diff(s_ref.params, s_ours.params) < 1e-6
  assert all(d['quantization_error'] < 1e-8 for d in diags.values())


# ----------------------------------------------- gradient correction (eq. 5)


def _fedjax_batch(cds, batch_size, rng):
  hp = fedjax.ShuffleRepeatBatchHParams(
      batch_size=batch_size, num_epochs=None, num_steps=1,
      seed=batching.shuffle_seed_from_rng(rng))
  return next(iter(cds.shuffle_repeat_batch(hp)))


def _appendix_a_client_grad(split_model, params, clients, batch_size, quant,
                            mask_fn=None):
  """Client gradient from the surrogate loss of Appendix A (equation 8).

  Per example j of client i: s = ||z - z^||^2 + (lambda_j/2) ||z - z~||^2
  with z^ = z - dl_j/dz~ / 2 and z~ fixed; averaged over the B examples
  (summed over vectors for sequences, masked where no loss) and over
  clients. lambda_j = lambda for 'example' scaling and B lambda for 'batch'
  (whose surrogate is the same with z the whole batch and the mean loss).
  """
  lam = quant.correction_lambda * (
      batch_size if quant.lambda_scaling == 'batch' else 1)
  wc, ws = split_model.split_params(params)
  grads = []
  for _, cds, rng in clients:
    batch = _fedjax_batch(cds, batch_size, rng)
    z = split_model.client_apply(wc, batch, None)
    z_tilde = pq.grouped_pq(
        z.reshape(-1, z.shape[-1]), jax.random.fold_in(rng, 2),
        quant.num_subvectors, quant.num_groups, quant.num_centroids,
        quant.kmeans_iters).reconstruction.reshape(z.shape)
    # Per-example loss gradients at z~ (the server's download, times B).
    g = jax.grad(lambda zt: jnp.sum(split_model.model.train_loss(
        batch, split_model.server_apply(ws, zt, batch, None))))(z_tilde)
    z_hat = z - g / 2
    mask = (jnp.ones(z.shape[:-1]) if mask_fn is None
            else mask_fn(batch, z))

    def surrogate(w, batch=batch, z_hat=z_hat, z_tilde=z_tilde, mask=mask):
      zz = split_model.client_apply(w, batch, None)
      per_vector = (jnp.sum((zz - z_hat) ** 2, -1) +
                    lam / 2 * mask *
                    jnp.sum((zz - z_tilde) ** 2, -1))
      return jnp.sum(per_vector) / batch_size

    grads.append(jax.grad(surrogate)(wc))
  total = jax.tree.map(lambda *g: sum(g), *grads)
  return jax.tree.map(lambda x: x / len(clients), total)


class _MlpClient(nn.Module):

  @nn.compact
  def __call__(self, batch, train):
    x = batch['x'].reshape((batch['x'].shape[0], -1))
    return jnp.tanh(nn.Dense(16, name='dense')(x))


class _MlpServer(nn.Module):

  @nn.compact
  def __call__(self, z, batch, train):
    return nn.Dense(62, name='dense')(nn.relu(nn.Dense(32)(z)))


def _mlp_model():
  return models.build_split_model(
      client=_MlpClient(), server=_MlpServer(),
      sample_batch={'x': np.zeros((1, 28, 28, 1), np.float32),
                    'y': np.zeros((1,), np.int32)},
      train_loss=lambda b, p: optax.softmax_cross_entropy_with_integer_labels(
          p, b['y']),
      eval_metrics={}, cut_layer='dense', cut_size=16)


@pytest.mark.parametrize('lam,scaling', [(0.0, 'batch'), (0.05, 'batch'),
                                         (0.5, 'example')])
def test_client_update_is_appendix_a_surrogate_gradient(femnist, lam,
                                                        scaling):
  clients, _ = femnist
  clients = clients[:3]
  split_model = _mlp_model()
  params = split_model.model.init(jax.random.PRNGKey(5))
  quant = sf.QuantizerConfig(4, 1, 3, correction_lambda=lam,
                             lambda_scaling=scaling, kmeans_iters=5)
  alg = sf.fedlite(split_model, optax.sgd(ETA), optax.sgd(ETA), 10, quant)
  state, _ = alg.apply(alg.init(params), clients)
  grad = _appendix_a_client_grad(split_model, params, clients, 10, quant)
  expected = jax.tree.map(lambda p, g: p - ETA * g, params['client'], grad)
  assert _max_abs_diff(state.params['client'], expected) < 1e-6
  assert _max_abs_diff(state.params['client'], params['client']) > 1e-4


@pytest.mark.parametrize('scaling', ['example', 'batch'])
def test_lambda_changes_only_the_client_update_by_eq5(femnist, scaling):
  # g(lambda) - g(0) = lambda' sum_j (z_j - z~_j)^T dz_j/dw_c, averaged over
  # clients, with lambda' = lambda / B ('example', the default) or lambda
  # ('batch'); the server update does not depend on lambda.
  clients, _ = femnist
  clients = clients[:3]
  split_model = _mlp_model()
  params = split_model.model.init(jax.random.PRNGKey(6))
  lam = 2.0 if scaling == 'example' else 0.2
  per_vector = lam / 10 if scaling == 'example' else lam
  runs = {}
  for value in (0.0, lam):
    quant = sf.QuantizerConfig(8, 2, 4, correction_lambda=value,
                               lambda_scaling=scaling)
    alg = sf.fedlite(split_model, optax.sgd(ETA), optax.sgd(ETA), 10, quant)
    runs[value], _ = alg.apply(alg.init(params), clients)
  assert _max_abs_diff(runs[0.0].params['server'],
                       runs[lam].params['server']) == 0.0
  wc = params['client']
  regs = []
  for _, cds, rng in clients:
    batch = _fedjax_batch(cds, 10, rng)
    z = split_model.client_apply(wc, batch, None)
    z_tilde = pq.grouped_pq(z, jax.random.fold_in(rng, 2), 8, 2, 4
                            ).reconstruction
    regs.append(jax.grad(lambda w, b=batch, zt=z_tilde: per_vector / 2 *
                         jnp.sum((split_model.client_apply(w, b, None) - zt)
                                 ** 2))(wc))
  reg = jax.tree.map(lambda *g: sum(g), *regs)
  diff = jax.tree.map(lambda a, b: a - b, runs[lam].params['client'],
                      runs[0.0].params['client'])
  expected = jax.tree.map(lambda g: -ETA * g / 3, reg)
  assert _max_abs_diff(diff, expected) < 1e-6
  assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(diff)) > 1e-5


def test_update_equals_whole_model_grad_with_vq_layer_at_the_cut(femnist):
  # Independent implementation of the corrected update: jax.grad of the
  # whole model's mean loss with models.vq_layer's custom_vjp layer dropped
  # in at the cut (per client, its own k-means key), then SGD.
  clients, _ = femnist
  clients = clients[:3]
  split_model = _mlp_model()
  params = split_model.model.init(jax.random.PRNGKey(11))
  lam = 0.8
  quant = sf.QuantizerConfig(8, 1, 3, correction_lambda=lam, kmeans_iters=6)
  alg = sf.fedlite(split_model, optax.sgd(ETA), optax.sgd(ETA), 10, quant)
  state, _ = alg.apply(alg.init(params), clients)
  parts = [(_fedjax_batch(cds, 10, rng), jax.random.fold_in(rng, 2))
           for _, cds, rng in clients]

  def loss(p):
    total = 0.0
    for batch, key in parts:
      z = split_model.client_apply(p['client'], batch, None)
      # The loss's denominator is all B |S| examples.
      z_tilde, _ = vq_layer.quantize_with_correction(
          z, key, 8, 1, 3, lam, 6, num_vectors=10 * len(parts))
      preds = split_model.server_apply(p['server'], z_tilde, batch, None)
      total = total + jnp.mean(split_model.model.train_loss(batch, preds))
    return total / len(parts)

  grads = jax.grad(loss)(params)
  expected = jax.tree.map(lambda p, g: p - ETA * g, params, grads)
  assert _max_abs_diff(state.params, expected) < 1e-6


def test_nwp_correction_skips_pad_positions(data_dir):
  train, _, info = datasets.load_federated_data(
      'shakespeare', str(data_dir), sequence_length=10)
  ids = list(train.client_ids())[:2]
  clients = [(cid, cds, jax.random.PRNGKey(7 + i))
             for i, (cid, cds) in enumerate(train.get_clients(ids))]
  split_model = models.create_stackoverflow_lstm(
      vocab_size=info.vocab_size, embed_size=8, lstm_hidden_size=8,
      projection_size=8)
  params = split_model.model.init(jax.random.PRNGKey(8))
  quant = sf.QuantizerConfig(2, 1, 4, correction_lambda=0.7, kmeans_iters=5)
  alg = sf.fedlite(split_model, optax.sgd(ETA), optax.sgd(ETA), 4, quant)
  state, diags = alg.apply(alg.init(params), clients)
  mask_fn = lambda b, z: (b['y'] != 0).astype(jnp.float32)  # noqa: E731
  grad = _appendix_a_client_grad(split_model, params, clients, 4, quant,
                                 mask_fn)
  expected = jax.tree.map(lambda p, g: p - ETA * g, params['client'], grad)
  assert _max_abs_diff(state.params['client'], expected) < 1e-6
  # 4 sequences x 10 tokens = 40 vectors per client in the message.
  d = next(iter(diags.values()))
  assert d['paper_activation_bits'] == pq.pq_message_bits(8, 40, 2, 1, 4, 64)


def test_vmap_and_unroll_layouts_agree(femnist):
  clients, _ = femnist
  split_model = _mlp_model()
  params = split_model.model.init(jax.random.PRNGKey(9))
  quant = sf.QuantizerConfig(8, 1, 4, correction_lambda=0.1)
  states = []
  for execution in ('vmap', 'unroll'):
    alg = sf.fedlite(split_model, optax.sgd(ETA), optax.sgd(ETA), 10, quant,
                     client_execution=execution)
    s, _ = alg.apply(alg.init(params), clients[:4])
    states.append(s)
  assert _max_abs_diff(states[0].params, states[1].params) < 1e-6


# ------------------------------------------------------------- bad input


def test_bad_quantizer_settings_are_clear_errors(femnist):
  clients, _ = femnist
  split_model = _mlp_model()
  opt = optax.sgd(0.1)
  with pytest.raises(ValueError, match=r'q\).*d=16.*q=5'):
    sf.fedlite(split_model, opt, opt, 10, sf.QuantizerConfig(5, 1, 2))
  with pytest.raises(ValueError, match='R.*q=8.*R=3'):
    sf.QuantizerConfig(8, 3, 2)
  with pytest.raises(ValueError, match='correction_lambda'):
    sf.QuantizerConfig(8, 1, 2, correction_lambda=-1e-3)
  with pytest.raises(ValueError, match='num_centroids'):
    sf.QuantizerConfig(8, 1, 0)
  alg = sf.fedlite(split_model, opt, opt, 2, sf.QuantizerConfig(1, 1, 3))
  with pytest.raises(ValueError, match='L.*at most.*2.*L=3'):
    alg.apply(alg.init(split_model.model.init(jax.random.PRNGKey(0))),
              clients[:1])


def test_registered_options_build_and_reject_bad_values():
  assert {'splitfed', 'fedlite'} <= set(registry.algorithms())
  task = tasks.get_task('emnist')
  config = config_lib.resolve(config_lib.RunConfig(
      task='emnist', algorithm='fedlite',
      options={'num_subvectors': 1000}), task.defaults)
  ctx = registry.BuildContext(config=config,
                              split_model=models.create_emnist_cnn(62),
                              num_params=1_206_590, train_client_ids=(),
                              info=None)
  with pytest.raises(config_lib.ConfigError, match='num_subvectors=1000'):
    algo_splitfed.build_fedlite(ctx)
  ctx = dataclasses.replace(ctx, config=dataclasses.replace(
      config, options=dict(config.options, num_subvectors=0)))
  assert algo_splitfed.quantizer_from_options(ctx).num_subvectors == 1152


# ------------------------------------------------- real training / runner


def test_short_real_femnist_run_lowers_the_loss(femnist):
  clients, test = femnist
  split_model = models.create_emnist_cnn(62)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(0))
  test_ids = list(test.client_ids())[:8]
  eval_batches = list(fedjax.padded_batch_client_datasets(
      [cds for _, cds in test.get_clients(test_ids)], batch_size=256))
  alg = sf.fedlite(split_model, optax.sgd(0.1), optax.sgd(0.1), 20,
                   sf.QuantizerConfig(1152, 1, 2, correction_lambda=5e-5))
  state = alg.init(params)
  before = fedjax.evaluate_model(model, params, eval_batches)['loss']
  train_losses = []
  for r in range(25):
    cohort = [(cid, cds, jax.random.fold_in(rng, r))
              for cid, cds, rng in clients]
    state, diags = alg.apply(state, cohort)
    train_losses.append(np.mean([d['loss'] for d in diags.values()]))
  after = fedjax.evaluate_model(model, state.params, eval_batches)['loss']
  assert float(after) < float(before) - 0.1
  assert np.mean(train_losses[-5:]) < np.mean(train_losses[:5])


def test_runner_end_to_end(data_dir, tmp_path):
  config = config_lib.RunConfig(
      task='emnist', algorithm='fedlite', num_rounds=2, clients_per_round=3,
      client_lr=0.03, eval_every=2, eval_num_clients=3, data_dir=str(data_dir),
      output_dir=str(tmp_path), progress=False,
      options={'num_subvectors': 1152, 'num_centroids': 2,
               'correction_lambda': 5e-5})
  summary = runner.run(config)
  comm = summary['communication']
  per_client_up = (32 * 9216 * 2 / 1152 + 20 * 1152) + 20 * 6 + 32 * 18_816
  assert comm['total_upload_bytes'] == pytest.approx(6 * per_client_up / 8)
  saved = json.loads((tmp_path / 'summary.json').read_text())
  assert saved['algorithm'] == 'fedlite'
  if 'communication_summary' in registry.AlgorithmSpec.__dataclass_fields__:
    assert f"{saved['communication']['activation_compression']:.4g}" == \
        '490.2'
