"""Shared pieces of the compressed-update algorithms (IGC, Top-K, FetchSGD, SGD).

Local update. Each sampled client takes ``local_steps`` steps of its client
optimizer on ``local_steps`` batches of ``batch_size`` examples drawn from a
shuffle of its data (FedJAX ``shuffle_repeat_batch`` with ``num_steps =
local_steps``; the shuffle seed derives from the client's PRNG key, itself
derived from the run seed, round and client; the data wraps around when a
client has fewer examples). Its update is the model delta ``theta_initial -
theta_final``. With ``local_steps = 1`` and client SGD at rate ``eta`` the
delta is ``eta * g`` for the stochastic gradient ``g`` of one batch: the one
local step per update of Melas-Kyriazi & Wang (2022), Algorithms 1-3, and
of FetchSGD; ``local_steps > 1`` compresses ``theta_final -
theta_initial`` (the paper's Section 2.2 local-update variant).

Weights. Every client of a round gets weight 1 (the paper's ``1/W``
average); all clients process the same number of examples
(``local_steps * batch_size``), so this equals example weighting.

Non-finite updates (``nonfinite``): the shared policy of
:mod:`fedlite_jax.algorithms.nonfinite` (``'raise'``, default, or ``'skip'``;
a skipped client uploads 0 bits and is left out of the round's average).

Download accounting of sparse methods (``'changed'``, FetchSGD / CommEfficient
``fed_aggregator.py``): a client downloads the weights that changed since it
last participated. The server keeps ``last_changed[j]``, the last round
whose update changed weight ``j`` (-1: never), and ``last_round[c]``, the
last round client ``c`` participated in (-1: never); a client that last
participated in round ``p`` (or never: ``p = 0``, it knows the initial
model, which derives from the seed) downloads ``32 * #{j : last_changed[j]
>= p}`` bits.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.algorithms import batching
from fedlite_jax.algorithms import nonfinite as nonfinite_lib
from fedlite_jax.rounds import ClientProgram
from fedlite_jax.rounds import ClientWork
from fedlite_jax.rounds import RoundResult

PyTree = Any
Params = Any
GradFn = Callable[[Params, dict, jax.Array], Params]
Compress = Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]

NONFINITE_POLICIES = nonfinite_lib.POLICIES
DOWNLOAD_ACCOUNTING = ('changed', 'dense')
FLOAT_BITS = 32

# fold_in tag of the compression key (ASCII 'comp'); local steps split the
# client key itself, exactly as FedAvg does.
_COMPRESS_STREAM = 0x636F6D70


def check_choice(value: str, allowed: Sequence[str], name: str) -> str:
  """Returns ``value`` or raises ``ValueError`` naming ``name`` and ``allowed``."""
  if value not in allowed:
    raise ValueError(f'{name}={value!r}: allowed values are '
                     f'{", ".join(allowed)}.')
  return value


def check_positive_int(value: Any, name: str) -> int:
  """Returns ``int(value)`` or raises for a non-integer or a value < 1."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f'{name} must be an integer; got {value!r}.')
  if value < 1:
    raise ValueError(f'{name} must be >= 1; got {value}.')
  return int(value)


def batch_hparams(batch_size: int,
                  local_steps: int) -> fedjax.ShuffleRepeatBatchHParams:
  """``local_steps`` shuffled batches of ``batch_size`` (seed from the key)."""
  return fedjax.ShuffleRepeatBatchHParams(
      batch_size=check_positive_int(batch_size, 'batch_size'),
      num_epochs=None,
      num_steps=check_positive_int(local_steps, 'local_steps'))


def compression_key(client_input: Mapping[str, jax.Array]) -> jax.Array:
  """The key a client compresses with (independent of its local steps)."""
  return jax.random.fold_in(client_input['rng'], _COMPRESS_STREAM)


def delta_client_program(grad_fn: GradFn,
                         client_optimizer: optax.GradientTransformation,
                         compress: Compress) -> ClientProgram:
  """Local steps, then ``compress(shared, client_input, delta)``.

  shared input: a dict with at least ``'params'`` (the server model); client
  input: a dict with at least ``'rng'`` (the client's key). ``step`` splits
  the key as FedAvg / FedJAX do. ``final`` computes ``delta = server -
  client`` and returns ``compress``'s output, zeroed when not finite
  (:func:`nonfinite.guarded`), and diagnostics ``{..., 'finite',
  'delta_l2_norm'}``.
  """

  def init(shared, client_input):
    params = shared['params']
    return {'params': params, 'opt_state': client_optimizer.init(params),
            'rng': client_input['rng'], 'input': client_input}

  def step(state, batch):
    rng, use_rng = jax.random.split(state['rng'])
    grads = grad_fn(state['params'], batch, use_rng)
    updates, opt_state = client_optimizer.update(grads, state['opt_state'],
                                                 state['params'])
    return {**state, 'params': optax.apply_updates(state['params'], updates),
            'opt_state': opt_state, 'rng': rng}

  def final(shared, state):
    delta = jax.tree.map(lambda a, b: a - b, shared['params'], state['params'])
    output, diag = compress(shared, state['input'], delta)
    sq = sum(jnp.vdot(x, x) for x in jax.tree.leaves(delta))
    return output, {**diag, 'delta_l2_norm': jnp.sqrt(sq)}

  return nonfinite_lib.guarded(ClientProgram(init, step, final))


def make_work(clients: Sequence[tuple[bytes, fedjax.ClientDataset, jax.Array]],
              hparams: fedjax.ShuffleRepeatBatchHParams) -> list[ClientWork]:
  """One :class:`ClientWork` per client: its batches, ``{'rng': key}``, weight 1."""
  if not clients:
    raise ValueError('A round needs at least one client; got none.')
  return [ClientWork(cid, batching.client_batches(cds, hparams, rng),
                     {'rng': rng}, 1.0) for cid, cds, rng in clients]


def skip_nonfinite(result: RoundResult, work: Sequence[ClientWork],
                   nonfinite: str, algorithm: str, round_num: int
                   ) -> tuple[float, list[bytes]]:
  """Applies the non-finite policy (:func:`nonfinite.resolve`) to a round.

  Returns:
    ``(total weight of the kept clients, skipped client ids)``.

  Raises:
    FloatingPointError: as :func:`nonfinite.resolve`.
  """
  ids = [w.client_id for w in work]
  skipped = nonfinite_lib.resolve(ids, [d['finite'] for d in
                                        result.diagnostics],
                                  nonfinite, algorithm, round_num)
  return nonfinite_lib.kept_weight([w.weight for w in work], ids,
                                   skipped), skipped


def client_id_index(client_ids: Optional[Sequence[bytes]]) -> dict[bytes, int]:
  """``{client_id: position}`` (empty for None)."""
  return {bytes(c): i for i, c in enumerate(client_ids or ())}


def client_positions(index: Mapping[bytes, int],
                     work: Sequence[ClientWork]) -> np.ndarray:
  """Positions of the round's clients in ``index``.

  Raises:
    KeyError: a client that is not among the training clients.
  """
  out = []
  for w in work:
    try:
      out.append(index[bytes(w.client_id)])
    except KeyError:
      raise KeyError(
          f'Client {w.client_id!r} is not among the {len(index)} training '
          'client ids the algorithm was built with (client_ids).') from None
  return np.asarray(out, np.int32)


@jax.jit
def changed_counts(last_changed: jax.Array,
                   last_round: jax.Array) -> jax.Array:
  """``#{j : last_changed[j] >= max(last_round[c], 0)}`` for each client c.

  Args:
    last_changed: ``int32[D]``.
    last_round: ``int32[W]`` (-1: never participated).

  Returns:
    ``int32[W]``.
  """
  since = jnp.maximum(last_round, 0)
  return jax.vmap(lambda p: jnp.sum(last_changed >= p, dtype=jnp.int32))(since)


@jax.jit
def mark_changed(last_changed: jax.Array, old_flat: jax.Array,
                 new_flat: jax.Array, round_num: jax.Array) -> jax.Array:
  """``last_changed`` with ``round_num`` where ``new_flat != old_flat``."""
  return jnp.where(new_flat != old_flat, round_num.astype(jnp.int32),
                   last_changed)


def download_bits(accounting: str, num_params: int, num_clients: int,
                  last_changed: jax.Array, last_round: jax.Array
                  ) -> np.ndarray:
  """Download bits per client of a round, float64 ``[W]`` (bits).

  Args:
    accounting: ``'dense'`` (32 bits x all ``num_params`` parameters) or
      ``'changed'`` (32 bits x the weights changed since the client last
      participated: FetchSGD / CommEfficient's accounting).
    num_params: D.
    num_clients: W, the clients of the round.
    last_changed: ``int32[D]``, the round each weight last changed.
    last_round: ``int32[W]``, each client's last participation (-1: never);
      only read for ``'changed'``.
  """
  if accounting == 'dense':
    return np.full((num_clients,), float(FLOAT_BITS * num_params))
  return FLOAT_BITS * np.asarray(changed_counts(last_changed, last_round),
                                 np.float64)


def finish_round(state: Any, work: Sequence[ClientWork],
                 result: RoundResult, *, upload_bits: float,
                 download: np.ndarray, batch_size: int,
                 index: Mapping[bytes, int], positions: np.ndarray,
                 round_num: int, skipped: Sequence[bytes] = ()
                 ) -> tuple[Any, dict[bytes, dict[str, Any]]]:
  """Per-client diagnostics and the round/participation bookkeeping.

  Returns ``state`` with ``round = round_num + 1`` and the participants'
  ``last_round = round_num`` (skipped clients included: they downloaded the
  model), and ``{client_id: {'upload_bits', 'download_bits',
  'num_examples', 'delta_l2_norm', 'finite', 'skipped'}}`` (bits, examples
  = local steps x ``batch_size``; upload 0 for the ``skipped`` clients).
  """
  diagnostics = {}
  for i, (w, diag) in enumerate(zip(work, result.diagnostics)):
    diagnostics[w.client_id] = {
        'upload_bits': float(upload_bits),
        'download_bits': float(download[i]),
        'num_examples': float(len(w.batches) * batch_size),
        'delta_l2_norm': float(diag['delta_l2_norm']),
        'finite': bool(diag['finite']),
    }
  last_round = state.last_round
  if index:
    last_round = last_round.at[positions].set(round_num)
  state = state.replace(round=jnp.asarray(round_num + 1, jnp.int32),
                        last_round=last_round)
  return state, nonfinite_lib.mark_skipped(diagnostics, skipped)
