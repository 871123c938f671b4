"""Synthetic client partitions of a centralized dataset.

Source: Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification" (2019, arXiv:1909.06335),
per-class form (Yurochkin et al. 2019; Li et al., NIID-Bench 2021): each
class's examples are split by ``p_c ~ Dir_K(alpha)`` over the K clients.
"""

from __future__ import annotations

import numbers
from typing import Mapping, Sequence

import fedjax
import numpy as np

from fedlite_jax.checks import check_int


def dirichlet_label_skew(labels: np.ndarray, num_clients: int, alpha: float,
                         seed: int,
                         min_examples_per_client: int = 1) -> list[np.ndarray]:
  """Splits example indices across clients with Dirichlet label skew.

  Deterministic given ``seed`` (``np.random.default_rng(seed)``): per class,
  in label order, shuffle its n_c indices, draw ``p ~ Dir(alpha * 1_K)`` and
  give client k the next ``floor(cumsum(p)[k] n_c) - floor(cumsum(p)[k-1]
  n_c)``. Then, while a client has fewer than ``min_examples_per_client``,
  the lowest-numbered such client takes the last-assigned index of the
  largest client (ties: lowest-numbered); no re-sampling, so it terminates.

  Args:
    labels: int array [N] of class labels (any integer values).
    num_clients: K, 1..N.
    alpha: Dirichlet concentration, finite and > 0.
    seed: integer >= 0.
    min_examples_per_client: >= 0 (default 1: no empty clients).

  Returns:
    K sorted int64 index arrays into ``labels``, together ``range(N)`` once.

  Raises:
    NotAnIntegerError (a ValueError): an integer argument is not an integer.
    ValueError: any other bad argument, e.g. ``num_clients *
      min_examples_per_client`` > N; each message names the bad value.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1 or labels.dtype.kind not in 'iu':
    raise ValueError('labels must be a 1-D integer array, got shape '
                     f'{labels.shape} and dtype {labels.dtype}.')
  num_examples = labels.shape[0]
  num_clients = check_int(num_clients, 'num_clients', 1)
  if num_clients > num_examples:
    raise ValueError(f'num_clients={num_clients} is greater than the number '
                     f'of examples ({num_examples}).')
  if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or
      not np.isfinite(alpha) or alpha <= 0):
    raise ValueError(f'alpha must be a finite number > 0, got {alpha!r}.')
  seed = check_int(seed, 'seed', 0)
  min_examples = check_int(min_examples_per_client, 'min_examples_per_client',
                           0)
  if num_clients * min_examples > num_examples:
    raise ValueError(
        f'min_examples_per_client={min_examples} is impossible: '
        f'{num_clients} clients x {min_examples} > {num_examples} examples.')

  rng = np.random.default_rng(seed)
  parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
  for c in np.unique(labels):
    idx = rng.permutation(np.flatnonzero(labels == c))
    p = rng.dirichlet(np.full(num_clients, float(alpha)))
    # floor(cumsum * n) is monotone, ends at n (p sums to 1 up to rounding,
    # so the last cut is pinned to n) and so splits idx exactly.
    cuts = np.floor(np.cumsum(p) * len(idx)).astype(np.int64)
    cuts = np.clip(cuts, 0, len(idx))
    cuts[-1] = len(idx)
    for k, chunk in enumerate(np.split(idx, cuts[:-1])):
      parts[k].append(chunk)
  clients = [list(np.concatenate(p)) if p else [] for p in parts]

  sizes = np.array([len(c) for c in clients])
  while sizes.min() < min_examples:
    needy = int(np.flatnonzero(sizes < min_examples)[0])
    donor = int(np.argmax(sizes))  # First maximum: lowest index on ties.
    clients[needy].append(clients[donor].pop())
    sizes[needy] += 1
    sizes[donor] -= 1
  return [np.sort(np.asarray(c, dtype=np.int64)) for c in clients]


def client_ids(num_clients: int, prefix: str = 'client_') -> list[bytes]:
  """Zero-padded bytes ids sorting in numeric order (FedJAX iterates sorted).

  E.g. ``client_ids(12)`` -> [b'client_00', ..., b'client_11'].
  """
  width = len(str(max(num_clients - 1, 0)))
  return [f'{prefix}{k:0{width}d}'.encode() for k in range(num_clients)]


def partition_to_federated_data(
    examples: Mapping[str, np.ndarray],
    partition: Sequence[np.ndarray],
    ids: Sequence[bytes] | None = None) -> fedjax.InMemoryFederatedData:
  """``fedjax.InMemoryFederatedData``: client k gets ``v[partition[k]]`` of
  each ``examples`` array v [N, ...]; ids default to :func:`client_ids`.

  Raises:
    ValueError: features disagree on N, no clients, ids of the wrong length
      or repeated, or an index out of range.
  """
  sizes = {k: np.shape(v)[0] for k, v in examples.items()}
  if len(set(sizes.values())) != 1:
    raise ValueError(f'Features disagree on the number of examples: {sizes}.')
  num_examples = next(iter(sizes.values()))
  if not partition:
    raise ValueError('partition has no clients.')
  ids = list(client_ids(len(partition)) if ids is None else ids)
  if len(ids) != len(partition) or len(set(ids)) != len(ids):
    raise ValueError(f'Need {len(partition)} distinct client ids, got '
                     f'{len(ids)} ({len(set(ids))} distinct).')
  data = {}
  for client_id, idx in zip(ids, partition):
    idx = np.asarray(idx, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= num_examples):
      raise ValueError(f'Client {client_id!r} has indices outside '
                       f'[0, {num_examples}).')
    data[client_id] = {k: np.asarray(v)[idx] for k, v in examples.items()}
  return fedjax.InMemoryFederatedData(data)
