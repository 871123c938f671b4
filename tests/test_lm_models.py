"""CIFG-LSTM and Transformer LMs: sizes, equations, causality, loss, metrics.

Independent expectations: the paper's Table 1 counts and closed-form counts
from the layer sizes; a NumPy re-implementation of the CIFG cell; hand
computed token cross-entropies; FedJAX-free perplexity.
"""

import math

import fedlite_jax  # noqa: F401
import fedjax
import jax
import numpy as np
import pytest

from fedlite_jax.training import evaluation
from fedlite_jax.training import state_io
from fedlite_jax.models import lm

V = 4096


def _lstm_count(d, h, v=V):
  return v * d + (2 * d) * 3 * h + 3 * h + h * d + v


def _transformer_count(d, f, layers, v=V, t=30):
  block = 4 * (d * d + d) + (2 * d * f + f + d) + 4 * d
  return v * d + t * d + layers * block + 2 * d + v


@pytest.mark.parametrize('preset,formula', [
    ('lstm_small', _lstm_count(256, 2048)),
    ('lstm_large', _lstm_count(1024, 2048)),
    ('transformer_small', _transformer_count(128, 2048, 6)),
    ('transformer_large', _transformer_count(512, 2048, 6)),
])
def test_param_counts_match_formula_and_paper(preset, formula):
  n = lm.count_params(preset)
  assert n == formula
  # Table 1 of Ro et al. (2022), within 1% (one decimal of millions).
  assert n == pytest.approx(lm.PAPER_PARAM_COUNTS[preset], rel=0.01)


def test_documented_counts():
  assert [lm.count_params(p) for p in ('lstm_small', 'lstm_large',
                                       'transformer_small',
                                       'transformer_large')] == [
                                           4_728_832, 18_884_608, 4_090_624,
                                           21_031_936]


def _batch(b=3, t=7, v=50, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randint(1, v, (b, t)).astype(np.int32)
  y = rng.randint(1, v, (b, t)).astype(np.int32)
  y[0, -3:] = 0  # PAD targets
  y[1, 2] = 2  # EOS
  y[2, 1] = 3  # OOV
  return {'x': x, 'y': y}


SMALL_LSTM = lm.LMConfig('lstm', 8, 16, 1)
SMALL_TF = lm.LMConfig('transformer', 8, 16, 2, 2)


def test_cifg_lstm_matches_numpy_reference():
  model = lm.create_lm(SMALL_LSTM, vocab_size=50, max_length=7).model
  params = model.init(jax.random.PRNGKey(1))
  assert set(params) == {'embed', 'lstm', 'output_bias'}  # tied output
  batch = _batch()
  logits = np.asarray(model.apply_for_eval(params, batch))
  p = jax.tree.map(np.asarray, params)
  emb, kern, bias, proj = (p['embed']['embedding'], p['lstm']['kernel'],
                           p['lstm']['bias'], p['lstm']['projection'])
  sig = lambda z: 1 / (1 + np.exp(-z))
  d, h = 8, 16
  for b in range(3):
    pv, c = np.zeros(d), np.zeros(h)
    for t in range(7):
      a = np.concatenate([emb[batch['x'][b, t]], pv]) @ kern + bias
      i = sig(a[:h] - 1.0)
      c = (1 - i) * c + i * np.tanh(a[h:2 * h])
      hh = sig(a[2 * h:]) * np.tanh(c)
      pv = hh @ proj
      ref = pv @ emb.T + p['output_bias']
      np.testing.assert_allclose(logits[b, t], ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize('cfg', [SMALL_LSTM, SMALL_TF])
def test_causal_and_shapes(cfg):
  model = lm.create_lm(cfg, vocab_size=50, max_length=7).model
  params = model.init(jax.random.PRNGKey(2))
  batch = _batch()
  out = np.asarray(model.apply_for_train(params, batch, None))
  assert out.shape == (3, 7, 50) and out.dtype == np.float32
  changed = dict(batch, x=batch['x'].copy())
  changed['x'][:, 4] = (changed['x'][:, 4] + 1) % 50
  out2 = np.asarray(model.apply_for_eval(params, changed))
  np.testing.assert_allclose(out[:, :4], out2[:, :4], rtol=1e-5, atol=1e-6)
  assert np.abs(out[:, 4:] - out2[:, 4:]).max() > 1e-4


def test_tied_embedding_drives_the_output():
  model = lm.create_lm(SMALL_TF, vocab_size=50, max_length=7).model
  params = model.init(jax.random.PRNGKey(3))
  batch = _batch()
  batch['x'] = np.where(batch['x'] == 40, 41, batch['x'])
  out = np.asarray(model.apply_for_eval(params, batch))
  emb = params['embed']['embedding']
  bumped = jax.tree.map(lambda x: x, params)
  # (A random direction: a constant shift is orthogonal to LayerNorm output.)
  bumped['embed'] = {'embedding': emb.at[40].add(
      jax.random.normal(jax.random.PRNGKey(9), (emb.shape[1],)))}
  out2 = np.asarray(model.apply_for_eval(bumped, batch))
  # Token 40 never appears in x here, so only its output logit can change.
  assert 40 not in batch['x']
  others = [v for v in range(50) if v != 40]
  np.testing.assert_allclose(out[..., others], out2[..., others], atol=1e-6)
  assert np.abs(out[..., 40] - out2[..., 40]).max() > 1e-3


def _ce(logits, targets):
  logits = logits - logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def test_losses_and_metrics_by_hand():
  batch = _batch()
  logits = np.random.RandomState(4).randn(3, 7, 50).astype(np.float32)
  ce = _ce(logits, batch['y'])
  mask = batch['y'] != 0
  np.testing.assert_allclose(
      lm.sequence_loss(batch, logits, 'sequence_sum'),
      (ce * mask).sum(1), rtol=1e-5)
  np.testing.assert_allclose(
      lm.sequence_loss(batch, logits, 'token_mean'),
      (ce * mask).sum(1) / mask.sum(1), rtol=1e-5)
  metrics = lm.lm_eval_metrics(oov_id=3)
  loss = fedjax.metrics.evaluate_batch(metrics['loss'], batch, logits)
  assert float(loss.result()) == pytest.approx((ce * mask).sum() / mask.sum(),
                                               rel=1e-5)
  keep = mask & (batch['y'] != 2) & (batch['y'] != 3)
  acc = (logits.argmax(-1) == batch['y'])[keep].mean()
  got = fedjax.metrics.evaluate_batch(metrics['accuracy'], batch, logits)
  assert float(got.result()) == pytest.approx(acc)


def test_runner_evaluation_adds_perplexity():
  model = lm.create_lm(SMALL_TF, vocab_size=50, max_length=7).model
  params = model.init(jax.random.PRNGKey(5))
  batch = _batch()
  m = evaluation.evaluate(model, params, [batch])
  assert m['perplexity'] == pytest.approx(math.exp(m['loss']), rel=1e-6)
  # An untrained model is near uniform over 50 ids.
  assert 25 < m['perplexity'] < 100


def test_bad_configs_raise():
  with pytest.raises(ValueError, match='presets'):
    lm.create_lm('gpt5')
  with pytest.raises(ValueError, match='num_heads'):
    lm.create_lm(lm.LMConfig('transformer', 10, 16, 1, 3))
  with pytest.raises(ValueError, match='oov_id'):
    lm.create_lm(SMALL_TF, vocab_size=50, oov_id=50)
  with pytest.raises(ValueError, match='one layer'):
    lm.create_lm(lm.LMConfig('lstm', 8, 8, 2))
  with pytest.raises(ValueError, match='loss_reduction'):
    lm.create_lm(SMALL_TF, vocab_size=50, loss_reduction='max')
  model = lm.create_lm(SMALL_TF, vocab_size=50, max_length=7).model
  params = model.init(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match='max_length'):
    model.apply_for_eval(params, _batch(t=9))
  split = lm.create_lm(SMALL_TF, vocab_size=50)
  with pytest.raises(NotImplementedError, match='tie'):
    split.client_apply(params, _batch(), None)


def test_init_params_roundtrip_and_mismatch(tmp_path):
  model = lm.create_lm(SMALL_TF, vocab_size=50, max_length=7).model
  params = model.init(jax.random.PRNGKey(6))
  path = state_io.save_params(tmp_path / 'p.msgpack', params,
                                 {'corpus': 'test'})
  like = model.init(jax.random.PRNGKey(7))
  loaded = state_io.load_init_params(path, like).params
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, b)
  assert state_io.read_metadata(path) == {'corpus': 'test'}
  other = lm.create_lm(SMALL_LSTM, vocab_size=50, max_length=7).model
  with pytest.raises(ValueError, match='variables differ'):
    state_io.load_init_params(path, other.init(jax.random.PRNGKey(0)))
  wider = lm.create_lm(SMALL_TF, vocab_size=60, max_length=7).model
  with pytest.raises(ValueError, match='shape'):
    state_io.load_init_params(path, wider.init(jax.random.PRNGKey(0)))
  with pytest.raises(FileNotFoundError):
    state_io.load_init_params(tmp_path / 'missing', like)
  (tmp_path / 'junk').write_bytes(b'not msgpack at all')
  with pytest.raises(ValueError, match='junk: not a parameter file'):
    state_io.load_init_params(tmp_path / 'junk', like)
