"""One FedOpt round for every delta-based method: :func:`federated_averaging`.

Source: Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2;
local steps of FedAvg (McMahan et al. 2017, Alg. 1) or FedProx (Li et al.
2020, Alg. 2); upload / download chains and PVT as in Ro et al. 2022, Sec. 4;
central DP-FedAvg (McMahan et al. 2018) or distributed DP under secure
aggregation (Kairouz et al. 2021; Agarwal et al. 2021).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence, Union

import fedjax
import jax
import jax.numpy as jnp
import optax

from fedlite_jax import privacy
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.algorithms import rounds_common as rc
from fedlite_jax.algorithms.compressed_round import (  # noqa: F401
    Compression, CompressedRound, DDPFedOptState, DPFedOptState,
    encode_decode, FedOptState, per_leaf_mean)
from fedlite_jax.algorithms.rounds_common import (  # noqa: F401
    DOWNLOAD_ACCOUNTING, DOWNLOAD_STREAM, batch_hparams, num_params,
    UPLOAD_STREAM)
from fedlite_jax.rounds import make_engine
from fedlite_jax.common import DP_STREAM, PyTree

Params = Any

__all__ = [
    'Compression', 'CompressedRound', 'DDPFedOptState', 'DP', 'DPFedOptState',
    'FedOptState',
    'dp_mean', 'federated_averaging',
    # Re-exported from rounds_common (used by training and tests).
    'DOWNLOAD_ACCOUNTING', 'DOWNLOAD_STREAM', 'UPLOAD_STREAM', 'batch_hparams',
    'num_params',
]


DP = privacy.DPSettings
"""DP-FedAvg's settings: :class:`fedlite_jax.privacy.DPSettings` (McMahan
et al. 2018, Alg. 1; adaptive clipping: Andrew et al. 2021, Alg. 1)."""


def dp_mean(dp: DP, seed: int, round_num: jax.Array, clip_norm: jax.Array,
            sums: PyTree, norms: Optional[jax.Array] = None,
            kept: Optional[jax.Array] = None) -> tuple[PyTree, jax.Array]:
  """``(noised mean, next C)`` of :func:`privacy.dp_noised_mean` with the
  round's key :func:`privacy.dp_round_key` (``seed``, ``round_num``).

  Args:
    dp: the settings (static); seed: the run seed; round_num: ``int32[]``.
    clip_norm: ``float32[]``, this round's ``C``.
    sums: the clipped deltas' sum (weight 1 per client).
    norms, kept: ``float32[W]`` pre-clip norms and kept flags (adaptive
      clipping).

  Returns:
    The noised mean (``sums``' structure) and the next ``float32[]`` C.
  """
  out = privacy.dp_noised_mean(dp, sums, privacy.dp_round_key(seed, round_num),
                               clip_norm, norms, kept)
  return out.mean, out.clip_norm


def _clip_decoded(compress: Callable, dp: DP, shared, client_input, delta,
                  mask):
  """``compress``, then the decoded delta clipped to ``shared['clip_norm']``
  (diagnostics ``dp_norm`` before clipping, ``dp_clipped`` 0/1)."""
  del dp  # C is the state's.
  out, diag = compress(shared, client_input, delta, mask)
  c = shared['clip_norm']
  clipped, norm = privacy.clip_by_global_norm(out['delta'], c)
  return {**out, 'delta': clipped}, {
      **diag, 'dp_norm': norm, 'dp_clipped': (norm > c).astype(jnp.float32)}


def _secure_encode(compress: Callable, ddp: privacy.DistributedDP, shared,
                   client_input, delta, mask):
  """``compress``, then :func:`privacy.encode_update` of the delta (key:
  the client's ``rng`` folded with ``DP_STREAM``)."""
  out, diag = compress(shared, client_input, delta, mask)
  sent, ddiag = privacy.encode_update(
      ddp, out['delta'], shared['dp_round_key'],
      jax.random.fold_in(client_input['rng'], DP_STREAM))
  return {**out, 'delta': sent}, {**diag, **ddiag}


def _check_options(fedprox_mu: float, weighting: str,
                   compression: Compression, dp: Optional[DP]) -> None:
  """One-line ValueErrors for a bad ``fedprox_mu`` or DP setting."""
  if not fedprox_mu >= 0:
    raise ValueError(f'fedprox_mu must be >= 0, got {fedprox_mu!r}.')
  if dp is None:
    return
  dp.check()
  if isinstance(dp, privacy.DistributedDP):
    if weighting != 'uniform' or compression.upload is not None:
      raise ValueError(
          'distributed DP needs uniform weighting and no upload transform '
          "(secure aggregation's B-bit integers replace it); got weighting="
          f'{weighting!r}, upload={compression.upload!r}.')
    return
  if weighting != 'uniform' or compression.pvt_fraction < 1:
    raise ValueError('DP-FedAvg needs uniform weighting and no PVT (a '
                     f'fixed denominator); got weighting={weighting!r}, '
                     f'pvt_fraction={compression.pvt_fraction}.')


def _client_update(r: CompressedRound, grad_fn: rc.GradFn,
                   client_optimizer: optax.GradientTransformation,
                   fedprox_mu: float, dp: Optional[DP], engine: str,
                   engine_options: dict[str, Any]):
  """The round engine of the clients' local steps and upload (the decoded
  delta clipped to ``C`` in the final step with ``dp``)."""
  compress = r.compress if dp is None else functools.partial(
      _secure_encode if isinstance(dp, privacy.DistributedDP) else
      _clip_decoded, r.compress, dp)
  return make_engine(engine, rc.delta_client_program(
      grad_fn, client_optimizer, compress, fedprox_mu=float(fedprox_mu),
      plan=r.plan), **engine_options)


def _server_update(r: CompressedRound,
                   server_optimizer: optax.GradientTransformation,
                   dp: Optional[DP], seed: int) -> Callable:
  """The jitted ``(state, sums, weights[, norms, kept]) -> (new state,
  finite)``: aggregation (per-leaf mean, or :func:`dp_mean`), then the
  server optimizer's step."""

  @jax.jit
  def server_update(state, sums, weights, norms=None, kept=None):
    if dp is None:
      mean = per_leaf_mean(sums, weights)
    elif isinstance(dp, privacy.DistributedDP):
      mean, wrapped = privacy.decode_sum(
          dp, sums, privacy.dp_round_key(seed, state.round), state.params)
      c, state = state.clip_norm, state.replace(wrapped_fraction=wrapped)
    else:
      mean, c = dp_mean(dp, seed, state.round, state.clip_norm, sums, norms,
                        kept)
    updates, opt_state = server_optimizer.update(mean, state.opt_state,
                                                 state.params)
    new_state = state.replace(params=optax.apply_updates(state.params,
                                                         updates),
                              opt_state=opt_state)
    if dp is not None:
      new_state = new_state.replace(clip_norm=c)
    new_state = r.with_changes(state, new_state)
    return new_state, nonfinite_lib.all_finite(new_state)

  return server_update


def _init_state(r: CompressedRound,
                server_optimizer: optax.GradientTransformation,
                dp: Optional[DP], params: Params) -> FedOptState:
  """Round 0's state (a :class:`DPFedOptState` at ``dp.clip_norm`` with
  ``dp``) on the first device."""
  state = r.init_state(params, server_optimizer.init(params))
  if dp is not None:
    fields = {f.name: getattr(state, f.name) for f in
              dataclasses.fields(state)}
    if isinstance(dp, privacy.DistributedDP):
      if dp.size != num_params(params):
        raise ValueError(f'the distributed DP size {dp.size} must be the '
                         f"model's number of parameters {num_params(params)}.")
      state = DDPFedOptState(**fields, clip_norm=jnp.float32(dp.clip_norm),
                             wrapped_fraction=jnp.float32(0))
    else:
      state = DPFedOptState(**fields, clip_norm=jnp.float32(dp.clip_norm))
  return rc.on_first_device(state)


def federated_averaging(
    grad_fn: rc.GradFn, client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams, *,
    fedprox_mu: float = 0.0, compression: Compression = Compression(),
    weighting: str = 'examples', download_accounting: str = 'dense',
    client_ids: Optional[Sequence[bytes]] = None, seed: int = 0,
    name: Optional[str] = None, nonfinite: str = 'raise', engine: str = 'auto',
    dp: Optional[Union[DP, privacy.DistributedDP]] = None,
    **engine_options) -> fedjax.FederatedAlgorithm:
  """FedAvg / FedAdam / FedProx, optionally compressed, as one FedOpt round.

  The entry point of every delta-based method, named as
  ``fedjax.algorithms.fed_avg.federated_averaging`` (same first four
  arguments; equal to it without the keyword options). The server optimizer
  steps on the mean ``Q(w) - w_client`` (Reddi et al. 2021, Alg. 2):

  * FedAvg: ``server_optimizer=optax.sgd(1.0)``; FedAdam: ``optax.adam``.
  * FedProx (Li et al. 2020, Alg. 2): ``fedprox_mu > 0``.
  * Quantized / PVT uploads and downloads (Ro et al. 2022, Sec. 4-6):
    ``compression=Compression(upload=..., download=..., pvt_fraction=...)``.
  * DP-FedAvg (McMahan et al. 2018, Alg. 1; adaptive clipping: Andrew et
    al. 2021, Alg. 1): ``dp=DP(...)``, ``weighting='uniform'``: each decoded
    upload clipped to ``C``; the server steps on
    :func:`fedlite_jax.privacy.dp_noised_mean` of the sum.
  * Distributed DP under secure aggregation (Kairouz et al. 2021, Alg. 1-2;
    Agarwal et al. 2021): ``dp=privacy.DistributedDP(...)``, uniform
    weights, no upload transform (PVT allowed); clients upload
    :func:`privacy.encode_update` (``B * d`` bits), the server steps on
    :func:`privacy.decode_sum` (keys: ``seed`` and the round).
  * IGC's baselines (Melas-Kyriazi & Wang 2022, Table 2: SGD, FedAvg with
    s local iterations, local Top-K): ``client_batch_hparams`` of s steps
    (:func:`~fedlite_jax.algorithms.rounds_common.batch_hparams`),
    ``weighting='uniform'``, ``Compression(upload=transforms.top_k(k))``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` of the mean batch loss.
    client_optimizer: optax transformation of the local steps.
    server_optimizer: applied to the mean delta (``optax.sgd(1.0)``: FedAvg;
      ``optax.adam(...)``: FedAdam).
    client_batch_hparams: local batching (``seed=None``: from the key).
    fedprox_mu: FedProx's ``mu >= 0`` (0: FedAvg's local steps).
    compression: upload / download chains and PVT.
    weighting, download_accounting, client_ids, seed, nonfinite: as
      :class:`CompressedRound`.
    name: the algorithm's name in messages (default ``'fedprox'`` if
      ``fedprox_mu > 0``, else ``'fedavg'``).
    engine, engine_options: :func:`fedlite_jax.rounds.make_engine`'s.
    dp: central DP-FedAvg's :class:`DP`, a
      :class:`fedlite_jax.privacy.DistributedDP` (its ``size`` the model's
      number of parameters), or None (no DP).

  Returns:
    ``FederatedAlgorithm(init, apply)`` over :class:`FedOptState`;
    diagnostics ``upload_bits``, ``download_bits``, ``num_examples`` (local
    steps x batch size under ``'uniform'``), ``delta_l2_norm``, ``finite``,
    ``skipped``; under PVT ``pvt_trained_fraction``, ``pvt_mask`` (bool per
    variable); with ``dp`` ``dp_norm`` (decoded delta, before clipping) and
    ``dp_clipped`` (0/1), the state a :class:`DPFedOptState`; with a
    distributed ``dp`` also ``dp_rounding_draws``, the state a
    :class:`DDPFedOptState`.

  Raises:
    ValueError: an unknown choice, ``fedprox_mu`` < 0, bad DP settings, a
      missing ``client_ids``, bad PVT or transform settings (at ``init``).
    FloatingPointError: from ``apply``: a non-finite update (``'raise'``),
      every update non-finite (``'skip'``), or a non-finite server state.
  """
  _check_options(fedprox_mu, weighting, compression, dp)
  if name is None:
    name = 'fedprox' if fedprox_mu else 'fedavg'
  r = CompressedRound(compression, name, seed, weighting, download_accounting,
                      client_ids, nonfinite, _secure_bits(dp))
  train = _client_update(r, grad_fn, client_optimizer, fedprox_mu, dp,
                         engine, engine_options)
  server_update = _server_update(r, server_optimizer, dp, seed)
  return fedjax.FederatedAlgorithm(
      lambda params: _init_state(r, server_optimizer, dp, params),
      functools.partial(_apply, r, train, server_update,
                        client_batch_hparams, dp, seed))


def _secure_bits(dp: Any) -> Optional[float]:
  """Upload bits per client of a distributed ``dp`` (``B * d``), else None."""
  if isinstance(dp, privacy.DistributedDP):
    return float(dp.bits * dp.dim)
  return None


def _apply(r: CompressedRound, train, server_update: Callable,
           client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
           dp: Any, seed: int, state: FedOptState, clients: rc.Clients):
  """:func:`federated_averaging`'s ``apply``: the clients' shared input
  (``Q(w)``, and C or the round's secure-sum key under DP), then
  :meth:`CompressedRound.apply`."""
  secure = isinstance(dp, privacy.DistributedDP)
  dp_c = {} if dp is None else {'clip_norm': state.clip_norm}
  if secure:
    dp_c = {'dp_round_key': privacy.dp_round_key(seed, int(state.round))}
  return r.apply(state, clients, client_batch_hparams,
                 lambda sent, work: [(train, {'params': sent, **dp_c}, work)],
                 server_update, dp_norms=dp is not None and not secure)
