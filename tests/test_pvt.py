"""PVT (partial variable training): masks, realized fraction, bits, averaging.

Expectations are computed independently: from the leaf sizes of the Table 1
models (realized fraction, which variables are freezable), by hand for a
quadratic loss (per-variable averaging over the clients that trained it),
from the quantizer's per-layer formula (upload bits), and against the plain
FedAvg implementation (PVT 100%).
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
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.transforms import pvt
from fedlite_jax.models import lm


def _masks(plan, n, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), n)
  return np.asarray(jax.jit(jax.vmap(lambda k: pvt.sample_mask(plan, k)))(
      keys))


def test_freezable_variables_of_the_paper_models():
  plan = pvt.make_plan(lm.param_shapes('lstm_small'), 0.4)
  frozen_ok = {n for n, f in zip(plan.names, plan.freezable) if f}
  assert frozen_ok == {'embed/embedding', 'lstm/kernel', 'lstm/projection'}
  plan = pvt.make_plan(lm.param_shapes('transformer_small'), 0.4)
  frozen_ok = {n for n, f in zip(plan.names, plan.freezable) if f}
  # Per block: q, k, v, out, mlp_in, mlp_out kernels + 2 LayerNorm scales;
  # plus token/position embeddings and the final LayerNorm scale.
  assert len(frozen_ok) == 6 * 8 + 3
  assert 'block_0/attention/query/kernel' in frozen_ok
  assert 'block_5/ln_mlp/scale' in frozen_ok
  assert 'block_0/mlp_in/bias' not in frozen_ok
  assert 'output_bias' not in frozen_ok


@pytest.mark.parametrize('model,fraction', [
    ('transformer_small', 0.4), ('transformer_small', 0.2),
    ('lstm_small', 0.4), ('lstm_large', 0.1)])
def test_realized_fraction_matches_target(model, fraction):
  plan = pvt.make_plan(lm.param_shapes(model), fraction)
  n = 4000
  masks = _masks(plan, n)
  sizes = np.asarray(plan.sizes, np.float64)
  fractions = masks @ sizes / sizes.sum()
  # Exact in expectation: A + p S = f N.
  always = sizes[~np.asarray(plan.freezable)].sum()
  assert math.isclose(
      (always + plan.probability * (sizes.sum() - always)) / sizes.sum(),
      fraction, rel_tol=1e-12)
  bound = 5 * fractions.std() / math.sqrt(n) + 1e-9
  assert abs(fractions.mean() - fraction) < bound
  # Every freezable leaf is trained with probability p.
  idx = list(plan.freezable_indices)
  p = plan.probability
  freq = masks[:, idx].mean(axis=0)
  assert np.all(np.abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9)
  assert masks[:, [i for i in range(len(sizes)) if i not in idx]].all()
  # Systematic sampling: floor(n p) or ceil(n p) freezable leaves each time.
  counts = masks[:, idx].sum(axis=1)
  k = len(idx) * p
  assert set(np.unique(counts)) <= {math.floor(k), math.ceil(k)}
  # A fresh mask per client: not all the same.
  assert len({m.tobytes() for m in masks[:50]}) > 1


def test_full_fraction_trains_everything():
  plan = pvt.make_plan(lm.param_shapes('transformer_tiny'), 1.0)
  assert plan.trains_everything
  assert _masks(plan, 8).all()


def test_bad_fractions_and_masks_raise():
  shapes = lm.param_shapes('transformer_tiny')
  for bad in (0.0, -0.1, 1.5, float('nan')):
    with pytest.raises(ValueError, match='pvt_fraction'):
      pvt.make_plan(shapes, bad)
  with pytest.raises(ValueError, match='always-trained'):
    pvt.make_plan(shapes, 1e-4)
  only_bias = {'dense': {'bias': jnp.zeros(3)}}
  with pytest.raises(ValueError, match='no freezable'):
    pvt.make_plan(only_bias, 0.5)
  kernels = {'a': {'kernel': jnp.zeros((2, 2))},
             'b': {'kernel': jnp.zeros((2, 2))}}
  with pytest.raises(ValueError, match='train no variable'):
    pvt.make_plan(kernels, 0.2)  # 2 leaves x p=0.2 < 1, nothing always on
  plan = pvt.make_plan(kernels, 0.5)
  with pytest.raises(ValueError, match='no trainable variable'):
    pvt.check_mask(plan, [False, False])
  with pytest.raises(ValueError, match='entries'):
    pvt.check_mask(plan, [True])


def _token_clients(num, vocab, seed=0):
  rng = np.random.RandomState(seed)
  out = []
  for i in range(num):
    n = 20 + 7 * i
    x = rng.randint(1, vocab, (n, 30)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -5:] = 0  # PAD targets
    out.append((f'client{i}'.encode(), fedjax.ClientDataset({'x': x, 'y': y}),
                jax.random.PRNGKey(100 + i)))
  return out


@pytest.fixture(scope='module')
def tiny_lm():
  # A one-block Transformer keeps compile times small.
  model = lm.create_lm(lm.LMConfig('transformer', 32, 64, 1, 2),
                       vocab_size=128).model
  return model, model.init(jax.random.PRNGKey(0))


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_pvt_100_percent_equals_fedavg(tiny_lm):
  model, params = tiny_lm
  clients = _token_clients(3, 128)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=16)
  grad_fn = fedjax.model_grad(model)
  server = optax.adam(1e-2)
  ref = federated_averaging(grad_fn, optax.sgd(0.1), server, hp,
                            engine='loop')
  ours = fedopt.federated_averaging(
      grad_fn, optax.sgd(0.1), server, hp,
      compression=fedopt.Compression(pvt_fraction=1.0), engine='loop')
  ref_state, _ = ref.apply(ref.init(params), clients)
  our_state, diag = ours.apply(ours.init(params), clients)
  assert _max_diff(ref_state.params, our_state.params) < 1e-6  # float order
  assert _max_diff(params, our_state.params) > 1e-3
  n = sum(x.size for x in jax.tree.leaves(params))
  for d in diag.values():
    assert 'pvt_mask' not in d  # PVT 100% is plain FedAvg
    assert d['upload_bits'] == d['download_bits'] == 32 * n


def test_pvt_upload_bits_and_frozen_variables(tiny_lm):
  model, params = tiny_lm
  clients = _token_clients(3, 128, seed=1)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=16)
  alg = fedopt.federated_averaging(
      fedjax.model_grad(model), optax.sgd(0.5), optax.sgd(1.0), hp,
      compression=fedopt.Compression(
          upload=transforms.uniform_quantization(8), pvt_fraction=0.4),
      engine='loop')
  leaves = jax.tree.leaves(params)
  sizes = [x.size for x in leaves]
  fractions = []
  for cid, cds, rng in clients:  # one client per round: frozen = unchanged
    state, diag = alg.apply(alg.init(params), [(cid, cds, rng)])
    d = diag[cid]
    mask = np.asarray(d['pvt_mask'])
    # Uniform 8-bit: 8 bits per value + 2 floats per TRAINED variable only.
    assert d['upload_bits'] == sum(8 * s + 64 for s, m in zip(sizes, mask)
                                   if m)
    assert d['download_bits'] == 32 * sum(sizes)
    assert math.isclose(d['pvt_trained_fraction'],
                        sum(s for s, m in zip(sizes, mask) if m) / sum(sizes))
    fractions.append(d['pvt_trained_fraction'])
    for m, old, new in zip(mask, leaves, jax.tree.leaves(state.params)):
      if m:
        assert float(jnp.max(jnp.abs(old - new))) > 0
      else:
        assert float(jnp.max(jnp.abs(old - new))) == 0.0
  assert len(set(fractions)) > 1  # fresh masks per client


def test_server_averages_each_variable_over_its_trainers():
  # Loss 0.5 ||w - s_k||^2 per leaf (s_k = the client's data mean), one SGD
  # step: delta_k = eta (w0 - s_k) on trained leaves. With server SGD(1) the
  # new leaf is w0 - sum_k n_k m_kl delta_k / sum_k n_k m_kl.
  eta = 0.5
  params = {'a': {'kernel': jnp.full((3, 2), 1.0)},
            'b': {'kernel': jnp.full((4,), -1.0)},
            'c': {'embedding': jnp.full((2, 2), 2.0)},
            'd': {'bias': jnp.full((2,), 0.5)}}

  def grad_fn(p, batch, rng):
    del rng
    s = jnp.mean(batch['x'])
    return jax.tree.map(lambda w: w - s, p)

  centers, counts = [3.0, -2.0, 0.5, 1.5, -1.0], [2, 4, 6, 3, 5]
  clients = [(f'k{i}'.encode(),
              fedjax.ClientDataset({'x': np.full((n, 1), c, np.float32)}),
              jax.random.PRNGKey(7 + i))
             for i, (c, n) in enumerate(zip(centers, counts))]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=None,
                                        num_steps=1, seed=0)
  alg = fedopt.federated_averaging(
      grad_fn, optax.sgd(eta), optax.sgd(1.0), hp,
      compression=fedopt.Compression(pvt_fraction=0.5), engine='loop')
  state, diag = alg.apply(alg.init(params), clients)
  masks = np.stack([np.asarray(diag[cid]['pvt_mask']) for cid, _, _ in
                    clients])
  assert len({m.tobytes() for m in masks}) > 1
  w0 = jax.tree.leaves(params)
  for l, (old, new) in enumerate(zip(w0, jax.tree.leaves(state.params))):
    num = sum(n * m * eta * (old - c)
              for c, n, m in zip(centers, counts, masks[:, l]))
    den = sum(n * m for n, m in zip(counts, masks[:, l]))
    expected = old - num / den if den else old
    np.testing.assert_allclose(new, expected, rtol=1e-6)
  assert masks[:, -1].all()  # the bias is never frozen


def _lm_batch(vocab, seed=0, batch=4, length=30):
  rng = np.random.RandomState(seed)
  x = rng.randint(1, vocab, (batch, length)).astype(np.int32)
  y = np.roll(x, -1, axis=1)
  y[:, -3:] = 0
  return {'x': x, 'y': y, '__mask__': np.ones(batch, bool)}
