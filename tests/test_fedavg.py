"""Our FedAvg/FedAdam equals fedjax.algorithms.fed_avg on the same clients.

Independent reference: FedJAX's own implementation, on real FEMNIST writers,
with the same clients, batches (same shuffle seed) and PRNG keys.
"""

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
from fedlite_jax.algorithms import federated_averaging


@pytest.fixture(scope='module')
def femnist(data_dir):
  train, _, _ = datasets.load_federated_data('emnist', str(data_dir))
  ids = list(train.client_ids())[:5]
  return [(cid, cds, jax.random.PRNGKey(i))
          for i, (cid, cds) in enumerate(train.get_clients(ids))]


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _run(alg, params, clients, rounds):
  state = alg.init(params)
  for _ in range(rounds):
    state, diag = alg.apply(state, clients)
  return state, diag


def _compare_rounds(ref, ours, params, clients, rounds, tol):
  """Per round, from the SAME starting state (FedJAX's), so that a tiny
  float-order difference is not amplified by the chaotic training dynamics
  (FedJAX itself turns a 1e-8 perturbation of the initial model into ~6e-5
  after one EMNIST round)."""
  ref_state = ref.init(params)
  diag = None
  for _ in range(rounds):
    start = ours.init(ref_state.params).replace(opt_state=ref_state.opt_state)
    our_state, diag = ours.apply(start, clients)
    ref_state, _ = ref.apply(ref_state, clients)
    assert _max_diff(ref_state.params, our_state.params) < tol
    assert _max_diff(start.params, our_state.params) > 1e-3  # not vacuous
  return diag


def test_cnn_matches_fedjax_fed_avg(femnist):
  model = models.create_emnist_cnn(62).model  # has dropout: rng use matters
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=7)
  params = model.init(jax.random.PRNGKey(0))
  ref = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0), hp)
  ours = federated_averaging(grad_fn, optax.sgd(0.1), optax.sgd(1.0), hp,
                             engine='loop')
  diag = _compare_rounds(ref, ours, params, femnist, 2, tol=1e-6)
  n = sum(x.size for x in jax.tree.leaves(params))
  assert n == 1_206_590
  for d in diag.values():
    assert d['upload_bits'] == d['download_bits'] == 32 * n


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


@pytest.mark.parametrize('server', ['sgd', 'adam'])
def test_vmap_engine_matches_fedjax(femnist, server):
  # vmap of convolutions is very slow on XLA:CPU, so the vmapped engine is
  # checked here with a small MLP (same engine code path for any model).
  model = _mlp_model()
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=3)
  params = model.init(jax.random.PRNGKey(1))
  server_opt = optax.sgd(1.0) if server == 'sgd' else optax.adam(1e-2)
  ref = fedjax.algorithms.fed_avg.federated_averaging(
      grad_fn, fedjax.optimizers.sgd(0.1),
      fedjax.optimizers.create_optimizer_from_optax(server_opt), hp)
  ours = federated_averaging(grad_fn, optax.sgd(0.1), server_opt, hp,
                             engine='vmap')
  # Adam's first step is lr * g / (|g| + 1e-8): on coordinates whose mean
  # delta g is ~1e-8, the float-order noise of the vmapped sum (~1e-12)
  # moves the update by up to ~lr * 1e-4. SGD passes the noise through.
  _compare_rounds(ref, ours, params, femnist, 2,
                  tol=1e-6 if server == 'sgd' else 5e-6)


def test_fedavg_server_sgd1_is_weighted_average_of_client_models(femnist):
  # Hand-derivable expectation: with server SGD(1.0), the new server model is
  # the example-weighted mean of the clients' local models.
  model = _mlp_model()
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=3)
  params = model.init(jax.random.PRNGKey(1))
  clients = femnist[:3]
  state, _ = _run(federated_averaging(grad_fn, optax.sgd(0.1), optax.sgd(1.0),
                                      hp, engine='loop'), params, clients, 1)
  locals_, weights = [], []
  for cid, cds, rng in clients:  # each client alone: the mean is its model
    s, _ = _run(federated_averaging(grad_fn, optax.sgd(0.1), optax.sgd(1.0),
                                    hp, engine='loop'), params,
                [(cid, cds, rng)], 1)
    locals_.append(s.params)
    weights.append(len(cds))
  w = np.asarray(weights, np.float64) / sum(weights)
  expected = jax.tree.map(lambda *xs: sum(wi * x for wi, x in zip(w, xs)),
                          *locals_)
  assert _max_diff(expected, state.params) < 1e-5


def test_nan_update_is_a_clear_error(femnist):
  model = _mlp_model()
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=3)
  params = model.init(jax.random.PRNGKey(1))
  alg = federated_averaging(grad_fn, optax.sgd(float('nan')), optax.sgd(1.0),
                            hp, engine='loop')
  with pytest.raises(FloatingPointError, match='non-finite'):
    alg.apply(alg.init(params), femnist[:2])


@pytest.mark.parametrize('engine', ['loop', 'vmap'])
def test_python_api_later_rounds_compile_nothing(engine):
  """FedJAX-style use (``init``, then ``apply`` per round, no runner):
  round 1 compiles (the counter counts), rounds 2 and 3 on other cohorts
  compile nothing: ``init``'s state sits where the server update puts its
  output, so neither the server update nor the download compiles again."""
  from fedlite_jax.rounds import stats  # pylint: disable=g-import-not-at-top
  model = _mlp_model()
  rng = np.random.RandomState(0)

  def cohort(r):
    return [(b'c%d' % i, fedjax.ClientDataset({
        'x': rng.rand(n, 28, 28, 1).astype(np.float32),
        'y': rng.randint(0, 62, n).astype(np.int32)}),
             jax.random.PRNGKey(10 * r + i))
            for i, n in enumerate(rng.randint(5, 60, 4))]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=None)
  alg = federated_averaging(fedjax.model_grad(model), optax.sgd(0.1),
                            optax.adam(1e-2), hp, engine=engine)
  state = alg.init(model.init(jax.random.PRNGKey(1)))
  counts = []
  for r in range(3):
    with stats.counting_compilations() as c:
      state, _ = alg.apply(state, cohort(r))
      jax.block_until_ready(state.params)
    counts.append(c.total)
  assert counts[0] > 0 and counts[1:] == [0, 0], counts
