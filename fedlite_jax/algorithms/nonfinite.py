"""The non-finite-update policy shared by every algorithm (``--nonfinite_updates``).

A client update is non-finite when any value the client would send (its
encoded delta, gradient, sketch, activations, ...) is NaN or +-Inf. Two
policies:

* ``'raise'`` (default): ``apply`` raises ``FloatingPointError`` naming the
  round's clients with non-finite updates. No state is returned, so a bad
  model is never evaluated or checkpointed.
* ``'skip'``: such a client is dropped from the round. Its output is zeroed
  inside the compiled client program (:func:`guarded`), so a NaN never
  reaches the server's weighted sum, and its aggregation weight is removed:
  the round equals the round without that client. Communication: the client
  sent nothing (``upload_bits`` 0) but received the model (its
  ``download_bits`` are still charged). The per-client diagnostics carry
  ``skipped`` (the communication ledger counts skipped client-rounds) and a
  warning names the clients. A round where every client is skipped raises
  ``FloatingPointError``: there is nothing to update the model with.

Under both policies a server state that is not finite after the update
(model or optimizer statistics; e.g. a diverging server optimizer) raises
``FloatingPointError`` instead of being returned (:func:`check_server_state`).

Not caught: a model that diverged to huge but finite weights (e.g. 1e18,
with a test loss of 1e23 or NaN from overflowing logits). Its next round's
client updates are non-finite, which raises (``'raise'``, or ``'skip'`` with
every client skipped).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.rounds import ClientProgram
from fedlite_jax.common import PyTree


POLICIES = ('raise', 'skip')

__all__ = [
    'POLICIES',
    'all_finite',
    'check_policy',
    'check_server_state',
    'guarded',
    'kept_weight',
    'mark_skipped',
    'resolve',
]


def check_policy(policy: str) -> str:
  """Returns ``policy`` or raises ``ValueError`` naming the allowed values."""
  if policy not in POLICIES:
    raise ValueError(f'nonfinite_updates={policy!r}: allowed values are '
                     f'{", ".join(POLICIES)}.')
  return policy


def all_finite(tree: PyTree) -> jax.Array:
  """``bool[]``: every floating-point entry of ``tree`` is finite (jittable).

  Integer and boolean leaves count as finite; an empty tree is finite.
  """
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not flags:
    return jnp.bool_(True)
  return jnp.all(jnp.stack(flags))


def guarded(program: ClientProgram) -> ClientProgram:
  """``program`` whose output is zeroed when it is not finite.

  ``final`` returns ``(output if finite else zeros, {**diagnostics,
  'finite': finite})``; a ``'finite'`` entry of the program's own
  diagnostics is and-ed in (a client is also dropped when its program
  flags a non-finite intermediate). Zeroing uses ``jnp.where``, so a finite
  output is passed through bit for bit. Outputs that carry the client's
  aggregation weight (e.g. a per-variable weight) are zeroed with it.
  """

  def final(shared, state):
    output, diag = program.final(shared, state)
    finite = all_finite(output)
    if isinstance(diag, Mapping) and 'finite' in diag:
      finite = jnp.logical_and(finite, diag['finite'])
    output = jax.tree.map(lambda o: jnp.where(finite, o, jnp.zeros_like(o)),
                          output)
    return output, {**diag, 'finite': finite}

  return ClientProgram(program.init, program.step, final)


def resolve(client_ids: Sequence[bytes], finite: Iterable[Any], policy: str,
            algorithm: str, round_num: Optional[int] = None) -> list[bytes]:
  """Applies the policy to one round; returns the skipped clients.

  Args:
    client_ids: the round's clients, in cohort order.
    finite: per client, whether its update was finite (same order).
    policy: ``'raise'`` or ``'skip'``.
    algorithm: name used in messages.
    round_num: the round (0-based), for messages; None if unknown.

  Returns:
    The ids of the clients to drop (empty when every update is finite).

  Raises:
    FloatingPointError: ``'raise'`` and any non-finite update; ``'skip'``
      and every update non-finite. The message names the clients.
  """
  bad = [cid for cid, ok in zip(client_ids, finite) if not bool(ok)]
  if not bad:
    return []
  where = f'{algorithm}' + (f' (round {round_num})' if round_num is not None
                            else '')
  if policy == 'raise':
    raise FloatingPointError(
        f'{where}: non-finite client updates from {bad}; lower the '
        'learning rate, add clipping, or pass --nonfinite_updates=skip to '
        'drop such clients from their round.')
  if len(bad) == len(client_ids):
    raise FloatingPointError(
        f'{where}: every client of the round sent a non-finite update '
        f'({bad}); nothing is left to update the model with (the model has '
        'probably diverged). Lower the learning rate or add clipping.')
  logging.warning('%s: skipping %d of %d client(s) with non-finite updates: '
                  '%s', where, len(bad), len(client_ids), bad)
  return bad


def kept_weight(weights: Sequence[float], client_ids: Sequence[bytes],
                skipped: Sequence[bytes]) -> float:
  """Sum (float64) of the weights of the clients not in ``skipped``."""
  drop = set(skipped)
  return float(np.sum(np.asarray(
      [w for w, cid in zip(weights, client_ids) if cid not in drop],
      np.float64)))


def check_server_state(finite: Any, algorithm: str,
                       skipped: Sequence[bytes] = (),
                       round_num: Optional[int] = None) -> None:
  """Raises unless the new server state is finite.

  Args:
    finite: ``all_finite`` of the new server state (model and optimizer
      statistics), computed inside the server update.
    algorithm: name used in the message.
    skipped: the clients skipped this round (named in the message).
    round_num: the round, for the message; None if unknown.

  Raises:
    FloatingPointError: ``finite`` is False.
  """
  if bool(finite):
    return
  where = f'{algorithm}' + (f' (round {round_num})' if round_num is not None
                            else '')
  dropped = f' (clients skipped this round: {list(skipped)})' if skipped else ''
  raise FloatingPointError(
      f'{where}: the server update produced a non-finite model or optimizer '
      f'state from finite client updates{dropped}; lower the server/client '
      'learning rate or add clipping.')


def mark_skipped(diagnostics: Mapping[Any, dict], skipped: Sequence[bytes],
                 upload_keys: Sequence[str] = ('upload_bits',)
                 ) -> Mapping[Any, dict]:
  """Sets each client's ``skipped`` flag; zeroes a skipped client's upload.

  Args:
    diagnostics: ``{client_id: dict}``, modified in place.
    skipped: the skipped clients.
    upload_keys: bit counts of what a client sends after its update (set
      to 0.0 for a skipped client: it sent nothing). Download bits stay.

  Returns:
    ``diagnostics``.
  """
  drop = set(skipped)
  for cid, d in diagnostics.items():
    d['skipped'] = cid in drop
    if cid in drop:
      for key in upload_keys:
        if key in d:
          d[key] = 0.0
  return diagnostics
