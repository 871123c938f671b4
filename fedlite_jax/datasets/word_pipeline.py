"""Word-level preprocessing in numpy (no TensorFlow).

Next-word prediction as FedJAX's ``stackoverflow.DefaultWordTokenizer`` (one
OOV bucket); tag prediction as TFF's ``tag_prediction_preprocessing``
(StackOverflow logistic regression).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping, Sequence

import fedjax
import numpy as np

from fedlite_jax.datasets import info as info_lib, sources, vocab as vocab_lib

Examples = Mapping[str, np.ndarray]
BatchPreprocessor = Callable[[Examples], dict[str, np.ndarray]]


def _as_bytes(word: bytes | str) -> bytes:
  return word.encode('utf-8') if isinstance(word, str) else bytes(word)


def _lookup_table(vocab: Sequence[bytes | str],
                  offset: int) -> dict[bytes, int]:
  table = {}
  for i, word in enumerate(vocab):
    word = _as_bytes(word)
    if word in table:
      raise ValueError(f'Vocabulary has a duplicate entry {word!r} (positions '
                       f'{table[word] - offset} and {i}).')
    table[word] = i + offset
  return table


class WordTokenizer:
  """Maps space-separated ``tokens`` to FedJAX's next-word-prediction ids.

  Ids: PAD 0, BOS 1, EOS 2, ``vocab[i]`` -> ``i + 3``, other words (empty
  ones too: split on single spaces, as ``tf.strings.split(sep=' ')``) OOV.

  Attributes:
    vocab_size: vocabulary slots (ids 3 .. vocab_size + 2), >= len(vocab)
      (default len(vocab)); more keep the OOV id for a small corpus.
    oov_id: ``vocab_size + 3``.
    num_ids: ``vocab_size + 4`` (the model's output size).

  Raises:
    ValueError: duplicate words, or vocab_size < len(vocab).
  """

  def __init__(self, vocab: Sequence[bytes | str],
               vocab_size: int | None = None):
    """``vocab``: words (``str`` UTF-8 encoded), without special tokens."""
    self._table = _lookup_table(vocab, info_lib.NUM_RESERVED)
    self.vocab_size = len(vocab) if vocab_size is None else int(vocab_size)
    if self.vocab_size < len(vocab):
      raise ValueError(f'vocab_size={vocab_size} is smaller than the '
                       f'vocabulary ({len(vocab)} words).')
    self.oov_id = self.vocab_size + info_lib.NUM_RESERVED
    self.num_ids = self.oov_id + 1

  def word_ids(self, tokens: bytes, max_words: int | None = None) -> list[int]:
    """Ids of the first ``max_words`` space-separated words (all if None)."""
    words = (tokens.split(b' ') if max_words is None else
             tokens.split(b' ', max_words)[:max_words])
    get, oov = self._table.get, self.oov_id
    return [get(w, oov) for w in words]

  def encode(self, tokens: np.ndarray,
             max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Encodes [B] posts as (x, y), int32 [B, L] each (L = max_length).

    ``x = ([BOS] + ids)[:L]``, ``y = (ids + [EOS])[:L]``, padded with PAD 0.
    Raises ValueError if max_length < 1.
    """
    if max_length < 1:
      raise ValueError(f'max_length must be >= 1, got {max_length}.')
    num = len(tokens)
    x = np.zeros((num, max_length), np.int32)
    y = np.zeros((num, max_length), np.int32)
    for i, t in enumerate(tokens):
      ids = self.word_ids(_as_bytes(t), max_length)
      seq_x = [info_lib.BOS] + ids[:max_length - 1]
      seq_y = ids + [info_lib.EOS] if len(ids) < max_length else ids
      x[i, :len(seq_x)] = seq_x
      y[i, :len(seq_y)] = seq_y
    return x, y

  def as_preprocess_batch(self, max_length: int) -> BatchPreprocessor:
    """``preprocess_batch``: {'tokens', 'domain_id'?} -> {'x', 'y', ...}."""
    if max_length < 1:
      raise ValueError(f'max_length must be >= 1, got {max_length}.')

    def preprocess_batch(examples: Examples) -> dict[str, np.ndarray]:
      x, y = self.encode(examples['tokens'], max_length)
      result = {'x': x, 'y': y}
      if 'domain_id' in examples:
        result['domain_id'] = examples['domain_id']
      return result

    return preprocess_batch


class TagPredictionEncoder:
  """Bag-of-words inputs and tag targets (TFF's StackOverflow LR task).

  Word ``i`` of ``word_vocab`` is ``x[..., i]``, tag ``j`` of ``tag_vocab``
  is ``y[..., j]``.

  Attributes:
    num_words: length of ``x``, >= len(word_vocab) (default: equal).
    num_tags: length of ``y``, >= len(tag_vocab) (default: equal).

  Raises:
    ValueError: duplicates, or a size smaller than its vocabulary.
  """

  def __init__(self, word_vocab: Sequence[bytes | str],
               tag_vocab: Sequence[bytes | str],
               num_words: int | None = None, num_tags: int | None = None):
    self._words = _lookup_table(word_vocab, 0)
    self._tags = _lookup_table(tag_vocab, 0)
    self.num_words = len(word_vocab) if num_words is None else int(num_words)
    self.num_tags = len(tag_vocab) if num_tags is None else int(num_tags)
    if self.num_words < len(word_vocab) or self.num_tags < len(tag_vocab):
      raise ValueError('num_words / num_tags must be >= the vocabulary sizes '
                       f'({len(word_vocab)}, {len(tag_vocab)}); got '
                       f'{num_words}, {num_tags}.')

  def encode(self, tokens: np.ndarray, titles: np.ndarray,
             tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encodes a batch of [B] bytes: tokens, titles, '|'-separated tags.

    Returns:
      ``(x, y)``. ``x``, float32 ``[B, num_words]``: word counts / number of
      words (OOV included) of ``tokens + b' ' + title`` split on whitespace;
      zeros for no words (TF's ``reduce_mean`` would give NaN). ``y``,
      float32 ``[B, num_tags]``: vocabulary tag counts (OOV tags dropped).
    """
    num = len(tokens)
    x = np.zeros((num, self.num_words), np.float32)
    y = np.zeros((num, self.num_tags), np.float32)
    for i in range(num):
      words = (_as_bytes(tokens[i]) + b' ' + _as_bytes(titles[i])).split()
      if words:
        ids = [self._words.get(w, -1) for w in words]
        counts = np.bincount([j for j in ids if j >= 0],
                             minlength=self.num_words)
        x[i] = counts / np.float32(len(words))
      tag_ids = [self._tags.get(t, -1) for t in _as_bytes(tags[i]).split(b'|')]
      for j in tag_ids:
        if j >= 0:
          y[i, j] += 1.0
    return x, y

  def as_preprocess_batch(self) -> BatchPreprocessor:
    """``preprocess_batch``: {'tokens', 'title', 'tags'} -> {'x', 'y'}."""

    def preprocess_batch(examples: Examples) -> dict[str, np.ndarray]:
      x, y = self.encode(examples['tokens'], examples['title'],
                         examples['tags'])
      return {'x': x, 'y': y}

    return preprocess_batch


@dataclasses.dataclass(frozen=True)
class NextWordTask:
  """Word-level next-word prediction on one dataset; call it to load the data.

  The vocabulary is the top training words (counted once, cached) of the
  ``tokens`` made by ``to_tokens``.

  Attributes:
    task: the ``DatasetInfo.task`` name.
    source: the dataset.
    to_tokens: ``preprocess_client`` giving clients ``tokens`` ([N]
      space-separated bytes).
    counts_name: file-name prefix of the cached word counts.
    derivation: how ``tokens`` is made (part of the counts' cache key).
    describe: (vocab_size, vocab_ranking) -> ``DatasetInfo.derived``.
  """
  task: str
  source: sources.DatasetSource
  to_tokens: Callable[[bytes, Examples], Examples]
  counts_name: str
  derivation: str
  describe: Callable[[int, str], str]

  def __call__(
      self,
      data_dir: str | os.PathLike[str] | None = None,
      *,
      sequence_length: int = 20, vocab_size: int = 10000,
      vocab_ranking: str = 'occurrences',
      allow_download: bool = False,
      cache_dir: str | os.PathLike[str] | None = None
  ) -> tuple[fedjax.FederatedData, fedjax.FederatedData, info_lib.DatasetInfo]:
    """Loads the task (arguments as for ``datasets.load_federated_data``).

    ``sequence_length`` L defaults to 20, FedJAX's StackOverflow training
    length (FedJAX evaluates with 30).

    Returns:
      (train, test, info). Batches: ``x``, ``y`` int32 [B, L] in
      [0, vocab_size + 4), plus ``domain_id`` int32 [B] for StackOverflow.

    Raises:
      DatasetNotFoundError: no files found.
      ValueError: sequence_length or vocab_size < 1, or a bad vocab_ranking.
    """
    vocab_lib.check_options(vocab_ranking, sequence_length=sequence_length,
                            vocab_size=vocab_size)
    opened = sources.open_splits(self.source, ('train', 'test'), data_dir,
                                 allow_download=allow_download,
                                 cache_directory=cache_dir)
    counts, counts_path = vocab_lib.cached_token_counts(
        opened.splits['train'].preprocess_client(self.to_tokens), 'tokens',
        b' ', self.counts_name, [opened.read_path('train')], self.derivation,
        cache_dir)
    tokenizer = WordTokenizer(counts.top(vocab_size, by=vocab_ranking),
                              vocab_size)
    train, test = opened.preprocess(
        tokenizer.as_preprocess_batch(sequence_length), self.to_tokens)
    return train, test, opened.dataset_info(
        train, test, (counts_path,), task=self.task,
        derived=self.describe(vocab_size, vocab_ranking),
        **info_lib.next_token_fields(tokenizer, sequence_length))
