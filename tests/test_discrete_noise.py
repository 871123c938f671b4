"""fedlite_jax.privacy.discrete_noise: the discrete Gaussian and Skellam
samplers against their exact pmfs.

Independent expectation: the pmfs computed here in numpy float64 (the
discrete Gaussian normalized over a wide integer range) and by
``scipy.stats.skellam``; chi-square goodness of fit at p = 1e-4 with a fixed
key. Each fit also shows its power: the same draws must be rejected against
the pmf whose variance is 10% larger or smaller.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from fedlite_jax.privacy import discrete_noise
from fedlite_jax.privacy.discrete_noise import discrete_gaussian
from fedlite_jax.privacy.discrete_noise import skellam

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
  obs, exp = [], []
  o = e = 0.0
  for c, x in zip(counts, draws.size * pmf):
    o, e = o + c, e + x
    if e >= min_expected:
      obs.append(o)
      exp.append(e)
      o = e = 0.0
  obs[-1] += o
  exp[-1] += e
  obs, exp = np.array(obs), np.array(exp)
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

@pytest.mark.parametrize('variance', [1.0, 10.0, 300.0, 4000.0])
def test_skellam_fits_the_exact_pmf(variance):
  draws = skellam(jax.random.PRNGKey(12), (_N,), variance)
  half_width = math.ceil(15 * math.sqrt(variance)) + 20
  support = np.arange(-half_width, half_width + 1)
  _fit_and_power(draws, _skellam_pmf, variance, support)


def test_jax_poisson_is_inexact_above_the_rate_limit():
  # Why skellam refuses rates above MAX_POISSON_RATE: at rate 1e6
  # jax.random.poisson (float32) is rejected against the exact pmf (the
  # module's docstring gives the 2e7-draw tests from 5000 up). If this
  # fails, JAX has changed and the limit can be re-verified.
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
  # eager draws.
  key = jax.random.PRNGKey(4)
  scales = np.array([scale, 0.0, np.nan, 4 * scale], np.float32)
  got = np.asarray(jax.jit(jax.vmap(lambda s: sampler(key, _SMALL, s)))(
      jnp.asarray(scales)))
  for i in (0, 3):
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
    (skellam, discrete_noise.MAX_SKELLAM_VARIANCE)])
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
    (skellam, discrete_noise.MAX_SKELLAM_VARIANCE)])
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
      'INVALID_DRAW', 'MAX_POISSON_RATE', 'MAX_SIGMA',
      'MAX_SKELLAM_VARIANCE', 'discrete_gaussian', 'skellam'}
  assert discrete_noise.MAX_SKELLAM_VARIANCE == (
      2 * discrete_noise.MAX_POISSON_RATE)
