"""Chunk planning of the vmap engines, and the engines' step counts.

Counts go to the open :func:`recording_stats`; notes: docs/notes/rounds.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from fedlite_jax.common import PyTree


def bucket_steps(num_steps: int, policy: str | int) -> int:
  """The padded step count of a chunk whose longest client has ``num_steps``.

  Args:
    num_steps: the most local steps of any client of the chunk.
    policy: 'grid' (smallest value >= ``num_steps`` of 1, 2, 3, 4, 5, 6, 7,
      8, 10, 12, 14, 16, 20, ...: four per octave, at most 1.25x), 'pow2'
      (next power of two), 'exact' or an int fixed budget.

  Raises:
    ValueError: an unknown policy, or ``num_steps`` above an int budget.
  """
  num_steps = int(num_steps)
  if isinstance(policy, int):
    if num_steps > policy:
      raise ValueError(
          f'A client has {num_steps} local steps, more than the fixed step '
          f'budget {policy}; raise the budget or cap the client data.')
    return policy
  if policy == 'grid':
    if num_steps <= 4:
      return max(1, num_steps)
    unit = 1 << ((num_steps - 1).bit_length() - 3)
    return -(-num_steps // unit) * unit
  if policy == 'pow2':
    return 1 << max(0, (num_steps - 1).bit_length())
  if policy == 'exact':
    return num_steps
  raise ValueError(f"step_bucket must be 'grid', 'pow2', 'exact' or an int; "
                   f'got {policy!r}.')


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One compiled-program run of a round: some clients side by side.

  Attributes:
    members: cohort positions of the chunk's clients, in lane order.
    lanes: client rows (>= ``len(members)``; the rest are padding clients).
    steps: local steps (>= every member's step count).
  """
  members: tuple[int, ...]
  lanes: int
  steps: int


def executed_steps(chunks: Sequence[Chunk]) -> int:
  """Steps the chunks execute, masked ones included: ``sum lanes * steps``."""
  return sum(c.lanes * c.steps for c in chunks)


def _lane_sizes(max_lanes: int, multiple: int) -> np.ndarray:
  """Allowed lane counts: ``multiple * 2^k`` below ``max_lanes``, and it."""
  sizes, v = {max_lanes}, multiple
  while v < max_lanes:
    sizes.add(v)
    v *= 2
  return np.asarray(sorted(sizes))


#: :func:`plan_chunks` keeps executed steps within this factor of the useful
#: ones when it can.
TARGET_PADDING = 1.25


def plan_chunks(step_counts: Sequence[int], clients_per_chunk: Optional[int],
                step_bucket: str | int = 'grid', lane_multiple: int = 1,
                chunk_cost: Optional[float] = None) -> list[Chunk]:
  """Groups a cohort into chunks of similar local step counts.

  Clients sorted by step count are cut into contiguous chunks minimising
  ``sum(lanes * steps) + chunk_cost * chunks``; without ``chunk_cost``, at
  the highest price ``max_lanes / 4^k`` whose plan stays within
  :data:`TARGET_PADDING` times the useful steps.

  Args:
    step_counts: ``[n]`` local steps of each client (>= 0).
    clients_per_chunk: most clients per chunk per device (0/None: no limit).
    step_bucket: :func:`bucket_steps` policy.
    lane_multiple: lanes are a multiple of this (the device count).
    chunk_cost: the price of one more chunk in lane-steps (>= 0).

  Returns:
    Chunks covering every client once, in ascending step order.

  Raises:
    ValueError: negative step counts or sizes.
  """
  counts = np.asarray([int(c) for c in step_counts], np.int64)
  if np.any(counts < 0):
    raise ValueError(f'step counts must be >= 0; got {counts.min()}.')
  if clients_per_chunk is not None and clients_per_chunk < 0:
    raise ValueError(f'clients_per_chunk must be >= 0 (0: no limit); got '
                     f'{clients_per_chunk}.')
  if lane_multiple < 1:
    raise ValueError(f'lane_multiple must be >= 1; got {lane_multiple}.')
  n = len(counts)
  if n == 0:
    return []
  needed = -(-n // lane_multiple) * lane_multiple
  max_lanes = needed if not clients_per_chunk else min(
      clients_per_chunk * lane_multiple, needed)
  sizes = _lane_sizes(max_lanes, lane_multiple)
  # lanes_for[m]: the smallest allowed lane count holding m clients.
  lanes_for = sizes[np.searchsorted(sizes, np.arange(max_lanes + 1))]
  order = np.argsort(counts, kind='stable')
  steps = np.asarray([bucket_steps(max(int(c), 1), step_bucket)
                      for c in counts[order]], np.int64)

  def solve(price: float) -> list[Chunk]:
    best = np.zeros(n + 1, np.float64)
    cut = np.zeros(n + 1, np.int64)
    for j in range(1, n + 1):
      i = np.arange(max(0, j - max_lanes), j)
      cost = best[i] + lanes_for[j - i] * steps[j - 1] + price
      k = int(np.argmin(cost))  # Ties: the largest chunk (smallest i).
      best[j], cut[j] = cost[k], i[k]
    chunks, j = [], n
    while j > 0:
      i = int(cut[j])
      chunks.append(Chunk(tuple(int(x) for x in order[i:j]),
                          int(lanes_for[j - i]), int(steps[j - 1])))
      j = i
    return chunks[::-1]

  if chunk_cost is not None:
    if not chunk_cost >= 0:
      raise ValueError(f'chunk_cost must be >= 0; got {chunk_cost}.')
    return solve(float(chunk_cost))
  useful = max(int(counts.sum()), 1)
  price = float(max_lanes)
  while price >= 1:
    chunks = solve(price)
    if executed_steps(chunks) <= TARGET_PADDING * useful:
      return chunks
    price /= 4
  return solve(0.0)


def plan_round(step_counts: Sequence[int], clients_per_chunk: Optional[int],
               step_bucket: str | int = 'grid',
               mesh: Any = None) -> list[list[Chunk]]:
  """Per chunk, one :class:`Chunk` of each process's clients.

  One process: :func:`plan_chunks`. Several: chunk ``k`` is the ``k``-th
  block of every process's clients sorted by step count.

  Args:
    step_counts, clients_per_chunk, step_bucket: as :func:`plan_chunks`.
    mesh: the :class:`~fedlite_jax.rounds.sharding.ClientMesh`, or None.
  """
  steps, per = step_counts, clients_per_chunk
  if mesh is None or not mesh.multi_process:
    devices = 1 if mesh is None else mesh.num_devices
    return [[c] for c in plan_chunks(steps, per, step_bucket, devices)]
  local_devices = mesh.num_devices // mesh.num_processes
  blocks = []
  for p in range(mesh.num_processes):
    lo, hi = mesh.local_clients(len(steps), p)
    blocks.append(sorted(range(lo, hi), key=lambda i: (steps[i], i)))
  size = max(len(b) for b in blocks)
  lanes = (-(-size // local_devices) if not per else
           min(per, -(-size // local_devices))) * local_devices
  out = []
  for start in range(0, size, lanes):
    members = [tuple(b[start:start + lanes]) for b in blocks]
    longest = max(steps[i] for m in members for i in m)
    n = bucket_steps(max(longest, 1), step_bucket)
    out.append([Chunk(m, lanes, n) for m in members])
  return out


#: ``clients_per_chunk='auto'``: a lane is budgeted this many copies of the
#: parameters (optimizer state, gradients, delta, carries) plus
#: :data:`AUTO_LANE_EXTRA_BYTES` within :data:`AUTO_MEMORY_FRACTION` of the
#: device's memory, at most :data:`AUTO_MAX_CLIENTS_PER_CHUNK` clients.
AUTO_PARAM_COPIES = 16
AUTO_LANE_EXTRA_BYTES = 64 * 2**20
AUTO_MEMORY_FRACTION = 0.5
AUTO_MAX_CLIENTS_PER_CHUNK = 256


def device_memory_bytes(device: Optional[jax.Device] = None) -> int:
  """Bytes of ``device``: its allocator limit, or the host's total memory."""
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends without stats.
    stats = None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit'])
  return int(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))


def resolve_clients_per_chunk(value: int | str | None, param_bytes: int,
                              memory_bytes: Optional[int] = None) -> int:
  """Clients per chunk (per device) for ``value``; 0 means no limit.

  Args:
    value: an int > 0, 0 or None (no limit), or 'auto': ``floor(
      AUTO_MEMORY_FRACTION * memory / (AUTO_PARAM_COPIES * param_bytes +
      AUTO_LANE_EXTRA_BYTES))`` in [1, AUTO_MAX_CLIENTS_PER_CHUNK].
    param_bytes: bytes of one copy of the model parameters.
    memory_bytes: the device's memory (default :func:`device_memory_bytes`).

  Raises:
    ValueError: a negative int or another string.
  """
  if value is None:
    return 0
  if isinstance(value, str):
    if value != 'auto':
      raise ValueError(f"clients_per_chunk must be an int >= 0 or 'auto'; got "
                       f'{value!r}.')
    memory = device_memory_bytes() if memory_bytes is None else memory_bytes
    lane = AUTO_PARAM_COPIES * max(int(param_bytes), 1) + AUTO_LANE_EXTRA_BYTES
    return int(min(max(AUTO_MEMORY_FRACTION * memory // lane, 1),
                   AUTO_MAX_CLIENTS_PER_CHUNK))
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
      value < 0:
    raise ValueError(f"clients_per_chunk must be an int >= 0 or 'auto'; got "
                     f'{value!r}.')
  return int(value)


def tree_bytes(tree: PyTree) -> int:
  """Bytes of the arrays of ``tree``."""
  return sum(int(np.prod(np.shape(x))) * np.dtype(jnp.result_type(x)).itemsize
             for x in jax.tree.leaves(tree))


class StatsRecorder:
  """Engine counts while a :func:`recording_stats` context is open.

  ``clients``, ``client_steps`` (useful), ``padded_steps`` (executed),
  ``chunks``; the last engine's ``name`` and ``clients_per_chunk``.
  """

  _KEYS = ('clients', 'client_steps', 'padded_steps', 'chunks')

  def __init__(self):
    self._counts = dict.fromkeys(self._KEYS, 0)
    self._totals = dict.fromkeys(self._KEYS, 0)
    self.name: Optional[str] = None
    self.clients_per_chunk: Optional[int] = None

  def add(self, name: str, clients_per_chunk: int, **counts: int) -> None:
    self.name, self.clients_per_chunk = name, int(clients_per_chunk)
    for k, v in counts.items():
      self._counts[k] += int(v)
      self._totals[k] += int(v)

  def _view(self, counts: dict[str, int]) -> dict[str, Any]:
    return {'name': self.name, 'clients_per_chunk': self.clients_per_chunk,
            **counts}

  def take(self) -> dict[str, Any]:
    """The counts since the last ``take`` (then reset)."""
    out = self._view(dict(self._counts))
    self._counts = dict.fromkeys(self._KEYS, 0)
    return out

  def totals(self) -> dict[str, Any]:
    """The counts since the recorder was opened."""
    return self._view(dict(self._totals))


_RECORDERS: list[StatsRecorder] = []


@contextlib.contextmanager
def recording_stats() -> Iterator[StatsRecorder]:
  """Collects the counts of every engine call made inside the context."""
  recorder = StatsRecorder()
  _RECORDERS.append(recorder)
  try:
    yield recorder
  finally:
    _RECORDERS.remove(recorder)


def record(name: str, clients_per_chunk: int, **counts: int) -> None:
  """Adds one run's counts (:class:`StatsRecorder`) to the open recorders."""
  for recorder in _RECORDERS:
    recorder.add(name, clients_per_chunk, **counts)
