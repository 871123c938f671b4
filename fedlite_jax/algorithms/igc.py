"""Intrinsic gradient compression: static, K-subspace, time-varying, both.

Source: Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022): Algorithm 1 (static), Algorithm 2 (K-subspace), Algorithm 3
(time-varying), Section 3.2 (K-subspace + time-varying), Table 1 (bandwidth).
Server: ``params = base + sum_k A_e^(k) sigma_k``; clients upload
``A_e^(k)T delta`` for one random subspace ``k``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import privacy, transforms as tx
from fedlite_jax.algorithms import (
    fedopt, rounds_common as rc, nonfinite as nonfinite_lib)
from fedlite_jax.transforms import fastfood as ff
from fedlite_jax.rounds import make_engine
from fedlite_jax.common import DP_STREAM, FLOAT_BITS

Params = Any

IGC_DOWNLOAD_ACCOUNTING = ('table1', 'exact')

__all__ = [
    'DDPIGCState', 'DPIGCState', 'IGC_DOWNLOAD_ACCOUNTING', 'IGCState',
    'default_rounds_per_epoch', 'igc_client_bits', 'igc_download_bits',
    'igc_upload_bits', 'igc_vectors_needed',
    'intrinsic_gradient_compression']


@fedjax.dataclass
class IGCState:
  """Server state of intrinsic gradient compression.

  Attributes:
    params: the model ``base + sum_k A_e^(k) sigma_k`` (float32).
    base: theta at the start of the current epoch (theta_0 without TV).
    sigma: ``float32[K, d]``, the current epoch's intrinsic coordinates.
    opt_state: server optimizer state over ``sigma``.
    epoch: ``int32[]``, the current epoch (0 without TV).
    round: ``int32[]``, rounds completed.
    last_epoch: ``int32[N]``, each training client's last epoch (-1: never).
  """
  params: Params
  base: Params
  sigma: jax.Array
  opt_state: optax.OptState
  epoch: jax.Array
  round: jax.Array
  last_epoch: jax.Array


@fedjax.dataclass
class DPIGCState(IGCState):
  """:class:`IGCState` of DP in the subspace, plus ``clip_norm``:
  float32[], the clip norm ``C`` of the next round (as
  :class:`fedopt.DPFedOptState`)."""
  clip_norm: jax.Array


@fedjax.dataclass
class DDPIGCState(DPIGCState):
  """:class:`DPIGCState` of distributed DP in the subspace, plus
  ``wrapped_fraction`` (as :class:`fedopt.DDPFedOptState`)."""
  wrapped_fraction: jax.Array


def default_rounds_per_epoch(num_train_clients: int,
                             clients_per_round: int) -> int:
  """One epoch = one pass over the clients: ``ceil(N / W)`` rounds."""
  n = rc.check_int(num_train_clients, 'num_train_clients')
  w = rc.check_int(clients_per_round, 'clients_per_round')
  return -(-n // w)


def igc_vectors_needed(epoch: int, last_epoch: int, time_varying: bool) -> int:
  """Epochs' worth of ``Sigma`` vectors a client needs to reconcile exactly.

  Args:
    epoch: the current epoch e.
    last_epoch: the client's last participation epoch p (-1: never).
    time_varying: the TV variant (else 1).

  Returns:
    With TV ``e - max(p, 0) + 1`` (``Sigma_p^final`` ... ``Sigma_e^current``).

  Raises:
    ValueError: ``e < 0``, ``p < -1`` or ``p > e`` (with TV).
  """
  if not time_varying:
    return 1
  if epoch < 0 or last_epoch < -1 or last_epoch > epoch:
    raise ValueError(f'Bad epochs: epoch={epoch}, last_epoch={last_epoch}.')
  return epoch - max(last_epoch, 0) + 1


def igc_upload_bits(d: int, num_subspaces: int = 1, *,
                    value_bits: Optional[float] = None,
                    count_index_bits: bool = True) -> float:
  """Upload bits of one client-round: ``32 d`` (or ``value_bits``) + index.

  Args:
    value_bits: the d coordinates as sent (default ``32 d``).
    count_index_bits: add ``ceil(log2 K)`` for the subspace index.

  Raises:
    ValueError: d < 1 or K < 1.
  """
  d = rc.check_int(d, 'intrinsic_dim (d)')
  k_bits = tx.index_bits(num_subspaces) if count_index_bits else 0
  return float((FLOAT_BITS * d if value_bits is None else value_bits) + k_bits)


def igc_download_bits(D: int, d: int, num_subspaces: int = 1,
                      time_varying: bool = False, *, accounting: str = 'table1',
                      vectors: int = 1) -> float:
  """Download bits of one client-round (Table 1, or exact reconciliation).

  Args:
    accounting: ``'table1'``: ``32 d K`` (x2 with TV); ``'exact'``: ``32
      min(vectors d K, D)``, ``vectors`` from :func:`igc_vectors_needed`.

  Raises:
    ValueError: bad sizes or accounting.
  """
  D = rc.check_int(D, 'D')
  d = rc.check_int(d, 'intrinsic_dim (d)')
  K = rc.check_int(num_subspaces, 'num_subspaces (K)')
  rc.check_choice(accounting, IGC_DOWNLOAD_ACCOUNTING, 'download_accounting')
  if accounting == 'table1':
    return float(FLOAT_BITS * d * K * (2 if time_varying else 1))
  vectors = rc.check_int(vectors, 'vectors')
  return float(FLOAT_BITS * min(vectors * d * K, D))


def igc_client_bits(D: int, d: int, num_subspaces: int = 1,
                    time_varying: bool = False, *, accounting: str = 'table1',
                    epoch: int = 0, last_epoch: int = -1,
                    value_bits: Optional[float] = None,
                    count_index_bits: bool = True) -> dict[str, float]:
  """``{'upload_bits', 'download_bits'}`` of one client in one round.

  Arguments as :func:`igc_upload_bits`, :func:`igc_download_bits` and
  :func:`igc_vectors_needed`.
  """
  vectors = igc_vectors_needed(epoch, last_epoch, time_varying)
  return {'upload_bits': igc_upload_bits(d, num_subspaces,
                                         value_bits=value_bits,
                                         count_index_bits=count_index_bits),
          'download_bits': igc_download_bits(
              D, d, num_subspaces, time_varying, accounting=accounting,
              vectors=vectors)}


class _Setup(NamedTuple):
  """IGC's checked settings, shared by its client and server steps."""
  name: str
  d: int
  K: int
  time_varying: bool
  rounds_per_epoch: Optional[int]
  index: dict[bytes, int]
  hparams: fedjax.ShuffleRepeatBatchHParams
  projection: tx.CommTransform
  upload_transform: Optional[tx.CommTransform]
  tail_state: Any
  value_bits: Optional[float]
  count_index_bits: bool
  download_accounting: str
  nonfinite: str
  project_on_server: bool
  server_optimizer: optax.GradientTransformation
  dp: Optional[fedopt.DP]
  dp_seed: int
  subspaces: Callable[[int, int], ff.FastfoodParams]  # (D, epoch), cached.


def _setup(intrinsic_dim, num_subspaces, time_varying, rounds_per_epoch,
           client_ids, download_accounting, nonfinite, batch_size,
           local_steps, seed, scale, count_index_bits, upload_transform,
           project_on_server, server_optimizer, dp, dp_seed) -> _Setup:
  """Checks :func:`intrinsic_gradient_compression`'s arguments (its
  ValueErrors) and returns them resolved."""
  d = rc.check_int(intrinsic_dim, 'intrinsic_dim (d)')
  K = rc.check_int(num_subspaces, 'num_subspaces (K)')
  rc.check_choice(download_accounting, IGC_DOWNLOAD_ACCOUNTING,
                  'download_accounting')
  nonfinite_lib.check_policy(nonfinite)
  if time_varying:
    if rounds_per_epoch is None:
      raise ValueError('time_varying=True needs rounds_per_epoch (one epoch '
                       '= one pass over the clients).')
    rounds_per_epoch = rc.check_int(rounds_per_epoch, 'rounds_per_epoch')
  index = rc.client_id_index(client_ids)
  if download_accounting == 'exact' and not index:
    raise ValueError("download_accounting='exact' needs the training "
                     'client_ids.')
  hparams = rc.batch_hparams(batch_size, local_steps)
  projection = tx.intrinsic_projection(d, K, seed, scale, count_index_bits)
  coord_shape = jax.ShapeDtypeStruct((d,), jnp.float32)
  tail_state = value_bits = None
  if upload_transform is not None:
    tail_state = upload_transform.init(coord_shape)
    if jax.tree.leaves(tail_state):
      raise ValueError('upload_transform must be stateless (client state is '
                       'not kept between participations).')
    value_bits = tx.message_bits(upload_transform, coord_shape, tail_state)
  if project_on_server and upload_transform is not None:
    raise ValueError('project_on_server needs a linear upload: it cannot be '
                     'combined with upload_transform (e.g. quantized '
                     'coordinates); drop one of them.')
  name = {(False, False): 'igc_static', (True, False): 'igc_k_subspace',
          (False, True): 'igc_time_varying',
          (True, True): 'igc_k_subspace_time_varying'}[(K > 1, time_varying)]
  if isinstance(dp, privacy.DistributedDP):
    dp.check()
    if dp.size != d or upload_transform is not None:
      raise ValueError(f'distributed DP in the subspace needs size = d = {d} '
                       f'and no upload_transform; got size={dp.size}, '
                       f'upload_transform={upload_transform!r}.')
    value_bits = float(dp.bits * dp.dim)
  elif dp is not None:
    dp.noise_std(dp.clip_norm)  # Validates C, z, sizes and sigma_b.
  if dp is not None:
    if name != 'igc_static' or project_on_server:
      raise ValueError(f'DP in the subspace needs static IGC without '
                       f'project_on_server; got {name}, project_on_server='
                       f'{project_on_server}.')
  return _Setup(name, d, K, time_varying, rounds_per_epoch, index, hparams,
                projection, upload_transform, tail_state, value_bits,
                count_index_bits, download_accounting, nonfinite,
                project_on_server, server_optimizer, dp, dp_seed,
                functools.partial(_subspaces, {}, d, K, seed, scale))


def _subspaces(cache: dict, d: int, K: int, seed: int, scale: ff.Scale,
               D: int, epoch: int) -> ff.FastfoodParams:
  """The K Fastfood matrices of ``epoch`` (only the last epoch's kept)."""
  if cache.get('key') != (D, epoch):
    cache.clear()
    cache['key'] = (D, epoch)
    cache['fastfood'] = tx.make_subspaces(D, d, K, seed, epoch, scale)
  return cache['fastfood']


def _compress(s: _Setup, shared, client_input, delta, mask):
  """Client upload (Alg. 1-3): ``A_e^(k)T delta`` (then ``upload_transform``
  and DP clipping) placed in row ``k`` of ``float32[K, d]``."""
  del mask  # no PVT
  k_proj, k_tail = jax.random.split(rc.compression_key(client_input))
  msg, _ = s.projection.encode(delta, tx.IntrinsicState(shared['fastfood']),
                               k_proj)
  coords = msg.values
  if s.upload_transform is not None:
    tail_msg, _ = s.upload_transform.encode(coords, s.tail_state, k_tail)
    coords, _ = s.upload_transform.decode(tail_msg, s.tail_state)
  k = msg.side['subspace']
  diag = {'subspace': k}
  if isinstance(s.dp, privacy.DistributedDP):  # K = 1: the d-vector.
    out, ddiag = privacy.encode_update(
        s.dp, coords, shared['dp_round_key'],
        jax.random.fold_in(client_input['rng'], DP_STREAM))
    return out, {**diag, **ddiag}
  if s.dp is not None:  # Clip the decoded d coordinates (the summed ones).
    coords, norm = privacy.clip_by_global_norm(coords, shared['clip_norm'])
    diag.update(dp_norm=norm, dp_clipped=(norm > shared['clip_norm']
                                          ).astype(jnp.float32))
  out = jax.nn.one_hot(k, s.K, dtype=coords.dtype)[:, None] * coords[None, :]
  return out, diag


def _defer_projection(K: int, shared, client_input, delta, mask):
  """``project_on_server``'s upload: ``onehot(k) (x) delta`` (``delta``
  itself for K = 1); the server projects the sums (:func:`_project_sums`)."""
  del shared, mask  # no PVT
  k_proj, _ = jax.random.split(rc.compression_key(client_input))
  k = tx.sample_subspace(k_proj, K)
  if K == 1:
    return delta, {'subspace': k}
  flat = tx.TreeSpec.of(delta).ravel(delta, jnp.float32)
  out = jax.nn.one_hot(k, K, dtype=flat.dtype)[:, None] * flat[None, :]
  return out, {'subspace': k}


@functools.partial(jax.jit, static_argnums=0)
def _project_sums(K: int, fastfood, per_subspace_sums) -> jax.Array:
  """The K summed deltas projected to ``float32[K, d]``."""
  if K == 1:
    per_subspace_sums = tx.TreeSpec.of(per_subspace_sums).ravel(
        per_subspace_sums, jnp.float32)[None, :]
  return tx.project_subspaces(fastfood, per_subspace_sums)


def _server_update(s: _Setup, state, fastfood, weighted_sum, total_weight,
                   positions, epoch, norms=None, kept=None):
  """The round's epoch start (if ``epoch``, int32[], is a new one: ``base =
  params``, ``sigma = 0``, a fresh server optimizer), the server step on
  ``sigma`` and the bookkeeping (``round + 1``, the participants' last epoch
  at ``positions``, int32[W]): ``(new state, finite)``."""
  sigma = jnp.zeros_like(state.sigma)
  started = state.replace(base=state.params, sigma=sigma, epoch=epoch,
                          opt_state=s.server_optimizer.init(sigma))
  state = jax.tree.map(lambda new, old: jnp.where(epoch != state.epoch, new,
                                                  old), started, state)
  spec = tx.TreeSpec.of(state.params)
  if isinstance(s.dp, privacy.DistributedDP):  # The secure sum's mean.
    mean, wrapped = privacy.decode_sum(
        s.dp, weighted_sum, privacy.dp_round_key(s.dp_seed, state.round),
        state.sigma[0])
    mean, state = mean[None, :], state.replace(wrapped_fraction=wrapped)
  elif s.dp is not None:  # d numbers of noise on the sum, fixed denominator.
    mean, c = fedopt.dp_mean(s.dp, s.dp_seed, state.round, state.clip_norm,
                             weighted_sum, norms, kept)
    state = state.replace(clip_norm=c)
  else:
    mean = weighted_sum / total_weight
  updates, opt_state = s.server_optimizer.update(mean, state.opt_state,
                                                 state.sigma)
  sigma = optax.apply_updates(state.sigma, updates)
  params = spec.unravel(
      spec.ravel(state.base) + tx.lift_subspaces(fastfood, sigma))
  new_state = state.replace(
      params=params, sigma=sigma, opt_state=opt_state, round=state.round + 1,
      last_epoch=state.last_epoch.at[positions].set(epoch))
  return new_state, nonfinite_lib.all_finite(new_state)


def _init(s: _Setup, params: Params) -> IGCState:
  """The round-0 state (``sigma = 0``, no client seen); ValueError: d > D."""
  rc.model_spec(params, s.d, 'intrinsic_dim d')
  sigma = jnp.zeros((s.K, s.d), jnp.float32)
  fields = dict(params=params, base=params, sigma=sigma,
                opt_state=s.server_optimizer.init(sigma),
                epoch=jnp.zeros((), jnp.int32),
                round=jnp.zeros((), jnp.int32),
                last_epoch=jnp.full((len(s.index),), -1, jnp.int32))
  if s.dp is None:
    return rc.on_first_device(IGCState(**fields))
  fields['clip_norm'] = jnp.float32(s.dp.clip_norm)
  if isinstance(s.dp, privacy.DistributedDP):
    return rc.on_first_device(DDPIGCState(**fields,
                                          wrapped_fraction=jnp.float32(0)))
  return rc.on_first_device(DPIGCState(**fields))


def _apply(s: _Setup, round_engine, server_update, state: IGCState, clients):
  """One round: client steps, the (projected) sum, :func:`_server_update`
  and the clients' diagnostics (bits as :func:`igc_client_bits`)."""
  D = rc.model_spec(state.params, s.d, 'intrinsic_dim d').size
  round_num = int(state.round)
  epoch = round_num // s.rounds_per_epoch if s.time_varying else 0
  fastfood = s.subspaces(D, epoch)
  work = rc.make_work(clients, s.hparams)
  shared = {'params': state.params, 'fastfood': fastfood}
  secure = isinstance(s.dp, privacy.DistributedDP)
  if secure:
    shared['dp_round_key'] = privacy.dp_round_key(s.dp_seed, round_num)
  elif s.dp is not None:
    shared['clip_norm'] = state.clip_norm
  result = round_engine(shared, work)
  total, skipped = rc.skip_nonfinite(result, work, s.nonfinite, s.name,
                                     round_num)
  weighted_sum = result.weighted_sum
  if s.project_on_server:
    weighted_sum = _project_sums(s.K, fastfood, weighted_sum)
  positions = rc.client_positions(s.index, work)
  last_epoch = np.asarray(state.last_epoch)
  prev = ([int(last_epoch[p]) for p in positions] if s.index else
          [-1] * len(work))
  dp_args = () if s.dp is None or secure else (
      np.asarray([x['dp_norm'] for x in result.diagnostics], np.float32),
      np.asarray([w.client_id not in skipped for w in work], np.float32))
  state, finite = server_update(state, fastfood, weighted_sum,
                                np.float32(total), positions,
                                np.asarray(epoch, np.int32), *dp_args)
  nonfinite_lib.check_server_state(finite, s.name, skipped, round_num)
  bits = [igc_client_bits(
      D, s.d, s.K, s.time_varying, accounting=s.download_accounting,
      epoch=epoch, last_epoch=p, value_bits=s.value_bits,
      count_index_bits=s.count_index_bits) for p in prev]
  return state, rc.client_diagnostics(
      work, result, upload_bits=bits[0]['upload_bits'],
      download=[b['download_bits'] for b in bits],
      num_examples=[len(w.batches) * s.hparams.batch_size for w in work],
      skipped=skipped, extra=lambda diag: {
          'subspace': int(diag['subspace']), 'epoch': epoch})


def intrinsic_gradient_compression(
    grad_fn: rc.GradFn, client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation, *, batch_size: int,
    intrinsic_dim: int, local_steps: int = 1, num_subspaces: int = 1,
    time_varying: bool = False, rounds_per_epoch: Optional[int] = None,
    seed: int = 0, scale: ff.Scale = 'unit_expectation',
    count_index_bits: bool = True,
    upload_transform: Optional[tx.CommTransform] = None,
    download_accounting: str = 'table1',
    client_ids: Optional[Sequence[bytes]] = None, nonfinite: str = 'raise',
    project_on_server: bool = False, engine: str = 'auto',
    dp: Optional[Union[fedopt.DP, privacy.DistributedDP]] = None,
    dp_seed: int = 0,
    **engine_options) -> fedjax.FederatedAlgorithm:
  """Builds static / K-subspace / time-varying IGC as a FederatedAlgorithm.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``.
    client_optimizer: local optimizer (``optax.sgd(eta)``: the paper's).
    server_optimizer: applied to the mean update ``S`` (``[K, d]``);
      ``optax.sgd(1.0)`` gives the paper's ``Sigma -= eta S``.
    batch_size: examples per local step (the paper's l).
    intrinsic_dim: d (>= 1, <= D).
    local_steps: local steps per round (1: the paper's one step).
    num_subspaces: K (>= 1).
    time_varying: new subspaces every epoch (Algorithm 3).
    rounds_per_epoch: TV epoch length (required with TV).
    seed: base subspace seed in ``[0, 2**32)``.
    scale: Fastfood scale (``'unit_expectation'``: E[A A^T] = I;
      ``'unit_column'`` needs D/d larger learning rates).
    count_index_bits: charge ``ceil(log2 K)`` upload bits for the index.
    upload_transform: stateless transform of the projected coordinates.
    download_accounting: ``'table1'`` or ``'exact'`` (needs ``client_ids``).
    client_ids: the training clients' ids.
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).
    project_on_server: simulate faster: clients send ``onehot(k) (x)
      delta`` and the server projects the K sums (linearity; equal to float
      rounding, same bits). Needs ``upload_transform=None``.
    engine, engine_options: :func:`fedlite_jax.rounds.make_engine`'s.
    dp: DP-FedAvg in the subspace (static IGC only, no
      ``project_on_server``): each client's d coordinates as the server
      decodes them are clipped to ``C``; Gaussian noise of std
      :meth:`fedopt.DP.noise_std` goes on the d-dimensional sum (key:
      ``dp_seed``, ``DP_STREAM``, round), divided by ``dp.denominator``,
      before the server optimizer and the map back to D. A
      :class:`fedlite_jax.privacy.DistributedDP` (``size = d``, no
      ``upload_transform``): distributed DP of the d coordinates under
      secure aggregation (``B * d_padded`` upload bits). None: no DP.
    dp_seed: the noise's seed (the run seed).

  Returns:
    ``FederatedAlgorithm(init, apply)``; diagnostics ``upload_bits``,
    ``download_bits``, ``subspace``, ``epoch``, ``delta_l2_norm``,
    ``num_examples``, ``finite``, ``skipped``; with ``dp`` ``dp_norm`` and
    ``dp_clipped`` (as :func:`fedopt.federated_averaging`), the state a
    :class:`DPIGCState` (:class:`DDPIGCState` when distributed).

  Raises:
    ValueError / TypeError: bad sizes or choices (also ``project_on_server``
      with ``upload_transform``); d > D (at ``init``).
    FloatingPointError: from ``apply``: a non-finite update (``'raise'``),
      every update non-finite (``'skip'``), or a non-finite server state.
  """
  s = _setup(intrinsic_dim, num_subspaces, time_varying, rounds_per_epoch,
             client_ids, download_accounting, nonfinite, batch_size,
             local_steps, seed, scale, count_index_bits, upload_transform,
             project_on_server, server_optimizer, dp, dp_seed)
  compress = (functools.partial(_defer_projection, s.K) if project_on_server
              else functools.partial(_compress, s))
  round_engine = make_engine(engine, rc.delta_client_program(
      grad_fn, client_optimizer, compress), **engine_options)
  server_update = jax.jit(functools.partial(_server_update, s))
  return fedjax.FederatedAlgorithm(
      functools.partial(_init, s),
      functools.partial(_apply, s, round_engine, server_update))
