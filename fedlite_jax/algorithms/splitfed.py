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

from fedlite_jax.algorithms import (
    nonfinite as nonfinite_lib, split_accounting, split_clients)
from fedlite_jax.algorithms.rounds_common import (
    Clients, check_choice, num_params, WEIGHTINGS)
# Re-exported: the client side as users and tests reach it.
from fedlite_jax.algorithms.split_clients import (  # noqa: F401
    PAD_ID, ClientExecution, LambdaScaling, QuantizerConfig, client_batch,
    loss_vector_mask, resolve_client_execution)
from fedlite_jax.transforms import pq
from fedlite_jax.models import vq_layer, split as split_lib
from fedlite_jax.rounds import stats, sharding

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


def _settings(split_model, batch_size, quantizer, label_bits, weighting,
              nonfinite, client_execution, lanes_per_device):
  """``(name, client_execution resolved, client mesh or None)``; raises
  :func:`split_learning`'s ValueErrors (also for a multi-process mesh)."""
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or \
      batch_size < 1:
    raise ValueError(f'batch_size must be an integer >= 1, got {batch_size!r}.')
  check_choice(weighting, WEIGHTINGS, 'client_weighting')
  if label_bits != AUTO_LABEL_BITS and not label_bits >= 0:
    raise ValueError(f'label_bits must be >= 0 or -1 (auto), got '
                     f'{label_bits!r}.')
  nonfinite_lib.check_policy(nonfinite)
  # L <= N q / R: checked on the first batch.
  if quantizer is not None and split_model.cut_size % quantizer.num_subvectors:
    raise ValueError(
        f'num_subvectors (q) must divide the cut size d={split_model.cut_size}'
        f', got q={quantizer.num_subvectors}.')
  execution = resolve_client_execution(client_execution)
  if lanes_per_device != 'auto':
    stats.resolve_lanes(lanes_per_device, 0)  # Validates it.
  name = 'SplitFed' if quantizer is None else 'FedLite'
  mesh = sharding.current_client_mesh()
  if mesh is not None and mesh.num_devices == 1:
    mesh = None
  if mesh is not None and mesh.multi_process:
    raise ValueError(f'{name} runs in one process (several devices are '
                     'fine); got a mesh over several processes.')
  return name, execution, mesh


def _quantize(quantizer: QuantizerConfig, upload, vector_mask_fn, z, batch,
              rngs, p):
  """Sections 4.1-4.2 on ``z [C, B, (T,) d]``: ``(correct, diag)``;
  ``correct(z)`` is ``Z~`` forward and ``G + lambda' p_i M_i (Z - Z~)``
  backward (equation 5); ``diag``: the ``[C]`` quantization errors."""
  num_clients = z.shape[0]
  flat = z.reshape(num_clients, -1, z.shape[-1])  # [C, N, d]
  kmeans_keys = jax.vmap(lambda k: jax.random.fold_in(k, _KMEANS_FOLD))(rngs)
  z_up = jax.vmap(upload)(flat, kmeans_keys)  # [C, N, d]
  diag = dict(zip(('quantization_error', 'relative_quantization_error'),
                  jax.vmap(pq.quantization_errors)(flat, z_up)))
  mask = jax.vmap(vector_mask_fn)(batch, z)  # [C, B, (T)]
  vector_weights = p.reshape((num_clients,) + (1,) * (mask.ndim - 1)) * mask
  example = quantizer.lambda_scaling == 'example'
  return functools.partial(
      vq_layer.vq_with_correction, z_tilde=z_up.reshape(z.shape),
      lam=quantizer.correction_lambda,
      loss_reduction='mean' if example else 'sum', num_vectors=z.shape[1],
      vector_weights=vector_weights), diag


def _client_grads(split_model: split_lib.SplitModel, execution: str,
                  quantize, params, batch, rngs, weights, total):
  """Steps 1-4 of Section 3 for ``C`` stacked clients: the gradient sum
  weighted by ``p_i = weights_i / total`` and ``[C]`` diagnostics (``loss``,
  ``finite``, :func:`_quantize`'s); ``quantize``: None for SplitFed."""
  wc, ws = split_model.split_params(params)
  drop = jax.vmap(lambda k: jax.random.fold_in(k, _DROPOUT_FOLD))(rngs)
  p = weights / total
  z, client_vjp = split_clients.client_forward_vjp(  # z: [C, B, (T,) d]
      split_model.client_apply, wc, batch, drop, execution)
  num_clients = z.shape[0]
  correct, diag = (lambda x: x), {}
  if quantize is not None:
    correct, diag = quantize(z, batch, rngs, p)

  def server_objective(ws, z):
    preds = jax.vmap(split_model.server_apply, in_axes=(None, 0, 0, 0))(
        ws, correct(z), batch, drop)
    losses = jax.vmap(split_model.model.train_loss)(batch, preds)  # [C, B]
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


def _server_update(split_model: split_lib.SplitModel, client_optimizer,
                   server_optimizer, state: SplitState, grads):
  """Step 5: ``w_c`` and ``w_s`` updated by their optimizers from the
  gradient sum; ``(new state, finite)``."""
  wc, ws = split_model.split_params(state.params)
  gc, gs = split_model.split_params(grads)
  uc, c_opt = client_optimizer.update(gc, state.client_opt_state, wc)
  us, s_opt = server_optimizer.update(gs, state.server_opt_state, ws)
  params = split_model.merge_params(optax.apply_updates(wc, uc),
                                    optax.apply_updates(ws, us))
  new_state = SplitState(params, c_opt, s_opt)
  return new_state, nonfinite_lib.all_finite(new_state)


_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b), donate_argnums=0)


def _iteration_bits(cache: dict, split_model: split_lib.SplitModel,
                    quantizer: Optional[QuantizerConfig], phi: float,
                    label_bits: float, params: Params,
                    batch0: Batch) -> split_accounting.IterationBits:
  """Per-client bits for ``batch0``'s shapes (cached per shape); ValueError
  for activations not of ``cut_size`` or a quantizer that does not fit."""
  sig = tuple(sorted((k, tuple(np.shape(v)), str(np.asarray(v).dtype))
                     for k, v in batch0.items()))
  if sig in cache:
    return cache[sig]
  wc, ws = split_model.split_params(params)
  z = jax.eval_shape(split_model.client_apply, wc, batch0, None)
  preds = jax.eval_shape(split_model.server_apply, ws, z, batch0, None)
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
  cache[sig] = split_accounting.iteration_bits(
      cut_size=split_model.cut_size, num_vectors=num_vectors,
      num_client_params=num_params(wc), num_params=num_params(params),
      quantizer=None if quantizer is None else quantizer.shape, phi=phi,
      label_elements=elements, bits_per_label=per_label)
  return cache[sig]


def _lanes(resolved: list, lanes_per_device, split_model, state, mesh,
           num_clients: int) -> int:
  """Clients per call over all devices (per device resolved at the first
  apply, kept in ``resolved``); records the iteration's ``stats``."""
  devices = 1 if mesh is None else mesh.num_devices
  if not resolved:
    resolved.append(min(
        stats.resolve_lanes(lanes_per_device, stats.tree_bytes(
            split_model.split_params(state.params)[0])),
        -(-num_clients // devices)))
  lanes = resolved[0] * devices
  slots = -(-num_clients // lanes) * lanes
  stats.record('split', clients=num_clients, useful_steps=num_clients,
               executed_steps=slots, sequential_steps=slots // lanes,
               segments=slots // lanes, lanes=lanes, segment_steps=1)
  return lanes


def _run_iteration(client_grads, server_update, mesh, lanes: int, state,
                   batches, rngs, weights, keep: Sequence[bool]):
  """``(new state, {key: np.ndarray[slots]}, finite)`` of one iteration in
  calls of ``lanes`` clients; dropped clients and the padding are zero-weight
  copies of the first kept client (``p_i = 0``)."""
  if mesh is not None:
    state = jax.device_put(state, mesh.replicated)
  fill = list(keep).index(True)
  extra = -(-len(keep) // lanes) * lanes - len(keep)
  slots = [i if k else fill for i, k in enumerate(keep)] + [fill] * extra
  w = np.asarray([weights[i] if k else 0.0 for i, k in enumerate(keep)] +
                 [0.0] * extra, np.float32)
  total = np.float32(np.sum(w, dtype=np.float32))
  grads, diags = None, []
  for start in range(0, len(slots), lanes):
    part = slice(start, start + lanes)
    args = (split_clients.stack_batches([batches[i] for i in slots[part]]),
            np.stack([rngs[i] for i in slots[part]]), w[part])
    if mesh is not None:
      args = jax.device_put(args, mesh.client_sharding)
    g, d = client_grads(state.params, *args, total)
    grads = g if grads is None else _add(grads, g)
    diags.append(d)
  new_state, finite = server_update(state, grads)
  diags = jax.device_get(diags)
  return new_state, {k: np.concatenate([d[k] for d in diags])
                     for k in diags[0]}, finite


def _with_skips(run, ids: Sequence[bytes], nonfinite: str, name: str):
  """``run`` over all clients, then without the non-finite ones ('skip'):
  ``(new state, diag, skipped ids)``; FloatingPointError as ``apply``."""
  new_state, diag, finite = run([True] * len(ids))
  skipped = nonfinite_lib.resolve(ids, diag['finite'][:len(ids)], nonfinite,
                                  name)
  if skipped:
    new_state, _, finite = run([cid not in skipped for cid in ids])
  nonfinite_lib.check_server_state(finite, name, skipped)
  return new_state, diag, skipped


def _client_batches(name: str, clients: Clients, batch_size: int,
                    weighting: str) -> tuple[list, list, list, list[float]]:
  """The clients' ids, batches, keys (NumPy) and unnormalized ``p_i``;
  ValueError for no clients or a client without examples."""
  if not clients:
    raise ValueError(f'{name}: apply needs at least one client.')
  batches, weights = [], []
  for cid, cds, rng in clients:
    if len(cds) == 0:
      raise ValueError(f'{name}: client {cid!r} has no examples.')
    batches.append(client_batch(cds, batch_size, rng))
    weights.append(1.0 if weighting == 'uniform' else float(len(cds)))
  return ([cid for cid, _, _ in clients], batches,
          [np.asarray(rng) for _, _, rng in clients], weights)


def _client_diagnostics(ids, diag, bits: split_accounting.IterationBits,
                        skipped, batch_size: int) -> dict[bytes, dict]:
  """``{client_id: diagnostics}`` as :func:`split_learning` returns them."""
  out = {}
  for i, cid in enumerate(ids):
    d = {'num_examples': float(batch_size)}
    d.update({k: float(v[i]) for k, v in diag.items() if k != 'finite'})
    d['train_loss'] = d['loss']  # The runner's per-client training loss.
    d.update(bits.diagnostics() if cid not in skipped else
             split_accounting.skipped_client_bits(bits))
    d['finite'] = bool(diag['finite'][i])
    out[cid] = d
  return nonfinite_lib.mark_skipped(out, skipped)


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
    client_optimizer, server_optimizer: for ``w_c`` (``eta_c``, on the mean
      client gradient) and ``w_s`` (``eta_s``).
    batch_size: ``B``, examples per client per iteration.
    quantizer: FedLite's quantizer and ``lambda``; None for SplitFed.
    phi: bits per float of the ``paper_*`` accounting (paper: 64).
    label_bits: bits per uploaded label entry; -1: ``ceil(log2 C)``, ``C``
      the number of model outputs (1 for multi-hot labels); 0: not sent.
    client_weighting: ``p_i``: ``'uniform'`` (1) or ``'examples'`` (the
      client's example count), as FedOpt's ``weighting``.
    vector_mask_fn: ``(client_batch, client_activations) -> mask`` of the
      vectors that get the gradient correction (:func:`loss_vector_mask`).
    client_execution: ``'vmap'``, ``'unroll'`` or ``'auto'``
      (:func:`resolve_client_execution`); same result to float tolerance.
    lanes_per_device: clients per device per compiled call, an int >= 1 or
      'auto' (``stats.resolve_lanes``, at most the first cohort's).
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).

  Returns:
    ``FederatedAlgorithm(init, apply)`` over :class:`SplitState`; diagnostics
    ``num_examples`` (``B``), ``loss`` = ``train_loss`` (server-side batch
    mean before the update), FedLite's ``quantization_error`` (MSE per
    vector) and ``relative_quantization_error`` (``||Z - Z~||_F^2 /
    ||Z||_F^2``), :data:`split_accounting.BIT_KEYS`, ``finite``, ``skipped``.

  Raises:
    ValueError: ``batch_size < 1``, an unknown ``client_weighting``,
      ``client_execution`` or ``nonfinite``, ``label_bits`` < 0 but not -1,
      ``q`` not dividing ``d``; from ``apply``: a quantizer that does not fit
      the activations, a client without data, different batch keys.
    FloatingPointError: from ``apply``: a non-finite client (``'raise'``),
      every client non-finite (``'skip'``), or a non-finite server state.
  """
  name, execution, mesh = _settings(
      split_model, batch_size, quantizer, label_bits, client_weighting,
      nonfinite, client_execution, lanes_per_device)
  client_grads = jax.jit(functools.partial(
      _client_grads, split_model, execution, None if quantizer is None else
      functools.partial(_quantize, quantizer,
                        split_clients.pq_upload(quantizer, phi), vector_mask_fn)))
  server_update = jax.jit(functools.partial(
      _server_update, split_model, client_optimizer, server_optimizer))
  bits_for = functools.partial(_iteration_bits, {}, split_model, quantizer,
                               phi, label_bits)
  resolved_lanes = []  # Per device, at the first apply.

  def init(params: Params) -> SplitState:
    wc, ws = split_model.split_params(params)
    return SplitState(params, client_optimizer.init(wc),
                      server_optimizer.init(ws))

  def apply(state: SplitState, clients: Clients):
    ids, batches, rngs, weights = _client_batches(name, clients, batch_size,
                                                  client_weighting)
    bits = bits_for(state.params, batches[0])
    lanes = _lanes(resolved_lanes, lanes_per_device, split_model, state, mesh,
                   len(clients))
    run = functools.partial(_run_iteration, client_grads, server_update, mesh,
                            lanes, state, batches, rngs, weights)
    state, diag, skipped = _with_skips(run, ids, nonfinite, name)
    return state, _client_diagnostics(ids, diag, bits, skipped, batch_size)

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
            server_optimizer: optax.GradientTransformation, batch_size: int,
            quantizer: QuantizerConfig, **kwargs) -> fedjax.FederatedAlgorithm:
  """FedLite (Section 4): SplitFed + grouped PQ upload + equation-5 gradient.

  ValueError if ``quantizer`` is not a :class:`QuantizerConfig`.
  """
  if not isinstance(quantizer, QuantizerConfig):
    raise ValueError(f'fedlite needs a QuantizerConfig, got {quantizer!r}.')
  return split_learning(split_model, client_optimizer, server_optimizer,
                        batch_size, quantizer=quantizer, **kwargs)
