"""The round loop: sample a cohort, train a round, hand its row to hooks."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
import zlib
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np

from fedlite_jax.training import data_path
from fedlite_jax.training.build import LOG
from fedlite_jax.training import round_metrics
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


@functools.partial(jax.jit, static_argnums=0)
def _client_key(seed: int, round_num: np.uint32, crc: np.uint32) -> jax.Array:
  key = jax.random.fold_in(jax.random.PRNGKey(seed), round_num)
  return jax.random.fold_in(key, crc)


def client_rng(seed: int, round_num: int, client_id: bytes) -> jax.Array:
  """The PRNG key of ``client_id`` in round ``round_num`` (0-based) of a
  run: ``fold_in(fold_in(PRNGKey(seed), round_num), crc32(client_id))``,
  one compiled program per seed (``uint32[2]``)."""
  return _client_key(int(seed), np.uint32(round_num),
                     np.uint32(zlib.crc32(bytes(client_id))))


@functools.partial(jax.jit, static_argnums=0)
def _client_keys(seed: int, round_num: np.uint32, crcs: jax.Array
                 ) -> jax.Array:
  return jax.vmap(lambda crc: _client_key(seed, round_num, crc))(crcs)


def client_rngs(seed: int, round_num: int, client_ids: Sequence[bytes]
                ) -> np.ndarray:
  """:func:`client_rng` of every client, ``uint32[len(client_ids), 2]``
  (NumPy), the same keys from one compiled call and one transfer."""
  crcs = np.array([zlib.crc32(bytes(c)) for c in client_ids], np.uint32)
  return np.asarray(_client_keys(int(seed), np.uint32(round_num), crcs))


def _dispatch(hooks: Sequence[Hook], run: Run, row: dict[str, Any]) -> None:
  """``round_end`` then, for an evaluation row, ``evaluation`` of every
  hook; the row joins ``run.rows``."""
  for hook in hooks:
    hook.round_end(run, row)
  run.rows.append(row)
  if round_metrics.is_evaluation(row):
    for hook in hooks:
      hook.evaluation(run, row)


def _train_round(run: Run, cohorts: data_path.CohortPrefetcher,
                 r: int) -> dict[str, Any]:
  """Trains round ``r`` (0-based); returns its row (``round`` = r + 1)."""
  config = run.config
  cap = config.max_examples_per_client
  t_data = time.perf_counter()
  sampled = cohorts.get(r, next_round=r + 1 if r + 1 < config.num_rounds
                        else -1)
  keys = client_rngs(config.seed, r, [cid for cid, _, _ in sampled])
  clients = [(cid, cds[:cap] if cap and len(cds) > cap else cds, key)
             for (cid, cds, _), key in zip(sampled, keys)]
  t_train = time.perf_counter()
  run.state, diagnostics = run.algorithm.apply(run.state, clients)
  jax.block_until_ready(run.state)
  t_done = time.perf_counter()
  totals = run.ledger.record_round(r + 1, diagnostics)
  return {'round': r + 1, **round_metrics.train_metrics(diagnostics),
          **round_metrics.comm_metrics(totals, run.ledger.summary()),
          'time/data_seconds': t_train - t_data,
          'time/train_seconds': t_done - t_train}


class RunInterrupted(Exception):
  """SIGINT or SIGTERM stopped a run between two rounds; the rounds done
  are checkpointed and the same command resumes.

  Attributes:
    signal_number: the signal (``signal.SIGINT`` or ``signal.SIGTERM``);
      a binary exits with ``128 + signal_number``.
    round: rounds done and checkpointed.
  """

  def __init__(self, signal_number: int, round_num: int):
    super().__init__(f'Interrupted at round {round_num}; checkpoint written; '
                     'run the same command to resume.')
    self.signal_number = signal_number
    self.round = round_num


#: Signals that end a run after its current round.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_signals(enabled: bool = True) -> Iterator[list[int]]:
  """While open, SIGINT and SIGTERM only note themselves in the yielded
  list (a second one raises KeyboardInterrupt at once); the old handlers
  come back on exit. Nothing is installed unless ``enabled`` (runs of
  several processes must stop at the same round) or outside the main
  thread (Python delivers signals to the main thread only)."""
  received: list[int] = []
  if not enabled or threading.current_thread() is not threading.main_thread():
    yield received
    return

  def note(signum, frame):
    del frame
    if received:
      raise KeyboardInterrupt
    received.append(signum)
    LOG.warning('%s: stopping after this round (again to stop now).',
                signal.Signals(signum).name)

  old = {s: signal.signal(s, note) for s in STOP_SIGNALS}
  try:
    yield received
  finally:
    for s, handler in old.items():
      signal.signal(s, handler)


def run_rounds(run: Run, hooks: Sequence[Hook],
               received: Sequence[int] = ()) -> Optional[int]:
  """Rounds ``run.start_round + 1`` .. ``num_rounds`` (or until a hook
  calls ``run.request_stop``), each row through ``hooks``; a run with an
  ``--init_checkpoint`` starts with the row of round 0 (its evaluation).
  The caller calls the hooks' ``end`` and ``close``.

  Args:
    run: the run (its ``rows`` grow).
    hooks: in call order.
    received: signals noted so far (:func:`stop_signals`'s list), checked
      after each round.

  Returns:
    The first signal in ``received`` if it stopped the loop before
    ``num_rounds``, else None.
  """
  cohorts = data_path.CohortPrefetcher(
      run.source, run.config.clients_per_round, run.config.seed,
      prefetch=run.config.prefetch_clients)
  try:
    for hook in hooks:
      hook.start(run)
    if run.init is not None and run.start_round == 0:
      for hook in hooks:
        hook.round_start(run, 0)
      _dispatch(hooks, run, {'round': 0})
    for r in range(run.start_round, run.config.num_rounds):
      for hook in hooks:
        hook.round_start(run, r + 1)
      _dispatch(hooks, run, _train_round(run, cohorts, r))
      if run.stop_reason is not None:
        break
      if received and r + 1 < run.config.num_rounds:
        return received[0]
    return None
  finally:
    cohorts.close()


def interrupted(run: Run, hooks: Sequence[Hook],
                signal_number: int) -> RunInterrupted:
  """Checkpoints the rounds done (the hooks' ``save_now``, complete on
  return) and returns the :class:`RunInterrupted` to raise."""
  done = run.rows[-1]['round'] if run.rows else run.start_round
  for hook in hooks:
    if callable(save_now := getattr(hook, 'save_now', None)):
      save_now(run)
  return RunInterrupted(signal_number, done)
