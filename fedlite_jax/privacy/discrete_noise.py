"""Integer noise for distributed DP under secure aggregation (pure JAX).

Under secure aggregation each client adds integer noise to its integer
(scaled, rounded) update, and the server only sees the sum modulo the field
size. This module samples that noise, vectorized over an array, with
explicit PRNG keys; the samplers are jittable and vmappable (``vmap`` over
keys, or over the scale), and return int32.

* :func:`discrete_gaussian`: the discrete Gaussian ``N_Z(0, sigma^2)`` with
  pmf proportional to ``exp(-x^2 / (2 sigma^2))`` on the integers, by the
  exact rejection sampler of Canonne, Kamath & Steinke 2020, "The Discrete
  Gaussian for Differential Privacy" (NeurIPS 2020; arXiv:2004.00010),
  Algorithm 3: discrete Laplace proposals of scale ``t = floor(sigma) + 1``,
  each accepted with probability
  ``exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2))``. The discrete Laplace is the
  difference of two i.i.d. geometric variables with ratio ``exp(-1/t)``,
  each drawn as in their Algorithm 2 as ``U + t V``: ``U`` uniform on
  ``{0, ..., t-1}`` accepted with probability ``exp(-U/t)``, ``V``
  geometric with ratio ``exp(-1)`` (Alg. 2 counts Bernoulli trials; here
  the inverse CDF ``floor(-log u)``). The three acceptance steps (two
  ``U``, one Gaussian) are one Bernoulli with the product of their
  probabilities, which accepts the same distribution.
* The Skellam mechanism's noise is
  :func:`fedlite_jax.privacy.skellam_noise.skellam`, which shares this
  module's checks and uniforms.

Precision (float32; x64 is off in this project): every acceptance test
compares a uniform draw with 32 random bits (values in ``[2^-33, 1]``) with
a probability computed in float32, so each probability is exact up to
float32 rounding (relative ~1e-7; ~1e-5 for the Poisson's, a bound on the
log-pmf of magnitude up to ~25) and the uniform's grid (absolute
~2^-24); probabilities below ``2^-33`` are never accepted.

Invalid traced scales cannot raise under ``jit``; such draws return
:data:`INVALID_DRAW` (a value no valid draw takes) instead of looping
forever or returning plausible noise.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    'INVALID_DRAW',
    'MAX_SIGMA',
    'discrete_gaussian',
]

# Largest sigma of discrete_gaussian. Its draws satisfy |x| < 23 * t with
# t = floor(sigma) + 1 (see _dlaplace_gauss_proposal), so |x| < 2.4e8, far
# below 2^31 - 1: no int32 overflow is possible, not merely improbable.
MAX_SIGMA = 1e7

# Every entry of a draw whose traced scale is invalid (NaN, negative or above
# the maximum). int32's minimum: no valid draw reaches it.
INVALID_DRAW = int(np.iinfo(np.int32).min)

# floor(-log(u)) for u >= 2^-33 (the smallest uniform of _to_uniform).
_V_MAX = 22.0

Shape = Union[int, Sequence[int]]


def _as_shape(shape: Shape) -> tuple[int, ...]:
  if isinstance(shape, (int, np.integer)):
    return (int(shape),)
  return tuple(int(d) for d in shape)


def _check_scale(fn: str, name: str, value: Any, upper: float) -> None:
  """One-line ``ValueError`` for a non-scalar, or a concrete bad value."""
  if np.ndim(value) != 0:
    raise ValueError(f'{fn}: {name} must be a scalar; got shape '
                     f'{np.shape(value)}.')
  if isinstance(value, jax.core.Tracer):
    return  # checked in the graph: INVALID_DRAW
  v = float(value)
  if not (math.isfinite(v) and 0 <= v <= upper):
    raise ValueError(f'{fn}: {name} must be a finite number in '
                     f'[0, {upper:g}]; got {value!r}.')


def _to_uniform(bits: jax.Array) -> jax.Array:
  """float32 uniform on ``[2^-33, 1]`` from 32 random bits per entry.

  Unlike ``jax.random.uniform`` (a grid of 2^-23 on ``[0, 1)``) small values
  keep float32's relative precision, so ``-log(u)`` has an accurate tail
  and no ``log(0)``.
  """
  return (bits.astype(jnp.float32) + 0.5) * jnp.float32(2.0 ** -32)


def _dlaplace_gauss_proposal(key, shape, t, sigma2):
  """One round of CKS Alg. 3 for every entry: ``(candidate, accepted)``.

  ``Y = G1 - G2``, ``Gi = Ri + t Vi``: ``Ri = bits mod t``, uniform on
  ``{0..t-1}`` when ``bits`` (32 random bits) is below the largest multiple
  of ``t`` that fits (exact; else the round is rejected, probability
  ``< t / 2^32``), and ``Vi = floor(-log U) <= 22``, geometric with ratio
  ``exp(-1)``. One Bernoulli with probability
  ``exp(-(R1 + R2) / t) * exp(-(|Y| - sigma^2/t)^2 / (2 sigma^2))``
  accepts both ``Ri`` (making ``Gi`` geometric with ratio ``exp(-1/t)``, so
  ``Y`` discrete Laplace with scale ``t``) and the Gaussian step at once:
  the accepted ``Y`` has pmf proportional to ``exp(-Y^2 / (2 sigma^2))``.
  ``|Y| <= (t - 1) + 22 t < 23 t``; all integer arithmetic is int32.
  """
  bits = jax.random.bits(key, (5,) + shape, jnp.uint32)
  t_u = t.astype(jnp.uint32)
  in_range = jnp.all(bits[:2] < (jnp.uint32(0xFFFFFFFF) // t_u) * t_u, axis=0)
  r = (bits[:2] % t_u).astype(jnp.int32)
  u = _to_uniform(bits[2:])
  # Clamped before the cast (a no-op for u >= 2^-33, stated for safety).
  v = jnp.minimum(jnp.floor(-jnp.log(u[:2])), _V_MAX).astype(jnp.int32)
  y = (r[0] - r[1]) + t * (v[0] - v[1])
  t_f = t.astype(jnp.float32)
  gap = jnp.abs(y).astype(jnp.float32) - sigma2 / t_f
  log_p = (-(r[0] + r[1]).astype(jnp.float32) / t_f
           - gap * gap / (2.0 * sigma2))
  return y, in_range & (jnp.log(u[2]) < log_p)


# Proposals per entry in one round of the loop: a round accepts 30-50% of its
# proposals, so 4 per entry fill an array in one round (a shortfall takes
# another round).
_OVERSAMPLE = 4


@functools.partial(jax.jit, static_argnums=1)
def _discrete_gaussian(key, shape, sigma):
  valid = (sigma >= 0) & (sigma <= MAX_SIGMA)  # False for NaN
  done_now = ~valid | (sigma == 0)
  s = jnp.where(done_now, jnp.float32(1.0), sigma)
  # t = floor(sigma) + 1 in float32, clamped to [1, MAX_SIGMA + 1] before
  # the int cast (the clamp only acts on masked-out invalid entries).
  t = jnp.clip(jnp.floor(s) + 1.0, 1.0, MAX_SIGMA + 1.0).astype(jnp.int32)
  sigma2 = s * s
  n = math.prod(shape)
  m = max(_OVERSAMPLE * n, 64)

  def cond(state):
    return state[1] < n

  def body(state):
    # The accepted proposals, in order, fill the next free entries: the
    # entries are i.i.d. draws of the accepted distribution.
    key, filled, y = state
    key, sub = jax.random.split(key)
    cand, ok = _dlaplace_gauss_proposal(sub, (m,), t, sigma2)
    ok = ok.astype(jnp.int32)
    pos = filled + jnp.cumsum(ok) - 1
    y = y.at[jnp.where(ok > 0, pos, n)].set(cand, mode='drop')
    return key, jnp.minimum(filled + jnp.sum(ok), n), y

  filled = jnp.where(done_now, n, 0).astype(jnp.int32)
  y = jax.lax.while_loop(cond, body,
                         (key, filled, jnp.zeros((n,), jnp.int32)))[2]
  return jnp.where(valid, y, INVALID_DRAW).reshape(shape)


def discrete_gaussian(key: jax.Array, shape: Shape, sigma: Any) -> jax.Array:
  """Exact discrete Gaussian noise ``N_Z(0, sigma^2)`` on the integers.

  ``P(X = x)`` is proportional to ``exp(-x^2 / (2 sigma^2))`` for every
  integer ``x`` (Canonne, Kamath & Steinke 2020, Alg. 3). Its variance is
  below ``sigma^2``: by 2.1e-7 relative at ``sigma = 1``, less for larger
  ``sigma``, 14% at ``sigma = 0.5``.

  "Exact" means an exact rejection sampler: no continuous Gaussian is
  rounded and no sample is truncated to a fixed number of trials; a
  ``jax.lax.while_loop`` draws, with fresh keys split from ``key``, rounds
  of 4 proposals per entry (a proposal is accepted with probability
  30-50%) whose accepted ones, in order, fill the next unfilled entries,
  until all are (one round almost always suffices). The acceptance
  probabilities are
  computed in float32 and compared with 32-bit uniforms, so each is exact up
  to float32 rounding (~1e-7 relative, ~2^-24 absolute); a value whose
  acceptance probability is below ``2^-33`` (beyond about ``7 sigma``,
  total mass < 1e-10) is never returned.

  No overflow: every draw satisfies ``|x| < 23 (floor(sigma) + 1)``, a
  bound of the sampler, not a probability (< 2.4e8 at :data:`MAX_SIGMA`),
  and every float-to-int cast is of a value clamped first (``floor(sigma)
  + 1`` to ``[1, MAX_SIGMA + 1]``, geometric draws to ``<= 22``).

  Args:
    key: PRNG key (``jax.random.PRNGKey`` or ``jax.random.key``).
    shape: output shape (int or tuple of ints); may have size 0.
    sigma: standard deviation (integer noise units), a Python/NumPy number
      or a float32 scalar (may be traced), in ``[0, MAX_SIGMA]``, used as
      float32. ``0`` gives
      zeros. A traced NaN, negative or too large ``sigma`` cannot raise: the
      output is then all :data:`INVALID_DRAW`.

  Returns:
    int32 array of ``shape``: i.i.d. draws (integer noise units).

  Raises:
    ValueError: (one line, naming the value) if ``sigma`` is not a scalar, or
      is a concrete value that is negative, not finite or above
      :data:`MAX_SIGMA`.
  """
  shape = _as_shape(shape)
  _check_scale('discrete_gaussian', 'sigma', sigma, MAX_SIGMA)
  return _discrete_gaussian(key, shape, jnp.asarray(sigma, jnp.float32))
