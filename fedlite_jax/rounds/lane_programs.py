"""The compiled programs of clients streamed through lanes.

A lane-step (:func:`lane_step`) first finalizes the lanes whose client
ended (``slots`` rows per device), writes their next clients' initial
states into those rows in place, then takes one masked vmapped step. A
segment (:func:`build_lane_programs`) is an on-device ``scan`` of
``segment_steps`` lane-steps that skips the steps past the plan. The
programs run per device under ``shard_map``; lane states and sums stay on
the devices between calls. Design notes: docs/notes/engines.md.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fedlite_jax.common import PyTree
from fedlite_jax.rounds import ordering
from fedlite_jax.rounds import sharding

#: Names of the compiled programs (``jit(<name>)`` in JAX's compile events).
PROGRAM_NAMES = ('lanes_begin', 'lanes_segment', 'lanes_finish')


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """What one lane-step reads, besides the shared input and the carry.

  In a segment's inputs every leaf has a second axis of ``S`` steps.

  Attributes:
    batch: ``[lanes, ...]`` each lane's batch (zeros when masked).
    active: ``bool[lanes]`` whether the lane steps.
    fin_lane: ``int32[slots]`` device-local lane finalized (-1: none).
    fin_weight: ``float32[slots]`` its aggregation weight (0: none).
    start_input: ``[slots, ...]`` the client input of the client that each
      slot then starts on its lane (padding where none starts).
    start_on: ``bool[slots]`` whether the slot starts a client (only on a
      finalized lane).
  """
  batch: dict
  active: jax.Array
  fin_lane: jax.Array
  fin_weight: jax.Array
  start_input: PyTree
  start_on: jax.Array


jax.tree_util.register_dataclass(
    StepInputs, data_fields=['batch', 'active', 'fin_lane', 'fin_weight',
                             'start_input', 'start_on'], meta_fields=[])


def _rows(x: PyTree, idx: jax.Array) -> PyTree:
  """Rows ``idx`` (``int32[k]``, >= 0) of each leaf: one gather per leaf."""
  return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode='clip'), x)


def _where_rows(mask: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """Per-row ``where`` over the leading (lane) axis."""
  return jax.tree.map(
      lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
      new, old)


def weighted_sum(weights: jax.Array, outputs: PyTree) -> PyTree:
  """``sum_i where(w_i > 0, w_i * o_i, 0)`` over the leading axis.

  A row of weight 0 (a padding or finished lane) cannot bring a NaN into
  the sum.

  Args:
    weights: ``float32[k]``.
    outputs: leaves ``[k, ...]``.

  Returns:
    Leaves ``[...]`` in the outputs' dtypes.
  """
  def leaf(o):
    w = weights.reshape((-1,) + (1,) * (o.ndim - 1)).astype(o.dtype)
    return jnp.sum(jnp.where(w > 0, w * o, 0), axis=0)
  return jax.tree.map(leaf, outputs)


def start_slots(init: Callable) -> Callable:
  """Starts the slots' clients in place.

  Args:
    init: ``(shared, client_input) -> state``.

  Returns:
    ``start(shared, states, deps, x) -> states``: each slot's lane row of
    every state leaf replaced by ``init``'s state for the slot's
    ``x.start_input`` (``x`` a :class:`StepInputs`), one slot at a time in
    an on-device loop over the slots. The new rows depend on ``deps`` (the
    finalized outputs, :func:`ordering.ordered_after`), so XLA writes them
    after the finalization has read the old rows, without copying the
    states. A slot that starts no client leaves its lane's row unchanged.
  """
  def start(shared, states, deps, x: StepInputs):
    lanes = jnp.maximum(x.fin_lane, 0)
    after = ordering.token(deps)

    def one(i, states):
      lane = lanes[i]
      new = ordering.ordered_after(
          init(shared, jax.tree.map(
              lambda a: lax.dynamic_index_in_dim(a, i, 0, False),
              x.start_input)), after)

      def leaf(old, row):
        row = jnp.where(x.start_on[i], row[None],
                        lax.dynamic_index_in_dim(old, lane, 0, True))
        return lax.dynamic_update_index_in_dim(old, row, lane, 0)
      return jax.tree.map(leaf, states, new)

    return lax.fori_loop(0, x.fin_lane.shape[0], one, states)
  return start


def lane_transition(init: Callable, final: Callable,
                    collect: bool = False) -> Callable:
  """What a lane-step does where clients end, before its step.

  Args:
    init, final: as :class:`~fedlite_jax.rounds.streaming.LaneStreams`'s.
    collect: return the finalized outputs instead of adding them to ``acc``.

  Returns:
    ``transition(shared, states, acc, x) -> (states, acc, diag, output)``:
    the slots' clients finalized from their lanes' rows (their weighted
    outputs added to ``acc``, ``[1, ...]`` per leaf, unless collecting),
    then their next clients started in place (:func:`start_slots`);
    ``diag`` and ``output`` are ``[slots, ...]`` (``output`` None unless
    collecting).
  """
  start = start_slots(init)

  def transition(shared, states, acc, x: StepInputs):
    out, diag = jax.vmap(final, in_axes=(None, 0),
                         axis_size=x.fin_lane.shape[0])(
                             shared, _rows(states, jnp.maximum(x.fin_lane, 0)))
    if not collect:
      acc = jax.tree.map(lambda a, s: a + s[None], acc,
                         weighted_sum(x.fin_weight, out))
      out = None
    return start(shared, states, (acc, diag, out), x), acc, diag, out
  return transition


def lane_step(init: Callable, step: Callable, final: Callable,
              collect: bool = False) -> Callable:
  """One lane-step: finalize and start where clients end, then step.

  Args:
    init, step, final: as :class:`~fedlite_jax.rounds.streaming.LaneStreams`'s.
    collect: return the finalized outputs instead of adding them to ``acc``.

  Returns:
    ``body(shared, states, acc, x) -> (states, acc, diag, output, result)``
    (``x`` a :class:`StepInputs`): ``states`` ``[lanes, ...]``; ``acc`` the
    weighted sums (``[1, ...]`` per leaf); ``diag`` and ``output``
    ``[slots, ...]`` of the finalized clients (zeros at a step where no
    client ends; ``output`` None unless collecting); ``result``
    ``[lanes, ...]`` the step results. The transition
    (:func:`lane_transition`) runs in a ``lax.cond`` only at steps where
    some slot is in use; its other branch passes states and sums through.
  """
  transition = lane_transition(init, final, collect)

  def body(shared, states, acc, x: StepInputs):
    shapes = jax.eval_shape(transition, shared, states, acc, x)[2:]
    idle = lambda shared, states, acc, x: (states, acc) + jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    states, acc, diag, out = lax.cond(jnp.any(x.fin_lane >= 0), transition,
                                      idle, shared, states, acc, x)
    stepped, result = jax.vmap(step, axis_size=x.active.shape[0])(
        states, x.batch)
    return _where_rows(x.active, stepped, states), acc, diag, out, result
  return body


class LanePrograms(NamedTuple):
  """The jitted programs of one (client update, mesh, segment length).

  Attributes:
    begin: ``(shared, inputs, lane_ids) -> (states, acc)``: each lane's
      first client started, the sums zero.
    segment: ``(shared, states, acc, x, num_steps) -> (states, acc, diag,
      output, result)``: ``num_steps <= S`` lane-steps (``x`` a
      :class:`StepInputs` of ``[rows, S, ...]`` leaves); per-step outputs
      ``[rows, S, ...]`` (steps not run stay zero; ``output`` and
      ``result`` None unless collecting).
    finish: ``(shared, states, acc, weights) -> (acc, diag, output)``: the
      lanes' last clients finalized.
    reduce: ``acc -> sums`` over the devices (replicated).
  """
  begin: Callable
  segment: Callable
  finish: Callable
  reduce: Callable


def _segment_fn(body: Callable, segment_steps: int, collect: bool):
  """``lanes_segment``: ``body`` in a ``scan`` of ``segment_steps`` steps,
  each past ``num_steps`` skipped by a ``lax.cond``."""
  S = segment_steps

  def lanes_segment(shared, states, acc, inputs, num_steps):
    at = lambda i: jax.tree.map(
        lambda a: lax.dynamic_index_in_dim(a, i, 1, keepdims=False), inputs)
    shapes = jax.eval_shape(body, shared, states, acc, at(0))[2:]
    if not collect:
      shapes = (shapes[0], None, None)
    bufs = jax.tree.map(
        lambda s: jnp.zeros((s.shape[0], S) + s.shape[1:], s.dtype), shapes)

    def one_step(i, carry):
      states, acc, bufs = carry
      states, acc, *outs = body(shared, states, acc, at(i))
      if not collect:
        outs = (outs[0], None, None)
      bufs = jax.tree.map(
          lambda b, o: lax.dynamic_update_index_in_dim(b, o, i, 1),
          bufs, tuple(outs))
      return states, acc, bufs

    states, acc, bufs = lax.fori_loop(
        0, S, lambda i, c: lax.cond(i < num_steps, one_step,
                                    lambda i, c: c, i, c),
        (states, acc, bufs))
    return (states, acc) + tuple(bufs)
  return lanes_segment


def _begin_finish(init: Callable, final: Callable, collect: bool):
  """``(lanes_begin, lanes_finish)`` before ``shard_map``."""
  def lanes_begin(shared, inputs, lane_ids):
    states = jax.vmap(init, in_axes=(None, 0), axis_size=lane_ids.shape[0])(
        shared, inputs)
    one = jax.tree.map(lambda a: a[0], states)
    out_shape = jax.eval_shape(final, shared, one)[0]
    acc = jax.tree.map(lambda s: jnp.zeros((1,) + s.shape, s.dtype),
                       out_shape)
    return states, acc

  def lanes_finish(shared, states, acc, weights):
    out, diag = jax.vmap(final, in_axes=(None, 0),
                         axis_size=weights.shape[0])(shared, states)
    if collect:
      return acc, diag, out
    acc = jax.tree.map(lambda a, o: a + o[None], acc,
                       weighted_sum(weights, out))
    return acc, diag, None
  return lanes_begin, lanes_finish


def build_lane_programs(init: Callable, step: Callable, final: Callable, *,
                        mesh: sharding.ClientMesh, segment_steps: int,
                        collect: bool = False) -> LanePrograms:
  """Jits the lane programs of a client update, sharded over ``mesh``.

  Args:
    init, step, final: as :class:`~fedlite_jax.rounds.streaming.LaneStreams`'s.
    mesh: the devices the lanes are split over.
    segment_steps: ``S``, lane-steps per ``segment`` call (>= 1).
    collect: False: outputs weighted and summed on the devices (the sums
      donated); True: returned per client.

  Returns:
    A :class:`LanePrograms`; each compiles once per argument shapes.
  """
  body = lane_step(init, step, final, collect)
  begin, finish = _begin_finish(init, final, collect)
  segment = _segment_fn(body, segment_steps, collect)
  lanes_in = P(sharding.AXIS)

  def shard(fn, in_specs, out_specs, donate=()):
    mapped = jax.shard_map(fn, mesh=mesh.mesh, in_specs=in_specs,
                           out_specs=out_specs, check_vma=False)
    mapped.__name__ = fn.__name__
    return jax.jit(mapped, donate_argnums=donate)

  def lanes_reduce(acc):
    return jax.tree.map(lambda x: x.sum(0), acc)

  return LanePrograms(
      begin=shard(begin, (P(), lanes_in, lanes_in), (lanes_in, lanes_in)),
      segment=shard(segment, (P(), lanes_in, lanes_in, lanes_in, P()),
                    (lanes_in,) * 5, donate=(1,) if collect else (1, 2)),
      finish=shard(finish, (P(),) + (lanes_in,) * 3, (lanes_in,) * 3,
                   donate=() if collect else (2,)),
      reduce=jax.jit(lanes_reduce, out_shardings=mesh.replicated))
