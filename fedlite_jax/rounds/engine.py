"""Round engines: a round's client updates as a Python loop or vmapped.

:class:`VmapEngine` (GPU/TPU default) runs chunks of clients as one vmap +
scan program; :class:`LoopEngine` (CPU default, jax-ml/jax#12868) calls
jitted steps per client. Notes: docs/notes/rounds.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.rounds import chunking
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import sharding
# Re-exported: the chunking names that tests, benchmarks and the runner use.
from fedlite_jax.common import PyTree
from fedlite_jax.rounds.chunking import (  # noqa: F401
    AUTO_LANE_EXTRA_BYTES, AUTO_MAX_CLIENTS_PER_CHUNK, AUTO_MEMORY_FRACTION,
    AUTO_PARAM_COPIES, bucket_steps, executed_steps, plan_chunks,
    recording_stats, resolve_clients_per_chunk, tree_bytes)

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
  """
  init: Callable[[PyTree, PyTree], PyTree]
  step: Callable[[PyTree, Batch], PyTree]
  final: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


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


def _stack_rows(*xs) -> Any:
  """Stacks per-client leaves on the device if any is there, else on host."""
  if any(isinstance(x, jax.Array) for x in xs):
    return jnp.stack([jnp.asarray(x) for x in xs])
  return np.stack([np.asarray(x) for x in xs])


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
    def init(shared_input, client_input):
      # A copy: the state must not alias shared_input to be donated.
      return jax.tree.map(jnp.copy, program.init(shared_input, client_input))

    if steps_per_call == 1:
      step = jax.jit(program.step, donate_argnums=0)
    else:

      @functools.partial(jax.jit, donate_argnums=0)
      def step(state, batches, mask):
        for i in range(steps_per_call):  # Unrolled: no while loop on CPU.
          batch = jax.tree.map(lambda x, i=i: x[i], batches)
          state = _masked(program.step(state, batch), state, mask[i])
        return state

    @functools.partial(jax.jit, donate_argnums=2)
    def final(shared_input, state, acc, weight):
      output, diag = program.final(shared_input, state)
      acc = jax.tree.map(lambda a, o: a + weight * o, acc, output)
      return acc, diag

    self._init, self._step, self._final = init, step, final
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
        acc = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           self._output_shape(shared_input, state))
      acc, diag = self._final(shared_input, state, acc,
                              np.float32(w.weight))
      total += float(w.weight)
      diags.append(diag)
    steps = [len(w.batches) for w in work]
    chunking.record(self.name, 1, clients=len(work), client_steps=sum(steps),
            padded_steps=sum(-(-n // self._k) * self._k for n in steps),
            chunks=len(work))
    return RoundResult(acc, total, [jax.device_get(d) for d in diags])

  def _output_shape(self, shared_input: PyTree, state: PyTree) -> PyTree:
    """Shapes of ``program.final``'s output, traced once per input shapes."""
    key = jax.tree.structure((shared_input, state)), tuple(
        (jnp.shape(x), jnp.result_type(x).name)
        for x in jax.tree.leaves((shared_input, state)))
    if key not in self._output_shapes:
      self._output_shapes[key] = jax.eval_shape(self._program.final,
                                                shared_input, state)[0]
    return self._output_shapes[key]


class VmappedClients:
  """A client update for many clients as one jitted vmap + scan program.

  Clients are padded to ``steps`` with masked steps (zero batches and step
  results), the client axis with padding clients (zero ``client_input``, no
  steps) to a multiple of the mesh's devices.

  Args:
    init, step, final: ``(shared, client_input) -> state``, ``(state,
      batch) -> (state, step_result)``, ``(shared, state) -> output``.
    mesh: the :class:`ClientMesh` of the clients; None: default device.
    reduce: ``(outputs, step_results) -> result`` in the same program
      (leaves ``[rows, ...]``, ``[rows, steps, ...]``); None: both.
    out_shardings: ``jax.jit`` output shardings (None: XLA's choice).
  """

  def __init__(self, init: Callable[[PyTree, PyTree], PyTree],
               step: Callable[[PyTree, Batch], tuple[PyTree, PyTree]],
               final: Callable[[PyTree, PyTree], PyTree], *,
               mesh: Optional[sharding.ClientMesh] = None,
               reduce: Optional[Callable[[PyTree, PyTree], PyTree]] = None,
               out_shardings: Any = None):
    self._mesh = mesh

    def one_client(shared_input, client_input, batches, mask):
      state = init(shared_input, client_input)

      def body(state, xs):
        batch, m = xs
        new_state, step_result = step(state, batch)
        step_result = jax.tree.map(
            lambda x: jnp.where(m, x, jnp.zeros_like(x)), step_result)
        return _masked(new_state, state, m), step_result

      state, step_results = jax.lax.scan(body, state, (batches, mask))
      return final(shared_input, state), step_results

    def run(shared_input, client_inputs, batches, mask):
      outputs = jax.vmap(one_client, in_axes=(None, 0, 0, 0))(
          shared_input, client_inputs, batches, mask)
      return outputs if reduce is None else reduce(*outputs)

    if out_shardings is None:
      self._run = jax.jit(run)
    else:
      self._run = jax.jit(run, out_shardings=out_shardings)

  def rows(self, cohort_size: int) -> np.ndarray:
    """``[cohort_size]`` int: each client's row of the (global) client axis."""
    if self._mesh is None:
      return np.arange(cohort_size)
    return self._mesh.rows(cohort_size)

  def __call__(self, shared_input: PyTree,
               client_batches: Sequence[Sequence[Batch]],
               client_inputs: Sequence[PyTree], steps: int,
               cohort_size: Optional[int] = None, *,
               lanes: Optional[int] = None,
               template: Optional[tuple[Batch, PyTree]] = None) -> PyTree:
    """Runs this process's clients as one program; returns ``reduce``'s result.

    Args:
      shared_input: the same for every client.
      client_batches: per local client (row order), its batches (maybe none).
      client_inputs: per local client, the pytree passed to ``init``.
      steps: padded step count (>= every batch count; same on all processes).
      cohort_size: client rows over all processes before the mesh's padding
        (default: the local count); ``lanes`` is an alias.
      template: ``(batch, client_input)`` giving padding clients' shapes
        (default: the first client's).

    Returns:
      ``reduce(outputs, step_results)`` as global arrays (rows: :meth:`rows`).

    Raises:
      ValueError: no client has any batch and no ``template`` is given.
    """
    cohort = lanes if lanes is not None else (
        len(client_batches) if cohort_size is None else cohort_size)
    mesh = self._mesh
    rows = cohort if mesh is None else mesh.rows_per_process(cohort)
    if template is None:
      batch = next((b[0] for b in client_batches if len(b)), None)
      if batch is None:
        raise ValueError('No client has any batch; at least one client must '
                         'run a local step.')
      template = batch, client_inputs[0]
    padding = jax.tree.map(np.zeros_like, template[0])
    pad_input = jax.tree.map(lambda x: np.zeros_like(np.asarray(x)),
                             template[1])
    num_pad = rows - len(client_batches)
    padded = [list(b) + [padding] * (steps - len(b)) for b in client_batches]
    padded += [[padding] * steps] * num_pad
    # One host array per leaf, [rows, steps, ...], one transfer per leaf.
    leaves = [jax.tree.leaves(b) for client in padded for b in client]
    treedef = jax.tree.structure(padding)
    batches = jax.tree.unflatten(treedef, [
        np.stack([l[i] for l in leaves]).reshape(
            (rows, steps) + np.shape(leaves[0][i]))
        for i in range(len(leaves[0]))])
    mask = np.zeros((rows, steps), bool)
    for r, b in enumerate(client_batches):
      mask[r, :len(b)] = True
    inputs = jax.tree.map(
        _stack_rows, *(list(client_inputs) + [pad_input] * num_pad))
    if mesh is not None:
      put = lambda x: mesh.put_clients(np.asarray(x), cohort)
      batches, mask, inputs = jax.tree.map(put, (batches, mask, inputs))
      shared_input = mesh.put_replicated(shared_input)
    return self._run(shared_input, inputs, batches, mask)


class VmapEngine:
  """A round's clients as one :class:`VmappedClients` run per chunk.

  Args:
    program: the client update.
    step_bucket: :func:`bucket_steps` policy ('grid', 'pow2', 'exact', int).
    mesh: the :class:`ClientMesh` to split clients over; None: one device.
    clients_per_chunk: an int > 0, 0 or None (no limit), or 'auto'
      (:func:`resolve_clients_per_chunk` of ``shared_input``'s bytes).
  """

  name = 'vmap'

  def __init__(self, program: ClientProgram, step_bucket: str | int = 'grid',
               mesh: Optional[sharding.ClientMesh] = None,
               clients_per_chunk: int | str | None = 'auto'):
    bucket_steps(1, step_bucket)  # Validates the policy.
    if clients_per_chunk != 'auto':
      resolve_clients_per_chunk(clients_per_chunk, 0)  # Validates it.
    self._program = program
    self._bucket = step_bucket
    self._mesh = mesh
    self._per_chunk_setting = clients_per_chunk
    self._per_chunk: Optional[int] = None

    # The weight rides in the state so that final weights the output.
    def init(shared_input, client_input):
      inner, weight = client_input
      return program.init(shared_input, inner), weight

    def step(state, batch):
      inner, weight = state
      return (program.step(inner, batch), weight), None

    def final(shared_input, state):
      inner, weight = state
      output, diag = program.final(shared_input, inner)
      # where, not a product: a padding client's NaN must not reach the sum.
      return jax.tree.map(lambda o: jnp.where(weight > 0, weight * o, 0.),
                          output), diag

    def reduce(outputs, _):
      weighted, diags = outputs
      return jax.tree.map(lambda x: jnp.sum(x, axis=0), weighted), diags

    self._clients = VmappedClients(
        init, step, final, mesh=mesh, reduce=reduce,
        out_shardings=None if mesh is None else (mesh.replicated,
                                                 mesh.client_sharding))
    self._add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b),
                        donate_argnums=0)

  @property
  def clients_per_chunk(self) -> Optional[int]:
    """The resolved chunk size per device (0: no limit; None: not yet)."""
    return self._per_chunk

  def __call__(self, shared_input: PyTree,
               work: Sequence[ClientWork]) -> RoundResult:
    _check_cohort(work)
    mesh = self._mesh
    if self._per_chunk is None:
      self._per_chunk = resolve_clients_per_chunk(
          self._per_chunk_setting, tree_bytes(shared_input))
    steps = [len(w.batches) for w in work]
    plan = chunking.plan_round(steps, self._per_chunk, self._bucket, mesh)
    process = 0 if mesh is None else mesh.process_index
    first = next(w for w in work
                 if not isinstance(w.batches, remote.RemoteBatches))
    template = (first.batches[0], (first.client_input, np.float32(0)))
    if mesh is not None:
      shared_input = mesh.put_replicated(shared_input)
    weighted_sum, chunk_diags = None, []
    for per_process in plan:
      chunk = per_process[process]
      local = [work[i] for i in chunk.members]
      chunk_sum, diags = self._clients(
          shared_input, [w.batches for w in local],
          [(w.client_input, np.float32(w.weight)) for w in local],
          chunk.steps, lanes=chunk.lanes * len(per_process),
          template=template)
      weighted_sum = chunk_sum if weighted_sum is None else self._add(
          weighted_sum, chunk_sum)
      chunk_diags.append(diags)
    chunk_diags = (jax.device_get(chunk_diags) if mesh is None else
                   [mesh.gather(d) for d in chunk_diags])
    per_client: list[Any] = [None] * len(work)
    for per_process, diags in zip(plan, chunk_diags):
      for p, chunk in enumerate(per_process):
        for lane, i in enumerate(chunk.members):
          row = p * chunk.lanes + lane
          per_client[i] = jax.tree.map(lambda x, r=row: x[r], diags)
    if mesh is not None:
      # Process-local arrays, so the server update is a process-local program.
      weighted_sum = jax.tree.map(lambda x: x.addressable_data(0),
                                  weighted_sum)
    chunking.record(self.name, self._per_chunk, clients=len(work),
            client_steps=sum(steps),
            padded_steps=sum(c.lanes * c.steps for pp in plan for c in pp),
            chunks=len(plan))
    total = float(np.sum(np.asarray([w.weight for w in work], np.float64)))
    return RoundResult(weighted_sum, total, per_client)


def make_engine(name: str, program: ClientProgram, *, steps_per_call: int = 1,
                step_bucket: str | int = 'grid',
                mesh: Optional[sharding.ClientMesh] = None,
                clients_per_chunk: int | str | None = 'auto'
                ) -> LoopEngine | VmapEngine:
  """Builds an engine by name.

  Args:
    name: 'auto' (vmap on GPU/TPU or several devices), 'loop' or 'vmap'.
    program: the client update.
    steps_per_call: loop engine: local steps per jitted call.
    step_bucket, clients_per_chunk: vmap engine (:class:`VmapEngine`).
    mesh: the :class:`ClientMesh`; None: the one set by
      ``sharding.use_client_mesh``, if any. One device is the same as none.

  Raises:
    ValueError: an unknown name, or 'loop' with several devices.
  """
  if mesh is None:
    mesh = sharding.current_client_mesh()
  if mesh is not None and mesh.num_devices == 1:
    mesh = None
  if name == 'auto':
    name = 'vmap' if mesh is not None else default_engine_name()
  if name == 'loop':
    if mesh is not None:
      raise ValueError(
          f'round engine loop runs on one device, but {mesh.num_devices} '
          "devices were requested; use engine 'vmap' (or 'auto') or one "
          'device.')
    return LoopEngine(program, steps_per_call=steps_per_call)
  if name == 'vmap':
    return VmapEngine(program, step_bucket=step_bucket, mesh=mesh,
                      clients_per_chunk=clients_per_chunk)
  raise ValueError(f'Unknown round engine {name!r}; allowed: {ENGINE_NAMES}.')
