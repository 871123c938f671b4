"""SentencePiece sub-word vocabularies and next-token-prediction data.

Source: Ro et al., "Scaling Language Model Size in Cross-Device Federated
Learning" (2022), Sec. 3 (SentencePiece [Kudo & Richardson 2018], 4K
vocabulary from the Stack Overflow training corpus) and App. A (sequence
length 30). Ids: PAD 0, BOS 1, EOS 2, UNK/OOV 3, pieces 4..vocab_size - 1.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from absl import logging
import fedjax
from fedjax.datasets import stackoverflow as fedjax_stackoverflow
import numpy as np
import sentencepiece as spm

from fedlite_jax.datasets import (
    cache, info as info_lib, shakespeare, sources, stackoverflow)
from fedlite_jax import checks
from fedlite_jax.common import PAD_ID

BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
NUM_SPECIAL_IDS = 4
SPECIAL_PIECES = {PAD_ID: '<pad>', BOS_ID: '<s>', EOS_ID: '</s>',
                  UNK_ID: '<unk>'}
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_SEQUENCE_LENGTH = 30
MODEL_TYPES = ('unigram', 'bpe')
# Bump when the training text or the option set changes (keys the cache).
PIPELINE_VERSION = 'sp_v1'

Examples = Mapping[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class SentencePieceConfig:
  """Training options of a SentencePiece model (all part of the cache key).

  Attributes:
    vocab_size: ids including PAD, BOS, EOS, UNK; > 4 (default: "4K").
    model_type: 'unigram' (Kudo 2018) or 'bpe'.
    character_coverage: fraction of characters in the alphabet (rest: UNK).
    input_sentence_size: training sentences kept (seeded sample); 0 = all.
    seed: seed of SentencePiece's random generator.
    max_sentence_length: longer sentences (bytes) are skipped by the trainer.
  """
  vocab_size: int = DEFAULT_VOCAB_SIZE
  model_type: str = 'unigram'
  character_coverage: float = 0.9995
  input_sentence_size: int = 1_000_000
  seed: int = 0
  max_sentence_length: int = 4192

  def validate(self) -> None:
    """Raises ``ValueError`` naming the first bad option."""
    size = self.vocab_size
    if isinstance(size, bool) or not isinstance(
        size, (int, np.integer)) or size <= NUM_SPECIAL_IDS:
      raise ValueError(f'vocab_size must be an integer > {NUM_SPECIAL_IDS} '
                       f'(PAD, BOS, EOS, UNK plus pieces), got '
                       f'{self.vocab_size!r}.')
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f'model_type must be one of {MODEL_TYPES}, got '
                       f'{self.model_type!r}.')
    if not 0.0 < self.character_coverage <= 1.0:
      raise ValueError(f'character_coverage must be in (0, 1], got '
                       f'{self.character_coverage!r}.')
    if self.input_sentence_size < 0:
      raise ValueError(f'input_sentence_size must be >= 0, got '
                       f'{self.input_sentence_size!r}.')
    if self.max_sentence_length < 1:
      raise ValueError(f'max_sentence_length must be >= 1, got '
                       f'{self.max_sentence_length!r}.')

  def cache_key(self) -> str:
    """Every field as ``name=repr``, joined by ``|``: the cache key."""
    return '|'.join(f'{f.name}={getattr(self, f.name)!r}'
                    for f in dataclasses.fields(self))


def normalize_text(text: bytes | str) -> str:
  """Stripped text, whitespace runs collapsed to ' ' (bad UTF-8 -> U+FFFD)."""
  if isinstance(text, (bytes, np.bytes_)):
    text = bytes(text).decode('utf-8', errors='replace')
  return ' '.join(str(text).split())


def train_sentencepiece(sentences: Iterable[str],
                        config: SentencePieceConfig = SentencePieceConfig()
                        ) -> bytes:
  """The serialized ``ModelProto`` trained on non-blank ``sentences``.

  Deterministic (seeded, one thread); this module's id layout.

  Raises:
    ValueError: a bad config; no non-blank sentence; or a ``vocab_size`` the
      corpus cannot support (naming SentencePiece's limit).
  """
  config.validate()
  non_blank = (s for s in sentences if s and not s.isspace())
  first = next(non_blank, None)
  if first is None:
    raise ValueError('Cannot train a SentencePiece model on an empty corpus '
                     '(no non-blank sentence).')

  def all_sentences() -> Iterator[str]:
    yield first
    yield from non_blank

  writer = io.BytesIO()
  spm.set_random_generator_seed(int(config.seed))
  start = time.perf_counter()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=all_sentences(),
        model_writer=writer,
        vocab_size=int(config.vocab_size),
        model_type=config.model_type,
        character_coverage=float(config.character_coverage),
        input_sentence_size=int(config.input_sentence_size),
        shuffle_input_sentence=True,
        max_sentence_length=int(config.max_sentence_length),
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        pad_piece=SPECIAL_PIECES[PAD_ID], bos_piece=SPECIAL_PIECES[BOS_ID],
        eos_piece=SPECIAL_PIECES[EOS_ID], unk_piece=SPECIAL_PIECES[UNK_ID],
        hard_vocab_limit=True,
        num_threads=1,
        minloglevel=2)
  except RuntimeError as e:
    if 'Vocabulary size' in str(e) or 'vocab_size' in str(e):
      raise ValueError(
          f'vocab_size={config.vocab_size} is larger than this corpus '
          f'supports; SentencePiece says: {str(e).strip()}') from None
    raise
  logging.info('fedlite_jax.datasets: trained a %d-piece SentencePiece %s '
               'model in %.1f s', config.vocab_size, config.model_type,
               time.perf_counter() - start)
  return writer.getvalue()


class SubwordTokenizer:
  """Text -> next-token-prediction ids with a SentencePiece model.

  Attributes:
    num_ids: the model's output size (= the SentencePiece vocab size).
    vocab_size: pieces without the 4 special ids (num_ids - 4).
    oov_id: UNK's id, 3.
    model_proto: the serialized model.
  """

  def __init__(self, model_proto: bytes):
    """Raises ValueError: not a model, or PAD/BOS/EOS/UNK ids not 0/1/2/3."""
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(model_proto)
    except (RuntimeError, OSError) as e:
      raise ValueError(f'Not a SentencePiece model proto: {e}') from None
    got = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(),
           self._sp.unk_id())
    if got != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
      raise ValueError(f'SentencePiece model has (pad, bos, eos, unk) ids '
                       f'{got}; this pipeline needs (0, 1, 2, 3).')
    self.model_proto = bytes(model_proto)
    self.num_ids = int(self._sp.get_piece_size())
    self.vocab_size = self.num_ids - NUM_SPECIAL_IDS
    self.oov_id = UNK_ID

  def pieces(self, text: str) -> list[str]:
    """The sub-word pieces of normalized ``text`` (for inspection)."""
    return self._sp.encode(normalize_text(text), out_type=str)

  def piece_ids(self, texts: Sequence[bytes | str]) -> list[list[int]]:
    """Sub-word ids (no BOS/EOS) of each normalized text."""
    return self._sp.encode([normalize_text(t) for t in texts])

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ``ids``; PAD, BOS and EOS are dropped."""
    return self._sp.decode([int(i) for i in ids
                            if i not in (PAD_ID, BOS_ID, EOS_ID)])

  def encode(self, texts: Sequence[bytes | str],
             max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Encodes [B] texts as (x, y), int32 [B, L] each (L = max_length).

    ``x = ([BOS] + ids)[:L]``, ``y = (ids + [EOS])[:L]``, padded with PAD 0.
    Raises ValueError if max_length < 1.
    """
    if max_length < 1:
      raise ValueError(f'max_length must be >= 1, got {max_length}.')
    all_ids = self.piece_ids(list(texts))
    x = np.zeros((len(all_ids), max_length), np.int32)
    y = np.zeros((len(all_ids), max_length), np.int32)
    for i, ids in enumerate(all_ids):
      seq_x = [BOS_ID] + ids[:max_length - 1]
      seq_y = (ids + [EOS_ID])[:max_length]
      x[i, :len(seq_x)] = seq_x
      y[i, :len(seq_y)] = seq_y
    return x, y

  def as_preprocess_batch(
      self, feature: str,
      max_length: int) -> Callable[[Examples], dict[str, np.ndarray]]:
    """``preprocess_batch``: {feature, 'domain_id'?} -> {'x', 'y', ...}.

    Raises:
      ValueError: max_length < 1.
    """
    if max_length < 1:
      raise ValueError(f'max_length must be >= 1, got {max_length}.')

    def preprocess_batch(examples: Examples) -> dict[str, np.ndarray]:
      x, y = self.encode(examples[feature], max_length)
      out = {'x': x, 'y': y}
      if 'domain_id' in examples:
        out['domain_id'] = examples['domain_id']
      return out

    return preprocess_batch


def split_sentences(fd: fedjax.FederatedData, feature: str,
                    split_lines: bool) -> Iterator[str]:
  """Normalized non-blank sentences of a raw split's bytes ``feature``.

  With ``split_lines`` each line of an example is a sentence.
  """
  for _, cds in fd.clients():
    for text in cds.all_examples()[feature]:
      text = bytes(text).decode('utf-8', errors='replace')
      parts = text.split('\n') if split_lines else (text,)
      for part in parts:
        s = normalize_text(part)
        if s:
          yield s


def cached_sentencepiece_model(
    sentences: Callable[[], Iterable[str]],
    name: str,
    source_paths: Sequence[str],
    derivation: str,
    config: SentencePieceConfig = SentencePieceConfig(),
    cache_directory: str | os.PathLike[str] | None = None
) -> tuple[bytes, str]:
  """:func:`train_sentencepiece`, cached; returns (proto, ``.model`` path).

  ``sentences()`` is called only on a cache miss. The cache key covers
  ``source_paths`` (the files the sentences come from), ``derivation`` (how
  they are made) and ``config``; ``name`` is the file-name prefix.
  """
  config.validate()
  key = cache.fingerprint(list(source_paths), derivation, config.cache_key(),
                          PIPELINE_VERSION)
  path = os.path.join(cache.cache_dir(cache_directory),
                      f'{name}.sp{config.vocab_size}.{key}.model')
  if os.path.isfile(path):
    logging.info('fedlite_jax.datasets: reusing SentencePiece model %s', path)
    with open(path, 'rb') as f:
      return f.read(), path
  logging.info('fedlite_jax.datasets: training a SentencePiece model '
               '(one-time) -> %s', path)
  proto = train_sentencepiece(sentences(), config)
  tmp = cache.atomic_path(path)
  with open(tmp, 'wb') as f:
    f.write(proto)
  os.replace(tmp, path)
  return proto, path


@dataclasses.dataclass(frozen=True)
class SentencePieceTask:
  """Next-sub-word prediction on one text dataset; call it to load the data.

  Trains (once, cached) a model on the training split's ``feature``; one
  example per snippet / post (its first L tokens).

  Attributes:
    task: the ``DatasetInfo.task`` name, e.g. 'shakespeare_sp'.
    source: the dataset.
    feature: the raw text feature ('snippets', 'tokens').
    split_lines: train on each line of an example separately.
    model_name: file-name prefix of the cached ``.model`` file.
    derivation: how the training sentences are made (part of the cache key).
    client: ``preprocess_client`` applied before encoding, or None.
    describe: (config, sequence_length) -> ``DatasetInfo.derived``.
  """
  task: str
  source: sources.DatasetSource
  feature: str
  split_lines: bool
  model_name: str
  derivation: str
  client: Callable[[bytes, Examples], Examples] | None
  describe: Callable[[SentencePieceConfig, int], str]

  def __call__(
      self,
      data_dir: str | os.PathLike[str] | None = None,
      *,
      sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
      config: SentencePieceConfig = SentencePieceConfig(),
      allow_download: bool = False,
      cache_dir: str | os.PathLike[str] | None = None
  ) -> tuple[fedjax.FederatedData, fedjax.FederatedData, info_lib.DatasetInfo]:
    """Loads the task; L = ``sequence_length`` (default 30, Ro et al. App. A).

    Returns:
      (train, test, info). Batches: ``x``, ``y`` int32 [B, L] in
      [0, config.vocab_size), plus ``domain_id`` int32 [B] for StackOverflow.

    Raises:
      DatasetNotFoundError: no files of the dataset found.
      ValueError: a bad argument, or a vocab_size the corpus cannot support.
    """
    checks.check_int(sequence_length, 'sequence_length')
    config.validate()
    opened = sources.open_splits(self.source, ('train', 'test'), data_dir,
                                 allow_download=allow_download,
                                 cache_directory=cache_dir)
    train_raw = opened.splits['train']
    proto, model_path = cached_sentencepiece_model(
        lambda: split_sentences(train_raw, self.feature, self.split_lines),
        self.model_name, [opened.read_path('train')], self.derivation,
        config, cache_dir)
    tokenizer = SubwordTokenizer(proto)
    train, test = opened.preprocess(
        tokenizer.as_preprocess_batch(self.feature, sequence_length),
        self.client)
    return train, test, opened.dataset_info(
        train, test, (model_path,), task=self.task,
        derived=self.describe(config, sequence_length),
        **info_lib.next_token_fields(tokenizer, sequence_length))


load_shakespeare_sp = SentencePieceTask(
    'shakespeare_sp', shakespeare.SHAKESPEARE, 'snippets', True,
    'shakespeare_train', 'snippets lines, whitespace collapsed', None,
    lambda c, length: (
        f'sub-word next-token prediction: SentencePiece {c.model_type} '
        f'{c.vocab_size} ids trained on the training snippets (seed '
        f'{c.seed}); one example per snippet, first {length} tokens'))

# Ro et al. 2022, Sec. 3.
load_stackoverflow_sp = SentencePieceTask(
    'stackoverflow_sp', stackoverflow.STACKOVERFLOW, 'tokens', False,
    'stackoverflow_train', "raw 'tokens', one post per sentence",
    fedjax_stackoverflow.preprocess_client,
    lambda c, length: (
        f'sub-word next-token prediction: SentencePiece {c.model_type} '
        f'{c.vocab_size} ids trained on the training posts (seed {c.seed}, '
        f'<= {c.input_sentence_size} sampled posts)'))


SP_TASKS = {'shakespeare': load_shakespeare_sp,
            'stackoverflow_nwp': load_stackoverflow_sp}


def load_sentencepiece_data(
    task: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    allow_download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None
) -> tuple[fedjax.FederatedData, fedjax.FederatedData, info_lib.DatasetInfo]:
  """``tokenizer='sentencepiece'`` version of a text task (a key of SP_TASKS).

  ``vocab_size`` counts the 4 special ids; ``seed`` seeds the training; the
  rest as :class:`SentencePieceTask`. Raises ValueError for an unknown task.
  """
  if task not in SP_TASKS:
    raise ValueError(f'tokenizer=sentencepiece supports tasks '
                     f'{sorted(SP_TASKS)}, got {task!r}.')
  return SP_TASKS[task](
      data_dir, sequence_length=sequence_length,
      config=SentencePieceConfig(vocab_size=vocab_size, seed=seed),
      allow_download=allow_download, cache_dir=cache_dir)


def load_tokenizer(path: str | os.PathLike[str]) -> SubwordTokenizer:
  """A :class:`SubwordTokenizer` from a ``.model`` file (e.g. the cache's)."""
  with open(path, 'rb') as f:
    return SubwordTokenizer(f.read())
