"""Short real-data runs on FEMNIST-105: every method lowers the test loss,
and the runner drives an IGC algorithm end to end (flags -> summary.json)."""

from __future__ import annotations

import fedlite_jax  # noqa: F401

import dataclasses
import json

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import datasets
from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import fetchsgd
from fedlite_jax.algorithms import igc
from fedlite_jax.training import algo_baselines  # noqa: F401
from fedlite_jax.training import algo_igc  # noqa: F401
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import evaluation
from fedlite_jax.training import registry
from fedlite_jax.training import tasks
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run

ROUNDS = 12
COHORT = 10
BATCH = 32
LR = 0.2


class _Mlp(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(62)(nn.relu(nn.Dense(32)(x)))


def _sgd_baseline(grad_fn, client_opt, server_opt, *, batch_size,
                  local_steps=1, upload=None, **kwargs):
  """IGC's SGD / FedAvg-with-local-steps / local Top-K baseline: FedAvg with
  ``local_steps`` batches per client, client weight 1, ``upload`` chain."""
  return fedopt.federated_averaging(
      grad_fn, client_opt, server_opt,
      fedopt.batch_hparams(batch_size, local_steps), weighting='uniform',
      compression=fedopt.Compression(upload=upload), **kwargs)


@pytest.fixture(scope='module')
def task(data_dir):
  net = _Mlp()
  model = fedjax.Model(
      init=lambda rng: net.init(rng, jnp.zeros((1, 28, 28, 1))),
      apply_for_train=lambda p, b, rng: net.apply(p, b['x']),
      apply_for_eval=lambda p, b: net.apply(p, b['x']),
      train_loss=lambda b, preds: fedjax.metrics.unreduced_cross_entropy_loss(
          b['y'], preds),
      eval_metrics={'loss': fedjax.metrics.CrossEntropyLoss()})
  train, test, _ = datasets.load_federated_data('emnist', str(data_dir))
  test_batches = evaluation.eval_batches(test, 512, None, 0)
  return model, train, test_batches


def _builders(grad_fn, ids, rpe):
  common = dict(batch_size=BATCH, client_ids=ids, engine='loop')
  sgd = lambda: optax.sgd(LR)
  server = lambda: optax.sgd(1.0)
  ig = lambda **kw: igc.intrinsic_gradient_compression(
      grad_fn, sgd(), server(), intrinsic_dim=2048, seed=1, **common, **kw)
  return {
      'sgd': lambda: _sgd_baseline(grad_fn, sgd(), server(),
                                                   **common),
      'fedavg_3_steps': lambda: _sgd_baseline(
          grad_fn, sgd(), server(), local_steps=3, **common),
      'topk': lambda: _sgd_baseline(
          grad_fn, sgd(), server(), upload=tx.top_k(2000),
          download_accounting='changed', **common),
      'fetchsgd': lambda: fetchsgd.fetchsgd(
          grad_fn, sgd(), rows=5, cols=4000, k=2000, **common),
      'igc_static': ig,
      'igc_k_subspace': lambda: ig(num_subspaces=4),
      'igc_time_varying': lambda: ig(time_varying=True, rounds_per_epoch=rpe),
      'igc_k_subspace_time_varying': lambda: ig(
          num_subspaces=4, time_varying=True, rounds_per_epoch=rpe),
  }


def test_every_method_lowers_the_test_loss(task):
  model, train, test_batches = task
  ids = list(train.client_ids())
  params0 = model.init(jax.random.PRNGKey(0))
  loss0 = float(fedjax.evaluate_model(model, params0, test_batches)['loss'])
  sampler = lambda: fedjax.client_samplers.UniformGetClientSampler(
      train, COHORT, seed=0)
  rpe = igc.default_rounds_per_epoch(len(ids), COHORT)
  results = {}
  for name, build in _builders(fedjax.model_grad(model), ids, rpe).items():
    alg = build()
    state = alg.init(params0)
    s = sampler()
    for r in range(ROUNDS):
      clients = [(cid, cds, jax.random.fold_in(jax.random.PRNGKey(r), i))
                 for i, (cid, cds, _) in enumerate(s.sample())]
      state, diag = alg.apply(state, clients)
    results[name] = float(
        fedjax.evaluate_model(model, state.params, test_batches)['loss'])
  for name, loss in results.items():
    assert np.isfinite(loss) and loss < loss0 - 0.1, (name, loss0, results)


def test_runner_end_to_end_k_subspace_time_varying(data_dir, tmp_path):
  d, K = 4096, 4
  summary = run(RunConfig(
      task='emnist', algorithm='igc_k_subspace_time_varying',
      data_dir=str(data_dir), num_rounds=3, clients_per_round=3,
      client_batch_size=20, client_lr=0.05, eval_every=3, eval_num_clients=5,
      progress=False, output_dir=str(tmp_path / 'run'),
      options={'intrinsic_dim': d, 'num_subspaces': K,
               'igc_rounds_per_epoch': 2}))
  D = 1_206_590
  comm = summary['communication']
  assert comm['upload_compression'] == pytest.approx(32 * D / (32 * d + 2))
  assert comm['download_compression'] == pytest.approx(D / (2 * d * K))
  saved = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert saved['flags']['options']['num_subspaces'] == K
  assert np.isfinite(saved['final_eval']['loss'])


def _parse_flagfile(path):
  fields = {f.name for f in dataclasses.fields(RunConfig)}
  kwargs, options = {}, {}
  for line in path.read_text().splitlines():
    if not line.startswith('--'):
      continue
    name, value = line[2:].split('=', 1)
    for cast in (int, float):
      try:
        value = cast(value)
        break
      except ValueError:
        pass
    (kwargs if name in fields else options)[name] = value
  return RunConfig(**kwargs, options=options)


def test_igc_flagfiles_resolve(repo_root):
  files = sorted((repo_root / 'experiments' / 'configs').glob('igc_*.flags'))
  assert len(files) >= 9
  known = registry.all_options()
  for path in files:
    config = _parse_flagfile(path)
    assert set(config.options) <= set(known), path
    resolved = config_lib.resolve(config,
                                  tasks.get_task(config.task).defaults)
    assert set(config.options) <= set(resolved.options), path
