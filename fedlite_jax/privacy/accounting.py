"""Privacy accounting for DP-FedAvg with Google's ``dp-accounting``.

Each round is the Poisson-sampled Gaussian mechanism
(``dp_accounting.PoissonSampledDpEvent(q, GaussianDpEvent(z))``) with
``q = cohort / population``; ``T`` rounds are its self-composition. The
epsilon at ``delta`` comes from dp_accounting's RDP accountant (default) or
its PLD accountant; nothing here re-derives the math.

Adaptive clipping (Andrew et al. 2021, Sec. 3.1) adds a Gaussian count with
std ``sigma_b`` (sensitivity 1/2) to the delta sum's Gaussian with multiplier
``z_Delta``; the two together are exactly one Gaussian with
``z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2)``, which is what the paper
accounts and what :func:`adaptive_clipping_event` builds.

Production cohorts (pfl-research): account at
``q = noise_cohort_size / population`` (:func:`sampling_probability`) and
scale the noise as in :func:`fedlite_jax.privacy.aggregation.noise_std_on_sum`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, Optional

import dp_accounting

__all__ = [
    'ACCOUNTANTS',
    'adaptive_clipping_event',
    'calibrate_noise_multiplier',
    'dp_fedavg_event',
    'epsilon',
    'event_epsilon',
    'make_accountant',
    'sampling_probability',
]

ACCOUNTANTS = ('rdp', 'pld')


class _DropUnconverged(logging.Filter):
  """Drops dp_accounting's 'failed to converge' warnings: the RDP
  accountant then excludes that order, and epsilon (a minimum over the
  other orders) is still a valid bound; at small z they flood a run's log."""

  def filter(self, record: logging.LogRecord) -> bool:
    return 'failed to converge' not in str(record.msg)


@contextlib.contextmanager
def _quiet_orders() -> Iterator[None]:
  logger, drop = logging.getLogger('absl'), _DropUnconverged()
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)


def _check_delta(delta: float) -> None:
  if not 0 < delta < 1:
    raise ValueError(f'delta must be in (0, 1); got {delta}.')


def _check_round_params(noise_multiplier: float, q: float,
                        rounds: int) -> None:
  if not noise_multiplier >= 0:
    raise ValueError(
        f'noise_multiplier z must be >= 0; got {noise_multiplier}.')
  if not 0 < q <= 1:
    raise ValueError(f'sampling probability q must be in (0, 1]; got {q}.')
  if not (isinstance(rounds, int) and rounds >= 1):
    raise ValueError(f'rounds must be an int >= 1; got {rounds!r}.')


def sampling_probability(cohort_size: int, population: int) -> float:
  """``q = cohort_size / population`` (e.g. the production cohort's).

  Raises:
    ValueError: (one line) unless ``0 < cohort_size <= population``.
  """
  if not 0 < cohort_size <= population:
    raise ValueError(f'need 0 < cohort_size <= population; got '
                     f'{cohort_size} and {population}.')
  return cohort_size / population


def make_accountant(accountant: str = 'rdp'
                    ) -> dp_accounting.PrivacyAccountant:
  """A fresh ``dp_accounting`` accountant: ``'rdp'`` or ``'pld'``.

  Both use add-or-remove-one adjacency (dp_accounting's default).

  Raises:
    ValueError: (one line) for another name.
  """
  if accountant == 'rdp':
    return dp_accounting.rdp.RdpAccountant()
  if accountant == 'pld':
    return dp_accounting.pld.PLDAccountant()
  raise ValueError(f"accountant must be one of {ACCOUNTANTS}; got "
                   f"{accountant!r}.")


def dp_fedavg_event(noise_multiplier: float, sampling_probability: float,
                    rounds: int) -> dp_accounting.DpEvent:
  """``T`` rounds of the Poisson-sampled Gaussian with multiplier ``z``.

  Raises:
    ValueError: (one line) for ``z < 0``, ``q`` outside (0, 1] or
      ``rounds < 1``.
  """
  _check_round_params(noise_multiplier, sampling_probability, rounds)
  return dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          sampling_probability,
          dp_accounting.GaussianDpEvent(noise_multiplier)), rounds)


def adaptive_clipping_event(delta_noise_multiplier: float,
                            count_noise_std: float,
                            sampling_probability: float,
                            rounds: int) -> dp_accounting.DpEvent:
  """Adaptive clipping's event: the Gaussian with the combined multiplier.

  ``z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, 3.1):
  the delta sum (multiplier ``z_Delta``) and the centered count (std
  ``sigma_b``, sensitivity 1/2) are one Gaussian with multiplier ``z``.

  Raises:
    ValueError: (one line) for a negative multiplier or std, or bad ``q``,
      ``rounds``.
  """
  if not (delta_noise_multiplier >= 0 and count_noise_std >= 0):
    raise ValueError(
        f'noise must be >= 0; got z_Delta={delta_noise_multiplier}, '
        f'sigma_b={count_noise_std}.')
  if delta_noise_multiplier == 0 or count_noise_std == 0:
    z = 0.0
  else:
    z = (delta_noise_multiplier ** -2 + (2 * count_noise_std) ** -2) ** -0.5
  return dp_fedavg_event(z, sampling_probability, rounds)


def epsilon(noise_multiplier: float, sampling_probability: float,
            rounds: int, delta: float, accountant: str = 'rdp') -> float:
  """Epsilon at ``delta`` after ``rounds`` of DP-FedAvg.

  Args:
    noise_multiplier: ``z`` >= 0 (0 gives ``inf``).
    sampling_probability: ``q`` in (0, 1] (Poisson sampling).
    rounds: ``T`` >= 1.
    delta: in (0, 1).
    accountant: ``'rdp'`` (default) or ``'pld'``.

  Raises:
    ValueError: (one line) for bad inputs.
  """
  _check_delta(delta)
  event = dp_fedavg_event(noise_multiplier, sampling_probability, rounds)
  acc = make_accountant(accountant)
  if noise_multiplier == 0:
    return math.inf
  with _quiet_orders():
    return float(acc.compose(event).get_epsilon(delta))


def event_epsilon(event: dp_accounting.DpEvent, delta: float,
                  accountant: str = 'rdp') -> float:
  """Epsilon at ``delta`` of any ``dp_accounting`` event (e.g.
  :func:`adaptive_clipping_event`).

  Raises:
    ValueError: (one line) for ``delta`` outside (0, 1) or an unknown
      accountant.
  """
  _check_delta(delta)
  with _quiet_orders():
    return float(make_accountant(accountant).compose(event).get_epsilon(
        delta))


def calibrate_noise_multiplier(target_epsilon: float, delta: float,
                               sampling_probability: float, rounds: int,
                               accountant: str = 'rdp',
                               max_noise_multiplier: float = 1000.0,
                               tol: Optional[float] = None) -> float:
  """The smallest ``z`` (to ``tol``) with epsilon <= ``target_epsilon``.

  ``dp_accounting.calibrate_dp_mechanism`` over :func:`dp_fedavg_event`
  (bisection on the bracket ``[0, max_noise_multiplier]``): the returned
  ``z`` has epsilon <= ``target_epsilon`` at ``delta`` and is at most
  ``tol`` above the smallest such ``z``. No tolerance on epsilon is
  promised; how close it lands to the target depends on epsilon's slope in
  ``z`` (the tests check within 1% for their settings).

  Args:
    target_epsilon: > 0.
    delta: in (0, 1).
    sampling_probability: ``q`` in (0, 1].
    rounds: ``T`` >= 1.
    accountant: ``'rdp'`` or ``'pld'``.
    max_noise_multiplier: the bracket's upper end.
    tol: absolute tolerance on ``z`` of the bisection (None: ``1e-5``).

  Returns:
    ``z`` (float).

  Raises:
    ValueError: (one line) for ``target_epsilon <= 0``, bad ``delta`` etc.,
      or when even ``max_noise_multiplier`` cannot reach the target.
  """
  if not target_epsilon > 0:
    raise ValueError(f'target_epsilon must be > 0; got {target_epsilon}.')
  _check_delta(delta)
  _check_round_params(1.0, sampling_probability, rounds)
  make_accountant(accountant)
  best = epsilon(max_noise_multiplier, sampling_probability, rounds, delta,
                 accountant)
  if best > target_epsilon:
    raise ValueError(
        f'target_epsilon={target_epsilon} is unreachable: even '
        f'noise_multiplier={max_noise_multiplier} gives epsilon={best:.4g} '
        f'at delta={delta}, q={sampling_probability}, rounds={rounds}.')
  with _quiet_orders():
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: make_accountant(accountant),
        lambda z: dp_fedavg_event(z, sampling_probability, rounds),
        target_epsilon, delta,
        dp_accounting.ExplicitBracketInterval(0.0, max_noise_multiplier),
        tol=tol if tol is not None else 1e-5)
  return float(z)
