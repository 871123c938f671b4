"""Clients streamed through lanes: one compiled program for every round.

Three programs of fixed shape per (client update, lanes, segment steps,
slots): ``lanes_begin`` starts each lane's first client, ``lanes_segment``
runs ``S`` unrolled steps of every lane (finalizing and starting clients in
``slots`` gathered rows per step), ``lanes_finish`` finalizes the lanes'
last clients. They run per device under ``shard_map``; state and sums stay
on the devices between calls. Notes: docs/notes/rounds.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np

from fedlite_jax.common import PyTree
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import sharding

Batch = dict

#: Names of the compiled programs (``jit(<name>)`` in JAX's compile events).
PROGRAM_NAMES = ('lanes_begin', 'lanes_segment', 'lanes_finish')


def _rows(x, idx):
  return jax.tree.map(lambda a: a[idx], x)


def _where_rows(mask, new, old):
  """Per-row ``where`` over the leading (lane) axis."""
  return jax.tree.map(
      lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
      new, old)


def _weighted_sum(weights, outputs):
  """``sum_i where(w_i > 0, w_i * o_i, 0)`` over the leading axis; a row of
  weight 0 (a padding or finished lane) cannot bring a NaN into the sum."""
  def leaf(o):
    w = weights.reshape((-1,) + (1,) * (o.ndim - 1)).astype(o.dtype)
    return jnp.sum(jnp.where(w > 0, w * o, 0), axis=0)
  return jax.tree.map(leaf, outputs)


def _zeros_like(tree: PyTree) -> PyTree:
  """Host zeros in the shapes and dtypes of ``tree``'s leaves."""
  return jax.tree.map(
      lambda x: np.zeros(np.shape(x), jnp.result_type(x)), tree)


def _stack(items: Sequence[PyTree], shape: tuple[int, ...]) -> PyTree:
  """Leaves stacked to ``shape + leaf shape``: on the device if any item is
  there (a carried client state), else on the host."""
  def leaf(*xs):
    xp = jnp if any(isinstance(x, jax.Array) for x in xs) else np
    return xp.stack([xp.asarray(x) for x in xs]).reshape(
        shape + np.shape(xs[0]))
  return jax.tree.map(leaf, *items)


class LaneStreams:
  """A client update run on lanes that stream clients (see module doc).

  Args:
    init: ``(shared, client_input) -> state``.
    step: ``(state, batch) -> (state, step_result)``.
    final: ``(shared, state) -> (output, diagnostics)``.
    mesh: the :class:`~fedlite_jax.rounds.sharding.ClientMesh` (None: the
      first local device).
    collect: False: outputs are weighted and summed on the devices; True:
      returned per client (``step_result`` too).
  """

  def __init__(self, init: Callable, step: Callable, final: Callable, *,
               mesh: Optional[sharding.ClientMesh] = None,
               collect: bool = False):
    if mesh is None:
      mesh = sharding.ClientMesh(Mesh(np.asarray(jax.local_devices()[:1]),
                                      (sharding.AXIS,)))
    self.mesh = mesh
    self.collect = collect
    self._programs: dict[tuple, tuple] = {}
    self._fns = init, step, final
    self._reduce = jax.jit(lambda acc: jax.tree.map(lambda x: x.sum(0), acc),
                           out_shardings=mesh.replicated)

  def _build(self, segment_steps: int):
    """The three jitted programs for ``segment_steps`` steps."""
    init, step, final = self._fns
    collect = self.collect
    lanes_in = P(sharding.AXIS)
    mesh = self.mesh.mesh

    def lanes_begin(shared, inputs, lane_ids):
      num_lanes = lane_ids.shape[0]
      states = jax.vmap(init, in_axes=(None, 0), axis_size=num_lanes)(
          shared, inputs)
      one = _rows(states, 0)
      out_shape = jax.eval_shape(final, shared, one)[0]
      acc = jax.tree.map(lambda s: jnp.zeros((1,) + s.shape, s.dtype),
                         out_shape)
      return states, acc

    def lanes_segment(shared, states, acc, batches, active, fin_lane, fin_w,
                      start_inputs, start_on):
      num_lanes, num_slots = active.shape[0], fin_lane.shape[0]
      diags, outputs, results = [], [], []
      for s in range(segment_steps):  # Unrolled: no loop on XLA:CPU.
        lane = fin_lane[:, s]
        out, diag = jax.vmap(final, in_axes=(None, 0), axis_size=num_slots)(
            shared, _rows(states, jnp.maximum(lane, 0)))
        diags.append(diag)
        if collect:
          outputs.append(out)
        else:
          acc = jax.tree.map(lambda a, o: a + o[None], acc,
                             _weighted_sum(fin_w[:, s], out))
        new = jax.vmap(init, in_axes=(None, 0), axis_size=num_slots)(
            shared, jax.tree.map(lambda x, s=s: x[:, s], start_inputs))
        target = jnp.where(start_on[:, s], lane, num_lanes)
        states = jax.tree.map(lambda x, n: x.at[target].set(n, mode='drop'),
                              states, new)
        stepped, result = jax.vmap(step, axis_size=num_lanes)(
            states, jax.tree.map(lambda x, s=s: x[:, s], batches))
        states = _where_rows(active[:, s], stepped, states)
        results.append(result)
      stack = lambda xs: jax.tree.map(lambda *r: jnp.stack(r, 1), *xs)
      return (states, acc, stack(diags),
              stack(outputs) if collect else None,
              stack(results) if collect else None)

    def lanes_finish(shared, states, acc, weights):
      out, diag = jax.vmap(final, in_axes=(None, 0),
                           axis_size=weights.shape[0])(shared, states)
      if collect:
        return acc, diag, out
      acc = jax.tree.map(lambda a, o: a + o[None], acc,
                         _weighted_sum(weights, out))
      return acc, diag, None

    def shard(fn, in_specs, out_specs, donate=()):
      mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                             out_specs=out_specs, check_vma=False)
      mapped.__name__ = fn.__name__
      return jax.jit(mapped, donate_argnums=donate)

    begin = shard(lanes_begin, (P(), lanes_in, lanes_in), (lanes_in, lanes_in))
    # The sums are donated where they are updated (not when collecting).
    segment = shard(lanes_segment, (P(),) + (lanes_in,) * 8,
                    (lanes_in,) * 5, donate=(1,) if collect else (1, 2))
    finish = shard(lanes_finish, (P(),) + (lanes_in,) * 3,
                   (lanes_in,) * 3, donate=() if collect else (2,))
    return begin, segment, finish

  def run(self, shared: PyTree, plan: lanes_lib.LanePlan,
          batches: Sequence[Sequence[Batch]], inputs: Sequence[PyTree],
          weights: Sequence[float], template: tuple[Batch, PyTree]
          ) -> tuple[PyTree, list[Any], Optional[list[Any]],
                     Optional[list[list[Any]]]]:
    """Runs one round as planned.

    Args:
      shared: the shared input (the same for every client).
      plan: the round's :class:`~fedlite_jax.rounds.lanes.LanePlan`; its
        devices must be the mesh's.
      batches, inputs, weights: per client (cohort position); only the
        clients on this process's lanes are read.
      template: ``(batch, client_input)`` whose zeros fill masked steps.

    Returns:
      ``(weighted sum or None, diagnostics, outputs or None, step results or
      None)``: the sum over every client as process-local arrays; per
      client its diagnostics (NumPy), and with ``collect`` its output and
      its step results (one per batch, NumPy).
    """
    mesh = self.mesh
    if plan.devices != mesh.num_devices:
      raise ValueError(f'The plan is for {plan.devices} devices, the mesh has '
                       f'{mesh.num_devices}.')
    key = (plan.segment_steps,)
    if key not in self._programs:
      self._programs[key] = self._build(plan.segment_steps)
    begin, segment, finish = self._programs[key]
    procs = mesh.num_processes
    per_proc = plan.devices // procs
    p = mesh.process_index
    lanes = slice(p * per_proc * plan.lanes_per_device,
                  (p + 1) * per_proc * plan.lanes_per_device)
    devices = slice(p * per_proc, (p + 1) * per_proc)
    S, F = plan.segment_steps, plan.slots
    pad_batch = _zeros_like(template[0])
    pad_input = _zeros_like(template[1])
    client_input = lambda c: pad_input if c < 0 else inputs[c]
    stacked = _stack

    def put(tree, rows):
      if mesh.multi_process:
        return jax.tree.map(
            lambda x: mesh.put_clients(np.asarray(x), rows), tree)
      return jax.device_put(tree, mesh.client_sharding)
    num_lanes, num_slots = plan.lanes, plan.devices * F
    weight = np.asarray(weights, np.float32)
    weight_of = lambda c: np.where(c >= 0, weight[np.maximum(c, 0)], 0.)

    shared = mesh.put_replicated(shared)
    states, acc = begin(shared, put(stacked(
        [client_input(c) for c in plan.begin[lanes]], (-1,)), num_lanes),
                        put(np.arange(plan.lanes)[lanes], num_lanes))
    seg_diags, seg_outputs, seg_results = [], [], []
    for k in range(plan.num_segments):
      t = slice(k * S, (k + 1) * S)
      who = plan.client[t, lanes].T          # [lanes, S]
      which = plan.batch[t, lanes].T
      step_batches = [batches[c][b] if c >= 0 else pad_batch
                      for c, b in zip(who.ravel(), which.ravel())]
      # Slots as rows: [S, devices, F] -> [devices * F, S].
      slot = lambda a: np.transpose(a[t, devices], (1, 2, 0)).reshape(
          -1, S)
      fin_client, started = slot(plan.finalize_client), slot(
          plan.start_client)
      states, acc, diags, outputs, results = segment(
          shared, states, acc,
          put(stacked(step_batches, who.shape), num_lanes),
          put(who >= 0, num_lanes),
          put(slot(plan.finalize), num_slots),
          put(weight_of(fin_client).astype(np.float32), num_slots),
          put(stacked([client_input(c) for c in started.ravel()],
                      started.shape), num_slots),
          put(started >= 0, num_slots))
      seg_diags.append(diags)
      seg_outputs.append(outputs)
      seg_results.append(results)
    acc, fin_diags, fin_outputs = finish(
        shared, states, acc,
        put(weight_of(plan.finish[lanes]).astype(np.float32), num_lanes))
    total = None if self.collect else jax.tree.map(
        lambda x: x.addressable_data(0), self._reduce(acc))
    return (total,) + self._per_client(plan, seg_diags, seg_outputs,
                                       seg_results, fin_diags, fin_outputs,
                                       len(batches))

  def _per_client(self, plan, seg_diags, seg_outputs, seg_results, fin_diags,
                  fin_outputs, num_clients):
    """Diagnostics (and outputs, step results) per client, in cohort order."""
    mesh = self.mesh
    got = mesh.gather((seg_diags, fin_diags))
    seg_diags, fin_diags = got
    S, F = plan.segment_steps, plan.slots
    diags: list[Any] = [None] * num_clients
    outputs: Optional[list[Any]] = [None] * num_clients if self.collect \
        else None
    for k, d in enumerate(seg_diags):
      for s in range(S):
        for dev in range(plan.devices):
          for f in range(F):
            c = plan.finalize_client[k * S + s, dev, f]
            if c >= 0:
              row = dev * F + f
              diags[c] = jax.tree.map(lambda x: x[row, s], d)
              if outputs is not None:
                outputs[c] = jax.tree.map(lambda x: x[row, s],
                                          seg_outputs[k])
    for lane, c in enumerate(plan.finish):
      if c >= 0:
        diags[c] = jax.tree.map(lambda x: x[lane], fin_diags)
        if outputs is not None:
          outputs[c] = jax.tree.map(lambda x: x[lane], fin_outputs)
    results = None
    if self.collect:
      results = [[] for _ in range(num_clients)]
      host = jax.device_get(seg_results)
      for k, r in enumerate(host):
        for s in range(S):
          for lane in range(plan.lanes):
            c = plan.client[k * S + s, lane]
            if c >= 0:
              results[c].append(jax.tree.map(lambda x: x[lane, s], r))
    return diags, outputs, results
