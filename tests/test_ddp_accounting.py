"""fedlite_jax.privacy.ddp_accounting against independent expectations.

The expectations are the papers' formulas written out again here, plainly
(loops over orders, ``math.comb``, the ``tau`` sum as a loop, Skellam in
the SCALED domain where the module uses the unscaled form), exact Renyi
divergences of the discrete noise summed numerically, and
``dp_accounting``'s own subsampled Gaussian. Sources: Kairouz, Liu &
Steinke 2021 [KLS21]; Agarwal, Kairouz & Liu 2021 [AKL21]; Zhu & Wang 2019
[ZW19] Thm. 5.
"""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import special
from scipy import stats

from fedlite_jax.privacy import ddp_accounting as ddp

ORDERS = tuple(range(2, 129)) + (256,)
RDP = dp_accounting.rdp.rdp_privacy_accountant


def _one_line(excinfo):
  assert '\n' not in str(excinfo.value)


# --- the formulas, written out ----------------------------------------------

def _rounded_l2(c, beta, d):
  """[KLS21] Thm. 1 / Prop. 22, scaled domain."""
  plain = c + math.sqrt(d)
  if beta == 0:
    return plain
  return min(plain, math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(
      1 / beta)) * (c + math.sqrt(d) / 2)))


def _tau(s, n):
  """[KLS21] Thm. 1, as a loop."""
  total = 0.0
  for k in range(1, n):
    total += math.exp(-2 * math.pi**2 * s * s * k / (k + 1))
  return 10 * total


def _ddgauss_rdp(a, l2, l1, std, tau, d):
  """[KLS21] Prop. 14 / Eq. 17."""
  x2, x1 = l2 / std, l1 / std
  return min(a / 2 * x2 * x2 + tau * d,
             a / 2 * (x2 * x2 + 2 * x1 * tau + tau * tau * d),
             a / 2 * (x2 + math.sqrt(d) * tau)**2)


def _skellam_rdp_scaled(a, l2, l1, var):
  """[AKL21] multi-dimensional Skellam: integer sensitivities, variance."""
  return (a * l2 * l2 / (2 * var)
          + min(((2 * a - 1) * l2 * l2 + 6 * l1) / (4 * var * var),
                3 * l1 / (2 * var)))


def _log_sum(logs, coefs):
  top = max(logs)
  return top + math.log(sum(c * math.exp(t - top)
                            for c, t in zip(coefs, logs)))


def _zhu_wang(a, q, eps):
  """[ZW19] Thm. 5 (coefficient 1 at l = 2, 3 from l = 3), min with eps."""
  logs = [(a - 1) * math.log(1 - q) + math.log(a * q - q + 1)]
  coefs = [1.0]
  for l in range(2, a + 1):
    logs.append(math.log(math.comb(a, l)) + l * math.log(q)
                + (a - l) * math.log(1 - q) + (l - 1) * eps(l))
    coefs.append(1.0 if l == 2 else 3.0)
  return min(eps(a), _log_sum(logs, coefs) / (a - 1))


def _epsilon(rdps, delta):
  """dp_accounting's conversion, written out: (epsilon, order)."""
  best, best_order = math.inf, None
  for a, r in zip(ORDERS, rdps):
    assert delta**2 + math.expm1(-r) <= 0  # dp_accounting's KL branch unused
    e = r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
    if e < best:
      best, best_order = e, a
  return max(0.0, best), best_order


def _expected(mech, n, d, sigma, gamma, q, rounds, delta, clip, beta):
  """Epsilon and order from the formulas above."""
  l2_s = _rounded_l2(clip / gamma, beta, d)
  l1_s = l2_s * min(math.sqrt(d), l2_s)
  if mech == 'ddgauss':
    tau = _tau(sigma / gamma, n)
    std = math.sqrt(n) * sigma / gamma  # central std, scaled domain
    table = {a: _ddgauss_rdp(a, l2_s, l1_s, std, tau, d)
             for a in range(2, 257)}
  else:
    var = n * (sigma / gamma)**2  # summed Skellam variance, scaled domain
    table = {a: _skellam_rdp_scaled(a, l2_s, l1_s, var) for a in range(2, 257)}
  if q == 1:
    rdps = [table[a] for a in ORDERS]
  else:
    rdps = [_zhu_wang(a, q, table.__getitem__) for a in ORDERS]
  return _epsilon([r * rounds for r in rdps], delta)


def _gaussian_epsilon(z, q, rounds, delta):
  """dp_accounting's RDP accountant, the same integer orders."""
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
      rounds)
  acc = dp_accounting.rdp.RdpAccountant(orders=list(ORDERS))
  return acc.compose(event).get_epsilon(delta)


def test_written_out_conversion_equals_dp_accounting_on_a_gaussian():
  z, q, rounds, delta = 1.1, 0.01, 100, 1e-5
  rdp = RDP._compute_rdp_poisson_subsampled_gaussian(q, z, ORDERS) * rounds
  eps, order = _epsilon(list(rdp), delta)
  want = _gaussian_epsilon(z, q, rounds, delta)
  assert eps == pytest.approx(want, rel=1e-12)
  assert RDP.compute_epsilon(ORDERS, list(rdp), delta) == (
      pytest.approx(eps, rel=1e-12), order)


# (n, d, sigma, gamma, q, T, clip, beta): gamma small (C/gamma >> sqrt(d))
# and large (rounding inflates the sensitivity; sigma/gamma near 1, where
# tau matters), q = 1 and q < 1, T in {1, 100}.
CASES = [
    (10, 2**10, 0.3, 1e-4, 1.0, 1, 1.0, 0.0),
    (10, 2**10, 0.3, 1e-4, 0.01, 100, 1.0, 0.0),
    (10, 2**16, 0.3, 1e-2, 0.05, 1, 1.0, math.exp(-0.5)),
    (100, 2**10, 0.009, 0.01, 1.0, 1, 0.05, math.exp(-0.5)),
    (100, 2**10, 0.009, 0.01, 0.02, 100, 0.05, math.exp(-0.5)),
    (100, 2**16, 0.1, 1e-3, 0.01, 100, 1.0, math.exp(-0.5)),
    (100, 2**16, 0.1, 2e-4, 1.0, 1, 1.0, 0.0),
    (10, 2**16, 0.5, 0.002, 0.01, 1, 1.0, 0.0),
]


@pytest.mark.parametrize('mech', ddp.MECHANISMS)
@pytest.mark.parametrize('case', CASES)
def test_epsilon_equals_the_papers_formulas(mech, case):
  n, d, sigma, gamma, q, rounds, clip, beta = case
  got = ddp.distributed_epsilon(mech, gamma, sigma, n, clip, beta, d, q,
                                rounds, 1e-5)
  eps, order = _expected(mech, n, d, sigma, gamma, q, rounds, 1e-5, clip,
                         beta)
  assert got.epsilon == pytest.approx(eps, rel=1e-9)
  assert got.order == order
  scaled = _rounded_l2(clip / gamma, beta, d)
  assert got.scaled_l2_sensitivity == pytest.approx(scaled, rel=1e-12)
  assert got.l2_sensitivity == pytest.approx(gamma * scaled, rel=1e-12)
  assert got.l1_sensitivity == pytest.approx(
      gamma * scaled * min(math.sqrt(d), scaled), rel=1e-12)
  assert got.central_std == pytest.approx(math.sqrt(n) * sigma, rel=1e-12)
  want_tau = _tau(sigma / gamma, n) if mech == 'ddgauss' else 0.0
  assert got.tau == pytest.approx(want_tau, rel=1e-12, abs=1e-300)
  fn = ddp.ddgauss_epsilon if mech == 'ddgauss' else ddp.skellam_epsilon
  assert fn(gamma, sigma, n, clip, beta, d, q, rounds, 1e-5) == got


def test_the_table_exercises_tau():
  """At least one DDGauss row's epsilon moves when tau is dropped."""
  n, d, sigma, gamma, q, rounds, clip, beta = CASES[3]
  got = ddp.ddgauss_epsilon(gamma, sigma, n, clip, beta, d, q, rounds, 1e-5)
  assert got.tau > 1e-3 and rounds == 1 and q == 1
  no_tau = [ddp.ddgauss_rdp(a, got.l2_sensitivity, got.l1_sensitivity,
                            got.central_std, 0.0, d) * rounds for a in ORDERS]
  assert RDP.compute_epsilon(ORDERS, no_tau, 1e-5)[0] < 0.99 * got.epsilon


# Pinned: printed once with repr() from distributed_epsilon at this module's
# first commit (each equal to _expected above to 2e-15): a later change of
# formula shows up here even if the written-out copy changes with it.
@pytest.mark.parametrize('mech,case,want', [
    ('ddgauss', CASES[1], 1.591674479868366),
    ('skellam', CASES[4], 11.916633847356987),
    ('ddgauss', CASES[5], 1.3679523140001555),
])
def test_pinned_values(mech, case, want):
  n, d, sigma, gamma, q, rounds, clip, beta = case
  got = ddp.distributed_epsilon(mech, gamma, sigma, n, clip, beta, d, q,
                                rounds, 1e-5)
  assert got.epsilon == pytest.approx(want, rel=1e-9)


# --- the continuous Gaussian limit -------------------------------------------

def _fine(mech, z, q, rounds, delta=1e-5, n=100, d=2**10):
  """Local std z/sqrt(n) with gamma = 1e-7: sigma/gamma = 1e6 (tau = 0) and
  rounding adds gamma sqrt(d) = 3.2e-6 to C = 1."""
  return ddp.distributed_epsilon(mech, 1e-7, z / math.sqrt(n), n, 1.0, 0.0, d,
                                 q, rounds, delta).epsilon


@pytest.mark.parametrize('mech', ddp.MECHANISMS)
@pytest.mark.parametrize('z,q,rounds', [
    (1.0, 1.0, 1), (0.8, 1.0, 100), (1.0, 0.001, 1000), (0.8, 0.001, 1000)])
def test_large_noise_and_a_fine_grid_approach_the_gaussian(mech, z, q,
                                                           rounds):
  gauss = _gaussian_epsilon(z, q, rounds, 1e-5)
  assert gauss <= _fine(mech, z, q, rounds) <= 1.01 * gauss


@pytest.mark.parametrize('mech', ddp.MECHANISMS)
def test_at_larger_q_the_gap_to_the_gaussian_is_the_sampling_bound(mech):
  """At q = 0.01 the limit is [ZW19] Thm. 5 applied to the Gaussian's
  a/(2 z^2) (about 10% above dp_accounting's exact subsampled Gaussian
  here: Thm. 5 triples the l >= 3 terms); discretization adds nothing."""
  z, q, rounds = 1.0, 0.01, 100
  thm5 = [_zhu_wang(a, q, lambda l: l / (2 * z * z)) * rounds for a in ORDERS]
  want = _epsilon(thm5, 1e-5)[0]
  assert want <= _fine(mech, z, q, rounds) <= want * (1 + 1e-4)
  assert want >= _gaussian_epsilon(z, q, rounds, 1e-5)


# --- the RDP bounds against exact Renyi divergences ---------------------------

def _renyi(log_p, log_q, a):
  """D_a(P || Q) of two pmfs on one grid (log masses; -inf tails dropped)."""
  ok = np.isfinite(log_p) & np.isfinite(log_q)
  return special.logsumexp(a * log_p[ok] + (1 - a) * log_q[ok]) / (a - 1)


@pytest.mark.parametrize('var', [2.0, 20.0, 100.0])
def test_skellam_bound_holds_against_the_exact_divergence(var):
  x = np.arange(-600, 601)
  skellam = lambda c: stats.skellam.logpmf(x - c, var / 2, var / 2)
  for shift in ((1,), (3,), (1, 2)):  # product noise: divergences add
    l1, l2 = sum(shift), math.sqrt(sum(s * s for s in shift))
    for a in (2, 8, 32, 128):
      exact = sum(_renyi(skellam(s), skellam(0), a) for s in shift)
      assert exact <= ddp.skellam_rdp(a, l2, l1, var, 1.0)
      # The unscaled form at s = 7 is the scaled one.
      assert ddp.skellam_rdp(a, l2 / 7, l1 / 7, var / 49, 7.0) == (
          pytest.approx(_skellam_rdp_scaled(a, l2, l1, var), rel=1e-12))
  if var == 100.0:  # tight where the Gaussian term leads
    assert ddp.skellam_rdp(2, 1.0, 1.0, var, 1.0) <= 1.05 * _renyi(
        skellam(1), skellam(0), 2)


@pytest.mark.parametrize('sigma', [0.3, 0.5, 0.8, 1.5])
def test_ddgauss_bound_holds_for_a_sum_of_two_discrete_gaussians(sigma):
  x = np.arange(-200, 201)
  log_p = -x**2 / (2 * sigma**2)
  p = np.exp(log_p - special.logsumexp(log_p))
  with np.errstate(divide='ignore'):
    log_sum = np.log(np.convolve(p, p))  # the pmf of X1 + X2 on -400..400
  tau = ddp.ddgauss_tau(sigma, 2)
  assert tau == pytest.approx(10 * math.exp(-math.pi**2 * sigma**2), rel=1e-12)
  worst = 0.0
  for shift in (1, 2):
    for a in (2, 8, 32):
      exact = _renyi(log_sum[:-shift], log_sum[shift:], a)
      std = math.sqrt(2) * sigma
      assert exact <= ddp.ddgauss_rdp(a, shift, shift, std, tau, 1) * (
          1 + 1e-9)
      worst = max(worst, exact / (a * shift**2 / (2 * std**2)))
  if sigma == 0.3:  # the sum is no discrete Gaussian: tau is needed
    assert worst > 1.05


# --- Poisson subsampling ------------------------------------------------------

@pytest.mark.parametrize('z', [0.7, 1.0, 2.0, 5.0])
@pytest.mark.parametrize('q', [0.001, 0.01, 0.1, 0.9])
def test_thm5_brackets_dp_accountings_exact_subsampled_gaussian(z, q):
  gaussian = lambda a: a / (2 * z * z)
  exact = RDP._compute_rdp_poisson_subsampled_gaussian(q, z, ORDERS)
  bound = ddp.poisson_subsampled_rdp(ORDERS, q, gaussian)
  # Thm. 5 is the exact binomial sum with its l >= 3 terms tripled.
  assert np.all(bound >= exact * (1 - 1e-12))
  assert np.all(bound <= exact + math.log(3) / (np.array(ORDERS) - 1) + 1e-12)
  np.testing.assert_allclose(
      bound, [_zhu_wang(a, q, gaussian) for a in ORDERS], rtol=1e-9,
      atol=1e-15)
  # Scalar and vector evaluations may differ in the last bits (SIMD log/exp).
  assert ddp.poisson_subsampled_rdp(17, q, gaussian) == pytest.approx(
      bound[15], rel=1e-12)
  if q == 0.9:  # the minimum with the unamplified RDP binds somewhere
    assert np.any(bound == gaussian(np.array(ORDERS)))
  assert ddp.poisson_subsampled_rdp(5, 1.0, gaussian) == gaussian(5)


# --- bounds, scale, parameters ------------------------------------------------

def test_rounded_bounds_by_hand():
  # c = 3, d = 16: plain 3 + 4 = 7. beta = e^-2: sqrt(2 log(1/beta)) = 2,
  # sqrt(9 + 16/4 + 2 (3 + 2)) = sqrt(23) < 7.
  assert ddp.rounded_l2_norm_bound(3.0, 0.0, 16) == 7.0
  assert ddp.rounded_l2_norm_bound(3.0, math.exp(-2), 16) == pytest.approx(
      math.sqrt(23), rel=1e-12)
  # beta = e^-200: 20 instead of 2, sqrt(9 + 4 + 100) > 7: the plain one.
  assert ddp.rounded_l2_norm_bound(3.0, math.exp(-200), 16) == 7.0
  assert ddp.rounded_l1_norm_bound(7.0, 16) == 28.0  # 7 min(4, 7)
  assert ddp.rounded_l1_norm_bound(2.0, 16) == 4.0  # 2 min(4, 2)
  # beta = 0 through the epsilon: C/gamma + sqrt(d) = 100 + 8.
  got = ddp.ddgauss_epsilon(0.01, 0.1, 10, 1.0, 0.0, 64, 1.0, 1, 1e-5)
  assert got.scaled_l2_sensitivity == 108.0
  assert got.l2_sensitivity == pytest.approx(1.08, rel=1e-12)
  assert got.scaled_l1_sensitivity == 108.0 * 8


@pytest.mark.parametrize('sigma,clip,bits,n,d,k,rho', [
    (0.01, 1.0, 16, 100, 2**16, 4, 1.0), (0.3, 0.5, 12, 10, 2**10, 3, 1.0),
    (0.0, 2.0, 20, 1000, 2**20, 4, 2.0), (1e-4, 0.1, 8, 50, 2**8, 3.5, 1.0)])
def test_scale_factor_solves_the_modular_range_equation(sigma, clip, bits, n,
                                                        d, k, rho):
  gamma = 1 / ddp.scale_factor(sigma, clip, bits, n, d, k, rho)
  rhs = 2 * k * math.sqrt(rho / d * clip**2 * n**2
                          + (gamma**2 / 4 + sigma**2) * n) / gamma
  assert rhs == pytest.approx(2.0**bits, rel=1e-9)


def test_too_few_bits_names_the_smallest_that_fits():
  # n k^2 = 800 * 16 = 12800: 4^6 = 4096 <= 12800 < 4^7 = 16384.
  with pytest.raises(ValueError, match=r'bits=6 .*800 clients.*k=4 .*B=7') as e:
    ddp.scale_factor(0.01, 1.0, 6, 800, 2**16, 4)
  _one_line(e)
  assert ddp.min_bits(800, 4) == 7
  assert ddp.scale_factor(0.01, 1.0, 7, 800, 2**16, 4) > 0
  # n k^2 = 16 * 16 = 4^4 exactly leaves no room for gamma: B = 5.
  assert ddp.min_bits(16, 4) == 5
  with pytest.raises(ValueError, match='B=5'):
    ddp.scale_factor(0.01, 1.0, 4, 16, 2**10, 4)


@pytest.mark.parametrize('mech', ddp.MECHANISMS)
def test_distributed_params(mech):
  z, clip, bits, n, d, beta = 1.2, 0.5, 14, 64, 2**12, math.exp(-0.5)
  p = ddp.distributed_params(mech, z, clip, bits, n, d, beta)
  assert p.k == {'ddgauss': 4, 'skellam': 3}[mech] == ddp.DEFAULT_K[mech]
  assert p.central_std == pytest.approx(z * clip, rel=1e-15)
  assert p.local_std == pytest.approx(z * clip / 8, rel=1e-15)
  assert p.gamma == pytest.approx(
      1 / ddp.scale_factor(z * clip / 8, clip, bits, n, d, p.k), rel=1e-15)
  assert p.scaled_local_std == pytest.approx(p.local_std / p.gamma, rel=1e-15)
  assert p.scaled_l2_bound == pytest.approx(
      _rounded_l2(clip / p.gamma, beta, d), rel=1e-12)
  assert ddp.distributed_params(mech, z, clip, bits, n, d, beta, k=2).k == 2


# --- calibration --------------------------------------------------------------

CAL = dict(delta=1e-5, clip=1.0, n=100, dim=2**16, beta=math.exp(-0.5),
           q=0.01, rounds=100)


@pytest.mark.parametrize('mech', ddp.MECHANISMS)
@pytest.mark.parametrize('bits,q,rounds,beta', [
    (10, 0.01, 100, math.exp(-0.5)), (16, 1.0, 1, 0.0)])
def test_epsilon_is_non_increasing_in_z(mech, bits, q, rounds, beta):
  eps = []
  for z in np.geomspace(0.05, 100, 50):
    p = ddp.distributed_params(mech, float(z), 1.0, bits, 100, 2**16, beta)
    eps.append(ddp.distributed_epsilon(mech, p.gamma, p.local_std, 100, 1.0,
                                       beta, 2**16, q, rounds, 1e-5).epsilon)
  assert all(b <= a * (1 + 1e-12) for a, b in zip(eps, eps[1:]))
  assert eps[-1] < eps[0]


@pytest.mark.parametrize('mech', ddp.MECHANISMS)
def test_calibration_lands_within_one_percent_below_the_target(mech):
  small = ddp.calibrate_distributed_noise(mech, 1.0, bits=16, **CAL)
  assert 0.99 <= small.epsilon <= 1.0
  p = ddp.distributed_params(mech, small.noise_multiplier, 1.0, 16, 100,
                             2**16, CAL['beta'])
  assert p == small.params
  again = ddp.distributed_epsilon(mech, p.gamma, p.local_std, 100, 1.0,
                                  CAL['beta'], 2**16, 0.01, 100, 1e-5)
  assert again.epsilon == small.epsilon
  large = ddp.calibrate_distributed_noise(mech, 4.0, bits=16, **CAL)
  assert 0.99 * 4.0 <= large.epsilon <= 4.0
  assert large.noise_multiplier < small.noise_multiplier


def test_an_unreachable_target_is_refused_in_one_line():
  # At bits=10 the scaled noise saturates: epsilon has a floor above 0.1.
  with pytest.raises(ValueError, match='unreachable.*bits=10') as e:
    ddp.calibrate_distributed_noise('skellam', 0.1, bits=10, **CAL)
  _one_line(e)
  with pytest.raises(ValueError, match='B=6') as e:  # 4^5 <= 100 * 16 < 4^6
    ddp.calibrate_distributed_noise('ddgauss', 1.0, bits=4, **CAL)
  _one_line(e)


S = dict(n=10, clip=1.0, beta=0.0, dim=16, q=1.0, rounds=1, delta=1e-5)


@pytest.mark.parametrize('call,match', [
    (lambda: ddp.rounded_l2_norm_bound(1.0, 1.0, 16), r'beta .*\[0, 1\)'),
    (lambda: ddp.rounded_l2_norm_bound(-1.0, 0.0, 16), 'scaled_l2'),
    (lambda: ddp.rounded_l1_norm_bound(1.0, 0), 'dim'),
    (lambda: ddp.ddgauss_tau(0.0, 10), 'scaled_local_std'),
    (lambda: ddp.ddgauss_rdp(2, 1.0, 1.0, 0.0, 0.0, 4), 'central_std'),
    (lambda: ddp.skellam_rdp(2, 1.0, 1.0, 1.0, 0.0), 'scale'),
    (lambda: ddp.poisson_subsampled_rdp(2.5, 0.1, abs), 'integers >= 2'),
    (lambda: ddp.poisson_subsampled_rdp([1, 2], 0.1, abs), 'integers >= 2'),
    (lambda: ddp.poisson_subsampled_rdp(2, 0.0, abs), r'q .*\(0, 1\]'),
    (lambda: ddp.distributed_epsilon('gauss', 0.1, 0.1, **S), 'mechanism'),
    (lambda: ddp.ddgauss_epsilon(0.0, 0.1, **S), 'gamma'),
    (lambda: ddp.skellam_epsilon(0.1, -1.0, **S), 'local_std'),
    (lambda: ddp.ddgauss_epsilon(0.1, 0.1, **{**S, 'rounds': 0}), 'rounds'),
    (lambda: ddp.skellam_epsilon(0.1, 0.1, **{**S, 'delta': 1.0}), 'delta'),
    (lambda: ddp.ddgauss_epsilon(0.1, 0.1, **{**S, 'n': 2.5}), 'n must'),
    (lambda: ddp.scale_factor(0.1, 1.0, 65, 10, 16, 3), r'bits .*\[1, 64\]'),
    (lambda: ddp.min_bits(10, 0), 'k must'),
    (lambda: ddp.distributed_params('ddgauss', 0.0, 1.0, 16, 10, 16, 0.0),
     'noise_multiplier'),
    (lambda: ddp.calibrate_distributed_noise('ddgauss', 0.0, bits=16, **CAL),
     'target_epsilon'),
])
def test_bad_inputs_raise_one_line(call, match):
  with pytest.raises(ValueError, match=match) as e:
    call()
  _one_line(e)
