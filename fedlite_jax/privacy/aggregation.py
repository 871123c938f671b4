"""Central DP-FedAvg aggregation and adaptive clipping (pure JAX, pytrees).

DP-FedAvg (McMahan, Ramage, Talwar & Zhang 2018, "Learning Differentially
Private Recurrent Language Models", Alg. 1): each client's contribution
``Delta_i`` (a pytree: the decoded update, in the space where the server
aggregates) is clipped to L2 norm ``C`` over all leaves, the clipped
contributions are summed, Gaussian noise of std ``z * C`` is added to the
SUM, and the sum is divided by a fixed denominator (uniform weighting; the
expected cohort size ``q * N`` or the given cohort size, never the realized
number of clients, so that one client changes the mean by at most
``C / denominator``).

Adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy 2021,
"Differentially Private Learning with Adaptive Clipping", Alg. 1): the
clients also report ``b_i = 1[||Delta_i|| <= C]``; the server adds noise of
std ``sigma_b`` to the centered count ``sum_i (b_i - 1/2)`` (sensitivity
1/2, Sec. 3.1), forms ``b_bar = noised / denominator + 1/2``, clamped to
[0, 1] as TF Privacy's quantile estimator does, and updates
``C <- C * exp(-eta_C * (b_bar - gamma))``. For a total noise multiplier
``z`` the delta sum gets ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, so
that the pair is exactly one Gaussian mechanism with multiplier ``z``.

Production cohorts (as in pfl-research): noise calibrated for
``noise_cohort_size`` (M) clients while a smaller cohort is trained and
summed (divided by ``denominator``, W). The std on the MEAN is
``z * C / M``; on the SUM over the trained cohort it is ``z * C * W / M``.
Without ``noise_cohort_size`` (default ``denominator``) the std on the sum
is ``z * C``. The count noise of adaptive clipping is scaled the same way
(``sigma_b * W / M`` on the trained cohort's count).

:func:`dp_noised_mean` is the server's step of both DP-FedAvg entry points
(``fedlite_jax.algorithms.fedopt.federated_averaging(dp=...)`` and
``fedlite_jax.algorithms.dp_fedavg.dp_federated_averaging``): noise on the
clipped sum, the fixed denominator and the adaptive update, from one
:class:`DPSettings`.

Every function is jittable (``clip_norm`` may be a traced scalar; it is
checked only when it is a Python number) and takes explicit PRNG keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from fedlite_jax.common import DP_STREAM, PyTree

__all__ = [
    'AdaptiveClipResult',
    'DPAggregate',
    'DPMean',
    'DPSettings',
    'adaptive_clip_update',
    'check_dp_params',
    'clip_by_global_norm',
    'dp_fedavg_aggregate',
    'dp_noised_mean',
    'dp_round_key',
    'effective_delta_noise_multiplier',
    'gaussian_noise_like',
    'global_norm',
    'noise_std_on_sum',
    'noised_unclipped_fraction',
]


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_dp_params(clip_norm: Any = None,
                    noise_multiplier: Any = None) -> None:
  """Raises a one-line ``ValueError`` for ``C <= 0`` or ``z < 0``.

  Traced (non-Python-number) arguments are not checked.
  """
  if _is_number(clip_norm) and not clip_norm > 0:
    raise ValueError(f'clip_norm C must be > 0; got {clip_norm}.')
  if _is_number(noise_multiplier) and not noise_multiplier >= 0:
    raise ValueError(
        f'noise_multiplier z must be >= 0; got {noise_multiplier}.')


def global_norm(tree: PyTree) -> jax.Array:
  """L2 norm over all leaves of ``tree``: float32 scalar (same units)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in leaves))


def clip_by_global_norm(tree: PyTree, clip_norm: Any
                        ) -> tuple[PyTree, jax.Array]:
  """Scales ``tree`` to global L2 norm at most ``clip_norm``.

  ``scale = C / max(||tree||, C)``: exactly 1 (the tree unchanged) when
  ``||tree|| <= C``.

  Args:
    tree: one contribution (pytree of floating arrays, any shapes).
    clip_norm: ``C`` > 0, Python float or float32 scalar (tree units).

  Returns:
    ``(clipped, norm)``: the clipped tree (same structure, shapes, dtypes)
    and the float32 norm before clipping.

  Raises:
    ValueError: (one line) if ``clip_norm`` is a number <= 0.
  """
  check_dp_params(clip_norm=clip_norm)
  norm = global_norm(tree)
  c = jnp.asarray(clip_norm, jnp.float32)
  scale = c / jnp.maximum(norm, c)
  clipped = jax.tree.map(lambda x: (x * scale).astype(x.dtype), tree)
  return clipped, norm


def gaussian_noise_like(tree: PyTree, key: jax.Array, std: Any) -> PyTree:
  """Independent ``N(0, std^2)`` noise with ``tree``'s structure and dtypes.

  Args:
    tree: pytree of floating arrays (or ``jax.ShapeDtypeStruct``).
    key: PRNG key; leaf ``i`` uses ``jax.random.split(key, n)[i]``.
    std: standard deviation (tree units), float or float32 scalar.
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  noise = [(std * jax.random.normal(k, jnp.shape(x), jnp.float32)).astype(
      jnp.result_type(x)) for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, noise)


def noise_std_on_sum(clip_norm: Any, noise_multiplier: Any,
                     denominator: float,
                     noise_cohort_size: Optional[float] = None) -> Any:
  """Std of the noise added to the clipped SUM (units of the contributions).

  ``z * C * denominator / noise_cohort_size``; with ``noise_cohort_size``
  None (it defaults to ``denominator``) this is ``z * C``. The std on the
  mean (sum / ``denominator``) is ``z * C / noise_cohort_size``.

  Raises:
    ValueError: (one line) for ``C <= 0``, ``z < 0`` or a cohort size <= 0.
  """
  check_dp_params(clip_norm, noise_multiplier)
  if not denominator > 0:
    raise ValueError(f'denominator must be > 0; got {denominator}.')
  if noise_cohort_size is None:
    noise_cohort_size = denominator
  if not noise_cohort_size > 0:
    raise ValueError(
        f'noise_cohort_size must be > 0; got {noise_cohort_size}.')
  return noise_multiplier * clip_norm * (denominator / noise_cohort_size)


class DPAggregate(NamedTuple):
  """Result of :func:`dp_fedavg_aggregate`.

  Attributes:
    mean: the noised mean, ``(sum of clipped + noise) / denominator``; one
      contribution's structure, shapes and dtypes.
    norms: float32[m], each contribution's norm before clipping.
    noise_std: float32 scalar, the std of the noise added to the sum.
  """
  mean: PyTree
  norms: jax.Array
  noise_std: jax.Array


def dp_fedavg_aggregate(contributions: PyTree, key: jax.Array,
                        clip_norm: Any, noise_multiplier: Any,
                        denominator: Optional[float] = None,
                        noise_cohort_size: Optional[float] = None,
                        mask: Optional[jax.Array] = None) -> DPAggregate:
  """DP-FedAvg's server aggregate (McMahan et al. 2018, Alg. 1).

  Args:
    contributions: pytree whose leaves have a leading client axis ``m``
      (decoded contributions, in the aggregation space: the model delta, or
      the d-dimensional update for a static IGC subspace).
    key: PRNG key of the noise.
    clip_norm: ``C`` > 0 (float or float32 scalar).
    noise_multiplier: ``z`` >= 0: the noise std on the sum is
      :func:`noise_std_on_sum`.
    denominator: fixed denominator of the uniform mean (e.g. the expected
      cohort size ``q * N``); default ``m`` (the given cohort size).
    noise_cohort_size: production-cohort size the noise is calibrated for
      (default ``denominator``).
    mask: optional bool/float[m]; clients with 0 contribute nothing (padding).

  Returns:
    A :class:`DPAggregate`; the noise is :func:`dp_noised_mean`'s (its
    ``key`` split into the sum's and the count's).

  Raises:
    ValueError: (one line) for ``C <= 0``, ``z < 0`` or a size <= 0.
  """
  m = jax.tree.leaves(contributions)[0].shape[0]
  settings = DPSettings(
      clip_norm=clip_norm, noise_multiplier=noise_multiplier,
      denominator=m if denominator is None else denominator,
      noise_cohort_size=noise_cohort_size)
  settings.check()
  clipped, norms = jax.vmap(lambda t: clip_by_global_norm(t, clip_norm))(
      contributions)
  if mask is not None:
    w = jnp.asarray(mask, jnp.float32)
    clipped = jax.tree.map(
        lambda x: x * w.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype),
        clipped)
  total = jax.tree.map(lambda x: jnp.sum(x, axis=0), clipped)
  out = dp_noised_mean(settings, total, key, clip_norm)
  return DPAggregate(out.mean, norms, out.noise_std)


def effective_delta_noise_multiplier(noise_multiplier: float,
                                     count_noise_std: float) -> float:
  """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, 3.1).

  The delta sum with multiplier ``z_Delta`` (sensitivity ``C``) and the
  centered count with std ``sigma_b`` (sensitivity 1/2) together are one
  Gaussian mechanism with multiplier ``z``. ``z = 0`` gives 0 (no noise).

  Raises:
    ValueError: (one line) if ``z < 0``, ``sigma_b < 0`` or
      ``sigma_b <= z / 2`` (the count alone would spend the whole budget).
  """
  check_dp_params(noise_multiplier=noise_multiplier)
  if not count_noise_std >= 0:
    raise ValueError(f'count_noise_std must be >= 0; got {count_noise_std}.')
  if noise_multiplier == 0:
    return 0.0
  if not 2 * count_noise_std > noise_multiplier:
    raise ValueError(
        f'count_noise_std sigma_b={count_noise_std} is too small for '
        f'noise_multiplier z={noise_multiplier}: need sigma_b > z/2 = '
        f'{noise_multiplier / 2}.')
  return float((noise_multiplier ** -2 - (2 * count_noise_std) ** -2)
               ** -0.5)


def noised_unclipped_fraction(norms: jax.Array, key: jax.Array,
                              clip_norm: Any, count_noise_std: Any,
                              denominator: float,
                              mask: Optional[jax.Array] = None) -> jax.Array:
  """``b_bar``: the noised fraction of clients with ``||Delta_i|| <= C``.

  ``b_bar = clip((sum_i (b_i - 1/2) + N(0, sigma_b^2)) / denominator + 1/2,
  0, 1)`` (Andrew et al. 2021, Alg. 1 and Sec. 3.1: centered, sensitivity
  1/2; the clamp as in TF Privacy).

  Args:
    norms: float[m] contribution norms (:attr:`DPAggregate.norms`).
    key: PRNG key of the count noise.
    clip_norm: the current ``C``.
    count_noise_std: ``sigma_b`` >= 0 (std on the count, in clients).
    denominator: fixed denominator (expected cohort size), > 0.
    mask: optional float[m] of participating clients (1) and padding (0).

  Returns:
    float32 scalar in [0, 1]: the noised fraction clamped to [0, 1], as
    TF Privacy's ``QuantileEstimatorQuery`` protects against out-of-range
    estimates (the noise, or a denominator below the cohort, can push it
    out).
  """
  check_dp_params(clip_norm=clip_norm)
  b = (norms <= clip_norm).astype(jnp.float32) - 0.5
  if mask is not None:
    b = b * jnp.asarray(mask, jnp.float32)
  noise = count_noise_std * jax.random.normal(key, (), jnp.float32)
  return jnp.clip((jnp.sum(b) + noise) / denominator + 0.5, 0.0, 1.0)


class AdaptiveClipResult(NamedTuple):
  """Result of :func:`adaptive_clip_update`.

  Attributes:
    clip_norm: float32 scalar, the next round's ``C``.
    unclipped_fraction: float32 scalar, the noised ``b_bar`` in [0, 1].
  """
  clip_norm: jax.Array
  unclipped_fraction: jax.Array


def adaptive_clip_update(clip_norm: Any, norms: jax.Array, key: jax.Array,
                         target_quantile: float, learning_rate: float,
                         count_noise_std: Any, denominator: float,
                         mask: Optional[jax.Array] = None
                         ) -> AdaptiveClipResult:
  """Geometric update ``C <- C * exp(-eta_C * (b_bar - gamma))``.

  Andrew et al. 2021, Alg. 1; ``b_bar`` from :func:`noised_unclipped_fraction`.
  ``C`` moves toward the ``gamma``-quantile of the contribution norms.

  Args:
    clip_norm: the current ``C`` > 0.
    norms: float[m] contribution norms this round.
    key: PRNG key of the count noise.
    target_quantile: ``gamma`` in [0, 1].
    learning_rate: ``eta_C`` >= 0.
    count_noise_std: ``sigma_b`` >= 0, the std on THIS count (clients of
      the ``m`` given; :attr:`DPSettings.count_noise_std_on_sum` scales a
      noise cohort's ``sigma_b`` to it).
    denominator: fixed denominator, > 0.
    mask: optional float[m] of participating clients.

  Returns:
    An :class:`AdaptiveClipResult`.

  Raises:
    ValueError: (one line) for ``gamma`` outside [0, 1] or ``eta_C < 0``.
  """
  _check_adaptive(target_quantile, learning_rate)
  b_bar = noised_unclipped_fraction(norms, key, clip_norm, count_noise_std,
                                    denominator, mask)
  c = jnp.asarray(clip_norm, jnp.float32)
  return AdaptiveClipResult(
      c * jnp.exp(-learning_rate * (b_bar - target_quantile)), b_bar)



def _check_adaptive(target_quantile: float, learning_rate: float) -> None:
  if not 0 <= target_quantile <= 1:
    raise ValueError(
        f'target_quantile gamma must be in [0, 1]; got {target_quantile}.')
  if not learning_rate >= 0:
    raise ValueError(f'learning_rate eta_C must be >= 0; got {learning_rate}.')


@dataclasses.dataclass(frozen=True)
class DPSettings:
  """Central DP-FedAvg's settings (McMahan et al. 2018, Alg. 1; adaptive
  clipping: Andrew et al. 2021, Alg. 1). Hashable (a static ``jit``
  argument).

  Attributes:
    clip_norm: the first round's ``C`` > 0 (units of the summed
      contributions, e.g. the decoded delta).
    noise_multiplier: ``z`` >= 0 of the round's Gaussian mechanism (with
      adaptive clipping: of the delta sum and the count together; the sum
      gets :attr:`delta_noise_multiplier`).
    denominator: ``W`` > 0, the mean's fixed denominator (clients: the
      trained cohort or its expected size).
    noise_cohort_size: ``M`` > 0, the cohort the noise is calibrated for
      (clients); None: ``W``.
    target_quantile: adaptive clipping's ``gamma`` in [0, 1]; None: fixed C.
    clip_learning_rate: ``eta_C`` >= 0 of the geometric update.
    count_noise_std: ``sigma_b`` >= 0, the std on the noise cohort's
      centered count (clients); with adaptive clipping and ``z > 0`` it must
      exceed ``z / 2``.
  """
  clip_norm: Any
  noise_multiplier: Any
  denominator: float
  noise_cohort_size: Optional[float] = None
  target_quantile: Optional[float] = None
  clip_learning_rate: float = 0.2
  count_noise_std: float = 0.0

  def check(self) -> None:
    """Raises a one-line ValueError for ``C <= 0``, ``z < 0``, a size <= 0,
    ``gamma`` outside [0, 1], ``eta_C < 0``, ``sigma_b < 0`` or
    ``sigma_b <= z / 2`` (adaptive clipping)."""
    self.noise_std(self.clip_norm)
    if self.target_quantile is not None:
      _check_adaptive(self.target_quantile, self.clip_learning_rate)

  @property
  def delta_noise_multiplier(self) -> float:
    """``z_Delta`` of the delta sum (``z`` without adaptive clipping); a
    one-line ValueError if ``sigma_b <= z / 2``
    (:func:`effective_delta_noise_multiplier`)."""
    if self.target_quantile is None:
      return self.noise_multiplier
    return effective_delta_noise_multiplier(self.noise_multiplier,
                                            self.count_noise_std)

  def noise_std(self, clip_norm: Any) -> Any:
    """Std of the noise on the trained cohort's clipped sum for clip norm
    ``clip_norm`` (units of the contributions): ``z_Delta * C * W / M``
    (:func:`noise_std_on_sum`); ``/ W`` on the mean."""
    return noise_std_on_sum(clip_norm, self.delta_noise_multiplier,
                            self.denominator, self.noise_cohort_size)

  @property
  def count_noise_std_on_sum(self) -> float:
    """Std of the noise on the trained cohort's centered count (clients):
    ``sigma_b * W / M``, scaled like the sum's so that ``b_bar`` gets
    ``sigma_b / M`` whatever ``W``."""
    return self.count_noise_std * self.denominator / (
        self.noise_cohort_size or self.denominator)


class DPMean(NamedTuple):
  """Result of :func:`dp_noised_mean`.

  Attributes:
    mean: ``(clipped sum + noise) / W``: the sum's structure, shapes and
      dtypes.
    clip_norm: float32 scalar, the next round's ``C`` (the given one
      without adaptive clipping).
    unclipped_fraction: float32 scalar ``b_bar`` in [0, 1] (adaptive
      clipping), else None.
    noise_std: float32 scalar, the std of the noise added to the sum.
  """
  mean: PyTree
  clip_norm: jax.Array
  unclipped_fraction: Optional[jax.Array]
  noise_std: jax.Array


def dp_round_key(seed: int, round_num: Any) -> jax.Array:
  """``fold_in(fold_in(PRNGKey(seed), DP_STREAM), round_num)``: a round's
  server noise key, a function of the seed and round only (resume-exact)."""
  return jax.random.fold_in(jax.random.fold_in(
      jax.random.PRNGKey(seed), DP_STREAM), round_num)


def dp_noised_mean(settings: DPSettings, clipped_sum: PyTree, key: jax.Array,
                   clip_norm: Any, norms: Optional[jax.Array] = None,
                   kept: Optional[jax.Array] = None) -> DPMean:
  """DP-FedAvg's server step on the clipped sum (jittable).

  McMahan et al. 2018, Alg. 1: ``mean = (sum + N(0, s^2 I)) / W`` with
  ``s = settings.noise_std(C)``. With ``settings.target_quantile`` also
  Andrew et al. 2021, Alg. 1: ``b_bar`` from ``norms`` with count noise of
  std :attr:`DPSettings.count_noise_std_on_sum`, clamped to [0, 1], and
  ``C <- C * exp(-eta_C * (b_bar - gamma))``
  (:func:`adaptive_clip_update`). ``k_sum, k_count = split(key)`` draw
  the sum's and the count's noise.

  Args:
    settings: the :class:`DPSettings` (static).
    clipped_sum: the sum of the clipped contributions (pytree of floating
      arrays, weight 1 per client).
    key: PRNG key of the round's noise.
    clip_norm: this round's ``C`` > 0 (float or float32 scalar, may be
      traced).
    norms: float32[m], each client's norm before clipping (adaptive
      clipping only).
    kept: optional float32[m], 1 for the clients in the sum, 0 for padding
      or skipped clients.

  Returns:
    A :class:`DPMean`.

  Raises:
    ValueError: (one line) adaptive clipping without ``norms``, or bad
      settings (:meth:`DPSettings.check`).
  """
  std = settings.noise_std(clip_norm)
  k_sum, k_count = jax.random.split(key)
  noise = gaussian_noise_like(clipped_sum, k_sum, std)
  mean = jax.tree.map(lambda s, n: ((s + n) / settings.denominator).astype(
      s.dtype), clipped_sum, noise)
  std = jnp.asarray(std, jnp.float32)
  if settings.target_quantile is None:
    return DPMean(mean, jnp.asarray(clip_norm, jnp.float32), None, std)
  if norms is None:
    raise ValueError('adaptive clipping (target_quantile set) needs the '
                     "clients' norms; got norms=None.")
  new = adaptive_clip_update(
      clip_norm, norms, k_count, settings.target_quantile,
      settings.clip_learning_rate, settings.count_noise_std_on_sum,
      settings.denominator, kept)
  return DPMean(mean, new.clip_norm, new.unclipped_fraction, std)
