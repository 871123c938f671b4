"""Opens a dataset's raw splits from whichever supported source is present.

FedJAX SQLite is opened directly; TFF SQLite / HDF5 are converted once,
streaming, into cached FedJAX SQLite; else, only if allowed and reachable,
FedJAX downloads its copy. Bad files raise
:class:`~fedlite_jax.datasets.errors.DatasetFormatError` naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
from typing import Callable, Mapping, Sequence

from absl import logging
import fedjax
from fedjax.core import sqlite_federated_data

from fedlite_jax.datasets import (
    cache, errors, info as info_lib, locate, schema, sqlite_header,
    tff_hdf5, tff_sqlite)

FEDJAX_DOWNLOAD = 'fedjax_download'
DOWNLOAD_HOST = 'storage.googleapis.com'
# Bump when the conversion's output changes, to invalidate old cache files.
_CONVERSION_VERSION = 'v1'

Downloader = Callable[..., fedjax.FederatedData]


@dataclasses.dataclass(frozen=True)
class DatasetSource:
  """A dataset's file names, raw features (FedJAX's schema), and FedJAX's
  ``load_split(split, cache_dir=...)`` to download it (None: no copy)."""
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
    cached: cache files read (split -> converted TFF file; derived files).
    origin: why the source's directory was searched, e.g. 'data_dir argument'.
  """
  splits: Mapping[str, fedjax.FederatedData]
  format: str
  paths: Mapping[str, str]
  cached: Mapping[str, str]
  origin: str

  def read_path(self, split: str) -> str:
    """The file ``split`` is read from (converted cache file, else source)."""
    return self.cached.get(split) or self.paths[split]

  def dataset_info(self, train: fedjax.FederatedData,
                   test: fedjax.FederatedData, cached: Sequence[str] = (),
                   **fields) -> info_lib.DatasetInfo:
    """The ``DatasetInfo``: the task's ``fields``, client counts, format,
    files, and cache files (plus ``cached``: token counts, models)."""
    files = tuple(dict.fromkeys(self.paths[s] for s in ('train', 'test')))
    return info_lib.DatasetInfo(
        num_train_clients=train.num_clients(),
        num_test_clients=test.num_clients(), format=self.format,
        source=os.path.dirname(files[0]), files=files,
        cached_files=tuple(self.cached.values()) + tuple(cached), **fields)

  def preprocess(self, batch: Callable[..., dict],
                 client: Callable[..., dict] | None = None
                 ) -> tuple[fedjax.FederatedData, fedjax.FederatedData]:
    """(train, test), each ``preprocess_client``-ed (if given) and
    ``preprocess_batch``-ed."""
    train, test = (self.splits[s] if client is None else
                   self.splits[s].preprocess_client(client)
                   for s in ('train', 'test'))
    return train.preprocess_batch(batch), test.preprocess_batch(batch)


def network_reachable(host: str = DOWNLOAD_HOST, port: int = 443,
                      timeout_s: float = 3.0) -> bool:
  """True if a TCP connection to ``host:port`` opens within ``timeout_s``."""
  try:
    socket.create_connection((host, port), timeout=timeout_s).close()
    return True
  except OSError:
    return False


_FEDJAX_COLUMNS = ('client_id', 'data', 'num_examples')


def check_fedjax_sqlite(path: str,
                        specs: Mapping[str, schema.FeatureSpec] | None = None
                        ) -> None:
  """Checks cheaply that ``path`` is a FedJAX SQLite federated dataset.

  Checks the SQLite header, FedJAX's table and columns, and that the first
  client decodes and matches ``specs`` (unless None).

  Raises:
    DatasetFormatError (a ValueError): naming the file and what is wrong.
  """
  sqlite_header.check_sqlite_file(path)
  try:
    connection = sqlite3.connect(path)
    try:
      columns = {r[1] for r in connection.execute(
          'PRAGMA table_info(federated_data);')}
      row = None
      if set(_FEDJAX_COLUMNS) <= columns:
        row = connection.execute(
            'SELECT client_id, data FROM federated_data ORDER BY rowid '
            'LIMIT 1;').fetchone()
    finally:
      connection.close()
  except sqlite3.DatabaseError as e:
    raise errors.DatasetFormatError(
        f'{path} is not a readable SQLite database: {e}.') from e
  if not columns:
    raise errors.DatasetFormatError(
        f'{path} has no federated_data table; not a FedJAX SQLite federated '
        'dataset.')
  missing = [c for c in _FEDJAX_COLUMNS if c not in columns]
  if missing:
    raise errors.DatasetFormatError(
        f'{path}: table federated_data lacks the column(s) '
        f'{", ".join(missing)} of FedJAX\'s format (client_id, data, '
        f'num_examples); it has {", ".join(sorted(columns))}.')
  if row is None:
    raise errors.DatasetFormatError(f'{path} holds no clients (table '
                                    'federated_data is empty).')
  client_id, blob = row
  where = f'{path}, client {client_id!r}'
  try:
    examples = sqlite_federated_data.decompress_and_deserialize(blob)
  except Exception as e:  # pylint: disable=broad-except
    raise errors.DatasetFormatError(
        f'{where}: data is not FedJAX\'s zlib-compressed msgpack examples '
        f'({type(e).__name__}: {e}).') from e
  if not isinstance(examples, Mapping):
    raise errors.DatasetFormatError(
        f'{where}: data decodes to a {type(examples).__name__}, not a dict of '
        'feature arrays.')
  if specs is not None:
    schema.conform(examples, specs, where=where)


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

  Raises:
    DatasetNotFoundError: a TFF SQLite file lacks a needed split.
    DatasetFormatError (a ValueError): a file is bad (names the file).
  """
  splits, cached = {}, {}
  for split, path in found.paths.items():
    if found.format == locate.FEDJAX_SQLITE:
      check_fedjax_sqlite(path, source.specs)
      opened_path = path
    else:
      opened_path = cached[split] = _convert(source, found, split,
                                             cache_directory)
    splits[split] = fedjax.SQLiteFederatedData.new(opened_path)
  return Opened(splits, found.format, dict(found.paths), cached, found.origin)


def _download(source: DatasetSource, splits: Sequence[str], message: str,
              target: str) -> Opened:
  """Downloads with FedJAX's loader into ``target`` or raises not-found."""
  if not network_reachable():
    raise errors.DatasetNotFoundError(
        f'{message}\nDownload: allowed, but {DOWNLOAD_HOST} is not reachable '
        'from this machine; copy the files by hand instead.')
  opened, paths = {}, {}
  for split in splits:
    logging.warning('fedlite_jax.datasets: downloading %s %s split with '
                    'FedJAX into %s', source.files.name, split, target)
    try:
      opened[split] = source.download(split, cache_dir=target)
    except Exception as e:  # pylint: disable=broad-except
      raise errors.DatasetNotFoundError(
          f'{message}\nDownload: FedJAX download of the {split!r} split into '
          f'{target} failed: {type(e).__name__}: {e}') from e
    paths[split] = os.path.join(target, source.files.fedjax_sqlite[split])
  return Opened(opened, FEDJAX_DOWNLOAD, paths, {}, 'FedJAX download')


def not_found_message(source: DatasetSource, splits: Sequence[str],
                      data_dir: str | os.PathLike[str] | None) -> str:
  """The text of :class:`DatasetNotFoundError`: what is missing (and where,
  for a ``data_dir``), the expected files and the searched directories."""
  where = ''
  if data_dir is not None:
    data_dir = os.fspath(data_dir)
    state = ('' if os.path.isdir(data_dir) else ', which is not a directory'
             if os.path.exists(data_dir) else ', which does not exist')
    where = f' in data_dir {data_dir}{state}'
  return (f'Could not find the {source.files.name!r} federated dataset '
          f'(splits {", ".join(splits)}){where}.\n'
          f'{locate.describe_search(source.files, splits, data_dir)}\n'
          f'Put the files in one of these directories (e.g. the directory '
          f'named by ${locate.DATA_DIR_ENV} or the data_dir argument), next '
          'to each other.')


def open_splits(source: DatasetSource, splits: Sequence[str],
                data_dir: str | os.PathLike[str] | None = None, *,
                allow_download: bool = False,
                cache_directory: str | os.PathLike[str] | None = None,
                allow_missing: bool = False) -> Opened | None:
  """Finds and opens ``source``'s raw ``splits``, e.g. ('train', 'test').

  Args:
    data_dir: explicit data directory: the only place searched (with its
      known subfolders), and where a download goes.
    allow_download: let FedJAX download the files when none are found, into
      ``data_dir`` if given, else ``~/.cache/fedjax``.
    cache_directory: where converted files go (see :func:`cache.cache_dir`).
    allow_missing: return None instead of raising or downloading when
      nothing is found (to try a fallback source).

  Raises:
    DatasetNotFoundError: nothing found or downloaded; the message names the
      expected files and searched directories.
    DatasetFormatError (a ValueError): a found file is corrupt, truncated,
      or not in its promised format or schema.
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
  target = (locate.fedjax_cache_dir() if data_dir is None else
            os.path.expanduser(os.fspath(data_dir)))
  if allow_download and source.download is not None:
    return _download(source, splits, message, target)
  if source.download is None:
    message += '\nDownload: FedJAX hosts no copy of this dataset.'
  else:
    message += ('\nDownload: not attempted (pass allow_download=True to let '
                f'FedJAX download its copy into {target}).')
  raise errors.DatasetNotFoundError(message)
