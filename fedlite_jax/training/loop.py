"""The round loop: sample a cohort, train a round, hand its row to hooks."""

from __future__ import annotations

import functools
import time
import zlib
from typing import Any, Sequence

import jax
import numpy as np

from fedlite_jax.training import data_path
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


def run_rounds(run: Run, hooks: Sequence[Hook]) -> None:
  """Rounds ``run.start_round + 1`` .. ``num_rounds`` (or until a hook
  calls ``run.request_stop``), each row through ``hooks``; a run with an
  ``--init_checkpoint`` starts with the row of round 0 (its evaluation).
  The caller calls the hooks' ``end`` and ``close``."""
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
  finally:
    cohorts.close()
