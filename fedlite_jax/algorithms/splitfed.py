"""SplitFed and FedLite as FedJAX algorithms (one iteration per round).

Sources: Wang et al., 2022, "FedLite: A Scalable Approach for Federated
Learning on Resource-constrained Clients": Section 3 (SplitFed, Thapa et al.
2020), Section 4.1 (grouped product quantization of the uploaded
activations), Section 4.2 / equation 5 (gradient correction), Appendix A.

One ``apply`` is one iteration of Section 3 for the sampled clients ``S``:

1. **Client forward.** Client ``i`` takes one mini-batch of ``B`` examples
   and computes ``Z_i = u(w_c; batch_i)`` (``[B, d]``, or ``[B, T, d]`` for
   the NWP LSTM: ``N = B T`` vectors of size ``d``, one per token position).
2. **Upload.** SplitFed sends ``Z_i``; FedLite sends the grouped-PQ message
   of ``Z_i`` (codebook + codewords, :func:`fedlite_jax.fedlite.pq.grouped_pq`,
   with a fresh codebook every iteration, as the paper requires), from which
   the server rebuilds ``Z~_i``. Labels go up as well.
3. **Server update.** The server evaluates its part on the concatenation of
   all clients' (quantized) activations; its objective is
   ``F_s = sum_i p_i l_i / sum_i p_i`` with ``l_i`` the mean training loss of
   client ``i``'s batch (``model.train_loss``, averaged over the ``B``
   examples, as ``fedjax.model_grad``). It steps ``w_s`` with its own
   optimizer on ``dF_s/dw_s`` and returns ``G_i = dl_i/dZ~_i`` to client ``i``.
4. **Client backward.** Equation 5 for every example, averaged like the
   loss: ``g_i = [G_i + lambda' M_i (Z_i - Z~_i)]^T dZ_i/dw_c``. With the
   default ``lambda_scaling='example'``, ``lambda' = lambda / B``: the
   corrected per-example gradients ``[dl_j/dz~_j + lambda (z_j - z~_j)]
   dz_j/dw_c`` are averaged over the batch exactly as the paper's analysis
   does (Appendix B, equation 36), i.e. the Appendix A surrogate
   ``(lambda/2) ||z_j - z~_j||^2`` is added to every example's loss (summed
   over its vectors for sequences) before the batch mean
   (``loss_reduction='mean'``, ``num_vectors = B``). With
   ``lambda_scaling='batch'``, ``lambda' = lambda``: ``lambda (Z - Z~)`` is
   added to the gradient of the client's batch-mean loss (a plain
   ``custom_vjp`` adding ``lambda (z - z~)`` in a mean-loss model,
   ``loss_reduction='sum'``; ``lambda_batch = lambda_example / B``). The
   paper does not say which its code used. ``M_i`` masks vectors that carry
   no loss (NWP positions whose target is PAD, see :func:`loss_vector_mask`);
   ``lambda = 0`` is the straight-through update and SplitFed has no
   correction (``Z~ = Z``). The correction is not built here: the server's
   objective reads the clients' ``Z`` through
   :func:`fedlite_jax.fedlite.vq_layer.vq_with_correction` (forward ``Z~``,
   ``vector_weights = (p_i / sum p) M_i``), so differentiating it w.r.t.
   ``Z`` yields the corrected cotangents
   ``(p_i / sum p) [G_i + lambda' M_i (Z_i - Z~_i)]``.
5. **Client-model synchronization.** ``g_c = sum_i p_i g_i / sum_i p_i`` is
   applied to ``w_c`` with the client optimizer.

Weights ``p_i``: ``'uniform'`` (default, ``p_i = 1``: every client contributes
``B`` examples, so with SGD and no quantization the iteration IS one step of
mini-batch SGD on the whole model over the ``B |S|`` examples, with learning
rate ``eta_c`` on ``w_c`` and ``eta_s`` on ``w_s``; ``eta_c = eta_s = eta``
gives plain SGD(``eta``) -- ``tests/test_splitfed.py`` checks this against
``jax.grad`` of the whole ``fedjax.Model``) or ``'num_examples'`` (``p_i =
|D_i|``, the client's dataset size; still exact SGD on that weighted loss).

Mini-batch choice: clients are stateless (FedJAX gives each sampled client a
fresh PRNG key per round), so "its next batch" is the first batch of a
shuffle-repeat pass seeded by the client's key
(``fedjax.ShuffleRepeatBatchHParams(batch_size=B, num_epochs=None,
num_steps=1)``, seed :func:`fedlite_jax.algorithms.batching.
shuffle_seed_from_rng`): ``B`` examples uniformly without replacement, or the
whole dataset plus uniformly re-drawn examples when it has fewer than ``B``.
Dropout (client and server part) uses ``fold_in(key, 1)`` of the client's
key -- the same key for both parts, so the split model draws exactly the
masks ``model.apply_for_train(params, batch_i, fold_in(key, 1))`` would -- and
the k-means initialization ``fold_in(key, 2)``.

Execution: the whole iteration of all clients is ONE jitted program: the
clients' forward passes (``client_execution='vmap'``: ``jax.vmap`` over
clients with the shared ``w_c``, so a convolution is one convolution over
``|S| B`` images, not a grouped one; ``'unroll'``: one forward per client,
unrolled in the same program, the CPU default because XLA:CPU's
convolution-kernel and max-pool gradients scale badly with the batch), the
quantizer vmapped over clients (one k-means per client), the server step on
all clients' activations, and the VJP of the client forward with the
per-client cotangents ``(p_i / sum p) [G_i + correction_i]``, which yields
``g_c`` directly (the weighted sum of the per-client ``g_i``, by linearity).
The program is compiled once per cohort size and batch shape.

Communication per client per iteration: see
:mod:`fedlite_jax.algorithms.split_accounting`.

Non-finite clients (:mod:`fedlite_jax.algorithms.nonfinite`): a client
whose activations, batch loss or returned gradient ``G_i`` is NaN/Inf
raises (``nonfinite='raise'``) or is dropped (``'skip'``): the iteration is
recomputed with that client's slot holding a zero-weight copy of a kept
client (``p_i = 0``, as the padding of a device mesh), so the result equals
the iteration without it; it downloaded the client-side model but sent
nothing and received no gradient
(:func:`split_accounting.skipped_client_bits`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.algorithms import split_accounting
from fedlite_jax.fedlite import pq
from fedlite_jax.fedlite import vq_layer
from fedlite_jax.models import split as split_lib
from fedlite_jax.rounds import chunking
from fedlite_jax.rounds import sharding

Params = Any
Batch = Mapping[str, Any]
ClientWeighting = Literal['uniform', 'num_examples']
VectorMaskFn = Callable[[Batch, jax.Array], jax.Array]
ClientExecution = Literal['auto', 'vmap', 'unroll']
LambdaScaling = Literal['batch', 'example']

PAD_ID = 0
AUTO_LABEL_BITS = -1
_DROPOUT_FOLD = 1
_KMEANS_FOLD = 2


@fedjax.dataclass
class SplitState:
  """Server-held state of SplitFed / FedLite.

  Attributes:
    params: the whole model ``{'client': w_c, 'server': w_s}``.
    client_opt_state: optax state of the client-side model's optimizer (the
      synchronized client model is updated centrally, step 5).
    server_opt_state: optax state of the server-side model's optimizer.
  """
  params: Params
  client_opt_state: optax.OptState
  server_opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class QuantizerConfig:
  """FedLite's quantization layer (Sections 4.1 and 4.2).

  Attributes:
    num_subvectors: ``q``, subvectors per activation vector (divides ``d``).
    num_groups: ``R``, groups sharing one codebook (divides ``q``; 1 is the
      paper's default, ``R = q`` vanilla product quantization).
    num_centroids: ``L``, k-means centroids per group
      (``1 <= L <= N q / R`` with ``N`` vectors per client).
    correction_lambda: ``lambda >= 0`` of equation 5 (module docstring); 0
      is the straight-through update.
    lambda_scaling: ``'example'`` (default; ``lambda / B``: equation 5 per
      example, averaged as in Appendix B eq. 36) or ``'batch'`` (``lambda
      (Z - Z~)`` added to the gradient of the client's batch-mean loss).
    kmeans_iters: Lloyd iterations per k-means (``>= 0``).
    empty_cluster: ``'farthest'`` or ``'keep'`` (see
      :mod:`fedlite_jax.fedlite.pq`).
  """
  num_subvectors: int
  num_groups: int = 1
  num_centroids: int = 2
  correction_lambda: float = 0.0
  lambda_scaling: LambdaScaling = 'example'
  kmeans_iters: int = pq.DEFAULT_NUM_ITERS
  empty_cluster: pq.EmptyClusterRule = 'farthest'

  def __post_init__(self):
    for name in ('num_subvectors', 'num_groups', 'num_centroids'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
    if self.num_subvectors % self.num_groups:
      raise ValueError(f'num_groups (R) must divide num_subvectors '
                       f'q={self.num_subvectors}, got R={self.num_groups}.')
    lam = self.correction_lambda
    if (isinstance(lam, bool) or not isinstance(lam, (int, float)) or
        not math.isfinite(lam) or lam < 0):
      raise ValueError(f'correction_lambda must be a finite number >= 0, got '
                       f'{lam!r}.')
    if self.lambda_scaling not in ('batch', 'example'):
      raise ValueError(f"lambda_scaling must be 'batch' or 'example', got "
                       f'{self.lambda_scaling!r}.')
    if (isinstance(self.kmeans_iters, bool) or
        not isinstance(self.kmeans_iters, int) or self.kmeans_iters < 0):
      raise ValueError(f'kmeans_iters must be an integer >= 0, got '
                       f'{self.kmeans_iters!r}.')
    if self.empty_cluster not in ('farthest', 'keep'):
      raise ValueError(f"empty_cluster must be 'farthest' or 'keep', got "
                       f'{self.empty_cluster!r}.')

  @property
  def shape(self) -> split_accounting.PQShape:
    return split_accounting.PQShape(self.num_subvectors, self.num_groups,
                                    self.num_centroids)

  def validate(self, cut_size: int, num_vectors: int) -> None:
    """Checks ``q | d``, ``R | q`` and ``L <= N q / R``.

    Raises:
      ValueError: naming the offending value (``pq.validate_pq_config``).
    """
    pq.validate_pq_config(cut_size, num_vectors, self.num_subvectors,
                          self.num_groups, self.num_centroids)


def loss_vector_mask(batch: Batch, activations: jax.Array) -> jax.Array:
  """Which activation vectors of one client carry training loss.

  For sequence activations ``[B, T, d]`` with integer targets ``batch['y']``
  of shape ``[B, T]`` (next-word prediction): positions whose target is not
  PAD (id 0, FedJAX's convention; their loss is masked out of
  ``train_loss``). Otherwise all vectors.

  Args:
    batch: one client's batch.
    activations: its activations, ``[B, d]`` or ``[B, T, d]``.

  Returns:
    float32 of shape ``activations.shape[:-1]`` with entries in {0, 1}.
  """
  lead = activations.shape[:-1]
  y = batch.get('y') if hasattr(batch, 'get') else None
  if (len(lead) == 2 and y is not None and tuple(y.shape) == tuple(lead) and
      jnp.issubdtype(y.dtype, jnp.integer)):
    return (y != PAD_ID).astype(jnp.float32)
  return jnp.ones(lead, jnp.float32)


def _num_params(tree: Params) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(tree)))


def _stack(batches: Sequence[Batch]) -> dict[str, np.ndarray]:
  keys = set(batches[0])
  for b in batches[1:]:
    if set(b) != keys:
      raise ValueError(f'Clients have different batch keys: {sorted(keys)} vs '
                       f'{sorted(b)}.')
  return {k: np.stack([np.asarray(b[k]) for b in batches]) for k in keys}


def client_batch(dataset: fedjax.ClientDataset, batch_size: int,
                 rng: jax.Array) -> dict[str, np.ndarray]:
  """The one mini-batch a client uses in an iteration (module docstring).

  Args:
    dataset: the client's data (at least one example).
    batch_size: ``B``.
    rng: the client's PRNG key for this iteration.

  Returns:
    A dict of NumPy arrays with ``B`` rows each.

  Raises:
    ValueError: if the client has no examples.
  """
  hparams = fedjax.ShuffleRepeatBatchHParams(
      batch_size=batch_size, num_epochs=None, num_steps=1)
  return batching.client_batches(dataset, hparams, rng)[0]


def resolve_client_execution(execution: ClientExecution) -> str:
  """``'auto'`` -> ``'unroll'`` on CPU, ``'vmap'`` on GPU/TPU.

  Raises:
    ValueError: for a value other than 'auto', 'vmap', 'unroll'.
  """
  if execution not in ('auto', 'vmap', 'unroll'):
    raise ValueError(f"client_execution must be 'auto', 'vmap' or 'unroll', "
                     f'got {execution!r}.')
  if execution == 'auto':
    return 'unroll' if jax.default_backend() == 'cpu' else 'vmap'
  return execution


def _client_forward_vjp(client_apply, wc, batch, drop, execution: str):
  """Client forward of all clients and the VJP of their sum w.r.t. ``w_c``.

  Returns ``(z, vjp)``: ``z`` stacks the clients' activations ``[C, ...]``;
  ``vjp(cotangent[C, ...])`` returns ``(sum_i cot_i^T dz_i/dw_c,)``.

  ``'vmap'``: one ``jax.vmap`` over clients with the shared ``w_c``.
  ``'unroll'``: a Python loop over clients inside the same jitted program
  (one forward and one VJP per client, then a sum). On XLA:CPU the
  convolution-kernel gradient and max-pool gradient scale badly with the
  batch (EMNIST CNN client part, fwd+bwd: 35 ms at 20 images, 980 ms at 200),
  so a whole FEMNIST iteration (10 clients x 20) ran ~1.5x faster unrolled
  (0.8 vs 1.2 s on a loaded 2-core machine).
  """
  if execution == 'vmap':
    return jax.vjp(
        lambda w: jax.vmap(client_apply, in_axes=(None, 0, 0))(w, batch, drop),
        wc)
  num_clients = drop.shape[0]
  zs, vjps = [], []
  for i in range(num_clients):
    batch_i = jax.tree.map(lambda x, i=i: x[i], batch)
    z_i, vjp_i = jax.vjp(
        lambda w, b=batch_i, k=drop[i]: client_apply(w, b, k), wc)
    zs.append(z_i)
    vjps.append(vjp_i)

  def vjp(cotangent):
    grads = [vjps[i](cotangent[i])[0] for i in range(num_clients)]
    return (jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *grads),)

  return jnp.stack(zs), vjp


def split_learning(
    split_model: split_lib.SplitModel,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    batch_size: int,
    *,
    quantizer: Optional[QuantizerConfig] = None,
    phi: float = pq.DEFAULT_PHI,
    label_bits: float = AUTO_LABEL_BITS,
    client_weighting: ClientWeighting = 'uniform',
    vector_mask_fn: VectorMaskFn = loss_vector_mask,
    client_execution: ClientExecution = 'auto',
    clients_per_chunk: int | str | None = 'auto',
    nonfinite: str = 'raise',
) -> fedjax.FederatedAlgorithm:
  """Builds SplitFed (``quantizer=None``) or FedLite as a FedJAX algorithm.

  Args:
    split_model: the task's :class:`~fedlite_jax.models.SplitModel`.
    client_optimizer: optax transformation for ``w_c`` (applied once per
      iteration to the synchronized client gradient ``g_c``; its learning
      rate is the paper's ``eta_c``).
    server_optimizer: optax transformation for ``w_s`` (``eta_s``).
    batch_size: ``B``, examples per client per iteration.
    quantizer: FedLite's quantizer and ``lambda``; None for SplitFed.
    phi: bits per float for the ``paper_*`` accounting (paper: 64).
    label_bits: bits per uploaded label entry; -1 (default) for
      ``ceil(log2 C)`` with ``C`` the number of model outputs (1 bit per
      entry for multi-hot labels shaped like the predictions), 0 when labels
      are not uploaded (vertical FL).
    client_weighting: ``'uniform'`` or ``'num_examples'`` (``p_i``).
    vector_mask_fn: ``(client_batch, client_activations) -> mask`` of the
      vectors that get the gradient correction (:func:`loss_vector_mask`).
    client_execution: how the clients' forward/backward passes are laid out
      in the one compiled program: ``'vmap'``, ``'unroll'`` or ``'auto'``
      (:func:`resolve_client_execution`). Same result to float tolerance.
    clients_per_chunk: clients per device of one compiled program: the
      iteration's gradient is summed over chunks of this many clients on
      the device (peak memory follows the chunk), then applied once; an int
      > 0, 0/None (the whole cohort in one program), or 'auto'
      (:func:`fedlite_jax.rounds.chunking.resolve_clients_per_chunk` from the
      client model's size). Same result to float tolerance.
    nonfinite: ``'raise'`` or ``'skip'`` (module docstring).

  Returns:
    ``fedjax.FederatedAlgorithm(init, apply)``; ``init(params)`` takes the
    whole model's ``{'client', 'server'}`` parameters and returns a
    :class:`SplitState`; ``apply(state, [(client_id, ClientDataset, key)])``
    runs one iteration and returns ``(state, {client_id: diagnostics})``.
    Diagnostics (floats): ``num_examples`` (``B``), ``loss`` (the client's
    mean training loss on its batch before the update), for FedLite
    ``quantization_error`` (mean squared error per vector) and
    ``relative_quantization_error`` (``||Z - Z~||_F^2 / ||Z||_F^2``), the
    bit counts of :data:`split_accounting.BIT_KEYS` (``upload_bits``,
    ``download_bits``, ``activation_bits``, ...), and the booleans
    ``finite`` and ``skipped``.

  Raises:
    ValueError: for ``batch_size < 1``, an unknown ``client_weighting``, a
      negative ``label_bits`` other than -1, an unknown ``client_execution``,
      or (from ``apply``) a quantizer
      that does not fit the activations (``q`` not dividing ``d``, ``L``
      larger than the subvectors of a group, ...), a client without data or
      clients with different batch keys, an unknown ``nonfinite`` policy.
    FloatingPointError: from ``apply``: a non-finite client (``'raise'``),
      every client non-finite (``'skip'``), or a non-finite server state
      (names the clients).
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or \
      batch_size < 1:
    raise ValueError(f'batch_size must be an integer >= 1, got {batch_size!r}.')
  if client_weighting not in ('uniform', 'num_examples'):
    raise ValueError(f"client_weighting must be 'uniform' or 'num_examples', "
                     f'got {client_weighting!r}.')
  if label_bits != AUTO_LABEL_BITS and not label_bits >= 0:
    raise ValueError(f'label_bits must be >= 0 or -1 (auto), got '
                     f'{label_bits!r}.')
  nonfinite_lib.check_policy(nonfinite)
  if quantizer is not None:
    # q | d and R | q are known now; L <= N q / R is checked on the first
    # batch, when N (B, or B T for sequences) is known.
    d = split_model.cut_size
    if d % quantizer.num_subvectors:
      raise ValueError(
          f'num_subvectors (q) must divide the cut size d={d}, got '
          f'q={quantizer.num_subvectors}.')
  execution = resolve_client_execution(client_execution)
  if clients_per_chunk != 'auto':
    chunking.resolve_clients_per_chunk(clients_per_chunk, 0)  # Validates.
  model = split_model.model
  client_apply = split_model.client_apply
  server_apply = split_model.server_apply
  name = 'SplitFed' if quantizer is None else 'FedLite'
  # Several devices (single process): the client axis of the iteration's
  # inputs is split over the mesh (fedlite_jax.rounds.sharding).
  mesh = sharding.current_client_mesh()
  if mesh is not None and mesh.num_devices == 1:
    mesh = None
  if mesh is not None and mesh.multi_process:
    raise ValueError(f'{name} runs in one process (several devices are '
                     'fine); got a mesh over several processes.')

  def objective_and_grads(params, batch, rngs, weights, total=None):
    """Steps 1-4 for the given clients; returns the sum of their gradients
    and per-client diagnostics. ``total``: the weight of the whole cohort
    (default: of these clients)."""
    wc, ws = split_model.split_params(params)
    drop = jax.vmap(lambda k: jax.random.fold_in(k, _DROPOUT_FOLD))(rngs)
    p = weights / (jnp.sum(weights) if total is None else total)

    z, client_vjp = _client_forward_vjp(client_apply, wc, batch, drop,
                                        execution)  # [C, B, (T,) d]
    num_clients = z.shape[0]
    diag = {}
    if quantizer is not None:
      flat = z.reshape(num_clients, -1, z.shape[-1])  # [C, N, d]
      kmeans_keys = jax.vmap(
          lambda k: jax.random.fold_in(k, _KMEANS_FOLD))(rngs)
      quantize = functools.partial(
          pq.grouped_pq, q=quantizer.num_subvectors, R=quantizer.num_groups,
          L=quantizer.num_centroids, num_iters=quantizer.kmeans_iters,
          phi=phi, empty_cluster=quantizer.empty_cluster)
      result = jax.vmap(quantize)(flat, kmeans_keys)
      z_up = result.reconstruction.reshape(z.shape)
      diag['quantization_error'] = result.quantization_error
      diag['relative_quantization_error'] = result.relative_error

      # Equation 5 via the custom_vjp layer: forward Z~, backward
      # G + lambda' w (Z - Z~) with w = p_i M_i (p normalized; step 4).
      mask = jax.vmap(vector_mask_fn)(batch, z)  # [C, B, (T)]
      vector_weights = p.reshape((num_clients,) + (1,) * (mask.ndim - 1)) * mask
      example = quantizer.lambda_scaling == 'example'
      correct = functools.partial(
          vq_layer.vq_with_correction, z_tilde=z_up,
          lam=quantizer.correction_lambda,
          loss_reduction='mean' if example else 'sum',
          num_vectors=z.shape[1], vector_weights=vector_weights)

    def server_objective(ws, z):
      z_server = z if quantizer is None else correct(z)
      preds = jax.vmap(server_apply, in_axes=(None, 0, 0, 0))(ws, z_server,
                                                              batch, drop)
      losses = jax.vmap(model.train_loss)(batch, preds)  # [C, B]
      client_loss = jnp.mean(losses, axis=1)
      return jnp.sum(p * client_loss), client_loss

    # cotangent[i] = p_i [G_i + lambda' M_i (Z_i - Z~_i)] (p normalized), with
    # G_i = dl_i / dZ~_i the download of client i.
    (_, client_loss), (g_server, cotangent) = jax.value_and_grad(
        server_objective, argnums=(0, 1), has_aux=True)(ws, z)
    (g_client,) = client_vjp(cotangent)
    diag['loss'] = client_loss
    diag['finite'] = (
        jnp.all(jnp.isfinite(z.reshape(num_clients, -1)), axis=1) &
        jnp.isfinite(client_loss) &
        jnp.all(jnp.isfinite(cotangent.reshape(num_clients, -1)), axis=1))
    return split_model.merge_params(g_client, g_server), diag

  def update(state: SplitState, grads):
    wc, ws = split_model.split_params(state.params)
    gc, gs = split_model.split_params(grads)
    uc, client_opt_state = client_optimizer.update(gc, state.client_opt_state,
                                                   wc)
    us, server_opt_state = server_optimizer.update(gs, state.server_opt_state,
                                                   ws)
    params = split_model.merge_params(optax.apply_updates(wc, uc),
                                      optax.apply_updates(ws, us))
    new_state = SplitState(params, client_opt_state, server_opt_state)
    return new_state, nonfinite_lib.all_finite(new_state)

  @jax.jit
  def iteration(state: SplitState, batch, rngs, weights):
    """The whole cohort as one program."""
    grads, diag = objective_and_grads(state.params, batch, rngs, weights)
    return (*update(state, grads), diag)

  # The cohort in chunks: gradient sums accumulated on the device (the
  # objective is a p-weighted sum over clients), then one update.
  chunk_grads = jax.jit(objective_and_grads)
  apply_update = jax.jit(update)
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)
  per_chunk_ref = []  # Resolved clients_per_chunk (first apply).

  bits_cache: dict[Any, split_accounting.IterationBits] = {}

  def bits_for(state: SplitState,
               batch0: Batch) -> split_accounting.IterationBits:
    """Per-client bit counts for this batch shape (computed once per shape)."""
    sig = tuple(sorted((k, tuple(np.shape(v)), str(np.asarray(v).dtype))
                       for k, v in batch0.items()))
    if sig in bits_cache:
      return bits_cache[sig]
    wc, ws = split_model.split_params(state.params)
    z = jax.eval_shape(client_apply, wc, batch0, None)
    preds = jax.eval_shape(server_apply, ws, z, batch0, None)
    if z.shape[-1] != split_model.cut_size:
      raise ValueError(f'Client activations have size {z.shape[-1]}, the '
                       f'model declares cut_size={split_model.cut_size}.')
    num_vectors = int(np.prod(z.shape[:-1]))
    if quantizer is not None:
      quantizer.validate(split_model.cut_size, num_vectors)
    y = batch0.get('y')
    if label_bits == 0 or y is None:
      elements, per_label = 0, 0.0
    else:
      elements = int(np.size(y))
      if label_bits != AUTO_LABEL_BITS:
        per_label = float(label_bits)
      elif tuple(np.shape(y)) == tuple(preds.shape):
        per_label = 1.0  # Multi-hot labels: one bit per entry.
      else:
        per_label = float(math.ceil(math.log2(max(preds.shape[-1], 2))))
    bits = split_accounting.iteration_bits(
        cut_size=split_model.cut_size,
        num_vectors=num_vectors,
        num_client_params=_num_params(wc),
        num_params=_num_params(state.params),
        quantizer=None if quantizer is None else quantizer.shape,
        phi=phi,
        label_elements=elements,
        bits_per_label=per_label)
    bits_cache[sig] = bits
    return bits

  def init(params: Params) -> SplitState:
    wc, ws = split_model.split_params(params)
    return SplitState(params, client_optimizer.init(wc),
                      server_optimizer.init(ws))

  def apply(state: SplitState,
            clients: Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]]):
    if not clients:
      raise ValueError(f'{name}: apply needs at least one client.')
    batches, weights = [], []
    for cid, cds, rng in clients:
      if len(cds) == 0:
        raise ValueError(f'{name}: client {cid!r} has no examples.')
      batches.append(client_batch(cds, batch_size, rng))
      weights.append(1.0 if client_weighting == 'uniform' else float(len(cds)))
    bits = bits_for(state, batches[0])
    rngs = [np.asarray(rng) for _, _, rng in clients]
    if mesh is not None:
      state = jax.device_put(state, mesh.replicated)

    if not per_chunk_ref:
      per_chunk_ref.append(chunking.resolve_clients_per_chunk(
          clients_per_chunk, chunking.tree_bytes(
              split_model.split_params(state.params)[0])))
    devices = 1 if mesh is None else mesh.num_devices
    padded = -(-len(clients) // devices) * devices
    lanes = padded if not per_chunk_ref[0] else min(
        per_chunk_ref[0] * devices, padded)
    slots_total = -(-len(clients) // lanes) * lanes

    def run(keep: Sequence[bool]):
      # Slots not kept, and the padding to whole chunks (of a multiple of
      # the device count), hold zero-weight copies of the first kept client
      # (p_i = 0: no effect on the update or the loss).
      fill = list(keep).index(True)
      extra = slots_total - len(clients)
      slots = [i if k else fill for i, k in enumerate(keep)] + [fill] * extra
      w = np.asarray([weights[i] if k else 0.0 for i, k in enumerate(keep)] +
                     [0.0] * extra, np.float32)

      def args(part):
        out = (_stack([batches[i] for i in slots[part]]),
               np.stack([rngs[i] for i in slots[part]]), w[part])
        return out if mesh is None else jax.device_put(out,
                                                       mesh.client_sharding)

      if lanes == len(slots):
        new_state, finite, diag = iteration(state, *args(slice(None)))
        return new_state, jax.device_get(diag), finite
      total = np.float32(np.sum(w, dtype=np.float32))
      grads, diags = None, []
      for start in range(0, len(slots), lanes):
        g, d = chunk_grads(state.params, *args(slice(start, start + lanes)),
                           total)
        grads = g if grads is None else add(grads, g)
        diags.append(d)
      new_state, finite = apply_update(state, grads)
      diags = jax.device_get(diags)
      return new_state, {k: np.concatenate([d[k] for d in diags])
                         for k in diags[0]}, finite

    chunking.record('split', per_chunk_ref[0], clients=len(clients),
                      client_steps=len(clients), padded_steps=slots_total,
                      chunks=slots_total // lanes)
    ids = [cid for cid, _, _ in clients]
    new_state, diag, finite = run([True] * len(clients))
    skipped = nonfinite_lib.resolve(ids, diag['finite'][:len(clients)],
                                    nonfinite, name)
    if skipped:
      new_state, _, finite = run([cid not in skipped for cid in ids])
    nonfinite_lib.check_server_state(finite, name, skipped)
    out = {}
    for i, cid in enumerate(ids):
      d = {'num_examples': float(batch_size)}
      d.update({k: float(v[i]) for k, v in diag.items() if k != 'finite'})
      d.update(bits.diagnostics() if cid not in skipped else
               split_accounting.skipped_client_bits(bits))
      d['finite'] = bool(diag['finite'][i])
      out[cid] = d
    return new_state, nonfinite_lib.mark_skipped(out, skipped)

  return fedjax.FederatedAlgorithm(init, apply)


def splitfed(split_model: split_lib.SplitModel,
             client_optimizer: optax.GradientTransformation,
             server_optimizer: optax.GradientTransformation,
             batch_size: int, **kwargs) -> fedjax.FederatedAlgorithm:
  """SplitFed (Section 3): :func:`split_learning` without quantization."""
  if kwargs.get('quantizer') is not None:
    raise ValueError('splitfed takes no quantizer; use fedlite.')
  kwargs.pop('quantizer', None)
  return split_learning(split_model, client_optimizer, server_optimizer,
                        batch_size, **kwargs)


def fedlite(split_model: split_lib.SplitModel,
            client_optimizer: optax.GradientTransformation,
            server_optimizer: optax.GradientTransformation,
            batch_size: int, quantizer: QuantizerConfig,
            **kwargs) -> fedjax.FederatedAlgorithm:
  """FedLite (Section 4): SplitFed + grouped PQ upload + equation-5 gradient.

  Raises:
    ValueError: if ``quantizer`` is not a :class:`QuantizerConfig`, and as
      :func:`split_learning`.
  """
  if not isinstance(quantizer, QuantizerConfig):
    raise ValueError(f'fedlite needs a QuantizerConfig, got {quantizer!r}.')
  return split_learning(split_model, client_optimizer, server_optimizer,
                        batch_size, quantizer=quantizer, **kwargs)
