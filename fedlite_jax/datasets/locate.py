"""Finds a federated dataset's files on disk (first match wins, no substitute).

An explicit ``data_dir`` and its known subfolders are the only places
searched. Without it: ``$FEDLITE_DATA_DIR`` and its subfolders, FedJAX's cache
``~/.cache/fedjax``, TFF's ``~/.tff``, Keras' ``~/.keras/datasets``. Per
directory: FedJAX SQLite, then TFF SQLite, then TFF legacy HDF5.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

from fedjax.datasets import downloads

FEDJAX_SQLITE = 'fedjax_sqlite'
TFF_SQLITE = 'tff_sqlite'
TFF_HDF5 = 'tff_hdf5'
FORMATS = (FEDJAX_SQLITE, TFF_SQLITE, TFF_HDF5)
FORMAT_TITLES = {FEDJAX_SQLITE: 'FedJAX SQLite', TFF_SQLITE: 'TFF SQLite',
                 TFF_HDF5: 'TFF legacy HDF5'}

DATA_DIR_ENV = 'FEDLITE_DATA_DIR'


@dataclasses.dataclass(frozen=True)
class DatasetFiles:
  """Where one dataset's files are expected, in each on-disk format.

  Attributes:
    name: dataset name used in messages, e.g. 'emnist'.
    fedjax_sqlite: split -> FedJAX SQLite file name.
    tff_sqlite: the TFF SQLite file name (holds every split), or None.
    tff_sqlite_splits: split -> TFF's ``split_name`` inside that file.
    tff_hdf5: split -> TFF legacy HDF5 file name.
    subdirs: subfolders of a data directory that may hold the files.
  """
  name: str
  fedjax_sqlite: Mapping[str, str]
  tff_sqlite: str | None
  tff_sqlite_splits: Mapping[str, str]
  tff_hdf5: Mapping[str, str]
  subdirs: tuple[str, ...] = ()

  @classmethod
  def by_convention(cls, name: str, splits: Sequence[str], fedjax_stem: str,
                    tff_sqlite: str, tff_hdf5_stem: str,
                    subdirs: tuple[str, ...],
                    tff_sqlite_splits: Mapping[str, str] | None = None
                    ) -> DatasetFiles:
    """``{fedjax_stem}_{split}.sqlite``, ``tff_sqlite`` (split names default
    to the splits'), ``{tff_hdf5_stem}_{split}.h5``, as FedJAX / TFF name
    their downloads."""
    return cls(name, {s: f'{fedjax_stem}_{s}.sqlite' for s in splits},
               tff_sqlite, tff_sqlite_splits or {s: s for s in splits},
               {s: f'{tff_hdf5_stem}_{s}.h5' for s in splits}, subdirs)

  def file_names(self, fmt: str, splits: Sequence[str]) -> list[str]:
    """The file names that format ``fmt`` needs for ``splits``."""
    if fmt == FEDJAX_SQLITE:
      return [self.fedjax_sqlite[s] for s in splits]
    if fmt == TFF_SQLITE:
      return [self.tff_sqlite] if self.tff_sqlite else []
    return [self.tff_hdf5[s] for s in splits if s in self.tff_hdf5]

  def expected_names(self, splits: Sequence[str]) -> str:
    """Human-readable list of acceptable file sets, one format per line."""
    lines = []
    for fmt in FORMATS:
      names = self.file_names(fmt, splits)
      if names:
        extra = ''
        if fmt == TFF_SQLITE:
          extra = ' (split_name ' + ', '.join(
              repr(self.tff_sqlite_splits[s]) for s in splits) + ')'
        lines.append(f'  {FORMAT_TITLES[fmt]}: {", ".join(names)}{extra}')
    return '\n'.join(lines)


@dataclasses.dataclass(frozen=True)
class SearchDir:
  """A directory to search and why it is searched."""
  path: str
  origin: str


@dataclasses.dataclass(frozen=True)
class Found:
  """A dataset located on disk: its format (one of FORMATS), split -> path
  (TFF SQLite: one file), directory, and why it was searched (origin)."""
  format: str
  paths: Mapping[str, str]
  directory: str
  origin: str


def fedjax_cache_dir() -> str:
  """FedJAX's download cache (``~/.cache/fedjax``; on Colab under /tmp)."""
  return downloads.default_cache_dir()


def tff_cache_dir() -> str:
  """TFF's download cache, ``~/.tff``."""
  return os.path.join(os.path.expanduser('~'), '.tff')


def keras_cache_dir() -> str:
  """Keras' cache ``~/.keras/datasets`` (TFF's legacy HDF5 downloads)."""
  return os.path.join(os.path.expanduser('~'), '.keras', 'datasets')


def search_dirs(data_dir: str | os.PathLike[str] | None,
                subdirs: Sequence[str]) -> list[SearchDir]:
  """The directories to search, in order, existing or not, deduplicated."""
  out, seen = [], set()

  def add(path: str, origin: str) -> None:
    real = os.path.realpath(path)
    if real not in seen:
      seen.add(real)
      out.append(SearchDir(path, origin))

  if data_dir is not None:
    root, origin = os.fspath(data_dir), 'data_dir argument'
  else:
    root, origin = os.environ.get(DATA_DIR_ENV), f'${DATA_DIR_ENV}'
  if root:
    root = os.path.expanduser(root)
    add(root, origin)
    for sub in subdirs:
      add(os.path.join(root, sub), f'{origin}, subfolder {sub}/')
  if data_dir is not None:
    return out
  add(fedjax_cache_dir(), 'FedJAX cache')
  add(tff_cache_dir(), 'TFF cache')
  add(keras_cache_dir(), 'Keras cache (TFF legacy HDF5)')
  return out


def find(files: DatasetFiles, splits: Sequence[str],
         data_dir: str | os.PathLike[str] | None) -> Found | None:
  """The first directory holding every file of ``splits`` in one format, or
  None. A TFF SQLite file matches by name (its splits are checked later)."""
  for d in search_dirs(data_dir, files.subdirs):
    if not os.path.isdir(d.path):
      continue
    for fmt in FORMATS:
      names = files.file_names(fmt, splits)
      if not names or (fmt == TFF_HDF5 and len(names) != len(splits)):
        continue
      paths = [os.path.join(d.path, n) for n in names]
      if all(os.path.isfile(p) for p in paths):
        by_split = ({s: paths[0] for s in splits} if fmt == TFF_SQLITE else
                    dict(zip(splits, paths)))
        return Found(fmt, by_split, d.path, d.origin)
  return None


def describe_search(files: DatasetFiles, splits: Sequence[str],
                    data_dir: str | os.PathLike[str] | None) -> str:
  """Multi-line text: expected file names and the directories searched."""
  dirs = search_dirs(data_dir, files.subdirs)
  lines = ['Expected one of these file sets (all files of one line, in one '
           'directory):', files.expected_names(splits),
           'Searched, in order:']
  for d in dirs:
    state = '' if os.path.isdir(d.path) else ' [does not exist]'
    lines.append(f'  {d.path} ({d.origin}){state}')
  if data_dir is not None:
    lines.append(f'  (an explicit data_dir is the only place searched; '
                 f'${DATA_DIR_ENV} and the caches are not)')
  elif not os.environ.get(DATA_DIR_ENV):
    lines.append(f'  (no data_dir argument and ${DATA_DIR_ENV} is not set)')
  return '\n'.join(lines)
