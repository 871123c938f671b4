"""One FedOpt round for every delta-based method, and its named configurations.

A round (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2):
the server broadcasts its model through a *download* transform; each sampled
client takes local steps of a *local rule* from the received model ``Q(w)``
and sends ``delta = Q(w) - w_client`` through an *upload* transform (and,
under PVT, only the variables its random mask trained); the server averages
the decoded deltas and applies its optimizer to the mean as a
pseudo-gradient. :func:`fedopt` builds it from

  * local rule: ``'sgd'`` (the client optimizer: FedAvg, McMahan et al.
    2017, Alg. 1), ``'fedprox'`` (Li et al., MLSys 2020, Alg. 2: the mean
    batch loss plus ``0.5 mu ||w - Q(w)||^2``), or ``'mime_lite'``
    (Karimireddy et al. 2020, Alg. 1 without SVRG: client steps of the base
    optimizer with the server's statistics, applied but not updated; the
    server moves by ``- server_lr * mean delta`` and updates the statistics
    with the clients' full-batch gradients at ``Q(w)``);
  * :class:`Compression`: upload and download chains of
    :mod:`fedlite_jax.transforms` (stateless or read-only state) and PVT
    (:mod:`fedlite_jax.transforms.pvt`; Ro et al. 2022, Sec. 4);
  * the server optimizer (optax: SGD 1.0 = FedAvg, Adam = FedAdam, ...);
  * client weights: ``'examples'`` (FedAvg) or ``'uniform'`` (every client 1;
    Melas-Kyriazi & Wang 2022 / FetchSGD, whose clients take a fixed number
    of local steps);
  * download accounting: ``'dense'`` (the download message of the whole
    model) or ``'changed'`` (FetchSGD's: 32 bits per weight changed since
    the client last participated; :func:`download_bits`).

FedAvg, FedAdam, FedProx, MimeLite, SGD with s local steps, local Top-K and
the quantized / PVT variants of Ro et al. are configurations of it
(:func:`federated_averaging`, :func:`efficient_federated_averaging`,
:func:`efficient_mime_lite`, :func:`compressed_sgd`). IGC and FetchSGD keep
their server rules (:mod:`igc`, :mod:`fetchsgd`) on this module's client
program, work, accounting and non-finite policy.

Randomness, all from the client's round key ``k`` (itself from the run seed,
round and client) or the run seed and round: local steps split ``k`` exactly
as FedJAX's ``fed_avg`` (same dropout and shuffle draws); the PVT mask uses
``fold_in(k, pvt.PVT_STREAM)``; the upload quantizer ``fold_in(k,
UPLOAD_STREAM)`` (MimeLite's gradient: ``GRAD_UPLOAD_STREAM``); the download
quantizer ``fold_in(fold_in(PRNGKey(seed), DOWNLOAD_STREAM), round)``.

Bits per client per round (diagnostics ``upload_bits`` / ``download_bits``):
upload = the upload chain's message size (``transforms.message_bits``; 32
per float32 value uncompressed), under PVT the sum over the trained
variables of their own message sizes (:func:`fedlite_jax.transforms.pvt.masked_bits`),
twice that for MimeLite (delta + gradient), 0 for a skipped client;
download = the download chain's size for the model (MimeLite: plus 32 bits
per float of the optimizer statistics) or the ``'changed'`` count.

Non-finite updates: the shared policy of :mod:`nonfinite` (``'raise'`` or
``'skip'``; a skipped client adds no weight to any variable).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.rounds import ClientProgram
from fedlite_jax.rounds import ClientWork
from fedlite_jax.rounds import make_engine
from fedlite_jax.transforms import pvt as pvt_lib

Params = Any
PyTree = Any
GradFn = Callable[[Params, dict, jax.Array], Params]
Compress = Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
Clients = Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]]

FLOAT_BITS = 32
LOCAL_RULES = ('sgd', 'fedprox', 'mime_lite')
WEIGHTINGS = ('examples', 'uniform')
DOWNLOAD_ACCOUNTING = ('changed', 'dense')
UPLOAD_STREAM = 0x75706C64  # 'upld'
GRAD_UPLOAD_STREAM = 0x67726164  # 'grad'
DOWNLOAD_STREAM = 0x646F776E  # 'down'
# IGC's and FetchSGD's compression key (ASCII 'comp'): their subspace choice
# and sketch streams, kept so their results stay reproducible.
COMPRESS_STREAM = 0x636F6D70

__all__ = [
    'Compression', 'FedOptState', 'compressed_sgd',
    'efficient_federated_averaging', 'efficient_mime_lite',
    'federated_averaging', 'fedopt', 'num_params',
]


# --------------------------------------------------------------------------
# Argument checks (one place; IGC and FetchSGD use them too).

def check_choice(value: str, allowed: Sequence[str], name: str) -> str:
  """Returns ``value`` or raises ``ValueError`` naming ``name`` and ``allowed``."""
  if value not in allowed:
    raise ValueError(f'{name}={value!r}: allowed values are '
                     f'{", ".join(allowed)}.')
  return value


def check_positive_int(value: Any, name: str) -> int:
  """Returns ``int(value)``; ``TypeError`` for a non-integer, ``ValueError`` < 1."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f'{name} must be an integer; got {value!r}.')
  if value < 1:
    raise ValueError(f'{name} must be >= 1; got {value}.')
  return int(value)


def num_params(params: Params) -> int:
  """Number of scalar parameters in a pytree."""
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def batch_hparams(batch_size: int,
                  local_steps: int) -> fedjax.ShuffleRepeatBatchHParams:
  """``local_steps`` shuffled batches of ``batch_size`` (seed from the key)."""
  return fedjax.ShuffleRepeatBatchHParams(
      batch_size=check_positive_int(batch_size, 'batch_size'),
      num_epochs=None,
      num_steps=check_positive_int(local_steps, 'local_steps'))


def compression_key(client_input: Mapping[str, jax.Array]) -> jax.Array:
  """IGC's / FetchSGD's compression key (independent of the local steps)."""
  return jax.random.fold_in(client_input['rng'], COMPRESS_STREAM)


# --------------------------------------------------------------------------
# The client program: local steps of a local rule, then compress the delta.

def _with_pvt_mask(state: dict, plan: Optional[pvt_lib.PVTPlan],
                   client_input: Mapping[str, jax.Array]) -> dict:
  """``state`` plus the client's PVT ``'mask'`` (none without PVT)."""
  if plan is not None and not plan.trains_everything:
    state['mask'] = pvt_lib.sample_mask(
        plan, jax.random.fold_in(client_input['rng'], pvt_lib.PVT_STREAM))
  return state


def model_spec(params: Params, at_least: int, what: str) -> tx.TreeSpec:
  """The model's :class:`TreeSpec`; ``ValueError`` if it has fewer than
  ``at_least`` parameters (``what`` names the setting)."""
  spec = tx.TreeSpec.of(params)
  if at_least > spec.size:
    raise ValueError(f'{what}={at_least} exceeds the number of model '
                     f'parameters D={spec.size}.')
  return spec


def delta_client_program(grad_fn: GradFn,
                         optimizer: optax.GradientTransformation,
                         compress: Callable[..., tuple[PyTree, PyTree]], *,
                         fedprox_mu: float = 0.0, mime: bool = False,
                         plan: Callable[[], Optional[pvt_lib.PVTPlan]] =
                         lambda: None) -> ClientProgram:
  """Local steps, then ``compress(shared, client_input, delta, mask)``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``.
    optimizer: the client optimizer (MimeLite: the base optimizer, whose
      state comes from ``shared['opt_state']`` and is not updated).
    compress: ``(shared, client_input, delta, mask) -> (output, diag)``;
      ``mask`` is the PVT mask ``bool[num_leaves]`` or None.
    fedprox_mu: ``mu >= 0`` of FedProx's proximal term (0: none).
    mime: MimeLite's fixed server statistics.
    plan: returns the PVT plan, or None (no PVT).

  Returns:
    A :class:`~fedlite_jax.rounds.ClientProgram`. shared input: ``{'params':
    Q(w), ...}``; client input: ``{'rng': key}``. ``step`` splits the key as
    FedJAX does; frozen variables (PVT) get zero gradients and updates.
    Output: ``compress``'s, zeroed when not finite
    (:func:`nonfinite.guarded`); diagnostics add ``delta_l2_norm``, ``mask``
    (PVT) and ``finite``.
  """

  def init(shared, client_input):
    params = shared['params']
    state = {'params': params, 'rng': client_input['rng'],
             'input': client_input}
    if mime:
      state['opt_state_fixed'] = shared['opt_state']
    else:
      state['opt_state'] = optimizer.init(params)
    if fedprox_mu:
      state['server_params'] = params
    return _with_pvt_mask(state, plan(), client_input)

  def step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    params = state['params']
    grads = grad_fn(params, batch, use_rng)
    if 'mask' in state:
      grads = pvt_lib.apply_mask(grads, state['mask'])
    if fedprox_mu:
      # d/dw of 0.5 mu ||w - w_s||^2 (FedProx, Li et al. 2020, Alg. 2).
      grads = jax.tree.map(lambda g, w, s: g + fedprox_mu * (w - s), grads,
                           params, state['server_params'])
      if 'mask' in state:
        grads = pvt_lib.apply_mask(grads, state['mask'])
    new = {}
    if mime:
      updates, _ = optimizer.update(grads, state['opt_state_fixed'], params)
    else:
      updates, new['opt_state'] = optimizer.update(grads, state['opt_state'],
                                                   params)
    if 'mask' in state:
      updates = pvt_lib.apply_mask(updates, state['mask'])
    return {**state, **new, 'params': optax.apply_updates(params, updates),
            'rng': rng}

  def final(shared, state):
    delta = jax.tree.map(lambda a, b: a - b, shared['params'], state['params'])
    output, diag = compress(shared, state['input'], delta, state.get('mask'))
    sq = sum(jnp.vdot(x, x) for x in jax.tree.leaves(delta))
    return output, {**diag, 'delta_l2_norm': jnp.sqrt(sq)}

  return nonfinite_lib.guarded(ClientProgram(init, step, final))


def _full_batch_grad_program(grad_fn: GradFn, upload_fn: Callable,
                             plan: Callable[[], Optional[pvt_lib.PVTPlan]]
                             ) -> ClientProgram:
  """MimeLite's full-batch gradient at ``Q(w)`` (FedJAX's
  ``mime.create_grads_for_each_client``) over padded batches. ``upload_fn(
  sum of num * grad, num, key, mask) -> (sent sum, mask)``; output
  ``{'delta': sent sum, 'mask': num * m}``."""

  def init(shared, client_input):
    state = {'params': shared['params'], 'rng': client_input['rng'],
             'input': client_input, 'num': jnp.zeros((), jnp.float32),
             'sum': jax.tree.map(jnp.zeros_like, shared['params'])}
    return _with_pvt_mask(state, plan(), client_input)

  def step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], batch, use_rng)
    if 'mask' in state:
      grads = pvt_lib.apply_mask(grads, state['mask'])
    num = jnp.sum(batch[fedjax.EXAMPLE_MASK_KEY]).astype(jnp.float32)
    return {**state, 'rng': rng, 'num': state['num'] + num,
            'sum': jax.tree.map(lambda g, s: g * num + s, grads, state['sum'])}

  def final(shared, state):
    del shared
    key = jax.random.fold_in(state['input']['rng'], GRAD_UPLOAD_STREAM)
    sent, mask = upload_fn(state['sum'], state['num'], key, state.get('mask'))
    return {'delta': sent, 'mask': mask.astype(jnp.float32) * state['num']}, {}

  return nonfinite_lib.guarded(ClientProgram(init, step, final))


def make_work(clients: Clients, hparams: fedjax.ShuffleRepeatBatchHParams,
              weighting: str = 'uniform') -> list[ClientWork]:
  """One :class:`ClientWork` per client: its batches and ``{'rng': key}``.

  Weight: the client's number of examples (``'examples'``) or 1
  (``'uniform'``).

  Raises:
    ValueError: no client.
  """
  if not clients:
    raise ValueError('A round needs at least one client; got none.')
  return [ClientWork(cid, batching.client_batches(cds, hparams, rng),
                     {'rng': rng},
                     float(len(cds)) if weighting == 'examples' else 1.0)
          for cid, cds, rng in clients]


def skip_nonfinite(result, work: Sequence[ClientWork], nonfinite: str,
                   algorithm: str, round_num: int
                   ) -> tuple[float, list[bytes]]:
  """The non-finite policy (:func:`nonfinite.resolve`) applied to a round.

  Returns:
    ``(total weight of the kept clients, skipped client ids)``.

  Raises:
    FloatingPointError: as :func:`nonfinite.resolve`.
  """
  ids = [w.client_id for w in work]
  skipped = nonfinite_lib.resolve(
      ids, [d['finite'] for d in result.diagnostics], nonfinite, algorithm,
      round_num)
  return nonfinite_lib.kept_weight([w.weight for w in work], ids,
                                   skipped), skipped


# --------------------------------------------------------------------------
# Download accounting ('changed': FetchSGD / CommEfficient fed_aggregator.py).
# The server keeps last_changed[j], the last round whose update changed
# weight j (-1: never), and last_round[c], the last round client c took part
# in (-1: never); a client that last took part in round p (or never: p = 0,
# it knows the initial model, which derives from the seed) downloads
# 32 * #{j : last_changed[j] >= p} bits.

def client_id_index(client_ids: Optional[Sequence[bytes]]) -> dict[bytes, int]:
  """``{client_id: position}`` (empty for None)."""
  return {bytes(c): i for i, c in enumerate(client_ids or ())}


def client_positions(index: Mapping[bytes, int],
                     work: Sequence[ClientWork]) -> np.ndarray:
  """``int32[W]`` positions of the round's clients in ``index`` (empty index:
  empty array).

  Raises:
    KeyError: a client that is not among the training clients.
  """
  out = []
  for w in work if index else ():
    if bytes(w.client_id) not in index:
      raise KeyError(
          f'Client {w.client_id!r} is not among the {len(index)} training '
          'client ids the algorithm was built with (client_ids).')
    out.append(index[bytes(w.client_id)])
  return np.asarray(out, np.int32)


@jax.jit
def changed_counts(last_changed: jax.Array,
                   last_round: jax.Array) -> jax.Array:
  """``int32[W]``: ``#{j : last_changed[j] >= max(last_round[c], 0)}``."""
  since = jnp.maximum(last_round, 0)
  return jax.vmap(lambda p: jnp.sum(last_changed >= p, dtype=jnp.int32))(since)


@jax.jit
def mark_changed(last_changed: jax.Array, old_flat: jax.Array,
                 new_flat: jax.Array, round_num: jax.Array) -> jax.Array:
  """``last_changed`` with ``round_num`` where ``new_flat != old_flat``."""
  return jnp.where(new_flat != old_flat, round_num.astype(jnp.int32),
                   last_changed)


def download_bits(accounting: str, dense_bits: float, num_clients: int,
                  last_changed: jax.Array, last_round: jax.Array
                  ) -> np.ndarray:
  """Download bits of each client of a round, float64 ``[W]``.

  Args:
    accounting: ``'dense'`` (``dense_bits`` each) or ``'changed'`` (32 x the
      weights changed since the client last took part).
    dense_bits: the whole model's download message (bits).
    num_clients: W.
    last_changed: ``int32[D]``; last_round: ``int32[W]`` (``'changed'`` only).
  """
  if accounting == 'dense':
    return np.full((num_clients,), float(dense_bits))
  return FLOAT_BITS * np.asarray(changed_counts(last_changed, last_round),
                                 np.float64)


def participation(state: Any, index: Mapping[bytes, int],
                  positions: np.ndarray, round_num: int) -> Any:
  """``state`` with ``round = round_num + 1`` and the participants'
  ``last_round = round_num`` (skipped clients too: they downloaded)."""
  last_round = state.last_round
  if index:
    last_round = last_round.at[positions].set(round_num)
  return state.replace(round=jnp.asarray(round_num + 1, jnp.int32),
                       last_round=last_round)


def client_diagnostics(work: Sequence[ClientWork], result, *, upload_bits,
                       download: np.ndarray, num_examples: Sequence[float],
                       skipped: Sequence[bytes] = (), extra=None
                       ) -> dict[bytes, dict[str, Any]]:
  """``{client_id: {'upload_bits', 'download_bits', 'num_examples',
  'delta_l2_norm', 'finite', 'skipped', ...}}`` (bits; upload 0 for the
  ``skipped`` clients). ``upload_bits``: a number or ``diag -> bits``;
  ``extra``: ``diag -> dict`` merged in."""
  out = {}
  for i, (w, diag) in enumerate(zip(work, result.diagnostics)):
    up = upload_bits(diag) if callable(upload_bits) else upload_bits
    out[w.client_id] = {
        'upload_bits': float(up), 'download_bits': float(download[i]),
        'num_examples': float(num_examples[i]),
        'delta_l2_norm': float(diag['delta_l2_norm']),
        'finite': bool(diag['finite']), **(extra(diag) if extra else {})}
  return nonfinite_lib.mark_skipped(out, skipped)


# --------------------------------------------------------------------------
# The builder.

@dataclasses.dataclass(frozen=True)
class Compression:
  """Communication settings of a FedOpt round.

  Attributes:
    download: CommTransform for the server model sent to clients, once per
      round (e.g. ``transforms.uniform_quantization(16)``); clients start
      from the decoded ``Q(w)``, the server keeps full precision. None: 32
      bits per float.
    upload: CommTransform for each client's delta (e.g.
      ``transforms.chain(transforms.intrinsic_projection(4096),
      transforms.uniform_quantization(8))``, ``transforms.terngrad()``,
      ``transforms.chain(transforms.top_k(k), uniform_quantization(8))``).
      None: 32 bits per float. Under PVT its size must be a sum over
      variables (true for the quantizers and identity).
    pvt_fraction: target trainable share of the parameters per client, in
      (0, 1]; 1 = no PVT (:mod:`fedlite_jax.transforms.pvt`).
    pvt_freezable: ``(key path, leaf) -> bool``: which variables PVT may
      freeze (default: the multiplicative ones).

  Both transforms must be stateless or have a read-only state (built by
  ``init``, returned untouched, e.g. the intrinsic projection's Fastfood
  matrices): clients keep nothing between participations, so
  ``top_k(error_feedback=True)`` is refused with a ``ValueError``
  (:func:`fedlite_jax.transforms.init_read_only`).
  """
  download: Optional[tx.CommTransform] = None
  upload: Optional[tx.CommTransform] = None
  pvt_fraction: float = 1.0
  pvt_freezable: Callable[[Any, Any], bool] = pvt_lib.is_multiplicative


@fedjax.dataclass
class FedOptState:
  """Server state of a FedOpt round.

  Attributes:
    params: the server model (full precision).
    opt_state: the server optimizer's state (MimeLite: the base
      optimizer's statistics).
    round: ``int32[]``, rounds completed (keys the download quantizer).
    last_changed: ``int32[D]``, the last round that changed each weight
      (-1: never), raveled in ``jax.tree.leaves`` order; ``int32[0]`` unless
      the download accounting is ``'changed'``.
    last_round: ``int32[N]``, each training client's last round (-1: never);
      ``int32[0]`` without ``client_ids``.
  """
  params: Params
  opt_state: optax.OptState
  round: jax.Array
  last_changed: jax.Array
  last_round: jax.Array


def _shape_struct(tree: PyTree) -> PyTree:
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _encode_decode(transform, state, tree, key):
  if transform is None:
    return tree
  message, _ = transform.encode(tree, state, key)
  return transform.decode(message, state)[0]


def _per_leaf_mean(sums: PyTree, weights: jax.Array) -> PyTree:
  leaves, treedef = jax.tree.flatten(sums)
  return jax.tree.unflatten(treedef, [
      jnp.where(weights[i] > 0, x / jnp.where(weights[i] > 0, weights[i], 1.0),
                jnp.zeros_like(x)) for i, x in enumerate(leaves)])


class _Setup:
  """Per-model static pieces, computed from the first params seen."""

  def __init__(self, compression: Compression, params: Params, name: str):
    example = _shape_struct(params)
    self.spec = tx.TreeSpec.of(params)
    self.plan = pvt_lib.make_plan(params, compression.pvt_fraction,
                                  compression.pvt_freezable)
    self.states = {}
    self.bits = {}
    for what in ('download', 'upload'):
      transform = getattr(compression, what)
      state = None if transform is None else tx.init_read_only(
          transform, example, f'{name}: the {what} transform')
      self.states[what] = state
      self.bits[what] = float(tx.message_bits(
          transform or tx.identity(), example, state))
    # Per-variable sizes only matter (and need to exist) under PVT.
    self.leaf_bits = None if self.plan.trains_everything else (
        pvt_lib.leaf_bits(compression.upload, params, name))

  def upload_bits(self, mask: Optional[np.ndarray]) -> float:
    if self.leaf_bits is None:
      return self.bits['upload']
    return pvt_lib.masked_bits(self.leaf_bits, mask)


def fedopt(
    grad_fn: GradFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: Optional[optax.GradientTransformation],
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    *,
    local: str = 'sgd',
    fedprox_mu: float = 0.0,
    grads_batch_size: Optional[int] = None,
    server_learning_rate: float = 1.0,
    compression: Compression = Compression(),
    weighting: str = 'examples',
    download_accounting: str = 'dense',
    client_ids: Optional[Sequence[bytes]] = None,
    seed: int = 0,
    name: str = 'fedopt',
    engine: str = 'auto',
    steps_per_call: int = 1,
    step_bucket: str | int = 'grid',
    clients_per_chunk: int | str | None = 'auto',
    nonfinite: str = 'raise',
) -> fedjax.FederatedAlgorithm:
  """Builds a FedOpt round (module docstring) as a ``FederatedAlgorithm``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` of the mean batch loss (e.g.
      ``fedjax.model_grad(model)``; MimeLite: must honour FedJAX's
      ``__mask__`` padding key, as ``model_grad`` does).
    client_optimizer: optax transformation of the local steps (chain
      ``optax.clip_by_global_norm`` for clipping); MimeLite: the base
      optimizer mimicked (Ro et al.: Adagrad).
    server_optimizer: applied to the mean delta (``optax.sgd(1.0)``: FedAvg;
      ``optax.adam(...)``: FedAdam); ignored (None) for MimeLite.
    client_batch_hparams: local batching (``seed=None``: derived per client
      and round from its key).
    local: ``'sgd'``, ``'fedprox'`` or ``'mime_lite'``.
    fedprox_mu: FedProx's ``mu > 0`` (``local='fedprox'`` only).
    grads_batch_size: MimeLite's full-batch gradient batch size (>= 1).
    server_learning_rate: MimeLite's server step on the mean delta.
    compression: upload / download chains and PVT (:class:`Compression`).
    weighting: ``'examples'`` or ``'uniform'`` client weights.
    download_accounting: ``'dense'`` or ``'changed'`` (needs ``client_ids``
      and no download transform).
    client_ids: the training clients' ids (for ``'changed'``).
    seed: run seed (keys the download quantizer).
    name: algorithm name in messages.
    engine, steps_per_call, step_bucket, clients_per_chunk: round engine
      settings (:func:`fedlite_jax.rounds.make_engine`)
      (:mod:`fedlite_jax.rounds`).
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).

  Returns:
    ``FederatedAlgorithm(init, apply)`` over :class:`FedOptState`.
    ``apply(state, clients)`` takes FedJAX's ``[(client_id, ClientDataset,
    PRNGKey)]`` and returns per-client diagnostics ``upload_bits``,
    ``download_bits`` (bits), ``num_examples`` (the client's examples, or
    local steps x batch size under ``'uniform'``), ``delta_l2_norm``,
    ``finite``, ``skipped`` and, under PVT, ``pvt_trained_fraction`` and
    ``pvt_mask`` (bool per variable, ``jax.tree.leaves`` order).

  Raises:
    ValueError: an unknown choice, ``fedprox_mu`` < 0 or set without
      ``'fedprox'``, a missing ``grads_batch_size`` / ``client_ids``, bad
      PVT or transform settings (at ``init``).
    FloatingPointError: from ``apply``: a non-finite client update
      (``'raise'``), every update non-finite (``'skip'``), or a non-finite
      server state (names the clients).
  """
  check_choice(local, LOCAL_RULES, 'local')
  check_choice(weighting, WEIGHTINGS, 'weighting')
  check_choice(download_accounting, DOWNLOAD_ACCOUNTING, 'download_accounting')
  nonfinite_lib.check_policy(nonfinite)
  if not fedprox_mu >= 0 or (fedprox_mu and local != 'fedprox'):
    raise ValueError(f'fedprox_mu={fedprox_mu!r}: must be >= 0, and only '
                     "set with local='fedprox'.")
  mime = local == 'mime_lite'
  if mime:
    grads_batch_size = check_positive_int(grads_batch_size, 'grads_batch_size')
  index = client_id_index(client_ids)
  if download_accounting == 'changed' and (not index or compression.download):
    raise ValueError("download_accounting='changed' needs the training "
                     'client_ids and no download transform.')
  track_changes = download_accounting == 'changed'
  setup_ref: dict[str, _Setup] = {}

  def setup(params) -> _Setup:
    spec = tx.TreeSpec.of(params)
    if 'setup' not in setup_ref or setup_ref['setup'].spec != spec:
      setup_ref['setup'] = _Setup(compression, params, name)
    return setup_ref['setup']

  def plan():
    return setup_ref['setup'].plan

  def upload(tree, key, mask):
    """``(decoded upload, bool[num_leaves] mask)`` of one client."""
    s = setup_ref['setup']
    if mask is None:
      return (_encode_decode(compression.upload, s.states['upload'], tree,
                             key), jnp.ones((len(s.plan.sizes),), bool))
    return pvt_lib.masked_upload(compression.upload, s.states['upload'], tree,
                                 mask, key), mask

  def compress(shared, client_input, delta, mask):
    del shared
    sent, mask = upload(
        delta, jax.random.fold_in(client_input['rng'], UPLOAD_STREAM), mask)
    return ({'delta': sent, 'mask': mask.astype(jnp.float32)},
            {'mask': mask})

  engine_args = dict(steps_per_call=steps_per_call, step_bucket=step_bucket,
      clients_per_chunk=clients_per_chunk)
  train_engine = make_engine(engine, delta_client_program(
      grad_fn, client_optimizer, compress, fedprox_mu=float(fedprox_mu),
      mime=mime, plan=plan), **engine_args)
  if mime:
    grads_hparams = fedjax.PaddedBatchHParams(batch_size=grads_batch_size)

    def grad_upload(total, num, key, mask):
      """The gradient sum as the server receives it: exact when uncompressed,
      else ``num * decode(encode(mean))``."""
      if compression.upload is None:
        ones = jnp.ones((len(setup_ref['setup'].plan.sizes),), bool)
        return ((total, ones) if mask is None else
                (pvt_lib.apply_mask(total, mask), mask))
      mean = jax.tree.map(lambda g: g / jnp.where(num > 0, num, 1.0), total)
      sent, mask = upload(mean, key, mask)
      return jax.tree.map(lambda g: g * num, sent), mask

    grads_engine = make_engine(
        engine, _full_batch_grad_program(grad_fn, grad_upload, plan),
        **engine_args)

  @jax.jit
  def download(params, round_num):
    key = jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(seed), DOWNLOAD_STREAM),
        round_num)
    return _encode_decode(compression.download,
                          setup_ref['setup'].states['download'], params, key)

  @jax.jit
  def server_update(state, sums, weights, grad_sums=None, grad_weights=None):
    mean_delta = _per_leaf_mean(sums, weights)
    if mime:
      params = jax.tree.map(lambda p, q: p - server_learning_rate * q,
                            state.params, mean_delta)
      _, opt_state = client_optimizer.update(
          _per_leaf_mean(grad_sums, grad_weights), state.opt_state,
          state.params)
    else:
      updates, opt_state = server_optimizer.update(
          mean_delta, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    new_state = state.replace(params=params, opt_state=opt_state)
    if track_changes:
      spec = tx.TreeSpec.of(state.params)
      new_state = new_state.replace(last_changed=mark_changed(
          state.last_changed, spec.ravel(state.params), spec.ravel(params),
          state.round))
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> FedOptState:
    s = setup(params)
    optimizer = client_optimizer if mime else server_optimizer
    return FedOptState(
        params=params, opt_state=optimizer.init(params),
        round=jnp.zeros((), jnp.int32),
        last_changed=jnp.full((s.spec.size if track_changes else 0,), -1,
                              jnp.int32),
        last_round=jnp.full((len(index),), -1, jnp.int32))

  def apply(state: FedOptState, clients: Clients):
    s = setup(state.params)
    round_num = int(state.round)
    sent = download(state.params, state.round)
    work = make_work(clients, client_batch_hparams, weighting)
    positions = client_positions(index, work)
    dense_down = s.bits['download']
    shared = {'params': sent}
    if mime:
      shared['opt_state'] = state.opt_state
      dense_down += FLOAT_BITS * sum(
          np.size(x) for x in jax.tree.leaves(state.opt_state)
          if jnp.issubdtype(jnp.result_type(x), jnp.floating))
    down = download_bits(download_accounting, dense_down, len(work),
                         state.last_changed, state.last_round[positions])
    train = train_engine(shared, work)
    ok = [bool(d['finite']) for d in train.diagnostics]
    sums = [train.weighted_sum]
    if mime:
      grad_work = [ClientWork(cid, list(cds.padded_batch(grads_hparams)),
                              {'rng': rng}, 1.0) for cid, cds, rng in clients]
      grads = grads_engine({'params': sent}, grad_work)
      grads_ok = [bool(d['finite']) for d in grads.diagnostics]
      sums.append(grads.weighted_sum)
    skipped = nonfinite_lib.resolve(
        [w.client_id for w in work],
        [a and b for a, b in zip(ok, grads_ok)] if mime else ok, nonfinite,
        name, round_num)
    if mime and skipped:
      # Each pass zeroed its own non-finite outputs; a client skipped for
      # the other pass only is still in this pass's sum: rerun that pass
      # without the skipped clients (rare; same per-client results).
      drop = set(skipped)
      for i, (eng, ws, flags) in enumerate(
          ((train_engine, work, ok), (grads_engine, grad_work, grads_ok))):
        if any(f for w, f in zip(ws, flags) if w.client_id in drop):
          sums[i] = eng(shared if i == 0 else {'params': sent},
                        [w for w in ws if w.client_id not in drop]
                        ).weighted_sum
    args = [sums[0]['delta'], sums[0]['mask']]
    if mime:
      args += [sums[1]['delta'], sums[1]['mask']]
    new_state, finite = server_update(state, *args)
    nonfinite_lib.check_server_state(finite, name, skipped, round_num)
    new_state = participation(new_state, index, positions, round_num)
    factor = 2 if mime else 1
    pvt_extra = None
    if not s.plan.trains_everything:
      pvt_extra = lambda d: {  # noqa: E731
          'pvt_mask': np.asarray(d['mask'], bool),
          'pvt_trained_fraction': pvt_lib.realized_fraction(
              s.plan, np.asarray(d['mask'], bool))}
    examples = [w.weight if weighting == 'examples' else
                len(w.batches) * client_batch_hparams.batch_size for w in work]
    diagnostics = client_diagnostics(
        work, train, download=down, num_examples=examples, skipped=skipped,
        upload_bits=lambda d: factor * s.upload_bits(
            np.asarray(d['mask'], bool)), extra=pvt_extra)
    if mime:
      for cid, g in zip([w.client_id for w in work], grads_ok):
        diagnostics[cid]['finite'] &= g
    return new_state, diagnostics

  return fedjax.FederatedAlgorithm(init, apply)


# --------------------------------------------------------------------------
# Named configurations.

def federated_averaging(
    grad_fn: GradFn, client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams, *,
    name: str = 'fedavg', **kwargs) -> fedjax.FederatedAlgorithm:
  """FedAvg / FedAdam (McMahan et al. 2017; Reddi et al. 2021), uncompressed.

  Same math as ``fedjax.algorithms.fed_avg`` (``tests/test_fedavg.py``
  checks equality); 32 bits per parameter each way. ``kwargs``: the
  engine / ``nonfinite`` / ``compression`` arguments of :func:`fedopt`.
  """
  return fedopt(grad_fn, client_optimizer, server_optimizer,
                client_batch_hparams, name=name, **kwargs)


def efficient_federated_averaging(
    grad_fn: GradFn, client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams, *,
    fedprox_mu: float = 0.0, compression: Compression = Compression(),
    name: Optional[str] = None, **kwargs) -> fedjax.FederatedAlgorithm:
  """FedAvg / FedAdam / FedProx with upload + download chains and PVT.

  Ro et al., "Scaling Language Model Size in Cross-Device Federated
  Learning" (2022), Sec. 4-6: FedProx when ``fedprox_mu > 0`` (Li et al.
  2020), else FedAvg / FedAdam by ``server_optimizer``. ``kwargs``: as
  :func:`fedopt` (``seed``, engine settings, ``nonfinite``).
  """
  if not fedprox_mu >= 0:
    raise ValueError(f'fedprox_mu must be >= 0, got {fedprox_mu!r}.')
  return fedopt(grad_fn, client_optimizer, server_optimizer,
                client_batch_hparams, fedprox_mu=fedprox_mu,
                local='fedprox' if fedprox_mu else 'sgd',
                compression=compression,
                name=name or ('fedprox' if fedprox_mu else 'fedavg'), **kwargs)


def efficient_mime_lite(
    grad_fn: GradFn, base_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    grads_batch_size: int, server_learning_rate: float = 1.0, *,
    compression: Compression = Compression(), name: str = 'mime_lite',
    **kwargs) -> fedjax.FederatedAlgorithm:
  """MimeLite (Karimireddy et al. 2020) with upload/download chains and PVT.

  Same round as ``fedjax.algorithms.mime_lite`` (``tests/
  test_fedprox_mimelite.py``): clients step ``base_optimizer`` with the
  server's statistics; each computes its full-batch gradient at ``Q(w)``
  (padded batches of ``grads_batch_size``); the server sets ``w <- w -
  server_learning_rate * mean delta`` and updates the statistics with the
  example-weighted mean gradient. The upload chain also encodes the mean
  gradient (upload = 2 x the delta's bits); the download adds 32 bits per
  float of the statistics. ``kwargs``: as :func:`fedopt`.

  Raises:
    ValueError: ``grads_batch_size`` not an integer >= 1 (and as
      :func:`fedopt`).
  """
  if isinstance(grads_batch_size, bool) or not isinstance(
      grads_batch_size, (int, np.integer)) or grads_batch_size < 1:
    raise ValueError(f'grads_batch_size must be an integer >= 1, got '
                     f'{grads_batch_size!r}.')
  return fedopt(grad_fn, base_optimizer, None, client_batch_hparams,
                local='mime_lite', grads_batch_size=int(grads_batch_size),
                server_learning_rate=float(server_learning_rate),
                compression=compression, name=name, **kwargs)


def compressed_sgd(
    grad_fn: GradFn, client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation, *, batch_size: int,
    local_steps: int = 1, upload: Optional[tx.CommTransform] = None,
    name: str = 'compressed_sgd', **kwargs) -> fedjax.FederatedAlgorithm:
  """SGD, FedAvg with ``local_steps`` local iterations, local Top-K.

  Melas-Kyriazi & Wang (2022), Table 2's "Uncompressed", "FedAvg (2 / 5
  local iters)" and "Local Top-K" rows (FetchSGD's baselines): every client
  takes ``local_steps`` steps on batches of ``batch_size`` (its data wraps
  around), weight 1, and uploads its delta through ``upload`` (e.g.
  ``transforms.top_k(k)``: ``k (32 + ceil(log2 D))`` bits, ``32 k`` with
  ``index_bits='none'``; ``chain(top_k(k), uniform_quantization(8))``).
  ``kwargs``: as :func:`fedopt` (``download_accounting``, ``client_ids``,
  engine settings, ``nonfinite``).
  """
  return fedopt(grad_fn, client_optimizer, server_optimizer,
                batch_hparams(batch_size, local_steps), weighting='uniform',
                compression=Compression(upload=upload), name=name, **kwargs)
