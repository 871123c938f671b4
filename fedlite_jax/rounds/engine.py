"""Round engines: a round's client updates as a Python loop or on lanes.

:class:`VmapEngine` (GPU/TPU default) streams clients through a fixed number
of vmapped lanes, one compiled program per run; :class:`LoopEngine` (CPU
default, jax-ml/jax#12868) calls jitted steps per client. Notes:
docs/notes/rounds.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.checks import check_int
from fedlite_jax.common import PyTree
from fedlite_jax.rounds import errors
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import remote
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
      summed with the client weights, ``diagnostics`` kept per client.
    step_in_place: ``step`` (the same values, bit for bit) with data
      dependences that let XLA update a state carried through an
      on-device loop in place (:mod:`fedlite_jax.rounds.ordering`), for
      the vmap engine's lanes; None: ``step``. The loop engine runs
      ``step``: there the dependences cost more than the copy they save
      (FEMNIST CNN on XLA:CPU, a round 0.90x of FedJAX's with them, 1.00x
      without).
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


def _masked(new: PyTree, old: PyTree, mask: jax.Array) -> PyTree:
  return jax.tree.map(lambda n, o: jnp.where(mask, n, o), new, old)


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


class LoopEngine:
  """Python loop over clients; jitted blocks of ``steps_per_call`` steps.

  Args:
    program: the client update.
    steps_per_call: local steps unrolled into one jitted call (>= 1); the
      last block is padded with masked steps.
  """

  name = 'loop'

  def __init__(self, program: ClientProgram, steps_per_call: int = 1):
    if steps_per_call < 1:
      raise ValueError(f'steps_per_call must be >= 1, got {steps_per_call}.')
    self._program = program
    self._k = steps_per_call

    @jax.jit
    def loop_init(shared_input, client_input):
      # A copy: the state must not alias shared_input to be donated.
      return jax.tree.map(jnp.copy, program.init(shared_input, client_input))

    if steps_per_call == 1:

      @functools.partial(jax.jit, donate_argnums=0)
      def loop_step(state, batch):
        return program.step(state, batch)
    else:

      @functools.partial(jax.jit, donate_argnums=0)
      def loop_step(state, batches, mask):
        for i in range(steps_per_call):  # Unrolled: no while loop on CPU.
          batch = jax.tree.map(lambda x, i=i: x[i], batches)
          state = _masked(program.step(state, batch), state, mask[i])
        return state

    @functools.partial(jax.jit, donate_argnums=2)
    def loop_final(shared_input, state, acc, weight):
      output, diag = program.final(shared_input, state)
      acc = jax.tree.map(lambda a, o: a + weight * o, acc, output)
      return acc, diag

    self._init, self._step, self._final = loop_init, loop_step, loop_final
    self._zero_programs = {}  # output shapes -> jitted zeros
    self._output_shapes = {}  # (shared, state) shapes -> output shapes

  def __call__(self, shared_input: PyTree,
               work: Sequence[ClientWork]) -> RoundResult:
    _check_cohort(work)
    acc = None
    total = 0.
    diags = []
    for w in work:
      state = self._init(shared_input, w.client_input)
      if self._k == 1:
        for batch in w.batches:
          state = self._step(state, batch)
      else:
        for start in range(0, len(w.batches), self._k):
          block = list(w.batches[start:start + self._k])
          mask = np.arange(self._k) < len(block)
          block += [block[-1]] * (self._k - len(block))
          stacked = jax.tree.map(lambda *xs: np.stack(xs), *block)
          state = self._step(state, stacked, mask)
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
    padded = [-(-n // self._k) * self._k for n in steps]
    stats.record(self.name, clients=len(work), useful_steps=sum(steps),
                 executed_steps=sum(padded), sequential_steps=sum(padded),
                 segments=sum(p // self._k for p in padded), lanes=1,
                 segment_steps=self._k, longest_client_steps=max(steps))
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
    lanes_per_device: an int >= 1, or 'auto': at most :func:`resolve_lanes`
      of ``shared_input``'s bytes and the device memory, and of those the
      lanes whose plan of the first cohort has the least modeled device
      time, sequential steps x (``lanes.AUTO_STEP_COST_LANES`` + lanes;
      on CPU ``AUTO_CPU_STEP_COST_LANES``)
      (:func:`~fedlite_jax.rounds.lanes.choose_lanes`).
    segment_steps: local steps per compiled segment (>= 1).
    slots: finalizations per device and step, an int >= 1 or 'auto'
      (:func:`~fedlite_jax.rounds.lanes.choose_slots` of the first round).
    segment_loop: ``streaming.LOOPS``: 'unroll' (every segment runs
      ``segment_steps`` steps), 'scan' (an on-device loop that runs only the
      planned steps), 'while' (a loop of the planned count), 'fixed' (an
      on-device loop of ``segment_steps`` steps without conditionals),
      'host' (the masked step called once per planned step, the
      finalizations and starts called before it where clients end; no
      device loop and no conditional; the ``segments`` statistic still
      counts segments of ``segment_steps`` steps) or 'auto' (scan; on CPU
      unroll for a client
      step with a convolution, :func:`streaming.resolve_loop`, at the
      first round).

  Raises:
    ValueError: a bad option.
  """

  name = 'vmap'

  def __init__(self, program: ClientProgram,
               mesh: Optional[sharding.ClientMesh] = None,
               lanes_per_device: int | str = 'auto', segment_steps: int = 4,
               slots: int | str = 'auto', segment_loop: str = 'auto'):
    if lanes_per_device != 'auto':
      resolve_lanes(lanes_per_device, 0)  # Validates it.
    self._segment_steps = check_int(segment_steps, 'segment_steps')
    if slots != 'auto':
      check_int(slots, 'slots')
    streaming.resolve_loop(segment_loop)  # Validates it.
    self._loop_setting = segment_loop
    self._loop: Optional[str] = None
    self._program = program
    self._mesh = mesh
    self._lanes_setting = lanes_per_device
    self._lanes: Optional[int] = None
    self._slots_setting = slots
    self._slots: Optional[int] = None

    def step(state, batch):
      return program.carried_step(state, batch), None

    self._streams = streaming.LaneStreams(program.init, step, program.final,
                                          mesh=mesh)

  @property
  def lanes_per_device(self) -> Optional[int]:
    """The resolved lanes per device (None: not yet)."""
    return self._lanes

  @property
  def segment_loop(self) -> Optional[str]:
    """The resolved segment loop (``streaming.LOOPS`` but 'auto'; None:
    not yet)."""
    return self._loop

  def __call__(self, shared_input: PyTree,
               work: Sequence[ClientWork]) -> RoundResult:
    _check_cohort(work)
    mesh = self._streams.mesh
    steps = [len(w.batches) for w in work]
    groups = None
    if mesh.multi_process:
      groups = [range(*mesh.local_clients(len(work), p))
                for p in range(mesh.num_processes)]
    first = next(w for w in work
                 if not isinstance(w.batches, remote.RemoteBatches))
    if self._loop is None:  # Fixed from the first round on.
      p = self._program
      self._loop = streaming.resolve_loop(
          self._loop_setting, p.step,
          jax.eval_shape(p.init, shared_input, first.client_input),
          first.batches[0])
    dynamic = streaming.runs_planned_steps(self._loop)
    if self._lanes is None:  # Fixed from the first round on.
      most = min(resolve_lanes(self._lanes_setting, tree_bytes(shared_input)),
                 -(-len(work) // mesh.num_devices))
      cost = (lanes_lib.AUTO_CPU_STEP_COST_LANES
              if jax.default_backend() == 'cpu' else
              lanes_lib.AUTO_STEP_COST_LANES)
      self._lanes = most if self._lanes_setting != 'auto' else \
          lanes_lib.choose_lanes(steps, most, self._segment_steps,
                                 mesh.num_devices, groups, dynamic, cost)
    if self._slots is None:
      self._slots = (lanes_lib.choose_slots(
          steps, self._lanes, self._segment_steps, mesh.num_devices, groups)
                     if self._slots_setting == 'auto' else
                     min(int(self._slots_setting), self._lanes))
    plan = lanes_lib.plan_lanes(steps, self._lanes, self._segment_steps,
                                self._slots, mesh.num_devices, groups,
                                dynamic)
    # Client inputs (keys) to the host in one transfer: a segment stacks
    # them there with its batches.
    inputs = jax.device_get([w.client_input for w in work])
    run = self._streams.run(
        shared_input, plan, [w.batches for w in work], inputs,
        [w.weight for w in work], (first.batches[0], inputs[0]),
        loop=self._loop)
    stats.record(self.name, clients=len(work), useful_steps=sum(steps),
                 executed_steps=plan.executed_steps,
                 sequential_steps=plan.sequential_steps,
                 segments=plan.num_segments,
                 lanes=plan.lanes, segment_steps=plan.segment_steps,
                 slots=plan.slots, longest_client_steps=max(steps),
                 rows_on_device=int(run.rows_on_device))
    total = float(np.sum(np.asarray([w.weight for w in work], np.float64)))
    return RoundResult(run.weighted_sum, total, run.diagnostics)


def make_engine(name: str, program: ClientProgram, *, steps_per_call: int = 1,
                mesh: Optional[sharding.ClientMesh] = None,
                lanes_per_device: int | str = 'auto', segment_steps: int = 4,
                slots: int | str = 'auto', segment_loop: str = 'auto'
                ) -> LoopEngine | VmapEngine:
  """Builds an engine by name.

  Args:
    name: 'auto' (vmap on GPU/TPU or several devices), 'loop' or 'vmap'.
    program: the client update.
    steps_per_call: loop engine: local steps per jitted call.
    lanes_per_device: vmap engine (:class:`VmapEngine`).
    segment_steps: vmap engine.
    slots: vmap engine.
    segment_loop: vmap engine.
    mesh: the :class:`ClientMesh`; None: the one set by
      ``sharding.use_client_mesh``, if any. One device is the same as none.

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
    return LoopEngine(program, steps_per_call=steps_per_call)
  if name == 'vmap':
    return VmapEngine(program, mesh=mesh, lanes_per_device=lanes_per_device,
                      segment_steps=segment_steps, slots=slots,
                      segment_loop=segment_loop)
  raise errors.EngineConfigError(
      f'Unknown round engine {name!r}; allowed: {ENGINE_NAMES}.')
