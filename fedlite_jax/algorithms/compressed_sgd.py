"""Uncompressed SGD, FedAvg with local steps, and local Top-K as FedJAX algorithms.

One builder, :func:`compressed_sgd`: every client takes ``local_steps`` local
steps (:mod:`local_delta`), encodes its delta with an upload transform
(``None``: uncompressed), the server decodes each message (inside the
compiled round program) and applies its optimizer to the mean decoded update
(Reddi et al. 2021's FedOpt form; ``optax.sgd(1.0)``: FedAvg).

* Uncompressed SGD (``upload=None``, ``local_steps=1``): FedSGD (McMahan et
  al. 2017) / the "Uncompressed" row of Melas-Kyriazi & Wang (2022), Table 2.
  ``local_steps > 1``: FedAvg with that many local iterations (their
  "FedAvg (2 / 5 local iters)" rows). 32 bits per parameter each way.
* Local Top-K (``upload=transforms.top_k(k)``): each client sends its k
  largest-magnitude delta entries (Table 2's "Local Top-K"; FetchSGD's
  baseline). Upload: ``k (32 + ceil(log2 D))`` bits, or ``32 k`` with
  ``index_bits='none'`` (FetchSGD's convention). Download:
  ``download_accounting='changed'`` (default for sparse uploads; FetchSGD's
  accounting: 32 bits per weight changed since the client last
  participated, see :mod:`local_delta`) or ``'dense'`` (``32 D``).

Client-side transform state that changes (e.g. Top-K error feedback) is not
supported: a federated client participates rarely and keeps nothing between
rounds here (FetchSGD moves error feedback to the server instead). A
read-only state built by ``init`` (the intrinsic projection's matrices) is
fine.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import local_delta
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.rounds import make_engine
from fedlite_jax import transforms as tx

Params = Any

__all__ = ['CompressedSGDState', 'compressed_sgd']


@fedjax.dataclass
class CompressedSGDState:
  """Server state.

  Attributes:
    params: the model.
    opt_state: server optimizer state.
    round: ``int32[]``, rounds completed.
    last_changed: ``int32[D]``, last round whose update changed each weight
      (-1: never), raveled in ``jax.tree.leaves`` order.
    last_round: ``int32[N]``, each training client's last participation
      round (-1: never).
  """
  params: Params
  opt_state: optax.OptState
  round: jax.Array
  last_changed: jax.Array
  last_round: jax.Array


def compressed_sgd(
    grad_fn: local_delta.GradFn,
    client_optimizer: optax.GradientTransformation,
    server_optimizer: optax.GradientTransformation,
    *,
    batch_size: int,
    local_steps: int = 1,
    upload: Optional[tx.CommTransform] = None,
    download_accounting: str = 'dense',
    client_ids: Optional[Sequence[bytes]] = None,
    nonfinite: str = 'raise',
    name: str = 'compressed_sgd',
    engine: str = 'auto',
    steps_per_call: int = 1,
    step_bucket: str | int = 'pow2',
) -> fedjax.FederatedAlgorithm:
  """Builds SGD / FedAvg(local steps) / local Top-K as a FederatedAlgorithm.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``.
    client_optimizer: local optimizer.
    server_optimizer: applied to the mean decoded delta.
    batch_size: examples per local step.
    local_steps: local steps per round (>= 1).
    upload: :class:`~fedlite_jax.transforms.CommTransform` of the delta
      pytree, stateless or with a read-only state (e.g. ``chain(top_k(k),
      uniform_quantization(8))``, ``intrinsic_projection(d)``; see
      :func:`fedlite_jax.transforms.init_read_only`); None: uncompressed,
      32 bits per float32.
    download_accounting: ``'dense'`` (``32 D``) or ``'changed'`` (needs
      ``client_ids``).
    client_ids: the training clients' ids.
    nonfinite: ``'raise'`` or ``'skip'`` (:mod:`nonfinite`).
    name: algorithm name in error messages.
    engine, steps_per_call, step_bucket: round engine settings.

  Returns:
    ``FederatedAlgorithm(init, apply)``; diagnostics per client:
    ``upload_bits``, ``download_bits``, ``num_examples``, ``delta_l2_norm``,
    ``finite``, ``skipped``.

  Raises:
    ValueError: bad settings; an upload transform that updates its state,
      e.g. ``top_k(k, error_feedback=True)`` (at ``init``).
    FloatingPointError: from ``apply``: a non-finite update (``'raise'``),
      every update non-finite (``'skip'``), or a non-finite server state.
  """
  local_delta.check_choice(download_accounting, local_delta.DOWNLOAD_ACCOUNTING,
                           'download_accounting')
  nonfinite_lib.check_policy(nonfinite)
  index = local_delta.client_id_index(client_ids)
  if download_accounting == 'changed' and not index:
    raise ValueError("download_accounting='changed' needs the training "
                     'client_ids.')
  hparams = local_delta.batch_hparams(batch_size, local_steps)
  transform = upload if upload is not None else tx.identity()
  cache: dict[str, Any] = {}

  def compress(shared, client_input, delta):
    key = local_delta.compression_key(client_input)
    msg, _ = transform.encode(delta, cache['upload_state'], key)
    decoded, _ = transform.decode(msg, cache['upload_state'])
    return decoded, {}

  round_engine = make_engine(
      engine, local_delta.delta_client_program(grad_fn, client_optimizer,
                                               compress),
      steps_per_call=steps_per_call, step_bucket=step_bucket)

  def prepare(params):
    spec = tx.TreeSpec.of(params)
    if cache.get('spec') != spec:
      example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                             params)
      state = tx.init_read_only(transform, example,
                                f'{name}: the upload transform')
      cache['upload_state'] = state
      cache['upload_bits'] = tx.message_bits(transform, example, state)
      cache['spec'] = spec
    return spec

  @jax.jit
  def server_update(state, weighted_sum, total_weight):
    spec = tx.TreeSpec.of(state.params)
    mean = jax.tree.map(lambda x: x / total_weight, weighted_sum)
    updates, opt_state = server_optimizer.update(mean, state.opt_state,
                                                 state.params)
    params = optax.apply_updates(state.params, updates)
    last_changed = local_delta.mark_changed(
        state.last_changed, spec.ravel(state.params), spec.ravel(params),
        state.round)
    new_state = state.replace(params=params, opt_state=opt_state,
                              last_changed=last_changed)
    return new_state, nonfinite_lib.all_finite(new_state)

  def init(params: Params) -> CompressedSGDState:
    spec = prepare(params)
    return CompressedSGDState(
        params=params, opt_state=server_optimizer.init(params),
        round=jnp.zeros((), jnp.int32),
        last_changed=jnp.full((spec.size,), -1, jnp.int32),
        last_round=jnp.full((len(index),), -1, jnp.int32))

  def apply(state: CompressedSGDState, clients):
    spec = prepare(state.params)
    D = spec.size
    round_num = int(state.round)
    work = local_delta.make_work(clients, hparams)
    positions = (local_delta.client_positions(index, work) if index
                 else np.zeros((0,), np.int32))
    download = local_delta.download_bits(
        download_accounting, D, len(work), state.last_changed,
        state.last_round[positions])
    result = round_engine({'params': state.params}, work)
    total, skipped = local_delta.skip_nonfinite(result, work, nonfinite,
                                                name, round_num)
    state, finite = server_update(state, result.weighted_sum,
                                  np.float32(total))
    nonfinite_lib.check_server_state(finite, name, skipped, round_num)
    return local_delta.finish_round(
        state, work, result, upload_bits=cache['upload_bits'],
        download=download, batch_size=hparams.batch_size, index=index,
        positions=positions, round_num=round_num, skipped=skipped)

  return fedjax.FederatedAlgorithm(init, apply)
