"""Skellam noise for distributed DP under secure aggregation (pure JAX).

:func:`skellam` draws the Skellam mechanism's noise (Agarwal, Kairouz & Liu
2021, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021; arXiv:2110.04995): ``P1 - P2``, ``P1, P2`` i.i.d.
Poisson(``variance / 2``), as centred deviations (jittable, vmappable,
int32, explicit keys).


The Skellam mechanism's noise (Agarwal, Kairouz & Liu 2021): mean 0,
variance ``variance``; ``P(X = x) = exp(-2 mu) I_|x|(2 mu)``,
``mu = variance / 2`` (the rate, rounded to float32). With
``m0 = floor(mu)`` and ``Pi = m0 + Ti``, ``X = T1 - T2``: only the centred
deviations ``Ti`` are drawn (int32, a few ``sqrt(mu)``), never ``Pi``,
which at variance 1e12 is beyond int32 and float32's integers.

``T`` for ``mu < 10``: inversion, ``P = #{j : F(j) < u}`` over
``j <= 47``, both tails summed in float32 from their small end.

``T`` for ``mu >= 10``: the transformed rejection method with squeeze,
PTRS, of W. Hormann, "The transformed rejection method for generating
Poisson random variables", Insurance: Mathematics and Economics 12 (1993)
39-45 (also ``jax.random.poisson``'s from rate 10, numpy's and
TensorFlow's), without its squeezes (vectorized they save nothing; the
full test alone is exact) and with three changes that keep it exact in
float32:

1. Proposal. PTRS draws ``U`` uniform on ``(-1/2, 1/2)`` and ``V`` on
   ``(0, 1)``, sets ``us = 1/2 - |U|``, ``a = -0.059 + 0.02483 b``,
   ``b = 0.931 + 2.53 sqrt(mu)``, and proposes
   ``k = floor((2a/us + b) U + mu + 0.43)``: ``x = (2a/us + b) U`` has
   density ``1 / (b + a/us^2)`` (its derivative in ``U``). Here
   ``T = k - m0 = floor(s y + frac + 0.43)``, exactly, with ``s`` the sign
   of ``U``, ``frac = mu - m0`` and
   ``y = (1/2 - us)(2a/us + b) = a/us + (b/2 - 2a) - b us``; ``us`` takes
   the 2^47 midpoints of a ``2^-48`` grid (47 random bits;
   ``jax.random.uniform`` has 23) and ``y`` is evaluated in double-float
   arithmetic (float32 pairs: Knuth's TwoSum, Dekker's exact product with
   12-bit halves split by masking, ``a/us`` corrected by its exact
   remainder). So ``T`` is the floor of the exact ``x`` unless that lies
   within ~1e-7 of an integer (rate 5e13; 1e-11 at rate 10): each
   value's probability is right to ~2e-7 relative. (Plain float32 is off
   by up to ``ulp(x)``, 0.25 at rate 1e12, where a 23-bit ``U`` alone
   gives each value only about 3 grid points.)
2. Acceptance. PTRS accepts ``k`` iff
   ``log V + log(1/alpha) - log(a/us^2 + b) <= log p(k)``,
   ``p(k) = mu^k e^-mu / k!``, with ``log p(k)`` as
   ``-mu + k log mu - lgamma(k + 1)``: terms of size ``mu log mu`` that
   cancel (float32 loses ~1e-3 of the log at rate 2000, ~1e-2 at 1e4:
   why ``jax.random.poisson`` fails chi-square tests from rate ~4000).
   Here, with ``d = k - mu = T - frac``, ``u = d / mu``, Stirling's
   ``log k! = k log k - k + log(2 pi k)/2 + delta(k)``,
   ``delta(k) = 1/(12k) - 1/(360k^3) + 1/(1260k^5)`` (error
   ``< 1/(1680k^7)``), and ``k log(k/mu) - k + mu = mu g(u)``,
   ``g(u) = (1 + u) log1p(u) - u``::

     log p(k) = -mu g(u) - log(2 pi mu)/2 - [log1p(u)/2 + delta(k)],

   ``mu g(u) = d u S(u)``, ``S(u) = sum_{i>=0} (-u)^i / ((i+1)(i+2))``
   (20 terms, relative error < 5e-9, for ``|u| < 1/2``; the closed form
   otherwise); for ``k < 16`` the bracket is ``L(k) - log(2 pi mu)/2``
   with the exact ``L(k) = log k! - k log k + k`` from a table. With
   ``log(a/us^2 + b) = log b + log1p(a / (b us^2))`` the test becomes::

     log V <= log(alpha b / (1.02 sqrt(2 pi mu))) - mu g(u)
              - [log1p(u)/2 + delta(k)] + log1p(a / (b us^2)),

   the first term one float32 number per rate, the others small or of
   size ``z^2/2`` (``z = d / sqrt(mu)``): nothing large cancels. Its
   right side is within ~1e-5 of float64 (tests: rates 10.7 to 5e13).
3. Hat. PTRS needs ``p(k) <= (1/alpha) / (b + a/us^2)`` on every cell;
   with Hormann's ``1/alpha = 1.1239 + 1.1328 / (b - 3.4)`` that fails by
   up to 0.58% on parts of the cells ``k ~ mu + 1.6..2 sqrt(mu)`` for
   rates 10 to ~2000 (0.18% near 100), which makes those ``k`` too
   rare by up to ~4e-5 relative (1e-5 near rate 100). ``1/alpha`` is
   multiplied by 1.02 here, which leaves the hat above ``p`` everywhere
   by at least 1.4% (checked in float64 for rates 10 to 1e16, step
   0.001-0.01 below 100), at 2% of the acceptance rate (~87% per round,
   74% near rate 10).

The rejection loop redraws, each round, only the first ~1/8 of the
entries not yet accepted (~1.15 candidates per entry). Accepted ``|T|``
are below ~8 ``sqrt(mu)`` (``V >= 2^-33``); a candidate with
``|x| >= 2^29`` is rejected, so ``|T1 - T2| < 2^30 + 66``: no overflow is
possible. chi-square tests (tests/test_discrete_noise.py) pass at
variances 1 to 1e9 and, for ``T`` alone, rates 5e3 and 1e7, where
``jax.random.poisson`` fails.

Range: :data:`MAX_SKELLAM_VARIANCE` = 1e14 (rate 5e13, sd 1e7; 1e12 is
``(2^B / 2k)^2 / n`` for B = 24 bits, k = 3, n = 8 clients), up to which
the integer part (against exact rationals), the acceptance bound
(against float64) and the moments are tested. The double-float error in
``x`` grows like ``sqrt(mu)``; beyond the maximum, which raises, sum
independent draws (Skellam is closed under sums).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.privacy.discrete_noise import _as_shape
from fedlite_jax.privacy.discrete_noise import _check_scale
from fedlite_jax.privacy.discrete_noise import _to_uniform
from fedlite_jax.privacy.discrete_noise import INVALID_DRAW
from fedlite_jax.privacy.discrete_noise import Shape

__all__ = ['MAX_POISSON_RATE', 'MAX_SKELLAM_VARIANCE', 'skellam']

# Largest variance of skellam, and the largest Poisson rate (mean) its
# sampler takes; see the module docstring for why and how it was verified.
MAX_SKELLAM_VARIANCE = 1e14
MAX_POISSON_RATE = MAX_SKELLAM_VARIANCE / 2

# --- Poisson deviations (for skellam) ----------------------------------------

# PTRS (Hormann 1993) from this rate on, the range its hat is given for;
# inversion below.
_PTRS_MIN_RATE = 10.0
# PTRS's hat is enlarged by this factor (1/alpha multiplied by it), because
# the published one does not quite dominate the Poisson histogram: see
# _ptrs_constants.
_PTRS_HAT_MARGIN = 1.02
# Below _PTRS_MIN_RATE: inversion over k = 0..47 (P(X > 47) < 1e-16 there).
_INVERSION_MAX = 47
# L(k) = log k! - k log k + k for k < _STIRLING_MIN_K, from math.lgamma
# (double precision, then rounded); Stirling's series above.
_STIRLING_MIN_K = 16
_LOG_FACTORIAL_REMAINDER = np.array(
    [0.0] + [math.lgamma(k + 1) - k * math.log(k) + k
             for k in range(1, _STIRLING_MIN_K)], np.float32)
# g(u) = (1 + u) log1p(u) - u = u^2 S(u), S(u) = sum_i (-u)^i / ((i+1)(i+2))
# for |u| < 1; used for |u| < 0.5 with 20 terms (truncation < 5e-9
# relative), the closed form elsewhere.
_G_SERIES = tuple(1.0 / ((i + 1) * (i + 2)) for i in range(20))
_G_SERIES_MAX_U = 0.5
# A proposal whose |x| reaches this is rejected (|x| < 2^29 keeps both T and
# T1 - T2 in int32; > 70 sd at MAX_POISSON_RATE).
_PTRS_MAX_X = 2.0 ** 29


def _split12(x):
  """``x = hi + lo`` exactly, each with at most 12 significant bits.

  By masking the low 12 mantissa bits (not Veltkamp's ``4097 x`` trick,
  whose ``c - (c - x)`` a compiler contracting ``c - x`` into an FMA
  would break), so products of halves are exact in float32.
  """
  hi = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000),
      jnp.float32)
  return hi, x - hi


def _two_sum(a, b):
  """Knuth's TwoSum: ``s + e == a + b`` exactly, ``s = fl(a + b)``."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _two_prod(a, b):
  """Dekker's product: ``p + e == a * b`` exactly, ``p = fl(a * b)``."""
  p = a * b
  ah, al = _split12(a)
  bh, bl = _split12(b)
  return p, (((ah * bh - p) + ah * bl) + al * bh) + al * bl


class _PtrsConstants(NamedTuple):
  mu: jax.Array  # the rate (float32 scalar)
  m0: jax.Array  # floor(mu)
  frac: jax.Array  # mu - m0, exact
  a: jax.Array
  b: jax.Array
  c0: tuple  # frac + 0.43, double-float (exact)
  c1: tuple  # b / 2 - 2 a, double-float (exact)
  log_c: jax.Array  # log(b / (margin * inv_alpha * sqrt(2 pi mu)))
  half_log_2pi_mu: jax.Array


def _ptrs_constants(mu):
  """PTRS's parameters for rate ``mu >= 10`` (float32 scalars).

  ``b = 0.931 + 2.53 sqrt(mu)``, ``a = -0.059 + 0.02483 b`` and
  ``1/alpha = 1.1239 + 1.1328 / (b - 3.4)`` as in Hormann (1993) and
  ``jax.random.poisson``; the float32 values computed here *define* the hat
  (any ``a, b`` give a valid proposal), so their rounding costs nothing as
  long as the hat dominates. It does not quite: with the published
  ``1/alpha``, ``p(k) (b + a/us^2) / (1/alpha)`` exceeds 1 on parts of the
  cells ``k = mu + 1.6..2 sd`` (by up to 0.58% near ``mu = 14``, 0.18%
  near 100, 3e-5 near 1000; from ~2000 up it stays below 1, by 3.2e-4
  as ``mu -> inf``), which would make those ``k`` too rare by up to ~4e-5
  relative (numerical integration over the cells). Here
  ``1/alpha`` is multiplied by :data:`_PTRS_HAT_MARGIN` = 1.02, which
  leaves every ratio below ``exp(-0.0140)`` (checked in float64 on a grid
  of ``mu`` from 10 to 1e16, step 0.001-0.01 below 100; see the tests) and
  costs 2% of the acceptance rate (~87% per round).
  """
  f32 = jnp.float32
  m0 = jnp.floor(mu)
  frac = mu - m0
  b = f32(0.931) + f32(2.53) * jnp.sqrt(mu)
  a = f32(-0.059) + f32(0.02483) * b
  inv_alpha = f32(1.1239) + f32(1.1328) / (b - f32(3.4))
  return _PtrsConstants(
      mu=mu, m0=m0, frac=frac, a=a, b=b,
      c0=_two_sum(frac, f32(0.43)),
      c1=_two_sum(f32(0.5) * b, f32(-2.0) * a),
      log_c=jnp.log(b / (f32(_PTRS_HAT_MARGIN) * inv_alpha
                         * jnp.sqrt(f32(2 * math.pi) * mu))),
      half_log_2pi_mu=f32(0.5) * jnp.log(f32(2 * math.pi) * mu))


def _ptrs_log_bound(t, us, c):
  """``log(p(k) (b + a/us^2) / (margin/alpha))``, ``k = floor(mu) + t``.

  PTRS accepts its candidate ``k`` iff ``log V`` is at most this (``-inf``
  for ``k < 0``). ``t``: int32; ``us``: float32; ``c``: constants. Computed
  relative to the mode, without large cancelling terms (see
  :func:`skellam`).
  """
  f32 = jnp.float32
  t_f = t.astype(f32)
  d = t_f - c.frac  # k - mu
  u = d / c.mu
  k = t_f + c.m0  # exact where it matters (k < 2^24)
  w = -u
  series = f32(_G_SERIES[-1])
  for coef in _G_SERIES[-2::-1]:
    series = f32(coef) + w * series
  closed = jnp.where(k > 0, (k / c.mu) * jnp.log1p(u), f32(0.0)) - u
  mu_g = jnp.where(jnp.abs(u) < _G_SERIES_MAX_U, d * u * series,
                   c.mu * closed)
  inv_k = 1.0 / jnp.maximum(k, f32(1.0))
  inv_k2 = inv_k * inv_k
  stirling = f32(0.5) * jnp.log1p(u) + inv_k * (
      f32(1 / 12) - inv_k2 * (f32(1 / 360) - inv_k2 * f32(1 / 1260)))
  table = jnp.asarray(_LOG_FACTORIAL_REMAINDER)[
      jnp.clip(k, 0, _STIRLING_MIN_K - 1).astype(jnp.int32)]
  a_k = jnp.where(k < _STIRLING_MIN_K, table - c.half_log_2pi_mu, stirling)
  bound = (c.log_c - mu_g - a_k) + jnp.log1p(c.a / (c.b * us * us))
  return jnp.where(k >= 0, bound, -jnp.inf)


def _ptrs_candidates(bits, c):
  """One PTRS proposal per entry from 3 random words: ``(T, accepted)``.

  ``bits``: uint32 ``(3,) + shape``; ``c``: :func:`_ptrs_constants`.
  ``T = floor(s (0.5 - us) (2a/us + b) + frac + 0.43)`` with ``s`` a random
  sign and ``us`` uniform on the midpoints of a ``2^-48`` grid of
  ``(0, 1/2)``, computed in double-float arithmetic (see :func:`skellam`);
  ``accepted`` is PTRS's exact test, rearranged in terms of ``T``.
  """
  f32 = jnp.float32
  sign = jnp.where((bits[0] & 1) == 1, f32(1.0), f32(-1.0))
  # us = (2^23 hi24 + lo23 + 1/2) 2^-48, as an exact double-float.
  us_hi, us_lo = _two_sum(
      (bits[0] >> 8).astype(f32) * f32(2.0 ** -25),
      ((bits[1] >> 9).astype(f32) + f32(0.5)) * f32(2.0 ** -48))
  # y = (0.5 - us)(2a/us + b) = a/us + (b/2 - 2a) - b us, double-float.
  q_hi = c.a / us_hi
  p, p_err = _two_prod(q_hi, us_hi)  # a - p is exact (Sterbenz)
  q_lo = (((c.a - p) - p_err) - q_hi * us_lo) / us_hi
  bu_hi, bu_lo = _two_prod(c.b, us_hi)
  bu_lo = bu_lo + c.b * us_lo
  s1, e1 = _two_sum(q_hi, c.c1[0])
  y_hi, e2 = _two_sum(s1, -bu_hi)
  y_lo = ((q_lo + c.c1[1]) + (e1 + e2)) - bu_lo
  # x = s y + frac + 0.43 and T = floor(x), exactly from the double-float.
  x_hi, e3 = _two_sum(sign * y_hi, c.c0[0])
  x_lo = (sign * y_lo + c.c0[1]) + e3
  in_range = jnp.abs(x_hi) < f32(_PTRS_MAX_X)
  x_hi = jnp.where(in_range, x_hi, f32(0.0))
  x_lo = jnp.where(in_range, x_lo, f32(0.0))
  n = jnp.floor(x_hi)
  t = n.astype(jnp.int32) + jnp.floor((x_hi - n) + x_lo).astype(jnp.int32)

  log_v = jnp.log(_to_uniform(bits[2]))
  return t, in_range & (log_v <= _ptrs_log_bound(t, us_hi, c))


def _inversion_candidates(bits, mu):
  """``P - floor(mu)``, ``P ~ Poisson(mu)``, ``0 <= mu < 10``, by inversion.

  ``bits``: uint32 ``(3,) + shape`` (the third word unused). ``P = #{j :
  F(j) < u}`` over ``j = 0..47``, ``u`` uniform: with ``r`` the 32-bit
  uniform of ``bits[0]`` (in ``[2^-33, 1]``) and a fair bit of ``bits[1]``,
  ``u = r / 2`` (test ``2 F(j) < r``) or ``u = 1 - r/2`` (test
  ``2 P(X > j) > r``, the upper tail summed from the top), so both tails
  keep float32's relative precision. Always accepted.
  """
  f32 = jnp.float32
  j = jnp.arange(1, _INVERSION_MAX + 1, dtype=f32)
  pmf = jnp.exp(-mu) * jnp.concatenate(
      [jnp.ones((1,), f32), jnp.cumprod(mu / j)])
  cdf2 = 2.0 * jnp.cumsum(pmf)
  tail = jnp.cumsum(pmf[::-1])[::-1]  # P(X >= j)
  sf2 = 2.0 * jnp.concatenate([tail[1:], jnp.zeros((1,), f32)])  # 2 P(X > j)
  r = _to_uniform(bits[0])
  column = (slice(None),) + (None,) * r.ndim
  lower = jnp.sum(cdf2[column] < r, axis=0, dtype=jnp.int32)
  upper = jnp.sum(sf2[column] > r, axis=0, dtype=jnp.int32)
  p = jnp.where((bits[1] & 1) == 1, upper, lower)
  return p - jnp.floor(mu).astype(jnp.int32), jnp.ones(r.shape, jnp.bool_)


def _random_words(key, n, shape):
  """uint32 ``(n,) + shape``, drawn flat (XLA on CPU compiles a flat
  ``jax.random.bits`` several times faster than a multi-dimensional one)."""
  return jax.random.bits(key, (n * math.prod(shape),),
                         jnp.uint32).reshape((n,) + shape)


def _poisson_deviation(key, shape, mu):
  """``P - floor(mu)``, ``P ~ Poisson(mu)``: int32 of ``shape``.

  ``mu``: float32 scalar in ``[0, MAX_POISSON_RATE]``. A rejection loop
  (``jax.lax.while_loop``) that draws, each round, one candidate for each of
  the first ``batch`` (about 1/8 of the entries) not yet accepted: 3 random
  words each, inversion (``mu < 10``, accepted at once) or PTRS
  (``mu >= 10``, accepted ~87% of the time), chosen by ``jax.lax.cond`` on
  ``mu`` (under ``vmap`` over ``mu`` both run, each on a safe rate). In
  all ~1.15 candidates per entry (~1.35 near rate 10), over ~9 rounds plus
  a few for the stragglers, instead of redrawing every entry each round
  until the last is accepted (~8 full rounds for 1e6 entries).
  """
  size = math.prod(shape)
  batch = min(size, max(64, -(-size // 8)))
  small = mu < _PTRS_MIN_RATE
  mu_small = jnp.where(small, mu, 0.0)
  c = _ptrs_constants(jnp.where(small, _PTRS_MIN_RATE, mu))

  def cond(state):
    return ~jnp.all(state[1])

  def body(state):
    key, done, t = state
    key, sub = jax.random.split(key)
    bits = _random_words(sub, 3, (batch,))
    cand, ok = jax.lax.cond(small,
                            lambda b: _inversion_candidates(b, mu_small),
                            lambda b: _ptrs_candidates(b, c), bits)
    # The first `batch` entries still pending (padded with `size`, out of
    # range: dropped by the scatters).
    idx = jnp.nonzero(~done, size=batch, fill_value=size)[0]
    t = t.at[idx].set(jnp.where(ok, cand, jnp.take(t, idx, mode='clip')),
                      mode='drop')
    done = done.at[idx].set(ok, mode='drop')
    return key, done, t

  done = jnp.zeros((size,), jnp.bool_)
  t = jnp.zeros((size,), jnp.int32)
  return jax.lax.while_loop(cond, body, (key, done, t))[2].reshape(shape)


@functools.partial(jax.jit, static_argnums=1)
def _skellam(key, shape, variance):
  valid = (variance >= 0) & (variance <= MAX_SKELLAM_VARIANCE)
  rate = jnp.where(valid, variance / 2.0, jnp.float32(0.0))
  t = _poisson_deviation(key, (2,) + shape, rate)
  return jnp.where(valid, t[0] - t[1], jnp.int32(INVALID_DRAW))


def skellam(key: jax.Array, shape: Shape, variance: Any) -> jax.Array:
  """Symmetric Skellam noise ``P1 - P2``, ``Pi`` i.i.d. Poisson(variance/2).

  The centred deviations of the two Poissons are drawn (inversion below
  rate 10, an exact float32 PTRS above it); the module docstring gives the
  algorithm, its precision and its range.

  Args:
    key: PRNG key (``jax.random.PRNGKey`` or ``jax.random.key``).
    shape: output shape (int or tuple of ints); may have size 0.
    variance: ``Var X`` (integer noise units squared), a Python/NumPy
      number or a float32 scalar (may be traced), in
      ``[0, MAX_SKELLAM_VARIANCE]``, used as float32. ``0`` gives zeros. A
      traced NaN, negative or too large ``variance`` cannot raise: the
      output is then all :data:`INVALID_DRAW`.

  Returns:
    int32 array of ``shape``: i.i.d. draws (integer noise units).

  Raises:
    ValueError: (one line, naming the value) if ``variance`` is not a
      scalar, or is a concrete value that is negative, not finite or above
      :data:`MAX_SKELLAM_VARIANCE`.
  """
  shape = _as_shape(shape)
  _check_scale('skellam', 'variance', variance, MAX_SKELLAM_VARIANCE)
  return _skellam(key, shape, jnp.asarray(variance, jnp.float32))
