"""Baselines: uncompressed SGD / FedAvg(local steps), local Top-K, FetchSGD.

References are written with NumPy (top-k by argsort, count sketch by
``np.add.at`` + ``np.median``, FetchSGD's server step as in CommEfficient's
``_server_helper_sketched``), on real FEMNIST writers with a small MLP. The
download accounting is checked against a hand-computed scenario and against
the definition "weights that differ between the model the client last
downloaded and the current one" (CommEfficient diffs its weight history).
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
from jax.flatten_util import ravel_pytree

from fedlite_jax import datasets
from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import fetchsgd
from fedlite_jax.algorithms import rounds_common
from fedlite_jax.rounds import stats

LR = 0.5
BATCH = 16


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(62)(nn.relu(nn.Dense(8)(x)))


def _sgd_baseline(grad_fn, client_opt, server_opt, *, batch_size,
                  local_steps=1, upload=None, **kwargs):
  """IGC's SGD / FedAvg-with-local-steps / local Top-K baseline: FedAvg with
  ``local_steps`` batches per client, client weight 1, ``upload`` chain."""
  return fedopt.federated_averaging(
      grad_fn, client_opt, server_opt,
      fedopt.batch_hparams(batch_size, local_steps), weighting='uniform',
      compression=fedopt.Compression(upload=upload), **kwargs)


@pytest.fixture(scope='module')
def setup(data_dir):
  net = _Mlp()
  model = fedjax.Model(
      init=lambda rng: net.init(rng, jnp.zeros((1, 28, 28, 1))),
      apply_for_train=lambda p, b, rng: net.apply(p, b['x']),
      apply_for_eval=lambda p, b: net.apply(p, b['x']),
      train_loss=lambda b, preds: fedjax.metrics.unreduced_cross_entropy_loss(
          b['y'], preds),
      eval_metrics={})
  train, _, _ = datasets.load_federated_data('emnist', str(data_dir))
  ids = list(train.client_ids())[:10]
  return (fedjax.model_grad(model), model.init(jax.random.PRNGKey(0)), ids,
          dict(train.get_clients(ids)))


def _rounds(setup, pattern):
  _, _, ids, data = setup
  return [[(ids[c], data[ids[c]], jax.random.PRNGKey(100 * r + c))
           for c in clients] for r, clients in enumerate(pattern)]


PATTERN = [(0, 1, 2), (3, 0, 4), (5, 6, 1), (0, 7, 8), (2, 9, 3)]


def _client_delta(setup, flat, cds, rng, local_steps=1):
  grad_fn, params0, _, _ = setup
  unravel = ravel_pytree(params0)[1]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=BATCH, num_epochs=None,
                                        num_steps=local_steps)
  p, key = jnp.asarray(flat), rng
  for batch in batching.client_batches(cds, hp, rng):
    key, use = jax.random.split(key)
    p = p - LR * ravel_pytree(grad_fn(unravel(p), batch, use))[0]
  return np.asarray(flat - p, np.float64)


def _run(alg, params, rounds):
  state = alg.init(params)
  history, diags = [ravel_pytree(state.params)[0]], []
  for clients in rounds:
    state, diag = alg.apply(state, clients)
    history.append(ravel_pytree(state.params)[0])
    diags.append(diag)
  return state, history, diags


@pytest.mark.parametrize('local_steps', [1, 3])
def test_sgd_and_fedavg_local_steps_match_reference(setup, local_steps):
  grad_fn, params0, ids, _ = setup
  rounds = _rounds(setup, PATTERN[:3])
  alg = _sgd_baseline(
      grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH,
      local_steps=local_steps, client_ids=ids, engine='loop')
  _, history, diags = _run(alg, params0, rounds)
  flat = np.asarray(history[0], np.float64)
  for r, clients in enumerate(rounds):
    deltas = [_client_delta(setup, flat.astype(np.float32), cds, rng,
                            local_steps) for _, cds, rng in clients]
    flat = flat - np.mean(deltas, axis=0)
    np.testing.assert_allclose(history[r + 1], flat, rtol=1e-4, atol=1e-6)
  D = flat.size
  for d in diags[0].values():
    assert d['upload_bits'] == d['download_bits'] == 32 * D
    assert d['num_examples'] == BATCH * local_steps


@pytest.mark.parametrize('index_bits', ['log2', 'none'])
def test_local_topk_matches_numpy_reference(setup, index_bits):
  grad_fn, params0, ids, _ = setup
  k = 300
  rounds = _rounds(setup, PATTERN[:3])
  alg = _sgd_baseline(
      grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH,
      upload=tx.top_k(k, index_bits), download_accounting='changed',
      client_ids=ids, engine='loop')
  _, history, diags = _run(alg, params0, rounds)
  flat = np.asarray(history[0], np.float64)
  D = flat.size
  for r, clients in enumerate(rounds):
    sparse = []
    for _, cds, rng in clients:
      delta = _client_delta(setup, flat.astype(np.float32), cds, rng)
      idx = np.argsort(-np.abs(delta), kind='stable')[:k]
      s = np.zeros(D)
      s[idx] = delta[idx]
      sparse.append(s)
    flat = flat - np.mean(sparse, axis=0)
    np.testing.assert_allclose(history[r + 1], flat, rtol=1e-4, atol=1e-6)
  per_index = int(np.ceil(np.log2(D))) if index_bits == 'log2' else 0
  assert all(d['upload_bits'] == k * (32 + per_index)
             for d in diags[0].values())


def _np_unsketch(table, buckets, signs):
  rows = table.shape[0]
  return np.median(table[np.arange(rows)[:, None], buckets] * signs, axis=0)


def test_fetchsgd_matches_numpy_reference(setup):
  grad_fn, params0, ids, _ = setup
  rows, cols, k, rho, seed = 5, 400, 40, 0.9, 77
  rounds = _rounds(setup, PATTERN)
  alg = fetchsgd.fetchsgd(grad_fn, optax.sgd(LR), batch_size=BATCH,
                          rows=rows, cols=cols, k=k, momentum=rho, seed=seed,
                          client_ids=ids, engine='loop')
  state, history, diags = _run(alg, params0, rounds)
  flat = np.asarray(history[0], np.float64)
  D = flat.size
  buckets, signs = (np.asarray(a) for a in tx.sketch_hashes(seed, rows, cols,
                                                            D))
  V = np.zeros((rows, cols))
  E = np.zeros((rows, cols))
  for r, clients in enumerate(rounds):
    S = np.zeros((rows, cols))
    for _, cds, rng in clients:
      delta = _client_delta(setup, flat.astype(np.float32), cds, rng)
      for j in range(rows):
        np.add.at(S[j], buckets[j], signs[j] * delta)
    S /= len(clients)
    V = rho * V + S
    E = E + V
    est = _np_unsketch(E, buckets, signs)
    idx = np.argsort(-np.abs(est), kind='stable')[:k]
    update = np.zeros(D)
    update[idx] = est[idx]
    hit = np.zeros((rows, cols), bool)
    for j in range(rows):
      hit[j, buckets[j, idx]] = True
    E[hit] = 0
    V[hit] = 0
    flat = flat - update
    np.testing.assert_allclose(history[r + 1], flat, rtol=1e-4, atol=1e-5)
    assert np.count_nonzero(history[r + 1] != history[r]) == k
  np.testing.assert_allclose(np.asarray(state.error), E, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.momentum), V, rtol=1e-4,
                             atol=1e-5)
  assert all(d['upload_bits'] == 32 * rows * cols for d in diags[0].values())


def test_changed_counts_hand_computed():
  # 6 weights; updates: round 0 changes w0, w1; round 1 changes w1, w2;
  # round 2 changes w5.
  last = np.full(6, -1, np.int32)
  theta = [np.zeros(6, np.float32)]
  for changed in ([0, 1], [1, 2], [5]):
    new = theta[-1].copy()
    new[changed] += 1.0
    last = np.asarray(rounds_common.mark_changed(
        jnp.asarray(last), jnp.asarray(theta[-1]), jnp.asarray(new),
        jnp.asarray(len(theta) - 1)))
    theta.append(new)
  np.testing.assert_array_equal(last, [0, 1, 1, -1, -1, 2])
  # A client downloading at round 3 that last took part in round p (-1:
  # never, it knows theta_0) needs the weights changed by rounds p..2.
  counts = rounds_common.changed_counts(jnp.asarray(last),
                                 jnp.asarray([-1, 0, 1, 2, 3]))
  np.testing.assert_array_equal(np.asarray(counts), [4, 4, 3, 1, 0])
  # The same in bits, and dense accounting: 32 x D for every client, also
  # when no participation history is kept (no client ids: W = 0 rows).
  np.testing.assert_array_equal(
      rounds_common.download_bits('changed', 32 * 6, 5, jnp.asarray(last),
                           jnp.asarray([-1, 0, 1, 2, 3])),
      [128, 128, 96, 32, 0])
  np.testing.assert_array_equal(
      rounds_common.download_bits('dense', 32 * 6, 3, jnp.asarray(last),
                           jnp.zeros((0,), jnp.int32)), [192] * 3)
  # The clients at positions of the training clients' tracker: gathered
  # inside the compiled program, the same bits.
  tracker = jnp.asarray([3, 2, -1, 1, 0, 9], jnp.int32)
  np.testing.assert_array_equal(
      rounds_common.download_bits('changed', 32 * 6, 5, jnp.asarray(last),
                                  tracker, np.asarray([2, 4, 3, 1, 0],
                                                      np.int32)),
      [128, 128, 96, 32, 0])


def test_server_update_and_participation_are_one_program():
  """rounds_common.server_update: the update, then round + 1 and the
  participants' last round = the round, in one program compiled once."""
  state = fedopt.FedOptState(
      params={'w': jnp.ones(2)}, opt_state=(), round=jnp.asarray(4, jnp.int32),
      last_changed=jnp.zeros((0,), jnp.int32),
      last_round=jnp.asarray([-1, 2, -1, 0], jnp.int32))

  def update(state, delta):
    new = state.replace(params={'w': state.params['w'] - delta})
    return new, jnp.asarray(True)

  with stats.counting_compilations() as compiles:
    for r in range(3):
      state, finite = rounds_common.server_update(
          update, state, np.asarray([2, 0], np.int32), jnp.full(2, 0.5))
      assert bool(finite)
      np.testing.assert_array_equal(state.params['w'], [0.5 - 0.5 * r] * 2)
      assert int(state.round) == 5 + r
      np.testing.assert_array_equal(state.last_round, [4 + r, 2, 4 + r, 0])
  assert compiles.count('server_update') == 1


@pytest.mark.parametrize('method', ['topk', 'fetchsgd'])
def test_download_is_weights_changed_since_last_participation(setup, method):
  grad_fn, params0, ids, _ = setup
  rounds = _rounds(setup, PATTERN)
  if method == 'topk':
    alg = _sgd_baseline(
        grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH,
        upload=tx.top_k(50), download_accounting='changed', client_ids=ids,
        engine='loop')
  else:
    alg = fetchsgd.fetchsgd(grad_fn, optax.sgd(LR), batch_size=BATCH, rows=3,
                            cols=200, k=60, client_ids=ids, engine='loop')
  _, history, diags = _run(alg, params0, rounds)
  last_download = {}
  for r, clients in enumerate(rounds):
    for cid, _, _ in clients:
      had = history[last_download.get(cid, 0)]
      expected = 32 * int(np.count_nonzero(history[r] != had))
      assert diags[r][cid]['download_bits'] == expected, (r, cid)
      last_download[cid] = r
  # Sanity: far below the dense 32 D for returning clients.
  assert diags[1][ids[0]]['download_bits'] < 32 * 200


def test_bad_settings(setup):
  grad_fn, params0, ids, _ = setup
  D = ravel_pytree(params0)[0].size
  with pytest.raises(ValueError, match='exceeds'):
    fetchsgd.fetchsgd(grad_fn, optax.sgd(LR), batch_size=BATCH, rows=3,
                      cols=10, k=D + 1, client_ids=ids).init(params0)
  with pytest.raises(ValueError, match='exceeds'):
    _sgd_baseline(
        grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH,
        upload=tx.top_k(D + 1)).init(params0)
  with pytest.raises(ValueError, match='stateless'):
    _sgd_baseline(
        grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH,
        upload=tx.top_k(5, error_feedback=True)).init(params0)
  with pytest.raises(ValueError, match='client_ids'):
    _sgd_baseline(
        grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH,
        upload=tx.top_k(5), download_accounting='changed')
  with pytest.raises(ValueError, match='momentum'):
    fetchsgd.fetchsgd(grad_fn, optax.sgd(LR), batch_size=BATCH, rows=3,
                      cols=10, k=5, momentum=1.0, download_accounting='dense')
  with pytest.raises(ValueError, match='local_steps'):
    _sgd_baseline(grad_fn, optax.sgd(LR), optax.sgd(1.0),
                                  batch_size=BATCH, local_steps=0)
