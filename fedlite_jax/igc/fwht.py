"""Fast Walsh-Hadamard transform (FWHT) in pure JAX.

The transform is the product with the unnormalized Sylvester Hadamard matrix
``H_n`` (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; the ordering of
``scipy.linalg.hadamard``). ``H_n`` is symmetric and ``H_n @ H_n = n * I``, so
the transform is its own transpose and, up to the factor ``n``, its own
inverse.

Layout. ``H_n`` of ``n = 2**k`` is the Kronecker product of Sylvester matrices
of any sizes whose product is ``n``: ``H_n = H_r (x) H_16 (x) ... (x) H_16``
(:func:`hadamard_factors`: ``r`` in {2, 4, 8, 16, 32}). A row-major vector of
length ``n`` reshaped to ``(r, 16, ..., 16)`` is therefore transformed by
contracting every axis with the small Hadamard matrix of its size; each
contraction is one ``(M, m) @ (m, m)`` GEMM (``m <= 32``) plus one
transpose. The leading axis is always the one contracted and the result axis
is appended last, so after all contractions the axes are back in their
original order without an explicit ``moveaxis``. A radix-2 butterfly instead
costs one full memory pass per level (XLA does not fuse across levels; see
docs/DESIGN_NOTES.md, "FWHT"). Measured on XLA:CPU (2 shared cores,
allocator page faults removed, benchmarks/bench_fwht.py): 2-3x faster than
the butterfly once the data leaves the cache (n = 2**24: 110-143 vs 322-417
ms) and 1.1-1.3x in cache (n <= 2**21). Contractions use
``precision=HIGHEST`` so that GPUs do not silently use TF32 (entries of ``H``
are +-1, so products are exact and the only rounding is float32 summation:
relative error ~ 1e-7 * log2(n)).

Differentiation. ``H`` is symmetric, so the VJP of ``y = fwht(x)`` is
``fwht(ct)``: a ``custom_vjp`` computes it with the forward code. (Relying on
linearity also works, but XLA:CPU ran JAX's transposed program 3x slower than
the forward pass at n = 2**24, because its transposes write with a large
stride.) The price is that forward mode (``jax.jvp``) is not supported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['fwht', 'hadamard_factors', 'is_power_of_two']

# Radix of every contraction but the first. 16 (four levels per GEMM) was the
# fastest of 2, 4, 8, 16 measured on XLA:CPU; larger radices waste FLOPs
# (a radix-m contraction costs m multiply-adds per element for log2(m) levels).
_RADIX_LOG2 = 4
# A leading factor 2 is merged into the next 16 (radix 32): faster at 2**17
# and 2**21 on XLA:CPU. Factors 4 and 8 stay separate (64 / 128 multiply-adds
# per element for a merged radix was no faster).
_MAX_MERGED_RADIX = 32


def is_power_of_two(n: int) -> bool:
  """Whether ``n`` is a positive integral power of two (1 included)."""
  return isinstance(n, (int, np.integer)) and n >= 1 and (n & (n - 1)) == 0


def hadamard_factors(n: int) -> tuple[int, ...]:
  """Sizes of the small Hadamard factors used to transform length ``n``.

  Args:
    n: transform length, a power of two >= 1.

  Returns:
    A tuple ``(r, 16, ..., 16)`` whose product is ``n``: ``r = 16`` when
    ``log2(n)`` is a multiple of 4; ``r = 32`` when ``log2(n) = 1 mod 4``
    (``n >= 32``); otherwise ``r`` in {2, 4, 8} followed by the 16s. ``()``
    for ``n == 1``.

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
  if q and (radix << rem) <= _MAX_MERGED_RADIX:
    # One radix-32 contraction instead of radix-2 + radix-16: one memory pass
    # fewer for 32 instead of 18 multiply-adds per element.
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

  Computes ``x @ H_n`` with ``H_n`` the Sylvester-ordered Hadamard matrix
  (``scipy.linalg.hadamard(n)``; symmetric, so also ``H_n @ x`` for vectors),
  without normalization: ``fwht(fwht(x)) == n * x``. Source: the Walsh-
  Hadamard transform used by Fastfood (Le, Sarlos & Smola, ICML 2013) and by
  intrinsic gradient compression (Melas-Kyriazi & Wang, 2022, Section 3.2).

  Cost: ``O(n log n)`` multiply-adds (16 per element per 4 levels), about
  ``ceil(log2(n) / 4)`` GEMM passes over the data, ``O(n)`` memory.
  Jitted, vmappable. Differentiable in reverse mode (``jax.grad``,
  ``jax.vjp``): the VJP is ``fwht`` of the cotangent (``H`` is symmetric),
  at the cost of the forward pass; forward mode (``jax.jvp``) is not
  supported (the function is linear: the tangent is ``fwht(t)``).

  Args:
    x: array of shape ``[..., n]`` with ``n`` a power of two (tested up to
      ``2**27``). Floating dtypes are kept (float32 is the intended one);
      integer and boolean inputs are promoted to float32.

  Returns:
    Array of the same shape as ``x`` and floating dtype,
    ``out[..., i] = sum_j x[..., j] * H_n[j, i]``.

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


# Reverse mode through H symmetric: VJP(ct) = fwht(ct), computed by the same
# code as the forward pass. JAX's own transpose of _fwht_impl is correct but
# its transposes move the minor axis to the front (strided writes): 3x slower
# than the forward pass at n = 2**24 on XLA:CPU (300 vs 95 ms).
@jax.custom_vjp
def _fwht_symmetric(x: jax.Array) -> jax.Array:
  return _fwht_impl(x)


def _fwht_symmetric_fwd(x):
  return _fwht_impl(x), None


def _fwht_symmetric_bwd(_, ct):
  return (_fwht_symmetric(ct),)  # Itself: higher orders stay fast.


_fwht_symmetric.defvjp(_fwht_symmetric_fwd, _fwht_symmetric_bwd)
