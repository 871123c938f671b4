"""Federated Shakespeare: raw snippets, and word-level next-word prediction.

Files: FedJAX ``shakespeare_{train,test}.sqlite``, TFF ``shakespeare.sqlite``
or TFF ``shakespeare_{train,test}.h5``. One client = one role in one play
(715 clients). Next-word prediction tokenizes each snippet StackOverflow-style
(:func:`words_from_text`) and reuses the StackOverflow word pipeline.
"""

from __future__ import annotations

import os
import re

import fedjax
from fedjax.datasets import shakespeare as fedjax_shakespeare
import numpy as np

from fedlite_jax.datasets import locate, schema, sources, word_pipeline

SPLITS = ('train', 'test')
SPECS = {'snippets': schema.FeatureSpec('bytes')}
# Bump when words_from_text changes (it keys the cached vocabulary).
TOKENIZER_VERSION = 'so_style_words_v1'

# A word: letters/digits, optionally joined by single apostrophes or hyphens
# ("sav'd", "four-score"); anything else that is not whitespace is one token.
_WORD_RE = re.compile(r"[^\W_]+(?:['\-][^\W_]+)*|\S")


SHAKESPEARE = sources.DatasetSource(
    locate.DatasetFiles.by_convention(
        'shakespeare', SPLITS, 'shakespeare', 'shakespeare.sqlite',
        'shakespeare', ('shakespeare', 'tff_shakespeare_h5')),
    SPECS, fedjax_shakespeare.load_split)


def words_from_text(text: bytes) -> bytes:
  """StackOverflow-style tokens of a UTF-8 snippet, as TFF documents them.

  Lowercased; punctuation is a token of its own except apostrophes and
  hyphens inside words; joined by single spaces (bad UTF-8 -> U+FFFD).
  """
  words = _WORD_RE.findall(text.decode('utf-8', errors='replace').lower())
  return ' '.join(words).encode('utf-8')


def snippets_to_tokens(
    client_id: bytes,
    examples: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """``preprocess_client``: {'snippets'} -> {'tokens'} ([N] bytes each)."""
  del client_id
  tokens = np.empty(len(examples['snippets']), dtype=object)
  tokens[:] = [words_from_text(s) for s in examples['snippets']]
  return {'tokens': tokens}


def load_snippets(data_dir: str | os.PathLike[str] | None = None,
                  *,
                  allow_download: bool = False,
                  cache_dir: str | os.PathLike[str] | None = None
                  ) -> tuple[fedjax.FederatedData, fedjax.FederatedData,
                             sources.Opened]:
  """Loads the raw snippets, like ``fedjax.datasets.shakespeare.load_split``.

  Arguments as for :func:`fedlite_jax.datasets.load_federated_data`.

  Returns:
    (train, test, opened): clients have ``snippets``, [N] object array of
    bytes; ``opened`` says which files were read.

  Raises:
    DatasetNotFoundError: no files found and no download allowed / possible.
  """
  opened = sources.open_splits(SHAKESPEARE, SPLITS, data_dir,
                               allow_download=allow_download,
                               cache_directory=cache_dir)
  return opened.splits['train'], opened.splits['test'], opened


# Word-level next-word prediction: one snippet = one example (first L words).
load_word_data = word_pipeline.NextWordTask(
    'shakespeare', SHAKESPEARE, snippets_to_tokens, 'shakespeare_train_words',
    TOKENIZER_VERSION,
    lambda vocab_size, vocab_ranking: (
        'word-level next-word prediction: snippets tokenized '
        f'StackOverflow-style ({TOKENIZER_VERSION}), vocabulary = top '
        f'{vocab_size} training words by {vocab_ranking}'))
