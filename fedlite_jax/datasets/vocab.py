"""Token counts of a training split, and vocabularies taken from them.

A vocabulary is the top tokens of the TRAINING split by occurrences or by
clients using them (TFF's ``stackoverflow.load_word_counts`` ranking), ties
by bytes ascending; counts are cached as msgpack.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Sequence

from absl import logging
import fedjax
import msgpack
import numpy as np

from fedlite_jax.datasets import cache

_FORMAT = 'fedlite_jax.token_counts'
_VERSION = 1
RANKINGS = ('occurrences', 'clients')


def check_ranking(by: str) -> None:
  """Raises ValueError unless ``by`` is one of RANKINGS."""
  if by not in RANKINGS:
    raise ValueError(f'vocab_ranking must be one of {RANKINGS}, got {by!r}.')


def check_options(vocab_ranking: str, **sizes: int) -> None:
  """Raises ValueError unless all ``sizes`` (name=value) are >= 1 and
  ``vocab_ranking`` is one of RANKINGS."""
  if min(sizes.values()) < 1:
    raise ValueError(f'{" and ".join(sizes)} must be >= 1, got '
                     f'{", ".join(str(v) for v in sizes.values())}.')
  check_ranking(vocab_ranking)


@dataclasses.dataclass(frozen=True)
class TokenCounts:
  """Token counts over one split.

  Attributes:
    tokens: every distinct token, sorted by (-occurrences, token bytes).
    occurrences: int64 [len(tokens)], total occurrences.
    clients: int64 [len(tokens)], number of clients using the token.
    num_clients: clients counted.
    num_examples: examples counted.
  """
  tokens: tuple[bytes, ...]
  occurrences: np.ndarray
  clients: np.ndarray
  num_clients: int
  num_examples: int

  def top(self, k: int, by: str = 'occurrences') -> list[bytes]:
    """The ``k`` >= 1 highest-ranked tokens ``by`` one of RANKINGS.

    Raises:
      ValueError: k < 1 or an unknown ranking.
    """
    if k < 1:
      raise ValueError(f'k must be >= 1, got {k}.')
    check_ranking(by)
    if by == 'occurrences':
      return list(self.tokens[:k])
    order = sorted(range(len(self.tokens)),
                   key=lambda i: (-int(self.clients[i]), self.tokens[i]))
    return [self.tokens[i] for i in order[:k]]


def count_tokens(fd: fedjax.FederatedData, feature: str,
                 sep: bytes | None) -> TokenCounts:
  """Counts the tokens of bytes ``feature`` over every client of ``fd``.

  Client preprocessing is applied, batch preprocessing is not. ``sep``: as
  ``bytes.split`` (= ``tf.strings.split``; None: runs of whitespace).
  Raises KeyError if a client lacks ``feature``.
  """
  occurrences = collections.Counter()
  clients = collections.Counter()
  num_clients = num_examples = 0
  start = last_log = time.monotonic()
  for _, dataset in fd.clients():
    values = dataset.raw_examples[feature]
    tokens = []
    for v in values:
      tokens.extend(v.split(sep))
    occurrences.update(tokens)
    clients.update(set(tokens))
    num_clients += 1
    num_examples += len(values)
    if time.monotonic() - last_log > 60:
      last_log = time.monotonic()
      logging.info('fedlite_jax.datasets: counted %s of %d clients, %d '
                   'examples (%.0f s)', feature, num_clients, num_examples,
                   last_log - start)
  ranked = sorted(occurrences.items(), key=lambda kv: (-kv[1], kv[0]))
  tokens = tuple(t for t, _ in ranked)
  return TokenCounts(
      tokens=tokens,
      occurrences=np.array([c for _, c in ranked], dtype=np.int64),
      clients=np.array([clients[t] for t in tokens], dtype=np.int64),
      num_clients=num_clients,
      num_examples=num_examples)


def save(counts: TokenCounts, path: str) -> None:
  """Writes counts as msgpack, atomically."""
  payload = dict(format=_FORMAT, version=_VERSION, tokens=list(counts.tokens),
                 occurrences=counts.occurrences.tolist(),
                 clients=counts.clients.tolist(),
                 num_clients=counts.num_clients,
                 num_examples=counts.num_examples)
  tmp = cache.atomic_path(path)
  with open(tmp, 'wb') as f:
    f.write(msgpack.packb(payload, use_bin_type=True))
  os.replace(tmp, path)


def load(path: str) -> TokenCounts:
  """Reads counts written by :func:`save`.

  Raises:
    ValueError: not a token-counts file of this version.
  """
  with open(path, 'rb') as f:
    payload = msgpack.unpackb(f.read(), raw=False)
  if (not isinstance(payload, dict) or payload.get('format') != _FORMAT or
      payload.get('version') != _VERSION):
    raise ValueError(f'{path} is not a {_FORMAT} v{_VERSION} file.')
  return TokenCounts(
      tokens=tuple(payload['tokens']),
      occurrences=np.array(payload['occurrences'], dtype=np.int64),
      clients=np.array(payload['clients'], dtype=np.int64),
      num_clients=payload['num_clients'],
      num_examples=payload['num_examples'])


def cached_token_counts(fd: fedjax.FederatedData,
                        feature: str,
                        sep: bytes | None,
                        name: str,
                        source_paths: Sequence[str],
                        derivation: str,
                        cache_directory: str | os.PathLike[str] | None = None
                        ) -> tuple[TokenCounts, str]:
  """:func:`count_tokens`, cached on disk; returns (counts, cache file path).

  Args:
    fd, feature, sep: as for :func:`count_tokens`.
    name: prefix of the cache file name, e.g. 'stackoverflow_train_tokens'.
    source_paths: the files ``fd`` reads (key the cache).
    derivation: how ``feature`` is made (part of the key).
    cache_directory: see :func:`cache.cache_dir`.
  """
  key = cache.fingerprint(list(source_paths), feature, repr(sep), derivation,
                          f'v{_VERSION}')
  path = os.path.join(cache.cache_dir(cache_directory),
                      f'{name}.{key}.counts.msgpack')
  if os.path.isfile(path):
    logging.info('fedlite_jax.datasets: reusing token counts %s', path)
    return load(path), path
  logging.info('fedlite_jax.datasets: counting %s over the training split '
               '(one-time); caching in %s', feature, path)
  counts = count_tokens(fd, feature, sep)
  save(counts, path)
  return counts, path
