"""Efficient FedAvg: FedAdam, FedProx, MimeLite with quantization and PVT.

Sources:
  * FedAvg / FedAdam: McMahan et al. 2017 (Alg. 1); Reddi et al., "Adaptive
    Federated Optimization", ICLR 2021 (Alg. 2: server optimizer on the mean
    model delta).
  * FedProx: Li et al., "Federated Optimization in Heterogeneous Networks",
    MLSys 2020, Alg. 2: each client minimizes ``F_k(w) + (mu / 2) ||w -
    w^t||^2`` (here: ``mean batch loss + 0.5 mu ||w - w_server||^2``).
  * MimeLite: Karimireddy et al., "Mime: Mimicking Centralized Stochastic
    Algorithms in Federated Learning" (2020), Alg. 1 without the SVRG
    correction: clients take steps of a base optimizer whose statistics
    (e.g. Adagrad's accumulator) are the server's, applied but not updated
    on the client; the server moves the model by ``- server_lr * mean
    delta`` and updates the statistics with the full-batch gradient at the
    server model computed on the round's client data.
  * Ro et al., "Scaling Language Model Size in Cross-Device Federated
    Learning" (2022), Sec. 4-6 and App. B/C/E/F: FedAdam, FedProx, MimeLite
    with an Adagrad base; download quantization of the server model, upload
    quantization (k-level uniform, zero-centred, TernGrad with/without
    clipping) of the client deltas; PVT (:mod:`fedlite_jax.algorithms.pvt`).

Each algorithm here is the uncompressed one composed with three optional
pieces (:class:`Compression`):

  * ``download``: a :class:`fedlite_jax.transforms.CommTransform` (stateless
    or with a read-only state, see :class:`Compression`) applied ONCE per
    round to the server model (the broadcast); clients
    start from the decoded model ``Q(w)``, compute ``delta = Q(w) - w_client``
    and FedProx's proximal term is centred at ``Q(w)``; the server keeps full
    precision and applies the mean delta to ``w``.
  * ``upload``: such a CommTransform applied by every client to its
    delta (MimeLite: also to its mean full-batch gradient).
  * ``pvt_fraction`` < 1: per client per round a fresh PVT mask (frozen
    variables get zero gradients and zero updates; by default their
    weight-gradient computations are skipped, :func:`pvt.gated_grad_fn`);
    only trained variables are encoded and counted; each variable is
    averaged over the clients that trained it. The engine reduces weighted sums, so the client output
    is ``(w_k * delta_k * m_k, w_k * m_k)`` per variable.

With no compression these are exactly FedAvg / FedProx / MimeLite
(``tests/test_fedprox_mimelite.py`` checks FedJAX's ``fed_prox`` and
``mime_lite`` per round; ``tests/test_pvt.py`` checks PVT 100% == FedAvg).

Randomness (all from the client's round key ``k`` -- itself derived from the
run seed, round and client -- or the run seed and round):
  local steps split ``k`` exactly as FedAvg/FedJAX; the PVT mask uses
  ``fold_in(k, PVT_STREAM)``; the upload quantizer ``fold_in(k,
  UPLOAD_STREAM)`` (MimeLite's gradient ``fold_in(k, GRAD_UPLOAD_STREAM)``);
  the download quantizer ``fold_in(fold_in(PRNGKey(seed),
  DOWNLOAD_STREAM), round)``.

Bits per client per round (diagnostics ``upload_bits`` / ``download_bits``):
  download = the download transform's message size for the whole model (32
  bits per parameter uncompressed); MimeLite adds 32 bits per float of the
  optimizer statistics it sends. Upload = the upload transform's message
  size for the model (any such transform or ``transforms.chain``, e.g.
  top-k then 8-bit values, or the intrinsic projection then 8-bit values);
  under PVT, the sum over the TRAINED variables
  of its per-variable message size (e.g. uniform b-bit: ``b * size + 64``
  per variable). MimeLite uploads the delta and the gradient, so twice
  that. Sizes come from the transforms' static bit counts
  (:func:`leaf_bits`, ``transforms.message_bits``), the mask from the
  client. PVT is not itself a ``CommTransform``: that interface's bit
  counts are static, while a PVT message's size depends on the client's
  random mask (and the mask also changes local training).
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
from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.algorithms import pvt as pvt_lib
from fedlite_jax.rounds import ClientProgram
from fedlite_jax.rounds import ClientWork
from fedlite_jax.rounds import make_engine

Params = Any
PyTree = Any
GradFn = Callable[[Params, dict, jax.Array], Params]

FLOAT_BITS = 32
UPLOAD_STREAM = 0x75706C64  # 'upld'
GRAD_UPLOAD_STREAM = 0x67726164  # 'grad'
DOWNLOAD_STREAM = 0x646F776E  # 'down'

__all__ = [
    'Compression',
    'EfficientState',
    'efficient_federated_averaging',
    'efficient_mime_lite',
    'leaf_bits',
]


@dataclasses.dataclass(frozen=True)
class Compression:
  """Communication settings of an efficient algorithm.

  Attributes:
    download: CommTransform for the server model sent to clients (e.g.
      ``transforms.uniform_quantization(16)``); None = 32-bit floats.
    upload: CommTransform for client deltas (e.g.
      ``transforms.uniform_quantization(8)``, ``transforms.terngrad()``,
      ``transforms.chain(transforms.intrinsic_projection(4096),
      transforms.uniform_quantization(8))``); None = 32-bit floats. With
      ``pvt_fraction < 1`` its size must be a sum over variables (true for
      the quantizers and identity).

  Both transforms must be stateless or have a read-only state (built by
  ``init`` from a seed, returned untouched by ``encode``/``decode``, e.g.
  ``intrinsic_projection``'s Fastfood matrices): clients keep nothing
  between participations, so ``top_k(error_feedback=True)`` is refused
  with a ``ValueError`` (:func:`fedlite_jax.transforms.init_read_only`).
    pvt_fraction: target trainable share of the parameters per client, in
      (0, 1]; 1 = no PVT.
    pvt_freezable: ``(key path, leaf) -> bool``, which variables PVT may
      freeze (default: multiplicative ones, :func:`pvt.is_multiplicative`).
    pvt_skip_frozen: compute client gradients with
      :func:`pvt.gated_grad_fn`, which skips the backward-pass work that only
      a frozen variable's gradient needs (a ``lax.cond`` per freezable
      variable; saves compute on the ``loop`` engine, nothing under the
      ``vmap`` engine); False = the full gradient, then masked (the
      reference). Same results either way (bit-identical in
      ``tests/test_pvt.py``; to float rounding in general).
  """
  download: Optional[tx.CommTransform] = None
  upload: Optional[tx.CommTransform] = None
  pvt_fraction: float = 1.0
  pvt_freezable: Callable[[Any, Any], bool] = pvt_lib.is_multiplicative
  pvt_skip_frozen: bool = True


@fedjax.dataclass
class EfficientState:
  """Server state.

  Attributes:
    params: the server model (full precision).
    opt_state: server optimizer state (MimeLite: the base optimizer's
      statistics).
    round: int32 scalar, rounds completed (keys the download quantizer).
  """
  params: Params
  opt_state: optax.OptState
  round: jax.Array


def _shape_struct(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                     jnp.result_type(x)), tree)


def leaf_bits(transform: Optional[tx.CommTransform],
              params: PyTree) -> list[float]:
  """Message size of each variable encoded alone, ``jax.tree.leaves`` order.

  Args:
    transform: a stateless CommTransform, or None (32 bits per float32).
    params: pytree of arrays or ``jax.ShapeDtypeStruct``.

  Returns:
    Bits per leaf (Python floats).
  """
  leaves = jax.tree.leaves(_shape_struct(params))
  if transform is None:
    return [float(tx.dtype_bits(x.dtype) * np.prod(x.shape, dtype=np.int64))
            for x in leaves]
  return [float(tx.message_bits(transform, [x])) for x in leaves]


def _check_stateless(transform: Optional[tx.CommTransform], example: PyTree,
                     what: str) -> Any:
  """The transform's state for ``example`` (None for no transform).

  Clients keep nothing between participations, so the state must be
  read-only (:func:`fedlite_jax.transforms.init_read_only`: ``encode`` /
  ``decode`` return it untouched): stateless transforms and
  ``intrinsic_projection`` (Fastfood matrices drawn by ``init`` from its
  seed, identically on clients and server) pass; ``top_k`` with error
  feedback raises ``ValueError``.
  """
  if transform is None:
    return None
  return tx.init_read_only(transform, _shape_struct(example),
                           f'The {what} transform')


def _tree_bits(transform: Optional[tx.CommTransform], params: PyTree,
               state: Any = None) -> float:
  if transform is None:
    return float(sum(leaf_bits(None, params)))
  return float(tx.message_bits(transform, _shape_struct(params), state))


def _encode_decode(transform: Optional[tx.CommTransform], state: Any,
                   tree: PyTree, key: jax.Array) -> PyTree:
  if transform is None:
    return tree
  message, _ = transform.encode(tree, state, key)
  decoded, _ = transform.decode(message, state)
  return decoded


def _float_count(tree: PyTree) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(tree)
                 if jnp.issubdtype(jnp.result_type(x), jnp.floating)))


class _Setup:
  """Per-model static pieces, computed once from the first params seen."""

  def __init__(self, compression: Compression, params: Params, name: str):
    self.plan = pvt_lib.make_plan(params, compression.pvt_fraction,
                                  compression.pvt_freezable)
    self.download_state = _check_stateless(compression.download, params,
                                           'download')
    self.upload_state = _check_stateless(compression.upload, params, 'upload')
    self.download_bits = _tree_bits(compression.download, params,
                                    self.download_state)
    self.full_upload_bits = _tree_bits(compression.upload, params,
                                       self.upload_state)
    # Per-variable sizes only matter (and are only required to exist, e.g.
    # a top-k with k larger than one variable has none) under PVT.
    self.leaf_upload_bits = None
    if not self.plan.trains_everything:
      try:
        self.leaf_upload_bits = leaf_bits(compression.upload, params)
      except (ValueError, TypeError) as e:
        raise ValueError(
            f'{name}: PVT needs an upload transform that encodes each '
            'variable on its own, with a size that is a sum over variables; '
            f'this one cannot encode a single variable ({e})') from None
      if not np.isclose(self.full_upload_bits, sum(self.leaf_upload_bits),
                        rtol=1e-9, atol=0):
        raise ValueError(
            f'{name}: PVT needs an upload transform whose size is a sum over '
            f'variables; this one sends {self.full_upload_bits} bits for the '
            f'model but {sum(self.leaf_upload_bits)} for its variables one '
            'by one.')
    self.spec = tx.TreeSpec.of(params)

  def upload_bits(self, mask: np.ndarray) -> float:
    """Upload bits of one message given the client's PVT mask."""
    if self.leaf_upload_bits is None:
      return self.full_upload_bits
    return pvt_lib.masked_bits(self.leaf_upload_bits, mask)


def _pvt_key(client_input):
  return jax.random.fold_in(client_input['rng'], pvt_lib.PVT_STREAM)


def _client_grad(grad_fn: GradFn, setup_ref: dict, skip_frozen: bool
                 ) -> Callable[[dict, Params, dict, jax.Array], Params]:
  """``(state, params, batch, rng) -> grads``, frozen leaves exactly zero.

  With a PVT mask in ``state`` and ``skip_frozen``, the gradient skips the
  frozen variables' own backward work (:func:`pvt.gated_grad_fn`);
  otherwise it is the full gradient, masked.
  """

  def grad(state, params, batch, rng):
    if 'mask' not in state:
      return grad_fn(params, batch, rng)
    if skip_frozen:
      gated = pvt_lib.gated_grad_fn(grad_fn, setup_ref['setup'].plan.freezable)
      return gated(params, batch, rng, state['mask'])
    return pvt_lib.apply_mask(grad_fn(params, batch, rng), state['mask'])

  return grad


def _train_program(grad_fn: GradFn, optimizer: optax.GradientTransformation,
                   setup_ref: dict, *, fedprox_mu: float, mime: bool,
                   upload: Optional[tx.CommTransform],
                   skip_frozen: bool = True) -> ClientProgram:
  """Local training (FedAvg / FedProx / MimeLite steps) + masked upload.

  shared input: ``{'params': Q(w)}`` (+ ``'opt_state'`` for MimeLite);
  client input: ``{'rng': key}``. Output: ``{'delta': delta * m, 'mask':
  float32[num_leaves]}``, all zeros when not finite
  (:func:`nonfinite.guarded`: the client then adds no weight either).
  """

  client_grad = _client_grad(grad_fn, setup_ref, skip_frozen)

  def plan():
    return setup_ref['setup'].plan

  def init(shared, client_input):
    params = shared['params']
    state = {'params': params, 'rng': client_input['rng'],
             'upload_key': jax.random.fold_in(client_input['rng'],
                                              UPLOAD_STREAM)}
    if mime:
      state['opt_state_fixed'] = shared['opt_state']
    else:
      state['opt_state'] = optimizer.init(params)
    if fedprox_mu:
      state['server_params'] = params
    if not plan().trains_everything:
      state['mask'] = pvt_lib.sample_mask(plan(), _pvt_key(client_input))
    return state

  def step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    params = state['params']
    grads = client_grad(state, params, batch, use_rng)
    if fedprox_mu:
      # d/dw of 0.5 mu ||w - w_s||^2 (FedProx, Li et al. 2020, Alg. 2).
      grads = jax.tree.map(lambda g, w, s: g + fedprox_mu * (w - s), grads,
                           params, state['server_params'])
    if 'mask' in state:
      grads = pvt_lib.apply_mask(grads, state['mask'])
    if mime:
      # Server statistics applied, not updated (MimeLite).
      updates, _ = optimizer.update(grads, state['opt_state_fixed'], params)
      new = {}
    else:
      updates, opt_state = optimizer.update(grads, state['opt_state'], params)
      new = {'opt_state': opt_state}
    if 'mask' in state:
      updates = pvt_lib.apply_mask(updates, state['mask'])
    return {**state, **new, 'params': optax.apply_updates(params, updates),
            'rng': rng}

  def final(shared, state):
    delta = jax.tree.map(lambda a, b: a - b, shared['params'], state['params'])
    setup = setup_ref['setup']
    sent = _encode_decode(upload, setup.upload_state, delta,
                          state['upload_key'])
    num = len(setup.plan.sizes)
    if 'mask' in state:
      sent = pvt_lib.apply_mask(sent, state['mask'])
      mask = state['mask']
    else:
      mask = jnp.ones((num,), bool)
    sq = sum(jnp.vdot(x, x) for x in jax.tree.leaves(delta))
    output = {'delta': sent, 'mask': mask.astype(jnp.float32)}
    return output, {'delta_l2_norm': jnp.sqrt(sq), 'mask': mask}

  return nonfinite_lib.guarded(ClientProgram(init, step, final))


def _grad_program(grad_fn: GradFn, setup_ref: dict,
                  upload: Optional[tx.CommTransform],
                  skip_frozen: bool = True) -> ClientProgram:
  """MimeLite's full-batch gradient at the received model (FedJAX's
  ``mime.create_grads_for_each_client``): sums ``num * grad`` over padded
  batches; output ``{'grads': num * Q_up(mean grad) * m, 'num': num * m}``,
  all zeros when not finite (:func:`nonfinite.guarded`)."""
  client_grad = _client_grad(grad_fn, setup_ref, skip_frozen)

  def init(shared, client_input):
    params = shared['params']
    state = {'params': params, 'rng': client_input['rng'],
             'num_sum': jnp.zeros((), jnp.float32),
             'grads_sum': jax.tree.map(jnp.zeros_like, params),
             'upload_key': jax.random.fold_in(client_input['rng'],
                                              GRAD_UPLOAD_STREAM)}
    plan = setup_ref['setup'].plan
    if not plan.trains_everything:
      state['mask'] = pvt_lib.sample_mask(plan, _pvt_key(client_input))
    return state

  def step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = client_grad(state, state['params'], batch, use_rng)
    num = jnp.sum(batch[fedjax.EXAMPLE_MASK_KEY]).astype(jnp.float32)
    grads_sum = jax.tree.map(lambda g, s: g * num + s, grads,
                             state['grads_sum'])
    return {**state, 'rng': rng, 'num_sum': state['num_sum'] + num,
            'grads_sum': grads_sum}

  def final(shared, state):
    del shared
    setup = setup_ref['setup']
    num = state['num_sum']
    if upload is None:
      sent = state['grads_sum']
    else:
      safe = jnp.where(num > 0, num, 1.0)
      mean = jax.tree.map(lambda g: g / safe, state['grads_sum'])
      mean = _encode_decode(upload, setup.upload_state, mean,
                            state['upload_key'])
      sent = jax.tree.map(lambda g: g * num, mean)
    n_leaves = len(setup.plan.sizes)
    if 'mask' in state:
      sent = pvt_lib.apply_mask(sent, state['mask'])
      weights = state['mask'].astype(jnp.float32) * num
    else:
      weights = jnp.full((n_leaves,), num, jnp.float32)
    return {'grads': sent, 'num': weights}, {}

  return nonfinite_lib.guarded(ClientProgram(init, step, final))


def _per_leaf_mean(sums: PyTree, weights: jax.Array) -> PyTree:
  leaves, treedef = jax.tree.flatten(sums)
  out = []
  for i, x in enumerate(leaves):
    w = weights[i]
    out.append(jnp.where(w > 0, x / jnp.where(w > 0, w, 1.0),
                         jnp.zeros_like(x)))
  return jax.tree.unflatten(treedef, out)


def _work(clients, hparams) -> list[ClientWork]:
  return [ClientWork(cid, batching.client_batches(cds, hparams, rng),
                     {'rng': rng}, float(len(cds)))
          for cid, cds, rng in clients]


def _make_download(compression: Compression, seed: int, setup_ref: dict):

  @jax.jit
  def download(params, round_num):
    if compression.download is None:
      return params
    key = jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(seed), DOWNLOAD_STREAM),
        round_num)
    return _encode_decode(compression.download,
                          setup_ref['setup'].download_state, params, key)

  return download


def _client_diagnostics(work, result, setup: _Setup, download_bits: float,
                        upload_factor: int) -> dict:
  diagnostics = {}
  for w, diag in zip(work, result.diagnostics):
    mask = np.asarray(diag['mask'], bool)
    up = upload_factor * setup.upload_bits(mask)
    diagnostics[w.client_id] = {
        'num_examples': w.weight,
        'delta_l2_norm': float(diag['delta_l2_norm']),
        'upload_bits': up,
        'download_bits': download_bits,
        'pvt_trained_fraction': pvt_lib.realized_fraction(setup.plan, mask),
        'pvt_mask': mask,
        'finite': bool(diag['finite']),
    }
  return diagnostics


def efficient_federated_averaging(
    grad_fn: GradFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    *,
    fedprox_mu: float = 0.0,
    compression: Compression = Compression(),
    seed: int = 0,
    name: Optional[str] = None,
    engine: str = 'auto',
    steps_per_call: int = 1,
    step_bucket: str | int = 'pow2',
    nonfinite: str = 'raise',
) -> fedjax.FederatedAlgorithm:
  """FedAvg / FedAdam / FedProx with download+upload compression and PVT.

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` of the mean batch loss (e.g.
      ``fedjax.model_grad(model)``).
    client_optimizer: optax transformation for local steps (chain
      ``optax.clip_by_global_norm`` for Ro et al.'s client clipping).
    server_optimizer: applied to the mean delta (``optax.sgd(1.0)``: FedAvg;
      ``optax.adam(1e-3, b1=0.9, b2=0.999, eps=1e-8)``: Ro et al.'s FedAdam).
    client_batch_hparams: local batching (``seed=None``: derived per client
      and round from its key).
    fedprox_mu: ``mu >= 0`` of FedProx's ``0.5 mu ||w - w_server||^2``
      (0: FedAvg).
    compression: download / upload transforms and PVT (:class:`Compression`).
    seed: run seed (keys the per-round download quantization).
    name: name in error messages (default 'fedavg' or 'fedprox').
    engine, steps_per_call, step_bucket: round engine settings
      (:mod:`fedlite_jax.rounds`).
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`; a skipped
      client uploads 0 bits and adds no weight to any variable).

  Returns:
    ``FederatedAlgorithm(init, apply)`` over :class:`EfficientState`;
    per-client diagnostics ``num_examples``, ``delta_l2_norm``,
    ``upload_bits``, ``download_bits``, ``pvt_trained_fraction`` (trained
    share of the parameters), ``pvt_mask`` (bool per variable,
    ``jax.tree.leaves`` order), ``finite``, ``skipped``.

  Raises:
    ValueError: ``fedprox_mu < 0``, an unknown ``nonfinite`` policy, a bad
      PVT fraction or transform (at ``init``/first ``apply``).
    FloatingPointError: from ``apply``: a non-finite client update
      (``'raise'``), every update non-finite (``'skip'``), or a non-finite
      server state (names the clients).
  """
  if not fedprox_mu >= 0:
    raise ValueError(f'fedprox_mu must be >= 0, got {fedprox_mu!r}.')
  nonfinite_lib.check_policy(nonfinite)
  name = name or ('fedprox' if fedprox_mu else 'fedavg')
  setup_ref: dict[str, _Setup] = {}
  program = _train_program(grad_fn, client_optimizer, setup_ref,
                           fedprox_mu=float(fedprox_mu), mime=False,
                           upload=compression.upload,
                           skip_frozen=compression.pvt_skip_frozen)
  round_engine = make_engine(engine, program, steps_per_call=steps_per_call,
                             step_bucket=step_bucket)
  download = _make_download(compression, seed, setup_ref)

  def setup(params) -> _Setup:
    spec = tx.TreeSpec.of(params)
    if 'setup' not in setup_ref or setup_ref['setup'].spec != spec:
      setup_ref['setup'] = _Setup(compression, params, name)
    return setup_ref['setup']

  @jax.jit
  def server_update(state, sums, weights):
    mean_delta = _per_leaf_mean(sums, weights)
    updates, opt_state = server_optimizer.update(mean_delta, state.opt_state,
                                                 state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = EfficientState(params, opt_state, state.round + 1)
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> EfficientState:
    setup(params)
    return EfficientState(params, server_optimizer.init(params),
                          jnp.zeros((), jnp.int32))

  def apply(state: EfficientState,
            clients: Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]]):
    s = setup(state.params)
    sent = download(state.params, state.round)
    work = _work(clients, client_batch_hparams)
    result = round_engine({'params': sent}, work)
    round_num = int(state.round)
    skipped = nonfinite_lib.resolve(
        [w.client_id for w in work], [d['finite'] for d in result.diagnostics],
        nonfinite, name, round_num)
    new_state, finite = server_update(state, result.weighted_sum['delta'],
                                      result.weighted_sum['mask'])
    nonfinite_lib.check_server_state(finite, name, skipped, round_num)
    diagnostics = _client_diagnostics(work, result, s, s.download_bits, 1)
    return new_state, nonfinite_lib.mark_skipped(diagnostics, skipped)

  return fedjax.FederatedAlgorithm(init, apply)


def efficient_mime_lite(
    grad_fn: GradFn,
    base_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    grads_batch_size: int,
    server_learning_rate: float = 1.0,
    *,
    compression: Compression = Compression(),
    seed: int = 0,
    name: str = 'mime_lite',
    engine: str = 'auto',
    steps_per_call: int = 1,
    step_bucket: str | int = 'pow2',
    nonfinite: str = 'raise',
) -> fedjax.FederatedAlgorithm:
  """MimeLite (Karimireddy et al. 2020) with compression and PVT.

  Same round as FedJAX's ``fedjax.algorithms.mime_lite.mime_lite``: (1)
  clients train with ``base_optimizer`` using the server's optimizer state
  without updating it; (2) each client computes the full-batch gradient of
  its (capped) data at the received model with padded batches of
  ``grads_batch_size`` (a second pass over its data); (3) the server sets
  ``w <- w - server_learning_rate * mean delta`` and updates the base
  optimizer state with the example-weighted mean gradient.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``; must honour FedJAX's
      ``__mask__`` padding key (``fedjax.model_grad`` does).
    base_optimizer: the optimizer mimicked (Ro et al.: Adagrad,
      ``optax.adagrad(lr, eps=...)``).
    client_batch_hparams: local batching.
    grads_batch_size: batch size of the full-batch gradient pass (>= 1).
    server_learning_rate: scales the mean delta (Ro et al. fix 1.0).
    compression: as :func:`efficient_federated_averaging`; the upload
      transform also encodes the client's mean gradient (upload = 2 x the
      delta's bits), and the download adds 32 bits per float of the
      optimizer state (sent uncompressed).
    seed, name, engine, steps_per_call, step_bucket, nonfinite: as
      :func:`efficient_federated_averaging`. A client is non-finite when its
      delta or its gradient is; a skipped client is left out of both
      averages.

  Returns:
    ``FederatedAlgorithm`` over :class:`EfficientState` (``opt_state`` is the
    base optimizer's); diagnostics as :func:`efficient_federated_averaging`.

  Raises:
    ValueError: ``grads_batch_size < 1``, an unknown ``nonfinite`` policy or
      bad compression settings.
    FloatingPointError: as :func:`efficient_federated_averaging`.
  """
  if isinstance(grads_batch_size, bool) or not isinstance(
      grads_batch_size, (int, np.integer)) or grads_batch_size < 1:
    raise ValueError(f'grads_batch_size must be an integer >= 1, got '
                     f'{grads_batch_size!r}.')
  nonfinite_lib.check_policy(nonfinite)
  setup_ref: dict[str, _Setup] = {}
  train_engine = make_engine(
      engine, _train_program(grad_fn, base_optimizer, setup_ref,
                             fedprox_mu=0.0, mime=True,
                             upload=compression.upload,
                             skip_frozen=compression.pvt_skip_frozen),
      steps_per_call=steps_per_call, step_bucket=step_bucket)
  grads_engine = make_engine(
      engine, _grad_program(grad_fn, setup_ref, compression.upload,
                            compression.pvt_skip_frozen),
      steps_per_call=steps_per_call, step_bucket=step_bucket)
  grads_hparams = fedjax.PaddedBatchHParams(batch_size=int(grads_batch_size))
  download = _make_download(compression, seed, setup_ref)
  lr = float(server_learning_rate)

  def setup(params) -> _Setup:
    spec = tx.TreeSpec.of(params)
    if 'setup' not in setup_ref or setup_ref['setup'].spec != spec:
      setup_ref['setup'] = _Setup(compression, params, name)
    return setup_ref['setup']

  @jax.jit
  def server_update(state, delta_sums, delta_weights, grad_sums, grad_weights):
    mean_delta = _per_leaf_mean(delta_sums, delta_weights)
    server_grads = _per_leaf_mean(grad_sums, grad_weights)
    params = jax.tree.map(lambda p, q: p - lr * q, state.params, mean_delta)
    _, opt_state = base_optimizer.update(server_grads, state.opt_state,
                                         state.params)
    new_state = EfficientState(params, opt_state, state.round + 1)
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> EfficientState:
    setup(params)
    return EfficientState(params, base_optimizer.init(params),
                          jnp.zeros((), jnp.int32))

  def apply(state: EfficientState,
            clients: Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]]):
    s = setup(state.params)
    sent = download(state.params, state.round)
    work = _work(clients, client_batch_hparams)
    train = train_engine({'params': sent, 'opt_state': state.opt_state}, work)
    grad_work = [ClientWork(cid, list(cds.padded_batch(grads_hparams)),
                            {'rng': rng}, 1.0) for cid, cds, rng in clients]
    grads = grads_engine({'params': sent}, grad_work)
    round_num = int(state.round)
    train_ok = [bool(d['finite']) for d in train.diagnostics]
    grads_ok = [bool(d['finite']) for d in grads.diagnostics]
    skipped = nonfinite_lib.resolve(
        [w.client_id for w in work],
        [a and b for a, b in zip(train_ok, grads_ok)], nonfinite, name,
        round_num)
    train_sum, grads_sum = train.weighted_sum, grads.weighted_sum
    # Each pass zeroed its own non-finite outputs; a client skipped for the
    # other pass only is still in this pass's sum: recompute the pass
    # without the skipped clients (rare; same per-client results).
    drop = set(skipped)
    if any(ok for w, ok in zip(work, train_ok) if w.client_id in drop):
      train_sum = train_engine(
          {'params': sent, 'opt_state': state.opt_state},
          [w for w in work if w.client_id not in drop]).weighted_sum
    if any(ok for w, ok in zip(grad_work, grads_ok) if w.client_id in drop):
      grads_sum = grads_engine(
          {'params': sent},
          [w for w in grad_work if w.client_id not in drop]).weighted_sum
    new_state, finite = server_update(
        state, train_sum['delta'], train_sum['mask'], grads_sum['grads'],
        grads_sum['num'])
    nonfinite_lib.check_server_state(finite, name, skipped, round_num)
    down = s.download_bits + FLOAT_BITS * _float_count(state.opt_state)
    diagnostics = _client_diagnostics(work, train, s, down, 2)
    for cid, ok in zip([w.client_id for w in work], grads_ok):
      diagnostics[cid]['finite'] &= ok
    return new_state, nonfinite_lib.mark_skipped(diagnostics, skipped)

  return fedjax.FederatedAlgorithm(init, apply)
