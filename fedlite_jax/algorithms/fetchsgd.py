"""FetchSGD as a FedJAX algorithm.

Source: Rothchild et al., "FetchSGD: Communication-Efficient Federated
Learning with Sketching", ICML 2020, Algorithm 1, as their reference code
(CommEfficient ``fed_aggregator.py``, ``error_type='virtual'``). Upload
``32 rows cols`` bits per client; download ``'changed'`` or ``32 D``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import (
    rounds_common as rc, nonfinite as nonfinite_lib)
from fedlite_jax.rounds import make_engine
from fedlite_jax import transforms as tx
from fedlite_jax.transforms import sketch as sketch_lib

Params = Any

__all__ = ['FetchSGDState', 'fetchsgd', 'fetchsgd_server_step']


@fedjax.dataclass
class FetchSGDState:
  """Server state.

  Attributes:
    params: the model.
    momentum: ``float32[rows, cols]``, V (momentum, in sketch space).
    error: ``float32[rows, cols]``, E (error accumulation, in sketch space).
    round: ``int32[]``, rounds completed.
    last_changed: ``int32[D]``, last round that changed each weight.
    last_round: ``int32[N]``, each training client's last round.
  """
  params: Params
  momentum: jax.Array
  error: jax.Array
  round: jax.Array
  last_changed: jax.Array
  last_round: jax.Array


def fetchsgd_server_step(mean_sketch: jax.Array, momentum: jax.Array,
                         error: jax.Array, *, k: int, rho: float, seed: int,
                         D: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``V <- rho V + S``, ``E <- E + V``, top-k of unsketch(E), zero buckets.

  Jittable with static ``k``, ``seed``, ``D``. Source: FetchSGD Alg. 1.

  Args:
    mean_sketch: ``float32[rows, cols]``, the average client sketch S.
    momentum, error: V and E, ``float32[rows, cols]``.
    k: coordinates updated per round (1 <= k <= D).
    rho: momentum (0: none).
    seed: the sketch seed.
    D: number of parameters.

  Returns:
    ``(delta float32[D] with k non-zeros, new V, new E)``.
  """
  rows, cols = mean_sketch.shape
  momentum = rho * momentum + mean_sketch
  error = error + momentum
  est = sketch_lib.unsketch(error, seed, D)
  values, idx = tx.topk_abs(est, k)
  delta = tx.scatter(values, idx, D)
  buckets, _ = sketch_lib.hashes_at(seed, rows, cols, idx)
  hit = jnp.zeros((rows, cols), bool).at[
      jnp.arange(rows)[:, None], buckets].set(True)
  return (delta, jnp.where(hit, 0.0, momentum), jnp.where(hit, 0.0, error))


def _check_args(rows, cols, k, momentum, server_lr, download_accounting,
                nonfinite, client_ids):
  """:func:`fetchsgd`'s ValueErrors; ``(rows, cols, k, client id index)``."""
  rows = rc.check_int(rows, 'sketch_rows')
  cols = rc.check_int(cols, 'sketch_cols')
  k = rc.check_int(k, 'topk_k')
  if not 0 <= momentum < 1:
    raise ValueError(f'momentum must be in [0, 1); got {momentum}.')
  if not server_lr > 0:
    raise ValueError(f'server_lr must be > 0; got {server_lr}.')
  rc.check_choice(download_accounting, rc.DOWNLOAD_ACCOUNTING,
                  'download_accounting')
  nonfinite_lib.check_policy(nonfinite)
  index = rc.client_id_index(client_ids)
  if download_accounting == 'changed' and not index:
    raise ValueError("download_accounting='changed' needs the training "
                     'client_ids.')
  return rows, cols, k, index


def _compress(upload: tx.CommTransform, shared, client_input, delta, mask):
  """Client upload: the delta's count sketch ``float32[rows, cols]``."""
  del shared, mask  # no PVT
  msg, _ = upload.encode(delta, (), rc.compression_key(client_input))
  return msg.values, {}


def _server_update(k: int, rho: float, seed: int, server_lr: float,
                   state: FetchSGDState, weighted_sum, total_weight):
  """:func:`fetchsgd_server_step` on the mean sketch, ``params -= server_lr
  Delta`` and the changed weights marked: ``(new state, finite)``."""
  spec = tx.TreeSpec.of(state.params)
  old = spec.ravel(state.params)
  delta, v, e = fetchsgd_server_step(
      weighted_sum / total_weight, state.momentum, state.error, k=k, rho=rho,
      seed=seed, D=spec.size)
  new = old - server_lr * delta
  new_state = state.replace(
      params=spec.unravel(new), momentum=v, error=e,
      last_changed=rc.mark_changed(state.last_changed, old, new, state.round))
  return new_state, nonfinite_lib.all_finite(new_state)


def fetchsgd(
    grad_fn: rc.GradFn, client_optimizer: optax.GradientTransformation, *,
    batch_size: int, rows: int, cols: int, k: int, server_lr: float = 1.0,
    momentum: float = 0.9, local_steps: int = 1, seed: int = 0,
    download_accounting: str = 'changed',
    client_ids: Optional[Sequence[bytes]] = None, nonfinite: str = 'raise',
    engine: str = 'auto', **engine_options) -> fedjax.FederatedAlgorithm:
  """Builds FetchSGD as a ``fedjax.FederatedAlgorithm``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``.
    client_optimizer: local optimizer (``optax.sgd(eta)``).
    batch_size: examples per local step.
    rows: sketch rows (>= 1; odd recommended).
    cols: sketch columns (>= 1).
    k: coordinates updated per round (1 <= k <= D).
    server_lr: multiplies Delta (the step is ``eta * server_lr``).
    momentum: rho in [0, 1) (FetchSGD: 0.9).
    local_steps: local steps per round (1: the paper's setting).
    seed: sketch hash seed in ``[0, 2**32)``.
    download_accounting: ``'changed'`` (needs ``client_ids``) or ``'dense'``.
    client_ids: the training clients' ids.
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).
    engine, engine_options: :func:`fedlite_jax.rounds.make_engine`'s.

  Returns:
    ``FederatedAlgorithm(init, apply)``; diagnostics ``upload_bits``,
    ``download_bits``, ``num_examples``, ``delta_l2_norm``, ``finite``,
    ``skipped``.

  Raises:
    ValueError: bad settings; k > D (at ``init``).
    FloatingPointError: from ``apply``: a non-finite sketch (``'raise'``),
      every sketch non-finite (``'skip'``), or a non-finite server state.
  """
  rows, cols, k, index = _check_args(rows, cols, k, momentum, server_lr,
                                     download_accounting, nonfinite,
                                     client_ids)
  hparams = rc.batch_hparams(batch_size, local_steps)
  compress = functools.partial(_compress, tx.count_sketch(rows, cols, seed))
  round_engine = make_engine(engine, rc.delta_client_program(
      grad_fn, client_optimizer, compress), **engine_options)
  server_update = jax.jit(functools.partial(_server_update, k, momentum,
                                            seed, server_lr))

  def init(params: Params) -> FetchSGDState:
    zeros = jnp.zeros((rows, cols), jnp.float32)
    return rc.on_first_device(FetchSGDState(
        params=params, momentum=zeros, error=zeros,
        round=jnp.zeros((), jnp.int32),
        last_changed=jnp.full((rc.model_spec(params, k, 'fetchsgd: topk_k')
                               .size,), -1, jnp.int32),
        last_round=jnp.full((len(index),), -1, jnp.int32)))

  def apply(state: FetchSGDState, clients):
    D = rc.model_spec(state.params, k, 'fetchsgd: topk_k').size
    round_num = int(state.round)
    work = rc.make_work(clients, hparams)
    positions = rc.client_positions(index, work)
    download = rc.download_bits(
        download_accounting, rc.FLOAT_BITS * D, len(work),
        state.last_changed, state.last_round, positions)
    result = round_engine({'params': state.params}, work)
    total, skipped = rc.skip_nonfinite(result, work, nonfinite, 'fetchsgd',
                                       round_num)
    state, finite = rc.server_update(server_update, state, positions,
                                     result.weighted_sum, np.float32(total))
    nonfinite_lib.check_server_state(finite, 'fetchsgd', skipped, round_num)
    return state, rc.client_diagnostics(
        work, result, upload_bits=tx.sketch_message_bits(rows, cols),
        download=download,
        num_examples=[len(w.batches) * hparams.batch_size for w in work],
        skipped=skipped)

  return fedjax.FederatedAlgorithm(init, apply)
