"""Opens a dataset's raw splits from whichever supported source is present.

One entry point, :func:`open_splits`, turns "dataset X, splits (train, test)"
into raw (unpreprocessed) ``fedjax.FederatedData`` with FedJAX's feature
schema, whatever the on-disk format:

* FedJAX SQLite: opened directly with ``fedjax.SQLiteFederatedData.new``.
* TFF SQLite and TFF legacy HDF5: converted once, streaming one client at a
  time, into a FedJAX-format SQLite file in the cache directory
  (:mod:`fedlite_jax.datasets.cache`), which is then opened with
  ``fedjax.SQLiteFederatedData.new``. Why convert rather than hold in memory:
  StackOverflow is 135.8M examples (and full EMNIST ~2 GB of float32 pixels),
  far beyond memory, and FedJAX's SQLite format gives cheap random access per
  client; using one path for all sizes keeps small and huge data on the same,
  tested code. The conversion is a one-time cost (seconds for Shakespeare,
  hours for StackOverflow) logged with absl.
* Nothing found: if ``allow_download`` and the download host is reachable,
  FedJAX's own ``load_split`` (``fedjax.datasets.downloads.maybe_download``
  into ``~/.cache/fedjax``); otherwise :class:`DatasetNotFoundError`.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
from typing import Callable, Mapping, Sequence

from absl import logging
import fedjax

from fedlite_jax.datasets import cache
from fedlite_jax.datasets import errors
from fedlite_jax.datasets import locate
from fedlite_jax.datasets import schema
from fedlite_jax.datasets import tff_hdf5
from fedlite_jax.datasets import tff_sqlite

FEDJAX_DOWNLOAD = 'fedjax_download'
DOWNLOAD_HOST = 'storage.googleapis.com'
# Bump when the conversion's output changes, to invalidate old cache files.
_CONVERSION_VERSION = 'v1'

Downloader = Callable[[str, str], fedjax.FederatedData]


@dataclasses.dataclass(frozen=True)
class DatasetSource:
  """Everything needed to find and open one dataset.

  Attributes:
    files: expected file names per format (:class:`locate.DatasetFiles`).
    specs: the raw features, in FedJAX's schema.
    download: (split, FedJAX cache dir) -> FederatedData, calling FedJAX's own
      ``load_split`` (hence ``downloads.maybe_download``); None if FedJAX has
      no copy to download.
  """
  files: locate.DatasetFiles
  specs: Mapping[str, schema.FeatureSpec]
  download: Downloader | None = None


@dataclasses.dataclass(frozen=True)
class Opened:
  """Raw splits and where they came from.

  Attributes:
    splits: split -> raw ``fedjax.FederatedData`` (FedJAX feature schema).
    format: one of ``locate.FORMATS`` or ``FEDJAX_DOWNLOAD``.
    paths: split -> the source file read.
    cached: cache files this load reads (split -> converted FedJAX SQLite
      file for TFF formats; loaders may add derived files); else empty.
    origin: why the source's directory was searched, e.g. 'data_dir argument'.
  """
  splits: Mapping[str, fedjax.FederatedData]
  format: str
  paths: Mapping[str, str]
  cached: Mapping[str, str]
  origin: str


def network_reachable(host: str = DOWNLOAD_HOST, port: int = 443,
                      timeout_s: float = 3.0) -> bool:
  """True if a TCP connection to ``host:port`` opens within ``timeout_s``."""
  try:
    socket.create_connection((host, port), timeout=timeout_s).close()
    return True
  except OSError:
    return False


def check_fedjax_sqlite(path: str) -> None:
  """Raises ValueError unless ``path`` has FedJAX's ``federated_data`` table."""
  try:
    connection = sqlite3.connect(path)
    try:
      row = connection.execute(
          "SELECT name FROM sqlite_master WHERE type = 'table' AND "
          "name = 'federated_data';").fetchone()
    finally:
      connection.close()
  except sqlite3.DatabaseError as e:
    raise ValueError(f'{path} is not an SQLite database: {e}') from e
  if row is None:
    raise ValueError(f'{path} has no federated_data table; not a FedJAX '
                     'SQLite federated dataset.')


def _convert(source: DatasetSource, found: locate.Found, split: str,
             cache_directory: str | None) -> str:
  """Converts one split of a TFF file into a cached FedJAX SQLite file."""
  path = found.paths[split]
  specs_key = repr(sorted((k, v.kind, v.shape, v.dtype)
                          for k, v in source.specs.items()))
  if found.format == locate.TFF_SQLITE:
    tff_split = source.files.tff_sqlite_splits[split]
    key = cache.fingerprint([path], 'tff_sqlite', tff_split, specs_key,
                            _CONVERSION_VERSION)
    produce = lambda: tff_sqlite.iter_clients(path, tff_split, source.specs)
  else:
    key = cache.fingerprint([path], 'tff_hdf5', specs_key, _CONVERSION_VERSION)
    produce = lambda: tff_hdf5.iter_clients(path, source.specs)
  name = f'{source.files.name}_{split}.{found.format}.{key}.sqlite'
  return cache.cached_fedjax_sqlite(name, produce, cache_directory)


def open_found(source: DatasetSource, found: locate.Found,
               cache_directory: str | None = None) -> Opened:
  """Opens the splits of a located dataset (converting TFF formats once).

  Args:
    source: the dataset.
    found: where it is (from :func:`locate.find`).
    cache_directory: see :func:`cache.cache_dir`.

  Returns:
    The opened splits.

  Raises:
    DatasetNotFoundError: a TFF SQLite file lacks a needed split.
    ValueError: a file is not in the format its name promises.
  """
  splits, cached = {}, {}
  for split, path in found.paths.items():
    if found.format == locate.FEDJAX_SQLITE:
      check_fedjax_sqlite(path)
      opened_path = path
    else:
      opened_path = cached[split] = _convert(source, found, split,
                                             cache_directory)
    splits[split] = fedjax.SQLiteFederatedData.new(opened_path)
  return Opened(splits, found.format, dict(found.paths), cached, found.origin)


def _download(source: DatasetSource, splits: Sequence[str],
              message: str) -> Opened:
  """Downloads with FedJAX's own loader, or raises DatasetNotFoundError."""
  if not network_reachable():
    raise errors.DatasetNotFoundError(
        f'{message}\nDownload: allowed, but {DOWNLOAD_HOST} is not reachable '
        'from this machine; copy the files by hand instead.')
  target = locate.fedjax_cache_dir()
  opened, paths = {}, {}
  for split in splits:
    logging.warning('fedlite_jax.datasets: downloading %s %s split with '
                    'FedJAX into %s', source.files.name, split, target)
    try:
      opened[split] = source.download(split, target)
    except Exception as e:  # pylint: disable=broad-except
      raise errors.DatasetNotFoundError(
          f'{message}\nDownload: FedJAX download of the {split!r} split into '
          f'{target} failed: {type(e).__name__}: {e}') from e
    paths[split] = os.path.join(target, source.files.fedjax_sqlite[split])
  return Opened(opened, FEDJAX_DOWNLOAD, paths, {}, 'FedJAX download')


def not_found_message(source: DatasetSource, splits: Sequence[str],
                      data_dir: str | os.PathLike[str] | None) -> str:
  """The text of :class:`DatasetNotFoundError` for ``source``."""
  return (f'Could not find the {source.files.name!r} federated dataset '
          f'(splits {", ".join(splits)}).\n'
          f'{locate.describe_search(source.files, splits, data_dir)}\n'
          f'Put the files in one of these directories (e.g. the directory '
          f'named by ${locate.DATA_DIR_ENV} or the data_dir argument), next '
          'to each other.')


def open_splits(source: DatasetSource,
                splits: Sequence[str],
                data_dir: str | os.PathLike[str] | None = None,
                *,
                allow_download: bool = False,
                cache_directory: str | os.PathLike[str] | None = None,
                allow_missing: bool = False) -> Opened | None:
  """Finds and opens a dataset's raw splits; see the module docstring.

  Args:
    source: the dataset.
    splits: e.g. ('train', 'test').
    data_dir: explicit data directory (searched before ``$FEDLITE_DATA_DIR``).
    allow_download: whether FedJAX may download the files when none are found
      (only if ``source.download`` exists and the host is reachable).
    cache_directory: where converted files go (see :func:`cache.cache_dir`).
    allow_missing: return None instead of raising when nothing is found and
      nothing is downloaded (used to try a fallback source).

  Returns:
    The opened splits (or None, see ``allow_missing``).

  Raises:
    DatasetNotFoundError: nothing found (and no download allowed, possible, or
      successful); the message names the expected files and searched
      directories.
  """
  found = locate.find(source.files, splits, data_dir)
  if found is not None:
    logging.info('fedlite_jax.datasets: %s found as %s in %s (%s)',
                 source.files.name, locate.FORMAT_TITLES[found.format],
                 found.directory, found.origin)
    return open_found(source, found,
                      None if cache_directory is None else
                      os.fspath(cache_directory))
  if allow_missing:
    return None
  message = not_found_message(source, splits, data_dir)
  if allow_download and source.download is not None:
    return _download(source, splits, message)
  if source.download is None:
    message += '\nDownload: FedJAX hosts no copy of this dataset.'
  else:
    message += ('\nDownload: not attempted (pass allow_download=True to let '
                f'FedJAX download its copy into {locate.fedjax_cache_dir()}).')
  raise errors.DatasetNotFoundError(message)
