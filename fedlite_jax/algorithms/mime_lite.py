"""MimeLite with upload / download chains and PVT, on the FedOpt round.

Source: Karimireddy et al., "Mime: Mimicking Centralized Stochastic
Algorithms in Federated Learning" (2020), Alg. 1 without SVRG (MimeLite), as
``fedjax.algorithms.mime_lite``; compressed as in Ro et al. 2022, Sec. 4-6.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import (
    nonfinite as nonfinite_lib, rounds_common as rc)
from fedlite_jax.algorithms.fedopt import (
    Compression, CompressedRound, FedOptState, per_leaf_mean)
from fedlite_jax.rounds import ClientProgram, ClientWork, make_engine
from fedlite_jax.transforms import pvt as pvt_lib

Params = Any

__all__ = ['GradState', 'efficient_mime_lite', 'full_batch_grad_program']


class GradState(NamedTuple):
  """A client's state in :func:`full_batch_grad_program`.

  Attributes:
    params: ``Q(w)``.
    rng: the key of the next batch.
    input: the client input ``{'rng': key}``.
    num: ``float32[]``, examples seen.
    sum: ``sum of num * grad`` (the params' pytree).
    mask: the PVT mask ``bool[num_leaves]``, or None.
  """
  params: Params
  rng: jax.Array
  input: Any
  num: jax.Array
  sum: Params
  mask: Optional[jax.Array]


def full_batch_grad_program(grad_fn: rc.GradFn, upload_fn,
                            plan: rc.PlanFn) -> ClientProgram:
  """MimeLite's full-batch gradient at ``Q(w)`` over padded batches.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``; honours FedJAX's
      ``__mask__`` padding key (as ``fedjax.model_grad``).
    upload_fn: ``(sum of num * grad, num, key, mask) -> (sent sum, mask)``.
    plan: returns the PVT plan, or None.

  Returns:
    A ``ClientProgram``; output ``{'delta': sent sum, 'mask': num * mask}``
    (float32), zeroed when not finite.
  """

  def init(shared, client_input):
    return GradState(
        params=shared['params'], rng=client_input['rng'], input=client_input,
        num=jnp.zeros((), jnp.float32),
        sum=jax.tree.map(jnp.zeros_like, shared['params']),
        mask=rc.pvt_mask(plan(), client_input))

  def step(state, batch):
    rng, use_rng = jax.random.split(state.rng)
    grads = grad_fn(state.params, batch, use_rng)
    if state.mask is not None:
      grads = pvt_lib.apply_mask(grads, state.mask)
    num = jnp.sum(batch[fedjax.EXAMPLE_MASK_KEY]).astype(jnp.float32)
    return state._replace(
        rng=rng, num=state.num + num,
        sum=jax.tree.map(lambda g, s: g * num + s, grads, state.sum))

  def final(shared, state):
    del shared
    key = jax.random.fold_in(state.input['rng'], rc.GRAD_UPLOAD_STREAM)
    sent, mask = upload_fn(state.sum, state.num, key, state.mask)
    return {'delta': sent, 'mask': mask.astype(jnp.float32) * state.num}, {}

  return nonfinite_lib.guarded(ClientProgram(init, step, final))


def _grad_upload(r: CompressedRound, total, num, key, mask):
  """The full-batch gradient sum as the server receives it: ``num *
  decode(encode(total / num))`` and the PVT mask (``bool[num_leaves]``)."""
  if r.compression.upload is None:
    return ((total, r.ones()) if mask is None else
            (pvt_lib.apply_mask(total, mask), mask))
  mean = jax.tree.map(lambda g: g / jnp.where(num > 0, num, 1.0), total)
  sent, mask = r.upload(mean, key, mask)
  return jax.tree.map(lambda g: g * num, sent), mask


def efficient_mime_lite(
    grad_fn: rc.GradFn, base_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    grads_batch_size: int, server_learning_rate: float = 1.0, *,
    compression: Compression = Compression(), weighting: str = 'examples',
    download_accounting: str = 'dense', client_ids=None, seed: int = 0,
    name: str = 'mime_lite', nonfinite: str = 'raise', engine: str = 'auto',
    **engine_options) -> fedjax.FederatedAlgorithm:
  """Builds MimeLite as a ``FederatedAlgorithm``.

  Uploads the delta and the full-batch gradient (2 x the delta's bits);
  downloads the model plus 32 bits per float of the statistics.

  Args:
    grad_fn: ``(params, batch, rng) -> grads`` of the mean batch loss;
      honours FedJAX's ``__mask__`` padding key (as ``fedjax.model_grad``).
    base_optimizer: the optimizer mimicked (Ro et al.: Adagrad).
    client_batch_hparams: local batching.
    grads_batch_size: the full-batch gradient's batch size (>= 1).
    server_learning_rate: the server step on the mean delta.
    compression, weighting, download_accounting, client_ids: as
      :func:`~fedlite_jax.algorithms.fedopt.federated_averaging`.
    seed, name, nonfinite, engine, engine_options: as
      :func:`~fedlite_jax.algorithms.fedopt.federated_averaging`.

  Returns:
    ``FederatedAlgorithm(init, apply)`` over ``FedOptState`` (``opt_state``:
    the statistics); diagnostics as ``federated_averaging``'s (``finite``:
    both passes).

  Raises:
    ValueError: ``grads_batch_size`` not an integer >= 1; as
      ``federated_averaging``.
    FloatingPointError: as ``federated_averaging``.
  """
  grads_batch_size = rc.check_int(grads_batch_size, 'grads_batch_size')
  server_learning_rate = float(server_learning_rate)
  r = CompressedRound(compression, name, seed, weighting, download_accounting,
                      client_ids, nonfinite)

  train = make_engine(engine, rc.delta_client_program(
      grad_fn, base_optimizer, r.compress, mime=True, plan=r.plan),
                      **engine_options)
  grads = make_engine(
      engine, full_batch_grad_program(
          grad_fn, functools.partial(_grad_upload, r), r.plan),
      **engine_options)
  grads_hparams = fedjax.PaddedBatchHParams(batch_size=grads_batch_size)

  @jax.jit
  def server_update(state, sums, weights, grad_sums, grad_weights):
    params = jax.tree.map(lambda p, q: p - server_learning_rate * q,
                          state.params, per_leaf_mean(sums, weights))
    _, opt_state = base_optimizer.update(
        per_leaf_mean(grad_sums, grad_weights), state.opt_state, state.params)
    new_state = r.with_changes(state, state.replace(params=params,
                                                    opt_state=opt_state))
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> FedOptState:
    return rc.on_first_device(
        r.init_state(params, base_optimizer.init(params)))

  def apply(state: FedOptState, clients: rc.Clients):
    def passes(sent, work):
      grad_work = [ClientWork(cid, list(cds.padded_batch(grads_hparams)),
                              {'rng': rng}, 1.0) for cid, cds, rng in clients]
      return [(train, {'params': sent, 'opt_state': state.opt_state}, work),
              (grads, {'params': sent}, grad_work)]

    stats_bits = rc.FLOAT_BITS * sum(
        np.size(x) for x in jax.tree.leaves(state.opt_state)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating))
    return r.apply(state, clients, client_batch_hparams, passes,
                   server_update, stats_bits, upload_factor=2)

  return fedjax.FederatedAlgorithm(init, apply)
