"""Training clients' examples kept on the devices; batches sent as row indices.

The lane engine (:class:`~fedlite_jax.rounds.streaming.LaneStreams`) reads a
round's batches from the host, stacks them per segment and sends them to
the devices. With a :class:`RowTable` the clients' preprocessed examples
are sent once per run, and a segment sends only the rows' indices
(``int32[lanes, S, batch_size]``): each lane-step gathers its batch on the
device. The batches are the same rows in the same order (FedJAX's
``shuffle_repeat_batch``); the host's per-round work is the shuffles.

Why: on one H200 a 100-client FEMNIST round (~120 ms) spent ~40 ms
cutting batches on the host, 15.7 ms stacking them and 6.9 ms sending
them, against ~40 ms of kernels. On the 2-core CPU machine a round's lane
inputs take 1.6-2.1x less host time this way
(``benchmarks/bench_round_inputs.py``); on a GPU it is unmeasured.
Notes: docs/notes/rounds.md.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import fedjax
import jax
import numpy as np

from fedlite_jax.common import PyTree

ClientId = bytes

#: ``--data_on_device`` settings: ``'auto'`` (on for the vmap engine on
#: GPU/TPU when the table fits :data:`AUTO_MEMORY_FRACTION` of a device's
#: memory, on one process), ``'on'``, ``'off'``.
SETTINGS = ('auto', 'on', 'off')

#: ``'auto'``: the largest share of one device's memory the table may take
#: (it is replicated on every device).
AUTO_MEMORY_FRACTION = 1 / 8


class RowTable:
  """The preprocessed examples of a set of clients, one array per feature,
  clients one after another (FedJAX's ``ClientDataset.all_examples()``).

  The preprocessor must map each row on its own (FedJAX's EMNIST,
  Shakespeare and StackOverflow preprocessors do): the table's rows are
  those of a batch preprocessed alone.

  Args:
    clients: ``(client_id, fedjax.ClientDataset)`` pairs, ids distinct.

  Attributes:
    host: ``{feature: array [rows, ...]}`` (NumPy).
    nbytes: bytes of ``host`` (one device holds as many).

  Raises:
    ValueError: no clients, a repeated id, a preprocessor that changes the
      number of rows, or clients whose features differ in names, shapes
      past the rows or dtypes.
  """

  def __init__(self, clients: Iterable[tuple[ClientId, Any]]):
    parts: dict[str, list[np.ndarray]] = {}
    self._offsets: dict[ClientId, tuple[int, int]] = {}
    rows = 0
    for cid, cds in clients:
      if cid in self._offsets:
        raise ValueError(f'Client {cid!r} appears twice in the row table.')
      examples = cds.all_examples()
      n = len(cds)
      got = {k: len(v) for k, v in examples.items()}
      if any(m != n for m in got.values()):
        raise ValueError(
            f'Client {cid!r}: its preprocessor maps {n} rows to {got}; a '
            'row table needs one row out per row in (send such batches '
            'from the host).')
      if parts and set(examples) != set(parts):
        raise ValueError(f'Client {cid!r} has features {sorted(examples)}, '
                         f'the table has {sorted(parts)}.')
      for k, v in examples.items():
        v = np.asarray(v)
        if k in parts and (v.dtype, v.shape[1:]) != (
            parts[k][0].dtype, parts[k][0].shape[1:]):
          raise ValueError(
              f'Client {cid!r}: feature {k!r} is {v.dtype}{list(v.shape[1:])}'
              f' per row, the table\'s {parts[k][0].dtype}'
              f'{list(parts[k][0].shape[1:])}.')
        parts.setdefault(k, []).append(v)
      self._offsets[cid] = (rows, n)
      rows += n
    if not self._offsets:
      raise ValueError('A row table needs at least one client; got none.')
    self.host = {k: np.concatenate(v) for k, v in parts.items()}
    self.nbytes = sum(v.nbytes for v in self.host.values())
    self._device: dict[Any, PyTree] = {}

  def __len__(self) -> int:
    """Rows in the table (all clients' examples)."""
    return next(iter(self.host.values())).shape[0]

  def __contains__(self, client_id: ClientId) -> bool:
    return client_id in self._offsets

  def dataset(self, client_id: ClientId, cds: Any) -> 'TableClientDataset':
    """``cds`` (the client's data, or its first rows: FedJAX's ``cds[:n]``)
    as a :class:`TableClientDataset` whose batches are rows of this table.

    Raises:
      KeyError: a client not in the table.
      ValueError: ``cds`` has more rows than the table holds for it.
    """
    if client_id not in self._offsets:
      raise KeyError(f'Client {client_id!r} is not in the row table.')
    start, n = self._offsets[client_id]
    if len(cds) > n:
      raise ValueError(f'Client {client_id!r} has {len(cds)} examples; the '
                       f'row table holds {n} for it.')
    return TableClientDataset(cds, self, start)

  def on_devices(self, sharding: jax.sharding.Sharding) -> PyTree:
    """``host`` placed with ``sharding`` (sent once per sharding)."""
    if sharding not in self._device:
      self._device[sharding] = jax.device_put(self.host, sharding)
    return self._device[sharding]


class TableClientDataset(fedjax.ClientDataset):
  """A ``fedjax.ClientDataset`` whose rows are also rows ``start ..`` of a
  :class:`RowTable` (it behaves as the dataset it wraps; slices are plain
  ``ClientDataset`` objects). ``batching.client_batches`` gives its
  batches as table rows.

  Attributes:
    row_table: the table; row_start: its first row in the table.
  """

  def __init__(self, cds: Any, table: RowTable, start: int):
    super().__init__(cds.raw_examples, cds.preprocessor)
    self.row_table = table
    self.row_start = int(start)


def table_memory_ok(nbytes: int, device: Optional[jax.Device] = None
                    ) -> tuple[bool, str]:
  """``(fits, why)``: whether a table of ``nbytes`` fits ``'auto'``'s share
  of ``device``'s memory (default: the first local device); a device that
  reports no memory (CPU) does not fit."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  limit = (stats or {}).get('bytes_limit')
  if not limit:
    return False, f'{device.platform} reports no device memory'
  budget = int(limit * AUTO_MEMORY_FRACTION)
  if nbytes > budget:
    return False, (f'the table needs {nbytes / 2**20:.0f} MiB, over '
                   f'{budget / 2**20:.0f} MiB ({AUTO_MEMORY_FRACTION:g} of '
                   'the device)')
  return True, f'{nbytes / 2**20:.0f} MiB of {budget / 2**20:.0f} MiB'
