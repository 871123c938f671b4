"""The non-finite-update policy of every algorithm (the runner's
``nonfinite_updates`` setting).

``'raise'`` (default): a client update with a NaN or +-Inf raises
``FloatingPointError``. ``'skip'``: such a client is dropped from its round
(upload 0 bits, download still charged); a round with every client dropped
raises. Under both, a non-finite server state after the update raises.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.rounds import ClientProgram
from fedlite_jax.common import PyTree


class NonFiniteUpdateError(FloatingPointError):
  """A client update with NaN/Inf under policy ``'raise'``.

  Attributes:
    settings: the setting names the message quotes (for a caller's flags).
  """

  settings = ('nonfinite_updates',)


POLICIES = ('raise', 'skip')

__all__ = ['POLICIES', 'all_finite', 'check_policy', 'check_server_state',
           'guarded', 'kept_weight', 'mark_skipped', 'resolve']


def check_policy(policy: str) -> str:
  """Returns ``policy`` or raises ``ValueError`` naming the allowed values."""
  if policy not in POLICIES:
    raise ValueError(f'nonfinite_updates={policy!r}: allowed values are '
                     f'{", ".join(POLICIES)}.')
  return policy


def all_finite(tree: PyTree) -> jax.Array:
  """``bool[]``: every inexact entry of ``tree`` is finite (jittable)."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def guarded(program: ClientProgram) -> ClientProgram:
  """``program`` whose output is zeroed when it is not finite.

  ``final`` returns ``(output if finite else zeros, {**diagnostics,
  'finite': finite})``, and-ing in a ``'finite'`` entry of the program's own
  diagnostics; a finite output passes through bit for bit.
  """

  def final(shared, state):
    output, diag = program.final(shared, state)
    finite = all_finite(output)
    if isinstance(diag, Mapping) and 'finite' in diag:
      finite = jnp.logical_and(finite, diag['finite'])
    output = jax.tree.map(lambda o: jnp.where(finite, o, jnp.zeros_like(o)),
                          output)
    return output, {**diag, 'finite': finite}

  return dataclasses.replace(program, final=final)


def resolve(client_ids: Sequence[bytes], finite: Iterable[Any], policy: str,
            algorithm: str, round_num: Optional[int] = None) -> list[bytes]:
  """Applies the policy to one round; returns the skipped clients.

  Args:
    client_ids: the round's clients.
    finite: per client, whether its update was finite.
    policy: ``'raise'`` or ``'skip'``.
    algorithm, round_num: named in messages (round 0-based, or None).

  Returns:
    The ids of the clients to drop.

  Raises:
    NonFiniteUpdateError: (a FloatingPointError) ``'raise'`` and any
      non-finite update.
    FloatingPointError: ``'skip'`` and every update non-finite.
  """
  bad = [cid for cid, ok in zip(client_ids, finite) if not bool(ok)]
  if not bad:
    return []
  where = algorithm if round_num is None else f'{algorithm} (round {round_num})'
  if policy == 'raise':
    raise NonFiniteUpdateError(
        f'{where}: non-finite client updates from {bad}; lower the '
        'learning rate, add clipping, or set nonfinite_updates=skip to '
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
  """Raises ``FloatingPointError`` unless ``finite`` (the new server state's
  :func:`all_finite`); the message names ``algorithm``, ``skipped`` and
  ``round_num``."""
  if bool(finite):
    return
  where = algorithm if round_num is None else f'{algorithm} (round {round_num})'
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
    diagnostics: ``{client_id: dict}``, modified in place and returned.
    skipped: the skipped clients.
    upload_keys: the bit counts set to 0.0 for a skipped client.
  """
  drop = set(skipped)
  for cid, d in diagnostics.items():
    d['skipped'] = cid in drop
    if cid in drop:
      d.update({key: 0.0 for key in upload_keys if key in d})
  return diagnostics
