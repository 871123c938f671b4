"""Host-side plan of a round on lanes that stream clients.

Each device runs ``lanes`` clients side by side; a lane runs its assigned
clients back to back. The plan says which client steps on which lane at each
step, and where clients end (``slots`` finalizations per device and step).
Notes: docs/notes/engines.md.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Optional, Sequence

import numpy as np

from fedlite_jax.checks import check_int


@dataclasses.dataclass(frozen=True)
class LanePlan:
  """Where and when every client of a round runs.

  Lanes are numbered globally, device ``d`` owning ``[d * lanes_per_device,
  (d + 1) * lanes_per_device)``; clients are cohort positions. ``T =
  steps`` is a multiple of ``segment_steps``.

  Attributes:
    lanes_per_device: lanes on each device.
    devices: devices (the lanes' and slots' leading groups).
    slots: finalizations (and starts) per device per step.
    segment_steps: steps per compiled segment.
    begin: ``int32[lanes]``: the client each lane starts the round with (-1:
      none, the lane idles).
    client: ``int32[T, lanes]``: the client stepping (-1: a masked step).
    batch: ``int32[T, lanes]``: that client's batch index (0 when masked).
    finalize: ``int32[T, devices, slots]``: the device-local lane whose
      client is finalized before step ``t`` (-1: an empty slot).
    finalize_client: ``int32[T, devices, slots]``: that client.
    start_client: ``int32[T, devices, slots]``: the client then started on
      the same lane (-1: none).
    finish: ``int32[lanes]``: the client finalized on each lane after the
      last step (-1: none).
  """
  lanes_per_device: int
  devices: int
  slots: int
  segment_steps: int
  begin: np.ndarray
  client: np.ndarray
  batch: np.ndarray
  finalize: np.ndarray
  finalize_client: np.ndarray
  start_client: np.ndarray
  finish: np.ndarray

  @property
  def lanes(self) -> int:
    """Lanes over all devices."""
    return self.lanes_per_device * self.devices

  @property
  def steps(self) -> int:
    """Rows of the plan's arrays: ``num_segments * segment_steps``."""
    return int(self.client.shape[0])

  @property
  def sequential_steps(self) -> int:
    """Steps run one after another: :attr:`last_step` (a segment runs
    only its planned steps)."""
    return self.last_step

  @property
  def last_step(self) -> int:
    """Steps up to the last unmasked one (``steps`` before rounding)."""
    active = np.flatnonzero(np.any(self.client >= 0, axis=1))
    return int(active[-1]) + 1 if len(active) else 0

  @property
  def num_segments(self) -> int:
    """Calls of the compiled segment program: ``steps / segment_steps``."""
    return self.steps // self.segment_steps

  @property
  def useful_steps(self) -> int:
    """Local steps of the clients (the steps that are not masked)."""
    return int(np.sum(self.client >= 0))

  @property
  def executed_steps(self) -> int:
    """Lane-steps executed, masked ones included: ``sequential_steps *
    lanes``."""
    return self.sequential_steps * self.lanes


def _assign(counts: np.ndarray, members: Sequence[int],
            lanes: Sequence[int]) -> dict[int, list[int]]:
  """Clients onto lanes: longest first onto the least-loaded lane (ties:
  lowest lane), then moves and swaps off the most-loaded lane while they
  lower it (``_improve``)."""
  queues = {lane: [] for lane in lanes}
  heap = [(0, lane) for lane in lanes]
  for i in sorted(members, key=lambda i: (-counts[i], i)):
    load, lane = heapq.heappop(heap)
    queues[lane].append(int(i))
    heapq.heappush(heap, (load + int(counts[i]), lane))
  _improve(counts, queues)
  for queue in queues.values():
    queue.sort(key=lambda i: (-counts[i], i))
  return queues


def _improve(counts: np.ndarray, queues: dict[int, list[int]],
             max_moves: int = 10_000) -> None:
  """Lowers the largest lane load by moves or pairwise swaps of clients
  (the one giving the lowest new load of the two lanes first)."""
  lanes = np.asarray(list(queues), np.int64)
  members = np.asarray([i for l in lanes for i in queues[int(l)]], np.int64)
  if len(lanes) < 2 or len(members) == 0:
    return
  lane_of = np.asarray([l for l in lanes for _ in queues[int(l)]], np.int64)
  size = counts[members]
  load = np.zeros(int(lanes.max()) + 1, np.int64)
  np.add.at(load, lane_of, size)
  for _ in range(max_moves):
    peak = load[lanes].max()
    top = int(lanes[np.argmax(load[lanes])])
    mine = np.flatnonzero(lane_of == top)
    others = np.flatnonzero(lane_of != top)
    other_lanes = lanes[lanes != top]
    # Moves: [mine, other lanes]; swaps: [mine, clients of other lanes].
    move_gain = np.broadcast_to(size[mine, None], (len(mine),
                                                   len(other_lanes)))
    move_peak = np.maximum(peak - move_gain,
                           load[other_lanes][None, :] + move_gain)
    swap_gain = size[mine, None] - size[others][None, :]
    swap_peak = np.maximum(peak - swap_gain,
                           load[lane_of[others]][None, :] + swap_gain)
    swap_peak = np.where(swap_gain > 0, swap_peak, peak)
    best_move = move_peak.min() if move_peak.size else peak
    best_swap = swap_peak.min() if swap_peak.size else peak
    if min(best_move, best_swap) >= peak:
      break
    if best_move <= best_swap:
      a, b = np.unravel_index(np.argmin(move_peak), move_peak.shape)
      i, dest, j = mine[a], int(other_lanes[b]), None
    else:
      a, b = np.unravel_index(np.argmin(swap_peak), swap_peak.shape)
      i, j = mine[a], others[b]
      dest = int(lane_of[j])
    gain = size[i] - (0 if j is None else size[j])
    lane_of[i] = dest
    if j is not None:
      lane_of[j] = top
    load[top] -= gain
    load[dest] += gain
  for l in lanes:
    queues[int(l)] = [int(members[k]) for k in np.flatnonzero(lane_of == l)]


def choose_slots(step_counts: Sequence[int], lanes_per_device: int,
                 segment_steps: int, devices: int = 1,
                 groups: Optional[Sequence[Sequence[int]]] = None) -> int:
  """The fewest finalization slots (1, 2, 4, ... or all lanes) that plan
  this cohort in as few steps as ``lanes_per_device`` slots do."""
  def steps(slots):
    return plan_lanes(step_counts, lanes_per_device, segment_steps, slots,
                      devices, groups).last_step

  target = steps(lanes_per_device)
  slots = 1
  while slots < lanes_per_device:
    if steps(slots) <= target:
      return slots
    slots *= 2
  return lanes_per_device


#: ``lanes_per_device='auto'`` takes the lanes of the least modeled device
#: time of the first cohort's plan, ``sequential steps x (step cost + lanes
#: per device)``: every lane-step (masked ones too) costs one unit and every
#: step this many more, on an accelerator (docs/notes/engines.md).
AUTO_STEP_COST_LANES = 4.0
#: The step cost on XLA:CPU, where a lane adds no parallel hardware.
AUTO_CPU_STEP_COST_LANES = 0.2


def choose_lanes(step_counts: Sequence[int], most: int, segment_steps: int,
                 devices: int = 1,
                 groups: Optional[Sequence[Sequence[int]]] = None,
                 step_cost: float = AUTO_STEP_COST_LANES) -> int:
  """Lanes per device for a cohort (<= ``most``): those whose plan (one
  slot per lane, the shortest plan) has the least modeled device time,
  ``plan.sequential_steps x (step_cost + lanes per device)``
  (:data:`AUTO_STEP_COST_LANES`); ties go to more lanes.

  Fewer lanes execute fewer masked lane-steps, more lanes fewer sequential
  steps; of lane counts that run the same steps the fewest win. Each
  candidate's time is bounded below by ``max(longest,
  ceil(useful / lanes))`` sequential steps (no plan is shorter); only
  candidates under the best time by that bound are planned.

  Raises:
    ValueError: as :func:`plan_lanes`, or ``step_cost < 0``.
  """
  counts = np.asarray([int(c) for c in step_counts], np.int64)
  most = check_int(most, 'most')
  if not step_cost >= 0:
    raise ValueError(f'step_cost must be >= 0, got {step_cost!r}.')
  useful, longest = int(counts.sum()), int(counts.max())
  best, best_time = most, np.inf
  for per in range(most, 0, -1):
    lanes = per * devices
    bound = max(longest, -(-useful // lanes))
    if bound * (step_cost + per) >= best_time:
      continue
    plan = plan_lanes(counts, per, segment_steps, per, devices, groups)
    time = plan.sequential_steps * (step_cost + per)
    if time < best_time:
      best, best_time = per, time
  return best


def _walk(counts: np.ndarray, queues: dict[int, list[int]], per: int,
          devices: int, slots: int) -> tuple[np.ndarray, np.ndarray, dict]:
  """Steps every lane through its queue: ``(begin, finish, rows)``, rows
  the per-step ``client``, ``batch``, ``finalize``, ``finalize_client``
  and ``start_client`` lists of :func:`plan_lanes`."""
  lanes = per * devices
  begin = np.full(lanes, -1, np.int32)
  current = np.full(lanes, -1, np.int64)   # client on the lane (or -1)
  done = np.zeros(lanes, np.int64)         # its steps taken
  left = np.zeros(lanes, np.int64)         # steps of the queued clients
  position = np.zeros(lanes, np.int64)     # next queue index
  for lane, queue in queues.items():
    if queue:
      begin[lane] = current[lane] = queue[0]
      position[lane] = 1
      left[lane] = int(sum(counts[i] for i in queue[1:]))
  rows = {k: [] for k in ('client', 'batch', 'finalize', 'finalize_client',
                          'start_client')}
  while True:
    fin, fin_client, start = (np.full((devices, slots), -1, np.int32)
                              for _ in range(3))
    running = current >= 0
    ended = running & (done == counts[np.maximum(current, 0)])
    waiting = ended & (left > 0)
    if not np.any(running & ~ended) and not np.any(waiting):
      break
    for d in range(devices):
      lo = d * per
      lanes_d = np.flatnonzero(waiting[lo:lo + per]) + lo
      # Lanes with the most work left finalize first (ties: lowest lane).
      lanes_d = sorted(lanes_d, key=lambda l: (-left[l], l))[:slots]
      for k, lane in enumerate(lanes_d):
        nxt = queues[lane][position[lane]]
        fin[d, k], fin_client[d, k], start[d, k] = lane - lo, current[lane], nxt
        current[lane], done[lane] = nxt, 0
        position[lane] += 1
        left[lane] -= counts[nxt]
    ended = current >= 0
    ended &= done == counts[np.maximum(current, 0)]
    step_client = np.where((current >= 0) & ~ended, current, -1)
    rows['client'].append(step_client.astype(np.int32))
    rows['batch'].append(np.where(step_client >= 0, done, 0).astype(np.int32))
    done += step_client >= 0
    rows['finalize'].append(fin)
    rows['finalize_client'].append(fin_client)
    rows['start_client'].append(start)
  finish = np.where(current >= 0, current, -1).astype(np.int32)
  return begin, finish, rows


def plan_lanes(step_counts: Sequence[int], lanes_per_device: int,
               segment_steps: int, slots: int, devices: int = 1,
               groups: Optional[Sequence[Sequence[int]]] = None
               ) -> LanePlan:
  """Plans a round: clients onto lanes, then every step of every lane.

  Clients go longest first onto the least-loaded lane. A lane whose client
  has taken its last step finalizes it before the next step and starts its
  next client there; at most ``slots`` lanes per device finalize at one
  step (the lanes with the most work left first), the others wait a masked
  step. A lane's last client is finalized after the last step.

  Args:
    step_counts: ``[n]`` local steps of each client (>= 1).
    lanes_per_device: lanes per device (>= 1).
    segment_steps: steps per compiled segment; the round's steps are
      rounded up to a multiple of it (>= 1).
    slots: finalizations per device per step (>= 1).
    devices: devices (>= 1).
    groups: clients of each process, which run on its own devices
      (``devices`` split evenly); None: one group of every client.

  Returns:
    A :class:`LanePlan`.

  Raises:
    ValueError: a count < 1, a bad size, or groups that do not cover every
      client once or do not split the devices evenly.
  """
  counts = np.asarray([int(c) for c in step_counts], np.int64)
  n = len(counts)
  if n == 0:
    raise ValueError('A round needs at least one client; got none.')
  if np.any(counts < 1):
    raise ValueError(f'Every client must take >= 1 local step; got '
                     f'{int(counts.min())}.')
  per = check_int(lanes_per_device, 'lanes_per_device')
  seg = check_int(segment_steps, 'segment_steps')
  slots = check_int(slots, 'slots')
  devices = check_int(devices, 'devices')
  groups = [list(range(n))] if groups is None else [list(g) for g in groups]
  if sorted(i for g in groups for i in g) != list(range(n)):
    raise ValueError('groups must hold every client position exactly once.')
  if devices % len(groups):
    raise ValueError(f'{devices} devices do not split evenly over '
                     f'{len(groups)} groups (processes).')
  lanes = per * devices
  share = lanes // len(groups)
  queues: dict[int, list[int]] = {}
  for p, members in enumerate(groups):
    queues.update(_assign(counts, members, range(p * share, (p + 1) * share)))
  begin, finish, rows = _walk(counts, queues, per, devices, slots)
  steps = len(rows['client'])
  total = -(-steps // seg) * seg

  def stack(rows, shape, fill=-1):
    out = np.full((total,) + shape, fill, np.int32)
    if rows:
      out[:steps] = np.stack(rows)
    return out

  return LanePlan(
      lanes_per_device=per, devices=devices, slots=slots, segment_steps=seg,
      begin=begin, client=stack(rows['client'], (lanes,)),
      batch=stack(rows['batch'], (lanes,), 0),
      finalize=stack(rows['finalize'], (devices, slots)),
      finalize_client=stack(rows['finalize_client'], (devices, slots)),
      start_client=stack(rows['start_client'], (devices, slots)),
      finish=finish)
