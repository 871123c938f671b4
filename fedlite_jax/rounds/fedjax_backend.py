"""A vmapped (and device-sharded) ``fedjax.ForEachClientBackend``.

Clients run as :class:`~fedlite_jax.rounds.engine.VmappedClients` programs
in chunks of similar step counts and come back chunk by chunk (reordered, as
from FedJAX's ``pmap`` backend), in call order within a chunk. Counts go to
:func:`~fedlite_jax.rounds.chunking.recording_stats` as ``'vmap_backend'``.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Iterator, Optional

import fedjax
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.rounds import chunking
from fedlite_jax.rounds import engine as engine_lib
from fedlite_jax.rounds import sharding
from fedlite_jax.common import PyTree


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


class VmapBackend(fedjax.ForEachClientBackend):
  """``for_each_client`` as vmapped, chunked, optionally sharded programs.

  Select it before building the algorithm (FedJAX binds the backend then).
  A client's runs of equal-shape batches run as successive programs, the
  state carried between them; a step's state leaf of another shape or dtype
  but the same size (FedJAX's ``apfl``) is cast back.

  Args:
    mesh: the devices to split clients over; None: every local device.
    step_bucket, clients_per_chunk: as
      :class:`~fedlite_jax.rounds.VmapEngine`.

  Raises:
    ValueError: a bad option; when run, several processes, or a step changing
      the state's structure or a leaf's size.
  """

  def __init__(self, mesh: Optional[sharding.ClientMesh] = None,
               step_bucket: str | int = 'grid',
               clients_per_chunk: int | str | None = 'auto'):
    chunking.bucket_steps(1, step_bucket)  # Validates the policy.
    if clients_per_chunk != 'auto':
      chunking.resolve_clients_per_chunk(clients_per_chunk, 0)
    self._mesh = mesh
    self._bucket = step_bucket
    self._per_chunk_setting = clients_per_chunk
    self._per_chunk: Optional[int] = None

  @property
  def clients_per_chunk(self) -> Optional[int]:
    """The resolved chunk size per device (0: no limit; None: not yet)."""
    return self._per_chunk

  def __call__(self, client_init, client_step, client_final):
    mesh = self._mesh or sharding.make_client_mesh()
    if mesh.multi_process:
      raise ValueError('VmapBackend runs the clients of one process; with '
                       'several processes use the fedlite_jax round engines.')
    device_mesh = mesh if mesh.num_devices > 1 else None
    devices = mesh.num_devices if device_mesh is not None else 1
    programs: dict[tuple[bool, bool], engine_lib.VmappedClients] = {}

    def program(first: bool, last: bool) -> engine_lib.VmappedClients:
      """init, steps, final; not first/last: from/to a carried state."""
      if (first, last) not in programs:

        def init(shared_input, client_input):
          if first:
            return client_init(shared_input, client_input)
          return client_input

        def step(state, batch):
          new_state, step_result = client_step(state, batch)
          return _cast_like(new_state, state), step_result

        def final(shared_input, state):
          return client_final(shared_input, state) if last else state

        programs[first, last] = engine_lib.VmappedClients(
            init, step, final, mesh=device_mesh)
      return programs[first, last]

    no_steps = jax.jit(lambda s, c: client_final(s, client_init(s, c)))

    def lanes_for(count: int, most: int) -> int:
      """The smallest of ``devices * 2^k`` and ``most`` holding ``count``."""
      lanes = devices
      while lanes < count and lanes < most:
        lanes *= 2
      return max(min(lanes, most), -(-count // devices) * devices)

    def run(shared_input: PyTree,
            clients: Iterable[tuple[Any, Iterable[PyTree], PyTree]]
            ) -> Iterator[tuple[Any, PyTree, list[PyTree]]]:
      clients = [(cid, list(batches), cin) for cid, batches, cin in clients]
      if not clients:
        return
      if self._per_chunk is None:
        self._per_chunk = chunking.resolve_clients_per_chunk(
            self._per_chunk_setting, chunking.tree_bytes(shared_input))
      per_chunk = self._per_chunk
      segments = [_segments(b) for _, b, _ in clients]
      groups = collections.OrderedDict()
      empty = []
      for i, (_, batches, cin) in enumerate(clients):
        if not batches:
          empty.append(i)
          continue
        key = (_signature(cin), segments[i][0][0])
        groups.setdefault(key, []).append(i)
      if device_mesh is not None:
        shared_input = device_mesh.put_replicated(shared_input)
      counts = collections.Counter()

      def run_chunk(members: list[int], lanes: int):
        """Runs the chunk's segments; returns per member (output, results)."""
        state = {i: clients[i][2] for i in members}
        results = {i: [] for i in members}
        outputs = {}
        for j in range(max(len(segments[i]) for i in members)):
          phase = collections.OrderedDict()
          for i in members:
            if j < len(segments[i]):
              last = j == len(segments[i]) - 1
              phase.setdefault((segments[i][j][0], last), []).append(i)
          for (_, last), part in phase.items():
            seg_batches = [clients[i][1][segments[i][j][1]:segments[i][j][2]]
                           for i in part]
            longest = max(len(b) for b in seg_batches)
            steps = chunking.bucket_steps(longest, self._bucket)
            part_lanes = lanes_for(len(part), lanes)
            prog = program(j == 0, last)
            out, step_results = prog(shared_input, seg_batches,
                                     [state[i] for i in part], steps,
                                     lanes=part_lanes)
            counts['padded_steps'] += part_lanes * steps
            counts['chunks'] += 1
            rows = prog.rows(part_lanes)
            step_results = jax.device_get(step_results)
            leaves, treedef = jax.tree.flatten(out)
            for k, i in enumerate(part):
              r = int(rows[k])
              results[i].extend(
                  jax.tree.map(lambda x, r=r, t=t: x[r, t], step_results)
                  for t in range(len(seg_batches[k])))
              row = jax.tree.unflatten(treedef, [x[r] for x in leaves])
              if last:
                outputs[i] = row
                del state[i]
              else:
                state[i] = row
            del out, leaves
        return [(i, outputs.pop(i), results.pop(i)) for i in sorted(members)]

      try:
        for i in empty:
          cid, _, cin = clients[i]
          counts['clients'] += 1
          counts['chunks'] += 1
          yield cid, no_steps(shared_input, cin), []
        for members in groups.values():
          steps = [len(clients[i][1]) for i in members]
          for chunk in chunking.plan_chunks(steps, per_chunk, self._bucket,
                                              devices):
            done = run_chunk([members[m] for m in chunk.members], chunk.lanes)
            counts['clients'] += len(done)
            counts['client_steps'] += sum(len(clients[i][1])
                                          for i, _, _ in done)
            done.reverse()
            while done:  # No lingering reference to a yielded output.
              i, output, results = done.pop()
              yield clients[i][0], output, results
      finally:
        chunking.record('vmap_backend', per_chunk, **counts)

    return run
