"""DP-FedAvg on FedJAX's own client loop (McMahan et al. 2018, Alg. 1).

FedJAX's ``fed_avg`` clients (``create_train_for_each_client``) with a
differentially private server: each client's delta, as the server receives
it (decoded, when built inside ``fedjax.for_each_client_backend`` of a
:class:`fedlite_jax.rounds.CompressedBackend`), is clipped to L2 norm ``C``
and the clipped deltas are summed with uniform weights; the server step is
:func:`fedlite_jax.privacy.dp_noised_mean`, the same function as the
runner's ``federated_averaging(dp=...)``: Gaussian noise on the sum
(:func:`fedlite_jax.privacy.noise_std_on_sum`), a fixed denominator and,
with ``adaptive``, the clip norm of Andrew et al. 2021, Alg. 1 (the delta
sum then uses ``z_Delta``,
:func:`fedlite_jax.privacy.effective_delta_noise_multiplier`). Accounting:
:mod:`fedlite_jax.privacy.accounting`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import fedjax
from fedjax.algorithms import fed_avg
import jax
import jax.numpy as jnp

from fedlite_jax import privacy
from fedlite_jax.common import PyTree

__all__ = ['AdaptiveClipping', 'DPServerState', 'dp_federated_averaging']


class AdaptiveClipping(NamedTuple):
  """Adaptive clipping's settings (Andrew et al. 2021, Alg. 1).

  Attributes:
    target_quantile: ``gamma`` in [0, 1].
    learning_rate: ``eta_C`` >= 0 (geometric update).
    count_noise_std: ``sigma_b`` >= 0, the std on the noise cohort's
      centered count (clients); must exceed ``z / 2`` when ``z > 0``.
  """
  target_quantile: float = 0.5
  learning_rate: float = 0.2
  count_noise_std: float = 0.0


@dataclasses.dataclass
class DPServerState:
  """Server state of :func:`dp_federated_averaging`.

  Attributes:
    params: the model parameters (pytree).
    opt_state: the server optimizer's state.
    clip_norm: float32 scalar, the current ``C``.
    key: PRNG key of the next round's noise.
  """
  params: PyTree
  opt_state: Any
  clip_norm: jax.Array
  key: jax.Array


def _settings(clip_norm: float, noise_multiplier: float,
              denominator: float, noise_cohort_size: Optional[float],
              adaptive: Optional[AdaptiveClipping]) -> privacy.DPSettings:
  """The :class:`privacy.DPSettings` of the arguments, checked."""
  a = adaptive or AdaptiveClipping()
  settings = privacy.DPSettings(
      clip_norm=clip_norm, noise_multiplier=noise_multiplier,
      denominator=denominator, noise_cohort_size=noise_cohort_size,
      target_quantile=None if adaptive is None else a.target_quantile,
      clip_learning_rate=a.learning_rate,
      count_noise_std=a.count_noise_std)
  settings.check()
  return settings


def _server_update(server_optimizer: fedjax.Optimizer,
                   settings: privacy.DPSettings, state: DPServerState,
                   total: PyTree, norms: jax.Array) -> DPServerState:
  """Noise, mean and next C (:func:`privacy.dp_noised_mean`, key
  ``split(state.key)[1]``), then the server optimizer's step."""
  key, round_key = jax.random.split(state.key)
  out = privacy.dp_noised_mean(settings, total, round_key, state.clip_norm,
                               norms)
  opt_state, params = server_optimizer.apply(out.mean, state.opt_state,
                                             state.params)
  return DPServerState(params, opt_state, out.clip_norm, key)


def _clipped_sum(train_for_each_client: Callable, clip: Callable,
                 state: DPServerState, clients, hparams):
  """``(sum of the clipped deltas, float32[m] pre-clip norms, diagnostics)``
  of one round's clients, one client at a time (memory: one model)."""
  batch_clients = [(cid, cds.shuffle_repeat_batch(hparams), crng)
                   for cid, cds, crng in clients]
  total = jax.tree.map(jnp.zeros_like, state.params)
  norms, diagnostics = [], {}
  for client_id, delta in train_for_each_client(state.params, batch_clients):
    clipped, norm = clip(delta, state.clip_norm)
    total = jax.tree.map(jnp.add, total, clipped)
    norms.append(norm)
    diagnostics[client_id] = {'delta_l2_norm': norm}
  return total, jnp.stack(norms), diagnostics


def dp_federated_averaging(
    grad_fn: Callable[..., PyTree],
    client_optimizer: fedjax.Optimizer,
    server_optimizer: fedjax.Optimizer,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    *,
    clip_norm: float,
    noise_multiplier: float,
    denominator: Optional[float] = None,
    noise_cohort_size: Optional[float] = None,
    adaptive: Optional[AdaptiveClipping] = None,
    seed: int = 0) -> fedjax.FederatedAlgorithm:
  """Builds DP-FedAvg (central DP, uniform weights) on FedJAX's clients.

  McMahan et al. 2018, Alg. 1; with ``adaptive`` Andrew et al. 2021, Alg. 1.
  Each round: the clients' deltas clipped to ``C`` and summed, then
  :func:`fedlite_jax.privacy.dp_noised_mean` with the round key
  ``split(state.key)[1]`` (``[0]`` is the next state's key): noise of std
  ``z_Delta * C * W / M`` on the sum, the mean over ``W``, the count noise
  ``sigma_b * W / M`` and ``C <- C * exp(-eta_C (b_bar - gamma))``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` (``fedjax.model_grad``).
    client_optimizer: FedJAX optimizer of the clients.
    server_optimizer: FedJAX optimizer applied to the noised mean delta.
    client_batch_hparams: clients' batching.
    clip_norm: initial ``C`` > 0 (units of the parameters).
    noise_multiplier: ``z`` >= 0 (total, including the count with
      ``adaptive``).
    denominator: ``W`` > 0, the mean's fixed denominator in clients (e.g.
      the expected cohort ``q * N``); default the number of clients in the
      round.
    noise_cohort_size: ``M``, the production cohort the noise is calibrated
      for (clients); default ``W``.
    adaptive: adaptive clipping's settings, or None for a fixed ``C``.
    seed: seed of the first round's noise key.

  Returns:
    A ``fedjax.FederatedAlgorithm`` whose state is :class:`DPServerState`;
    diagnostics per client: ``delta_l2_norm`` (float32, before clipping).

  Raises:
    ValueError: (one line) ``C <= 0``, ``z < 0``, a size <= 0, ``gamma``
      outside [0, 1], ``eta_C < 0`` or ``sigma_b <= z / 2``.
  """
  settings = _settings(clip_norm, noise_multiplier,
                       1.0 if denominator is None else denominator,
                       noise_cohort_size, adaptive)
  train_for_each_client = fed_avg.create_train_for_each_client(
      grad_fn, client_optimizer)
  clip = jax.jit(privacy.clip_by_global_norm)
  finish = jax.jit(functools.partial(_server_update, server_optimizer),
                   static_argnums=0)

  def init(params):
    return DPServerState(params, server_optimizer.init(params),
                         jnp.float32(clip_norm), jax.random.PRNGKey(seed))

  def apply(state, clients):
    total, norms, diagnostics = _clipped_sum(
        train_for_each_client, clip, state, clients, client_batch_hparams)
    round_settings = settings
    if denominator is None:
      round_settings = dataclasses.replace(settings,
                                           denominator=float(len(norms)))
      round_settings.check()
    return finish(round_settings, state, total, norms), diagnostics

  return fedjax.FederatedAlgorithm(init, apply)


jax.tree_util.register_dataclass(
    DPServerState, data_fields=['params', 'opt_state', 'clip_norm', 'key'],
    meta_fields=[])
