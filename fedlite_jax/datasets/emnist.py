"""Federated EMNIST (62 classes) and its digits-only variant.

Files: FedJAX ``federated_emnist[_digitsonly]_{train,test}.sqlite``, TFF
``emnist_all.sqlite``, or TFF ``fed_emnist[_digitsonly]_{train,test}.h5``.
Without digits-only files, digits-only is DERIVED from the 62-class files
(label < 10; logged and in ``DatasetInfo.derived``).
"""

from __future__ import annotations

import functools
import os

from absl import logging
import fedjax
from fedjax.datasets import emnist as fedjax_emnist

from fedlite_jax.datasets import (
    cache, errors, info as info_lib, locate, schema, sources)

SPLITS = ('train', 'test')
SPECS = {
    'pixels': schema.FeatureSpec('float', (28, 28), 'float32'),
    'label': schema.FeatureSpec('int64', (), 'int32'),
}
_SUBDIRS = ('femnist105', 'emnist')
_DERIVE_VERSION = 'digits_label_lt_10_v1'


EMNIST = sources.DatasetSource(
    locate.DatasetFiles.by_convention(
        'emnist', SPLITS, 'federated_emnist', 'emnist_all.sqlite',
        'fed_emnist', _SUBDIRS, {'train': 'all_train', 'test': 'all_test'}),
    SPECS, functools.partial(fedjax_emnist.load_split, only_digits=False))

EMNIST_DIGITS = sources.DatasetSource(
    locate.DatasetFiles.by_convention(
        'emnist_digits', SPLITS, 'federated_emnist_digitsonly',
        'emnist_all.sqlite', 'fed_emnist_digitsonly', _SUBDIRS,
        {'train': 'digits_only_train', 'test': 'digits_only_test'}),
    SPECS, functools.partial(fedjax_emnist.load_split, only_digits=True))


def _derive_digits(opened: sources.Opened,
                   cache_dir: str | None) -> sources.Opened:
  """Keeps label < 10 of 62-class splits, cached as FedJAX SQLite."""
  splits, cached = {}, {}
  for split, fd in opened.splits.items():
    def produce(fd=fd):
      for client_id, dataset in fd.clients():
        examples = dataset.raw_examples
        keep = examples['label'] < 10
        if keep.any():
          yield client_id, {k: v[keep] for k, v in examples.items()}

    key = cache.fingerprint([opened.read_path(split)], _DERIVE_VERSION)
    path = cache.cached_fedjax_sqlite(
        f'emnist_digits_derived_{split}.{key}.sqlite', produce, cache_dir)
    splits[split] = fedjax.SQLiteFederatedData.new(path)
    cached[f'{split}_digits_derived'] = path
  return sources.Opened(splits, opened.format, opened.paths,
                        {**opened.cached, **cached}, opened.origin)


def load_raw(only_digits: bool = False,
             data_dir: str | os.PathLike[str] | None = None,
             *,
             allow_download: bool = False,
             cache_dir: str | os.PathLike[str] | None = None
             ) -> tuple[sources.Opened, str]:
  """Opens the raw EMNIST train/test splits.

  Features: ``pixels`` float32 [N, 28, 28] in [0, 1] (1.0 = background),
  ``label`` int32 [N].

  Args:
    only_digits: digits-only (10 classes) instead of 62 classes.
    data_dir, allow_download, cache_dir: as for
      :func:`fedlite_jax.datasets.load_federated_data`.

  Returns:
    (opened splits, '' or a note that digits-only was derived).

  Raises:
    DatasetNotFoundError: no files found and no download allowed / possible.
  """
  if not only_digits:
    return sources.open_splits(EMNIST, SPLITS, data_dir,
                               allow_download=allow_download,
                               cache_directory=cache_dir), ''
  opened = sources.open_splits(EMNIST_DIGITS, SPLITS, data_dir,
                               cache_directory=cache_dir, allow_missing=True)
  if opened is not None:
    return opened, ''
  full = sources.open_splits(EMNIST, SPLITS, data_dir,
                             cache_directory=cache_dir, allow_missing=True)
  if full is not None:
    note = ('digits-only EMNIST DERIVED from the 62-class files '
            f'{sorted(full.paths.values())} by keeping labels < 10 (clients '
            'without digits dropped); not identical to the published '
            'digits-only files')
    logging.warning('fedlite_jax.datasets: no digits-only EMNIST files found; '
                    '%s.', note)
    return _derive_digits(full, cache_dir), note
  try:
    return sources.open_splits(EMNIST_DIGITS, SPLITS, data_dir,
                               allow_download=allow_download,
                               cache_directory=cache_dir), ''
  except errors.DatasetNotFoundError as e:
    raise errors.DatasetNotFoundError(
        f'{e}\nThe 62-class EMNIST files (from which digits-only can be '
        f'derived) were not found either:\n'
        f'{EMNIST.files.expected_names(SPLITS)}') from e


def load_data(only_digits: bool = False,
              data_dir: str | os.PathLike[str] | None = None,
              *,
              allow_download: bool = False,
              cache_dir: str | os.PathLike[str] | None = None
              ) -> tuple[fedjax.FederatedData, fedjax.FederatedData,
                         info_lib.DatasetInfo]:
  """Loads federated EMNIST with FedJAX's ``emnist.preprocess_split``.

  Arguments as for :func:`load_raw`.

  Returns:
    (train, test, info). Batches: ``x`` float32 [B, 28, 28, 1] = 1 - pixels
    (background 0); ``y`` int32 [B] in [0, 62) or [0, 10); ``domain_id``
    int32 [B] (0 = high-school writer, 1 = Census; parsed from the client id).

  Raises:
    DatasetNotFoundError: no files found (see :func:`load_raw`).
  """
  opened, derived = load_raw(only_digits, data_dir,
                             allow_download=allow_download,
                             cache_dir=cache_dir)
  train = fedjax_emnist.preprocess_split(opened.splits['train'])
  test = fedjax_emnist.preprocess_split(opened.splits['test'])
  info = opened.dataset_info(
      train, test, task='emnist_digits' if only_digits else 'emnist',
      num_classes=10 if only_digits else 62, input_shape=(28, 28, 1),
      x_dtype='float32', y_dtype='int32', derived=derived)
  return train, test, info
