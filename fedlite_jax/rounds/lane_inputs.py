"""The host side of a round on lanes: each segment's inputs from the plan.

:class:`SegmentFeeder` cuts, stacks and sends a segment's batches and
finalization/start rows (:class:`~fedlite_jax.rounds.lane_programs.StepInputs`)
to the devices; segment ``k + 1``'s are made on a worker thread while
segment ``k`` runs, and batches made on first access (``make()``) are made
ahead on warm-up threads.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.common import PyTree
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import sharding
from fedlite_jax.rounds.lane_programs import StepInputs

_POOLS: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
  """A process-wide pool of ``workers`` threads named ``name``, made on
  first use and shared by every engine (no threads per engine)."""
  with _POOLS_LOCK:
    if (name, workers) not in _POOLS:
      _POOLS[name, workers] = concurrent.futures.ThreadPoolExecutor(
          max_workers=workers, thread_name_prefix=name)
    return _POOLS[name, workers]


def zeros_like(tree: PyTree) -> PyTree:
  """Host zeros in the shapes and dtypes of ``tree``'s leaves."""
  return jax.tree.map(
      lambda x: np.zeros(np.shape(x), jnp.result_type(x)), tree)


def stack(items: Sequence[PyTree], shape: tuple[int, ...]) -> PyTree:
  """Leaves stacked to ``shape + leaf shape``: on the device if any item is
  there (a carried client state), else on the host."""
  def leaf(*xs):
    xp = jnp if any(isinstance(x, jax.Array) for x in xs) else np
    return xp.stack([xp.asarray(x) for x in xs]).reshape(
        shape + np.shape(xs[0]))
  return jax.tree.map(leaf, *items)


class SegmentFeeder:
  """Makes a round's segment inputs on this process's lanes.

  Args:
    plan: the round's plan; its devices are ``mesh``'s.
    mesh: the devices.
    batches: per client (cohort position) its batches; only the clients on
      this process's lanes are read.
    inputs: per client its client input (host arrays).
    weights: per client its aggregation weight.
    template: ``(batch, client_input)`` whose zeros fill masked steps.
  """

  def __init__(self, plan: lanes_lib.LanePlan, mesh: sharding.ClientMesh,
               batches: Sequence[Sequence[dict]], inputs: Sequence[PyTree],
               weights: Sequence[float], template: tuple[dict, PyTree]):
    self.plan, self.mesh, self.batches = plan, mesh, batches
    per_proc = plan.devices // mesh.num_processes
    p = mesh.process_index
    self.lanes = slice(p * per_proc * plan.lanes_per_device,
                       (p + 1) * per_proc * plan.lanes_per_device)
    self.devices = slice(p * per_proc, (p + 1) * per_proc)
    self._pad_batch = zeros_like(template[0])
    n = len(batches)
    # Client inputs as one table (row n: padding), indexed per lane/step.
    self._table = stack(list(inputs) + [zeros_like(template[1])], (-1,))
    self._n = n
    self._weight = np.asarray(weights, np.float32)

  def pick(self, c: np.ndarray) -> PyTree:
    """Client inputs of clients ``c`` (int array; -1: padding)."""
    return jax.tree.map(lambda t: t[np.where(c >= 0, c, self._n)],
                        self._table)

  def weight_of(self, c: np.ndarray) -> np.ndarray:
    """``float32`` weights of clients ``c`` (0 where ``c < 0``)."""
    return np.where(c >= 0, self._weight[np.maximum(c, 0)],
                    0.).astype(np.float32)

  def put(self, tree: PyTree, rows: int) -> PyTree:
    """``tree``'s leaves (leading axis: this process's rows of ``rows``)
    sharded over the devices."""
    if self.mesh.multi_process:
      return jax.tree.map(
          lambda x: self.mesh.put_clients(np.asarray(x), rows), tree)
    return jax.device_put(tree, self.mesh.client_sharding)

  def begin(self) -> tuple[PyTree, PyTree]:
    """``(inputs, lane_ids)`` of ``lanes_begin``, on the devices."""
    plan = self.plan
    return (self.put(self.pick(plan.begin[self.lanes]), plan.lanes),
            self.put(np.arange(plan.lanes)[self.lanes], plan.lanes))

  def finish_weights(self) -> jax.Array:
    """``lanes_finish``'s weights, on the devices."""
    plan = self.plan
    return self.put(self.weight_of(plan.finish[self.lanes]), plan.lanes)

  def segment(self, k: int) -> tuple[StepInputs, np.int32]:
    """Segment ``k``'s inputs (on the devices) and its planned steps."""
    plan, S, t = self.plan, self.plan.segment_steps, slice(
        k * self.plan.segment_steps, (k + 1) * self.plan.segment_steps)
    who = plan.client[t, self.lanes].T          # [lanes, S]
    which = plan.batch[t, self.lanes].T
    step_batches = [self.batches[c][b] if c >= 0 else self._pad_batch
                    for c, b in zip(who.ravel(), which.ravel())]
    # Slots as rows: [S, devices, F] -> [devices * F, S].
    slot = lambda a: np.transpose(a[t, self.devices], (1, 2, 0)).reshape(
        -1, S)
    started = slot(plan.start_client)
    num_slots = plan.devices * plan.slots
    inputs = StepInputs(
        batch=self.put(stack(step_batches, who.shape), plan.lanes),
        active=self.put(who >= 0, plan.lanes),
        fin_lane=self.put(slot(plan.finalize), num_slots),
        fin_weight=self.put(self.weight_of(slot(plan.finalize_client)),
                            num_slots),
        start_input=self.put(self.pick(started), num_slots),
        start_on=self.put(started >= 0, num_slots))
    return inputs, np.int32(min(S, plan.sequential_steps - k * S))

  def warm_up(self, threads: int) -> None:
    """Submits the ``make()`` of this process's clients' batches (those
    made on first access) to ``threads`` warm-up threads, in the order of
    the clients' first steps."""
    plan = self.plan
    local = plan.client[:, self.lanes]
    first = np.full(self._n, plan.steps, np.int64)
    t_idx, l_idx = np.nonzero(local >= 0)
    np.minimum.at(first, local[t_idx, l_idx], t_idx)
    for c in np.argsort(first, kind='stable'):
      make = getattr(self.batches[c], 'make', None)
      if first[c] < plan.steps and make is not None:
        pool('lanes_warm', threads).submit(make)

  def segments(self, warm_threads: int
               ) -> Iterator[tuple[StepInputs, np.int32]]:
    """Yields each segment's ``(inputs, steps)`` in order; with more than
    one segment, the next one is made on a worker thread while the caller
    runs this one (the same values either way)."""
    count = self.plan.num_segments
    if count == 1:
      yield self.segment(0)
      return
    worker = pool('lanes_prefetch', 1)
    pending = worker.submit(self.segment, 0)
    self.warm_up(warm_threads)
    for k in range(count):
      ready = pending.result()
      if k + 1 < count:
        pending = worker.submit(self.segment, k + 1)
      yield ready

