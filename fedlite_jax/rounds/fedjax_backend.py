"""A vmapped (and device-sharded) ``fedjax.ForEachClientBackend``.

Clients stream through the lanes of
:class:`~fedlite_jax.rounds.streaming.LaneStreams` programs and come back in
call order. Counts go to :func:`~fedlite_jax.rounds.stats.recording_stats`
as ``'vmap_backend'``.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator, Optional

import fedjax
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.checks import check_int
from fedlite_jax.common import PyTree
from fedlite_jax.rounds import errors
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import settings as settings_lib
from fedlite_jax.rounds import sharding
from fedlite_jax.rounds import stats
from fedlite_jax.rounds import streaming


def _signature(tree: PyTree) -> tuple:
  """Structure, shapes and dtypes of a pytree (the key of a program)."""
  return jax.tree.structure(tree), tuple(
      (np.shape(x), str(getattr(x, 'dtype', None) or np.result_type(x)))
      for x in jax.tree.leaves(tree))


def _segments(batches: list) -> list[tuple[tuple, int, int]]:
  """``[(signature, start, end)]``: runs of equally shaped batches."""
  out = []
  for t, batch in enumerate(batches):
    sig = _signature(batch)
    if out and out[-1][0] == sig:
      out[-1] = (sig, out[-1][1], t + 1)
    else:
      out.append((sig, t, t + 1))
  return out


def _cast_like(new: PyTree, old: PyTree) -> PyTree:
  """``new`` in the shapes and dtypes of ``old`` (leaves of equal size)."""
  new_leaves, new_def = jax.tree.flatten(new)
  old_leaves, old_def = jax.tree.flatten(old)
  if new_def != old_def:
    raise ValueError(
        f'VmapBackend: client_step returned a state of structure {new_def}, '
        f'but got {old_def}; the state structure must not change.')
  out = []
  for n, o in zip(new_leaves, old_leaves):
    n_shape, o_shape = jnp.shape(n), jnp.shape(o)
    n_dtype, o_dtype = jnp.result_type(n), jnp.result_type(o)
    if n_shape != o_shape:
      if int(np.prod(n_shape)) != int(np.prod(o_shape)):
        raise ValueError(
            f'VmapBackend: client_step turns a state leaf of shape {o_shape} '
            f'into {n_shape}; a step may change a leaf shape only when its '
            'size stays the same.')
      n = jnp.reshape(n, o_shape)
    if n_dtype != o_dtype:
      n = jnp.asarray(n).astype(o_dtype)
    out.append(n)
  return jax.tree.unflatten(old_def, out)


class _Runner:
  """One ``for_each_client`` function's lane programs and windows."""

  def __init__(self, backend: 'VmapBackend', mesh: sharding.ClientMesh,
               client_init, client_step, client_final):
    self.backend, self.mesh = backend, mesh
    self.fns = client_init, client_step, client_final
    self.streams: dict[tuple[bool, bool], streaming.LaneStreams] = {}
    self.slots: dict[tuple, int] = {}
    self.counter = collections.Counter()
    self.no_steps = jax.jit(lambda s, c: client_final(s, client_init(s, c)))

  def program(self, first: bool, last: bool) -> streaming.LaneStreams:
    """init, steps, final; not first/last: from/to a carried state."""
    if (first, last) not in self.streams:
      client_init, client_step, client_final = self.fns

      def init(shared_input, client_input):
        return client_init(shared_input, client_input) if first \
            else client_input

      def step(state, batch):
        new_state, step_result = client_step(state, batch)
        return _cast_like(new_state, state), step_result

      def final(shared_input, state):
        return (client_final(shared_input, state) if last else state), None

      self.streams[first, last] = streaming.LaneStreams(
          init, step, final, mesh=self.mesh, collect=True)
    return self.streams[first, last]

  def lanes_for(self, count: int) -> int:
    """Lanes per device: the smallest power of two holding ``count``
    clients, at most the resolved lanes."""
    most, devices = self.backend.lanes_per_device, self.mesh.num_devices
    lanes = 1
    while lanes * devices < count and lanes < most:
      lanes *= 2
    return min(lanes, most)

  def run_phase(self, shared_input, key, members, runs, inputs):
    """One run of equal-shape batches of each member, on lanes."""
    prog = self.program(key[0], key[1])
    counts = [len(r) for r in runs]
    lanes, devices = self.lanes_for(len(members)), self.mesh.num_devices
    segment_steps = self.backend.settings.segment_steps
    if (key, lanes) not in self.slots:
      self.slots[key, lanes] = lanes_lib.choose_slots(
          counts, lanes, segment_steps, devices)
    plan = lanes_lib.plan_lanes(counts, lanes, segment_steps,
                                self.slots[key, lanes], devices)
    run = prog.run(shared_input, plan, runs, inputs, np.ones(len(members)),
                   (runs[0][0], inputs[0]))
    self.counter['executed_steps'] += plan.executed_steps
    self.counter['sequential_steps'] += plan.sequential_steps
    self.counter['segments'] += plan.num_segments
    return run.outputs, run.step_results

  def run_window(self, shared_input, clients):
    """``(output, step results)`` of each client, in window order."""
    segments = [_segments(b) for _, b, _ in clients]
    state = {i: cin for i, (_, _, cin) in enumerate(clients)}
    results = {i: [] for i in range(len(clients))}
    outputs = {}
    for i, (_, batches, cin) in enumerate(clients):
      if not batches:
        outputs[i] = self.no_steps(shared_input, cin)
    for j in range(max(len(s) for s in segments)):
      phase = collections.OrderedDict()
      for i, segs in enumerate(segments):
        if j < len(segs):
          key = (j == 0, j == len(segs) - 1, segs[j][0],
                 _signature(state[i]))
          phase.setdefault(key, []).append(i)
      for key, members in phase.items():
        runs = [clients[i][1][segments[i][j][1]:segments[i][j][2]]
                for i in members]
        outs, res = self.run_phase(shared_input, key, members, runs,
                                   [state[i] for i in members])
        for i, out, r in zip(members, outs, res):
          results[i].extend(r)
          if key[1]:
            outputs[i] = out
            del state[i]
          else:
            state[i] = out
    return [(outputs.pop(i), results.pop(i)) for i in range(len(clients))]

  def __call__(self, shared_input: PyTree,
               clients: Iterable[tuple[Any, Iterable[PyTree], PyTree]]
               ) -> Iterator[tuple[Any, PyTree, list[PyTree]]]:
    clients = [(cid, list(batches), cin) for cid, batches, cin in clients]
    if not clients:
      return
    backend, devices = self.backend, self.mesh.num_devices
    if backend.lanes_per_device is None:  # Fixed at the first call.
      backend._lanes = backend.settings.most_lanes(  # pylint: disable=protected-access
          shared_input, len(clients), devices)
    shared_input = self.mesh.put_replicated(shared_input)
    self.counter.clear()
    size = backend.window * backend.lanes_per_device * devices
    try:
      for start in range(0, len(clients), size):
        window = clients[start:start + size]
        done = self.run_window(shared_input, window)
        done.reverse()
        for cid, _, _ in window:  # Call order; no lingering references.
          output, results = done.pop()
          yield cid, output, results
    finally:
      stats.record('vmap_backend', clients=len(clients),
                   useful_steps=sum(len(b) for _, b, _ in clients),
                   lanes=backend.lanes_per_device * devices,
                   segment_steps=backend.settings.segment_steps,
                   **self.counter)


class VmapBackend(fedjax.ForEachClientBackend):
  """``for_each_client`` with clients streamed through vmapped lanes.

  Select it before building the algorithm (FedJAX binds the backend then).
  Clients run on :class:`~fedlite_jax.rounds.streaming.LaneStreams` lanes
  (optionally sharded over devices) in windows of ``window`` clients in call
  order, and come back in call order, as from FedJAX's default backend. A
  client's runs of equal-shape batches run as successive programs, the
  state carried between them; a step's state leaf of another shape or dtype
  but the same size (FedJAX's ``apfl``) is cast back.

  Args:
    mesh: the devices to split clients over; None: every local device.
    lanes_per_device, segment_steps: as
      :class:`~fedlite_jax.rounds.settings.LaneSettings` ('auto': at most
      the first call's clients per device); fixed at the first call.
    window: clients run (and held) at once, as a multiple of the lanes
      (>= 1).

  Raises:
    ValueError: a bad option; when run, several processes, or a step changing
      the state's structure or a leaf's size.
  """

  def __init__(self, mesh: Optional[sharding.ClientMesh] = None,
               lanes_per_device: int | str = 'auto', segment_steps: int = 4,
               window: int = 4):
    self.settings = settings_lib.LaneSettings(lanes_per_device,
                                              segment_steps)
    self._mesh = mesh
    self._lanes: Optional[int] = None
    self.window = check_int(window, 'window')

  @property
  def lanes_per_device(self) -> Optional[int]:
    """The resolved lanes per device (None: not yet)."""
    return self._lanes

  def __call__(self, client_init, client_step, client_final):
    mesh = self._mesh or sharding.make_client_mesh()
    if mesh.multi_process:
      raise errors.EngineConfigError(
          'VmapBackend runs the clients of one process; with '
          'several processes use the fedlite_jax round engines.')
    runner = _Runner(self, mesh, client_init, client_step, client_final)

    def run(shared_input: PyTree,
            clients: Iterable[tuple[Any, Iterable[PyTree], PyTree]]
            ) -> Iterator[tuple[Any, PyTree, list[PyTree]]]:
      return runner(shared_input, clients)
    return run
