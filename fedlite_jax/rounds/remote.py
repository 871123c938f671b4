"""Stand-ins for clients whose data another process loads (multi-host runs).

They know their size (from the data's metadata), so weights, step counts and
the ledger agree on every process, but their examples are never read.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import fedjax


def num_shuffle_repeat_batches(num_examples: int,
                               hparams: fedjax.ShuffleRepeatBatchHParams
                               ) -> int:
  """Batches ``ClientDataset.shuffle_repeat_batch(hparams)`` yields.

  FedJAX 0.0.17's rule: ``ceil(n * epochs / B)`` (``floor`` with
  ``drop_remainder``), capped at ``num_steps``.

  Raises:
    ValueError: both ``num_epochs`` and ``num_steps`` are None (infinite).
  """
  epochs, steps = hparams.num_epochs, hparams.num_steps
  if epochs is None and steps is None:
    raise ValueError('shuffle_repeat_batch with num_epochs=None and '
                     'num_steps=None never ends; set one of them.')
  if epochs is None:
    return steps
  total = num_examples * epochs
  count = (total // hparams.batch_size if hparams.drop_remainder else
           math.ceil(total / hparams.batch_size))
  return count if steps is None else min(count, steps)


class RemoteBatches(Sequence[Any]):
  """The batches of a client that another process runs: a length only.

  Raises:
    RuntimeError: on any access to a batch.
  """

  def __init__(self, num_batches: int, client_id: Any, owner: Optional[int]):
    self._n = num_batches
    self._client_id = client_id
    self._owner = owner

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, index):
    raise RuntimeError(
        f'Batches of client {self._client_id!r} live on process '
        f'{self._owner}; this process never loads them. Only the round engine '
        'may touch local clients\' batches.')


class RemoteClientDataset:
  """A ``fedjax.ClientDataset`` stand-in: size known, examples elsewhere.

  Args:
    client_id: the client's id.
    num_examples: its number of examples (>= 0).
    owner: the process that loads it (for error messages).
  """

  def __init__(self, client_id: Any, num_examples: int,
               owner: Optional[int] = None):
    self.client_id = client_id
    self._n = int(num_examples)
    self.owner = owner

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, index) -> 'RemoteClientDataset':
    if not isinstance(index, slice):
      raise RuntimeError(f'Examples of client {self.client_id!r} live on '
                         f'process {self.owner}.')
    return RemoteClientDataset(self.client_id,
                               len(range(self._n)[index]), self.owner)

  def shuffle_repeat_batch(self, hparams: fedjax.ShuffleRepeatBatchHParams,
                           **unused) -> RemoteBatches:
    """The batch count FedJAX's ``shuffle_repeat_batch`` would give."""
    return RemoteBatches(num_shuffle_repeat_batches(self._n, hparams),
                         self.client_id, self.owner)

  def padded_batch(self, hparams: fedjax.PaddedBatchHParams,
                   **unused) -> RemoteBatches:
    """``ceil(n / batch_size)`` batches, as FedJAX's ``padded_batch``."""
    return RemoteBatches(math.ceil(self._n / hparams.batch_size),
                         self.client_id, self.owner)


class PartitionedFederatedData:
  """Federated data whose ``get_clients(cohort)`` loads only local clients.

  Positions that ``is_local(position, cohort_size)`` rejects come back as
  :class:`RemoteClientDataset` of ``owner(position, cohort_size)``; other
  attributes are the wrapped object's.
  """

  def __init__(self, federated_data: Any, is_local, owner):
    self._fd = federated_data
    self._is_local = is_local
    self._owner = owner
    self._sizes = dict(federated_data.client_sizes())

  def __getattr__(self, name):
    return getattr(self._fd, name)

  def get_clients(self, client_ids):
    """``(client_id, dataset)`` in the order asked: this process's clients
    loaded, the others as :class:`RemoteClientDataset` stand-ins."""
    client_ids = list(client_ids)
    n = len(client_ids)
    local = [cid for i, cid in enumerate(client_ids) if self._is_local(i, n)]
    loaded = dict(self._fd.get_clients(local)) if local else {}
    for i, cid in enumerate(client_ids):
      if self._is_local(i, n):
        yield cid, loaded[cid]
      else:
        yield cid, RemoteClientDataset(cid, self._sizes[cid],
                                       self._owner(i, n))
