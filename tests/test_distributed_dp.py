"""Distributed DP under secure aggregation: the client pipeline and the
server's decoding (``fedlite_jax.privacy.distributed``), checked against
independent expectations: a NumPy int64 modular sum, central clipping of the
same updates (zero noise), the noise std of the papers' split ``z * C``, and
conditional rounding's bound (Kairouz et al. 2021, Alg. 1-2, Prop. 22).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax import privacy
from fedlite_jax.privacy import ddp_accounting
from fedlite_jax.privacy import distributed


def _updates(n, size, seed=0):
  """n updates of length ``size``, norms from 0.2 to 3 (some clipped at 1)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, size)).astype(np.float32)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  return x * np.linspace(0.2, 3.0, n, dtype=np.float32)[:, None]


def _secure_mean(ddp, updates, round_key):
  """Every client's :func:`client_encode`, the uint32 sum, the decode."""
  keys = jax.random.split(jax.random.PRNGKey(7), len(updates))
  rot = distributed.round_rotation_key(round_key)
  msgs = jax.vmap(lambda v, k: distributed.client_encode(ddp, v, rot, k))(
      jnp.asarray(updates), keys)
  total = jnp.sum(msgs.residues, axis=0, dtype=jnp.uint32)
  return distributed.server_decode(ddp, total, rot) / ddp.denominator, msgs


def _central_mean(updates, clip):
  norms = np.linalg.norm(updates, axis=1, keepdims=True)
  return np.mean(updates * np.minimum(1.0, clip / norms), axis=0)


@pytest.mark.parametrize('mechanism,bits', [('ddgauss', 32),
                                            ('skellam', 32),
                                            ('ddgauss', 16)])
def test_zero_noise_equals_central_clipping_to_the_rounding_error(
    mechanism, bits):
  n, size, clip = 8, 1000, 1.0
  ddp = privacy.secure_settings(
      mechanism=mechanism, noise_multiplier=0.0, clip_norm=clip, bits=bits,
      beta=math.exp(-0.5), clients=n, size=size,
      k_stddevs=ddp_accounting.DEFAULT_K[mechanism])
  updates = _updates(n, size)
  got, _ = _secure_mean(ddp, updates, jax.random.PRNGKey(1))
  want = _central_mean(updates, clip)
  # Each coordinate rounds by < 1 step: ||error of the mean|| <= gamma *
  # sqrt(d); float32 rotation and scaling add ~1e-6 relative.
  bound = ddp.gamma * math.sqrt(ddp.dim) + 1e-5 * clip
  err = float(np.linalg.norm(np.asarray(got) - want))
  assert err <= bound, (err, bound)
  assert err > 0  # The rounding is real, and the bound is not vacuous:
  assert bound < 0.05 * float(np.linalg.norm(want))


def test_modular_sum_is_exact_and_wraps_as_int64_arithmetic():
  n, size = 5, 64
  ddp = distributed.DistributedDP('ddgauss', 1.0, 6, 1 / 40, 0.0, 0.0, size,
                                  n)
  updates = _updates(n, size, seed=3) * 0 + 0.2  # Norm 1.6 -> clipped to 1.
  rot = distributed.round_rotation_key(jax.random.PRNGKey(0))
  keys = jax.random.split(jax.random.PRNGKey(2), n)
  msgs = jax.vmap(lambda v, k: distributed.client_encode(ddp, v, rot, k))(
      jnp.asarray(updates), keys)
  ints = np.asarray(msgs.integers, np.int64)
  assert np.all(np.asarray(msgs.residues) == np.mod(ints, 2 ** 6))
  total = np.sum(ints, axis=0)
  residue_sum = jnp.sum(msgs.residues, axis=0, dtype=jnp.uint32)
  signed = np.asarray(distributed._signed(residue_sum, 6), np.int64)
  assert np.all(signed == (np.mod(total + 32, 64) - 32))
  wrapped = np.mean((total < -32) | (total > 31))
  assert 0 < wrapped < 1  # The case wraps some coordinates, not all.
  assert float(distributed.wrapped_fraction(
      jnp.asarray(total, jnp.float32), 6)) == pytest.approx(wrapped)


@pytest.mark.parametrize('mechanism', ['ddgauss', 'skellam'])
def test_noise_of_the_sum_has_std_z_c(mechanism):
  n, size, clip, z = 10, 2 ** 16, 1.0, 0.5
  ddp = privacy.secure_settings(
      mechanism=mechanism, noise_multiplier=z, clip_norm=clip, bits=20,
      beta=0.0, clients=n, size=size,
      k_stddevs=ddp_accounting.DEFAULT_K[mechanism])
  got, _ = _secure_mean(ddp, np.zeros((n, size), np.float32),
                        jax.random.PRNGKey(4))
  std = float(np.std(np.asarray(got))) * n  # On the sum.
  # 2^16 coordinates: the sample std's relative error is ~0.28%; 2% is
  # 7 standard errors, and a 10% variance error (4.9% in the std) fails.
  assert std == pytest.approx(z * clip, rel=0.02)


def test_conditional_rounding_keeps_the_bound_and_is_unbiased():
  d = 256
  x = jnp.asarray(np.random.default_rng(0).normal(size=d) * 3, jnp.float32)
  bound = ddp_accounting.rounded_l2_norm_bound(float(jnp.linalg.norm(x)),
                                                0.1, d)
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  y, draws = jax.vmap(lambda k: distributed.conditional_round(k, x, bound))(
      keys)
  norms = np.linalg.norm(np.asarray(y, np.float64), axis=1)
  assert np.all(norms <= bound + 1e-9)
  assert np.all(np.abs(np.asarray(y) - np.asarray(x)) < 1)
  # Kept with probability >= 1 - beta = 0.9: the mean draws is at most
  # 1/0.9; with 2000 rounds the sample mean stays below 1.2.
  assert float(np.mean(np.asarray(draws))) < 1.2
  # The rounding is unbiased per coordinate before conditioning; the
  # conditioning moves the mean by little (std of one draw <= 0.5).
  err = np.abs(np.mean(np.asarray(y, np.float64), axis=0) - np.asarray(x))
  assert np.max(err) < 0.05


def test_rotation_is_orthogonal_and_decode_inverts_it():
  d = 1024
  signs = distributed.rotation_signs(jax.random.PRNGKey(3), d)
  x = jnp.asarray(np.random.default_rng(1).normal(size=d), jnp.float32)
  y = distributed._rotate(x, signs)
  assert float(jnp.linalg.norm(y)) == pytest.approx(
      float(jnp.linalg.norm(x)), rel=1e-5)
  np.testing.assert_allclose(distributed._unrotate(y, signs), x, atol=1e-5)
  assert set(np.unique(np.asarray(signs)).tolist()) == {-1.0, 1.0}


def test_non_finite_update_is_flagged():
  ddp = distributed.DistributedDP('skellam', 1.0, 16, 1e-3, 0.0, 0.5, 10,
                                  2)
  out, diag = distributed.encode_update(
      ddp, {'w': jnp.full((10,), jnp.nan)}, jax.random.PRNGKey(0),
      jax.random.PRNGKey(1))
  assert not bool(diag['finite'])
  assert out['residues'].dtype == jnp.uint32


@pytest.mark.parametrize('field,value,expected', [
    ('bits', 1, 'bits B must be an int in [2, 32]; got 1'),
    ('bits', 33, 'bits B must be an int in [2, 32]; got 33'),
    ('beta', 1.0, 'beta must be in [0, 1); got 1.0'),
    ('gamma', 0.0, 'gamma must be finite and > 0; got 0.0'),
    ('mechanism', 'laplace', "mechanism must be one of"),
])
def test_bad_settings_one_line(field, value, expected):
  good = dict(mechanism='ddgauss', clip_norm=1.0, bits=16, gamma=1e-3,
              local_std=0.1, beta=0.5, size=10, denominator=2)
  with pytest.raises(ValueError) as e:
    distributed.DistributedDP(**{**good, field: value}).check()
  assert expected in str(e.value) and '\n' not in str(e.value)


def test_too_few_bits_names_the_smallest_that_fits():
  with pytest.raises(ValueError) as e:
    privacy.secure_settings(mechanism='ddgauss', noise_multiplier=1.0,
                            clip_norm=1.0, bits=4, beta=0.5, clients=800,
                            size=100, k_stddevs=4)
  need = ddp_accounting.min_bits(800, 4)
  assert need == 7  # 2^(2B) > 800 * 16 = 12800: B = 7 (16384).
  assert str(need) in str(e.value) and '\n' not in str(e.value)
