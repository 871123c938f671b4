"""Federated Shakespeare: raw snippets, and word-level next-word prediction.

Sources (search order in :mod:`fedlite_jax.datasets.locate`): FedJAX SQLite
``shakespeare_{train,test}.sqlite``, TFF SQLite ``shakespeare.sqlite``
(splits 'train', 'test'), TFF legacy HDF5 ``shakespeare_{train,test}.h5``.
One client = one speaking role in one play (715 clients; 16,068 train /
2,356 test snippets). Raw feature: ``snippets``, an object array of bytes.

Word-level next-word prediction (so Shakespeare can stand in for
StackOverflow) goes through exactly the StackOverflow word pipeline
(:class:`~fedlite_jax.datasets.word_pipeline.WordTokenizer`). Each snippet is
first turned into StackOverflow-style ``tokens`` by :func:`words_from_text`,
which follows the preprocessing TFF documents for StackOverflow (lowercase;
punctuation as separate tokens except apostrophes and hyphens inside words;
whitespace, including newlines, collapsed):

  b"Is 'old dog' my reward? Most true,"
  -> b"is ' old dog ' my reward ? most true ,"

One snippet is one example, like one StackOverflow post, so x / y hold its
first ``sequence_length`` words (FedJAX's character-level Shakespeare, by
contrast, concatenates a client's snippets; use ``fedjax.datasets.shakespeare``
preprocessing on :func:`load_snippets` for that).
"""

from __future__ import annotations

import os
import re

import fedjax
from fedjax.datasets import shakespeare as fedjax_shakespeare
import numpy as np

from fedlite_jax.datasets import locate
from fedlite_jax.datasets import schema
from fedlite_jax.datasets import sources
from fedlite_jax.datasets import word_pipeline

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
  """StackOverflow-style space-separated tokens of a snippet.

  Args:
    text: UTF-8 bytes (invalid bytes become U+FFFD).

  Returns:
    Lowercased tokens joined by single spaces, as UTF-8 bytes (b'' for a
    snippet without tokens); see the module docstring.
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

  Args:
    data_dir: explicit data directory (see :mod:`locate`).
    allow_download: let FedJAX download its copy if nothing is found locally.
    cache_dir: cache for TFF-format conversions (see :mod:`cache`).

  Returns:
    (train, test, opened): client datasets have ``snippets``, [N] object array
    of bytes; ``opened`` says which files were read.

  Raises:
    DatasetNotFoundError: no files found and no download allowed / possible.
  """
  opened = sources.open_splits(SHAKESPEARE, SPLITS, data_dir,
                               allow_download=allow_download,
                               cache_directory=cache_dir)
  return opened.splits['train'], opened.splits['test'], opened


# Word-level next-word prediction (see the module docstring).
load_word_data = word_pipeline.NextWordTask(
    'shakespeare', SHAKESPEARE, snippets_to_tokens, 'shakespeare_train_words',
    TOKENIZER_VERSION,
    lambda vocab_size, vocab_ranking: (
        'word-level next-word prediction: snippets tokenized '
        f'StackOverflow-style ({TOKENIZER_VERSION}), vocabulary = top '
        f'{vocab_size} training words by {vocab_ranking}'))
