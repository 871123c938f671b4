"""Clients streamed through lanes: one compiled program for every round.

Three programs of fixed shape per (client update, lanes, segment steps,
slots, loop): ``lanes_begin`` starts each lane's first client,
``lanes_segment`` runs up to ``S`` steps of every lane, ``lanes_finish``
finalizes the lanes' last clients. A lane-step (:func:`lane_step`) first
finalizes the lanes whose client ended (``slots`` rows), writes their
next clients' initial states into those rows in place, then takes one
masked vmapped step. The segment's steps are an on-device loop of ``S`` steps
that skips the steps past the plan (``loop='scan'``), a loop with a run-time
trip count (``'while'``), a loop of ``S`` steps with no conditional at all
(``'fixed'``: nothing is read back to the host), unrolled (``'unroll'``:
XLA:CPU with ``lax`` convolutions), or no segment program at all
(``'host'``: the host calls ``lanes_step``, the masked step, at every
step, after ``lanes_transition``, the finalizations and starts, at the
steps where clients end). The programs run per
device under ``shard_map``; state and sums stay on the devices between
calls. When every client's batches are rows of one
``device_rows.RowTable``, a segment receives the rows and each lane-step
gathers its batches from the table on the device. Notes:
docs/notes/rounds.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np

from fedlite_jax.common import PyTree
from fedlite_jax.rounds import lanes as lanes_lib
from fedlite_jax.rounds import ordering
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import sharding

Batch = dict

#: Names of the compiled programs (``jit(<name>)`` in JAX's compile events).
PROGRAM_NAMES = ('lanes_begin', 'lanes_segment', 'lanes_finish')

#: The programs that run lane-steps: a segment's, or the two of a ``'host'``
#: loop (the masked step; the finalizations and starts before it where
#: clients end).
STEP_PROGRAM_NAMES = ('lanes_segment', 'lanes_step', 'lanes_transition')

#: How a segment runs its steps: ``'unroll'`` (a Python loop traced into one
#: program); ``'scan'`` (an on-device loop of ``S`` steps, each step past the
#: planned count skipped by a ``lax.cond``: one traced step, so compiling
#: costs one step's compile, and the round's last segment computes only its
#: planned steps; XLA knows the trip count, so XLA:GPU need not read a
#: loop predicate back: on an H200, FEMNIST rounds of 0.127 s against
#: 0.155 s with ``'while'`` (that run may have shared the GPU with an
#: orphaned benchmark worker), though its calls still held the host ~11 ms
#: each, cause not yet traced); ``'while'``
#: (an on-device loop whose trip count is given at run time: XLA:GPU copies
#: each iteration's predicate to the host, so the call blocks until the
#: segment ends, ~15 ms per FEMNIST segment on an H200, and the next
#: segment's inputs cannot be prepared meanwhile); ``'fixed'`` (an
#: on-device loop of ``S`` steps with no ``lax.cond``: every step finalizes
#: and starts its slots, idle ones masked, and the last segment runs its
#: padding steps masked, so executed steps are rounded up to a multiple of
#: ``S``; XLA:GPU blocks the host on every conditional, reading its
#: predicate back (``ConditionalThunk``), and on no known-trip-count loop,
#: so a call returns once queued and the host prepares the next segment
#: while the device runs this one; unmeasured on a GPU); or ``'auto'``: scan,
#: except unroll on CPU for a client step with a convolution (XLA:CPU runs
#: convolutions in a ``while`` loop ~13x slower, jax-ml/jax#12868; im2col
#: convolutions are matmuls and scan there); ``'host'`` (no loop and no
#: conditional on the device: the host calls the masked step once per
#: planned step, and before it the finalizations and starts where the plan
#: says clients end, so that XLA:GPU never reads a predicate back and never
#: copies the lane states through a conditional's branches (it does, in a
#: ``scan`` or ``while`` segment: ``bench_lane_cost.py``, H200 target);
#: the step is compiled once, alone; each call costs host time (about 1 us
#: per array argument on XLA:CPU); slower on XLA:CPU, unmeasured on a GPU).
LOOPS = ('auto', 'unroll', 'scan', 'while', 'fixed', 'host')


def runs_planned_steps(loop: str) -> bool:
  """Whether a resolved ``loop`` computes only the plan's steps in the
  round's last segment (:attr:`LanePlan.dynamic_steps`)."""
  return loop in ('scan', 'while', 'host')


def has_convolution(fn: Callable, *args) -> bool:
  """Whether ``fn(*args)`` (traced with ``jax.make_jaxpr``, not run) holds
  a ``conv_general_dilated``, nested jaxprs included: the case in which
  XLA:CPU runs a ``while`` loop ~13x slower (jax-ml/jax#12868).

  Args:
    fn: any traceable function.
    *args: its arguments (arrays or ``jax.ShapeDtypeStruct`` values).

  Raises:
    Whatever tracing ``fn`` raises (e.g. TypeError for bad shapes).
  """
  return 'conv_general_dilated' in str(jax.make_jaxpr(fn)(*args))


def resolve_loop(loop: str, step: Optional[Callable] = None,
                 *example: Any) -> str:
  """``loop`` resolved (:data:`LOOPS` but ``'auto'``); ``'auto'``
  on CPU traces ``step(*example)`` (unroll if it convolves; without a
  ``step``, unroll).

  Raises:
    ValueError: ``loop`` not in :data:`LOOPS`.
  """
  if loop not in LOOPS:
    raise ValueError(f'segment loop must be one of {LOOPS}; got {loop!r}.')
  if loop != 'auto':
    return loop
  if jax.default_backend() != 'cpu':
    return 'scan'
  return 'unroll' if step is None or has_convolution(step, *example) \
      else 'scan'


def _rows(x, idx):
  """Rows ``idx`` (``int32[k]``, >= 0) of each leaf: one gather per leaf.
  XLA's cost model charges a fused gather its whole operand (every lane),
  though it reads ``k`` rows; one dynamic slice per row is charged only its
  row but made the Transformer's segment compile in 1.89-2.00x the time of
  the plain steps it replaces, against 1.34-1.40x with the gathers
  (XLA:CPU, 39 lanes, 8 slots; docs/notes/rounds.md)."""
  return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode='clip'), x)


def _where_rows(mask, new, old):
  """Per-row ``where`` over the leading (lane) axis."""
  return jax.tree.map(
      lambda n, o: jnp.where(mask.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
      new, old)


def _at(x: 'StepInputs', s, table) -> 'StepInputs':
  """Step ``s`` (static or traced) of a segment's ``[rows, S]`` inputs;
  with a row table, the lanes' batches gathered from it."""
  if isinstance(s, int):
    x = jax.tree.map(lambda a: a[:, s], x)
  else:
    x = jax.tree.map(
        lambda a: lax.dynamic_index_in_dim(a, s, 1, keepdims=False), x)
  if table is None:
    return x
  return dataclasses.replace(x, batch=jax.tree.map(
      lambda t: jnp.take(t, x.batch, axis=0, mode='clip'), table))


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


_POOLS: dict[tuple[str, int], concurrent.futures.ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _local_first(batches: Sequence[Sequence[Batch]]) -> int:
  """The first client whose batches this process holds."""
  return next(i for i, b in enumerate(batches)
              if not isinstance(b, remote.RemoteBatches))


def _row_table(batches: Sequence[Sequence[Batch]]):
  """The ``device_rows.RowTable`` that every local client's batches are
  rows of (``batching.TableBatches``), or None when none is.

  Raises:
    ValueError: some clients' batches are table rows and others are not,
      or rows of different tables (a round reads one table).
  """
  local = [b for b in batches if not isinstance(b, remote.RemoteBatches)]
  tables = {id(getattr(b, 'row_table', None)): getattr(b, 'row_table', None)
            for b in local}
  if len(tables) > 1:
    raise ValueError(
        f'A round\'s clients read {len(tables)} different sources of '
        'batches (row tables and host batches); the lane engine reads one: '
        'wrap every client with the same device_rows.RowTable, or none.')
  return next(iter(tables.values()))


def _pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
  """A process-wide pool of ``workers`` threads named ``name``, made on
  first use and shared by every engine (no threads per engine)."""
  with _POOLS_LOCK:
    if (name, workers) not in _POOLS:
      _POOLS[name, workers] = concurrent.futures.ThreadPoolExecutor(
          max_workers=workers, thread_name_prefix=name)
    return _POOLS[name, workers]


@dataclasses.dataclass(frozen=True)
class StepInputs:
  """What one lane-step reads, besides the shared input and the carry.

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
  batch: Batch
  active: jax.Array
  fin_lane: jax.Array
  fin_weight: jax.Array
  start_input: PyTree
  start_on: jax.Array


jax.tree_util.register_dataclass(
    StepInputs, data_fields=['batch', 'active', 'fin_lane', 'fin_weight',
                             'start_input', 'start_on'], meta_fields=[])


#: How a lane-step writes its slots' next clients into the lane states:
#: ``'rows'`` (one ``dynamic_update_slice`` per state leaf and slot, in an
#: on-device loop over the slots that runs ``init`` for one slot at a time:
#: XLA:CPU's cost analysis charges the rows written) or ``'scatter'`` (one
#: scatter per leaf with unique indices, a slot that starts nothing out of
#: bounds and dropped: one kernel per leaf for all slots, where the loop
#: launches ``slots`` per leaf; cost analysis charges a fused scatter its
#: whole operand). The rows run in the lane-step's conditional, where a
#: client ends; the scatters after it, at every step (so that no lane
#: state passes through the conditional: :func:`lane_step`). Both update
#: in place and give the same states; which is faster on a GPU is
#: unmeasured.
STARTS = ('rows', 'scatter')


def start_slots(init: Callable, unroll: bool = False,
                method: str = 'rows') -> Callable:
  """Starts the slots' clients: each slot's lane row of every state leaf
  replaced in place by ``init``'s state (``method``: :data:`STARTS`;
  ``unroll``: the ``'rows'`` loop as a Python loop, for cost analysis,
  which counts a loop body once).

  Returns:
    ``start(shared, states, deps, x) -> states``: ``x`` a
    :class:`StepInputs`; the new rows are made to depend on ``deps`` (the
    finalized outputs, :func:`ordering.ordered_after`), so that XLA writes
    the rows after the finalization has read them, in place, without
    copying the states. A slot that starts no client leaves its lane's row
    as it is.

  Raises:
    ValueError: ``method`` not in :data:`STARTS`.
  """
  if method not in STARTS:
    raise ValueError(f'starts={method!r}: allowed values are '
                     f'{", ".join(STARTS)}.')

  def start(shared, states, deps, x: StepInputs):
    num_slots = x.fin_lane.shape[0]
    if method == 'scatter':
      new = jax.vmap(init, in_axes=(None, 0), axis_size=num_slots)(
          shared, x.start_input)
      new = ordering.ordered_after(new, deps)

      def scatter(old, rows):
        # Unused slots: distinct rows past the end, dropped.
        at = jnp.where(x.start_on, x.fin_lane,
                       old.shape[0] + jnp.arange(num_slots))
        return old.at[at].set(rows, mode='drop', unique_indices=True)
      return jax.tree.map(scatter, states, new)
    lanes = jnp.maximum(x.fin_lane, 0)
    after = ordering.token(deps)

    def one(i, states):
      lane = lanes[i]
      # init runs inside the loop, one slot at a time: its row goes
      # straight into the lane's row (init's reads fused into the write),
      # where a vmapped init wrote [slots, ...] new rows first (Transformer,
      # 39 lanes, 8 slots: 0.67 GB at every step, XLA:CPU).
      new = ordering.ordered_after(
          init(shared, jax.tree.map(
              lambda a: lax.dynamic_index_in_dim(a, i, 0, False),
              x.start_input)), after)

      def leaf(old, row):
        row = jnp.where(x.start_on[i], row[None],
                        lax.dynamic_index_in_dim(old, lane, 0, True))
        return lax.dynamic_update_index_in_dim(old, row, lane, 0)
      return jax.tree.map(leaf, states, new)

    if unroll:
      for i in range(num_slots):
        states = one(i, states)
      return states
    return lax.fori_loop(0, num_slots, one, states)
  return start


def _finalizer(final: Callable, collect: bool) -> Callable:
  """``finalized(shared, states, x) -> (increment, diag, out)``: the slots'
  clients finalized from their lanes' rows; the weighted increment of the
  sums (None when collecting), ``out`` None unless collecting."""
  def finalized(shared, states, x: StepInputs):
    num_slots = x.fin_lane.shape[0]
    out, diag = jax.vmap(final, in_axes=(None, 0), axis_size=num_slots)(
        shared, _rows(states, jnp.maximum(x.fin_lane, 0)))
    if collect:
      return None, diag, out
    return jax.tree.map(lambda o: o[None],
                        _weighted_sum(x.fin_weight, out)), diag, None
  return finalized


def lane_transition(init: Callable, final: Callable, collect: bool = False,
                    starts: str = 'rows') -> Callable:
  """What a lane-step does where clients end, before its step: finalizes
  the slots' clients into the sums, then starts their next ones in place
  (:func:`start_slots`, ``starts``: :data:`STARTS`).

  Returns:
    ``transition(shared, states, acc, x) -> (states, acc, diag, output)``
    (as :func:`lane_step`'s, without the step; ``x`` a
    :class:`StepInputs`).

  Raises:
    ValueError: ``starts`` not in :data:`STARTS`.
  """
  start = start_slots(init, method=starts)
  finalized = _finalizer(final, collect)

  def transition(shared, states, acc, x: StepInputs):
    increment, diag, out = finalized(shared, states, x)
    if not collect:
      acc = jax.tree.map(jnp.add, acc, increment)
    return start(shared, states, (acc, diag, out), x), acc, diag, out
  return transition


def lane_step(init: Callable, step: Callable, final: Callable,
              collect: bool = False, skip_idle: bool = True,
              starts: str = 'rows') -> Callable:
  """One lane-step: finalize, start, step (the body of every segment).

  Args:
    init, step, final: as :class:`LaneStreams`'s.
    collect: return the finalized outputs instead of adding them to ``acc``.
    skip_idle: finalize and start clients only at steps where a slot is
      in use (a ``lax.cond``; its other branch passes the states and sums
      through and gives zero diagnostics); False: at every step.
    starts: :data:`STARTS`.

  Returns:
    A function ``body(shared, states, acc, inputs)`` (``inputs`` a
    :class:`StepInputs`) returning ``(states, acc, diag, output, result)``:
    ``states`` ``[lanes, ...]``; ``acc`` the weighted sum
    (``[1, ...]`` per leaf; returned unchanged when collecting); ``diag``
    and ``output`` ``[slots, ...]`` of the finalized clients (``output``
    None unless collecting); ``result`` ``[lanes, ...]`` the step results.
    The finalization reads the slots' rows of the states, then the starts
    write only those rows (:func:`start_slots`), in place. With
    ``starts='scatter'`` the conditional holds the finalization alone and
    returns the sums' increment: nothing passes through its branches,
    which XLA:GPU copies (its optimized HLO, compiled without a device for
    an H200: a step of 39 Transformer lanes copies 6.9 GB with the rows
    starts inside, 0.13 GB with the scatter after it;
    ``bench_lane_cost.py``, H200 target). With ``'rows'`` the starts run
    in the conditional's transition branch; both branches alias the
    states and sums to its operand, so on XLA:CPU it copies neither
    (XLA:CPU's optimized HLO: a Transformer segment of 39
    lanes copies 2.6 MB, against 0.34 GB of weighted sums when the starts
    ran at every step, outside the conditional, and a step where no
    client ends launches about half the kernels: 909 against 1,878,
    ``bench_lane_cost.py``); the masked step's ``where`` writes the
    states in place. With a client step whose
    parameter updates wait for all its gradients (the
    ``ClientProgram.step_in_place`` of
    ``rounds_common.delta_client_program``), no pass over the lane states
    is added to the vmapped step (XLA:CPU cost analysis,
    ``benchmarks/bench_lane_cost.py``).
  """
  start = start_slots(init, method=starts)
  finalized = _finalizer(final, collect)
  transition = lane_transition(init, final, collect, starts)

  def body(shared, states, acc, x: StepInputs):
    num_lanes = x.active.shape[0]
    if skip_idle and starts == 'scatter':
      # Nothing passes through the conditional: its branches return the
      # sums' increment (zeros where no client ends), not the sums, and
      # the starts run after it.
      shapes = jax.eval_shape(finalized, shared, states, x)
      idle_fin = lambda shared, states, x: jax.tree.map(
          lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      delta, diag, out = lax.cond(jnp.any(x.fin_lane >= 0), finalized,
                                  idle_fin, shared, states, x)
      if not collect:
        acc = jax.tree.map(jnp.add, acc, delta)
      states = start(shared, states, (acc, diag, out), x)
    elif skip_idle:
      shapes = jax.eval_shape(transition, shared, states, acc, x)[2:]
      idle = lambda shared, states, acc, x: (states, acc) + jax.tree.map(
          lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      states, acc, diag, out = lax.cond(jnp.any(x.fin_lane >= 0),
                                        transition, idle, shared, states,
                                        acc, x)
    else:
      states, acc, diag, out = transition(shared, states, acc, x)
    stepped, result = jax.vmap(step, axis_size=num_lanes)(states, x.batch)
    states = _where_rows(x.active, stepped, states)
    return states, acc, diag, out, result
  return body


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
    rows_on_device: whether the batches were gathered on the devices from
      a ``device_rows.RowTable`` (else cut, stacked and sent by the host).
  """
  diagnostics: list
  weighted_sum: Optional[PyTree] = None
  outputs: Optional[list] = None
  step_results: Optional[list[list]] = None
  rows_on_device: bool = False


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

  Attributes:
    prefetch: make segment ``k + 1``'s inputs on a worker thread while
      segment ``k`` runs (default True; set False on an instance or on the
      class to make them between calls, as a benchmark's reference). The
      results are the same either way.
    warm_threads: with ``prefetch``, threads that make the clients' batches
      ahead, for batch sequences with a ``make()`` method
      (``batching.ClientBatches``), in the order of their first steps:
      NumPy's row gathers and preprocessing release Python's lock, so they
      run in parallel (default: half the CPUs, 1 to 8).
    starts: how the slots' next clients are written into the lane states,
      :data:`STARTS` (default ``'rows'``; set on an instance or on the
      class before a round, as a benchmark's comparison). The results are
      the same either way.
  """

  prefetch: bool = True
  starts: str = 'rows'
  warm_threads: int = max(1, min(8, (os.cpu_count() or 2) // 2))

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
    def lanes_reduce(acc):
      return jax.tree.map(lambda x: x.sum(0), acc)
    self._reduce = jax.jit(lanes_reduce, out_shardings=mesh.replicated)

  def _build(self, segment_steps: int, loop: str):
    """The three jitted programs for ``segment_steps`` steps."""
    init, step, final = self._fns
    collect = self.collect
    # A fixed segment holds no conditional (XLA:GPU reads each one's
    # predicate back to the host): it transitions at every step.
    body = lane_step(init, step, final, collect, skip_idle=loop != 'fixed',
                     starts=self.starts)
    lanes_in = P(sharding.AXIS)
    mesh = self.mesh.mesh
    S = segment_steps

    def lanes_begin(shared, inputs, lane_ids):
      num_lanes = lane_ids.shape[0]
      states = jax.vmap(init, in_axes=(None, 0), axis_size=num_lanes)(
          shared, inputs)
      one = jax.tree.map(lambda a: a[0], states)
      out_shape = jax.eval_shape(final, shared, one)[0]
      acc = jax.tree.map(lambda s: jnp.zeros((1,) + s.shape, s.dtype),
                         out_shape)
      return states, acc

    def lanes_segment(shared, states, acc, inputs, num_steps, table):
      at = lambda x, s: _at(x, s, table)

      if loop == 'unroll':  # XLA:CPU: no while loop around the step.
        diags, outputs, results = [], [], []
        for s in range(S):
          states, acc, diag, out, result = body(shared, states, acc,
                                                at(inputs, s))
          diags.append(diag)
          outputs.append(out)
          results.append(result)
        stack = lambda xs: jax.tree.map(lambda *r: jnp.stack(r, 1), *xs)
        return (states, acc, stack(diags),
                stack(outputs) if collect else None,
                stack(results) if collect else None)
      # An on-device loop of num_steps <= S steps; per-step outputs are
      # written into [rows, S] buffers (unwritten steps stay zero).
      first = at(inputs, 0)
      shapes = jax.eval_shape(body, shared, states, acc, first)[2:]
      if not collect:
        shapes = (shapes[0], None, None)
      bufs = jax.tree.map(
          lambda s: jnp.zeros((s.shape[0], S) + s.shape[1:], s.dtype), shapes)

      def one_step(i, carry):
        states, acc, bufs = carry
        states, acc, *outs = body(shared, states, acc, at(inputs, i))
        if not collect:
          outs = (outs[0], None, None)
        bufs = jax.tree.map(
            lambda b, o: lax.dynamic_update_index_in_dim(b, o, i, 1),
            bufs, tuple(outs))
        return states, acc, bufs

      carry = (states, acc, bufs)
      if loop == 'while':
        carry = lax.fori_loop(0, num_steps, one_step, carry)
      elif loop == 'fixed':  # S steps; padding steps are masked.
        carry = lax.fori_loop(0, S, one_step, carry)
      else:  # A static trip count; steps past num_steps pass through.
        carry = lax.fori_loop(
            0, S, lambda i, c: lax.cond(i < num_steps, one_step,
                                        lambda i, c: c, i, c), carry)
      states, acc, bufs = carry
      return (states, acc) + tuple(bufs)

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
    finish = shard(lanes_finish, (P(),) + (lanes_in,) * 3,
                   (lanes_in,) * 3, donate=() if collect else (2,))
    if loop == 'host':
      return begin, self._host_steps(shard), finish
    # The sums are donated where they are updated (not when collecting).
    segment = shard(lanes_segment,
                    (P(), lanes_in, lanes_in, lanes_in, P(), P()),
                    (lanes_in,) * 5, donate=(1,) if collect else (1, 2))
    return begin, segment, finish

  def _host_steps(self, shard: Callable) -> Callable:
    """A ``'host'`` segment: ``segment(shared, states, acc, inputs,
    num_steps, table, clients_end)`` calls, for each of its ``num_steps``
    steps, ``lanes_transition`` (finalizations and starts) where
    ``clients_end[s]`` (some slot finalizes a client), then ``lanes_step``
    (the masked step), and returns what a device loop's segment returns,
    its per-step outputs as lists over the steps (None where no client
    ends). The step is compiled once, in ``lanes_step``."""
    init, step, final = self._fns
    collect = self.collect
    transition = lane_transition(init, final, collect, self.starts)

    def lanes_step(shared, states, inputs, s, table):
      del shared
      x = _at(inputs, s, table)
      stepped, result = jax.vmap(step, axis_size=x.active.shape[0])(
          states, x.batch)
      return _where_rows(x.active, stepped, states), (
          result if collect else None)

    def lanes_transition(shared, states, acc, inputs, s):
      x = jax.tree.map(
          lambda a: lax.dynamic_index_in_dim(a, s, 1, keepdims=False),
          dataclasses.replace(inputs, batch=None, active=None))
      return transition(shared, states, acc, x)

    lanes_in = P(sharding.AXIS)
    idle = shard(lanes_step, (P(), lanes_in, lanes_in, P(), P()),
                 (lanes_in, lanes_in), donate=(1,))
    ends = shard(lanes_transition, (P(), lanes_in, lanes_in, lanes_in, P()),
                 (lanes_in,) * 4, donate=(1,) if collect else (1, 2))

    index: list[jax.Array] = []  # the step indices, sent once

    def segment(shared, states, acc, inputs, num_steps, table, clients_end):
      while len(index) < int(num_steps):
        index.append(self.mesh.put_replicated(np.int32(len(index))))
      diags, outputs, results = [], [], []
      for s in range(int(num_steps)):
        diag = out = None
        if clients_end[s]:
          states, acc, diag, out = ends(shared, states, acc, inputs, index[s])
        states, result = idle(shared, states, inputs, index[s], table)
        diags.append(diag)
        outputs.append(out)
        results.append(result)
      return (states, acc, diags, outputs if collect else None,
              results if collect else None)
    segment.programs = {'lanes_step': idle, 'lanes_transition': ends}
    return segment

  def run(self, shared: PyTree, plan: lanes_lib.LanePlan,
          batches: Sequence[Sequence[Batch]], inputs: Sequence[PyTree],
          weights: Sequence[float], template: tuple[Batch, PyTree],
          loop: str = 'auto') -> LaneRun:
    """Runs one round as planned.

    Args:
      shared: the shared input (the same for every client).
      plan: the round's :class:`~fedlite_jax.rounds.lanes.LanePlan`; its
        devices must be the mesh's.
      batches, inputs, weights: per client (cohort position); only the
        clients on this process's lanes are read. Batches that are all
        ``batching.TableBatches`` of one table are gathered on the devices.
      template: ``(batch, client_input)`` whose zeros fill masked steps.
      loop: :data:`LOOPS`; must agree with ``plan.dynamic_steps`` (scan
        runs only the planned steps).

    Returns:
      A :class:`LaneRun`.

    Raises:
      ValueError: a plan for another mesh, a loop the plan was not made
        for, or clients whose batches mix table rows and host batches.
    """
    mesh = self.mesh
    loop = resolve_loop(loop)
    if plan.devices != mesh.num_devices:
      raise ValueError(f'The plan is for {plan.devices} devices, the mesh has '
                       f'{mesh.num_devices}.')
    if plan.dynamic_steps != runs_planned_steps(loop):
      raise ValueError(
          f"A plan with dynamic_steps={plan.dynamic_steps} cannot run with "
          f"loop {loop!r}; plan scan and while loops with "
          "dynamic_steps=True.")
    key = (plan.segment_steps, loop, self.starts)
    if key not in self._programs:
      self._programs[key] = self._build(plan.segment_steps, loop)
    begin, segment, finish = self._programs[key]
    procs = mesh.num_processes
    per_proc = plan.devices // procs
    p = mesh.process_index
    lanes = slice(p * per_proc * plan.lanes_per_device,
                  (p + 1) * per_proc * plan.lanes_per_device)
    devices = slice(p * per_proc, (p + 1) * per_proc)
    S, F = plan.segment_steps, plan.slots
    row_table = _row_table(batches)
    if row_table is None:
      pad_batch = _zeros_like(template[0])
      batch_of = lambda c, b: batches[c][b] if c >= 0 else pad_batch
    else:  # Rows' indices; the lane-steps gather the batches (device_rows).
      pad_batch = np.zeros_like(batches[_local_first(batches)].rows[0])
      batch_of = lambda c, b: batches[c].rows[b] if c >= 0 else pad_batch
    n = len(batches)
    # Client inputs as one table (row n: padding), indexed per lane/step.
    table = _stack(list(inputs) + [_zeros_like(template[1])], (-1,))
    pick = lambda c: jax.tree.map(
        lambda t: t[np.where(c >= 0, c, n)], table)

    def put(tree, rows):
      if mesh.multi_process:
        return jax.tree.map(
            lambda x: mesh.put_clients(np.asarray(x), rows), tree)
      return jax.device_put(tree, mesh.client_sharding)
    num_lanes, num_slots = plan.lanes, plan.devices * F
    weight = np.asarray(weights, np.float32)
    weight_of = lambda c: np.where(c >= 0, weight[np.maximum(c, 0)],
                                   0.).astype(np.float32)

    def prepare(k: int) -> tuple[StepInputs, np.int32, np.ndarray]:
      """Segment ``k``'s inputs, on the devices, its planned steps, and
      at which of its steps some client ends (``bool[S]``)."""
      t = slice(k * S, (k + 1) * S)
      who = plan.client[t, lanes].T          # [lanes, S]
      which = plan.batch[t, lanes].T
      step_batches = [batch_of(c, b)
                      for c, b in zip(who.ravel(), which.ravel())]
      # Slots as rows: [S, devices, F] -> [devices * F, S].
      slot = lambda a: np.transpose(a[t, devices], (1, 2, 0)).reshape(-1, S)
      fin_lane, fin_client = slot(plan.finalize), slot(plan.finalize_client)
      started = slot(plan.start_client)      # started on the slot's lane
      inputs_k = StepInputs(
          batch=put(_stack(step_batches, who.shape), num_lanes),
          active=put(who >= 0, num_lanes),
          fin_lane=put(fin_lane, num_slots),
          fin_weight=put(weight_of(fin_client), num_slots),
          start_input=put(pick(started), num_slots),
          start_on=put(started >= 0, num_slots))
      ends = np.any(plan.finalize[t] >= 0, axis=(1, 2))
      return inputs_k, np.int32(min(S, plan.sequential_steps - k * S)), ends

    # Segment k + 1's inputs are made (batches cut, stacked, sent) on a
    # worker thread while segment k's call runs; the call releases Python's
    # lock, also where it waits for the device.
    ahead = self.prefetch and plan.num_segments > 1
    pending = (self._worker().submit(prepare, 0) if ahead else None)
    if ahead:
      # Batches that are made on first access (``make()``), made on the
      # warm-up threads in the order of the clients' first steps.
      local = plan.client[:, lanes]
      first = np.full(n, plan.steps, np.int64)
      t_idx, l_idx = np.nonzero(local >= 0)
      np.minimum.at(first, local[t_idx, l_idx], t_idx)
      for c in np.argsort(first, kind='stable'):
        make = getattr(batches[c], 'make', None)
        if first[c] < plan.steps and make is not None:
          self._warmers().submit(make)
    shared = mesh.put_replicated(shared)
    rows = (None if row_table is None else
            row_table.on_devices(mesh.replicated))
    states, acc = begin(shared, put(pick(plan.begin[lanes]), num_lanes),
                        put(np.arange(plan.lanes)[lanes], num_lanes))
    seg_diags, seg_outputs, seg_results = [], [], []
    for k in range(plan.num_segments):
      if ahead:
        inputs_k, steps_k, ends_k = self._ready(pending)
        if k + 1 < plan.num_segments:
          pending = self._worker().submit(prepare, k + 1)
      else:
        inputs_k, steps_k, ends_k = prepare(k)
      states, acc, diags, outputs, results = segment(
          shared, states, acc, inputs_k, steps_k, rows,
          *((ends_k,) if loop == 'host' else ()))
      seg_diags.append(diags)
      seg_outputs.append(outputs)
      seg_results.append(results)
    acc, fin_diags, fin_outputs = finish(
        shared, states, acc,
        put(weight_of(plan.finish[lanes]), num_lanes))
    diags, outputs, results = self._per_client(
        plan, seg_diags, seg_outputs, seg_results, fin_diags, fin_outputs, n)
    on_device = row_table is not None
    if self.collect:
      return LaneRun(diags, outputs=outputs, step_results=results,
                     rows_on_device=on_device)
    total = jax.tree.map(lambda x: x.addressable_data(0), self._reduce(acc))
    return LaneRun(diags, weighted_sum=total, rows_on_device=on_device)

  @staticmethod
  def _ready(pending: concurrent.futures.Future):
    """A prefetched segment's inputs (the caller waits here while the
    host, not the device, is behind)."""
    return pending.result()

  def _warmers(self) -> concurrent.futures.ThreadPoolExecutor:
    """Threads that make clients' batches ahead (:attr:`warm_threads`)."""
    return _pool('lanes_warm', self.warm_threads)

  def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
    """The thread that prepares segment inputs ahead."""
    return _pool('lanes_prefetch', 1)

  def _per_client(self, plan, seg_diags, seg_outputs, seg_results, fin_diags,
                  fin_outputs, num_clients):
    """Diagnostics (and outputs, step results) per client, in cohort order."""
    mesh = self.mesh
    got = mesh.gather((seg_diags, fin_diags))
    seg_diags, fin_diags = got
    S, F = plan.segment_steps, plan.slots
    # A 'host' segment's outputs are lists over its steps of [rows] arrays,
    # a device loop's [rows, S] arrays.
    if seg_diags and isinstance(seg_diags[0], list):
      at = lambda tree, row, s: jax.tree.map(lambda x: x[row], tree[s])
    else:
      at = lambda tree, row, s: jax.tree.map(lambda x: x[row, s], tree)
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
              diags[c] = at(d, row, s)
              if outputs is not None:
                outputs[c] = at(seg_outputs[k], row, s)
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
              results[c].append(at(r, lane, s))
    return diags, outputs, results
