"""fedlite_jax.privacy.discrete_noise: the discrete Gaussian and Skellam
samplers against their exact pmfs.

Independent expectation: the pmfs computed here in numpy float64 (the
discrete Gaussian normalized over a wide integer range), by
``scipy.stats.skellam`` and ``scipy.stats.poisson``, and for large Skellam
variances as the convolution of two Poisson pmfs (checked here against
``scipy.stats.skellam``, which is too slow to use at variance 1e9);
chi-square goodness of fit at p = 1e-4 with a fixed key. Each fit also
shows its power: the same draws must be rejected against the pmf whose
variance is 10% larger or smaller. The large-rate Poisson
sampler behind ``skellam`` is also checked piece by piece: its integer part
against exact rational arithmetic, its acceptance bound against float64,
and its hat against the Poisson pmf.
"""

from fractions import Fraction
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import signal
from scipy import stats

from fedlite_jax.privacy import discrete_noise
from fedlite_jax.privacy.discrete_noise import discrete_gaussian
from fedlite_jax.privacy import skellam_noise
from fedlite_jax.privacy.skellam_noise import skellam

_P_VALUE = 1e-4
# One draw size (and one small shape) throughout, so that each sampler
# compiles once per shape: the scale is a traced argument.
_N = 400_000
_SMALL = (4, 16)


def _dgauss_pmf(sigma, support):
  log_w = -support.astype(np.float64) ** 2 / (2 * sigma ** 2)
  w = np.exp(log_w - log_w.max())
  return w / w.sum()


def _skellam_pmf(variance, support):
  return stats.skellam(variance / 2, variance / 2).pmf(support)


def _chi2(draws, support, pmf, min_expected=20.0):
  """Pearson statistic and threshold at ``_P_VALUE``; tails pooled.

  One bin per integer of ``support``; adjacent integers are pooled, from the
  left, until a bin expects ``min_expected`` draws (the last remainder
  joins the last bin).
  """
  assert draws.min() >= support[0] and draws.max() <= support[-1]
  counts = np.bincount(draws - support[0], minlength=support.size)
  cum_exp = np.cumsum(draws.size * pmf)
  ends, start = [], 0.0
  while True:  # the greedy pooling, one bin per step
    j = int(np.searchsorted(cum_exp, start + min_expected))
    if j >= cum_exp.size:
      break
    ends.append(j)
    start = cum_exp[j]
  ends = np.array(ends[:-1] + [support.size - 1])
  exp = np.diff(np.r_[0.0, cum_exp[ends]])
  obs = np.diff(np.r_[0, np.cumsum(counts)[ends]])
  statistic = float(((obs - exp) ** 2 / exp).sum())
  return statistic, float(stats.chi2.isf(_P_VALUE, obs.size - 1))


def _fit_and_power(draws, pmf_of_variance, variance, support):
  """Fits at ``variance``; rejected at ``variance * 1.1`` and ``/ 1.1``."""
  draws = np.asarray(draws).astype(np.int64)
  stat, threshold = _chi2(draws, support, pmf_of_variance(variance, support))
  assert stat < threshold, (variance, stat, threshold)
  for factor in (1.1, 1 / 1.1):
    wrong = pmf_of_variance(variance * factor, support)
    stat_wrong, threshold_wrong = _chi2(draws, support, wrong)
    assert stat_wrong > threshold_wrong, (variance, factor, stat_wrong,
                                          threshold_wrong)


# --- discrete Gaussian --------------------------------------------------------

@pytest.mark.parametrize('sigma', [0.5, 2.0, 7.3, 40.0, 1000.0])
def test_discrete_gaussian_fits_the_exact_pmf(sigma):
  draws = discrete_gaussian(jax.random.PRNGKey(11), (_N,), sigma)
  half_width = math.ceil(15 * sigma) + 10
  support = np.arange(-half_width, half_width + 1)
  _fit_and_power(draws, lambda v, s: _dgauss_pmf(math.sqrt(v), s),
                 sigma ** 2, support)


def test_discrete_gaussian_large_sigma_moments_and_bins():
  sigma, n = 1e5, _N
  x = np.asarray(discrete_gaussian(jax.random.PRNGKey(5), (n,), sigma))
  assert x.dtype == np.int32 and x.shape == (n,)
  x = x.astype(np.float64)
  # The discrete Gaussian's mean is 0 and, at this sigma, its variance
  # sigma^2 (to far below 1e-7 relative); Gaussian standard errors.
  assert abs(x.mean()) < 5 * sigma / math.sqrt(n)
  assert abs(x.var() / sigma ** 2 - 1) < 5 * math.sqrt(2 / (n - 1))
  # No overflow or wrap-around: nothing beyond 6 sigma (P ~ 2e-9 each).
  assert np.abs(x).max() < 6 * sigma
  # 100 equiprobable bins with integer edges; at this sigma
  # P(X <= k) = Phi((k + 1/2) / sigma) to ~1e-11.
  edges = np.unique(np.round(stats.norm.ppf(np.linspace(0, 1, 101)[1:-1])
                             * sigma))
  obs = np.bincount(np.searchsorted(edges, x, side='right'),
                    minlength=edges.size + 1)
  exp = n * np.diff(np.r_[0, stats.norm.cdf((edges - 0.5) / sigma), 1])
  stat = ((obs - exp) ** 2 / exp).sum()
  assert stat < stats.chi2.isf(_P_VALUE, edges.size)


def test_discrete_gaussian_at_max_sigma():
  sigma, n = discrete_noise.MAX_SIGMA, _N
  x = np.asarray(discrete_gaussian(jax.random.PRNGKey(6), (n,), sigma))
  assert x.dtype == np.int32
  x = x.astype(np.float64)
  assert abs(x.mean()) < 5 * sigma / math.sqrt(n)
  assert abs(x.var() / sigma ** 2 - 1) < 5 * math.sqrt(2 / (n - 1))
  assert np.abs(x).max() < 7 * sigma


def test_discrete_gaussian_small_sigma_is_almost_always_zero():
  x = np.asarray(discrete_gaussian(jax.random.PRNGKey(7), (_N,), 0.1))
  # P(|X| >= 1) = 2 exp(-50) / (1 + ...) ~ 4e-22.
  assert not x.any()


# --- Skellam ------------------------------------------------------------------

# Variances 1 and 10 and just below 20 draw by inversion (rate < 10); 20 and
# up by transformed rejection (PTRS).
@pytest.mark.parametrize('variance', [1.0, 10.0, 19.9, 20.0, 300.0, 4000.0])
def test_skellam_fits_the_exact_pmf(variance):
  draws = skellam(jax.random.PRNGKey(12), (_N,), variance)
  half_width = math.ceil(15 * math.sqrt(variance)) + 20
  support = np.arange(-half_width, half_width + 1)
  _fit_and_power(draws, _skellam_pmf, variance, support)


_N_LARGE = 1_000_000


def _skellam_pmf_convolved(variance, support):
  """The pmf of P1 - P2, Pi ~ Poisson(variance / 2), in float64.

  The correlation of scipy's Poisson pmf (normalized over +-12 sd) with
  itself, by FFT (scipy.stats.skellam takes minutes for the ~5e5 integers
  needed at variance 1e9, and scipy.special.ive, exp(-2 mu) I_|x|(2 mu),
  returns NaN from argument ~1.07e9 on).
  """
  mu = variance / 2
  sd = math.sqrt(mu)
  k = np.arange(max(0, math.floor(mu - 12 * sd)), math.ceil(mu + 12 * sd) + 1)
  pmf = stats.poisson(mu).pmf(k)
  pmf /= pmf.sum()
  return np.maximum(signal.fftconvolve(pmf, pmf[::-1])[support + k.size - 1],
                    0.0)


@pytest.mark.parametrize('variance', [1e4, 1e6, 1e9])
def test_skellam_large_variances_fit_the_exact_pmf(variance):
  sd = math.sqrt(variance)
  half_width = math.ceil(8 * sd) + 20
  support = np.arange(-half_width, half_width + 1)
  # The convolution is scipy.stats.skellam's pmf, at a few points.
  points = np.round(np.array([0, 0.5, 1, 2, 3, 5]) * sd).astype(np.int64)
  for v in (variance, variance * 1.1):
    np.testing.assert_allclose(_skellam_pmf_convolved(v, points),
                               stats.skellam(v / 2, v / 2).pmf(points),
                               rtol=1e-7)
  draws = skellam(jax.random.PRNGKey(15), (_N_LARGE,), variance)
  _fit_and_power(draws, _skellam_pmf_convolved, variance, support)


@pytest.mark.parametrize('variance',
                         [1e12, skellam_noise.MAX_SKELLAM_VARIANCE])
def test_skellam_huge_variance_moments(variance):
  n = _N
  x = np.asarray(skellam(jax.random.PRNGKey(14), (n,), variance))
  assert x.dtype == np.int32 and x.shape == (n,)
  assert (x != discrete_noise.INVALID_DRAW).all()
  x = x.astype(np.float64)
  v = float(np.float32(variance))  # the variance as the sampler takes it
  sd = math.sqrt(v)
  # Mean 0 and variance v; standard errors sd / sqrt(n) and, the excess
  # kurtosis 1/v being negligible, v sqrt(2 / (n - 1)).
  assert abs(x.mean()) < 5 * sd / math.sqrt(n)
  assert abs(x.var() / v - 1) < 5 * math.sqrt(2 / (n - 1))
  # No overflow or wrap-around: nothing beyond 7 sd (P ~ 3e-12 each).
  assert np.abs(x).max() < 7 * sd


def test_skellam_variance_limit():
  upper = skellam_noise.MAX_SKELLAM_VARIANCE
  assert upper >= 1e12
  assert upper == 2 * skellam_noise.MAX_POISSON_RATE
  key = jax.random.PRNGKey(0)
  assert skellam(key, _SMALL, upper).dtype == jnp.int32
  bad = upper * 1.001
  with pytest.raises(ValueError, match='variance') as excinfo:
    skellam(key, (3,), bad)
  message = str(excinfo.value)
  assert '\n' not in message
  assert repr(bad) in message and f'{upper:g}' in message


# --- the Poisson deviation behind skellam ------------------------------------

_N_POISSON = 3_000_000
_deviation = jax.jit(skellam_noise._poisson_deviation, static_argnums=1)


@pytest.mark.parametrize('rate', [5e3, 1e7])
def test_poisson_deviation_fits_the_exact_pmf(rate):
  # T = P - floor(rate) against scipy's Poisson pmf shifted by floor(rate),
  # one bin per integer (pooled in the tails). jax.random.poisson fails this
  # kind of test from rate ~4000 up (see test_jax_poisson_is_inexact...).
  rate = float(np.float32(rate))
  m0 = math.floor(rate)
  t = np.asarray(_deviation(jax.random.PRNGKey(13), (_N_POISSON,),
                            jnp.float32(rate)))
  assert t.dtype == np.int32
  t = t.astype(np.int64)
  # +-8 sd, and wide enough for the 2%-off rates below.
  half_width = math.ceil(8 * math.sqrt(rate) + 0.03 * rate) + 20
  support = np.arange(-half_width, half_width + 1)
  stat, threshold = _chi2(t, support, stats.poisson(rate).pmf(m0 + support))
  assert stat < threshold, (rate, stat, threshold)
  # Power: rejected against the rate 2% larger or smaller.
  for factor in (1.02, 1 / 1.02):
    pmf = stats.poisson(rate * factor).pmf(m0 + support)
    stat_wrong, threshold_wrong = _chi2(t, support, pmf)
    assert stat_wrong > threshold_wrong, (rate, factor, stat_wrong)
  # Finer power, with 50 equiprobable bins (which the exact pmf passes
  # too): rejected against the same rates shifted back to the same mean
  # (by the nearest integer), i.e. against a 2% change of the variance
  # alone; and at 5e3 against a rounded normal of the same mean and
  # variance, i.e. the Poisson's skewness 1/sqrt(rate) = 0.014 is seen.
  dist = stats.poisson(rate)
  edges = np.unique(dist.ppf(np.linspace(0, 1, 51)[1:-1]).astype(np.int64))
  obs = np.bincount(np.searchsorted(edges - m0, t, side='right'),
                    minlength=edges.size + 1)
  threshold = stats.chi2.isf(_P_VALUE, edges.size)

  def binned_stat(cdf_below_edges):
    exp = t.size * np.diff(np.r_[0, cdf_below_edges, 1])
    return ((obs - exp) ** 2 / exp).sum()

  assert binned_stat(dist.cdf(edges - 1)) < threshold
  for factor in (1.02, 1 / 1.02):
    shift = round(rate * factor - rate)
    other = stats.poisson(rate * factor).cdf(edges - 1 + shift)
    assert binned_stat(other) > threshold, (rate, factor)
  if rate < 1e4:
    normal = stats.norm.cdf(edges - 0.5, rate, math.sqrt(rate))
    assert binned_stat(normal) > threshold


def _ptrs_hat_log_ratio(rate, margin):
  """max_x log(p(floor(x)) / hat(x)) for PTRS at ``rate``, in float64.

  Hormann's (1993) parameters, rounded to float32 as the sampler computes
  them; the hat (``margin/alpha`` times the proposal density
  ``1 / (b + a/us^2)`` of ``x``) dominates the Poisson histogram iff this
  is <= 0. In the cell ``T <= x - m0 < T + 1``, ``y = |x - m0 - frac -
  0.43| = (0.5 - us)(2a/us + b)`` decreases in ``us``, so the hat is
  smallest at the cell's end farthest from the centre.
  """
  f32 = np.float32
  rate = f32(rate)
  b = f32(0.931) + f32(2.53) * np.sqrt(rate)
  a = f32(-0.059) + f32(0.02483) * b
  inv_alpha = f32(1.1239) + f32(1.1328) / (b - f32(3.4))
  rate, a, b, inv_alpha = float(rate), float(a), float(b), float(inv_alpha)
  m0 = math.floor(rate)
  c0 = rate - m0 + float(f32(0.43))
  sd = math.sqrt(rate)
  t = np.arange(max(-m0, -math.ceil(12 * sd)), math.ceil(12 * sd) + 1)
  y = np.maximum(np.abs(t - c0), np.abs(t + 1 - c0))
  q = y + 2 * a - 0.5 * b  # us solves b us^2 + q us - a = 0
  root = np.sqrt(q * q + 4 * a * b)
  us = np.where(q > 0, 2 * a / (q + root), (root - q) / (2 * b))
  log_p = stats.poisson(rate).logpmf(m0 + t)
  return float(np.max(log_p + np.log(b + a / us ** 2)
                      - math.log(margin * inv_alpha)))


def test_ptrs_hat_dominates_the_poisson_pmf():
  # With the sampler's margin the hat dominates everywhere checked, by
  # 1%; without it, not quite (by up to 0.58% near rate 14, 0.18% near
  # 100), so Hormann's PTRS as published (and jax.random.poisson) draws
  # some values slightly too rarely at those rates.
  margin = skellam_noise._PTRS_HAT_MARGIN
  for rate in (10.0, 11.61, 14.05, 37.3, 103.5, 2040.0, 1e4, 1e9):
    assert _ptrs_hat_log_ratio(rate, margin) < -0.01, rate
  assert _ptrs_hat_log_ratio(14.05, 1.0) > 0.005
  assert _ptrs_hat_log_ratio(103.5, 1.0) > 0.0015


_ptrs_candidates = jax.jit(
    lambda bits, rate: (skellam_noise._ptrs_candidates(
        bits, skellam_noise._ptrs_constants(rate))[0],
                        skellam_noise._ptrs_constants(rate)))


def _exact_ptrs_x(w0, w1, a, b, frac):
  """The candidate's x - floor(rate), exactly (rationals), from two words."""
  sign = 1 if w0 & 1 else -1
  us = Fraction(2 ** 23 * (w0 >> 8) + (w1 >> 9), 2 ** 48) + Fraction(1, 2 ** 49)
  y = (Fraction(1, 2) - us) * (2 * a / us + b)
  return sign * y + frac + Fraction(float(np.float32(0.43)))


@pytest.mark.parametrize('rate', [10.5, 1e7, skellam_noise.MAX_POISSON_RATE])
def test_ptrs_integer_part_is_exact(rate):
  # T = floor(x - floor(rate)) from the double-float arithmetic equals the
  # floor of the exact x for random words and, within 1e-6 of a cell
  # boundary, for words next to the boundaries (solved for in float64).
  rng = np.random.default_rng(int(rate) % 1000)
  words = [rng.integers(0, 2 ** 32, 1500, dtype=np.uint64)
           for _ in range(2)]
  _, c = _ptrs_candidates(jnp.zeros((3, 1), jnp.uint32), jnp.float32(rate))
  a, b, frac = (float(c.a), float(c.b), float(c.frac))
  c0 = frac + float(np.float32(0.43))
  sd = math.sqrt(rate)
  near = ([], [])
  for n in rng.integers(-4 * sd, 4 * sd, 150):
    target = n - c0  # sign * y
    q = abs(target) + 2 * a - 0.5 * b
    root = math.sqrt(q * q + 4 * a * b)
    us = 2 * a / (q + root) if q > 0 else (root - q) / (2 * b)
    for m in int(us * 2 ** 48) + np.arange(-3, 3):
      near[0].append(int(m >> 23) << 8 | int(target > 0))
      near[1].append(int(m & (2 ** 23 - 1)) << 9)
  w0 = np.r_[words[0], near[0]].astype(np.uint32)
  w1 = np.r_[words[1], near[1]].astype(np.uint32)
  bits = np.stack([w0, w1, np.zeros_like(w0)])
  t, _ = _ptrs_candidates(jnp.asarray(bits), jnp.float32(rate))
  t = np.asarray(t)
  a, b, frac = Fraction(a), Fraction(b), Fraction(frac)
  close = 0
  for i in range(w0.size):
    x = _exact_ptrs_x(int(w0[i]), int(w1[i]), a, b, frac)
    if abs(x) >= 2 ** 29:
      continue  # rejected
    distance = min(x - math.floor(x), math.ceil(x) - x)
    close += distance < 1e-4
    if i < 1500 or distance > 1e-6:
      assert t[i] == math.floor(x), (rate, i, float(x), t[i])
  assert close > 300  # the boundary cases do probe the boundaries


_ptrs_log_bound = jax.jit(
    lambda t, us, rate: (skellam_noise._ptrs_log_bound(
        t, us, skellam_noise._ptrs_constants(rate)),
                         skellam_noise._ptrs_constants(rate)))


@pytest.mark.parametrize('rate', [10.7, 37.3, 5000.3, 1e7, 5e13])
def test_ptrs_acceptance_bound_matches_float64(rate):
  # log(p(k) (b + a/us^2) / (margin/alpha)), which log V is compared
  # with, against float64: scipy's log pmf, or at 5e13 (where its
  # k log(rate) - rate - lgamma(k + 1) loses ~1e-2) the closed form
  # -(k log1p(u) - d) - log(2 pi k)/2 - 1/(12k), d = k - rate, u = d/rate.
  rate = float(np.float32(rate))
  m0 = math.floor(rate)
  sd = math.sqrt(rate)
  rng = np.random.default_rng(2)
  t = np.r_[rng.integers(max(-m0, -8 * sd), 8 * sd, 3000), 0, 1, -1,
            -min(m0, 10 ** 6)].astype(np.int32)
  us = rng.uniform(0, 0.5, t.size).astype(np.float32)
  got, c = _ptrs_log_bound(jnp.asarray(t), jnp.asarray(us), jnp.float32(rate))
  got = np.asarray(got, np.float64)
  a, b = float(c.a), float(c.b)
  inv_alpha = float(np.float32(1.1239) + np.float32(1.1328)
                    / (np.float32(b) - np.float32(3.4)))
  k = m0 + t.astype(np.float64)
  if rate < 1e8:
    log_p = stats.poisson(rate).logpmf(k)
  else:
    d = t - (rate - m0)
    log_p = (-(k * np.log1p(d / rate) - d) - 0.5 * np.log(2 * np.pi * k)
             - 1 / (12 * k))
  ref = (log_p + np.log(b + a / us.astype(np.float64) ** 2)
         - math.log(skellam_noise._PTRS_HAT_MARGIN * inv_alpha))
  relevant = ref > -30  # log V >= -22.9
  np.testing.assert_allclose(got[relevant], ref[relevant], rtol=0, atol=2e-5)


def test_jax_poisson_is_inexact_at_large_rates():
  # Why skellam does not use jax.random.poisson: at rate 1e6 it (float32,
  # log-pmf as k log(rate) - rate - lgamma(k + 1)) is rejected against the
  # exact pmf (with 2e7 draws from rate ~4000 on: p = 2e-4 at 5000, 2e-33
  # at 1e4, where skellam's sampler gives p = 0.05-0.9). If this fails, JAX
  # has changed.
  rate, n = 1e6, _N
  x = np.asarray(jax.random.poisson(jax.random.PRNGKey(3), rate, (n,)))
  assert x.dtype == np.int32
  dist = stats.poisson(rate)
  edges = np.unique(dist.ppf(np.linspace(0, 1, 201)[1:-1]).astype(np.int64))
  obs = np.bincount(np.searchsorted(edges, x, side='right'),
                    minlength=edges.size + 1)
  exp = n * np.diff(np.r_[0, dist.cdf(edges - 1), 1])
  stat = ((obs - exp) ** 2 / exp).sum()
  assert stat > stats.chi2.isf(_P_VALUE, edges.size)


# --- shared contract ----------------------------------------------------------

_SAMPLERS = [(discrete_gaussian, 30.0), (skellam, 900.0)]
# Jitted once per sampler, the scale traced: reused across tests.
_JITTED = {f: jax.jit(f, static_argnums=1)
           for f in (discrete_gaussian, skellam)}


@pytest.mark.parametrize('sampler,scale', _SAMPLERS)
def test_deterministic_int32_and_shape(sampler, scale):
  key = jax.random.PRNGKey(0)
  a = sampler(key, _SMALL, scale)
  assert a.dtype == jnp.int32 and a.shape == _SMALL
  np.testing.assert_array_equal(a, sampler(key, _SMALL, scale))
  assert not np.array_equal(a, sampler(jax.random.PRNGKey(1), _SMALL, scale))
  assert np.unique(a).size > 10  # noise, not a constant


def test_discrete_gaussian_scalar_empty_int_shapes_and_typed_keys():
  # The rejection loop ends at once on an empty array; a scalar is one entry.
  key = jax.random.PRNGKey(0)
  assert discrete_gaussian(key, (0, 4), 3.0).shape == (0, 4)
  scalar = discrete_gaussian(key, (), 3.0)
  assert scalar.shape == () and scalar.dtype == jnp.int32
  # An int shape, and a new-style typed key (jax.random.key).
  typed = discrete_gaussian(jax.random.key(0), 5, 3.0)
  assert typed.dtype == jnp.int32 and typed.shape == (5,)


@pytest.mark.parametrize('sampler,scale', _SAMPLERS)
def test_jit_and_vmap_over_keys_match_eager(sampler, scale):
  keys = jax.random.split(jax.random.PRNGKey(2), 4)
  eager = np.stack([sampler(k, _SMALL, scale) for k in keys])
  np.testing.assert_array_equal(
      np.stack([_JITTED[sampler](k, _SMALL, scale) for k in keys]), eager)
  # vmap over keys (the rejection loop runs until every key's draw is done;
  # the others keep theirs), inside jit with a traced scale: one compile;
  # vmap batches the same way without jit.
  batched = jax.jit(jax.vmap(lambda k, s: sampler(k, _SMALL, s),
                             in_axes=(0, None)))
  np.testing.assert_array_equal(batched(keys, jnp.float32(scale)), eager)


@pytest.mark.parametrize('sampler,scale', _SAMPLERS)
def test_vmap_over_the_scale(sampler, scale):
  # A batch of scales with a zero and a NaN member: the zero gives zeros,
  # the NaN INVALID_DRAW (and the batched loop still ends), the rest match
  # eager draws (for skellam, 3.0 draws by inversion, the others by PTRS).
  key = jax.random.PRNGKey(4)
  scales = np.array([scale, 0.0, np.nan, 4 * scale, 3.0], np.float32)
  got = np.asarray(jax.jit(jax.vmap(lambda s: sampler(key, _SMALL, s)))(
      jnp.asarray(scales)))
  for i in (0, 3, 4):
    np.testing.assert_array_equal(got[i], sampler(key, _SMALL, scales[i]))
  assert not got[1].any()
  assert (got[2] == discrete_noise.INVALID_DRAW).all()


@pytest.mark.parametrize('sampler', [discrete_gaussian, skellam])
def test_zero_scale_gives_zeros(sampler):
  key = jax.random.PRNGKey(8)
  for zero in (0, 0.0, np.float32(0), jnp.float32(0)):
    out = sampler(key, _SMALL, zero)
    assert out.dtype == jnp.int32 and not out.any()
  assert not _JITTED[sampler](key, _SMALL, jnp.float32(0)).any()


@pytest.mark.parametrize('sampler,upper', [
    (discrete_gaussian, discrete_noise.MAX_SIGMA),
    (skellam, skellam_noise.MAX_SKELLAM_VARIANCE)])
@pytest.mark.parametrize('bad,shown', [
    (-1.0, '-1.0'), (-1e-3, '-0.001'), (float('nan'), 'nan'),
    (float('inf'), 'inf'), (np.float32(-2), '-2'), ('huge', None)])
def test_bad_python_scales_raise_one_line(sampler, upper, bad, shown):
  if bad == 'huge':
    bad, shown = 2.5 * upper, repr(2.5 * upper)
  name = 'sigma' if sampler is discrete_gaussian else 'variance'
  with pytest.raises(ValueError, match=name) as excinfo:
    sampler(jax.random.PRNGKey(0), (3,), bad)
  message = str(excinfo.value)
  assert '\n' not in message
  assert shown in message and f'{upper:g}' in message


@pytest.mark.parametrize('sampler', [discrete_gaussian, skellam])
def test_non_scalar_scale_raises(sampler):
  with pytest.raises(ValueError, match=r'scalar; got shape \(2,\)'):
    sampler(jax.random.PRNGKey(0), (3,), jnp.ones(2))


@pytest.mark.parametrize('sampler,upper', [
    (discrete_gaussian, discrete_noise.MAX_SIGMA),
    (skellam, skellam_noise.MAX_SKELLAM_VARIANCE)])
def test_bad_traced_scales_give_the_invalid_marker(sampler, upper):
  # Under jit nothing can raise; the draw terminates (no endless rejection
  # loop on NaN) and every entry is INVALID_DRAW, which valid draws never
  # take.
  key = jax.random.PRNGKey(0)
  for bad in (-1.0, float('nan'), float('inf'), 2 * upper):
    np.testing.assert_array_equal(
        _JITTED[sampler](key, _SMALL, jnp.float32(bad)),
        np.full(_SMALL, discrete_noise.INVALID_DRAW))
  assert (np.asarray(_JITTED[sampler](key, _SMALL, jnp.float32(upper)))
          != discrete_noise.INVALID_DRAW).all()


def test_public_names():
  assert set(discrete_noise.__all__) == {
      'INVALID_DRAW', 'MAX_SIGMA', 'discrete_gaussian'}
  assert set(skellam_noise.__all__) == {
      'MAX_POISSON_RATE', 'MAX_SKELLAM_VARIANCE', 'skellam'}
  assert skellam_noise.MAX_SKELLAM_VARIANCE == (
      2 * skellam_noise.MAX_POISSON_RATE)
