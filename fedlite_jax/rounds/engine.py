"""Round engines: a round's client updates as a Python loop or on lanes.

:class:`VmapEngine` (GPU/TPU default) streams clients through a fixed number
of vmapped lanes, one compiled program per run; :class:`LoopEngine` (CPU
default, jax-ml/jax#12868) calls jitted steps per client. Notes:
docs/notes/engines.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.common import PyTree
from fedlite_jax.rounds import errors
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import settings as settings_lib
from fedlite_jax.rounds import sharding
from fedlite_jax.rounds import stats
from fedlite_jax.rounds import streaming
# Re-exported: the names that tests, benchmarks and the runner use.
from fedlite_jax.rounds.stats import (  # noqa: F401
    AUTO_LANE_EXTRA_BYTES, AUTO_MAX_LANES, AUTO_MEMORY_FRACTION,
    AUTO_PARAM_COPIES, recording_stats, resolve_lanes, tree_bytes)

Batch = dict

ENGINE_NAMES = ('auto', 'loop', 'vmap')


@dataclasses.dataclass(frozen=True)
class ClientProgram:
  """A client update as three pure, jittable functions.

  Attributes:
    init: ``(shared_input, client_input) -> state``; ``shared_input`` is the
      same for all clients (the server model), ``client_input`` per client.
    step: ``(state, batch) -> state``; one local step.
    final: ``(shared_input, state) -> (output, diagnostics)``; ``output`` is
      summed with the client weights (integer leaves with the weights in
      their dtype, wrapping: secure aggregation's ``uint32`` residues sum
      mod ``2^32``), ``diagnostics`` kept per client.
    step_in_place: ``step`` (the same values, bit for bit) with data
      dependences that let XLA update a state carried through an
      on-device loop in place (:mod:`fedlite_jax.rounds.ordering`), for
      the vmap engine's lanes; None: ``step``. The loop engine runs
      ``step``.
  """
  init: Callable[[PyTree, PyTree], PyTree]
  step: Callable[[PyTree, Batch], PyTree]
  final: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]
  step_in_place: Optional[Callable[[PyTree, Batch], PyTree]] = None

  @property
  def carried_step(self) -> Callable[[PyTree, Batch], PyTree]:
    """The step an engine that carries states in place runs:
    ``step_in_place``, else ``step``."""
    return self.step_in_place or self.step


@dataclasses.dataclass(frozen=True)
class ClientWork:
  """One sampled client's work for a round.

  Attributes:
    client_id: the client's id.
    batches: the local batches in order (all of a round's alike in shape).
    client_input: pytree passed to ``ClientProgram.init``.
    weight: the aggregation weight (FedAvg: number of examples).
  """
  client_id: bytes
  batches: Sequence[Batch]
  client_input: PyTree
  weight: float


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What an engine returns for one round.

  Attributes:
    weighted_sum: ``sum_i weight_i * output_i`` (pytree of float32 arrays).
    total_weight: ``sum_i weight_i`` (Python float).
    diagnostics: per-client diagnostics (NumPy), in cohort order.
  """
  weighted_sum: PyTree
  total_weight: float
  diagnostics: list[PyTree]


def default_engine_name() -> str:
  """'vmap' on GPU/TPU, 'loop' on CPU."""
  return 'loop' if jax.default_backend() == 'cpu' else 'vmap'


def _check_cohort(work: Sequence[ClientWork]) -> None:
  if not work:
    raise ValueError('A round needs at least one client; got an empty cohort.')
  for w in work:
    if not w.batches:
      raise ValueError(
          f'Client {w.client_id!r} has no batches; every sampled client must '
          'run at least one local step.')
    if not np.isfinite(w.weight) or w.weight < 0:
      raise ValueError(
          f'Client {w.client_id!r} has weight {w.weight}; weights must be '
          'finite and >= 0.')


def _weighted(weight: jax.Array, output: jax.Array) -> jax.Array:
  """``weight * output``; an integer output (secure aggregation's residues)
  takes the weight in its own dtype, so its sum wraps in that dtype."""
  if jnp.issubdtype(output.dtype, jnp.inexact):
    return weight * output
  return output * weight.astype(output.dtype)


class LoopEngine:
  """Python loop over clients; one jitted call per local step.

  Args:
    program: the client update.
  """

  name = 'loop'

  def __init__(self, program: ClientProgram):
    self._program = program

    @jax.jit
    def loop_init(shared_input, client_input):
      # A copy: the state must not alias shared_input to be donated.
      return jax.tree.map(jnp.copy, program.init(shared_input, client_input))

    @functools.partial(jax.jit, donate_argnums=0)
    def loop_step(state, batch):
      return program.step(state, batch)

    @functools.partial(jax.jit, donate_argnums=2)
    def loop_final(shared_input, state, acc, weight):
      output, diag = program.final(shared_input, state)
      acc = jax.tree.map(lambda a, o: a + _weighted(weight, o), acc, output)
      return acc, diag

    self._init, self._step, self._final = loop_init, loop_step, loop_final
    self._zero_programs = {}  # output shapes -> jitted zeros
    self._output_shapes = {}  # (shared, state) shapes -> output shapes

  def __call__(self, shared_input: PyTree,
               work: Sequence[ClientWork]) -> RoundResult:
    """Runs one round.

    Args:
      shared_input: the same for every client (the server model).
      work: the cohort (>= 1 client, each with >= 1 batch).

    Returns:
      A :class:`RoundResult`.

    Raises:
      ValueError: an empty cohort, a client without batches or with a
        negative or non-finite weight.
    """
    _check_cohort(work)
    acc = None
    total = 0.
    diags = []
    for w in work:
      state = self._init(shared_input, w.client_input)
      for batch in w.batches:
        state = self._step(state, batch)
      if acc is None:
        # Committed where the state is, as the sums loop_final returns: an
        # uncommitted first sum compiles loop_final again for the second
        # client.
        acc = jax.device_put(
            self._zeros(self._output_shape(shared_input, state)),
            next(iter(jax.tree.leaves(state)[0].devices())))
      acc, diag = self._final(shared_input, state, acc,
                              np.float32(w.weight))
      total += float(w.weight)
      diags.append(diag)
    steps = [len(w.batches) for w in work]
    stats.record(self.name, clients=len(work), useful_steps=sum(steps),
                 executed_steps=sum(steps), sequential_steps=sum(steps),
                 segments=sum(steps), lanes=1, segment_steps=1,
                 longest_client_steps=max(steps))
    return RoundResult(acc, total, [jax.device_get(d) for d in diags])

  def _zeros(self, shapes: PyTree) -> PyTree:
    """Device zeros in ``shapes``, from one compiled program (eager zeros
    were one op per leaf every round, and an uncommitted first sum made
    ``loop_final`` compile twice)."""
    key = jax.tree.structure(shapes), tuple(
        (s.shape, s.dtype.name) for s in jax.tree.leaves(shapes))
    if key not in self._zero_programs:
      def loop_zeros():
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      self._zero_programs[key] = jax.jit(loop_zeros)
    return self._zero_programs[key]()

  def _output_shape(self, shared_input: PyTree, state: PyTree) -> PyTree:
    """Shapes of ``program.final``'s output, traced once per input shapes."""
    key = jax.tree.structure((shared_input, state)), tuple(
        (jnp.shape(x), jnp.result_type(x).name)
        for x in jax.tree.leaves((shared_input, state)))
    if key not in self._output_shapes:
      self._output_shapes[key] = jax.eval_shape(self._program.final,
                                                shared_input, state)[0]
    return self._output_shapes[key]


class VmapEngine:
  """A round's clients streamed through lanes as one compiled program.

  ``lanes_per_device`` lanes per device each run their clients back to back
  in segments of ``segment_steps`` steps
  (:class:`~fedlite_jax.rounds.streaming.LaneStreams`, planned by
  :func:`~fedlite_jax.rounds.lanes.plan_lanes`); the programs' shapes are
  fixed at the first round, so a run compiles them once.

  Args:
    program: the client update.
    mesh: the :class:`ClientMesh` to split lanes over; None: one device.
    lanes_per_device, segment_steps, slots: as
      :class:`~fedlite_jax.rounds.settings.LaneSettings`; with 'auto', the
      first round's cohort picks the lanes of the least modeled device time
      (:func:`~fedlite_jax.rounds.lanes.choose_lanes`) and the fewest slots
      that plan it as fast (:func:`~fedlite_jax.rounds.lanes.choose_slots`).

  Raises:
    ValueError: a bad option.
  """

  name = 'vmap'

  def __init__(self, program: ClientProgram,
               mesh: Optional[sharding.ClientMesh] = None,
               lanes_per_device: int | str = 'auto', segment_steps: int = 4,
               slots: int | str = 'auto'):
    self.settings = settings_lib.LaneSettings(lanes_per_device,
                                              segment_steps, slots)
    self._program = program
    self._lanes: Optional[int] = None
    self._slots: Optional[int] = None

    def step(state, batch):
      return program.carried_step(state, batch), None

    self._streams = streaming.LaneStreams(program.init, step, program.final,
                                          mesh=mesh)

  @property
  def lanes_per_device(self) -> Optional[int]:
    """The resolved lanes per device (None: not yet)."""
    return self._lanes

  def _resolve(self, shared_input: PyTree, steps: list[int],
               groups) -> None:
    """Fixes lanes and slots at the first round."""
    mesh, s = self._streams.mesh, self.settings
    if self._lanes is None:
      most = s.most_lanes(shared_input, len(steps), mesh.num_devices)
      cost = (lanes_lib.AUTO_CPU_STEP_COST_LANES
              if jax.default_backend() == 'cpu' else
              lanes_lib.AUTO_STEP_COST_LANES)
      self._lanes = most if s.lanes_per_device != 'auto' else \
          lanes_lib.choose_lanes(steps, most, s.segment_steps,
                                 mesh.num_devices, groups, cost)
    if self._slots is None:
      self._slots = (lanes_lib.choose_slots(
          steps, self._lanes, s.segment_steps, mesh.num_devices, groups)
                     if s.slots == 'auto' else min(int(s.slots), self._lanes))

  def __call__(self, shared_input: PyTree,
               work: Sequence[ClientWork]) -> RoundResult:
    """Runs one round (as :meth:`LoopEngine.__call__`)."""
    _check_cohort(work)
    mesh = self._streams.mesh
    steps = [len(w.batches) for w in work]
    groups = None
    if mesh.multi_process:
      groups = [range(*mesh.local_clients(len(work), p))
                for p in range(mesh.num_processes)]
    first = next(w for w in work
                 if not isinstance(w.batches, remote.RemoteBatches))
    self._resolve(shared_input, steps, groups)
    plan = lanes_lib.plan_lanes(steps, self._lanes,
                                self.settings.segment_steps, self._slots,
                                mesh.num_devices, groups)
    # Client inputs (keys) to the host in one transfer: a segment stacks
    # them there with its batches.
    inputs = jax.device_get([w.client_input for w in work])
    run = self._streams.run(
        shared_input, plan, [w.batches for w in work], inputs,
        [w.weight for w in work], (first.batches[0], inputs[0]))
    stats.record(self.name, clients=len(work), useful_steps=sum(steps),
                 executed_steps=plan.executed_steps,
                 sequential_steps=plan.sequential_steps,
                 segments=plan.num_segments,
                 lanes=plan.lanes, segment_steps=plan.segment_steps,
                 slots=plan.slots, longest_client_steps=max(steps))
    total = float(np.sum(np.asarray([w.weight for w in work], np.float64)))
    return RoundResult(run.weighted_sum, total, run.diagnostics)


def make_engine(name: str, program: ClientProgram, *,
                mesh: Optional[sharding.ClientMesh] = None,
                lanes_per_device: int | str = 'auto', segment_steps: int = 4,
                slots: int | str = 'auto') -> LoopEngine | VmapEngine:
  """Builds an engine by name.

  Args:
    name: 'auto' (vmap on GPU/TPU or several devices), 'loop' or 'vmap'.
    program: the client update.
    mesh: the :class:`ClientMesh`; None: the one set by
      ``sharding.use_client_mesh``, if any. One device is the same as none.
    lanes_per_device, segment_steps, slots: vmap engine
      (:class:`VmapEngine`).

  Returns:
    A :class:`LoopEngine` or :class:`VmapEngine`.

  Raises:
    errors.EngineConfigError: (a ValueError) an unknown name, or 'loop'
      with several devices.
  """
  if mesh is None:
    mesh = sharding.current_client_mesh()
  if mesh is not None and mesh.num_devices == 1:
    mesh = None
  if name == 'auto':
    name = 'vmap' if mesh is not None else default_engine_name()
  if name == 'loop':
    if mesh is not None:
      raise errors.EngineConfigError(
          f'round engine loop runs on one device, but {mesh.num_devices} '
          "devices were requested; use engine 'vmap' (or 'auto') or one "
          'device.')
    return LoopEngine(program)
  if name == 'vmap':
    return VmapEngine(program, mesh=mesh, lanes_per_device=lanes_per_device,
                      segment_steps=segment_steps, slots=slots)
  raise errors.EngineConfigError(
      f'Unknown round engine {name!r}; allowed: {ENGINE_NAMES}.')
