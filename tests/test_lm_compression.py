"""Download/upload quantization inside the efficient algorithms; Table 8 GB.

Independent expectations: the quantizers' per-layer formulas for the bit
counts (bits x size + side floats), their error bounds / value sets for the
applied updates, a quadratic loss whose one-step update reveals the model a
client received, and Ro et al. (2022) Table 8's published totals.
"""

import math

import fedlite_jax  # noqa: F401
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import transforms
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import mime_lite
from fedlite_jax.transforms import pvt
from fedlite_jax.comm import CommLedger
from fedlite_jax.comm import lm_costs
from fedlite_jax.training import algo_lm
from fedlite_jax.training import compression_options
from fedlite_jax.training import registry
from fedlite_jax.training.config import ConfigError
from fedlite_jax.models import lm

ETA = 0.5
PARAMS = {'a': {'kernel': jnp.linspace(-1.0, 2.0, 12).reshape(3, 4)},
          'b': {'bias': jnp.linspace(0.0, 1.0, 5)},
          'c': {'embedding': jnp.linspace(3.0, -3.0, 8).reshape(4, 2)}}


def _grad_fn(params, batch, rng):
  """Gradient of 0.5 ||w - s||^2 per leaf, s = mean of the client's data,
  plus a position-dependent term so that deltas are not constant."""
  del rng
  s = jnp.mean(batch['x'])
  return jax.tree.map(lambda w: w - s * (1 + 0.1 * jnp.arange(w.size)
                                         .reshape(w.shape)), params)


def _clients(centers):
  return [(f'k{i}'.encode(),
           fedjax.ClientDataset({'x': np.full((4, 1), c, np.float32)}),
           jax.random.PRNGKey(3 + i)) for i, c in enumerate(centers)]


HP = fedjax.ShuffleRepeatBatchHParams(batch_size=4, num_epochs=None,
                                      num_steps=1, seed=0)


def _one_round(compression, centers=(1.5,)):
  alg = fedopt.federated_averaging(
      _grad_fn, optax.sgd(ETA), optax.sgd(1.0), HP, compression=compression,
      engine='loop')
  return alg.apply(alg.init(PARAMS), _clients(centers))


def test_uniform_upload_error_bound_and_bits():
  plain, _ = _one_round(fedopt.Compression())
  state, diag = _one_round(fedopt.Compression(
      upload=transforms.uniform_quantization(4)))
  sizes = [x.size for x in jax.tree.leaves(PARAMS)]
  (d,) = diag.values()
  assert d['upload_bits'] == sum(4 * s + 64 for s in sizes)
  assert d['download_bits'] == 32 * sum(sizes)
  changed = False
  for w0, p, q in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(plain.params),
                      jax.tree.leaves(state.params)):
    delta = np.asarray(w0 - p)
    spacing = (delta.max() - delta.min()) / (2**4 - 1)
    err = np.abs(np.asarray(q - p))
    assert err.max() <= spacing * (1 + 1e-5) + 1e-6
    changed |= err.max() > 0
  assert changed


@pytest.mark.parametrize('clip', [None, 2.5])
def test_terngrad_upload_values_and_bits(clip):
  state, diag = _one_round(fedopt.Compression(
      upload=transforms.terngrad(clip_std=clip)))
  sizes = [x.size for x in jax.tree.leaves(PARAMS)]
  (d,) = diag.values()
  assert math.isclose(d['upload_bits'],
                      sum(math.log2(3) * s + 32 for s in sizes))
  for w0, w in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(state.params)):
    applied = np.unique(np.round(np.abs(np.asarray(w0 - w)), 6))
    assert len(applied[applied > 0]) <= 1  # {0, +-s} per layer


def test_download_quantization_clients_start_from_quantized_model():
  # One SGD step from the received model m: delta = eta * g(m), and g is
  # affine in m, so m = w0 - (w0 - w1) ... solved per leaf below. With 1-bit
  # download quantization every entry of m is the leaf's min or max.
  state, diag = _one_round(fedopt.Compression(
      download=transforms.uniform_quantization(1)), centers=(0.0,))
  sizes = [x.size for x in jax.tree.leaves(PARAMS)]
  (d,) = diag.values()
  assert d['download_bits'] == sum(1 * s + 64 for s in sizes)
  for w0, w1 in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(state.params)):
    # s = 0: g(m) = m, delta = eta * m, w1 = w0 - eta * m.
    received = np.asarray((w0 - w1) / ETA)
    lo, hi = float(w0.min()), float(w0.max())
    assert np.all(np.isclose(received, lo, atol=1e-5) |
                  np.isclose(received, hi, atol=1e-5))


def test_download_quantization_is_fresh_per_round_and_unbiased():
  comp = fedopt.Compression(download=transforms.uniform_quantization(2))
  alg = fedopt.federated_averaging(
      _grad_fn, optax.sgd(ETA), optax.sgd(1.0), HP, compression=comp,
      engine='loop')
  received = []
  for r in range(2):  # same server model, rounds 0 and 1
    start = alg.init(PARAMS).replace(round=jnp.asarray(r, jnp.int32))
    new, _ = alg.apply(start, _clients([0.0]))
    received.append([np.asarray((w0 - w1) / ETA) for w0, w1 in zip(
        jax.tree.leaves(PARAMS), jax.tree.leaves(new.params))])
  assert any(not np.allclose(a, b) for a, b in zip(*received))
  # The broadcast quantizer is unbiased over the per-round keys.
  t = transforms.uniform_quantization(2)
  encode = jax.jit(lambda k: t.encode(PARAMS, (), k)[0].values)
  keys = [jax.random.fold_in(jax.random.fold_in(
      jax.random.PRNGKey(0), fedopt.DOWNLOAD_STREAM), r) for r in range(200)]
  draws = [encode(k) for k in keys]
  mean = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs), 0), *draws)
  for w0, m in zip(jax.tree.leaves(PARAMS), jax.tree.leaves(mean)):
    spacing = float(w0.max() - w0.min()) / 3
    assert float(jnp.max(jnp.abs(m - w0))) < 5 * spacing / 2 / math.sqrt(200)


def test_mime_lite_with_pvt_and_quantization_bits():
  params = {'a': {'kernel': jnp.ones((3, 4))}, 'b': {'kernel': jnp.ones(6)},
            'c': {'bias': jnp.zeros(2)}}
  alg = mime_lite.efficient_mime_lite(
      _grad_fn, optax.adagrad(0.1), HP, grads_batch_size=2,
      compression=fedopt.Compression(
          upload=transforms.uniform_quantization(8),
          download=transforms.uniform_quantization(16), pvt_fraction=0.6),
      engine='loop')
  state, diag = alg.apply(alg.init(params),
                          _clients([0.5, -1.0, 2.0, 0.0]))
  sizes = [x.size for x in jax.tree.leaves(params)]
  opt_floats = sum(x.size for x in jax.tree.leaves(state.opt_state)
                   if jnp.issubdtype(x.dtype, jnp.floating))
  for d in diag.values():
    mask = np.asarray(d['pvt_mask'])
    assert mask[list(pvt.make_plan(params, 0.6).freezable).index(False)]
    assert d['upload_bits'] == 2 * sum(8 * s + 64
                                       for s, m in zip(sizes, mask) if m)
    assert d['download_bits'] == (sum(16 * s + 64 for s in sizes)
                                  + 32 * opt_floats)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))


def test_table8_totals_by_formula_and_ledger():
  gb = lm_costs.paper_total_gb
  # Ro et al. 2022, Table 8 (10K rounds; download / upload GB).
  assert gb(4.7e6, 32, 10_000) == pytest.approx(188)
  assert gb(4.1e6, 32, 10_000) == pytest.approx(164)
  assert gb(18.8e6, 32, 10_000) == pytest.approx(752)
  assert gb(21.0e6, 32, 10_000) == pytest.approx(840)
  assert gb(18.8e6, 16, 10_000) == pytest.approx(376)
  assert gb(21.0e6, 16, 10_000) == pytest.approx(420)
  assert gb(18.8e6, 8, 10_000, trainable_fraction=0.4) == pytest.approx(75.2)
  assert gb(21.0e6, 8, 10_000, trainable_fraction=0.4) == pytest.approx(84)
  # The same through the ledger, 800 clients x 10K rounds (in bulk: the
  # ledger only sums per-client bits).
  ledger = CommLedger(num_params=18_800_000)
  bits = lm_costs.paper_round_bits(18.8e6, 32)
  for r in range(10_000):
    ledger.record_round(r, {b'c': {'upload_bits': bits,
                                   'download_bits': bits}})
  totals = lm_costs.ledger_gb_per_client(ledger)
  assert totals['upload_gb'] == pytest.approx(752)
  assert totals['download_gb'] == pytest.approx(752)
  assert ledger.summary()['total_upload_bytes'] == pytest.approx(752e9)


def test_table8_efficient_transformer_with_our_bit_accounting():
  # Our Large Transformer (21.03M parameters), PVT 40% realized masks,
  # uniform 8-bit upload with its 64 side bits per trained variable, 32-bit
  # download: per-client bits summed by the ledger over 10K rounds.
  shapes = lm.param_shapes('transformer_large')
  plan = pvt.make_plan(shapes, 0.4)
  leaf_bits = pvt.leaf_bits(transforms.uniform_quantization(8), shapes)
  keys = jax.random.split(jax.random.PRNGKey(0), 10_000)
  masks = np.asarray(jax.jit(jax.vmap(lambda k: pvt.sample_mask(plan, k)))(
      keys))
  per_round = masks.astype(np.float64) @ np.asarray(leaf_bits)
  n = lm.count_params('transformer_large')
  ledger = CommLedger(num_params=n)
  for r, up in enumerate(per_round):
    ledger.record_round(r, {b'c': {'upload_bits': float(up),
                                   'download_bits': 32.0 * n}})
  totals = lm_costs.ledger_gb_per_client(ledger)
  assert totals['upload_gb'] == pytest.approx(84, rel=0.01)
  assert totals['upload_gb'] == pytest.approx(
      lm_costs.paper_total_gb(n, 8, 10_000, 0.4), rel=0.01)
  assert totals['download_gb'] == pytest.approx(840, rel=0.002)
  expected = pvt.expected_masked_bits(plan, leaf_bits) * 10_000 / 8e9
  assert totals['upload_gb'] == pytest.approx(expected, rel=0.01)


def test_options_map_to_transforms_and_bad_combinations_raise():
  opts = {o.name: o.default for o in algo_lm.COMPRESSION_OPTIONS}
  c = algo_lm.compression_from_options(opts)
  assert c.download is None and c.upload is None and c.pvt_fraction == 1.0
  c = algo_lm.compression_from_options(
      {**opts, 'upload': 'uniform_quantization:8',
       'download': 'uniform_quantization:16', 'pvt_fraction': 0.4})
  assert transforms.message_bits(c.upload, [jnp.zeros(10)]) == 8 * 10 + 64
  assert transforms.message_bits(c.download, [jnp.zeros(10)]) == 16 * 10 + 64
  c = algo_lm.compression_from_options({**opts, 'upload': 'terngrad'})
  assert transforms.message_bits(c.upload, [jnp.zeros(9)]) == pytest.approx(
      9 * math.log2(3) + 32)
  for bad, match in [({'pvt_fraction': 0.0}, 'pvt_fraction'),
                     ({'pvt_fraction': 1.5}, 'pvt_fraction'),
                     ({'download': 'uniform_quantization:40'}, 'download'),
                     ({'upload': 'uniform_quantization:33'}, 'upload')]:
    with pytest.raises(ConfigError, match=match):
      algo_lm.compression_from_options({**opts, **bad})
  specs = registry.algorithms()
  for name in ('fedprox', 'mime_lite'):
    names = {o.name for o in specs[name].options}
    assert {'upload', 'download', 'pvt_fraction', 'quantizer_rng'} <= names
    assert not set(compression_options.REMOVED_FLAGS) & names


def test_any_stateless_transform_chain_works_without_pvt():
  # A non-per-variable upload (top-k over the whole delta, then 8-bit
  # quantization of the k values) composes with the algorithm; its size is
  # the chain's static message size. Under PVT it is rejected clearly.
  up = transforms.chain(transforms.top_k(6),
                        transforms.uniform_quantization(8))
  _, diag = _one_round(fedopt.Compression(upload=up))
  (d,) = diag.values()
  assert d['upload_bits'] == transforms.message_bits(up, PARAMS)
  with pytest.raises(ValueError, match='sum over'):
    _one_round(fedopt.Compression(upload=up, pvt_fraction=0.6))
