"""Intrinsic gradient compression as FedJAX algorithms (static, K-subspace,
time-varying, K-subspace + time-varying).

Source: Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022): Algorithm 1 (static), Algorithm 2 (K-subspace), Algorithm 3
(time-varying), Section 3.2 (K-subspace + time-varying: described, never
evaluated there), Table 1 (bandwidth).

One implementation covers all four (K = ``num_subspaces``, TV =
``time_varying``):

* Server state: ``base`` (theta at the start of the current epoch; theta_0
  without TV), ``sigma`` (``float32[K, d]``, the current epoch's
  ``Sigma^(k)``), the model ``params = base + sum_k A_e^(k) sigma_k`` (what
  every client reconstructs from its download), a server optimizer state
  over ``sigma``, the epoch and round numbers, and each training client's
  last participation epoch.
* Client (through the round engine, all clients of a round in one compiled
  program on accelerators): local steps (:mod:`rounds_common`), then
  ``k ~ Unif{0..K-1}`` and ``c = A_e^(k)T delta`` (the
  :func:`~fedlite_jax.transforms.intrinsic_projection` transform, optionally
  followed by ``upload_transform``, e.g. 8-bit quantization of ``c``);
  output ``onehot(k) (x) c`` (``[K, d]``), so the engine's sum is the
  per-subspace sum.
* Server: ``S = sum / W`` (``[K, d]``; Algorithm 2's ``1/W sum_{i_w = k}
  C_w``), ``sigma <- server_optimizer(S)`` (SGD at rate 1 with one local SGD
  step at rate eta gives ``Sigma -= eta S``: Algorithm 1/2/3's update),
  ``params = base + sum_k A^(k) sigma_k``.
* K = 1 is exactly Algorithm 1 (the same code with one subspace; tested
  bit-for-bit against ``igc_static``).
* Time-varying: epoch ``e = round // rounds_per_epoch``, one epoch being one
  pass over the clients: ``rounds_per_epoch = ceil(num_train_clients /
  clients_per_round)`` by default. At the first round of a new epoch the
  server folds the finished epoch into the base (``base <- params``, the
  paper's ``theta_{e-1}^final``), resets ``sigma`` (and the server
  optimizer state, which lives in the old subspace) to zero and draws the
  epoch's matrices (seeds :func:`~fedlite_jax.transforms.subspace_seed`; the
  first epoch uses the static seed, so a one-epoch time-varying run equals
  static exactly). Clients reconstruct ``theta_e = theta_{e-1}^c +
  A_{e-1}(Sigma_{e-1}^final - Sigma^last) + A_e Sigma_e^current``, equal in
  exact arithmetic to the server's ``base + A_e sigma`` used here.

Bits per client per round (Table 1; :func:`igc_client_bits`):

* upload: ``32 d`` (or ``upload_transform``'s bits for the ``d``
  coordinates) ``+ ceil(log2 K)`` for the subspace index
  (``count_index_bits``).
* download, ``download_accounting='table1'`` (default): static ``32 d``,
  K-subspace ``32 d K``, time-varying ``2 x 32 d``, both ``2 x 32 d K`` --
  the paper's counts, which assume each client takes part once per epoch.
* ``'exact'``: the vectors a client actually needs given its last
  participation epoch ``p`` (never: it knows theta_0): ``n = e - max(p, 0) +
  1`` epochs' ``K`` vectors (``n = 1`` without TV), capped at the full model
  (``32 D``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import rounds_common as rc
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.igc import fastfood as ff
from fedlite_jax.rounds import make_engine
from fedlite_jax import transforms as tx
from fedlite_jax.common import FLOAT_BITS

Params = Any

IGC_DOWNLOAD_ACCOUNTING = ('table1', 'exact')

__all__ = [
    'IGC_DOWNLOAD_ACCOUNTING',
    'IGCState',
    'default_rounds_per_epoch',
    'igc_client_bits',
    'igc_download_bits',
    'igc_upload_bits',
    'igc_vectors_needed',
    'intrinsic_gradient_compression',
]


@fedjax.dataclass
class IGCState:
  """Server state of intrinsic gradient compression.

  Attributes:
    params: the model ``base + sum_k A_e^(k) sigma_k`` (pytree, float32).
    base: theta at the start of the current epoch (theta_0 without TV).
    sigma: ``float32[K, d]``, the current epoch's intrinsic coordinates.
    opt_state: server optimizer state over ``sigma``.
    epoch: ``int32[]``, the current epoch (0 without TV).
    round: ``int32[]``, rounds completed.
    last_epoch: ``int32[N]``, each training client's last participation
      epoch (-1: never); ``N = 0`` when built without client ids.
  """
  params: Params
  base: Params
  sigma: jax.Array
  opt_state: optax.OptState
  epoch: jax.Array
  round: jax.Array
  last_epoch: jax.Array


def default_rounds_per_epoch(num_train_clients: int,
                             clients_per_round: int) -> int:
  """One epoch = one pass over the clients: ``ceil(N / W)`` rounds."""
  n = rc.check_int(num_train_clients, 'num_train_clients')
  w = rc.check_int(clients_per_round, 'clients_per_round')
  return -(-n // w)


def igc_vectors_needed(epoch: int, last_epoch: int,
                       time_varying: bool) -> int:
  """Epochs' worth of ``Sigma`` vectors a client needs to reconcile exactly.

  Args:
    epoch: the current epoch e (>= 0).
    last_epoch: the client's last participation epoch p (-1: never, it knows
      theta_0).
    time_varying: without TV every client needs only the current vectors.

  Returns:
    ``1`` without TV; with TV ``e - max(p, 0) + 1`` (``Sigma_p^final`` ...
    ``Sigma_{e-1}^final`` and ``Sigma_e^current``; 1 within the same epoch).
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
    d: intrinsic dimension (>= 1).
    num_subspaces: K (>= 1).
    value_bits: bits of the d coordinates as sent (default ``32 d``; e.g.
      ``8 d + 64`` after 8-bit quantization).
    count_index_bits: add ``ceil(log2 K)`` for the subspace index.

  Raises:
    ValueError: d < 1 or K < 1.
  """
  d = rc.check_int(d, 'intrinsic_dim (d)')
  k_bits = tx.index_bits(num_subspaces) if count_index_bits else 0
  return float((FLOAT_BITS * d if value_bits is None else value_bits) + k_bits)


def igc_download_bits(D: int, d: int, num_subspaces: int = 1,
                      time_varying: bool = False, *,
                      accounting: str = 'table1',
                      vectors: int = 1) -> float:
  """Download bits of one client-round (Table 1, or exact reconciliation).

  Args:
    D: number of model parameters (>= 1).
    d: intrinsic dimension.
    num_subspaces: K.
    time_varying: TV variant.
    accounting: ``'table1'``: ``32 d K`` (x2 with TV). ``'exact'``:
      ``32 min(vectors d K, D)`` with ``vectors`` from
      :func:`igc_vectors_needed`.
    vectors: see ``accounting='exact'``.

  Raises:
    ValueError: bad sizes or accounting.
  """
  D = rc.check_int(D, 'D')
  d = rc.check_int(d, 'intrinsic_dim (d)')
  K = rc.check_int(num_subspaces, 'num_subspaces (K)')
  rc.check_choice(accounting, IGC_DOWNLOAD_ACCOUNTING,
                           'download_accounting')
  if accounting == 'table1':
    return float(FLOAT_BITS * d * K * (2 if time_varying else 1))
  vectors = rc.check_int(vectors, 'vectors')
  return float(FLOAT_BITS * min(vectors * d * K, D))


def igc_client_bits(D: int, d: int, num_subspaces: int = 1,
                    time_varying: bool = False, *,
                    accounting: str = 'table1', epoch: int = 0,
                    last_epoch: int = -1,
                    value_bits: Optional[float] = None,
                    count_index_bits: bool = True) -> dict[str, float]:
  """``{'upload_bits', 'download_bits'}`` of one client in one round.

  What the algorithms report to the communication ledger (see the module
  docstring and :func:`igc_upload_bits` / :func:`igc_download_bits`).
  """
  vectors = igc_vectors_needed(epoch, last_epoch, time_varying)
  return {
      'upload_bits': igc_upload_bits(d, num_subspaces, value_bits=value_bits,
                                     count_index_bits=count_index_bits),
      'download_bits': igc_download_bits(D, d, num_subspaces, time_varying,
                                         accounting=accounting,
                                         vectors=vectors),
  }


def intrinsic_gradient_compression(
    grad_fn: rc.GradFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    *,
    batch_size: int,
    intrinsic_dim: int,
    local_steps: int = 1,
    num_subspaces: int = 1,
    time_varying: bool = False,
    rounds_per_epoch: Optional[int] = None,
    seed: int = 0,
    scale: ff.Scale = 'unit_expectation',
    count_index_bits: bool = True,
    upload_transform: Optional[tx.CommTransform] = None,
    download_accounting: str = 'table1',
    client_ids: Optional[Sequence[bytes]] = None,
    nonfinite: str = 'raise',
    project_on_server: bool = False,
    engine: str = 'auto',
    **engine_options,
) -> fedjax.FederatedAlgorithm:
  """Builds static / K-subspace / time-varying IGC as a FederatedAlgorithm.

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` (e.g. ``fedjax.model_grad``).
    client_optimizer: local optimizer (``optax.sgd(eta)``: the paper's step).
    server_optimizer: applied to the mean compressed update ``S`` (``[K,
      d]``); ``optax.sgd(1.0)`` gives the paper's ``Sigma -= eta S``.
    batch_size: examples per local step (the paper's l).
    intrinsic_dim: d (>= 1, <= D).
    local_steps: local steps per round (1: the paper's one step).
    num_subspaces: K (>= 1); 1 = static / time-varying.
    time_varying: new subspaces every epoch (Algorithm 3).
    rounds_per_epoch: TV epoch length in rounds (required with TV; see
      :func:`default_rounds_per_epoch`).
    seed: base subspace seed in ``[0, 2**32)``.
    scale: Fastfood scale (default ``'unit_expectation'``: E[A A^T] = I;
      ``'unit_column'`` needs D/d larger learning rates).
    count_index_bits: charge ``ceil(log2 K)`` upload bits for the index.
    upload_transform: optional stateless transform of the d coordinates
      after projection (e.g. ``transforms.uniform_quantization(8)``); its bits
      replace ``32 d``.
    download_accounting: ``'table1'`` or ``'exact'`` (needs ``client_ids``).
    client_ids: the training clients' ids (for per-client participation).
    nonfinite: ``'raise'`` or ``'skip'`` (see :mod:`nonfinite`; a skipped
      client uploads 0 bits).
    project_on_server: a faster SIMULATION of the same algorithm: the
      projection is linear, so ``sum_i w_i A^(k_i)T delta_i`` (what the
      server aggregates) equals ``A^(k)T`` of the per-subspace weighted sum
      of the deltas; each client outputs ``onehot(k) (x) delta`` (``[K,
      D]``) and the server projects K sums instead of every client
      projecting its own. Equal to the default to float rounding (tested);
      bits are accounted exactly as before. Needs ``upload_transform=None``
      (a quantized upload is not linear).
    engine, engine_options: round engine name and settings
      (``steps_per_call``, ``step_bucket``, ``clients_per_chunk``;
      :func:`fedlite_jax.rounds.make_engine`).

  Returns:
    ``FederatedAlgorithm(init, apply)``; ``apply`` returns per-client
    diagnostics with ``upload_bits``, ``download_bits``, ``subspace``,
    ``epoch``, ``delta_l2_norm``, ``num_examples``, ``finite``,
    ``skipped``.

  Raises:
    ValueError / TypeError: bad sizes or choices (here), including
      ``project_on_server`` with an ``upload_transform``; d > D (at
      ``init``).
    FloatingPointError: from ``apply``: a non-finite update (``'raise'``),
      every update non-finite (``'skip'``), or a non-finite server state.
  """
  d = rc.check_int(intrinsic_dim, 'intrinsic_dim (d)')
  K = rc.check_int(num_subspaces, 'num_subspaces (K)')
  rc.check_choice(download_accounting, IGC_DOWNLOAD_ACCOUNTING,
                           'download_accounting')
  nonfinite_lib.check_policy(nonfinite)
  if time_varying:
    if rounds_per_epoch is None:
      raise ValueError('time_varying=True needs rounds_per_epoch (one epoch '
                       '= one pass over the clients).')
    rounds_per_epoch = rc.check_int(rounds_per_epoch,
                                                      'rounds_per_epoch')
  index = rc.client_id_index(client_ids)
  if download_accounting == 'exact' and not index:
    raise ValueError("download_accounting='exact' needs the training "
                     'client_ids.')
  hparams = rc.batch_hparams(batch_size, local_steps)
  projection = tx.intrinsic_projection(d, K, seed, scale, count_index_bits)
  coord_shape = jax.ShapeDtypeStruct((d,), jnp.float32)
  if upload_transform is not None:
    tail_state = upload_transform.init(coord_shape)
    if jax.tree.leaves(tail_state):
      raise ValueError('upload_transform must be stateless (client state is '
                       'not kept between participations).')
    value_bits = tx.message_bits(upload_transform, coord_shape, tail_state)
  else:
    tail_state = None
    value_bits = None
  if project_on_server and upload_transform is not None:
    raise ValueError('project_on_server needs a linear upload: it cannot be '
                     'combined with upload_transform (e.g. quantized '
                     'coordinates); drop one of them.')
  name = {(False, False): 'igc_static', (True, False): 'igc_k_subspace',
          (False, True): 'igc_time_varying',
          (True, True): 'igc_k_subspace_time_varying'}[(K > 1, time_varying)]

  def compress(shared, client_input, delta, mask):
    del mask  # no PVT
    key = rc.compression_key(client_input)
    k_proj, k_tail = jax.random.split(key)
    msg, _ = projection.encode(delta, tx.IntrinsicState(shared['fastfood']),
                               k_proj)
    coords = msg.values
    if upload_transform is not None:
      tail_msg, _ = upload_transform.encode(coords, tail_state, k_tail)
      coords, _ = upload_transform.decode(tail_msg, tail_state)
    k = msg.side['subspace']
    out = jax.nn.one_hot(k, K, dtype=coords.dtype)[:, None] * coords[None, :]
    return out, {'subspace': k}

  def defer_projection(shared, client_input, delta, mask):
    del mask  # no PVT
    # The same subspace draw as projection.encode (same key split).
    k_proj, _ = jax.random.split(rc.compression_key(client_input))
    k = tx.sample_subspace(k_proj, K)
    if K == 1:  # The delta pytree itself: no per-client ravel or mask.
      return delta, {'subspace': k}
    flat = tx.TreeSpec.of(delta).ravel(delta, jnp.float32)
    out = jax.nn.one_hot(k, K, dtype=flat.dtype)[:, None] * flat[None, :]
    return out, {'subspace': k}

  @jax.jit
  def project_sums(fastfood, per_subspace_sums):
    if K == 1:
      per_subspace_sums = tx.TreeSpec.of(per_subspace_sums).ravel(
          per_subspace_sums, jnp.float32)[None, :]
    return tx.project_subspaces(fastfood, per_subspace_sums)

  round_engine = make_engine(
      engine, rc.delta_client_program(
          grad_fn, client_optimizer,
          defer_projection if project_on_server else compress),
      **engine_options)
  cache: dict[str, Any] = {}

  def subspaces(D: int, epoch: int) -> ff.FastfoodParams:
    if cache.get('key') != (D, epoch):
      cache.clear()  # Keep one epoch's matrices (12 L bytes each).
      cache['key'] = (D, epoch)
      cache['fastfood'] = tx.make_subspaces(D, d, K, seed, epoch, scale)
    return cache['fastfood']

  def spec_of(params):
    return rc.model_spec(params, d, 'intrinsic_dim d')

  @jax.jit
  def server_update(state, fastfood, weighted_sum, total_weight):
    spec = tx.TreeSpec.of(state.params)
    mean = weighted_sum / total_weight
    updates, opt_state = server_optimizer.update(mean, state.opt_state,
                                                 state.sigma)
    sigma = optax.apply_updates(state.sigma, updates)
    flat = spec.ravel(state.base) + tx.lift_subspaces(fastfood, sigma)
    params = spec.unravel(flat)
    new_state = state.replace(params=params, sigma=sigma, opt_state=opt_state)
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> IGCState:
    spec_of(params)
    sigma = jnp.zeros((K, d), jnp.float32)
    return IGCState(params=params, base=params, sigma=sigma,
                    opt_state=server_optimizer.init(sigma),
                    epoch=jnp.zeros((), jnp.int32),
                    round=jnp.zeros((), jnp.int32),
                    last_epoch=jnp.full((len(index),), -1, jnp.int32))

  def apply(state: IGCState, clients):
    spec = spec_of(state.params)
    D = spec.size
    round_num = int(state.round)
    epoch = round_num // rounds_per_epoch if time_varying else 0
    if epoch != int(state.epoch):
      sigma = jnp.zeros_like(state.sigma)
      state = state.replace(base=state.params, sigma=sigma,
                            opt_state=server_optimizer.init(sigma),
                            epoch=jnp.asarray(epoch, jnp.int32))
    fastfood = subspaces(D, epoch)
    work = rc.make_work(clients, hparams)
    result = round_engine({'params': state.params, 'fastfood': fastfood},
                          work)
    total, skipped = rc.skip_nonfinite(result, work, nonfinite,
                                                name, round_num)
    weighted_sum = result.weighted_sum
    if project_on_server:
      weighted_sum = project_sums(fastfood, weighted_sum)
    state, finite = server_update(state, fastfood, weighted_sum,
                                  np.float32(total))
    nonfinite_lib.check_server_state(finite, name, skipped, round_num)
    last_epoch = np.asarray(state.last_epoch)
    positions = rc.client_positions(index, work)
    prev = [int(last_epoch[p]) for p in positions] if index else [-1] * len(work)
    bits = [igc_client_bits(
        D, d, K, time_varying, accounting=download_accounting, epoch=epoch,
        last_epoch=p, value_bits=value_bits,
        count_index_bits=count_index_bits) for p in prev]
    diagnostics = rc.client_diagnostics(
        work, result, upload_bits=bits[0]['upload_bits'],
        download=[b['download_bits'] for b in bits],
        num_examples=[len(w.batches) * hparams.batch_size for w in work],
        skipped=skipped, extra=lambda diag: {
            'subspace': int(diag['subspace']), 'epoch': epoch})
    if index:
      last_epoch = last_epoch.copy()
      last_epoch[positions] = epoch
    state = state.replace(round=jnp.asarray(round_num + 1, jnp.int32),
                          last_epoch=jnp.asarray(last_epoch))
    return state, diagnostics

  return fedjax.FederatedAlgorithm(init, apply)
