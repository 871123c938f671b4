"""Round pieces shared by FedOpt, MimeLite, IGC and FetchSGD.

Source: local steps of FedAvg (McMahan et al. 2017, Alg. 1), FedProx (Li et
al. 2020, Alg. 2), MimeLite (Karimireddy et al. 2020, Alg. 1); PVT masks (Ro
et al. 2022, Sec. 4); ``'changed'`` download accounting (FetchSGD's code).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import fedjax
from fedjax.core import util as fedjax_util
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import batching, nonfinite as nonfinite_lib
from fedlite_jax.checks import check_int
from fedlite_jax.rounds import ClientProgram, ClientWork, ordering
from fedlite_jax.transforms import pvt as pvt_lib
from fedlite_jax.common import (  # noqa: F401  (re-exported)
    COMPRESS_STREAM, DOWNLOAD_STREAM, FLOAT_BITS, GRAD_UPLOAD_STREAM,
    PVT_STREAM, PyTree, UPLOAD_STREAM)

Params = Any
GradFn = Callable[[Params, dict, jax.Array], Params]
Clients = Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]]
PlanFn = Callable[[], Optional[pvt_lib.PVTPlan]]

WEIGHTINGS = ('examples', 'uniform')
DOWNLOAD_ACCOUNTING = ('changed', 'dense')

#: Per-client training diagnostics (:func:`client_diagnostics`): the mean
#: loss and accuracy over the examples of the client's local steps (each
#: evaluated at the parameters the step starts from), and their number.
TRAIN_DIAGNOSTICS = ('train_loss', 'train_accuracy', 'train_examples')
#: DP-FedAvg's per-client diagnostics: the decoded delta's norm before
#: clipping, and 1.0 where it was clipped (else 0.0).
DP_DIAGNOSTICS = ('dp_norm', 'dp_clipped')

__all__ = [
    'COMPRESS_STREAM', 'DOWNLOAD_ACCOUNTING', 'DOWNLOAD_STREAM',
    'DP_DIAGNOSTICS', 'FLOAT_BITS',
    'GRAD_UPLOAD_STREAM', 'LocalState', 'TRAIN_DIAGNOSTICS', 'TrainGrad',
    'UPLOAD_STREAM', 'WEIGHTINGS', 'batch_hparams', 'changed_counts',
    'changed_counts_at', 'check_choice', 'check_int', 'client_diagnostics',
    'client_id_index', 'client_positions', 'compression_key',
    'delta_client_program', 'download_bits', 'make_work', 'mark_changed',
    'model_spec', 'num_params', 'participation', 'pvt_mask', 'server_update',
    'skip_nonfinite', 'train_grad']


def check_choice(value: str, allowed: Sequence[str], name: str) -> str:
  """``value``, or ``ValueError`` naming ``name`` and ``allowed``."""
  if value not in allowed:
    raise ValueError(f'{name}={value!r}: allowed values are '
                     f'{", ".join(allowed)}.')
  return value


def num_params(params: Params) -> int:
  """Number of scalar parameters in a pytree."""
  return int(sum(np.size(x) for x in jax.tree.leaves(params)))


def batch_hparams(batch_size: int,
                  local_steps: int) -> fedjax.ShuffleRepeatBatchHParams:
  """``local_steps`` shuffled batches of ``batch_size`` (seed from the key)."""
  return fedjax.ShuffleRepeatBatchHParams(
      batch_size=check_int(batch_size, 'batch_size'), num_epochs=None,
      num_steps=check_int(local_steps, 'local_steps'))


def compression_key(client_input: Mapping[str, jax.Array]) -> jax.Array:
  """IGC's / FetchSGD's compression key."""
  return jax.random.fold_in(client_input['rng'], COMPRESS_STREAM)


def model_spec(params: Params, at_least: int, what: str) -> tx.TreeSpec:
  """The model's TreeSpec; ``ValueError`` if it has < ``at_least`` params."""
  spec = tx.TreeSpec.of(params)
  if at_least > spec.size:
    raise ValueError(f'{what}={at_least} exceeds the number of model '
                     f'parameters D={spec.size}.')
  return spec


def pvt_mask(plan: Optional[pvt_lib.PVTPlan],
             client_input: Mapping[str, jax.Array]) -> Optional[jax.Array]:
  """The client's PVT mask ``bool[num_leaves]``, or None (no PVT)."""
  if plan is None or plan.trains_everything:
    return None
  return pvt_lib.sample_mask(
      plan, jax.random.fold_in(client_input['rng'], PVT_STREAM))


def _masked(tree: PyTree, mask: Optional[jax.Array]) -> PyTree:
  return tree if mask is None else pvt_lib.apply_mask(tree, mask)


@dataclasses.dataclass(frozen=True)
class TrainGrad:
  """A :data:`GradFn` that also measures the batch's training loss.

  Called, it is ``grad`` (gradients only); :func:`delta_client_program`
  calls ``with_stats`` instead and accumulates the statistics over the
  client's local steps, in the same compiled step.

  Attributes:
    grad: ``(params, batch, rng) -> grads`` of the mean batch loss.
    with_stats: ``(params, batch, rng) -> (grads, stats)``: the same
      gradients (``jax.value_and_grad`` of the same loss) and ``{'loss':
      MeanStat, 'accuracy': Stat}`` (fedjax stats, float32; ``'accuracy'``
      only where the model defines it) over the batch's real examples.
    zero_stats: ``() -> stats`` of no examples (float32 zeros).
  """
  grad: GradFn
  with_stats: Callable[[Params, dict, jax.Array], tuple[Params, dict]]
  zero_stats: Callable[[], dict]

  def __call__(self, params: Params, batch: dict, rng: jax.Array) -> Params:
    return self.grad(params, batch, rng)


def train_grad(model: fedjax.Model) -> TrainGrad:
  """``fedjax.model_grad(model)`` plus the training loss and accuracy.

  The loss is FedJAX's: the mean of ``model.train_loss`` over the examples
  whose ``__mask__`` is set (all without a mask); the accuracy is
  ``model.eval_metrics['accuracy']`` (if any) on the training predictions
  (dropout on), over the same examples.
  """
  mask_key = fedjax.EXAMPLE_MASK_KEY
  accuracy = model.eval_metrics.get('accuracy')

  def loss_and_aux(params, batch, rng):
    preds = model.apply_for_train(params, batch, rng)
    losses = model.train_loss(batch, preds)
    if mask_key in batch:
      mask = batch[mask_key]
      num = jnp.sum(mask)
      loss_sum = jnp.vdot(losses, mask)
      loss = fedjax_util.safe_div(loss_sum, num)
    else:
      num = jnp.asarray(losses.shape[0], jnp.float32)
      loss_sum = jnp.sum(losses)
      loss = jnp.mean(losses)
    return loss, (preds, loss_sum, num)

  def zero_stats():
    zero = {'loss': fedjax.metrics.MeanStat.new(0.0, 0.0)}
    if accuracy is not None:
      zero['accuracy'] = accuracy.zero()
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), zero)

  @jax.jit
  def with_stats(params, batch, rng):
    (_, (preds, loss_sum, num)), grads = jax.value_and_grad(
        loss_and_aux, has_aux=True)(params, batch, rng)
    stats = {'loss': fedjax.metrics.MeanStat.new(loss_sum, num)}
    if accuracy is not None:
      stat = jax.vmap(accuracy.evaluate_example)(batch, preds)
      if mask_key in batch:
        stat = jax.tree.map(
            lambda a, b: fedjax.metrics.apply_mask(batch[mask_key], a, b),
            stat, accuracy.zero())
      stats['accuracy'] = stat.reduce()
    return grads, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), stats)

  return TrainGrad(fedjax.model_grad(model), with_stats, zero_stats)


class LocalState(NamedTuple):
  """A client's state between local steps of :func:`delta_client_program`.

  Attributes:
    params: the client model.
    opt_state: the client optimizer's state (MimeLite: the server's).
    rng: the key of the next step.
    input: the client input ``{'rng': key}``.
    anchor: FedProx's ``Q(w)``, or None.
    mask: the PVT mask ``bool[num_leaves]``, or None.
    stats: the training statistics of the steps so far (a
      :class:`TrainGrad`'s), or None.
  """
  params: Params
  opt_state: optax.OptState
  rng: jax.Array
  input: Mapping[str, jax.Array]
  anchor: Optional[Params]
  mask: Optional[jax.Array]
  stats: Optional[dict] = None


def delta_client_program(grad_fn: GradFn,
                         optimizer: optax.GradientTransformation,
                         compress: Callable[..., tuple[PyTree, PyTree]], *,
                         fedprox_mu: float = 0.0, mime: bool = False,
                         plan: PlanFn = lambda: None) -> ClientProgram:
  """Local steps from ``Q(w)``, then ``compress(.., Q(w) - w_client, ..)``.

  Args:
    grad_fn: ``(params, batch, rng) -> grads``; a :class:`TrainGrad` also
      gives the ``train_*`` diagnostics.
    optimizer: the client optimizer (MimeLite: the base optimizer).
    compress: ``(shared, client_input, delta, mask) -> (output, diag)``;
      ``mask``: ``bool[num_leaves]`` or None.
    fedprox_mu: ``mu >= 0`` of FedProx's proximal term (0: none).
    mime: use ``shared['opt_state']``, never updated (MimeLite).
    plan: returns the PVT plan, or None.

  Returns:
    A ``ClientProgram`` over :class:`LocalState`, whose shared input is
    ``{'params': Q(w), ...}`` and client input ``{'rng': key}``; output
    ``compress``'s, zeroed when not finite; diagnostics add
    ``delta_l2_norm``, ``finite``
    and (:class:`TrainGrad`) ``train_loss``, ``train_examples``,
    ``train_accuracy`` (if the model has one; see
    :data:`TRAIN_DIAGNOSTICS`). Its ``step_in_place`` (the vmap engine's)
    orders every parameter update after all gradients.
  """
  stats_fn = grad_fn.with_stats if isinstance(grad_fn, TrainGrad) else None

  def init(shared, client_input):
    params = shared['params']
    return LocalState(
        params=params,
        opt_state=shared['opt_state'] if mime else optimizer.init(params),
        rng=client_input['rng'], input=client_input,
        anchor=params if fedprox_mu else None,
        mask=pvt_mask(plan(), client_input),
        stats=grad_fn.zero_stats() if stats_fn else None)

  def step(state, batch, in_place=False):
    rng, use_rng = jax.random.split(state.rng)
    params = state.params
    stats = state.stats
    if stats_fn is None:
      grads = grad_fn(params, batch, use_rng)
    else:
      grads, batch_stats = stats_fn(params, batch, use_rng)
      stats = {k: v.merge(batch_stats[k]) for k, v in stats.items()}
    if in_place:
      # Every parameter update waits for all gradients (same values), so
      # the carried parameters can be updated in place.
      grads = ordering.ordered_after(grads, grads)
    grads = _masked(grads, state.mask)
    if fedprox_mu:
      # d/dw of 0.5 mu ||w - w_s||^2 (FedProx, Li et al. 2020, Alg. 2).
      grads = _masked(jax.tree.map(lambda g, w, s: g + fedprox_mu * (w - s),
                                   grads, params, state.anchor), state.mask)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    return state._replace(
        params=optax.apply_updates(params, _masked(updates, state.mask)),
        opt_state=state.opt_state if mime else opt_state, rng=rng,
        stats=stats)

  def final(shared, state):
    delta = jax.tree.map(lambda a, b: a - b, shared['params'], state.params)
    output, diag = compress(shared, state.input, delta, state.mask)
    sq = sum(jnp.vdot(x, x) for x in jax.tree.leaves(delta))
    diag = {**diag, 'delta_l2_norm': jnp.sqrt(sq)}
    if state.stats is not None:
      diag['train_loss'] = state.stats['loss'].result()
      diag['train_examples'] = state.stats['loss'].weight
      if 'accuracy' in state.stats:
        diag['train_accuracy'] = state.stats['accuracy'].result()
    return output, diag

  return nonfinite_lib.guarded(ClientProgram(
      init, step, final,
      step_in_place=functools.partial(step, in_place=True)))


def on_first_device(state: PyTree) -> PyTree:
  """``state`` committed to this process's first local device (where the
  round engines' sums land); same pytree, shapes and dtypes."""
  return jax.device_put(state, jax.local_devices()[0])


def make_work(clients: Clients, hparams: fedjax.ShuffleRepeatBatchHParams,
              weighting: str = 'uniform') -> list[ClientWork]:
  """One ClientWork per client (weight: examples or 1); ValueError if none."""
  if not clients:
    raise ValueError('A round needs at least one client; got none.')
  seeds = (batching.shuffle_seeds([rng for _, _, rng in clients])
           if hparams.seed is None else [None] * len(clients))
  return [ClientWork(cid, batching.client_batches(cds, hparams, rng, seed),
                     {'rng': rng},
                     float(len(cds)) if weighting == 'examples' else 1.0)
          for (cid, cds, rng), seed in zip(clients, seeds)]


def skip_nonfinite(result, work: Sequence[ClientWork], nonfinite: str,
                   algorithm: str, round_num: int) -> tuple[float, list[bytes]]:
  """``(kept clients' total weight, skipped ids)`` (``nonfinite.resolve``)."""
  ids = [w.client_id for w in work]
  finite = [d['finite'] for d in result.diagnostics]
  skipped = nonfinite_lib.resolve(ids, finite, nonfinite, algorithm, round_num)
  return nonfinite_lib.kept_weight([w.weight for w in work], ids,
                                   skipped), skipped


def client_id_index(client_ids: Optional[Sequence[bytes]]) -> dict[bytes, int]:
  """``{client_id: position}`` (empty for None)."""
  return {bytes(c): i for i, c in enumerate(client_ids or ())}


def client_positions(index: Mapping[bytes, int],
                     work: Sequence[ClientWork]) -> np.ndarray:
  """``int32[W]`` positions of the round's clients in ``index`` (or empty);
  ``KeyError`` for a client not among the training clients."""
  out = []
  for w in work if index else ():
    if bytes(w.client_id) not in index:
      raise KeyError(
          f'Client {w.client_id!r} is not among the {len(index)} training '
          'client ids the algorithm was built with (client_ids).')
    out.append(index[bytes(w.client_id)])
  return np.asarray(out, np.int32)


@jax.jit
def changed_counts(last_changed: jax.Array, last_round: jax.Array) -> jax.Array:
  """``int32[W]``: ``#{j : last_changed[j] >= max(last_round[c], 0)}``."""
  since = jnp.maximum(last_round, 0)
  return jax.vmap(lambda p: jnp.sum(last_changed >= p, dtype=jnp.int32))(since)


@jax.jit
def changed_counts_at(last_changed: jax.Array, last_round: jax.Array,
                      positions: jax.Array) -> jax.Array:
  """:func:`changed_counts` of the clients at ``positions`` (``int32[W]``)
  of ``last_round`` (``int32[N]``), gathered in the same program."""
  return changed_counts(last_changed, last_round[positions])


@jax.jit
def mark_changed(last_changed: jax.Array, old_flat: jax.Array,
                 new_flat: jax.Array, round_num: jax.Array) -> jax.Array:
  """``last_changed`` with ``round_num`` where ``new_flat != old_flat``."""
  return jnp.where(new_flat != old_flat, round_num.astype(jnp.int32),
                   last_changed)


def download_bits(accounting: str, dense_bits: float, num_clients: int,
                  last_changed: jax.Array, last_round: jax.Array,
                  positions: Optional[np.ndarray] = None) -> np.ndarray:
  """Download bits of each client of a round, ``float64[W]``.

  Args:
    accounting: ``'dense'`` (``dense_bits`` each) or ``'changed'`` (``32
      #{j : last_changed[j] >= max(last_round, 0)}``).
    dense_bits: the whole model's download message (bits).
    num_clients: W.
    last_changed: ``int32[D]``; last_round: ``int32[W]``, or with
      ``positions`` (``int32[W]``) ``int32[N]`` of every training client
      (``'changed'``; gathered inside one compiled program).
  """
  if accounting == 'dense':
    return np.full((num_clients,), float(dense_bits))
  counts = (changed_counts(last_changed, last_round) if positions is None
            else changed_counts_at(last_changed, last_round, positions))
  return FLOAT_BITS * np.asarray(counts, np.float64)


def participation(state: Any, positions: jax.Array) -> Any:
  """``state`` with ``round + 1`` and ``last_round[positions] = round``
  (skipped clients too: they downloaded); ``positions``: ``int32[W]``,
  empty without training client ids (jittable)."""
  return state.replace(
      round=state.round + 1,
      last_round=state.last_round.at[positions].set(state.round))


@functools.partial(jax.jit, static_argnums=0)
def server_update(update: Callable[..., tuple[Any, jax.Array]], state: Any,
                  positions: jax.Array, *args) -> tuple[Any, jax.Array]:
  """``update(state, *args) -> (new state, finite)`` followed by
  :func:`participation` (``positions``: ``int32[W]``), as one compiled
  program (compiled once per ``update`` and argument shapes)."""
  new_state, finite = update(state, *args)
  return participation(new_state, positions), finite


def client_diagnostics(work: Sequence[ClientWork], result, *, upload_bits,
                       download: np.ndarray, num_examples: Sequence[float],
                       skipped: Sequence[bytes] = (), extra=None
                       ) -> dict[bytes, dict[str, Any]]:
  """``{client_id: {'upload_bits', 'download_bits', 'num_examples',
  'delta_l2_norm', 'finite', 'skipped', **extra(diag)}}`` plus the
  :data:`TRAIN_DIAGNOSTICS` and :data:`DP_DIAGNOSTICS` the program
  reported; ``upload_bits``: a number
  or ``diag -> bits`` (0 for ``skipped`` clients)."""
  out = {}
  for i, (w, diag) in enumerate(zip(work, result.diagnostics)):
    up = upload_bits(diag) if callable(upload_bits) else upload_bits
    out[w.client_id] = {
        'upload_bits': float(up), 'download_bits': float(download[i]),
        'num_examples': float(num_examples[i]),
        'delta_l2_norm': float(diag['delta_l2_norm']),
        'finite': bool(diag['finite']),
        **{k: float(diag[k]) for k in TRAIN_DIAGNOSTICS + DP_DIAGNOSTICS
           if k in diag},
        **(extra(diag) if extra else {})}
  return nonfinite_lib.mark_skipped(out, skipped)
