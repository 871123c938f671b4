"""Accounting and parameter choice for distributed DP under secure aggregation.

[KLS21] Kairouz, Liu & Steinke, ICML 2021, "The Distributed Discrete Gaussian
Mechanism for Federated Learning with Secure Aggregation" (arXiv:2102.06387);
[AKL21] Agarwal, Kairouz & Liu, NeurIPS 2021, "The Skellam Mechanism for
Differentially Private Federated Learning" (arXiv:2110.04995); [ZW19] Zhu &
Wang, ICML 2019, "Poisson Subsampled Renyi Differential Privacy". A client
clips to L2 norm ``C``, pads to ``d = 2^m``, rotates, scales by ``1/gamma``,
rounds (``beta``), adds integer noise (``'ddgauss'``: discrete Gaussian of
std ``sigma/gamma``; ``'skellam'``: variance ``(sigma/gamma)^2``), reduces
mod ``2^B``; secure aggregation sums ``n`` clients. RDP at integer orders,
Poisson-amplified ([ZW19] Thm. 5), times ``T``, to epsilon by dp_accounting.

Units: UNSCALED (model-parameter units) unless a name says ``scaled`` (the
integer grid). Arguments of these names mean, throughout: ``gamma`` > 0 the
grid step (unscaled units per integer); ``local_std`` ``sigma``, a client's
noise std (central std ``sqrt(n) sigma``, noise multiplier ``z = sqrt(n)
sigma / C``); ``n`` >= 1 clients summed per round; ``clip`` ``C`` > 0;
``beta`` in [0, 1); ``dim`` ``d`` >= 1, the padded dimension; ``q`` in
(0, 1], a client's sampling probability; ``rounds`` ``T`` >= 1; ``delta`` in
(0, 1); ``bits`` ``B`` in [1, 64], the secure sum's bit width; ``k`` > 0
standard deviations of the aggregate kept inside ``2^B``; ``rho`` > 0 the
rotation's flatness ([KLS21] Lemma 29). Counts are ints.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

import dp_accounting
import numpy as np
from scipy import special

__all__ = [
    'Calibration', 'DEFAULT_K', 'DistributedEpsilon', 'DistributedParams',
    'MECHANISMS', 'RDP_ORDERS', 'calibrate_distributed_noise',
    'ddgauss_epsilon', 'ddgauss_rdp', 'ddgauss_tau', 'distributed_epsilon',
    'distributed_params', 'min_bits', 'poisson_subsampled_rdp',
    'rounded_l1_norm_bound', 'rounded_l2_norm_bound', 'scale_factor',
    'skellam_epsilon', 'skellam_rdp',
]

RDP_ORDERS = tuple(range(2, 129)) + (256,)
"""Integer RDP orders (as the papers' code; [ZW19] Thm. 5 needs integers)."""

MECHANISMS = ('ddgauss', 'skellam')

DEFAULT_K = {'ddgauss': 4, 'skellam': 3}
"""Standard deviations of the aggregate kept inside ``2^B`` (papers' code)."""

_Orders = Union[int, Sequence[int], np.ndarray]


class DistributedEpsilon(NamedTuple):
  """Result of :func:`distributed_epsilon`: epsilon and how to recompute it.

  Attributes:
    epsilon: epsilon at ``delta`` after all rounds.
    order: the RDP order that attains it.
    l2_sensitivity, l1_sensitivity: rounded sensitivities, unscaled.
    scaled_l2_sensitivity, scaled_l1_sensitivity: the same over ``gamma``.
    tau: [KLS21] Thm. 1's ``tau`` (0.0 for Skellam, which has none).
    central_std: std of the summed noise, unscaled: ``sqrt(n) sigma``.
  """
  epsilon: float
  order: int
  l2_sensitivity: float
  l1_sensitivity: float
  scaled_l2_sensitivity: float
  scaled_l1_sensitivity: float
  tau: float
  central_std: float


class DistributedParams(NamedTuple):
  """Result of :func:`distributed_params`: what the client pipeline needs.

  Attributes:
    gamma: the grid step (unscaled units per integer).
    local_std: each client's noise std, unscaled: ``z C / sqrt(n)``.
    scaled_local_std: ``local_std / gamma``, the integer noise's std.
    central_std: std of the summed noise, unscaled: ``z C``.
    scaled_l2_bound: the norm conditional rounding enforces ([KLS21] Prop. 22).
    k: standard deviations of the aggregate kept inside ``2^B``.
  """
  gamma: float
  local_std: float
  scaled_local_std: float
  central_std: float
  scaled_l2_bound: float
  k: float


class Calibration(NamedTuple):
  """Result of :func:`calibrate_distributed_noise`.

  Attributes:
    noise_multiplier: ``z``, the central std over ``C``.
    epsilon: its epsilon (<= the target).
    params: :func:`distributed_params` at ``z``.
  """
  noise_multiplier: float
  epsilon: float
  params: DistributedParams


def _require(ok: bool, name: str, allowed: object, value: object) -> None:
  if not ok:
    allowed = f'one of {allowed}' if isinstance(allowed, tuple) else allowed
    raise ValueError(f'{name} must be {allowed}; got {value!r}.')


def _positive(name: str, value: float) -> None:
  _require(value > 0 and math.isfinite(value), name, 'finite and > 0', value)


def _count(name: str, value: int, high: float = math.inf) -> None:
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  _require(ok and 1 <= value <= high, name, f'an int in [1, {high}]', value)


def _int_orders(order: _Orders) -> np.ndarray:
  orders = np.atleast_1d(np.asarray(order))
  _require(orders.size and orders.ndim == 1 and np.all(np.mod(orders, 1) == 0)
           and np.all(orders >= 2), 'orders', 'integers >= 2', order)
  return orders.astype(np.int64)


def _out(order: _Orders, values: np.ndarray) -> Union[float, np.ndarray]:
  return float(values[0]) if np.ndim(order) == 0 else values


def rounded_l2_norm_bound(scaled_l2: float, beta: float, dim: int) -> float:
  """L2 norm bound after randomized rounding to integers (scaled domain).

  [KLS21] Thm. 1 / Prop. 22: rounding norm ``c`` gives <= ``c + sqrt(d)``;
  conditional rounding (redraw until within the second bound; a try passes
  w.p. >= ``1 - beta``) also <= ``sqrt(c^2 + d/4 + sqrt(2 log(1/beta)) (c +
  sqrt(d)/2))``. Returns the smaller; for ``beta = 0`` the first.

  Args:
    scaled_l2: ``c`` >= 0, the norm before rounding (e.g. ``C / gamma``).
    beta, dim: as in the module docstring.

  Raises:
    ValueError: (one line) for a value outside its range.
  """
  _require(scaled_l2 >= 0, 'scaled_l2', '>= 0', scaled_l2)
  _require(0 <= beta < 1, 'beta', 'in [0, 1)', beta)
  _count('dim', dim)
  plain = scaled_l2 + math.sqrt(dim)
  if beta == 0:
    return plain
  return min(plain, math.sqrt(scaled_l2**2 + dim / 4 + math.sqrt(
      2 * math.log(1 / beta)) * (scaled_l2 + math.sqrt(dim) / 2)))


def rounded_l1_norm_bound(rounded_l2: float, dim: int) -> float:
  """L1 bound ``L2 min(sqrt(d), L2)`` of an integer vector (scaled domain):
  ``L1 <= sqrt(d) L2`` (Cauchy-Schwarz) and ``L1 <= L2^2`` (``|x| <= x^2``).

  Raises:
    ValueError: (one line) for ``rounded_l2 < 0`` or ``dim < 1``.
  """
  _require(rounded_l2 >= 0, 'rounded_l2', '>= 0', rounded_l2)
  _count('dim', dim)
  return rounded_l2 * min(math.sqrt(dim), rounded_l2)


def ddgauss_tau(scaled_local_std: float, n: int) -> float:
  """[KLS21] Thm. 1: ``tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k/(k+1))``,
  how far ``n`` discrete Gaussians of std ``s`` (scaled) sum from one.

  Raises:
    ValueError: (one line) for ``scaled_local_std <= 0`` or ``n < 1``.
  """
  _positive('scaled_local_std', scaled_local_std)
  _count('n', n)
  k = np.arange(1, n, dtype=np.float64)
  return float(10 * np.sum(np.exp(-2 * math.pi**2 * scaled_local_std**2
                                  * k / (k + 1))))


def ddgauss_rdp(order: _Orders, l2_sens: float, l1_sens: float,
                central_std: float, tau: float,
                dim: int) -> Union[float, np.ndarray]:
  """RDP of the distributed discrete Gaussian: one round, no sampling.

  [KLS21] Prop. 14 / Eq. 17 with Thm. 1's ``tau``: with ``D2 = l2/s``,
  ``D1 = l1/s`` (``s`` the central std; all in one domain), ``eps(a)`` is
  the least of ``a/2 D2^2 + tau d``, ``a/2 (D2^2 + 2 D1 tau + tau^2 d)``
  and ``a/2 (D2 + sqrt(d) tau)^2``.

  Args:
    order: an order ``a`` > 1 (gives a float), or a 1-d array (an array).
    l2_sens, l1_sens: rounded L2 and L1 sensitivities, >= 0.
    central_std: ``sqrt(n)`` times the local std, > 0.
    tau: :func:`ddgauss_tau` of the SCALED local std, >= 0.
    dim: as in the module docstring.

  Raises:
    ValueError: (one line) for a bad value.
  """
  _positive('central_std', central_std)
  _require(min(l2_sens, l1_sens, tau) >= 0, 'l2_sens, l1_sens, tau', '>= 0',
           (l2_sens, l1_sens, tau))
  _count('dim', dim)
  a = np.atleast_1d(np.asarray(order, dtype=np.float64))
  d2, d1 = l2_sens / central_std, l1_sens / central_std
  return _out(order, np.minimum.reduce([
      a / 2 * d2**2 + tau * dim,
      a / 2 * (d2**2 + 2 * d1 * tau + tau**2 * dim),
      a / 2 * (d2 + math.sqrt(dim) * tau)**2]))


def skellam_rdp(order: _Orders, l2_sens: float, l1_sens: float,
                central_var: float, scale: float) -> Union[float, np.ndarray]:
  """RDP of the distributed Skellam mechanism: one round, no sampling.

  [AKL21] Sec. 3's bound for the multi-dimensional Skellam mechanism
  (integer sensitivities ``D1'``, ``D2'``, noise variance ``V``)::

    a D2'^2/(2V) + min(((2a - 1) D2'^2 + 6 D1') / (4 V^2), 3 D1' / (2V))

  here in the unscaled form of its Sec. 4 and the authors' code (``D' = s
  D``, ``V = s^2 mu``): ``a/(2 mu) D2^2 + min(((2a - 1) s D2^2 + 6 D1) /
  (4 s^3 mu^2), 3 D1 / (2 s mu))``. Code citing the paper numbers these
  Cor. 3.6 and Cor. 4.1 (arXiv v2), unchecked here against its text; the
  tests check the bound against exact Skellam Renyi divergences.

  Args:
    order: as :func:`ddgauss_rdp`.
    l2_sens, l1_sens: ``D2``, ``D1``, rounded sensitivities, UNSCALED.
    central_var: ``mu`` > 0, the summed noise's variance, UNSCALED.
    scale: ``s = 1/gamma`` > 0.

  Raises:
    ValueError: (one line) for a bad value.
  """
  _positive('central_var', central_var)
  _positive('scale', scale)
  _require(min(l2_sens, l1_sens) >= 0, 'l2_sens, l1_sens', '>= 0',
           (l2_sens, l1_sens))
  a = np.atleast_1d(np.asarray(order, dtype=np.float64))
  s, mu = scale, central_var
  return _out(order, a / (2 * mu) * l2_sens**2 + np.minimum(
      ((2 * a - 1) * s * l2_sens**2 + 6 * l1_sens) / (4 * s**3 * mu**2),
      3 * l1_sens / (2 * s * mu)))


def _sampled(orders: np.ndarray, q: float,
             rdp: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
  """[ZW19] Thm. 5 of a vectorized ``rdp`` at ``orders``, min with ``rdp``."""
  if q == 1:
    return rdp(orders)
  top = int(orders.max())
  base = np.concatenate([[np.nan, np.nan], rdp(np.arange(2, top + 1))])
  a = orders[:, None].astype(np.float64)
  l = np.arange(2, top + 1, dtype=np.float64)[None, :]
  inside = l <= a
  a_minus_l = np.where(inside, a - l, 0.0)
  log_comb = (special.gammaln(a + 1) - special.gammaln(l + 1)
              - special.gammaln(a_minus_l + 1))
  terms = np.where(inside, (l - 1) * base[None, 2:] + log_comb
                   + a_minus_l * math.log1p(-q) + l * math.log(q), -np.inf)
  first = (a - 1) * math.log1p(-q) + np.log1p((a - 1) * q)
  weights = np.broadcast_to(np.where(l == 2, 1.0, 3.0), terms.shape)
  log_sum = special.logsumexp(
      np.concatenate([first, terms], axis=1), axis=1,
      b=np.concatenate([np.ones_like(first), weights], axis=1))
  return np.minimum(log_sum / (orders - 1), base[orders])


def poisson_subsampled_rdp(order: _Orders, q: float,
                           rdp_fn: Callable[[int], float]
                           ) -> Union[float, np.ndarray]:
  """RDP of a mechanism run on a Poisson sample: [ZW19] Thm. 5.

  The general upper bound for integer ``a >= 2`` (add-or-remove-one, any
  mechanism with RDP ``eps``, no ``eps(inf)``), as a log-sum-exp::

    1/(a-1) log[ (1-q)^(a-1) (a q - q + 1)
                 + C(a,2) q^2 (1-q)^(a-2) e^eps(2)
                 + 3 sum_{l=3..a} C(a,l) q^l (1-q)^(a-l) e^((l-1) eps(l)) ]

  then the min with the unamplified ``eps(a)`` (``q = 1``: ``eps(a)``). For
  the Gaussian: the exact sum with ``l >= 3`` tripled, <= ``log(3)/(a-1)``
  above it.

  Args:
    order: an integer ``a >= 2`` (gives a float) or a sequence (an array).
    q: the sampling probability, in (0, 1].
    rdp_fn: ``eps``, an int order -> its RDP (called for ``2..max(order)``).

  Raises:
    ValueError: (one line) for an order not an integer >= 2, or bad ``q``.
  """
  _require(0 < q <= 1, 'sampling probability q', 'in (0, 1]', q)
  orders = _int_orders(order)
  rdp = lambda ls: np.array([float(rdp_fn(int(l))) for l in ls])
  return _out(order, _sampled(orders, q, rdp))


def distributed_epsilon(
    mechanism: str, gamma: float, local_std: float, n: int, clip: float,
    beta: float, dim: int, q: float, rounds: int, delta: float,
    orders: Sequence[int] = RDP_ORDERS) -> DistributedEpsilon:
  """:class:`DistributedEpsilon` after ``rounds`` rounds of a mechanism.

  Sensitivity: ``C / gamma`` through :func:`rounded_l2_norm_bound` and
  :func:`rounded_l1_norm_bound`, back by ``* gamma``. Per round:
  :func:`ddgauss_rdp` (``tau`` of ``sigma / gamma``) or :func:`skellam_rdp`
  (``mu = n sigma^2``, ``s = 1/gamma``), through
  :func:`poisson_subsampled_rdp` when ``q < 1``; times ``rounds``. Epsilon:
  ``dp_accounting``'s ``compute_epsilon`` (Canonne et al. 2020, Prop. 12),
  ``max(0, min_a rdp + log((a-1)/a) - (log(delta) + log(a))/(a-1))``.

  Args:
    mechanism: ``'ddgauss'`` or ``'skellam'``.
    gamma, local_std, n, clip, beta, dim, q, rounds, delta: as in the module
      docstring (``local_std`` > 0).
    orders: integer RDP orders >= 2.

  Raises:
    ValueError: (one line) for a bad value.
  """
  _require(mechanism in MECHANISMS, 'mechanism', MECHANISMS, mechanism)
  _positive('gamma', gamma)
  _positive('local_std', local_std)
  _positive('clip', clip)
  _count('n', n)
  _require(0 < q <= 1, 'sampling probability q', 'in (0, 1]', q)
  _count('rounds', rounds)
  _require(0 < delta < 1, 'delta', 'in (0, 1)', delta)
  orders = _int_orders(orders)
  scaled_l2 = rounded_l2_norm_bound(clip / gamma, beta, dim)
  scaled_l1 = rounded_l1_norm_bound(scaled_l2, dim)
  l2, l1 = gamma * scaled_l2, gamma * scaled_l1
  central_std = math.sqrt(n) * local_std
  if mechanism == 'ddgauss':
    tau = ddgauss_tau(local_std / gamma, n)
    rdp = lambda a: ddgauss_rdp(a, l2, l1, central_std, tau, dim)
  else:
    tau = 0.0
    rdp = lambda a: skellam_rdp(a, l2, l1, central_std**2, 1 / gamma)
  total = _sampled(orders, q, rdp) * rounds
  eps, order = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(
      [int(a) for a in orders], [float(r) for r in total], delta)
  return DistributedEpsilon(float(eps), int(order), l2, l1, scaled_l2,
                            scaled_l1, tau, central_std)


def ddgauss_epsilon(gamma: float, local_std: float, n: int, clip: float,
                    beta: float, dim: int, q: float, rounds: int, delta: float,
                    orders: Sequence[int] = RDP_ORDERS) -> DistributedEpsilon:
  """:func:`distributed_epsilon` of the distributed discrete Gaussian
  ([KLS21] Thm. 1 / Prop. 14); arguments, result, errors as there."""
  return distributed_epsilon('ddgauss', gamma, local_std, n, clip, beta,
                             dim, q, rounds, delta, orders)


def skellam_epsilon(gamma: float, local_std: float, n: int, clip: float,
                    beta: float, dim: int, q: float, rounds: int, delta: float,
                    orders: Sequence[int] = RDP_ORDERS) -> DistributedEpsilon:
  """:func:`distributed_epsilon` of the distributed Skellam mechanism
  ([AKL21], :func:`skellam_rdp`); arguments, result, errors as there."""
  return distributed_epsilon('skellam', gamma, local_std, n, clip, beta,
                             dim, q, rounds, delta, orders)


def min_bits(n: int, k: float) -> int:
  """The least integer ``B`` with ``2^(2B) > n k^2`` (:func:`scale_factor`).

  Raises:
    ValueError: (one line) for ``n < 1`` or ``k <= 0``.
  """
  _count('n', n)
  _positive('k', k)
  return next(b for b in itertools.count(1) if 4.0**b > n * k * k)


def scale_factor(local_std: float, clip: float, bits: int, n: int, dim: int,
                 k: float, rho: float = 1.0) -> float:
  """The scale ``1/gamma`` keeping ``k`` std of the aggregate in ``2^B``.

  [KLS21] Sec. 4.2 / 4.4, Eq. 61 with the norm growth ``n C`` (as the
  papers' code): a rotated coordinate of the sum has variance <= ``rho/d
  (n C)^2 + n gamma^2/4 + n sigma^2`` (signal, rounding, noise; unscaled).
  Solving ``2^B = 2k sqrt(rho/d C^2 n^2 + (gamma^2/4 + sigma^2) n) / gamma``::

    1/gamma = sqrt(2^(2B) - n k^2) / (2k sqrt(rho/d C^2 n^2 + n sigma^2))

  Args:
    local_std, clip, bits, n, dim, k, rho: as in the module docstring
      (``local_std`` >= 0).

  Raises:
    ValueError: (one line) for a bad value, or ``2^(2B) <= n k^2`` (no
      ``gamma`` fits), naming the least ``B`` that fits.
  """
  _require(0 <= local_std < math.inf, 'local_std', 'finite and >= 0',
           local_std)
  _positive('clip', clip)
  _positive('rho', rho)
  _count('dim', dim)
  _count('bits', bits, 64)
  need = min_bits(n, k)
  if bits < need:
    raise ValueError(f'bits={bits} is too small for {n} clients per round at '
                     f'k={k} standard deviations (2^(2B) must exceed n k^2 = '
                     f'{n * k * k:g}): need at least B={need}.')
  return math.sqrt(4.0**bits - n * k * k) / (2 * k * math.sqrt(
      rho / dim * clip**2 * n**2 + n * local_std**2))


def distributed_params(mechanism: str, noise_multiplier: float, clip: float,
                       bits: int, n: int, dim: int, beta: float,
                       k: Optional[float] = None,
                       rho: float = 1.0) -> DistributedParams:
  """:class:`DistributedParams`: grid and noise at noise multiplier ``z``.

  Central std ``z C``, local std ``z C / sqrt(n)``, ``gamma`` = 1 /
  :func:`scale_factor` at that local std, and the conditional rounding
  bound :func:`rounded_l2_norm_bound` of ``C / gamma``.

  Args:
    mechanism: ``'ddgauss'`` or ``'skellam'``.
    noise_multiplier: ``z`` > 0.
    clip, bits, n, dim, beta, rho: as in the module docstring.
    k: as there; None: ``DEFAULT_K[mechanism]``.

  Raises:
    ValueError: (one line) for a bad value or too few bits.
  """
  _require(mechanism in MECHANISMS, 'mechanism', MECHANISMS, mechanism)
  k = DEFAULT_K[mechanism] if k is None else k
  _positive('noise_multiplier', noise_multiplier)
  _count('n', n)
  central_std = noise_multiplier * clip
  local_std = central_std / math.sqrt(n)
  gamma = 1 / scale_factor(local_std, clip, bits, n, dim, k, rho)
  return DistributedParams(gamma, local_std, local_std / gamma, central_std,
                           rounded_l2_norm_bound(clip / gamma, beta, dim), k)


def calibrate_distributed_noise(mechanism: str, target_epsilon: float,
                                delta: float, clip: float, bits: int, n: int,
                                dim: int, beta: float, q: float, rounds: int,
                                k: Optional[float] = None, rho: float = 1.0,
                                max_noise_multiplier: float = 100.0,
                                rtol: float = 1e-6) -> Calibration:
  """:class:`Calibration`: the least ``z`` (to ``rtol``) meeting a target.

  Bisection on ``(0, max_noise_multiplier]``, each ``z`` with its own
  ``gamma`` (:func:`distributed_params`). Epsilon is non-increasing in ``z``
  (sensitivity over central std, ``tau``, Skellam's grid terms fall with
  ``gamma / z``; tested); with ``B`` fixed it has a floor above 0.

  Args:
    mechanism: ``'ddgauss'`` or ``'skellam'``.
    target_epsilon: > 0.
    delta, clip, bits, n, dim, beta, q, rounds, rho: as in the module
      docstring.
    k: as there; None: ``DEFAULT_K[mechanism]``.
    max_noise_multiplier: the bracket's upper end.
    rtol: stop when the bracket is under ``rtol * z``.

  Raises:
    ValueError: (one line) for a bad value, too few bits, or a target that
      ``max_noise_multiplier`` does not reach.
  """
  for name, value in (('target_epsilon', target_epsilon), ('rtol', rtol),
                      ('max_noise_multiplier', max_noise_multiplier)):
    _positive(name, value)

  def at(z: float) -> tuple[float, DistributedParams]:
    p = distributed_params(mechanism, z, clip, bits, n, dim, beta, k, rho)
    return distributed_epsilon(mechanism, p.gamma, p.local_std, n, clip, beta,
                               dim, q, rounds, delta).epsilon, p

  lo, hi = 0.0, max_noise_multiplier
  eps_hi, params_hi = at(hi)
  if eps_hi > target_epsilon:
    raise ValueError(
        f'target_epsilon={target_epsilon} is unreachable for {mechanism} at '
        f'bits={bits}, n={n}, dim={dim}: even noise_multiplier={hi} gives '
        f'epsilon={eps_hi:.4g} (delta={delta}, q={q}, rounds={rounds}); '
        f'raise bits or the target.')
  while hi - lo > rtol * hi:
    mid = (lo + hi) / 2
    eps_mid, params_mid = at(mid)
    if eps_mid <= target_epsilon:
      hi, eps_hi, params_hi = mid, eps_mid, params_mid
    else:
      lo = mid
  return Calibration(hi, eps_hi, params_hi)
