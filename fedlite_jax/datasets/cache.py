"""The on-disk cache for converted data and vocabularies.

Files derived from a dataset (a TFF SQLite or HDF5 split converted to FedJAX's
SQLite format, a derived digits-only EMNIST, token counts) are written once to
a cache directory and reused. Their names carry a fingerprint of the source
files (real path, size, modification time) and of the derivation, so a changed
source is never served from a stale cache.

Cache directory: the explicit ``cache_dir`` argument, else
``$FEDLITE_CACHE_DIR``, else ``~/.cache/fedlite_jax``. Writes are atomic (a
temporary file renamed into place), so concurrent processes at worst both do
the work.
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
  """A short hex digest of source files' identity plus derivation parameters.

  Args:
    paths: source files; each contributes its real path, size and mtime (ns).
      Content is not hashed: the sources can be tens of GB.
    *parts: strings naming the derivation (split, version, parameters).

  Returns:
    16 hex characters.

  Raises:
    FileNotFoundError: a path does not exist.
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
  """Writes clients to a FedJAX-format SQLite file, atomically and streaming.

  Uses ``fedjax.SQLiteFederatedDataBuilder`` (table ``federated_data``, data =
  zlib(msgpack(examples))), so the result opens with
  ``fedjax.SQLiteFederatedData.new``; rows (hence FedJAX's read order) follow
  the order of ``clients``. Only one client is in memory at a time.

  Args:
    path: destination file; replaced atomically when complete.
    clients: (client id bytes, dict of arrays with equal first dimension).

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
  """Returns a cached FedJAX SQLite file, writing it with ``produce`` if absent.

  Args:
    file_name: file name inside the cache directory; callers include a
      :func:`fingerprint` in it.
    produce: called only on a cache miss; yields the clients to write.
    cache_directory: see :func:`cache_dir`.

  Returns:
    The path of the (existing or new) file.
  """
  path = os.path.join(cache_dir(cache_directory), file_name)
  if os.path.isfile(path):
    logging.info('fedlite_jax.datasets: reusing cached %s', path)
    return path
  logging.info('fedlite_jax.datasets: writing %s (one-time conversion)', path)
  write_fedjax_sqlite(path, produce())
  return path
