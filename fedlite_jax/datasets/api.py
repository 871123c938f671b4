"""The single entry point: :func:`load_federated_data`.

Its batches are dicts of numpy arrays (FedJAX's conventions):

================== ===================================== =====================
task               x                                     y
================== ===================================== =====================
embedded_mnist     float32 [B,28,28,1] in [0,1], bg 0    int32 [B] in [0,10)
emnist             float32 [B,28,28,1] = 1 - pixels      int32 [B] in [0,62)
emnist_digits      same                                  int32 [B] in [0,10)
stackoverflow_nwp  int32 [B,L] word ids                  int32 [B,L]
stackoverflow_tag  float32 [B,tag_word_vocab_size]       float32 [B,tags]
shakespeare        int32 [B,L] word ids                  int32 [B,L]
================== ===================================== =====================

EMNIST and StackOverflow next-word batches also have 'domain_id'. Word ids:
PAD 0, BOS 1, EOS 2, words 3..vocab_size+2, OOV vocab_size+3.
"""

from __future__ import annotations

import os

import fedjax

from fedlite_jax.datasets import (
    embedded_mnist, emnist, info as info_lib, shakespeare, stackoverflow)

TASKS = ('embedded_mnist', 'emnist', 'emnist_digits', 'stackoverflow_nwp',
         'stackoverflow_tag', 'shakespeare')
DEFAULT_TASK = 'embedded_mnist'


def load_federated_data(
    task: str = DEFAULT_TASK, data_dir: str | os.PathLike[str] | None = None,
    *, sequence_length: int = 20, vocab_size: int = 10000,
    allow_download: bool = False,
    cache_dir: str | os.PathLike[str] | None = None, num_clients: int = 50,
    alpha: float = 0.5, seed: int = 0, test_fraction: float = 0.2,
    tag_word_vocab_size: int = 5000, tag_vocab_size: int = 1000,
    vocab_ranking: str = 'occurrences',
) -> tuple[fedjax.FederatedData, fedjax.FederatedData, info_lib.DatasetInfo]:
  """Loads a task's federated train and test data.

  Batches are dicts of numpy arrays, as in the module's table. Files are
  searched as in :mod:`fedlite_jax.datasets.locate`; 'embedded_mnist' needs
  none (SYNTHETIC partition). Arguments that do not apply to ``task`` are
  ignored.

  Args:
    task: one of TASKS.
    data_dir: explicit data directory, the only one searched when given.
    sequence_length: L for 'stackoverflow_nwp' and 'shakespeare'.
    vocab_size: word vocabulary slots for 'stackoverflow_nwp' / 'shakespeare'.
    allow_download: permit FedJAX downloads when no local files are found.
    cache_dir: cache for converted files and vocabularies (default
      $FEDLITE_CACHE_DIR or ~/.cache/fedlite_jax).
    num_clients: 'embedded_mnist' clients.
    alpha: 'embedded_mnist' Dirichlet concentration.
    seed: 'embedded_mnist' partition / split seed.
    test_fraction: 'embedded_mnist' per-client test fraction.
    tag_word_vocab_size: 'stackoverflow_tag' input size (top words).
    tag_vocab_size: 'stackoverflow_tag' output size (top tags).
    vocab_ranking: 'occurrences' or 'clients', for word / tag vocabularies.

  Returns:
    (train, test, info); see :class:`~fedlite_jax.datasets.info.DatasetInfo`.

  Raises:
    ValueError: unknown task (the message lists TASKS) or a bad argument.
    DatasetNotFoundError (a FileNotFoundError): no files found; the message
      names the expected files and the searched directories.
    DatasetFormatError (a ValueError): a file is corrupt, truncated, or not
      in its promised format or schema (one line naming the file).
  """
  if task == 'embedded_mnist':
    kwargs = dict(num_clients=num_clients, alpha=alpha, seed=seed,
                  test_fraction=test_fraction)
    train, test = embedded_mnist.load_embedded_mnist(**kwargs)
    return train, test, embedded_mnist.dataset_info(**kwargs)
  files = dict(allow_download=allow_download, cache_dir=cache_dir)
  words = dict(sequence_length=sequence_length, vocab_size=vocab_size,
               vocab_ranking=vocab_ranking, **files)
  if task in ('emnist', 'emnist_digits'):
    return emnist.load_data(only_digits=task == 'emnist_digits',
                            data_dir=data_dir, **files)
  if task == 'stackoverflow_nwp':
    return stackoverflow.load_word_prediction(data_dir, **words)
  if task == 'stackoverflow_tag':
    return stackoverflow.load_tag_prediction(
        data_dir, word_vocab_size=tag_word_vocab_size,
        tag_vocab_size=tag_vocab_size, vocab_ranking=vocab_ranking, **files)
  if task == 'shakespeare':
    return shakespeare.load_word_data(data_dir, **words)
  raise ValueError(f'Unknown task {task!r}; allowed tasks: {", ".join(TASKS)}.')
