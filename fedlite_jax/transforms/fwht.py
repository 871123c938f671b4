"""Fast Walsh-Hadamard transform (FWHT) in pure JAX.

The product with the unnormalized Sylvester Hadamard matrix ``H_n`` (``H_1 =
[1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``, ``scipy.linalg.hadamard``) as a
Kronecker product of small factors, one GEMM each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['fwht', 'hadamard_factors', 'is_power_of_two']

# Radix of every contraction but the first (docs/notes/transforms.md).
_RADIX_LOG2 = 4
# A leading factor 2 is merged into the next 16 (radix 32); 4 and 8 are not.
_MAX_MERGED_RADIX = 32


def is_power_of_two(n: int) -> bool:
  """Whether ``n`` is a positive integral power of two (1 included)."""
  return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def hadamard_factors(n: int) -> tuple[int, ...]:
  """Sizes of the small Hadamard factors used to transform length ``n``.

  ``H_n = H_r (x) H_16 (x) ... (x) H_16`` (Sylvester ordering).

  Returns:
    ``(r, 16, ..., 16)`` with product ``n``: ``r = 16`` when ``log2(n)`` is
    a multiple of 4; ``r = 32`` when ``log2(n) = 1 mod 4`` (``n >= 32``);
    otherwise ``r`` in {2, 4, 8}. ``()`` for ``n == 1``.

  Raises:
    ValueError: if ``n`` is not a power of two.
  """
  if not is_power_of_two(n):
    raise ValueError(
        f'fwht needs a power-of-two length; got length {n!r}.')
  k = int(n).bit_length() - 1
  q, rem = divmod(k, _RADIX_LOG2)
  radix = 1 << _RADIX_LOG2
  if rem == 0:
    return (radix,) * q
  if q and (radix << rem) <= _MAX_MERGED_RADIX:  # One memory pass fewer.
    return (radix << rem,) + (radix,) * (q - 1)
  return (1 << rem,) + (radix,) * q


@functools.lru_cache(maxsize=None)
def _sylvester_np(m: int) -> np.ndarray:
  """The m x m Sylvester Hadamard matrix as float64 NumPy (m a power of 2)."""
  h = np.ones((1, 1))
  while h.shape[0] < m:
    h = np.block([[h, h], [h, -h]])
  return h


@jax.jit
def fwht(x: jax.Array) -> jax.Array:
  """Unnormalized fast Walsh-Hadamard transform over the last axis.

  ``x @ H_n`` (``H_n`` symmetric, so also ``H_n @ x``); ``fwht(fwht(x)) ==
  n * x``. Source: the transform of Fastfood (Le, Sarlos & Smola, ICML 2013)
  and of intrinsic gradient compression (Melas-Kyriazi & Wang, 2022, Section
  3.2). Cost: ``O(n log n)``, about ``ceil(log2(n) / 4)`` GEMM passes,
  ``O(n)`` memory. Contractions use ``precision=HIGHEST`` (no TF32 on GPUs);
  the only rounding is float32 summation (relative error ~ 1e-7 log2(n)).
  Jitted, vmappable; reverse mode only (the VJP is ``fwht`` of the
  cotangent); ``jax.jvp`` is not supported.

  Args:
    x: ``[..., n]``, ``n`` a power of two (tested up to ``2**27``). Floating
      dtypes are kept; integer and boolean inputs become float32.

  Returns:
    The shape of ``x``, floating: ``out[..., i] = sum_j x[..., j] H_n[j, i]``.

  Raises:
    ValueError: if ``x`` is a scalar or its last axis is not a power of two
      (the message names the length).
  """
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError(
        'fwht needs an array with at least one axis; got a scalar.')
  if not jnp.issubdtype(x.dtype, jnp.floating):
    x = x.astype(jnp.float32)
  hadamard_factors(x.shape[-1])  # Validates the length.
  return _fwht_symmetric(x)


def _fwht_impl(x: jax.Array) -> jax.Array:
  """The transform for a validated floating ``x`` (see :func:`fwht`)."""
  factors = hadamard_factors(x.shape[-1])
  if len(factors) == 0:  # n == 1: H_1 = [1].
    return x
  lead = x.shape[:-1]
  nl = len(lead)
  y = x.reshape(lead + factors)
  for m in factors:
    h = jnp.asarray(_sylvester_np(m), dtype=y.dtype)
    # Contract the first transform axis (position nl); tensordot appends the
    # transformed axis last, so after len(factors) steps the order is restored.
    y = jnp.tensordot(y, h, axes=((nl,), (0,)),
                      precision=jax.lax.Precision.HIGHEST)
  return y.reshape(x.shape)


# H is symmetric: VJP(ct) = fwht(ct), by the forward code.
@jax.custom_vjp
def _fwht_symmetric(x: jax.Array) -> jax.Array:
  return _fwht_impl(x)


def _fwht_symmetric_fwd(x):
  return _fwht_impl(x), None


def _fwht_symmetric_bwd(_, ct):
  return (_fwht_symmetric(ct),)  # Itself: higher orders stay fast.


_fwht_symmetric.defvjp(_fwht_symmetric_fwd, _fwht_symmetric_bwd)
