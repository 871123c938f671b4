"""End to end: SentencePiece Shakespeare -> LM preset -> registry algorithm.

Builds ``fedprox`` / ``mime_lite`` / compressed ``fedavg`` through the
registry from a resolved RunConfig (as the runner does), runs a round on
real clients, and checks the ledger-facing diagnostics against the
quantizer's per-variable formula.
"""

import types

import fedlite_jax  # noqa: F401
import jax
import numpy as np
import pytest

from fedlite_jax.comm import CommLedger
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import lm_tasks
from fedlite_jax.training import registry
from fedlite_jax.training import runner
from fedlite_jax.models import lm


@pytest.fixture(scope='module')
def sp_task(data_dir, tmp_path_factory):
  mp = pytest.MonkeyPatch()
  mp.setenv('FEDLITE_CACHE_DIR', str(tmp_path_factory.mktemp('cache')))
  cfg = types.SimpleNamespace(
      tokenizer='sentencepiece', data_dir=str(data_dir), sequence_length=30,
      allow_download=False, vocab_size=10000, sp_vocab_size=4096,
      model='transformer_tiny')
  train, test, info = lm_tasks.load_text_data(cfg, 'shakespeare')
  yield cfg, train, test, info
  mp.undo()


def test_text_data_and_model_hooks(sp_task):
  cfg, train, _, info = sp_task
  assert info.task == 'shakespeare_sp' and info.num_classes == 4096
  split_model = lm_tasks.build_lm(cfg, info)
  params = split_model.model.init(jax.random.PRNGKey(0))
  assert sum(x.size for x in jax.tree.leaves(params)) == lm.count_params(
      'transformer_tiny')
  default = lm_tasks.build_lm(types.SimpleNamespace(model=None), info)
  assert default.module.embed_size == 256  # lstm_small for SentencePiece
  with pytest.raises(ValueError, match='--model'):
    lm_tasks.build_lm(types.SimpleNamespace(model='bert'), info)
  with pytest.raises(ValueError, match='--tokenizer'):
    lm_tasks.load_text_data(types.SimpleNamespace(tokenizer='bpe'),
                            'shakespeare')


@pytest.mark.parametrize('algorithm,options', [
    ('fedprox', {'fedprox_mu': 0.01, 'upload': 'uniform_quantization:8',
                 'pvt_fraction': 0.4}),
    ('mime_lite', {'download': 'uniform_quantization:16',
                   'upload': 'terngrad'}),
])
def test_registry_algorithms_run_a_round(sp_task, algorithm, options):
  cfg, train, _, info = sp_task
  spec = registry.get(algorithm)
  config = config_lib.resolve(
      config_lib.RunConfig(task='shakespeare', algorithm=algorithm,
                           num_rounds=1, clients_per_round=3,
                           client_batch_size=16, client_optimizer='sgd',
                           client_lr=0.1, client_clip_norm=16.0,
                           server_optimizer='adam', server_lr=1e-2,
                           eval_every=1, options=options), {})
  # A one-block model keeps compile times small (the preset hook is tested
  # above).
  split_model = lm.create_lm(lm.LMConfig('transformer', 16, 32, 1, 2),
                             vocab_size=info.num_classes, oov_id=info.oov_id)
  params = split_model.model.init(jax.random.PRNGKey(0))
  n = sum(x.size for x in jax.tree.leaves(params))
  alg = spec.build(registry.BuildContext(
      config=config, split_model=split_model, num_params=n,
      train_client_ids=tuple(train.client_ids()), info=info))
  ids = list(train.client_ids())[:2]
  clients = [(cid, cds, runner.client_rng(0, 0, cid))
             for cid, cds in train.get_clients(ids)]
  state, diag = alg.apply(alg.init(params), clients)
  ledger = CommLedger(n)
  ledger.record_round(0, diag)
  sizes = [x.size for x in jax.tree.leaves(params)]
  for d in diag.values():
    mask = np.asarray(d.get('pvt_mask', np.ones(len(sizes), bool)))
    if algorithm == 'fedprox':
      assert d['upload_bits'] == sum(8 * s + 64
                                     for s, m in zip(sizes, mask) if m)
      assert d['download_bits'] == 32 * n
    else:
      assert mask.all()
      assert d['upload_bits'] == pytest.approx(
          2 * sum(np.log2(3) * s + 32 for s in sizes))
      assert d['download_bits'] == sum(16 * s + 64 for s in sizes) + 32 * n
  assert ledger.summary()['upload_compression'] > 1
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.params))

