"""One FedOpt round for every delta-based method: :func:`federated_averaging`.

Source: Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2;
local steps of FedAvg (McMahan et al. 2017, Alg. 1) or FedProx (Li et al.
2020, Alg. 2); upload / download chains and PVT as in Ro et al. 2022, Sec. 4.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import privacy
from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.algorithms import rounds_common as rc
from fedlite_jax.algorithms.rounds_common import (  # noqa: F401
    DOWNLOAD_ACCOUNTING, DOWNLOAD_STREAM, batch_hparams, num_params,
    UPLOAD_STREAM)
from fedlite_jax.rounds import make_engine
from fedlite_jax.transforms import pvt as pvt_lib
from fedlite_jax.common import PyTree

Params = Any

__all__ = [
    'Compression', 'CompressedRound', 'DP', 'DPFedOptState', 'FedOptState',
    'dp_mean', 'federated_averaging',
    # Re-exported from rounds_common (used by training and tests).
    'DOWNLOAD_ACCOUNTING', 'DOWNLOAD_STREAM', 'UPLOAD_STREAM', 'batch_hparams',
    'num_params',
]


@dataclasses.dataclass(frozen=True)
class Compression:
  """Communication settings of a FedOpt round.

  Transforms must be stateless or read-only (``transforms.init_read_only``).

  Attributes:
    download: CommTransform of the model sent (clients start from the
      decoded ``Q(w)``); None: 32 bits per float.
    upload: CommTransform of each client's delta (under PVT its size must
      be a sum over variables); None: 32 bits per float.
    pvt_fraction: trainable share of the parameters per client, in (0, 1];
      1 = no PVT.
    pvt_freezable: ``(key path, leaf) -> bool``: what PVT may freeze.
  """
  download: Optional[tx.CommTransform] = None
  upload: Optional[tx.CommTransform] = None
  pvt_fraction: float = 1.0
  pvt_freezable: Callable[[Any, Any], bool] = pvt_lib.is_multiplicative


@fedjax.dataclass
class FedOptState:
  """Server state of a FedOpt (or MimeLite) round.

  Attributes:
    params: the server model (full precision).
    opt_state: the server (MimeLite: base) optimizer's state.
    round: ``int32[]``, rounds completed.
    last_changed: ``int32[D]``, last round that changed each weight (-1:
      never), ``jax.tree.leaves`` order; ``int32[0]`` unless ``'changed'``.
    last_round: ``int32[N]``, each training client's last round (-1: never);
      ``int32[0]`` without ``client_ids``.
  """
  params: Params
  opt_state: optax.OptState
  round: jax.Array
  last_changed: jax.Array
  last_round: jax.Array


@fedjax.dataclass
class DPFedOptState(FedOptState):
  """:class:`FedOptState` of DP-FedAvg, plus ``clip_norm``: float32[], the
  clip norm ``C`` of the next round (adaptive clipping moves it)."""
  clip_norm: jax.Array


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


def _clip_decoded(compress: Callable, shared, client_input, delta, mask):
  """``compress``, then the decoded delta clipped to ``shared['clip_norm']``
  (diagnostics ``dp_norm`` before clipping, ``dp_clipped`` 0/1)."""
  out, diag = compress(shared, client_input, delta, mask)
  c = shared['clip_norm']
  clipped, norm = privacy.clip_by_global_norm(out['delta'], c)
  return {**out, 'delta': clipped}, {
      **diag, 'dp_norm': norm, 'dp_clipped': (norm > c).astype(jnp.float32)}


def encode_decode(transform: Optional[tx.CommTransform], state: Any,
                  tree: PyTree, key: jax.Array) -> PyTree:
  """``tree`` as the receiver decodes it (``tree`` itself for None)."""
  if transform is None:
    return tree
  message, _ = transform.encode(tree, state, key)
  return transform.decode(message, state)[0]


def per_leaf_mean(sums: PyTree, weights: jax.Array) -> PyTree:
  """Each leaf of ``sums`` over its weight ``weights[i]`` (0 where 0)."""
  leaves, treedef = jax.tree.flatten(sums)
  return jax.tree.unflatten(treedef, [
      jnp.where(weights[i] > 0, x / jnp.where(weights[i] > 0, weights[i], 1.0),
                jnp.zeros_like(x)) for i, x in enumerate(leaves)])


class _Setup:
  """Per-model static pieces (transform states, bits, PVT plan)."""

  def __init__(self, compression: Compression, params: Params, name: str):
    example = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
        params)
    self.spec = tx.TreeSpec.of(params)
    self.plan = pvt_lib.make_plan(params, compression.pvt_fraction,
                                  compression.pvt_freezable)
    self.states, self.bits = {}, {}
    for what in ('download', 'upload'):
      transform = getattr(compression, what)
      state = None if transform is None else tx.init_read_only(
          transform, example, f'{name}: the {what} transform')
      self.states[what] = state
      self.bits[what] = float(tx.message_bits(
          transform or tx.identity(), example, state))
    # Per-variable sizes: under PVT only.
    self.leaf_bits = None if self.plan.trains_everything else (
        pvt_lib.leaf_bits(compression.upload, params, name))

  def upload_bits(self, mask: Optional[np.ndarray]) -> float:
    return (self.bits['upload'] if self.leaf_bits is None else
            pvt_lib.masked_bits(self.leaf_bits, mask))


class CompressedRound:
  """The compression, accounting and bookkeeping FedOpt and MimeLite share.

  Args:
    compression: upload / download chains and PVT.
    name: the algorithm's name in messages.
    seed: run seed (keys the download quantizer).
    weighting: ``'examples'`` or ``'uniform'`` client weights.
    download_accounting: ``'dense'`` or ``'changed'`` (needs ``client_ids``,
      no download transform).
    client_ids: the training clients' ids.
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).

  Raises:
    ValueError: an unknown choice or a missing ``client_ids``.
  """

  def __init__(self, compression: Compression, name: str, seed: int,
               weighting: str, download_accounting: str,
               client_ids: Optional[Sequence[bytes]], nonfinite: str):
    rc.check_choice(weighting, rc.WEIGHTINGS, 'weighting')
    rc.check_choice(download_accounting, DOWNLOAD_ACCOUNTING,
                    'download_accounting')
    nonfinite_lib.check_policy(nonfinite)
    self.index = rc.client_id_index(client_ids)
    if download_accounting == 'changed' and (
        not self.index or compression.download):
      raise ValueError("download_accounting='changed' needs the training "
                       'client_ids and no download transform.')
    self.compression, self.name, self.seed = compression, name, seed
    self.weighting, self.accounting = weighting, download_accounting
    self.nonfinite = nonfinite
    self.track_changes = download_accounting == 'changed'
    self.s: Optional[_Setup] = None
    self.download = jax.jit(self._download)

  def setup(self, params: Params) -> _Setup:
    """Transform states and PVT plan for ``params``' structure (cached)."""
    if self.s is None or self.s.spec != tx.TreeSpec.of(params):
      self.s = _Setup(self.compression, params, self.name)
    return self.s

  def plan(self) -> pvt_lib.PVTPlan:
    """The PVT plan of the last :meth:`setup` (variables PVT may freeze)."""
    return self.s.plan

  def ones(self) -> jax.Array:
    """``bool[num_leaves]`` all True: the mask of a client without PVT."""
    return jnp.ones((len(self.s.plan.sizes),), bool)

  def upload(self, tree: PyTree, key: jax.Array,
             mask: Optional[jax.Array]) -> tuple[PyTree, jax.Array]:
    """``(decoded upload, bool[num_leaves] mask)`` of one client."""
    transform, state = self.compression.upload, self.s.states['upload']
    if mask is None:
      return encode_decode(transform, state, tree, key), self.ones()
    return pvt_lib.masked_upload(transform, state, tree, mask, key), mask

  def compress(self, shared, client_input, delta, mask):
    """The delta's upload: ``{'delta', 'mask': float per variable}``."""
    del shared
    sent, mask = self.upload(
        delta, jax.random.fold_in(client_input['rng'], UPLOAD_STREAM), mask)
    return ({'delta': sent, 'mask': mask.astype(jnp.float32)},
            {'mask': mask})

  def _download(self, params, round_num):
    key = jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(self.seed), DOWNLOAD_STREAM),
        round_num)
    return encode_decode(self.compression.download,
                         self.s.states['download'], params, key)

  def init_state(self, params: Params, opt_state: Any) -> FedOptState:
    """Round 0's :class:`FedOptState` (change / participation trackers -1)."""
    s = self.setup(params)
    return FedOptState(
        params=params, opt_state=opt_state, round=jnp.zeros((), jnp.int32),
        last_changed=jnp.full((s.spec.size if self.track_changes else 0,),
                              -1, jnp.int32),
        last_round=jnp.full((len(self.index),), -1, jnp.int32))

  def with_changes(self, state: FedOptState,
                   new_state: FedOptState) -> FedOptState:
    """``new_state`` with ``last_changed`` updated (jittable)."""
    if not self.track_changes:
      return new_state
    spec = tx.TreeSpec.of(state.params)
    return new_state.replace(last_changed=rc.mark_changed(
        state.last_changed, spec.ravel(state.params),
        spec.ravel(new_state.params), state.round))

  def apply(self, state: FedOptState, clients: rc.Clients,
            hparams: fedjax.ShuffleRepeatBatchHParams, passes: Callable,
            server_update: Callable, extra_download_bits: float = 0.0,
            upload_factor: int = 1, dp_norms: bool = False):
    """One round: download, client passes, non-finite policy, server update.

    Args:
      state, clients: as ``FederatedAlgorithm.apply``.
      hparams: local batching of the training pass.
      passes: ``(Q(w), work) -> [(engine, shared input, work)]``, training
        pass first; each output is ``{'delta', 'mask'}``.
      server_update: ``(state, delta sum, mask sum, ...) -> (new state,
        finite)`` over the passes' sums in order; jittable: it runs with
        the participation bookkeeping as one compiled program
        (:func:`rounds_common.server_update`).
      extra_download_bits: added to the dense download (bits).
      upload_factor: uploads per client (the delta's bits each).
      dp_norms: also pass ``server_update`` the clients' ``dp_norm``
        diagnostics and kept flags (``float32[W]`` each; DP-FedAvg).

    Returns:
      ``(new state, diagnostics)`` as :func:`federated_averaging`; a client
      is skipped when any of its passes is not finite.
    """
    s = self.setup(state.params)
    round_num = int(state.round)
    work = rc.make_work(clients, hparams, self.weighting)
    positions = rc.client_positions(self.index, work)
    down = rc.download_bits(
        self.accounting, s.bits['download'] + extra_download_bits, len(work),
        state.last_changed, state.last_round, positions)
    runs = passes(self.download(state.params, state.round), work)
    results = [eng(shared, ws) for eng, shared, ws in runs]
    ok = [[bool(d['finite']) for d in res.diagnostics] for res in results]
    skipped = nonfinite_lib.resolve(
        [w.client_id for w in work], [all(f) for f in zip(*ok)],
        self.nonfinite, self.name, round_num)
    sums = [res.weighted_sum for res in results]
    # A client skipped for another pass only is still in this pass's sum:
    # rerun this pass without the skipped clients (rare).
    for i, ((eng, shared, ws), flags) in enumerate(zip(runs, ok)):
      if any(f for w, f in zip(ws, flags) if w.client_id in skipped):
        sums[i] = eng(shared, [w for w in ws if w.client_id not in skipped]
                      ).weighted_sum
    args = [x for total in sums for x in (total['delta'], total['mask'])]
    if dp_norms:
      args += [np.asarray([d['dp_norm'] for d in results[0].diagnostics],
                          np.float32),
               np.asarray([w.client_id not in skipped for w in work],
                          np.float32)]
    new_state, finite = rc.server_update(server_update, state, positions,
                                         *args)
    nonfinite_lib.check_server_state(finite, self.name, skipped, round_num)
    extra = None
    if not s.plan.trains_everything:
      extra = lambda d: {  # noqa: E731
          'pvt_mask': np.asarray(d['mask'], bool),
          'pvt_trained_fraction': pvt_lib.realized_fraction(
              s.plan, np.asarray(d['mask'], bool))}
    diagnostics = rc.client_diagnostics(
        work, results[0], download=down, skipped=skipped, extra=extra,
        num_examples=[w.weight if self.weighting == 'examples' else
                      len(w.batches) * hparams.batch_size for w in work],
        upload_bits=lambda d: upload_factor * s.upload_bits(
            np.asarray(d['mask'], bool)))
    for flags in ok[1:]:
      for w, f in zip(work, flags):
        diagnostics[w.client_id]['finite'] &= f
    return new_state, diagnostics


def _check_options(fedprox_mu: float, weighting: str,
                   compression: Compression, dp: Optional[DP]) -> None:
  """One-line ValueErrors for a bad ``fedprox_mu`` or DP setting."""
  if not fedprox_mu >= 0:
    raise ValueError(f'fedprox_mu must be >= 0, got {fedprox_mu!r}.')
  if dp is None:
    return
  dp.check()
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
  compress = r.compress if dp is None else functools.partial(_clip_decoded,
                                                             r.compress)
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
    state = DPFedOptState(**{f.name: getattr(state, f.name) for f in
                             dataclasses.fields(state)},
                          clip_norm=jnp.float32(dp.clip_norm))
  return rc.on_first_device(state)


def federated_averaging(
    grad_fn: rc.GradFn, client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams, *,
    fedprox_mu: float = 0.0, compression: Compression = Compression(),
    weighting: str = 'examples', download_accounting: str = 'dense',
    client_ids: Optional[Sequence[bytes]] = None, seed: int = 0,
    name: Optional[str] = None, nonfinite: str = 'raise', engine: str = 'auto',
    dp: Optional[DP] = None, **engine_options) -> fedjax.FederatedAlgorithm:
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
    al. 2021, Alg. 1): ``dp=DP(...)``, ``weighting='uniform'``. Each
    client's decoded upload is clipped to ``C`` in its final step; the
    server runs :func:`fedlite_jax.privacy.dp_noised_mean` on the sum (key
    :func:`~fedlite_jax.privacy.dp_round_key` of ``seed`` and the round)
    and steps the server optimizer on the noised mean.
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
    dp: DP-FedAvg's settings, or None (no DP).

  Returns:
    ``FederatedAlgorithm(init, apply)`` over :class:`FedOptState`;
    diagnostics ``upload_bits``, ``download_bits``, ``num_examples`` (local
    steps x batch size under ``'uniform'``), ``delta_l2_norm``, ``finite``,
    ``skipped``; under PVT ``pvt_trained_fraction``, ``pvt_mask`` (bool per
    variable); with ``dp`` ``dp_norm`` (decoded delta, before clipping) and
    ``dp_clipped`` (0/1), the state a :class:`DPFedOptState`.

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
                      client_ids, nonfinite)
  train = _client_update(r, grad_fn, client_optimizer, fedprox_mu, dp,
                         engine, engine_options)
  server_update = _server_update(r, server_optimizer, dp, seed)

  def apply(state: FedOptState, clients: rc.Clients):
    dp_c = {} if dp is None else {'clip_norm': state.clip_norm}
    return r.apply(state, clients, client_batch_hparams,
                   lambda sent, work: [(train, {'params': sent, **dp_c}, work)],
                   server_update, dp_norms=dp is not None)

  return fedjax.FederatedAlgorithm(
      lambda params: _init_state(r, server_optimizer, dp, params), apply)
