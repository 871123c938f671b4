"""Tests for fedlite_jax.transforms.reparameterization: theta = theta_0 + A theta'."""

from __future__ import annotations

import fedlite_jax  # noqa: F401  (before fedjax; applies compat fixes)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from fedlite_jax.transforms import fastfood as ff
from fedlite_jax.transforms import reparameterization as reparam


class _MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(3)(x)


def _model_and_data():
  model = _MLP()
  kx, kp, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (32, 5))
  y = jax.random.randint(ky, (32,), 0, 3)
  params = model.init(kp, x)

  def loss(p):
    logits = model.apply(p, x)
    return -jnp.mean(jnp.take_along_axis(
        jax.nn.log_softmax(logits), y[:, None], axis=1))

  return params, loss  # D = 5*16 + 16 + 16*3 + 3 = 147.


def _tree_allclose(a, b, **kw):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(
      np.asarray(u), np.asarray(v), **kw), a, b)


def test_zero_gives_theta0_exactly():
  params, _ = _model_and_data()
  theta_prime0, to_params = reparam.make_intrinsic(params, 40, seed=7)
  assert theta_prime0.shape == (40,) and theta_prime0.dtype == jnp.float32
  assert not np.any(np.asarray(theta_prime0))
  out = to_params(theta_prime0)
  assert jax.tree.structure(out) == jax.tree.structure(params)
  jax.tree.map(lambda u, v: np.testing.assert_array_equal(
      np.asarray(u), np.asarray(v)), out, params)


@pytest.mark.parametrize('d', [10, 300])  # d < D and d > D (D = 147).
@pytest.mark.parametrize('scale', ff.SCALES)
def test_grad_through_to_params_is_projected_full_gradient(d, scale):
  params, loss = _model_and_data()
  sub = reparam.intrinsic_subspace(params, d, seed=3, scale=scale)
  _, to_params = reparam.make_intrinsic(params, d, seed=3, scale=scale)
  theta_prime = 0.1 * jax.random.normal(jax.random.key(1), (d,))
  g_prime = jax.grad(lambda t: loss(to_params(t)))(theta_prime)
  full = jax.grad(loss)(to_params(theta_prime))
  expected = ff.fastfood_project(sub.fastfood, ravel_pytree(full)[0])
  np.testing.assert_allclose(np.asarray(g_prime), np.asarray(expected),
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(
      np.asarray(reparam.intrinsic_project(sub, full)), np.asarray(expected),
      rtol=1e-6, atol=1e-7)


def test_to_params_is_theta0_plus_dense_A_theta_prime():
  params, _ = _model_and_data()
  d = 12
  sub = reparam.intrinsic_subspace(params, d, seed=5)
  flat0, unravel = ravel_pytree(params)
  a = np.asarray(jax.vmap(lambda e: ff.fastfood_lift(sub.fastfood, e),
                          out_axes=1)(jnp.eye(d)), np.float64)
  assert a.shape == (flat0.shape[0], d)
  theta_prime = np.linspace(-1.0, 1.0, d)
  expected = unravel(jnp.asarray(
      np.asarray(flat0, np.float64) + a @ theta_prime, jnp.float32))
  _tree_allclose(reparam.intrinsic_to_params(sub, theta_prime), expected,
                 rtol=1e-5, atol=1e-6)
  # intrinsic_lift is the same without theta_0.
  _tree_allclose(reparam.intrinsic_lift(sub, theta_prime),
                 unravel(jnp.asarray(a @ theta_prime, jnp.float32)),
                 rtol=1e-5, atol=1e-6)


def test_subspace_is_a_jit_argument_and_same_seed_same_subspace():
  params, loss = _model_and_data()
  sub1 = reparam.intrinsic_subspace(params, 20, seed=9)
  sub2 = reparam.intrinsic_subspace(params, 20, seed=9)
  t = jnp.arange(20, dtype=jnp.float32) / 20

  @jax.jit
  def f(sub, t):
    return loss(reparam.intrinsic_to_params(sub, t))

  assert float(f(sub1, t)) == float(f(sub2, t))
  sub3 = reparam.intrinsic_subspace(params, 20, seed=10)
  assert float(f(sub1, t)) != float(f(sub3, t))


def test_sgd_in_the_subspace_reduces_the_loss():
  params, loss = _model_and_data()
  theta_prime, to_params = reparam.make_intrinsic(params, 30, seed=1)
  step = jax.jit(jax.value_and_grad(lambda t: loss(to_params(t))))
  first, _ = step(theta_prime)
  for _ in range(30):
    value, g = step(theta_prime)
    theta_prime = theta_prime - 0.5 * g
  assert float(value) < 0.9 * float(first)


def test_mixed_shapes_and_dtypes_roundtrip():
  params = {'a': jnp.ones((2, 3), jnp.float32),
            'b': [jnp.arange(4, dtype=jnp.bfloat16),
                  jnp.zeros((), jnp.float32)]}
  theta_prime0, to_params = reparam.make_intrinsic(params, 5, seed=0)
  out = to_params(theta_prime0)
  assert out['b'][0].dtype == jnp.bfloat16 and out['a'].shape == (2, 3)
  _tree_allclose(out, params, rtol=0, atol=0)


def test_bad_inputs_rejected():
  params, _ = _model_and_data()
  sub = reparam.intrinsic_subspace(params, 8, seed=0)
  with pytest.raises(ValueError):
    reparam.intrinsic_to_params(sub, jnp.zeros((9,)))
  with pytest.raises(ValueError):
    reparam.intrinsic_project(sub, {'other': jnp.zeros((147,))})
  with pytest.raises(ValueError, match='L=64.*147'):
    reparam.intrinsic_subspace(params, 8, seed=0, L=64)
  with pytest.raises(ValueError):
    reparam.intrinsic_subspace({}, 8, seed=0)
