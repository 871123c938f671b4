"""Federated StackOverflow: next-word prediction and tag prediction.

Files: FedJAX ``stackoverflow_{train,held_out,test}.sqlite``, TFF
``stackoverflow.sqlite`` (splits 'train', 'heldout', 'test') or TFF
``stackoverflow_{train,held_out,test}.h5``. Vocabularies are counted once on
the training split and cached (:mod:`fedlite_jax.datasets.vocab`).
"""

from __future__ import annotations

import os
from typing import Sequence

import fedjax
from fedjax.datasets import stackoverflow as fedjax_stackoverflow
import numpy as np

from fedlite_jax.datasets import (
    info as info_lib, locate, schema, sources, vocab as vocab_lib,
    word_pipeline)

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


STACKOVERFLOW = sources.DatasetSource(
    locate.DatasetFiles.by_convention(
        'stackoverflow', SPLITS, 'stackoverflow', 'stackoverflow.sqlite',
        'stackoverflow', ('stackoverflow',),
        {'train': 'train', 'held_out': 'heldout', 'test': 'test'}),
    SPECS, fedjax_stackoverflow.load_split)


def load_raw(splits: Sequence[str] = ('train', 'test'),
             data_dir: str | os.PathLike[str] | None = None, *,
             allow_download: bool = False,
             cache_dir: str | os.PathLike[str] | None = None) -> sources.Opened:
  """Opens raw StackOverflow ``splits`` (a subset of SPLITS).

  Features (object arrays of bytes unless noted): ``creation_date``,
  ``score`` (int64), ``tags`` ('|'-separated), ``title``, ``tokens``
  (space-separated), ``type`` (b'question' / b'answer').

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
      f'stackoverflow_train_{feature}', [opened.read_path('train')],
      derivation, cache_dir)


# Next-word prediction, as FedJAX's ``as_preprocess_batch`` (``domain_id`` = 1
# for answers, from FedJAX's ``preprocess_client``).
load_word_prediction = word_pipeline.NextWordTask(
    'stackoverflow_nwp', STACKOVERFLOW, fedjax_stackoverflow.preprocess_client,
    'stackoverflow_train_tokens', _WORDS_DERIVATION,
    lambda vocab_size, vocab_ranking: (
        f'vocabulary = top {vocab_size} training words by {vocab_ranking} '
        '(built here, not FedJAX\'s vocabulary file)'))


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
    word_vocab_size: length of x: the top training words of ``tokens``.
    tag_vocab_size: length of y: the top training tags.
    vocab_ranking: 'occurrences' (default) or 'clients' (TFF's ranking).
    data_dir, allow_download, cache_dir: as for
      :func:`fedlite_jax.datasets.load_federated_data`.

  Returns:
    (train, test, info). Batches: ``x`` float32 [B, word_vocab_size] (word
    frequencies of tokens + title, sum <= 1), ``y`` float32
    [B, tag_vocab_size] (multi-hot tags).

  Raises:
    DatasetNotFoundError: no files found.
    ValueError: a vocabulary size < 1 or a bad vocab_ranking.
  """
  vocab_lib.check_options(vocab_ranking, word_vocab_size=word_vocab_size,
                          tag_vocab_size=tag_vocab_size)
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
  train, test = opened.preprocess(encoder.as_preprocess_batch(),
                                  _keep_tag_features)
  info = opened.dataset_info(
      train, test, (words_path, tags_path), task='stackoverflow_tag',
      num_classes=tag_vocab_size, input_shape=(word_vocab_size,),
      x_dtype='float32', y_dtype='float32', vocab_size=word_vocab_size,
      derived=(f'bag of words over the top {word_vocab_size} training words, '
               f'multi-hot over the top {tag_vocab_size} training tags (by '
               f'{vocab_ranking})'))
  return train, test, info
