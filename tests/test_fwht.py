"""Tests for fedlite_jax.transforms.fwht against scipy.linalg.hadamard."""

from __future__ import annotations

import os

import fedlite_jax  # noqa: F401  (before fedjax; applies compat fixes)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from fedlite_jax.transforms import fwht as fwht_lib
from fedlite_jax.transforms.fwht import fwht

SMALL_NS = [2**k for k in range(0, 11)]  # 1 .. 1024: all residues mod 4.


def _hadamard_row_signs(j: int, n: int) -> np.ndarray:
  """Row j of the Sylvester H_n: (-1)^popcount(i & j), without building H_n."""
  i = np.arange(n, dtype=np.int64) & j
  parity = np.zeros(n, dtype=np.int64)
  while np.any(i):
    parity ^= i & 1
    i >>= 1
  return 1.0 - 2.0 * parity


def _row_signs_at(j: int, idx: np.ndarray) -> np.ndarray:
  """H_n[j, idx] for any n > max(idx, j), by the popcount formula."""
  return np.array([1.0 - 2.0 * (bin(int(i) & j).count('1') & 1) for i in idx])


@pytest.mark.parametrize('n', SMALL_NS)
def test_exact_on_integers_vs_scipy(n):
  rng = np.random.default_rng(n)
  x = rng.integers(-8, 9, size=(n,)).astype(np.float32)
  expected = x.astype(np.float64) @ scipy.linalg.hadamard(n)
  # Integer inputs with |sums| < 2**24 are exact in float32.
  np.testing.assert_array_equal(np.asarray(fwht(x)), expected)


@pytest.mark.parametrize('n', SMALL_NS)
def test_matches_scipy_with_batch_axes(n):
  rng = np.random.default_rng(100 + n)
  x = rng.standard_normal((2, 3, n)).astype(np.float32)
  expected = x.astype(np.float64) @ scipy.linalg.hadamard(n)
  out = fwht(jnp.asarray(x))
  assert out.shape == (2, 3, n) and out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), expected,
                             rtol=1e-5, atol=1e-5 * np.sqrt(n))


@pytest.mark.parametrize('n', [1, 2, 8, 16, 128, 4096, 2**15])
def test_involution(n):
  x = jax.random.normal(jax.random.key(n), (3, n), jnp.float32)
  np.testing.assert_allclose(np.asarray(fwht(fwht(x))), n * np.asarray(x),
                             rtol=1e-5, atol=1e-4 * n)


@pytest.mark.parametrize('n', [2**17, 2**18, 2**19])
def test_large_delta_rows(n):
  # H e_j is row j of H_n; checks the factor ordering at sizes with a
  # leading radix 32 (2**17), 4 (2**18) and 8 (2**19) that scipy cannot
  # build.
  for j in (1, 12345, n - 1):
    e = jnp.zeros((n,), jnp.float32).at[j].set(1.0)
    np.testing.assert_array_equal(np.asarray(fwht(e)),
                                  _hadamard_row_signs(j, n))


def _physical_memory_bytes() -> int:
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return 0


@pytest.mark.skipif(_physical_memory_bytes() < 8 * 2**30,
                    reason='needs ~3 GiB for three 2**27 float32 buffers')
def test_length_2_to_27():
  # GPT-2 scale (L = 2**27, leading radix 8): a delta gives row j of H,
  # checked at sampled positions against the popcount formula.
  n, j = 2**27, 123_456_789
  out = fwht(jnp.zeros((n,), jnp.float32).at[j].set(1.0))
  idx = np.random.default_rng(0).integers(0, n, size=4096)
  idx[:3] = (0, 1, n - 1)
  np.testing.assert_array_equal(np.asarray(out)[idx], _row_signs_at(j, idx))
  assert float(jnp.min(jnp.abs(out))) == 1.0 == float(jnp.max(jnp.abs(out)))


def test_grad_is_fwht_of_cotangent():
  n = 256
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n,))
  y = jax.random.normal(ky, (n,))
  g = jax.grad(lambda v: jnp.vdot(fwht(v), y))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(fwht(y)),
                             rtol=1e-5, atol=1e-4)
  # Batched VJP and forward mode.
  ys = jax.random.normal(ky, (4, n))
  _, vjp = jax.vjp(fwht, jnp.ones((4, n)))
  np.testing.assert_allclose(np.asarray(vjp(ys)[0]), np.asarray(fwht(ys)),
                             rtol=1e-5, atol=1e-4)
  # Second-order: grad of a grad (the VJP is fwht itself, so it nests).
  gg = jax.grad(lambda v: jnp.sum(jax.grad(
      lambda u: 0.5 * jnp.sum(fwht(u) ** 2))(v) * y))(x)
  np.testing.assert_allclose(np.asarray(gg), n * np.asarray(y), rtol=1e-4,
                             atol=1e-3)


def test_jit_and_vmap_agree():
  x = jax.random.normal(jax.random.key(3), (5, 2048))
  eager = np.asarray(fwht(x))
  np.testing.assert_allclose(np.asarray(jax.jit(fwht)(x)), eager, rtol=1e-6,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(jax.vmap(fwht)(x)), eager, rtol=1e-6,
                             atol=1e-5)


def test_integer_input_promoted_to_float32():
  out = fwht(jnp.arange(8, dtype=jnp.int32))
  assert out.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out),
                                np.arange(8) @ scipy.linalg.hadamard(8))


@pytest.mark.parametrize('n', [0, 3, 6, 12, 1000])
def test_non_power_of_two_rejected_with_length(n):
  with pytest.raises(ValueError, match=rf'\b{n}\b'):
    fwht(jnp.zeros((2, n)))


def test_scalar_rejected():
  with pytest.raises(ValueError):
    fwht(jnp.float32(1.0))


def test_factors():
  assert fwht_lib.hadamard_factors(1) == ()
  assert fwht_lib.hadamard_factors(2) == (2,)
  assert fwht_lib.hadamard_factors(2**21) == (32,) + (16,) * 4
  assert fwht_lib.hadamard_factors(2**22) == (4,) + (16,) * 5
  assert fwht_lib.hadamard_factors(2**24) == (16,) * 6
  assert fwht_lib.hadamard_factors(2**27) == (8,) + (16,) * 6
