"""DP-FedAvg on FedJAX's fed_avg clients (fedlite_jax.algorithms.dp_fedavg),
plain and through rounds.CompressedBackend."""

import dataclasses

import fedlite_jax  # noqa: F401  (FedJAX compatibility first)
import fedjax
from fedjax.algorithms import fed_avg
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax import privacy
from fedlite_jax.algorithms import dp_fedavg
from fedlite_jax.rounds import CompressedBackend

HP = fedjax.ShuffleRepeatBatchHParams(batch_size=5, num_epochs=1, seed=0)


def _grad(params, batch, rng):
  del rng
  def loss(p):
    pred = batch['x'] @ p['w'] + p['b']
    return jnp.mean((pred - batch['y']) ** 2)
  return jax.grad(loss)(params)


def _clients(m=4, n=10, scale=1.0):
  rng = np.random.default_rng(0)
  out = []
  for i in range(m):
    x = rng.normal(size=(n, 3)).astype(np.float32)
    y = (scale * (x @ np.array([1.0, -2.0, 0.5]) + i)).astype(np.float32)
    out.append((f'c{i}'.encode(), fedjax.ClientDataset({'x': x, 'y': y}),
                jax.random.PRNGKey(i)))
  return out


PARAMS = {'w': jnp.zeros((3,)), 'b': jnp.zeros(())}


def _flat(tree):
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def test_large_clip_no_noise_equals_fedjax_fed_avg():
  # Equal example counts: FedJAX's example weights equal uniform weights.
  clients = _clients()
  theirs = fed_avg.federated_averaging(_grad, fedjax.optimizers.sgd(0.1),
                                       fedjax.optimizers.sgd(1.0), HP)
  ours = dp_fedavg.dp_federated_averaging(
      _grad, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0), HP,
      clip_norm=1e6, noise_multiplier=0.0)
  a, b = theirs.init(PARAMS), ours.init(PARAMS)
  for _ in range(2):
    a, _ = theirs.apply(a, clients)
    b, diag = ours.apply(b, clients)
  np.testing.assert_allclose(_flat(b.params), _flat(a.params), rtol=1e-5,
                             atol=1e-6)
  assert set(diag) == {cid for cid, _, _ in clients}


def test_clipped_round_moves_the_model_by_at_most_c():
  c = 0.05
  ours = dp_fedavg.dp_federated_averaging(
      _grad, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0), HP,
      clip_norm=c, noise_multiplier=0.0)
  state, diag = ours.apply(ours.init(PARAMS), _clients(scale=10.0))
  assert all(float(d['delta_l2_norm']) > c for d in diag.values())
  # A mean of vectors of norm <= C (triangle inequality).
  assert np.linalg.norm(_flat(state.params)) <= c * (1 + 1e-5)


def test_noise_std_on_the_server_update_is_zc_over_denominator():
  c, z, m = 0.01, 2.0, 4

  algo = dp_fedavg.dp_federated_averaging(
      _grad, fedjax.optimizers.sgd(0.0), fedjax.optimizers.sgd(1.0), HP,
      clip_norm=c, noise_multiplier=z)
  start = algo.init(PARAMS)
  clients = _clients(m)

  def one(seed):
    # Client lr 0: every delta is 0, so the update is the noise alone.
    state = dataclasses.replace(start, key=jax.random.PRNGKey(seed))
    return _flat(algo.apply(state, clients)[0].params)

  samples = np.concatenate([one(s) for s in range(100)])  # 400 values
  sigma = z * c / m
  n = samples.size
  assert abs(samples.mean()) < 5 * sigma / np.sqrt(n)
  assert abs(samples.std() - sigma) < 5 * sigma / np.sqrt(2 * n)


def test_through_compressed_backend_with_adaptive_clipping():
  backend = CompressedBackend(upload='uniform_quantization:8')
  with fedjax.for_each_client_backend(backend):
    algo = dp_fedavg.dp_federated_averaging(
        _grad, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0), HP,
        clip_norm=0.01, noise_multiplier=0.5,
        adaptive=dp_fedavg.AdaptiveClipping(0.5, 0.5, 1.0))
  state = algo.init(PARAMS)
  for _ in range(3):
    state, _ = algo.apply(state, _clients())
  assert float(state.clip_norm) > 0.01  # every delta exceeds C: C grows
  assert backend.ledger.summary()['rounds'] == 3
  with pytest.raises(ValueError, match='too small') as e:
    dp_fedavg.dp_federated_averaging(
        _grad, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0), HP,
        clip_norm=1.0, noise_multiplier=1.0,
        adaptive=dp_fedavg.AdaptiveClipping(count_noise_std=0.4))
  assert '\n' not in str(e.value)
  assert privacy.clip_sensitivity('uniform_quantization:8', 0.01).bound == 0.01
