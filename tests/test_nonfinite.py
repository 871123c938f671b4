"""One non-finite-update policy for every registered algorithm.

Each algorithm is built through the registry (as ``--algorithm=...
--nonfinite_updates=...`` would build it) on a tiny split MLP and four
clients, one of which has a NaN input:

* ``raise``: ``apply`` raises ``FloatingPointError`` naming that client (no
  state comes back), and a diverging server step (``server_lr = inf``)
  raises instead of returning a non-finite model.
* ``skip``: the round equals the round without that client, the client is
  marked ``skipped`` with 0 upload bits and its download still charged, the
  ledger counts it, and a round of only such clients raises.
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401

import dataclasses
import math

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import models
from fedlite_jax.algorithms import nonfinite
from fedlite_jax.algorithms import split_accounting
from fedlite_jax.comm import CommLedger
from fedlite_jax.training import compression_options
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import registry
from fedlite_jax.training import tasks
from fedlite_jax.rounds import ClientProgram

BAD = b'bad'
GOOD = (b'g0', b'g1', b'g2')

# name -> (RunConfig overrides, options): small sizes for a 67-parameter MLP.
CASES = {
    'fedavg': ({}, {}),
    'fedavg_up8_pvt50': ({'algorithm': 'fedavg'},
                         {'upload': 'uniform_quantization:8',
                          'download': 'uniform_quantization:16',
                          'pvt_fraction': 0.5}),
    'fedprox': ({}, {'fedprox_mu': 0.1}),
    'mime_lite': ({}, {'mime_grads_batch_size': 4}),
    'sgd': ({}, {}),
    'topk': ({}, {'upload': 'top_k:10'}),
    'fetchsgd': ({}, {'topk_k': 10, 'sketch_cols': 40}),
    'igc_static': ({}, {'intrinsic_dim': 16}),
    'igc_k_subspace': ({}, {'intrinsic_dim': 16, 'num_subspaces': 3}),
    'igc_time_varying': ({}, {'intrinsic_dim': 16,
                              'igc_rounds_per_epoch': 1}),
    'igc_k_subspace_time_varying': ({}, {'intrinsic_dim': 16,
                                         'num_subspaces': 3,
                                         'igc_rounds_per_epoch': 1}),
    'splitfed': ({}, {}),
    'fedlite': ({}, {'num_subvectors': 4, 'num_centroids': 2,
                     'correction_lambda': 0.1}),
}


class _Client(nn.Module):

  @nn.compact
  def __call__(self, batch, train):
    return jnp.tanh(nn.Dense(8, name='dense')(batch['x']))


class _Server(nn.Module):

  @nn.compact
  def __call__(self, z, batch, train):
    del batch, train
    return nn.Dense(3, name='dense')(z)


@pytest.fixture(scope='module')
def split_model():
  return models.build_split_model(
      client=_Client(), server=_Server(),
      sample_batch={'x': np.zeros((1, 4), np.float32),
                    'y': np.zeros((1,), np.int32)},
      train_loss=lambda b, p: optax.softmax_cross_entropy_with_integer_labels(
          p, b['y']),
      eval_metrics={'accuracy': fedjax.metrics.Accuracy()},
      cut_layer='dense', cut_size=8)


def _client(cid: bytes, seed: int, nan: bool = False):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(8, 4)).astype(np.float32)
  if nan:  # Every example: one-step algorithms see only one batch.
    x[:, 1] = np.nan
  y = rng.integers(0, 3, size=8).astype(np.int32)
  return (cid, fedjax.ClientDataset({'x': x, 'y': y}),
          jax.random.PRNGKey(seed))


@pytest.fixture(scope='module')
def clients():
  good = [_client(cid, i) for i, cid in enumerate(GOOD)]
  return {'good': good,
          'with_bad': good[:1] + [_client(BAD, 7, nan=True)] + good[1:],
          'all_bad': [_client(BAD, 7, nan=True), _client(b'bad2', 8, nan=True)]}


def _build(split_model, case: str, policy: str, extra_options=None,
           **overrides):
  """Builds ``case``; ``overrides``/``extra_options`` bypass validation.

  They are applied after ``config_lib.resolve`` (which rejects e.g. an
  infinite learning rate), to drive the algorithm itself into divergence.
  """
  config_overrides, options = CASES[case]
  algorithm = config_overrides.get('algorithm', case)
  fields = {'task': 'emnist', 'algorithm': algorithm, 'client_batch_size': 4,
            'client_lr': 0.1}
  if algorithm not in ('splitfed', 'fedlite'):  # they take no round engine
    fields['round_engine'] = 'loop'
  config = config_lib.resolve(
      config_lib.RunConfig(**fields,
                           options={**options, 'nonfinite_updates': policy}),
      tasks.get_task('emnist').defaults)
  config = dataclasses.replace(
      config, **overrides,
      options={**config.options, **(extra_options or {})})
  params = split_model.model.init(jax.random.PRNGKey(0))
  ctx = registry.BuildContext(
      config=config, split_model=split_model,
      num_params=int(sum(np.size(x) for x in jax.tree.leaves(params))),
      train_client_ids=GOOD + (BAD, b'bad2'), info=None)
  alg = registry.get(algorithm).build(ctx)
  return alg, alg.init(params), registry.get(algorithm).eval_params


def _assert_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5,
                               atol=1e-6)


def test_every_registered_algorithm_takes_the_option():
  specs = registry.algorithms()
  assert {CASES[c][0].get('algorithm', c) for c in CASES} == set(specs)
  for name, spec in specs.items():
    assert compression_options.NONFINITE_UPDATES in spec.options, name
  # Resuming a run stopped by 'raise' with 'skip' is allowed.
  assert not compression_options.NONFINITE_UPDATES.affects_result


@pytest.mark.parametrize('case', sorted(CASES))
def test_raise_names_the_client_and_returns_no_state(case, split_model,
                                                     clients):
  alg, state, _ = _build(split_model, case, 'raise')
  with pytest.raises(FloatingPointError, match=f"non-finite.*{BAD!r}"):
    alg.apply(state, clients['with_bad'])


@pytest.mark.parametrize('case', sorted(CASES))
def test_diverging_server_step_raises(case, split_model, clients):
  if case in ('splitfed', 'fedlite'):
    alg, state, _ = _build(split_model, case, 'skip',
                           {'split_server_lr': math.inf})
  else:
    alg, state, _ = _build(split_model, case, 'skip', server_lr=math.inf)
  with pytest.raises(FloatingPointError, match='non-finite model'):
    alg.apply(state, clients['good'])


@pytest.mark.parametrize('case', sorted(CASES))
def test_skip_drops_the_client(case, split_model, clients):
  alg, state, eval_params = _build(split_model, case, 'skip')
  skipped_state, diags = alg.apply(state, clients['with_bad'])
  expected_state, expected = alg.apply(state, clients['good'])
  _assert_close(eval_params(skipped_state), eval_params(expected_state))
  assert nonfinite.all_finite(eval_params(skipped_state))

  bad = diags[BAD]
  assert bad['skipped'] and not bad['finite']
  assert bad['upload_bits'] == 0.0
  # It still received the model: FedAvg-like algorithms charge the same
  # download as a kept client; split learning the client-side model only.
  if case in ('splitfed', 'fedlite'):
    assert bad['download_bits'] == expected[GOOD[0]][
        'client_model_download_bits'] > 0
  else:
    assert bad['download_bits'] == expected[GOOD[0]]['download_bits']
    # 'changed' accounting charges nothing in round 0 (nothing changed yet).
    assert bad['download_bits'] > 0 or case in ('topk', 'fetchsgd')
  for cid in GOOD:
    assert not diags[cid]['skipped'] and diags[cid]['finite']
    assert diags[cid]['upload_bits'] == expected[cid]['upload_bits'] > 0

  ledger = CommLedger(67)
  ledger.record_round(0, expected)
  assert ledger.record_round(1, diags)['skipped_clients'] == 1
  assert ledger.skipped_clients(0) == 0 and ledger.skipped_clients(1) == 1
  assert ledger.summary()['skipped_client_rounds'] == 1

  with pytest.raises(FloatingPointError, match='every client'):
    alg.apply(state, clients['all_bad'])


def test_guarded_zeroes_a_nonfinite_output_only():
  program = nonfinite.guarded(ClientProgram(
      init=lambda shared, x: x, step=lambda s, b: s,
      final=lambda shared, s: ({'v': s, 'w': jnp.ones(2)}, {'n': s.sum()})))
  out, diag = program.final(None, jnp.asarray([1.5, -2.0]))
  np.testing.assert_array_equal(out['v'], [1.5, -2.0])
  assert bool(diag['finite'])
  out, diag = program.final(None, jnp.asarray([1.0, jnp.inf]))
  np.testing.assert_array_equal(out['v'], [0.0, 0.0])
  np.testing.assert_array_equal(out['w'], [0.0, 0.0])  # the weight too
  assert not bool(diag['finite']) and diag['n'] == jnp.inf


def test_resolve_policy_and_messages():
  ids = [b'a', b'b', b'c']
  assert nonfinite.resolve(ids, [True] * 3, 'raise', 'alg') == []
  with pytest.raises(FloatingPointError, match=r"alg \(round 4\).*\[b'b'\]"):
    nonfinite.resolve(ids, [True, False, True], 'raise', 'alg', 4)
  assert nonfinite.resolve(ids, [True, False, True], 'skip', 'alg') == [b'b']
  with pytest.raises(FloatingPointError, match='every client'):
    nonfinite.resolve(ids, [False] * 3, 'skip', 'alg')
  with pytest.raises(ValueError, match="nonfinite_updates='ignore'.*raise"):
    nonfinite.check_policy('ignore')
  assert nonfinite.kept_weight([2.0, 3.0, 5.0], ids, [b'b']) == 7.0
  nonfinite.check_server_state(np.bool_(True), 'alg')
  with pytest.raises(FloatingPointError, match="skipped this round: \\[b'b'\\]"):
    nonfinite.check_server_state(np.bool_(False), 'alg', [b'b'])


def test_split_skipped_client_bits():
  bits = split_accounting.iteration_bits(
      cut_size=8, num_vectors=4, num_client_params=40, num_params=67,
      label_elements=4, bits_per_label=2.0)
  got = split_accounting.skipped_client_bits(bits)
  assert set(got) == set(split_accounting.BIT_KEYS)
  assert got['download_bits'] == got['client_model_download_bits'] == 32 * 40
  assert all(v == 0 for k, v in got.items()
             if k not in ('download_bits', 'client_model_download_bits'))
