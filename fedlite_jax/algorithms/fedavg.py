"""FedAvg and FedAdam (FedAvg with a server optimizer) as a FedJAX algorithm.

Sources:
  McMahan et al., "Communication-Efficient Learning of Deep Networks from
  Decentralized Data", AISTATS 2017 (Algorithm 1, FedAvg).
  Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (Algorithm 2:
  the server applies an optimizer -- SGD gives FedAvg, Adam gives FedAdam --
  to the weighted mean model delta used as a pseudo-gradient).

Same math as ``fedjax.algorithms.fed_avg`` (client SGD-style local steps,
delta = server params - client params, weights = number of client examples),
but the clients of a round run through a round engine
(``fedlite_jax.rounds``): one vmapped program on accelerators, jitted
step blocks on CPU. ``tests/test_fedavg.py`` checks equality with FedJAX's.

Communication: uncompressed, 32 bits per parameter each way per client.

Non-finite updates: the shared policy of
:mod:`fedlite_jax.algorithms.nonfinite` (``nonfinite='raise'`` or ``'skip'``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.rounds import ClientProgram
from fedlite_jax.rounds import ClientWork
from fedlite_jax.rounds import make_engine

Params = Any
GradFn = Callable[[Params, dict, jax.Array], Params]

FLOAT_BITS = 32


@fedjax.dataclass
class ServerState:
  """FedAvg server state.

  Attributes:
    params: the server model (pytree of float32 arrays).
    opt_state: the server optimizer's (optax) state.
  """
  params: Params
  opt_state: optax.OptState


def num_params(params: Params) -> int:
  """Number of scalar parameters in a pytree."""
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def client_program(grad_fn: GradFn,
                   client_optimizer: optax.GradientTransformation
                   ) -> ClientProgram:
  """The FedAvg client update (FedJAX's ``create_train_for_each_client``).

  shared input: server params; client input: the client's PRNG key; each step
  splits the key (``rng, use_rng = split(rng)``) exactly as FedJAX does, so
  dropout draws match; output: ``delta = server_params - client_params``.
  """

  def init(server_params, client_rng):
    return {
        'params': server_params,
        'opt_state': client_optimizer.init(server_params),
        'rng': client_rng,
    }

  def step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], batch, use_rng)
    updates, opt_state = client_optimizer.update(grads, state['opt_state'],
                                                 state['params'])
    params = optax.apply_updates(state['params'], updates)
    return {'params': params, 'opt_state': opt_state, 'rng': rng}

  def final(server_params, state):
    delta = jax.tree.map(lambda a, b: a - b, server_params, state['params'])
    sq_norm = sum(jnp.vdot(x, x) for x in jax.tree.leaves(delta))
    return delta, {'delta_l2_norm': jnp.sqrt(sq_norm)}

  return ClientProgram(init, step, final)


def federated_averaging(
    grad_fn: GradFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    client_batch_hparams: fedjax.ShuffleRepeatBatchHParams,
    *,
    engine: str = 'auto',
    steps_per_call: int = 1,
    step_bucket: str | int = 'pow2',
    nonfinite: str = 'raise',
    name: str = 'fedavg',
) -> fedjax.FederatedAlgorithm:
  """Builds FedAvg / FedAdam as a ``fedjax.FederatedAlgorithm``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``, e.g. ``fedjax.model_grad``.
    client_optimizer: optax transformation for local steps (e.g.
      ``optax.sgd(0.1)``; chain ``optax.clip_by_global_norm`` for clipping).
    server_optimizer: optax transformation applied to the mean delta
      (``optax.sgd(1.0)``: FedAvg; ``optax.adam(...)``: FedAdam).
    client_batch_hparams: local batching; ``seed=None`` derives each client's
      shuffle seed from its PRNG key (reproducible per seed, round, client).
    engine: 'auto', 'loop' or 'vmap' (see ``fedlite_jax.rounds``).
    steps_per_call: loop engine: local steps per jitted call.
    step_bucket: vmap engine: step padding policy.
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).
    name: algorithm name in messages.

  Returns:
    ``FederatedAlgorithm(init, apply)``. ``apply(state, clients)`` takes
    FedJAX's ``[(client_id, ClientDataset, PRNGKey)]`` and returns
    ``(state, {client_id: diagnostics})`` where the diagnostics hold
    ``num_examples``, ``delta_l2_norm``, ``upload_bits`` and
    ``download_bits`` (32 x number of parameters each; upload 0 for a
    skipped client), ``finite`` and ``skipped``.

  Raises:
    ValueError: an unknown ``nonfinite`` policy.
    FloatingPointError: from ``apply``: a non-finite client delta
      (``'raise'``), every delta non-finite (``'skip'``), or a non-finite
      server state (names the clients).
  """
  nonfinite_lib.check_policy(nonfinite)
  round_engine = make_engine(
      engine, nonfinite_lib.guarded(client_program(grad_fn, client_optimizer)),
      steps_per_call=steps_per_call, step_bucket=step_bucket)

  @jax.jit
  def server_update(state, weighted_sum, total_weight):
    mean_delta = jax.tree.map(lambda x: x / total_weight, weighted_sum)
    updates, opt_state = server_optimizer.update(mean_delta, state.opt_state,
                                                 state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = ServerState(params, opt_state)
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> ServerState:
    return ServerState(params, server_optimizer.init(params))

  def apply(state: ServerState,
            clients: Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]]):
    work = [
        ClientWork(cid, batching.client_batches(cds, client_batch_hparams, rng),
                   rng, float(len(cds))) for cid, cds, rng in clients
    ]
    result = round_engine(state.params, work)
    ids = [w.client_id for w in work]
    skipped = nonfinite_lib.resolve(
        ids, [d['finite'] for d in result.diagnostics], nonfinite, name)
    total = nonfinite_lib.kept_weight([w.weight for w in work], ids, skipped)
    new_state, finite = server_update(state, result.weighted_sum,
                                      np.float32(total))
    nonfinite_lib.check_server_state(finite, name, skipped)
    bits = float(FLOAT_BITS * num_params(state.params))
    diagnostics = {}
    for w, diag in zip(work, result.diagnostics):
      diagnostics[w.client_id] = {
          'num_examples': w.weight,
          'delta_l2_norm': float(diag['delta_l2_norm']),
          'upload_bits': bits,
          'download_bits': bits,
          'finite': bool(diag['finite']),
      }
    return new_state, nonfinite_lib.mark_skipped(diagnostics, skipped)

  return fedjax.FederatedAlgorithm(init, apply)
