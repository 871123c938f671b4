"""A model split at a cut layer into a client part and a server part.

Source: split learning (Vepakomma et al., 2018; SplitFed, Thapa et al., 2020;
FedLite, Wang et al., 2022, Section 3): the client runs u(w_c; x) -> z, the
server h(w_s; z). One Flax module serves as a ``fedjax.Model`` and as the
split pair.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple

import fedjax  # fedlite_jax/__init__.py has patched it already.
import flax.linen as nn
import jax

from fedlite_jax.models import vq_layer

Array = jax.Array
Params = Any  # A pytree of arrays: {'client': ..., 'server': ...}.
Batch = Mapping[str, Array]
PRNGKey = Array
TrainLoss = Callable[[Batch, Array], Array]

CLIENT = 'client'
SERVER = 'server'
_QUANTIZE_FOLD = 1


class SplitNet(nn.Module):
  """The whole network: ``server(client(batch, train), batch, train)``.

  ``train`` turns dropout on (it then needs a ``'dropout'`` rng).

  Attributes:
    client: the client part (parameters under ``'client'``).
    server: the server part (parameters under ``'server'``).
  """
  client: nn.Module
  server: nn.Module

  def __call__(self, batch: Batch, train: bool) -> Array:
    return self.server_forward(self.client_forward(batch, train), batch, train)

  def client_forward(self, batch: Batch, train: bool) -> Array:
    """The client part: ``batch`` -> activations at the cut, ``[B, (T,) d]``."""
    return self.client(batch, train)

  def server_forward(self, activations: Array, batch: Batch,
                     train: bool) -> Array:
    """The server part: cut activations (and ``batch``) -> predictions."""
    return self.server(activations, batch, train)


@dataclasses.dataclass(frozen=True)
class SplitModel:
  """A ``fedjax.Model`` together with its client/server split.

  The views agree exactly: ``server_apply(ps, client_apply(pc, b, r), b, r)``
  equals ``model.apply_for_train({'client': pc, 'server': ps}, b, r)`` (and,
  with ``r = None``, ``model.apply_for_eval``), dropout masks included.

  Attributes:
    model: the whole model; params ``{'client': ..., 'server': ...}``;
      ``apply_for_train``'s rng drives dropout; ``train_loss`` is [B].
    cut_layer: the name of the cut (e.g. ``'flatten'``).
    cut_size: d, the size of one activation vector at the cut.
    client_apply: ``(client_params, batch, rng_or_None) -> activations``,
      float32 [B, d] ([B, T, d] for sequences); a key turns dropout on.
    server_apply: ``(server_params, activations, batch, rng_or_None) ->
      predictions``.
    module: the underlying Flax module (a :class:`SplitNet`).
  """
  model: fedjax.Model
  cut_layer: str
  cut_size: int
  client_apply: Callable[[Params, Batch, Optional[PRNGKey]], Array]
  server_apply: Callable[[Params, Array, Batch, Optional[PRNGKey]], Array]
  module: Optional[nn.Module] = None

  def split_params(self, params: Params) -> Tuple[Params, Params]:
    """``(client_params, server_params)`` of the whole model's params.

    Raises:
      ValueError: if ``params`` is not a mapping with exactly the keys
        ``'client'`` and ``'server'``.
    """
    if not isinstance(params, Mapping) or set(params) != {CLIENT, SERVER}:
      keys = sorted(params) if isinstance(params, Mapping) else type(params)
      raise ValueError(
          f"split_params expects {{'client': ..., 'server': ...}}, got {keys}.")
    return params[CLIENT], params[SERVER]

  def merge_params(self, client_params: Params,
                   server_params: Params) -> Params:
    """Inverse of :meth:`split_params`."""
    return {CLIENT: client_params, SERVER: server_params}


def _rngs(rng: Optional[PRNGKey]) -> dict[str, PRNGKey]:
  """Dropout uses ``rng``; a quantizer layer at the cut ``fold_in(rng, 1)``."""
  if rng is None:
    return {}
  return {'dropout': rng,
          vq_layer.RNG_COLLECTION: jax.random.fold_in(rng, _QUANTIZE_FOLD)}


def build_split_model(*, client: nn.Module, server: nn.Module,
                      sample_batch: Batch, train_loss: TrainLoss,
                      eval_metrics: Mapping[str, fedjax.metrics.Metric],
                      cut_layer: str, cut_size: int) -> SplitModel:
  """Wraps a client module and a server module into a :class:`SplitModel`.

  Args:
    client: ``client(batch, train) -> activations`` [B(, T), cut_size].
    server: ``server(activations, batch, train) -> predictions``.
    sample_batch: a batch with the expected keys, dtypes and trailing shapes
      (``init`` infers the parameter shapes from it).
    train_loss: ``(batch, preds) -> per-example loss [B]``.
    eval_metrics: FedJAX metrics evaluated on ``(example, prediction)``.
    cut_layer: the name of the cut.
    cut_size: d, the size of one activation vector at the cut.

  Returns:
    A :class:`SplitModel` of jitted functions (``apply_for_train`` without a
    key raises Flax's ``InvalidRngError`` if the model uses dropout). A key
    ``rng`` also gives a :class:`~fedlite_jax.models.vq_layer.FedLiteQuantizer`
    its ``'quantize'`` stream ``fold_in(rng, 1)``; without it the quantizer
    derives its k-means key from its input.
  """
  net = SplitNet(client=client, server=server)

  @jax.jit
  def init(rng: PRNGKey) -> Params:
    return net.init({'params': rng}, sample_batch, train=False)['params']

  @jax.jit
  def apply_for_train(params: Params, batch: Batch,
                      rng: Optional[PRNGKey] = None) -> Array:
    return net.apply({'params': params}, batch, train=True, rngs=_rngs(rng))

  @jax.jit
  def apply_for_eval(params: Params, batch: Batch) -> Array:
    return net.apply({'params': params}, batch, train=False)

  @jax.jit
  def client_apply(client_params: Params, batch: Batch,
                   rng: Optional[PRNGKey] = None) -> Array:
    return net.apply({'params': {CLIENT: client_params}}, batch,
                     train=rng is not None, rngs=_rngs(rng),
                     method=SplitNet.client_forward)

  @jax.jit
  def server_apply(server_params: Params, activations: Array, batch: Batch,
                   rng: Optional[PRNGKey] = None) -> Array:
    return net.apply({'params': {SERVER: server_params}}, activations, batch,
                     train=rng is not None, rngs=_rngs(rng),
                     method=SplitNet.server_forward)

  model = fedjax.Model(
      init=init, apply_for_train=apply_for_train,
      apply_for_eval=apply_for_eval, train_loss=train_loss,
      eval_metrics=dict(eval_metrics))
  return SplitModel(model=model, cut_layer=cut_layer, cut_size=cut_size,
                    client_apply=client_apply, server_apply=server_apply,
                    module=net)
