"""DP-FedAvg on FedJAX's own client loop (McMahan et al. 2018, Alg. 1).

FedJAX's ``fed_avg`` clients (``create_train_for_each_client``) with a
differentially private server: each client's delta, as the server receives
it (decoded, when built inside ``fedjax.for_each_client_backend`` of a
:class:`fedlite_jax.rounds.CompressedBackend`), is clipped to L2 norm ``C``;
the clipped deltas are summed with uniform weights, Gaussian noise is added
to the sum (:func:`fedlite_jax.privacy.noise_std_on_sum`) and the sum is
divided by a fixed denominator. With ``adaptive`` the clip norm follows
Andrew et al. 2021, Alg. 1, and the delta sum uses ``z_Delta``
(:func:`fedlite_jax.privacy.effective_delta_noise_multiplier`). Accounting:
:mod:`fedlite_jax.privacy.accounting`.
"""

from __future__ import annotations

import dataclasses
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
    count_noise_std: ``sigma_b`` (std on the count; must exceed ``z / 2``).
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

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` (``fedjax.model_grad``).
    client_optimizer: FedJAX optimizer of the clients.
    server_optimizer: FedJAX optimizer applied to the noised mean delta.
    client_batch_hparams: clients' batching.
    clip_norm: initial ``C`` > 0 (units of the parameters).
    noise_multiplier: ``z`` >= 0 (total, including the count with
      ``adaptive``).
    denominator: fixed denominator of the mean (e.g. expected cohort
      ``q * N``); default the number of clients in the round.
    noise_cohort_size: production-cohort size the noise is calibrated for.
    adaptive: adaptive clipping settings, or None for a fixed ``C``.
    seed: seed of the server's noise keys.

  Returns:
    A ``fedjax.FederatedAlgorithm`` whose state is :class:`DPServerState`;
    diagnostics per client: ``delta_l2_norm`` (before clipping).

  Raises:
    ValueError: (one line) ``C <= 0``, ``z < 0``, or ``sigma_b <= z / 2``.
  """
  privacy.check_dp_params(clip_norm, noise_multiplier)
  z_delta = noise_multiplier
  if adaptive is not None:
    z_delta = privacy.effective_delta_noise_multiplier(
        noise_multiplier, adaptive.count_noise_std)
  train_for_each_client = fed_avg.create_train_for_each_client(
      grad_fn, client_optimizer)
  clip = jax.jit(privacy.clip_by_global_norm)

  @jax.jit
  def finish(state, total, norms, denom):
    key, k_noise, k_count = jax.random.split(state.key, 3)
    std = z_delta * state.clip_norm * (denom / (
        denom if noise_cohort_size is None else noise_cohort_size))
    noise = privacy.gaussian_noise_like(total, k_noise, std)
    mean = jax.tree.map(lambda s, n: (s + n) / denom, total, noise)
    opt_state, params = server_optimizer.apply(mean, state.opt_state,
                                               state.params)
    c = state.clip_norm
    if adaptive is not None:
      c = privacy.adaptive_clip_update(
          c, norms, k_count, adaptive.target_quantile, adaptive.learning_rate,
          adaptive.count_noise_std, denom).clip_norm
    return DPServerState(params, opt_state, c, key)

  def init(params):
    return DPServerState(params, server_optimizer.init(params),
                         jnp.float32(clip_norm), jax.random.PRNGKey(seed))

  def apply(state, clients):
    batch_clients = [(cid, cds.shuffle_repeat_batch(client_batch_hparams),
                      crng) for cid, cds, crng in clients]
    total = jax.tree.map(jnp.zeros_like, state.params)
    norms, diagnostics = [], {}
    for client_id, delta in train_for_each_client(state.params,
                                                  batch_clients):
      clipped, norm = clip(delta, state.clip_norm)
      total = jax.tree.map(jnp.add, total, clipped)
      norms.append(norm)
      diagnostics[client_id] = {'delta_l2_norm': norm}
    denom = float(len(norms) if denominator is None else denominator)
    privacy.noise_std_on_sum(clip_norm, noise_multiplier, denom,
                             noise_cohort_size)  # validates the sizes
    return finish(state, total, jnp.stack(norms), denom), diagnostics

  return fedjax.FederatedAlgorithm(init, apply)


jax.tree_util.register_dataclass(
    DPServerState, data_fields=['params', 'opt_state', 'clip_norm', 'key'],
    meta_fields=[])
