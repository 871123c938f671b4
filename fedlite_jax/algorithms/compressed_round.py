"""The compression, accounting and bookkeeping FedOpt and MimeLite share:
:class:`CompressedRound`, its :class:`Compression` settings and the server
states (:class:`FedOptState` and its DP forms).

Source: Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2;
upload / download chains and PVT as in Ro et al. 2022, Sec. 4.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.algorithms import rounds_common as rc
from fedlite_jax.algorithms.rounds_common import (
    DOWNLOAD_ACCOUNTING, DOWNLOAD_STREAM, UPLOAD_STREAM)
from fedlite_jax.transforms import pvt as pvt_lib
from fedlite_jax.common import PyTree

Params = Any

__all__ = [
    'Compression', 'CompressedRound', 'DDPFedOptState', 'DPFedOptState',
    'FedOptState', 'encode_decode', 'per_leaf_mean',
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


@fedjax.dataclass
class DDPFedOptState(DPFedOptState):
  """:class:`DPFedOptState` of distributed DP, plus ``wrapped_fraction``:
  float32[], the share of the last secure sum's coordinates that wrapped
  around the modulus (:func:`fedlite_jax.privacy.wrapped_fraction`)."""
  wrapped_fraction: jax.Array


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

  def __init__(self, compression: Compression, params: Params, name: str,
               upload_bits: Optional[float] = None):
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
    if upload_bits is not None:  # Secure aggregation's B * d per client.
      self.bits['upload'], self.leaf_bits = float(upload_bits), None

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
    upload_bits: fixed upload bits per client (distributed DP's ``B * d``),
      or None: the upload chain's.

  Raises:
    ValueError: an unknown choice or a missing ``client_ids``.
  """

  def __init__(self, compression: Compression, name: str, seed: int,
               weighting: str, download_accounting: str,
               client_ids: Optional[Sequence[bytes]], nonfinite: str,
               upload_bits: Optional[float] = None):
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
    self.nonfinite, self.fixed_upload_bits = nonfinite, upload_bits
    self.track_changes = download_accounting == 'changed'
    self.s: Optional[_Setup] = None
    self.download = jax.jit(self._download)

  def setup(self, params: Params) -> _Setup:
    """Transform states and PVT plan for ``params``' structure (cached)."""
    if self.s is None or self.s.spec != tx.TreeSpec.of(params):
      self.s = _Setup(self.compression, params, self.name,
                      self.fixed_upload_bits)
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
