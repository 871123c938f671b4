"""SplitFed and FedLite as FedJAX algorithms (one iteration per round).

Source: Wang et al., 2022, "FedLite: A Scalable Approach for Federated
Learning on Resource-constrained Clients": Section 3 (SplitFed, Thapa et al.
2020), Section 4.1 (grouped product quantization of the uploaded
activations), Section 4.2 / equation 5 (gradient correction), Appendix A.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.algorithms.rounds_common import (
    Clients, check_choice, num_params, WEIGHTINGS)
from fedlite_jax.algorithms import split_accounting
from fedlite_jax.algorithms import split_clients
# Re-exported: the client side as users and tests reach it.
from fedlite_jax.algorithms.split_clients import (  # noqa: F401
    PAD_ID, ClientExecution, LambdaScaling, QuantizerConfig, client_batch,
    loss_vector_mask, resolve_client_execution)
from fedlite_jax.transforms import pq
from fedlite_jax.models import vq_layer
from fedlite_jax.models import split as split_lib
from fedlite_jax.rounds import stats
from fedlite_jax.rounds import sharding

Params = Any
Batch = Mapping[str, Any]
ClientWeighting = Literal['examples', 'uniform']  # rounds_common.WEIGHTINGS
VectorMaskFn = Callable[[Batch, jax.Array], jax.Array]

AUTO_LABEL_BITS = -1
_DROPOUT_FOLD = 1
_KMEANS_FOLD = 2


@fedjax.dataclass
class SplitState:
  """Server-held state of SplitFed / FedLite.

  Attributes:
    params: the whole model ``{'client': w_c, 'server': w_s}``.
    client_opt_state: optax state of ``w_c``'s optimizer (applied centrally).
    server_opt_state: optax state of ``w_s``'s optimizer.
  """
  params: Params
  client_opt_state: optax.OptState
  server_opt_state: optax.OptState


def split_learning(
    split_model: split_lib.SplitModel,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation, batch_size: int, *,
    quantizer: Optional[QuantizerConfig] = None, phi: float = pq.DEFAULT_PHI,
    label_bits: float = AUTO_LABEL_BITS,
    client_weighting: ClientWeighting = 'uniform',
    vector_mask_fn: VectorMaskFn = loss_vector_mask,
    client_execution: ClientExecution = 'auto',
    lanes_per_device: int | str = 'auto', nonfinite: str = 'raise',
) -> fedjax.FederatedAlgorithm:
  """Builds SplitFed (``quantizer=None``) or FedLite as a FedJAX algorithm.

  One ``apply`` is one iteration of Section 3; client ``i``'s backward is
  equation 5, ``[G_i + lambda' M_i (Z_i - Z~_i)]^T dZ_i/dw_c``.

  Args:
    split_model: the task's :class:`~fedlite_jax.models.SplitModel`.
    client_optimizer: for ``w_c`` (``eta_c``), on the mean client gradient.
    server_optimizer: for ``w_s`` (``eta_s``).
    batch_size: ``B``, examples per client per iteration.
    quantizer: FedLite's quantizer and ``lambda``; None for SplitFed.
    phi: bits per float for the ``paper_*`` accounting (paper: 64).
    label_bits: bits per uploaded label entry; -1: ``ceil(log2 C)``, ``C``
      the number of model outputs (1 for multi-hot labels); 0: not sent.
    client_weighting: ``p_i``: ``'uniform'`` (1) or ``'examples'`` (the
      client's example count), as FedOpt's ``weighting``.
    vector_mask_fn: ``(client_batch, client_activations) -> mask`` of the
      vectors that get the gradient correction (:func:`loss_vector_mask`).
    client_execution: ``'vmap'``, ``'unroll'`` or ``'auto'``
      (:func:`resolve_client_execution`); same result to float tolerance.
    lanes_per_device: clients per device in one call of the compiled
      iteration, an int >= 1 or 'auto' (``stats.resolve_lanes``, at most the
      first cohort's clients per device); the cohort runs in calls of that
      many clients, gradient sums accumulated on the devices.
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).

  Returns:
    ``FederatedAlgorithm(init, apply)`` over :class:`SplitState`; diagnostics
    ``num_examples`` (``B``), ``loss`` and ``train_loss`` (the server-side
    batch mean loss before the update), for
    FedLite ``quantization_error`` (mean squared error per vector) and
    ``relative_quantization_error`` (``||Z - Z~||_F^2 / ||Z||_F^2``), the
    bits of :data:`split_accounting.BIT_KEYS`, ``finite``, ``skipped``.

  Raises:
    ValueError: ``batch_size < 1``, an unknown ``client_weighting``,
      ``client_execution`` or ``nonfinite``, a negative ``label_bits`` other
      than -1, or (from ``apply``) a quantizer that does not fit the
      activations, a client without data, clients with different batch keys.
    FloatingPointError: from ``apply``: a non-finite client (``'raise'``),
      every client non-finite (``'skip'``), or a non-finite server state.
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or \
      batch_size < 1:
    raise ValueError(f'batch_size must be an integer >= 1, got {batch_size!r}.')
  check_choice(client_weighting, WEIGHTINGS, 'client_weighting')
  if label_bits != AUTO_LABEL_BITS and not label_bits >= 0:
    raise ValueError(f'label_bits must be >= 0 or -1 (auto), got '
                     f'{label_bits!r}.')
  nonfinite_lib.check_policy(nonfinite)
  if quantizer is not None:  # L <= N q / R: checked on the first batch.
    d = split_model.cut_size
    if d % quantizer.num_subvectors:
      raise ValueError(
          f'num_subvectors (q) must divide the cut size d={d}, got '
          f'q={quantizer.num_subvectors}.')
  execution = resolve_client_execution(client_execution)
  if lanes_per_device != 'auto':
    stats.resolve_lanes(lanes_per_device, 0)  # Validates it.
  model, client_apply, server_apply = (
      split_model.model, split_model.client_apply, split_model.server_apply)
  name = 'SplitFed' if quantizer is None else 'FedLite'
  # Several devices (one process): the client axis is split over the mesh.
  mesh = sharding.current_client_mesh()
  if mesh is not None and mesh.num_devices == 1:
    mesh = None
  if mesh is not None and mesh.multi_process:
    raise ValueError(f'{name} runs in one process (several devices are '
                     'fine); got a mesh over several processes.')

  if quantizer is not None:
    upload = split_clients.pq_upload(quantizer, phi)

  def objective_and_grads(params, batch, rngs, weights, total=None):
    """Steps 1-4: ``(gradient sum, diagnostics)``; ``total``: cohort weight."""
    wc, ws = split_model.split_params(params)
    drop = jax.vmap(lambda k: jax.random.fold_in(k, _DROPOUT_FOLD))(rngs)
    p = weights / (jnp.sum(weights) if total is None else total)

    z, client_vjp = split_clients.client_forward_vjp(  # z: [C, B, (T,) d]
        client_apply, wc, batch, drop, execution)
    num_clients = z.shape[0]
    diag = {}
    if quantizer is not None:
      flat = z.reshape(num_clients, -1, z.shape[-1])  # [C, N, d]
      kmeans_keys = jax.vmap(
          lambda k: jax.random.fold_in(k, _KMEANS_FOLD))(rngs)
      z_up = jax.vmap(upload)(flat, kmeans_keys)  # [C, N, d]
      (diag['quantization_error'],
       diag['relative_quantization_error']) = jax.vmap(
           pq.quantization_errors)(flat, z_up)
      z_up = z_up.reshape(z.shape)

      # Equation 5: forward Z~, backward G + lambda' p_i M_i (Z - Z~).
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

    # cotangent[i] = p_i [G_i + lambda' M_i (Z_i - Z~_i)], G_i = dl_i / dZ~_i.
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
    uc, c_opt = client_optimizer.update(gc, state.client_opt_state, wc)
    us, s_opt = server_optimizer.update(gs, state.server_opt_state, ws)
    params = split_model.merge_params(optax.apply_updates(wc, uc),
                                      optax.apply_updates(ws, us))
    new_state = SplitState(params, c_opt, s_opt)
    return new_state, nonfinite_lib.all_finite(new_state)

  # Calls of `lanes` clients: gradient sums accumulated on the device, then
  # one update; the shapes are fixed at the first apply.
  def split_lanes(params, batch, rngs, weights, total):
    return objective_and_grads(params, batch, rngs, weights, total)

  lane_grads = jax.jit(split_lanes)
  apply_update = jax.jit(update)
  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)
  lanes_ref = []  # Resolved lanes per device (first apply).

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
        cut_size=split_model.cut_size, num_vectors=num_vectors,
        num_client_params=num_params(wc), num_params=num_params(state.params),
        quantizer=None if quantizer is None else quantizer.shape, phi=phi,
        label_elements=elements, bits_per_label=per_label)
    bits_cache[sig] = bits
    return bits

  def init(params: Params) -> SplitState:
    wc, ws = split_model.split_params(params)
    return SplitState(params, client_optimizer.init(wc),
                      server_optimizer.init(ws))

  def apply(state: SplitState, clients: Clients):
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

    devices = 1 if mesh is None else mesh.num_devices
    if not lanes_ref:
      lanes_ref.append(min(
          stats.resolve_lanes(lanes_per_device, stats.tree_bytes(
              split_model.split_params(state.params)[0])),
          -(-len(clients) // devices)))
    lanes = lanes_ref[0] * devices
    slots_total = -(-len(clients) // lanes) * lanes

    def run(keep: Sequence[bool]):
      # Slots not kept and the padding to whole chunks hold zero-weight
      # copies of the first kept client (p_i = 0: no effect).
      fill = list(keep).index(True)
      extra = slots_total - len(clients)
      slots = [i if k else fill for i, k in enumerate(keep)] + [fill] * extra
      w = np.asarray([weights[i] if k else 0.0 for i, k in enumerate(keep)] +
                     [0.0] * extra, np.float32)

      def args(part):
        out = (split_clients.stack_batches([batches[i] for i in slots[part]]),
               np.stack([rngs[i] for i in slots[part]]), w[part])
        return out if mesh is None else jax.device_put(out,
                                                       mesh.client_sharding)

      total = np.float32(np.sum(w, dtype=np.float32))
      grads, diags = None, []
      for start in range(0, len(slots), lanes):
        g, d = lane_grads(state.params, *args(slice(start, start + lanes)),
                          total)
        grads = g if grads is None else add(grads, g)
        diags.append(d)
      new_state, finite = apply_update(state, grads)
      diags = jax.device_get(diags)
      return new_state, {k: np.concatenate([d[k] for d in diags])
                         for k in diags[0]}, finite

    stats.record('split', clients=len(clients), useful_steps=len(clients),
                 executed_steps=slots_total,
                 sequential_steps=slots_total // lanes,
                 segments=slots_total // lanes, lanes=lanes, segment_steps=1)
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
      d['train_loss'] = d['loss']  # The runner's per-client training loss.
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
  if kwargs.pop('quantizer', None) is not None:
    raise ValueError('splitfed takes no quantizer; use fedlite.')
  return split_learning(split_model, client_optimizer, server_optimizer,
                        batch_size, **kwargs)


def fedlite(split_model: split_lib.SplitModel,
            client_optimizer: optax.GradientTransformation,
            server_optimizer: optax.GradientTransformation,
            batch_size: int, quantizer: QuantizerConfig,
            **kwargs) -> fedjax.FederatedAlgorithm:
  """FedLite (Section 4): SplitFed + grouped PQ upload + equation-5 gradient.

  ValueError if ``quantizer`` is not a :class:`QuantizerConfig`.
  """
  if not isinstance(quantizer, QuantizerConfig):
    raise ValueError(f'fedlite needs a QuantizerConfig, got {quantizer!r}.')
  return split_learning(split_model, client_optimizer, server_optimizer,
                        batch_size, quantizer=quantizer, **kwargs)
