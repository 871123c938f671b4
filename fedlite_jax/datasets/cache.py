"""The on-disk cache for converted data, derived subsets and vocabularies.

Directory: ``cache_dir``, else ``$FEDLITE_CACHE_DIR``, else
``~/.cache/fedlite_jax``. File names carry a :func:`fingerprint` of the
sources; writes are atomic (a temporary file renamed into place).
"""

from __future__ import annotations

import hashlib
import os
from typing import Callable, Iterable, Sequence

from absl import logging
import fedjax
import numpy as np

CACHE_DIR_ENV = 'FEDLITE_CACHE_DIR'

Examples = dict[str, np.ndarray]


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> str:
  """Returns (and creates) the cache directory; see the module docstring."""
  path = explicit or os.environ.get(CACHE_DIR_ENV) or os.path.join(
      os.path.expanduser('~'), '.cache', 'fedlite_jax')
  path = os.path.expanduser(os.fspath(path))
  os.makedirs(path, exist_ok=True)
  return path


def fingerprint(paths: Sequence[str], *parts: str) -> str:
  """16 hex characters identifying source files and a derivation.

  ``paths`` count by real path, size and mtime (not content); ``parts`` name
  the derivation. Raises FileNotFoundError if a path does not exist.
  """
  h = hashlib.sha256()
  for p in paths:
    st = os.stat(p)
    h.update(f'{os.path.realpath(p)}|{st.st_size}|{st.st_mtime_ns}\n'.encode())
  for part in parts:
    h.update(f'{part}\n'.encode())
  return h.hexdigest()[:16]


def atomic_path(path: str) -> str:
  """A temporary sibling of ``path`` for writing, unique to this process."""
  return f'{path}.{os.getpid()}.partial'


def write_fedjax_sqlite(path: str,
                        clients: Iterable[tuple[bytes, Examples]]) -> None:
  """Writes (id bytes, examples) ``clients`` to a FedJAX SQLite file.

  Atomic, one client in memory at a time; rows (FedJAX's read order) follow
  ``clients``.

  Raises:
    ValueError: a client's arrays disagree on the number of examples.
    sqlite3.IntegrityError: a client id repeats.
  """
  tmp = atomic_path(path)
  if os.path.exists(tmp):
    os.remove(tmp)
  try:
    with fedjax.SQLiteFederatedDataBuilder(tmp) as builder:
      builder.add_many(clients)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def cached_fedjax_sqlite(
    file_name: str, produce: Callable[[], Iterable[tuple[bytes, Examples]]],
    cache_directory: str | os.PathLike[str] | None = None) -> str:
  """The path of cached ``file_name`` (with a :func:`fingerprint` in it),
  written from the clients ``produce()`` yields on a cache miss."""
  path = os.path.join(cache_dir(cache_directory), file_name)
  if os.path.isfile(path):
    logging.info('fedlite_jax.datasets: reusing cached %s', path)
    return path
  logging.info('fedlite_jax.datasets: writing %s (one-time conversion)', path)
  write_fedjax_sqlite(path, produce())
  return path
