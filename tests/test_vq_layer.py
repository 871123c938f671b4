"""Tests for fedlite_jax.models.vq_layer (FedLite, Section 4.2, Appendix A).

The expected client gradients are computed independently with ``jax.grad`` of
the paper's surrogate loss (equations 6 and 8):
``s(w_c) = ||z - z^||^2 + lambda/2 ||z - z~||^2`` per example, with
``z^ = z - dh/dz~ / 2`` and ``z~`` held fixed (``stop_gradient``).
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401  (before fedjax; none is used here)
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import models
from fedlite_jax.transforms import pq
from fedlite_jax.models import vq_layer

B, D_IN, D, CLASSES = 6, 5, 8, 3
Q, R, L, ITERS = 4, 1, 3, 5


def client_model(w_c, x):
  """u(w_c; x): a dense layer with tanh -> activations [B, D]."""
  return jnp.tanh(x @ w_c['kernel'] + w_c['bias'])


def per_example_server_loss(w_s, z, y):
  """h(w_s; z) per example: softmax cross-entropy of a dense layer."""
  logits = z @ w_s['kernel'] + w_s['bias']
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None],
                              axis=1)[:, 0]


def make_problem(seed=0):
  k = jax.random.split(jax.random.key(seed), 5)
  w_c = {'kernel': jax.random.normal(k[0], (D_IN, D)),
         'bias': 0.1 * jax.random.normal(k[1], (D,))}
  w_s = {'kernel': jax.random.normal(k[2], (D, CLASSES)),
         'bias': jnp.zeros((CLASSES,))}
  x = jax.random.normal(k[3], (B, D_IN))
  y = jax.random.randint(k[4], (B,), 0, CLASSES)
  return w_c, w_s, x, y


def quantize(z, key=jax.random.key(42)):
  return pq.grouped_pq(jax.lax.stop_gradient(z), key, Q, R, L,
                       ITERS).reconstruction


def surrogate_grad(w_c, w_s, x, y, z_tilde, lam, weight):
  """jax.grad of sum_i weight * [||z_i - z^_i||^2 + lam/2 ||z_i - z~_i||^2]."""
  # dh/dz~ per example (rows are independent).
  dh = jax.grad(lambda zt: jnp.sum(per_example_server_loss(w_s, zt, y)))(
      z_tilde)

  def surrogate(w_c):
    z = client_model(w_c, x)
    z_hat = jax.lax.stop_gradient(z - dh / 2)
    z_t = jax.lax.stop_gradient(z_tilde)
    return weight * jnp.sum(
        jnp.sum((z - z_hat)**2, axis=1) + lam / 2 * jnp.sum((z - z_t)**2,
                                                            axis=1))

  return jax.grad(surrogate)(w_c)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol,
                                                       atol=atol), a, b)


@pytest.mark.parametrize('lam', [0.0, 0.3, 2.0])
def test_mean_loss_gradient_equals_surrogate(lam):
  w_c, w_s, x, y = make_problem()
  z_tilde = quantize(client_model(w_c, x))

  def loss(w_c):
    z = client_model(w_c, x)
    out = vq_layer.vq_with_correction(z, z_tilde, lam)  # lam / B
    return jnp.mean(per_example_server_loss(w_s, out, y))

  expected = surrogate_grad(w_c, w_s, x, y, z_tilde, lam, weight=1 / B)
  assert_trees_close(jax.grad(loss)(w_c), expected)


def test_sum_loss_gradient_equals_surrogate():
  w_c, w_s, x, y = make_problem(1)
  z_tilde = quantize(client_model(w_c, x))
  lam = 0.7

  def loss(w_c):
    out = vq_layer.vq_with_correction(client_model(w_c, x), z_tilde, lam,
                                      loss_reduction='sum')
    return jnp.sum(per_example_server_loss(w_s, out, y))

  expected = surrogate_grad(w_c, w_s, x, y, z_tilde, lam, weight=1.0)
  assert_trees_close(jax.grad(loss)(w_c), expected)


def test_quantize_with_correction_end_to_end():
  # Quantization inside the differentiated function, jitted.
  w_c, w_s, x, y = make_problem(2)
  lam, key = 0.5, jax.random.key(42)

  @jax.jit
  def loss(w_c):
    z_tilde, result = vq_layer.quantize_with_correction(
        client_model(w_c, x), key, Q, R, L, lam, ITERS)
    return jnp.mean(per_example_server_loss(w_s, z_tilde, y)), result

  (value, result), grad = jax.value_and_grad(loss, has_aux=True)(w_c)
  z_tilde = quantize(client_model(w_c, x), key)
  np.testing.assert_array_equal(result.reconstruction, z_tilde)
  np.testing.assert_allclose(
      value, jnp.mean(per_example_server_loss(w_s, z_tilde, y)), rtol=1e-6)
  assert_trees_close(grad, surrogate_grad(w_c, w_s, x, y, z_tilde, lam,
                                          weight=1 / B))
  # The gradient for the server model is the plain one at z~ (no correction).
  g_s = jax.grad(lambda w_s: jnp.mean(per_example_server_loss(
      w_s, vq_layer.quantize_with_correction(client_model(w_c, x), key, Q, R,
                                             L, lam, ITERS)[0], y)))(w_s)
  assert_trees_close(g_s, jax.grad(lambda w_s: jnp.mean(
      per_example_server_loss(w_s, z_tilde, y)))(w_s))


def test_lambda_zero_is_straight_through():
  w_c, w_s, x, y = make_problem(3)
  z_tilde = quantize(client_model(w_c, x))

  def loss(w_c, layer):
    z = client_model(w_c, x)
    return jnp.mean(per_example_server_loss(w_s, layer(z), y))

  ours = jax.grad(loss)(w_c, lambda z: vq_layer.vq_with_correction(
      z, z_tilde, 0.0))
  ste = jax.grad(loss)(w_c, lambda z: z + jax.lax.stop_gradient(z_tilde - z))
  assert_trees_close(ours, ste, rtol=1e-6, atol=1e-7)


def test_backward_rule_directly():
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  z_tilde = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
  out, vjp = jax.vjp(
      lambda z, zt: vq_layer.vq_with_correction(z, zt, 1.2), z, z_tilde)
  np.testing.assert_array_equal(out, z_tilde)
  g_z, g_zt = vjp(g)
  # 'mean' over the 2 * 3 vectors of z.
  np.testing.assert_allclose(g_z, g + 1.2 / 6 * (z - z_tilde), rtol=1e-6)
  np.testing.assert_array_equal(g_zt, jnp.zeros_like(z_tilde))  # no codebook
  g_z = jax.vjp(lambda z: vq_layer.vq_with_correction(
      z, z_tilde, 1.2, num_vectors=4.0), z)[1](g)[0]
  np.testing.assert_allclose(g_z, g + 0.3 * (z - z_tilde), rtol=1e-6)
  # A traced lambda (e.g. a hyper-parameter under jit), no gradient into it.
  g_lam = jax.grad(lambda lam: jnp.sum(vq_layer.vq_with_correction(
      z, z_tilde, lam)))(0.5)
  assert g_lam == 0.0


def test_vmap_over_clients():
  w_c, w_s, x, y = make_problem(4)
  xs = jnp.stack([x, x[::-1] * 0.5, x + 1.0])
  ys = jnp.stack([y, y[::-1], y])
  keys = jax.random.split(jax.random.key(0), 3)
  lam = 0.2

  def client_grad(x, y, key):
    def loss(w_c):
      z_tilde, _ = vq_layer.quantize_with_correction(
          client_model(w_c, x), key, Q, R, L, lam, ITERS)
      return jnp.mean(per_example_server_loss(w_s, z_tilde, y))
    return jax.grad(loss)(w_c)

  # Full float32 matmuls: JAX's GPU default (TF32, ~1e-3 relative) rounds
  # the vmapped and the per-client shapes differently (seen on an H100).
  with jax.default_matmul_precision('highest'):
    batched = jax.jit(jax.vmap(client_grad))(xs, ys, keys)
    for i in range(3):
      assert_trees_close(jax.tree.map(lambda a: a[i], batched),
                         client_grad(xs[i], ys[i], keys[i]))


def test_multi_axis_activations_flatten_to_one_batch():
  # SO NWP style: [sequences, tokens, d] quantized as one batch of vectors.
  z = jax.random.normal(jax.random.key(0), (3, 4, D))
  z_tilde, result = vq_layer.quantize_with_correction(
      z, jax.random.key(1), Q, R, L, 1.0, ITERS)
  flat = pq.grouped_pq(z.reshape(12, D), jax.random.key(1), Q, R, L, ITERS)
  np.testing.assert_array_equal(z_tilde, flat.reconstruction.reshape(z.shape))
  assert result.message_bits == pq.pq_message_bits(D, 12, Q, R, L)
  g = jax.grad(lambda z: jnp.sum(vq_layer.quantize_with_correction(
      z, jax.random.key(1), Q, R, L, 1.0, ITERS)[0]))(z)
  np.testing.assert_allclose(g, 1.0 + (z - z_tilde) / 12, rtol=1e-5)


def test_errors():
  z = jnp.zeros((4, 8))
  with pytest.raises(ValueError, match='same shape and dtype'):
    vq_layer.vq_with_correction(z, jnp.zeros((4, 7)), 0.1)
  with pytest.raises(ValueError, match='same shape and dtype'):
    vq_layer.vq_with_correction(z, jnp.zeros((4, 8), jnp.bfloat16), 0.1)
  with pytest.raises(ValueError, match=r'lam .*>= 0, got -0.5'):
    vq_layer.vq_with_correction(z, z, -0.5)
  with pytest.raises(ValueError, match="loss_reduction .*'max'"):
    vq_layer.vq_with_correction(z, z, 0.1, loss_reduction='max')
  with pytest.raises(ValueError, match=r'num_vectors .*> 0, got 0'):
    vq_layer.vq_with_correction(z, z, 0.1, num_vectors=0)
  with pytest.raises(ValueError, match=r'vector_weights .*\(4,\), got shape '
                     r'\(3,\)'):
    vq_layer.vq_with_correction(z, z, 0.1, vector_weights=jnp.ones(3))
  with pytest.raises(ValueError, match='at least 2 axes'):
    vq_layer.quantize_with_correction(jnp.zeros((8,)), jax.random.key(0), 2,
                                      1, 2, 0.1)
  with pytest.raises(ValueError, match='R .*must divide q=4, got R=3'):
    vq_layer.quantize_with_correction(z, jax.random.key(0), 4, 3, 2, 0.1)


class _SplitModel(nn.Module):
  """Client dense -> FedLite quantizer -> server dense."""
  lam: float

  @nn.compact
  def __call__(self, x, *, quantize=True):
    z = nn.tanh(nn.Dense(D, name='client')(x))
    z = vq_layer.FedLiteQuantizer(q=Q, R=R, L=L, lam=self.lam,
                                  num_iters=ITERS, name='fedlite')(
                                      z, enabled=quantize)
    return nn.Dense(CLASSES, name='server')(z), z


def test_flax_module():
  model = _SplitModel(lam=0.4)
  x = jax.random.normal(jax.random.key(0), (B, D_IN))
  rngs = {'params': jax.random.key(1), 'quantize': jax.random.key(2)}
  params = model.init(rngs, x)['params']
  assert set(params) == {'client', 'server'}  # the quantizer has none

  apply = lambda p, key: model.apply({'params': p}, x,
                                     rngs={'quantize': key},
                                     mutable=['intermediates'])
  (logits, z_tilde), state = apply(params, jax.random.key(3))
  (_, again), _ = apply(params, jax.random.key(3))
  np.testing.assert_array_equal(z_tilde, again)  # deterministic per key
  z = jnp.tanh(x @ params['client']['kernel'] + params['client']['bias'])
  assert not np.allclose(z, z_tilde)
  # k-means codebook: at most L distinct values per subvector position.
  assert len({tuple(r) for r in np.asarray(z_tilde).reshape(-1, D // Q)
             }) <= L
  stats = state['intermediates']['fedlite']
  np.testing.assert_allclose(stats['relative_error'][0],
                             jnp.sum((z - z_tilde)**2) / jnp.sum(z**2),
                             rtol=1e-5)
  np.testing.assert_allclose(
      stats['compression_ratio'][0],
      pq.pq_compression_ratio(D, B, Q, R, L), rtol=1e-6)
  # Disabled: the identity.
  _, z_plain = model.apply({'params': params}, x, quantize=False)
  np.testing.assert_allclose(z_plain, z, rtol=1e-6)

  # Gradient through the module = gradient with the corrected layer.
  v = jax.random.normal(jax.random.key(5), z.shape)
  def through_module(p):
    (_, zt), _ = apply(p, jax.random.key(3))
    return jnp.sum(zt * v) / B
  def reference(p):
    zc = jnp.tanh(x @ p['client']['kernel'] + p['client']['bias'])
    out = vq_layer.vq_with_correction(zc, jax.lax.stop_gradient(z_tilde), 0.4)
    return jnp.sum(out * v) / B
  assert_trees_close(jax.grad(through_module)(params),
                     jax.grad(reference)(params))


def test_vector_weights_scale_the_correction_per_vector():
  # Two clients' stacked activations [2, 3, D] in the loss sum_i p_i mean_b,
  # with one vector masked out: cotangent g + (lam / 3) p_i m_ib (z - z~).
  z = jax.random.normal(jax.random.key(7), (2, 3, D))
  z_tilde = jnp.round(z)
  g = jax.random.normal(jax.random.key(8), z.shape)
  p = np.array([0.25, 0.75], np.float32)
  mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
  lam = 0.9
  _, vjp = jax.vjp(lambda zz: vq_layer.vq_with_correction(
      zz, z_tilde, lam, num_vectors=3, vector_weights=p[:, None] * mask), z)
  expected = (np.asarray(g) + lam / 3 * (p[:, None] * mask)[..., None] *
              np.asarray(z - z_tilde))
  np.testing.assert_allclose(vjp(g)[0], expected, rtol=1e-6, atol=1e-7)
  # The masked vector gets the plain (straight-through) cotangent.
  np.testing.assert_array_equal(vjp(g)[0][0, 2], g[0, 2])


def test_input_derived_key_is_a_deterministic_function_of_the_input():
  z = jax.random.normal(jax.random.key(0), (B, D))
  same = jax.jit(vq_layer.input_derived_key)(z)
  np.testing.assert_array_equal(vq_layer.input_derived_key(z), same)
  assert not np.array_equal(vq_layer.input_derived_key(z),
                            vq_layer.input_derived_key(z + 1.0))


class _QuantizedClient(nn.Module):
  """u(w_c; x) = tanh(dense(x)), then the FedLite quantizer (the cut)."""
  lam: float

  @nn.compact
  def __call__(self, batch, train):
    z = jnp.tanh(nn.Dense(D, name='dense')(batch['x']))
    return vq_layer.FedLiteQuantizer(q=Q, R=R, L=L, lam=self.lam,
                                     num_iters=ITERS, name='quantizer')(z)


class _DenseServer(nn.Module):

  @nn.compact
  def __call__(self, z, batch, train):
    return nn.Dense(CLASSES, name='dense')(z)


def _hand_grads(params, x, y, z_tilde, lam):
  """Equation 5 by hand (NumPy): mean softmax cross-entropy of a dense layer
  on z~, straight-through + (lam / B)(z - z~) into tanh(x W + b)."""
  wc, ws = params['client']['dense'], params['server']['dense']
  x, z_tilde = np.asarray(x, np.float64), np.asarray(z_tilde, np.float64)
  z = np.tanh(x @ np.asarray(wc['kernel'], np.float64) + np.asarray(wc['bias']))
  logits = z_tilde @ np.asarray(ws['kernel'], np.float64) + np.asarray(
      ws['bias'])
  prob = np.exp(logits - logits.max(1, keepdims=True))
  prob /= prob.sum(1, keepdims=True)
  d_logits = (prob - np.eye(CLASSES)[y]) / len(y)
  g_ztilde = d_logits @ np.asarray(ws['kernel'], np.float64).T
  d_pre = (g_ztilde + lam / len(y) * (z - z_tilde)) * (1 - z**2)
  return {'client': {'dense': {'kernel': x.T @ d_pre, 'bias': d_pre.sum(0)}},
          'server': {'dense': {'kernel': z_tilde.T @ d_logits,
                               'bias': d_logits.sum(0)}}}


def test_quantizer_inside_build_split_model():
  lam = 1.5
  split_model = models.build_split_model(
      client=_QuantizedClient(lam=lam), server=_DenseServer(),
      sample_batch={'x': np.zeros((1, D_IN), np.float32),
                    'y': np.zeros((1,), np.int32)},
      train_loss=lambda b, p: optax.softmax_cross_entropy_with_integer_labels(
          p, b['y']),
      eval_metrics={}, cut_layer='quantizer', cut_size=D)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(0))  # no 'quantize' rng needed
  _, _, x, y = make_problem(3)
  batch = {'x': x, 'y': y}
  wc = params['client']['dense']
  z = jnp.tanh(x @ wc['kernel'] + wc['bias'])

  # Without a key (eval): the k-means key is derived from the input.
  z_eval = split_model.client_apply(params['client'], batch, None)
  expected, _ = vq_layer.quantize_with_correction(
      z, vq_layer.input_derived_key(z), Q, R, L, lam, ITERS)
  np.testing.assert_allclose(z_eval, expected, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(
      model.apply_for_eval(params, batch),
      split_model.server_apply(params['server'], z_eval, batch, None),
      rtol=1e-6, atol=1e-7)

  # With a key (train): the 'quantize' stream; z~ is quantized (at most L
  # distinct subvectors), and the split view agrees with the whole model.
  key = jax.random.PRNGKey(4)
  z_tilde = split_model.client_apply(params['client'], batch, key)
  assert float(jnp.max(jnp.abs(z_tilde - z))) > 1e-3
  assert len({tuple(r) for r in np.asarray(z_tilde).reshape(-1, D // Q)
             }) <= L
  np.testing.assert_allclose(
      model.apply_for_train(params, batch, key),
      split_model.server_apply(params['server'], z_tilde, batch, key),
      rtol=1e-6, atol=1e-7)

  def loss(p):
    return jnp.mean(model.train_loss(batch, model.apply_for_train(p, batch,
                                                                  key)))

  grads = jax.grad(loss)(params)
  assert_trees_close(grads, _hand_grads(params, x, y, z_tilde, lam),
                     rtol=1e-4, atol=1e-6)
  # lambda matters: without the correction the client gradient differs.
  ste = _hand_grads(params, x, y, z_tilde, 0.0)
  assert not np.allclose(grads['client']['dense']['kernel'],
                         ste['client']['dense']['kernel'], atol=1e-5)
