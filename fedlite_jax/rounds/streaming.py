"""Clients streamed through lanes: one compiled program for every round.

The parts: the plan (:func:`~fedlite_jax.rounds.lanes.plan_lanes`, pure
NumPy), the programs (:mod:`~fedlite_jax.rounds.lane_programs`: start the
lanes' first clients, segments of lane-steps, finish the last clients),
the segment inputs made on the host
(:class:`~fedlite_jax.rounds.lane_inputs.SegmentFeeder`), and the driver
here (:class:`LaneStreams`), which runs a planned round. Design notes:
docs/notes/engines.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import Mesh
import numpy as np

from fedlite_jax.checks import check_int
from fedlite_jax.common import PyTree
from fedlite_jax.rounds import lane_inputs
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import sharding
from fedlite_jax.rounds.lane_programs import LanePrograms  # noqa: F401
from fedlite_jax.rounds.lane_programs import PROGRAM_NAMES  # noqa: F401
from fedlite_jax.rounds.lane_programs import StepInputs  # noqa: F401
from fedlite_jax.rounds.lane_programs import build_lane_programs

#: Default warm-up threads: half the CPUs, 1 to 8.
DEFAULT_WARM_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclasses.dataclass(frozen=True)
class LaneRun:
  """What :meth:`LaneStreams.run` returns for one round.

  Attributes:
    diagnostics: per client (cohort order), its diagnostics (NumPy).
    weighted_sum: summing streams (``collect=False``): ``sum_i w_i *
      output_i`` as process-local arrays; None when collecting.
    outputs: collecting streams: per client its output; None when summing.
    step_results: collecting streams: per client its step results, one per
      batch (NumPy); None when summing.
  """
  diagnostics: list
  weighted_sum: Optional[PyTree] = None
  outputs: Optional[list] = None
  step_results: Optional[list[list]] = None


class LaneStreams:
  """A client update run on lanes that stream clients (see module doc).

  Args:
    init: ``(shared, client_input) -> state``; must be cheap (it runs for
      every finalization slot at every step where a client ends).
    step: ``(state, batch) -> (state, step_result)``.
    final: ``(shared, state) -> (output, diagnostics)``.
    mesh: the :class:`~fedlite_jax.rounds.sharding.ClientMesh` (None: the
      first local device).
    collect: False: outputs are weighted and summed on the devices; True:
      returned per client (``step_result`` too).
    warm_threads: threads that make clients' batches ahead, for batch
      sequences with a ``make()`` method (``batching.ClientBatches``), in
      the order of their first steps (>= 1; default half the CPUs, 1 to 8).

  Raises:
    ValueError: ``warm_threads`` < 1.
  """

  def __init__(self, init: Callable, step: Callable, final: Callable, *,
               mesh: Optional[sharding.ClientMesh] = None,
               collect: bool = False,
               warm_threads: int = DEFAULT_WARM_THREADS):
    if mesh is None:
      mesh = sharding.ClientMesh(Mesh(np.asarray(jax.local_devices()[:1]),
                                      (sharding.AXIS,)))
    self.mesh = mesh
    self.collect = collect
    self.warm_threads = check_int(warm_threads, 'warm_threads')
    self._fns = init, step, final
    self._programs: dict[int, LanePrograms] = {}

  def programs(self, segment_steps: int) -> LanePrograms:
    """The jitted programs for ``segment_steps`` steps per segment (built
    once per length)."""
    if segment_steps not in self._programs:
      self._programs[segment_steps] = build_lane_programs(
          *self._fns, mesh=self.mesh, segment_steps=segment_steps,
          collect=self.collect)
    return self._programs[segment_steps]

  def run(self, shared: PyTree, plan: lanes_lib.LanePlan,
          batches: Sequence[Sequence[dict]], inputs: Sequence[PyTree],
          weights: Sequence[float], template: tuple[dict, PyTree]
          ) -> LaneRun:
    """Runs one round as planned.

    Args:
      shared: the shared input (the same for every client).
      plan: the round's :class:`~fedlite_jax.rounds.lanes.LanePlan`; its
        devices must be the mesh's.
      batches, inputs, weights: per client (cohort position); only the
        clients on this process's lanes are read.
      template: ``(batch, client_input)`` whose zeros fill masked steps.

    Returns:
      A :class:`LaneRun`.

    Raises:
      ValueError: a plan for another number of devices.
    """
    if plan.devices != self.mesh.num_devices:
      raise ValueError(f'The plan is for {plan.devices} devices, the mesh has '
                       f'{self.mesh.num_devices}.')
    progs = self.programs(plan.segment_steps)
    feed = lane_inputs.SegmentFeeder(plan, self.mesh, batches, inputs,
                                     weights, template)
    shared = self.mesh.put_replicated(shared)
    states, acc = progs.begin(shared, *feed.begin())
    per_segment = []
    for x, steps in feed.segments(self.warm_threads):
      states, acc, *outs = progs.segment(shared, states, acc, x, steps)
      per_segment.append(outs)
    acc, fin_diags, fin_outputs = progs.finish(shared, states, acc,
                                               feed.finish_weights())
    diags, outputs, results = self._per_client(
        plan, per_segment, fin_diags, fin_outputs, len(batches))
    if self.collect:
      return LaneRun(diags, outputs=outputs, step_results=results)
    total = jax.tree.map(lambda x: x.addressable_data(0), progs.reduce(acc))
    return LaneRun(diags, weighted_sum=total)

  def _per_client(self, plan, per_segment, fin_diags, fin_outputs,
                  num_clients):
    """Diagnostics (and outputs, step results) per client, in cohort order."""
    seg_diags = [d for d, _, _ in per_segment]
    seg_diags, fin_diags = self.mesh.gather((seg_diags, fin_diags))
    S, F = plan.segment_steps, plan.slots
    at = lambda tree, row, s: jax.tree.map(lambda x: x[row, s], tree)
    diags: list[Any] = [None] * num_clients
    outputs = [None] * num_clients if self.collect else None
    for k, d in enumerate(seg_diags):
      for t, dev, f in zip(*np.nonzero(
          plan.finalize_client[k * S:(k + 1) * S] >= 0)):
        c = plan.finalize_client[k * S + t, dev, f]
        diags[c] = at(d, dev * F + f, t)
        if outputs is not None:
          outputs[c] = at(per_segment[k][1], dev * F + f, t)
    for lane, c in enumerate(plan.finish):
      if c >= 0:
        diags[c] = jax.tree.map(lambda x: x[lane], fin_diags)
        if outputs is not None:
          outputs[c] = jax.tree.map(lambda x: x[lane], fin_outputs)
    if not self.collect:
      return diags, None, None
    results = [[] for _ in range(num_clients)]
    host = jax.device_get([r for _, _, r in per_segment])
    for k, r in enumerate(host):
      for t in range(S):
        for lane in range(plan.lanes):
          c = plan.client[k * S + t, lane]
          if c >= 0:
            results[c].append(at(r, lane, t))
    return diags, outputs, results
