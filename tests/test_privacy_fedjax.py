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


# --- one adaptive step, by hand, through both entry points ---------------------

from fedlite_jax.algorithms import fedopt  # noqa: E402
from fedlite_jax.common import DP_STREAM  # noqa: E402
import optax  # noqa: E402

# Four clients whose delta is their row d_i (one local SGD step at rate 1 on
# the gradient mean(d)): norms 0.5, 0.5, 0.5, 2 around C = 1.
_DELTAS = np.array([[0.3, 0.4, 0.0], [0.0, 0.3, -0.4], [0.5, 0.0, 0.0],
                    [0.0, 0.0, 2.0]], np.float32)
_STEP = dict(c=1.0, z=1.0, sigma_b=2.0, gamma=0.25, eta=0.2, w=4.0, m=40.0,
             seed=11)
_ONE_STEP_HP = fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=1,
                                                seed=0)


def _delta_grad(params, batch, rng):
  del rng
  return {'w': jnp.mean(batch['d'], axis=0) + 0.0 * params['w']}


def _delta_clients():
  return [(f'c{i}'.encode(),
           fedjax.ClientDataset({'d': np.stack([d, d])}),
           jax.random.PRNGKey(i)) for i, d in enumerate(_DELTAS)]


def _by_hand(k_count, norms, eta=None, rule='geometric', scaled=True):
  """Andrew et al. 2021, Alg. 1 written out: b_bar from the centered count
  with noise sigma_b * W / M (the sum's scaling), clamped to [0, 1]."""
  p = _STEP
  eta = p['eta'] if eta is None else eta
  sigma = p['sigma_b'] * (p['w'] / p['m'] if scaled else 1.0)
  noise = sigma * float(jax.random.normal(k_count, (), jnp.float32))
  b_bar = (np.sum((norms <= p['c']) - 0.5) + noise) / p['w'] + 0.5
  b_bar = min(max(b_bar, 0.0), 1.0)
  if rule == 'linear':
    return p['c'] * (1 - eta * (b_bar - p['gamma']))
  return p['c'] * np.exp(-eta * (b_bar - p['gamma']))


def _check_one_step(got, k_count, norms):
  want = _by_hand(k_count, norms)
  assert got == pytest.approx(want, rel=1e-6)
  # Each wrong variant is far from it: a doubled eta, a linear rule, the
  # count noise unscaled by W / M.
  for wrong in (_by_hand(k_count, norms, eta=2 * _STEP['eta']),
                _by_hand(k_count, norms, rule='linear'),
                _by_hand(k_count, norms, scaled=False)):
    assert abs(wrong - want) > 1e-3 * want


def test_one_adaptive_step_of_the_runners_federated_averaging():
  p = _STEP
  dp = fedopt.DP(clip_norm=p['c'], noise_multiplier=p['z'],
                 denominator=p['w'], noise_cohort_size=p['m'],
                 target_quantile=p['gamma'], clip_learning_rate=p['eta'],
                 count_noise_std=p['sigma_b'])
  algo = fedopt.federated_averaging(
      _delta_grad, optax.sgd(1.0), optax.sgd(1.0), _ONE_STEP_HP,
      weighting='uniform', seed=p['seed'], engine='loop', dp=dp)
  state, diag = algo.apply(algo.init({'w': jnp.zeros(3)}), _delta_clients())
  norms = np.array([float(diag[f'c{i}'.encode()]['dp_norm'])
                    for i in range(4)])
  np.testing.assert_allclose(norms, np.linalg.norm(_DELTAS, axis=1),
                             rtol=1e-6)
  # The round's key: fold_in(fold_in(PRNGKey(seed), DP_STREAM), round 0),
  # split into the sum's and the count's.
  key = jax.random.fold_in(jax.random.fold_in(
      jax.random.PRNGKey(p['seed']), DP_STREAM), 0)
  _check_one_step(float(state.clip_norm), jax.random.split(key)[1], norms)


def test_one_adaptive_step_of_dp_federated_averaging():
  p = _STEP
  algo = dp_fedavg.dp_federated_averaging(
      _delta_grad, fedjax.optimizers.sgd(1.0), fedjax.optimizers.sgd(1.0),
      _ONE_STEP_HP, clip_norm=p['c'], noise_multiplier=p['z'],
      denominator=p['w'], noise_cohort_size=p['m'], seed=p['seed'],
      adaptive=dp_fedavg.AdaptiveClipping(p['gamma'], p['eta'],
                                          p['sigma_b']))
  start = algo.init({'w': jnp.zeros(3)})
  state, diag = algo.apply(start, _delta_clients())
  norms = np.array([float(diag[f'c{i}'.encode()]['delta_l2_norm'])
                    for i in range(4)])
  np.testing.assert_allclose(norms, np.linalg.norm(_DELTAS, axis=1),
                             rtol=1e-6)
  # The round's key: split(state.key)[1], split into the sum's and the
  # count's; [0] is the next state's key.
  next_key, round_key = jax.random.split(start.key)
  np.testing.assert_array_equal(state.key, next_key)
  _check_one_step(float(state.clip_norm), jax.random.split(round_key)[1],
                  norms)
