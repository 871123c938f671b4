"""Intrinsic gradient compression algorithms (static, K-subspace, TV, both).

Independent reference: Algorithms 1-3 of Melas-Kyriazi & Wang (2022) written
out below with FedJAX's ``model_grad`` and the Fastfood operator directly
(``theta = theta_base + sum_k A^(k) Sigma^(k)``, ``Sigma^(k) -= eta / W
sum_{i: k_i = k} A^(k)T g_i``, new matrices each epoch), on real FEMNIST
writers with a small MLP.
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401

import types

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedlite_jax.training import state_io
from fedlite_jax import datasets
from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import igc
from fedlite_jax.training import algo_igc  # noqa: F401  (registers igc_*)
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import registry
from fedlite_jax.training import tasks
from fedlite_jax.transforms import fastfood as ff

LR = 0.5
BATCH = 16


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(62)(nn.relu(nn.Dense(16)(x)))


def _model():
  net = _Mlp()
  return fedjax.Model(
      init=lambda rng: net.init(rng, jnp.zeros((1, 28, 28, 1))),
      apply_for_train=lambda p, b, rng: net.apply(p, b['x']),
      apply_for_eval=lambda p, b: net.apply(p, b['x']),
      train_loss=lambda b, preds: fedjax.metrics.unreduced_cross_entropy_loss(
          b['y'], preds),
      eval_metrics={'loss': fedjax.metrics.CrossEntropyLoss()})


@pytest.fixture(scope='module')
def femnist(data_dir):
  train, _, _ = datasets.load_federated_data('emnist', str(data_dir))
  ids = list(train.client_ids())[:12]
  return ids, dict(train.get_clients(ids))


@pytest.fixture(scope='module')
def setup():
  model = _model()
  return model, fedjax.model_grad(model), model.init(jax.random.PRNGKey(0))


def _rounds(femnist, pattern):
  ids, data = femnist
  return [[(ids[c], data[ids[c]], jax.random.PRNGKey(1000 * r + c))
           for c in clients] for r, clients in enumerate(pattern)]


PATTERN = [(0, 1, 2, 3), (4, 5, 0, 6), (7, 1, 8, 9), (2, 3, 10, 11),
           (5, 0, 9, 1)]


def _build(setup, femnist, **kw):
  _, grad_fn, _ = setup
  kw.setdefault('client_ids', femnist[0])
  kw.setdefault('engine', 'loop')
  return igc.intrinsic_gradient_compression(
      grad_fn, optax.sgd(LR), optax.sgd(1.0), batch_size=BATCH, **kw)


def _run(alg, params, rounds, state=None):
  state = alg.init(params) if state is None else state
  diags = []
  for clients in rounds:
    state, diag = alg.apply(state, clients)
    diags.append(diag)
  return state, diags


def _reference(setup, rounds, ks, *, d, K, seed, rpe=None, local_steps=1):
  """Algorithms 1-3 as written in the paper (float32, plain loops)."""
  _, grad_fn, params0 = setup
  flat0, unravel = ravel_pytree(params0)
  D = flat0.size
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=BATCH, num_epochs=None,
                                        num_steps=local_steps)
  base, sigma, epoch = flat0, np.zeros((K, d), np.float32), 0
  mats = None
  for r, clients in enumerate(rounds):
    e = r // rpe if rpe else 0
    if mats is None or e != epoch:
      if mats is not None:  # reconcile: theta_{e-1}^final
        base = base + sum(ff.fastfood_lift(mats[k], sigma[k])
                          for k in range(K))
        sigma = np.zeros((K, d), np.float32)
      mats = [ff.fastfood_params(tx.subspace_seed(seed, e, k), D, d)
              for k in range(K)]
      epoch = e
    theta = base + sum(ff.fastfood_lift(mats[k], sigma[k]) for k in range(K))
    S = np.zeros((K, d), np.float32)
    for (cid, cds, rng), k in zip(clients, ks[r]):
      p = theta
      key = rng
      for batch in batching.client_batches(cds, hp, rng):
        key, use = jax.random.split(key)
        g = ravel_pytree(grad_fn(unravel(p), batch, use))[0]
        p = p - LR * g
      S[k] += np.asarray(ff.fastfood_project(mats[k], theta - p))
    sigma = sigma - S / len(clients)
  theta = base + sum(ff.fastfood_lift(mats[k], sigma[k]) for k in range(K))
  return unravel(theta), sigma


def _close(a, b, **kw):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), **kw), a, b)


def _equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(
      np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize('K,tv,local_steps', [
    (1, False, 1), (3, False, 1), (1, True, 1), (2, True, 1), (1, False, 3)])
def test_matches_paper_algorithm(setup, femnist, K, tv, local_steps):
  rounds = _rounds(femnist, PATTERN)
  alg = _build(setup, femnist, intrinsic_dim=64, num_subspaces=K,
               time_varying=tv, rounds_per_epoch=2 if tv else None, seed=17,
               local_steps=local_steps)
  state, diags = _run(alg, setup[2], rounds)
  ks = [[diag[cid]['subspace'] for cid, _, _ in clients]
        for diag, clients in zip(diags, rounds)]
  assert {k for r in ks for k in r} == set(range(K))
  ref_params, ref_sigma = _reference(setup, rounds, ks, d=64, K=K, seed=17,
                                     rpe=2 if tv else None,
                                     local_steps=local_steps)
  _close(state.params, ref_params, rtol=2e-4, atol=2e-6)
  np.testing.assert_allclose(np.asarray(state.sigma), ref_sigma, rtol=2e-4,
                             atol=2e-6)
  assert int(state.epoch) == (2 if tv else 0)
  assert not np.allclose(ravel_pytree(state.params)[0],
                         ravel_pytree(setup[2])[0])


def _registry_alg(setup, femnist, algorithm, **options):
  model, _, params = setup
  task = tasks.get_task('emnist')
  config = config_lib.resolve(
      config_lib.RunConfig(task='emnist', algorithm=algorithm,
                           client_batch_size=BATCH, client_lr=LR,
                           round_engine='loop', options=options),
      task.defaults)
  ctx = registry.BuildContext(
      config=config, split_model=types.SimpleNamespace(model=model),
      num_params=ravel_pytree(params)[0].size,
      train_client_ids=tuple(femnist[0]), info=None)
  return registry.get(algorithm).build(ctx)


def test_k_subspace_with_k1_equals_static_exactly(setup, femnist):
  rounds = _rounds(femnist, PATTERN)
  static = _registry_alg(setup, femnist, 'igc_static', intrinsic_dim=64)
  ksub = _registry_alg(setup, femnist, 'igc_k_subspace', intrinsic_dim=64,
                       num_subspaces=1)
  s1, d1 = _run(static, setup[2], rounds)
  s2, d2 = _run(ksub, setup[2], rounds)
  _equal(s1.params, s2.params)
  _equal(s1.sigma, s2.sigma)
  assert d1 == d2


@pytest.mark.parametrize('K', [1, 3])
def test_time_varying_for_one_epoch_equals_static_exactly(setup, femnist, K):
  rounds = _rounds(femnist, PATTERN)
  s1, d1 = _run(_build(setup, femnist, intrinsic_dim=64, num_subspaces=K,
                       seed=5), setup[2], rounds)
  s2, d2 = _run(_build(setup, femnist, intrinsic_dim=64, num_subspaces=K,
                       seed=5, time_varying=True,
                       rounds_per_epoch=len(rounds)), setup[2], rounds)
  _equal(s1.params, s2.params)
  _equal(s1.sigma, s2.sigma)
  for a, b in zip(d1, d2):
    for cid in a:
      assert a[cid]['subspace'] == b[cid]['subspace']
      assert a[cid]['upload_bits'] == b[cid]['upload_bits']
      # Table 1: time-varying downloads 2d (x K).
      assert b[cid]['download_bits'] == 2 * a[cid]['download_bits']


def test_time_varying_moves_in_a_new_subspace_each_epoch(setup, femnist):
  rounds = _rounds(femnist, PATTERN[:3])
  alg = _build(setup, femnist, intrinsic_dim=64, seed=5, time_varying=True,
               rounds_per_epoch=2)
  s2, _ = _run(alg, setup[2], rounds[:2])
  s3, _ = alg.apply(s2, rounds[2])
  _equal(s3.base, s2.params)  # theta_0^final is the new base
  D = ravel_pytree(setup[2])[0].size
  a1 = ff.fastfood_params(tx.subspace_seed(5, 1, 0), D, 64)
  step = ravel_pytree(s3.params)[0] - ravel_pytree(s3.base)[0]
  np.testing.assert_allclose(step, ff.fastfood_lift(a1, s3.sigma[0]),
                             atol=1e-6)
  # The epoch-1 step is not in the epoch-0 subspace: its projection onto
  # span(A_0) (least squares) leaves a large residual.
  a0 = ff.fastfood_params(5, D, 64)
  basis = np.stack([np.asarray(ff.fastfood_lift(a0, e))
                    for e in np.eye(64, dtype=np.float32)], 1)
  coef = np.linalg.lstsq(basis, np.asarray(step), rcond=None)[0]
  resid = np.linalg.norm(basis @ coef - step) / np.linalg.norm(step)
  assert resid > 0.9


def test_exact_download_accounting_follows_participation(setup, femnist):
  # rounds_per_epoch = 2: rounds 0-1 epoch 0, 2-3 epoch 1, 4 epoch 2.
  pattern = [(0, 1), (0, 2), (1, 3), (4, 0), (1, 0, 2, 5)]
  # Vectors needed, by hand: never -> e + 1; same epoch -> 1; else e - p + 1.
  expected = [[1, 1], [1, 1], [2, 2], [2, 2], [2, 2, 3, 3]]
  alg = _build(setup, femnist, intrinsic_dim=32, num_subspaces=2,
               time_varying=True, rounds_per_epoch=2,
               download_accounting='exact')
  _, diags = _run(alg, setup[2], _rounds(femnist, pattern))
  ids = femnist[0]
  for r, (clients, want) in enumerate(zip(pattern, expected)):
    got = [diags[r][ids[c]]['download_bits'] for c in clients]
    assert got == [32 * 32 * 2 * n for n in want], (r, got)
    assert all(diags[r][ids[c]]['upload_bits'] == 32 * 32 + 1
               for c in clients)


def test_upload_quantization_of_the_coordinates(setup, femnist):
  rounds = _rounds(femnist, PATTERN[:2])
  plain, _ = _run(_build(setup, femnist, intrinsic_dim=64, num_subspaces=4),
                  setup[2], rounds)
  quant, diags = _run(_build(setup, femnist, intrinsic_dim=64,
                             num_subspaces=4,
                             upload_transform=tx.uniform_quantization(8)),
                      setup[2], rounds)
  for d in diags[0].values():
    assert d['upload_bits'] == 8 * 64 + 64 + 2
  delta_q = np.asarray(quant.sigma)
  delta_p = np.asarray(plain.sigma)
  assert not np.array_equal(delta_q, delta_p)
  err = np.linalg.norm(delta_q - delta_p) / np.linalg.norm(delta_p)
  assert err < 0.05, err


def test_loop_and_vmap_engines_agree(setup, femnist):
  rounds = _rounds(femnist, PATTERN[:3])
  kw = dict(intrinsic_dim=48, num_subspaces=3, time_varying=True,
            rounds_per_epoch=2, seed=3)
  s1, d1 = _run(_build(setup, femnist, engine='loop', **kw), setup[2], rounds)
  s2, d2 = _run(_build(setup, femnist, engine='vmap', **kw), setup[2], rounds)
  _close(s1.params, s2.params, rtol=1e-5, atol=1e-6)
  assert [{c: v['subspace'] for c, v in d.items()} for d in d1] == \
      [{c: v['subspace'] for c, v in d.items()} for d in d2]


def test_resume_from_checkpoint_is_exact(setup, femnist, tmp_path):
  rounds = _rounds(femnist, PATTERN)
  kw = dict(intrinsic_dim=48, num_subspaces=2, time_varying=True,
            rounds_per_epoch=2, seed=3, download_accounting='exact')
  full, full_diags = _run(_build(setup, femnist, **kw), setup[2], rounds)
  part, _ = _run(_build(setup, femnist, **kw), setup[2], rounds[:3])
  state_io.save_checkpoint(tmp_path, 3, {'server': part}, {'x': 1})
  template = _build(setup, femnist, **kw).init(setup[2])
  _, restored = state_io.restore_checkpoint(
      state_io.latest_checkpoint(tmp_path), {'server': template}, {'x': 1})
  fresh = _build(setup, femnist, **kw)  # cold subspace cache
  resumed, diags = _run(fresh, setup[2], rounds[3:], state=restored['server'])
  _equal(full.params, resumed.params)
  _equal(full.last_epoch, resumed.last_epoch)
  assert diags == full_diags[3:]


def test_nonfinite_updates_raise_or_skip(setup, femnist):
  ids, data = femnist
  bad = fedjax.ClientDataset({'x': np.full((20, 28, 28, 1), np.nan,
                                           np.float32),
                              'y': np.zeros((20,), np.int32)})
  good = [(ids[0], data[ids[0]], jax.random.PRNGKey(1)),
          (ids[1], data[ids[1]], jax.random.PRNGKey(2))]
  with_bad = good + [(b'nan', bad, jax.random.PRNGKey(3))]
  alg = _build(setup, femnist, intrinsic_dim=32, client_ids=None)
  with pytest.raises(FloatingPointError, match="non-finite.*b'nan'"):
    alg.apply(alg.init(setup[2]), with_bad)
  skip = _build(setup, femnist, intrinsic_dim=32, client_ids=None,
                nonfinite='skip')
  s_skip, diag = skip.apply(skip.init(setup[2]), with_bad)
  s_good, _ = skip.apply(skip.init(setup[2]), good)
  _close(s_skip.params, s_good.params, rtol=1e-6, atol=1e-7)
  assert not diag[b'nan']['finite'] and diag[ids[0]]['finite']


def test_bad_input_errors(setup, femnist):
  D = ravel_pytree(setup[2])[0].size
  with pytest.raises(ValueError, match='exceeds the number of model'):
    _build(setup, femnist, intrinsic_dim=D + 1).init(setup[2])
  with pytest.raises(ValueError, match='intrinsic_dim'):
    _build(setup, femnist, intrinsic_dim=0)
  with pytest.raises(ValueError, match='num_subspaces'):
    _build(setup, femnist, intrinsic_dim=8, num_subspaces=0)
  with pytest.raises(ValueError, match='rounds_per_epoch'):
    _build(setup, femnist, intrinsic_dim=8, time_varying=True)
  with pytest.raises(ValueError, match='client_ids'):
    _build(setup, femnist, intrinsic_dim=8, client_ids=None,
           download_accounting='exact')
  with pytest.raises(ValueError, match='nonfinite'):
    _build(setup, femnist, intrinsic_dim=8, nonfinite='ignore')
  alg = _build(setup, femnist, intrinsic_dim=8)
  ids, data = femnist
  stranger = [(b'stranger', data[ids[0]], jax.random.PRNGKey(0))]
  with pytest.raises(KeyError, match='stranger'):
    alg.apply(alg.init(setup[2]), stranger)
  with pytest.raises(config_lib.ConfigError, match='intrinsic_dim'):
    _registry_alg(setup, femnist, 'igc_static', intrinsic_dim=D + 1)


@pytest.mark.parametrize('K,tv', [(1, False), (3, True)])
def test_project_on_server_equals_client_projection(setup, femnist, K, tv):
  """Linearity: projecting the per-subspace sums = summing the projections."""
  rounds = _rounds(femnist, PATTERN)
  kw = dict(intrinsic_dim=64, num_subspaces=K, time_varying=tv,
            rounds_per_epoch=2 if tv else None, seed=5)
  s1, d1 = _run(_build(setup, femnist, **kw), setup[2], rounds)
  s2, d2 = _run(_build(setup, femnist, project_on_server=True, **kw),
                setup[2], rounds)
  _close(s1.params, s2.params, rtol=1e-5, atol=1e-6)
  _close(s1.sigma, s2.sigma, rtol=1e-4, atol=1e-6)
  # The same subspace draws and bits per client; norms to float rounding.
  strip = lambda ds: [{c: {k: v for k, v in x.items() if k != 'delta_l2_norm'}
                       for c, x in d.items()} for d in ds]
  assert strip(d1) == strip(d2)
  norms = lambda ds: [x['delta_l2_norm'] for d in ds for x in d.values()]
  np.testing.assert_allclose(norms(d1), norms(d2), rtol=1e-4)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(s1.params), jax.tree.leaves(setup[2])))
  assert moved > 1e-4
  with pytest.raises(ValueError, match='project_on_server'):
    _build(setup, femnist, project_on_server=True,
           upload_transform=tx.uniform_quantization(8), **kw)
