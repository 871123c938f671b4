"""Federated StackOverflow: next-word prediction and tag prediction.

Sources (search order in :mod:`fedlite_jax.datasets.locate`): FedJAX SQLite
``stackoverflow_{train,held_out,test}.sqlite``; TFF SQLite
``stackoverflow.sqlite`` (splits 'train', 'heldout', 'test'; converted once,
streaming, into FedJAX-format SQLite in the cache, since the file holds 135.8M
training examples); TFF legacy HDF5 ``stackoverflow_{train,held_out,test}.h5``.

Raw features (FedJAX ``stackoverflow.load_split``; object arrays of bytes
unless noted): ``creation_date``, ``score`` (int64), ``tags`` ('|'-separated),
``title``, ``tokens`` (space-separated), ``type`` (b'question' / b'answer').

Vocabularies come from the TRAINING split (:mod:`fedlite_jax.datasets.vocab`;
counted once and cached; this pass over the full training split takes a long
time, logged with absl): words from ``tokens`` split on ' ', tags from
``tags`` split on '|'. FedJAX's default vocabulary file
(``gs://gresearch/fedjax/stackoverflow/stackoverflow.word_count``) needs
TensorFlow's GCS reader, so it is not used; with ``vocab_ranking='clients'``
the ranking follows TFF's published word counts (users per word).
"""

from __future__ import annotations

import os
from typing import Sequence

import fedjax
from fedjax.datasets import stackoverflow as fedjax_stackoverflow
import numpy as np

from fedlite_jax.datasets import info as info_lib
from fedlite_jax.datasets import locate
from fedlite_jax.datasets import schema
from fedlite_jax.datasets import sources
from fedlite_jax.datasets import vocab as vocab_lib
from fedlite_jax.datasets import word_pipeline

SPLITS = ('train', 'held_out', 'test')
SPECS = {
    'creation_date': schema.FeatureSpec('bytes'),
    'score': schema.FeatureSpec('int64', (), 'int64'),
    'tags': schema.FeatureSpec('bytes'),
    'title': schema.FeatureSpec('bytes'),
    'tokens': schema.FeatureSpec('bytes'),
    'type': schema.FeatureSpec('bytes'),
}
_WORDS_DERIVATION = "raw 'tokens' split on b' '"
_TAGS_DERIVATION = "raw 'tags' split on b'|'"


def _download(split: str, cache_dir: str) -> fedjax.FederatedData:
  return fedjax_stackoverflow.load_split(split, cache_dir=cache_dir)


STACKOVERFLOW = sources.DatasetSource(
    locate.DatasetFiles(
        name='stackoverflow',
        fedjax_sqlite={s: f'stackoverflow_{s}.sqlite' for s in SPLITS},
        tff_sqlite='stackoverflow.sqlite',
        tff_sqlite_splits={'train': 'train', 'held_out': 'heldout',
                           'test': 'test'},
        tff_hdf5={s: f'stackoverflow_{s}.h5' for s in SPLITS},
        subdirs=('stackoverflow',)),
    SPECS, _download)


def load_raw(splits: Sequence[str] = ('train', 'test'),
             data_dir: str | os.PathLike[str] | None = None,
             *,
             allow_download: bool = False,
             cache_dir: str | os.PathLike[str] | None = None
             ) -> sources.Opened:
  """Opens raw StackOverflow splits (all six features).

  Args:
    splits: a subset of ('train', 'held_out', 'test').
    data_dir: explicit data directory.
    allow_download: let FedJAX download its copy if nothing is found locally.
    cache_dir: cache for TFF-format conversions.

  Returns:
    The opened splits (``.splits[name]`` is a raw ``fedjax.FederatedData``).

  Raises:
    ValueError: an unknown split.
    DatasetNotFoundError: no files found and no download allowed / possible.
  """
  unknown = [s for s in splits if s not in SPLITS]
  if unknown:
    raise ValueError(f'Unknown StackOverflow split(s) {unknown}; allowed: '
                     f'{SPLITS}.')
  return sources.open_splits(STACKOVERFLOW, tuple(splits), data_dir,
                             allow_download=allow_download,
                             cache_directory=cache_dir)


def _train_counts(opened: sources.Opened, feature: str, sep: bytes,
                  derivation: str, cache_dir) -> tuple[vocab_lib.TokenCounts,
                                                       str]:
  return vocab_lib.cached_token_counts(
      opened.splits['train'], feature, sep,
      f'stackoverflow_train_{feature}',
      [opened.cached.get('train') or opened.paths['train']], derivation,
      cache_dir)


def _info(opened: sources.Opened, train: fedjax.FederatedData,
          test: fedjax.FederatedData, cached: Sequence[str],
          **kwargs) -> info_lib.DatasetInfo:
  files = tuple(dict.fromkeys(opened.paths[s] for s in ('train', 'test')))
  return info_lib.DatasetInfo(
      num_train_clients=train.num_clients(),
      num_test_clients=test.num_clients(),
      format=opened.format,
      source=os.path.dirname(files[0]),
      files=files,
      cached_files=tuple(opened.cached.values()) + tuple(cached),
      **kwargs)


def load_word_prediction(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    sequence_length: int = 20,
    vocab_size: int = 10000,
    vocab_ranking: str = 'occurrences',
    allow_download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None
) -> tuple[fedjax.FederatedData, fedjax.FederatedData, info_lib.DatasetInfo]:
  """StackOverflow next-word prediction, as FedJAX's ``as_preprocess_batch``.

  Client preprocessing is FedJAX's ``stackoverflow.preprocess_client``
  (keeps ``tokens``, adds ``domain_id`` = 1 for answers); batch preprocessing
  is :class:`~fedlite_jax.datasets.word_pipeline.WordTokenizer`.

  Args:
    data_dir: explicit data directory.
    sequence_length: L, length of x and y (default 20, FedJAX's training
      length; FedJAX evaluates with 30).
    vocab_size: vocabulary slots (default 10,000): ids 3 .. vocab_size + 2;
      OOV = vocab_size + 3; output size vocab_size + 4.
    vocab_ranking: 'occurrences' (default) or 'clients' (TFF's ranking).
    allow_download: let FedJAX download its copy if nothing is found locally.
    cache_dir: cache for conversions and token counts.

  Returns:
    (train, test, info). Batches: ``x``, ``y`` int32 [B, L]; ``domain_id``
    int32 [B].

  Raises:
    DatasetNotFoundError: no files found.
    ValueError: sequence_length or vocab_size < 1, or a bad vocab_ranking.
  """
  if sequence_length < 1 or vocab_size < 1:
    raise ValueError('sequence_length and vocab_size must be >= 1, got '
                     f'{sequence_length}, {vocab_size}.')
  vocab_lib.check_ranking(vocab_ranking)
  opened = load_raw(('train', 'test'), data_dir,
                    allow_download=allow_download, cache_dir=cache_dir)
  counts, counts_path = _train_counts(opened, 'tokens', b' ',
                                      _WORDS_DERIVATION, cache_dir)
  tokenizer = word_pipeline.WordTokenizer(
      counts.top(vocab_size, by=vocab_ranking), vocab_size)
  preprocess = tokenizer.as_preprocess_batch(sequence_length)
  train, test = (
      opened.splits[s].preprocess_client(
          fedjax_stackoverflow.preprocess_client).preprocess_batch(preprocess)
      for s in ('train', 'test'))
  info = _info(
      opened, train, test, (counts_path,),
      task='stackoverflow_nwp',
      num_classes=tokenizer.num_ids,
      input_shape=(sequence_length,),
      x_dtype='int32',
      y_dtype='int32',
      sequence_length=sequence_length,
      vocab_size=vocab_size,
      oov_id=tokenizer.oov_id,
      derived=(f'vocabulary = top {vocab_size} training words by '
               f'{vocab_ranking} (built here, not FedJAX\'s vocabulary file)'))
  return train, test, info


def _keep_tag_features(
    client_id: bytes,
    examples: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """``preprocess_client`` keeping only what tag prediction reads."""
  del client_id
  return {k: examples[k] for k in ('tokens', 'title', 'tags')}


def load_tag_prediction(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    word_vocab_size: int = 5000,
    tag_vocab_size: int = 1000,
    vocab_ranking: str = 'occurrences',
    allow_download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None
) -> tuple[fedjax.FederatedData, fedjax.FederatedData, info_lib.DatasetInfo]:
  """StackOverflow tag prediction (TFF's logistic-regression task).

  Args:
    data_dir: explicit data directory.
    word_vocab_size: length of x: the top training words of ``tokens``.
    tag_vocab_size: length of y: the top training tags.
    vocab_ranking: 'occurrences' (default) or 'clients' (TFF's ranking).
    allow_download: let FedJAX download its copy if nothing is found locally.
    cache_dir: cache for conversions and token counts.

  Returns:
    (train, test, info). Batches: ``x`` float32 [B, word_vocab_size] (word
    frequencies of tokens + title, summing to <= 1), ``y`` float32
    [B, tag_vocab_size] (multi-hot tags); see
    :class:`~fedlite_jax.datasets.word_pipeline.TagPredictionEncoder`.

  Raises:
    DatasetNotFoundError: no files found.
    ValueError: a vocabulary size < 1 or a bad vocab_ranking.
  """
  if word_vocab_size < 1 or tag_vocab_size < 1:
    raise ValueError('word_vocab_size and tag_vocab_size must be >= 1, got '
                     f'{word_vocab_size}, {tag_vocab_size}.')
  vocab_lib.check_ranking(vocab_ranking)
  opened = load_raw(('train', 'test'), data_dir,
                    allow_download=allow_download, cache_dir=cache_dir)
  words, words_path = _train_counts(opened, 'tokens', b' ', _WORDS_DERIVATION,
                                    cache_dir)
  tags, tags_path = _train_counts(opened, 'tags', b'|', _TAGS_DERIVATION,
                                  cache_dir)
  encoder = word_pipeline.TagPredictionEncoder(
      words.top(word_vocab_size, by=vocab_ranking),
      tags.top(tag_vocab_size, by=vocab_ranking),
      num_words=word_vocab_size, num_tags=tag_vocab_size)
  preprocess = encoder.as_preprocess_batch()
  train, test = (
      opened.splits[s].preprocess_client(_keep_tag_features).preprocess_batch(
          preprocess) for s in ('train', 'test'))
  info = _info(
      opened, train, test, (words_path, tags_path),
      task='stackoverflow_tag',
      num_classes=tag_vocab_size,
      input_shape=(word_vocab_size,),
      x_dtype='float32',
      y_dtype='float32',
      vocab_size=word_vocab_size,
      derived=(f'bag of words over the top {word_vocab_size} training words, '
               f'multi-hot over the top {tag_vocab_size} training tags (by '
               f'{vocab_ranking})'))
  return train, test, info
