"""The runner's host data path: decoded clients kept across rounds
(:class:`ClientCache`, which also gives every thread its own SQLite
connection), the next round's cohort loaded in a background thread while
the current one trains (:class:`CohortPrefetcher`). Neither changes results;
a background load that fails raises (on the training thread, at the round
that needs it).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import sqlite3
import threading
from typing import Any, Iterable, Iterator, Optional

import fedjax
import jax
import numpy as np

ClientId = bytes


def dataset_bytes(dataset: Any) -> int:
  """Bytes of a client's decoded example arrays (0 for a remote stand-in)."""
  examples = getattr(dataset, 'raw_examples', None) or {}
  return int(sum(np.asarray(v).nbytes for v in examples.values()))


def _sqlite_path(fd: Any) -> Optional[str]:
  """The database file of FedJAX SQLite data (None for other data); call it
  on the thread that opened ``fd``."""
  if not isinstance(fd, fedjax.SQLiteFederatedData):
    return None
  # pylint: disable=protected-access
  rows = fd._connection.execute('PRAGMA database_list').fetchall()
  return next(r[2] for r in rows if r[1] == 'main')


def _thread_reader(fd: Any, path: Optional[str]) -> Any:
  """``fd`` usable from this thread: SQLite data (``path`` not None) gets
  a new connection to ``path`` with ``fd``'s parsing and preprocessing."""
  if path is None:
    return fd
  # pylint: disable=protected-access
  return fedjax.SQLiteFederatedData(
      sqlite3.connect(path), fd._parse_examples, fd._start, fd._stop,
      fd._preprocess_client, fd._preprocess_batch)


class ClientCache:
  """Decoded clients of ``fd`` kept across rounds within ``budget_bytes``
  (LRU; 0 keeps none); a thread-safe ``FederatedData`` as far as FedJAX's
  client sampler needs one: ``client_ids()`` (read once, here) and
  ``get_clients`` from any thread (FedJAX SQLite: a connection per thread).
  Other attributes are ``fd``'s (use them on the creating thread).

  Raises:
    ValueError: ``budget_bytes < 0``.
  """

  def __init__(self, fd: Any, budget_bytes: int):
    if budget_bytes < 0:
      raise ValueError(f'budget_bytes must be >= 0; got {budget_bytes}.')
    self._fd = fd
    self._path = _sqlite_path(fd)
    self._client_ids = tuple(fd.client_ids())
    self._budget = int(budget_bytes)
    self._entries: collections.OrderedDict[ClientId, tuple[Any, int]] = (
        collections.OrderedDict())
    self._bytes = 0
    self._lock = threading.Lock()
    self._local = threading.local()
    self._owner = threading.get_ident()
    self.hits = 0
    self.misses = 0

  def __getattr__(self, name: str) -> Any:
    if name.startswith('_'):
      raise AttributeError(name)
    return getattr(self._fd, name)

  @property
  def cached_bytes(self) -> int:
    """Bytes of the decoded clients held now."""
    return self._bytes

  def __contains__(self, client_id: ClientId) -> bool:
    with self._lock:
      return client_id in self._entries

  def client_ids(self) -> Iterator[ClientId]:
    """The training client ids (read once, on the constructing thread)."""
    return iter(self._client_ids)

  def _reader(self) -> Any:
    if threading.get_ident() == self._owner:
      return self._fd
    if not hasattr(self._local, 'fd'):
      self._local.fd = _thread_reader(self._fd, self._path)
    return self._local.fd

  def get_clients(self, client_ids: Iterable[ClientId]
                  ) -> Iterator[tuple[ClientId, fedjax.ClientDataset]]:
    """``(client_id, dataset)`` in the order asked."""
    client_ids = list(client_ids)
    with self._lock:
      missing = [c for c in client_ids if c not in self._entries]
    fetched = dict(self._reader().get_clients(missing)) if missing else {}
    out = []
    with self._lock:
      for c in client_ids:
        if c in fetched:
          self.misses += 1
          dataset = fetched[c]
          if c not in self._entries:
            size = dataset_bytes(dataset)
            if size <= self._budget:
              self._entries[c] = (dataset, size)
              self._bytes += size
        else:
          self.hits += 1
          dataset = self._entries[c][0]
          self._entries.move_to_end(c)
        out.append((c, dataset))
      while self._bytes > self._budget and self._entries:
        _, (_, size) = self._entries.popitem(last=False)
        self._bytes -= size
    return iter(out)


@functools.partial(jax.jit, static_argnums=1)
def _sampler_keys(round_num: jax.Array, num_clients: int) -> jax.Array:
  """``split(PRNGKey(round_num), num_clients)``: FedJAX's sampler's keys."""
  return jax.random.split(jax.random.PRNGKey(round_num), num_clients)


class CohortPrefetcher:
  """Round ``r``'s cohort, ``UniformGetClientSampler(fd, clients_per_round,
  seed, r).sample()`` (its keys as NumPy ``uint32[2]`` rows, split in one
  compiled program), with (``prefetch``) the next one loaded in a
  background thread.

  With ``prefetch``, ``fd`` must be readable from another thread: a
  :class:`ClientCache` (FedJAX SQLite data), in-memory data, or a wrapper
  of those (``rounds.remote.PartitionedFederatedData``). A background load
  that fails raises its error from :meth:`get`.

  Attributes:
    background_loads: cohorts :meth:`get` took from the background thread.
  """

  def __init__(self, fd: Any, clients_per_round: int, seed: int,
               prefetch: bool = True):
    self._fd = fd
    self._n = clients_per_round
    self._seed = seed
    self._prefetch = prefetch
    self._pool = (concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix='cohort') if prefetch else None)
    self._pending: Optional[tuple[int, concurrent.futures.Future]] = None
    self.background_loads = 0

  def _load(self, round_num: int) -> list[tuple[ClientId, Any, Any]]:
    # UniformGetClientSampler(fd, n, seed, round_num).sample(), with its
    # keys split in one compiled program (not one eager slice per client).
    random_state = fedjax.client_samplers.get_pseudo_random_state(
        self._seed, round_num)
    client_ids = random_state.choice(
        np.array(list(self._fd.client_ids()), dtype=object), size=self._n,
        replace=False)
    keys = np.asarray(_sampler_keys(np.int32(round_num), self._n))
    return [(cid, cds, key) for (cid, cds), key in
            zip(self._fd.get_clients(client_ids), keys)]

  def get(self, round_num: int, next_round: Optional[int] = None
          ) -> list[tuple[ClientId, Any, Any]]:
    """The cohort of ``round_num``; starts loading ``next_round`` (None:
    ``round_num + 1``; -1: none)."""
    cohort = None
    if self._pending is not None:
      r, future = self._pending
      self._pending = None
      if r == round_num:
        cohort = future.result()  # Raises what the background load raised.
        self.background_loads += 1
      else:
        future.cancel()
    if cohort is None:
      cohort = self._load(round_num)
    upcoming = round_num + 1 if next_round is None else next_round
    if self._pool is not None and upcoming >= 0:
      self._pending = (upcoming, self._pool.submit(self._load, upcoming))
    return cohort

  def close(self) -> None:
    """Stops the background thread (waits for a load in progress)."""
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None
    self._pending = None

  def __enter__(self) -> 'CohortPrefetcher':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
