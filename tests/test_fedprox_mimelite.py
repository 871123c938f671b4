"""FedProx and MimeLite (algorithms.efficient) vs FedJAX and by hand.

Independent references: FedJAX's own ``fed_prox`` and ``mime_lite`` on real
FEMNIST writers with the same clients, batches (same shuffle seed) and PRNG
keys (a dropout MLP, so the rng use must match too); and closed forms for a
quadratic loss.
"""

import fedlite_jax  # noqa: F401
import fedjax
from fedjax.algorithms import fed_prox as fedjax_fed_prox
from fedjax.algorithms import mime_lite as fedjax_mime_lite
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import datasets
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import mime_lite


@pytest.fixture(scope='module')
def femnist(data_dir):
  train, _, _ = datasets.load_federated_data('emnist', str(data_dir))
  ids = list(train.client_ids())[:3]
  return [(cid, cds, jax.random.PRNGKey(10 + i))
          for i, (cid, cds) in enumerate(train.get_clients(ids))]


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x, train):
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(32)(x))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    return nn.Dense(62)(x)


def _mlp_model():
  net = _Mlp()
  sample = jnp.zeros((1, 28, 28, 1))
  return fedjax.Model(
      init=lambda rng: net.init(rng, sample, False),
      apply_for_train=lambda p, b, rng: net.apply(
          p, b['x'], True, rngs={'dropout': rng}),
      apply_for_eval=lambda p, b: net.apply(p, b['x'], False),
      train_loss=lambda b, preds: fedjax.metrics.unreduced_cross_entropy_loss(
          b['y'], preds),
      eval_metrics={})


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize('mu,server', [(0.1, 'sgd'), (0.01, 'adam')])
def test_fedprox_matches_fedjax(femnist, mu, server):
  model = _mlp_model()
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=5)
  params = model.init(jax.random.PRNGKey(0))
  server_opt = optax.sgd(1.0) if server == 'sgd' else optax.adam(1e-2)
  ref = fedjax_fed_prox.fed_prox(
      fedjax.model_per_example_loss(model), fedjax.optimizers.sgd(0.1),
      fedjax.optimizers.create_optimizer_from_optax(server_opt), hp,
      proximal_weight=mu)
  ours = fedopt.federated_averaging(
      fedjax.model_grad(model), optax.sgd(0.1), server_opt, hp,
      fedprox_mu=mu, engine='loop')
  ref_state = ref.init(params)
  for r in range(2):
    start = ours.init(ref_state.params).replace(
        opt_state=ref_state.opt_state, round=jnp.asarray(r, jnp.int32))
    our_state, diag = ours.apply(start, femnist)
    ref_state, _ = ref.apply(ref_state, femnist)
    assert _max_diff(ref_state.params, our_state.params) < 2e-6
    assert _max_diff(start.params, our_state.params) > 1e-3  # not vacuous
  n = sum(x.size for x in jax.tree.leaves(params))
  for d in diag.values():
    assert d['upload_bits'] == d['download_bits'] == 32 * n


@pytest.mark.parametrize('engine', ['loop', 'vmap'])
def test_mimelite_matches_fedjax(femnist, engine):
  model = _mlp_model()
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=9)
  params = model.init(jax.random.PRNGKey(1))
  base = optax.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-3)
  ref = fedjax_mime_lite.mime_lite(
      fedjax.model_per_example_loss(model),
      fedjax.optimizers.create_optimizer_from_optax(base), hp,
      fedjax.PaddedBatchHParams(batch_size=64), server_learning_rate=0.7)
  ours = mime_lite.efficient_mime_lite(
      fedjax.model_grad(model), base, hp, grads_batch_size=64,
      server_learning_rate=0.7, engine=engine)
  ref_state = ref.init(params)
  for r in range(2):
    start = ours.init(ref_state.params).replace(
        opt_state=ref_state.opt_state, round=jnp.asarray(r, jnp.int32))
    our_state, diag = ours.apply(start, femnist)
    ref_state, _ = ref.apply(ref_state, femnist)
    assert _max_diff(ref_state.params, our_state.params) < 2e-6
    assert _max_diff(ref_state.opt_state, our_state.opt_state) < 2e-5
    assert _max_diff(start.params, our_state.params) > 1e-3
    assert _max_diff(start.opt_state, our_state.opt_state) > 1e-3
  n = sum(x.size for x in jax.tree.leaves(params))
  for d in diag.values():
    assert d['upload_bits'] == 2 * 32 * n  # delta + full-batch gradient
    assert d['download_bits'] == 2 * 32 * n  # model + Adagrad accumulator


def _quadratic_clients(centers, counts):
  """Clients whose per-example loss is 0.5 ||w - c||^2 (gradient w - c)."""
  out = []
  for i, (c, n) in enumerate(zip(centers, counts)):
    x = np.tile(np.asarray(c, np.float32), (n, 1))
    out.append((f'c{i}'.encode(), fedjax.ClientDataset({'x': x}),
                jax.random.PRNGKey(i)))
  return out


def _quadratic_grad(params, batch, rng):
  del rng
  return {'w': params['w'] - jnp.mean(batch['x'], axis=0)}


def test_fedprox_closed_form_two_steps():
  # Two local SGD steps on 0.5||w - c||^2 + 0.5 mu ||w - w0||^2:
  #   w1 = w0 - eta (w0 - c)
  #   w2 = w1 - eta ((w1 - c) + mu (w1 - w0))
  eta, mu = 0.3, 0.5
  w0 = np.array([1.0, -2.0], np.float32)
  centers = [np.array([3.0, 1.0]), np.array([-1.0, 0.0])]
  counts = [4, 12]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=None,
                                        num_steps=2, seed=0)
  alg = fedopt.federated_averaging(
      _quadratic_grad, optax.sgd(eta), optax.sgd(1.0), hp, fedprox_mu=mu,
      engine='loop')
  state, _ = alg.apply(alg.init({'w': jnp.asarray(w0)}),
                       _quadratic_clients(centers, counts))
  finals = []
  for c in centers:
    w1 = w0 - eta * (w0 - c)
    finals.append(w1 - eta * ((w1 - c) + mu * (w1 - w0)))
  expected = (counts[0] * finals[0] + counts[1] * finals[1]) / sum(counts)
  np.testing.assert_allclose(state.params['w'], expected, rtol=1e-6)


def test_mimelite_closed_form_sgd_base():
  # With an SGD base (no statistics) MimeLite is FedAvg with server step
  # size server_lr on the mean delta: w <- w - s * mean(eta * (w - c_k)).
  eta, s = 0.25, 0.5
  w0 = np.array([0.5, 2.0], np.float32)
  centers = [np.array([1.0, 1.0]), np.array([-3.0, 2.0])]
  counts = [3, 5]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=8, num_epochs=None,
                                        num_steps=1, seed=0)
  alg = mime_lite.efficient_mime_lite(
      _quadratic_grad, optax.sgd(eta), hp, grads_batch_size=4,
      server_learning_rate=s, engine='loop')
  state, _ = alg.apply(alg.init({'w': jnp.asarray(w0)}),
                       _quadratic_clients(centers, counts))
  deltas = [eta * (w0 - c) for c in centers]
  mean = (counts[0] * deltas[0] + counts[1] * deltas[1]) / sum(counts)
  np.testing.assert_allclose(state.params['w'], w0 - s * mean, rtol=1e-6)


def test_bad_settings_raise():
  with pytest.raises(ValueError, match='fedprox_mu'):
    fedopt.federated_averaging(
        _quadratic_grad, optax.sgd(0.1), optax.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=2), fedprox_mu=-1.0)
  with pytest.raises(ValueError, match='grads_batch_size'):
    mime_lite.efficient_mime_lite(
        _quadratic_grad, optax.sgd(0.1),
        fedjax.ShuffleRepeatBatchHParams(batch_size=2), grads_batch_size=0)


def test_nonfinite_update_is_a_clear_error():
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=None,
                                        num_steps=1, seed=0)
  alg = fedopt.federated_averaging(
      _quadratic_grad, optax.sgd(float('nan')), optax.sgd(1.0), hp,
      engine='loop')
  with pytest.raises(FloatingPointError, match='non-finite'):
    alg.apply(alg.init({'w': jnp.ones(2)}),
              _quadratic_clients([np.zeros(2)], [2]))
