#!/usr/bin/env python3
"""What a lane-step costs next to the plain vmapped training step.

For each model it compiles, on XLA:CPU from abstract shapes (no data, no
parameters in memory), the vmap engine's ``lanes_segment`` of the runner's
FedAvg client update (``delta_client_program``: gradient with loss
statistics, SGD, finalization into the weighted sum) and, as the reference,
``--segment_steps`` plain vmapped gradient + SGD steps over the same lanes
(``fedjax.model_grad``, no bookkeeping). It prints per lane-step, from
XLA:CPU's ``cost_analysis()`` of the optimized programs:

* FLOPs and bytes accessed of the segment / those of the plain steps
  (unrolled segments: the whole segment over ``S`` plain steps; ``scan``,
  ``while`` and ``fixed`` segments: cost analysis counts a loop body once,
  so the segment against ONE plain step; the loop over the slots' starts
  inside every lane-step is counted in full: the starts unrolled, compiled
  alone, minus the same rolled). A lane-step finalizes clients only at
  steps where some client ends (a ``lax.cond``; a ``fixed`` segment at
  every step: its transition share is 1), so it also prints the two kinds
  of step: a transition step (``streaming.lane_step`` compiled alone: cost
  analysis charges its conditional the costlier branch, the finalization)
  and an idle step (the masked step, and what the conditional's idle
  branch copies, read from the optimized HLO: it passes the lane states
  and sums through; the starts run in the transition branch), the share
  of a planned round's steps that are transitions (100 clients of
  ``bench_rounds``' population: real FEMNIST under ``$FEDLITE_DATA_DIR``,
  else synthetic example counts; one epoch), and the planned mean of the
  two (planned FLOPs, planned bytes; ``fixed``: the loop body, which every
  step runs, with the copies that XLA makes of the loop-carried states);
* compile seconds of the segment / of the ``S`` unrolled plain steps it
  replaces;
* the optimized HLO's copies, gathers, scatters (and those without
  ``unique_indices``), selects and top-level instructions;
* kernels per step (:func:`executed_kernels`): what one run of the plain
  step, of an idle lane-step and of a transition lane-step executes
  outside fusions, loops times their trip counts: on a GPU each is a
  launch, so the count stands in for launch overhead, which cost analysis
  does not see. XLA:CPU's fusion stands in for XLA:GPU's, an upper bound:
  XLA:GPU also fuses small independent kernels side by side (horizontal
  fusion), and XLA:CPU runs the threefry key split as a loop.

* GB copied per step: what XLA's ``copy`` kernels read and write in one
  run of the plain step, an idle and a transition lane-step, and a
  segment's step (:func:`executed_kernels` with ``copied=True``).

``--starts=scatter`` measures the lane-steps that start the slots'
clients by one scatter per state leaf (``LaneStreams.starts``) instead of
a loop of row writes over the slots (a comma-separated list measures
each). ``--loops=host``: the host-stepped loop's two programs (the masked
step; the finalizations and starts that precede it where clients end).

Models: ``transformer_large`` (Ro et al. 2022, Table 1, 21M parameters;
batch 16 x 30 tokens, vocabulary 4,096) on 39 lanes and 8 finalization
slots (the H200 run's plan), and the EMNIST CNN (``femnist``, 1.2M
parameters, batch 20, im2col convolutions as the vmap engine builds them)
on 100 lanes (``--shapes`` sets others). Costs are XLA:CPU's: a proxy for
a GPU, where fusion differs. ``--target=h200`` compiles for XLA:GPU
instead, on this machine, without a GPU (:func:`use_target`): its
kernels and copies, no cost analysis.

  python benchmarks/bench_lane_cost.py \\
      --output=benchmarks/results/lane_cost_cpu.md
  PYTHONPATH=<plugin folder> python benchmarks/bench_lane_cost.py \\
      --target=h200 --loops=scan,while,fixed,host --starts=rows,scatter \\
      --shapes=transformer_large:39:16,femnist:50:32 \\
      --output=benchmarks/results/lane_cost_h200_deviceless.md
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from typing import Any, Callable, Optional

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import models
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import rounds_common as rc
from fedlite_jax.models import lm
from fedlite_jax.rounds import sharding
from fedlite_jax.rounds import streaming

#: (lanes, slots, batch builder) per model.
CONFIGS = {
    'transformer_large': (39, 8),
    'transformer_tiny': (8, 2),
    'femnist': (100, 8),
}

#: Compile targets besides XLA:CPU: XLA:GPU compiling without a device
#: (JAX's deviceless ahead-of-time compilation, ``jax.experimental.
#: topologies``) for a ``GpuTargetConfig`` text proto under
#: ``benchmarks/targets/``.
TARGETS = ('cpu', 'h200')

#: Where ``_compile`` places its abstract arguments and the lane programs
#: their mesh: empty for XLA:CPU; set by :func:`use_target`.
_PLACEMENT: dict[str, Any] = {}


def use_target(target: str) -> str:
  """Compiles what follows for ``target`` (:data:`TARGETS`, or a path to
  a ``GpuTargetConfig`` text proto) and returns its description.

  A GPU target needs the CUDA plugin of this JAX
  (``pip install --target=<dir> jax-cuda12-plugin==<jax version>
  jax-cuda12-pjrt==<jax version>``, ``<dir>`` on ``PYTHONPATH``); no GPU
  and no driver: XLA:GPU's compiler runs on the CPU. It cannot time
  kernels, so it picks GEMM tilings without autotuning, and its programs
  carry no cost analysis.

  Raises:
    SystemExit: one line, when the config file or the plugin is missing.
  """
  _PLACEMENT.clear()
  if target == 'cpu':
    return 'XLA:CPU'
  import os  # pylint: disable=g-import-not-at-top
  path = target if os.path.exists(target) else os.path.join(
      os.path.dirname(os.path.abspath(__file__)), 'targets',
      f'{target}.txtpb')
  if not os.path.exists(path):
    raise SystemExit(f'--target={target}: no such target; use one of '
                     f'{", ".join(TARGETS)} or a GpuTargetConfig file.')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_platforms', 'cpu')  # no GPU backend to start
  try:
    topology = topologies.get_topology_desc(
        platform='cuda', target_config=open(path).read(), topology='1x1x1')
  except Exception as e:  # pylint: disable=broad-except
    raise SystemExit(
        f'--target={target}: XLA:GPU without a device needs '
        f'jax-cuda12-plugin=={jax.__version__} and jax-cuda12-pjrt=='
        f'{jax.__version__} on PYTHONPATH ({type(e).__name__}: '
        f'{str(e).splitlines()[0] if str(e) else ""})') from None
  mesh = Mesh(np.asarray(topology.devices), (sharding.AXIS,))
  _PLACEMENT['sharding'] = NamedSharding(mesh, PartitionSpec())
  _PLACEMENT['mesh'] = sharding.ClientMesh(mesh)
  return (f'XLA:GPU for {topology.devices[0].device_kind} without a device '
          f'({os.path.basename(path)}; no autotuning, no cost analysis)')
FEMNIST_BATCH = 20
LM_BATCH = 16


def build_model(name: str, dtype: str = 'float32') -> fedjax.Model:
  """The model as the vmap engine builds it."""
  compute = None if dtype == 'float32' else dtype
  if name == 'femnist':
    return models.create_emnist_cnn(62, conv_implementation='im2col',
                                    compute_dtype=compute).model
  return lm.create_lm(name, lm.DEFAULT_VOCAB_SIZE,
                      compute_dtype=compute).model


def batch_shape(name: str, lanes: int) -> dict:
  """``[lanes, ...]`` abstract batch of one step."""
  if name == 'femnist':
    return {'x': jax.ShapeDtypeStruct((lanes, FEMNIST_BATCH, 28, 28, 1),
                                      jnp.float32),
            'y': jax.ShapeDtypeStruct((lanes, FEMNIST_BATCH), jnp.int32)}
  t = lm.DEFAULT_MAX_LENGTH
  return {k: jax.ShapeDtypeStruct((lanes, LM_BATCH, t), jnp.int32)
          for k in ('x', 'y')}


def _lead(tree, *dims):
  return jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(tuple(dims) + tuple(s.shape), s.dtype),
      tree)


def _cost(compiled) -> dict:
  """FLOPs and bytes accessed of a compiled program (NaN where the
  compiler has no cost analysis: XLA:GPU without a device)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  cost = cost or {}
  return {'flops': float(cost.get('flops', np.nan)),
          'bytes': float(cost.get('bytes accessed', np.nan))}


def hlo_counts(text: str) -> dict:
  """Instruction counts of an optimized HLO module's text."""
  ops = re.findall(r'=\s*[\w\[\]{},.:\s]*?\s(\w[\w-]*)\(', text)
  entry = text[text.find('ENTRY'):]
  scatters = re.findall(r'\sscatter\([^\n]*', text)
  return {
      'copy': sum(op == 'copy' for op in ops),
      'gather': sum(op == 'gather' for op in ops),
      'scatter': len(scatters),
      'scatter_not_unique': sum('unique_indices=true' not in s
                                for s in scatters),
      'select': sum(op == 'select' for op in ops),
      'entry_instructions': entry.count('\n  '),
      'copy_bytes': copied_bytes(text),
  }


_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'bf16': 2, 'f16': 2, 's16': 2,
                'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8,
                'u64': 8}


def _shape_bytes(text: str) -> int:
  """Bytes of the array shapes (``f32[39,512]{1,0}``) in an HLO shape."""
  total = 0
  for dtype, dims in re.findall(r'\b([a-z]+\d*)\[([\d,]*)\]', text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * int(np.prod(
          [int(d) for d in dims.split(',') if d], dtype=np.int64))
  return total


def copied_bytes(text: str) -> int:
  """Bytes that the ``copy`` instructions of an optimized HLO module read
  and write, outside fusions (a copy in a fusion is a layout change of its
  kernel): in a lane program, XLA's copies of carried buffers (lane states,
  sums) before they are written in place."""
  fused = set(re.findall(r' fusion\([^\n]*?calls=%?([\w.\-]+)', text))
  total = 0
  for block in re.split(r'\n(?=\S)', text):
    name = re.match(r'(?:ENTRY )?%?([\w.\-]+)', block)
    if name is None or name.group(1) in fused:
      continue
    total += 2 * sum(_shape_bytes(shape) for shape in
                     re.findall(r'= (\S+) copy\(', block))
  return total


def idle_branch_copy_bytes(text: str) -> int:
  """Bytes that the idle branch of a lane-step's ``lax.cond`` copies, read
  and written (what cost analysis charges a ``copy``), in the optimized HLO
  ``text`` of ``lane_step(skip_idle=True)`` compiled alone.

  The idle branch passes through what the transition branch writes anew
  (the weighted sums), so XLA copies it into the conditional's output:
  every idle step of a segment pays that copy, which cost analysis (the
  costlier branch only) does not show.

  Raises:
    ValueError: not exactly one conditional in the entry computation, or
      its idle branch not found.
  """
  entry = text[text.find('ENTRY'):]
  conds = re.findall(r' conditional\((.*)', entry)
  if len(conds) != 1:
    raise ValueError(f'expected the lane-step\'s one conditional in the '
                     f'entry computation; found {len(conds)}.')
  # lax.cond(pred, transition, idle) lowers to branches {idle, transition}.
  found = (re.search(r'branch_computations=\{%?([\w.\-]+)', conds[0]) or
           re.search(r'false_computation=%?([\w.\-]+)', conds[0]))
  if found is None:
    raise ValueError('the conditional names no branch computations.')
  start = re.search(r'^%?' + re.escape(found.group(1)) + r' .*\{$', text,
                    re.MULTILINE)
  if start is None:
    raise ValueError(f'branch computation {found.group(1)!r} not found.')
  body = text[start.end():text.find('\n}', start.end())]
  return 2 * sum(_shape_bytes(shape) for shape in re.findall(
      r'= (\S+) copy\(', body))


#: Instructions that run no kernel of their own (views, tuples, constants).
_NOT_KERNELS = frozenset({
    'parameter', 'constant', 'tuple', 'get-tuple-element', 'bitcast',
    'after-all', 'partition-id', 'replica-id', 'opt-barrier'})


def executed_kernels(text: str, branch: Optional[int] = None,
                     copied: bool = False) -> int:
  """Kernels one run of an optimized HLO module executes: its instructions
  outside fusions, a fusion counted once, a ``while`` loop's body times its
  ``known_trip_count`` (unknown: once, its condition included), a
  ``conditional`` as its costlier branch (``branch``: as its branch of that
  index instead; ``lax.cond``'s false branch is 0). On a GPU each is a launch (a
  kernel, a library call or a copy), so the count is a proxy for a
  program's launch overhead: of XLA:CPU's programs, an upper bound for
  XLA:GPU's, which also fuses small independent kernels side by side.
  ``copied``: instead, the bytes that those runs' ``copy`` kernels read
  and write (XLA's copies of buffers it cannot update in place).

  Raises:
    ValueError: no ENTRY computation, or a called computation not found.
  """
  comps: dict[str, list[str]] = {}
  entry = None
  for block in re.split(r'\n(?=\S)', text):
    head = re.match(r'(ENTRY )?%?([\w.\-]+) ', block)
    if head is None:
      continue
    comps[head.group(2)] = [l for l in block.splitlines()[1:]
                            if ' = ' in l]
    if head.group(1):
      entry = head.group(2)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text.')
  memo: dict[str, tuple[int, int]] = {}

  def called(line: str, key: str) -> list[str]:
    # A list ends before the next attribute: ``true_computation=%a,
    # false_computation=%b`` (XLA:GPU's text) is two keys.
    found = re.search(
        key + r'=\{?([^}\s,]+(?:, *%?[\w.\-]+(?![\w.\-]*=))*)\}?', line)
    return [n.strip().lstrip('%') for n in found.group(1).split(',')] \
        if found else []

  def count(name: str) -> tuple[int, int]:
    """(kernels, bytes copied) of one run of computation ``name``."""
    if name in memo:
      return memo[name]
    if name not in comps:
      raise ValueError(f'computation {name!r} not found.')
    kernels = copies = 0
    for line in comps[name]:
      line = re.sub(r'/\*.*?\*/', '', line)  # /*index=5*/ in tuple shapes
      op = re.search(r' = [^=]*?\s?([a-z][\w\-]*)\(', line)
      op = op.group(1) if op else ''
      if op in _NOT_KERNELS:
        continue
      if op == 'while':
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        body = count(called(line, 'body')[0])
        n, extra = ((int(trips.group(1)), (0, 0)) if trips else
                    (1, count(called(line, 'condition')[0])))
        kernels += n * body[0] + extra[0]
        copies += n * body[1] + extra[1]
      elif op == 'conditional':
        # A predicated conditional's false branch is index 0, as an
        # indexed one's (``lax.cond``); the costlier: the most kernels.
        branches = [count(b) for b in (
            called(line, 'branch_computations') or
            called(line, 'false_computation') +
            called(line, 'true_computation'))]
        got = max(branches) if branch is None else branches[branch]
        kernels += got[0]
        copies += got[1]
      elif op == 'call':
        got = count(called(line, 'to_apply')[0])
        kernels += got[0]
        copies += got[1]
      else:
        kernels += 1
        if op == 'copy':
          copies += 2 * _shape_bytes(line.split(' = ', 1)[1].split(
              ' copy(')[0])
    memo[name] = kernels, copies
    return memo[name]
  return count(entry)[1 if copied else 0]


def _compile(fn: Callable, *args) -> tuple[Any, float]:
  if 'sharding' in _PLACEMENT:  # on the target's device
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=_PLACEMENT['sharding'])
        if isinstance(a, jax.ShapeDtypeStruct) else a, args)
  lowered = jax.jit(fn).lower(*args) if not hasattr(fn, 'lower') else \
      fn.lower(*args)
  t = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t


def idle_lane_step(program, starts: str = 'rows') -> Callable:
  """``(shared, states, acc, inputs) -> states``: what a lane-step runs
  besides its conditional's idle branch where no client ends: the masked
  vmapped step, after the slots' starts where they run outside the
  conditional (``starts='scatter'``; with ``'rows'`` they are in the other
  branch)."""
  start = (streaming.start_slots(program.init, method='scatter')
           if starts == 'scatter' else None)

  def idle_step(shared, states, acc, x):
    if start is not None:
      states = start(shared, states, acc, x)
    stepped = jax.vmap(program.carried_step)(states, x.batch)
    return jax.tree.map(
        lambda n, o: jnp.where(
            x.active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o),
        stepped, states)
  return idle_step


def client_program(model: fedjax.Model, params) -> tuple[Any, dict]:
  """The runner's FedAvg client update (``delta_client_program``) and its
  shared input ``{'params': params}`` (arrays or abstract shapes)."""
  r = fedopt.CompressedRound(fedopt.Compression(), 'fedavg', 0, 'examples',
                             'dense', None, 'raise')
  r.setup(params)
  program = rc.delta_client_program(rc.train_grad(model), optax.sgd(0.1),
                                    r.compress, plan=r.plan)
  return program, {'params': params}


def starts_cost(program, shared, states, acc, step_inputs
                ) -> tuple[dict, dict]:
  """Cost analysis of the slots' starts (``streaming.start_slots``, rows)
  compiled alone with the lane states donated: ``(rolled, unrolled)``, the
  on-device loop over the slots (its body counted once) and the same
  starts as a Python loop (every slot counted). The segment's loop costs
  the rolled lane-step plus ``unrolled - rolled``: exact when only the
  loop differs between the two, which a test checks (the rolled starts
  cost about one slot's share of the unrolled ones)."""
  carried = jax.jit(streaming.start_slots(program.init), donate_argnums=(1,))
  rolled, _ = _compile(carried, shared, states, acc, step_inputs)
  unrolled, _ = _compile(
      jax.jit(streaming.start_slots(program.init, unroll=True),
              donate_argnums=(1,)), shared, states, acc, step_inputs)
  return _cost(rolled), _cost(unrolled)


def measure(name: str, lanes: int, slots: int, segment_steps: int,
            loop: str, dtype: str = 'float32', starts: str = 'rows') -> dict:
  """One model's lane segment against its plain steps (see module doc);
  ``starts``: how the lane-steps write the slots' next clients
  (``streaming.STARTS``)."""
  model = build_model(name, dtype)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  S = segment_steps

  # The reference: S plain vmapped grad + SGD steps over the lanes.
  grad = fedjax.model_grad(model)

  def plain_step(p, b, k):
    g = jax.vmap(grad)(p, b, k)
    return jax.tree.map(lambda w, d: w - 0.1 * d, p, g)

  def plain_steps(p, bs, k):
    for s in range(S):
      p = plain_step(p, jax.tree.map(lambda x, s=s: x[:, s], bs), k)
    return p

  lane_params = _lead(params, lanes)
  lane_keys = _lead(key, lanes)
  one_batch = batch_shape(name, lanes)
  seg_batch = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct((s.shape[0], S) + s.shape[1:], s.dtype),
      one_batch)
  one, one_s = _compile(plain_step, lane_params, one_batch, lane_keys)
  plain, plain_s = _compile(plain_steps, lane_params, seg_batch, lane_keys)

  program, shared = client_program(model, params)
  streams = streaming.LaneStreams(
      program.init, lambda st, b: (program.carried_step(st, b), None),
      program.final, mesh=_PLACEMENT.get('mesh'))
  client_input = {'rng': key}
  states = jax.eval_shape(
      jax.vmap(program.init, in_axes=(None, 0)), shared,
      _lead(client_input, lanes))
  acc = _lead(jax.eval_shape(program.final, shared, jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), states))[0], 1)
  inputs = streaming.StepInputs(
      batch=seg_batch,
      active=jax.ShapeDtypeStruct((lanes, S), jnp.bool_),
      fin_lane=jax.ShapeDtypeStruct((slots, S), jnp.int32),
      fin_weight=jax.ShapeDtypeStruct((slots, S), jnp.float32),
      start_input=_lead(client_input, slots, S),
      start_on=jax.ShapeDtypeStruct((slots, S), jnp.bool_))
  streams.starts = starts
  segment = streams._build(S, loop)[1]  # pylint: disable=protected-access
  s_arg = jax.ShapeDtypeStruct((), jnp.int32)
  host = loop == 'host'
  if host:  # No segment program: the step, and the transitions before it.
    host_idle, host_idle_s = _compile(segment.programs['lanes_step'],
                                      shared, states, inputs, s_arg, None)
    seg, seg_s = _compile(segment.programs['lanes_transition'], shared,
                          states, acc, inputs, s_arg)
    seg_s += host_idle_s
  else:
    seg, seg_s = _compile(segment, shared, states, acc, inputs, s_arg, None)
  step_inputs = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape[:1] + s.shape[2:], s.dtype),
      inputs)
  step = lambda st, b: (program.carried_step(st, b), None)
  # Compiled alone, the lane states and sums are donated, as the segment
  # carries them (else XLA copies the states before writing rows in place).
  carried = lambda fn, donate=(1,): jax.jit(fn, donate_argnums=donate)
  # The slots' starts run in an on-device loop, which cost analysis counts
  # once: the other slots' iterations are the starts unrolled minus rolled.
  if starts == 'rows':
    rolled, unrolled = starts_cost(program, shared, states, acc, step_inputs)
    more_starts = {k: unrolled[k] - rolled[k] for k in ('flops', 'bytes')}
  else:  # One scatter per leaf: no loop.
    more_starts = {'flops': 0.0, 'bytes': 0.0}
  # A transition step: the lane-step as a segment runs it (cost analysis
  # charges its lax.cond the costlier branch, the finalization).
  # A host loop's steps are its two programs (no conditional, no copy).
  if host:
    in_cond, lone_s, idle, idle_copy = seg, seg_s, host_idle, 0
  else:
    in_cond, lone_s = _compile(
        carried(streaming.lane_step(program.init, step, program.final,
                                    skip_idle=True, starts=starts), (1, 2)),
        shared, states, acc, step_inputs)
    # An idle step: the idle branch (its copies, read from the HLO) and the
    # masked step; the starts run in the transition branch.
    idle_copy = idle_branch_copy_bytes(in_cond.as_text())
    idle, _ = _compile(carried(idle_lane_step(program, starts)), shared,
                       states, acc, step_inputs)
  # A fixed segment transitions at every step (it holds no lax.cond).
  share = 1.0 if loop == 'fixed' else transition_share(name, lanes, slots,
                                                        S, loop)

  per = {'seg': _cost(seg), 'one': _cost(one), 'plain': _cost(plain),
         'body': _cost(in_cond), 'idle': _cost(idle)}
  if host:  # A transition step calls both programs.
    for k in ('seg', 'body'):
      per[k] = {m: per[k][m] + per['idle'][m] for m in ('flops', 'bytes')}
  for k in ('flops', 'bytes'):
    per['body'][k] += more_starts[k]
    # Cost analysis counts a while loop's body once; an unrolled segment
    # traces S lane-steps, each with its loop of starts.
    per['seg'][k] += more_starts[k] * (S if loop == 'unroll' else 1)
  per['idle']['bytes'] += idle_copy
  planned = {k: share * per['body'][k] + (1 - share) * per['idle'][k]
             for k in ('flops', 'bytes')}
  # Cost analysis counts a while loop's body once.
  seg_per_step = {k: v / (S if loop == 'unroll' else 1)
                  for k, v in per['seg'].items()}
  if loop == 'fixed':  # Every step is the loop body (with its loop copies).
    planned = dict(seg_per_step)
  if host:  # A step is one of the two programs, as planned.
    seg_per_step = dict(planned)
  # Per step of a segment: a loop's body (a while loop's counted once),
  # an unrolled segment's share, a host loop's planned mean.
  per_step = lambda n, idle_n: (
      share * n + (1 - share) * idle_n if host else
      n / (1 if loop == 'while' else S))
  texts = {'seg': seg.as_text(), 'in_cond': in_cond.as_text(),
           'idle': idle.as_text()}
  idle_branch = None if loop == 'fixed' else 0

  def transition_count(copied: bool = False) -> float:
    """A transition step's kernels (or copies): a host loop calls its
    transition program, then its step."""
    n = executed_kernels(texts['in_cond'], copied=copied)
    return n + executed_kernels(texts['idle'], copied=copied) if host else n
  return {
      'model': name, 'dtype': dtype, 'loop': loop, 'lanes': lanes,
      'slots': slots, 'segment_steps': S, 'starts': starts,
      # Launches per lane-step (executed_kernels): the plain step, a step
      # where no client ends, one where clients end, the segment's mean.
      # (A host loop: its step program, its transition program.)
      'kernels': {
          'plain_step': executed_kernels(one.as_text()),
          # The lane-step with its conditional's idle branch (lax.cond's
          # false branch, index 0); a fixed segment's every step transitions.
          'idle_step': executed_kernels(
              texts['idle' if host else 'in_cond'], branch=idle_branch),
          'transition_step': transition_count(),
          'segment_per_step': per_step(
              transition_count() if host else executed_kernels(texts['seg']),
              executed_kernels(texts['idle']) if host else 0)},
      # GB that XLA's copies read and write per lane-step: an idle and a
      # transition step (the lane-step alone), and a segment's step on its
      # path of the most kernels (the loop's own copies of its carried
      # states included).
      'copied_gb': {
          'plain_step': executed_kernels(one.as_text(), copied=True) / 1e9,
          'idle_step': executed_kernels(
              texts['idle' if host else 'in_cond'], branch=idle_branch,
              copied=True) / 1e9,
          'transition_step': transition_count(copied=True) / 1e9,
          'segment_per_step': per_step(
              transition_count(copied=True) if host else
              executed_kernels(texts['seg'], copied=True),
              executed_kernels(texts['idle'], copied=True) if host else 0)
                              / 1e9},
      'params': int(sum(np.prod(s.shape) for s in jax.tree.leaves(params))),
      'plain_step_flops': per['one']['flops'],
      'plain_step_bytes': per['one']['bytes'],
      'flops_ratio': seg_per_step['flops'] / per['one']['flops'],
      'bytes_ratio': seg_per_step['bytes'] / per['one']['bytes'],
      'body_flops_ratio': per['body']['flops'] / per['one']['flops'],
      'body_bytes_ratio': per['body']['bytes'] / per['one']['bytes'],
      'idle_bytes_ratio': per['idle']['bytes'] / per['one']['bytes'],
      'idle_copy_bytes': idle_copy,
      'idle_copy_bytes_ratio': idle_copy / per['one']['bytes'],
      'transition_share': share,
      'planned_flops_ratio': planned['flops'] / per['one']['flops'],
      'planned_bytes_ratio': planned['bytes'] / per['one']['bytes'],
      'plain_steps_bytes_ratio': per['plain']['bytes'] / S /
                                 per['one']['bytes'],
      'segment_compile_s': seg_s, 'plain_steps_compile_s': plain_s,
      'plain_step_compile_s': one_s, 'body_compile_s': lone_s,
      'compile_ratio': seg_s / plain_s,
      'hlo_segment': hlo_counts(seg.as_text()),
      'hlo_plain_steps': hlo_counts(plain.as_text()),
  }


def transition_share(name: str, lanes: int, slots: int, segment_steps: int,
                     loop: str, cohort: int = 100, seed: int = 0) -> float:
  """Share of a planned round's steps at which clients end and start (the
  lane-steps that run the transition branch): ``cohort`` clients of
  ``bench_rounds``' population (real FEMNIST writers under
  ``$FEDLITE_DATA_DIR``, else its synthetic example counts), one epoch."""
  import os  # pylint: disable=g-import-not-at-top
  import bench_rounds  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import lanes as lanes_lib  # pylint: disable=g-import-not-at-top
  model = 'femnist' if name == 'femnist' else name
  clients, _ = bench_rounds.population(
      model, cohort, seed, 0, os.environ.get('FEDLITE_DATA_DIR'))
  batch = FEMNIST_BATCH if name == 'femnist' else LM_BATCH
  rng = np.random.RandomState(seed)
  pick = rng.choice(len(clients), cohort, replace=False)
  counts = [-(-len(clients[i][1]) // batch) for i in pick]
  plan = lanes_lib.plan_lanes(counts, min(lanes, cohort), segment_steps,
                              min(slots, lanes), dynamic_steps=streaming.runs_planned_steps(loop))
  steps = plan.sequential_steps
  busy = np.any(plan.finalize[:steps] >= 0, axis=(1, 2))
  return float(busy.mean())


def _x(v: float) -> str:
  """A ratio, or n/a where the compiler gave no cost analysis."""
  return 'n/a' if np.isnan(v) else f'{v:.3f}x'


def _row(m: dict) -> str:
  h, p = m['hlo_segment'], m['hlo_plain_steps']
  return (f"| {m['model']} | {m['dtype']} | {m['loop']} | {m['lanes']} | "
          f"{m['slots']} | {m['segment_steps']} | "
          f"{_x(m['flops_ratio'])} | {_x(m['bytes_ratio'])} | "
          f"{_x(m['body_bytes_ratio'])} | {_x(m['idle_bytes_ratio'])} | "
          f"{m['transition_share']:.2f} | {_x(m['planned_flops_ratio'])} | "
          f"{_x(m['planned_bytes_ratio'])} | "
          f"{m['segment_compile_s']:.1f} / {m['plain_steps_compile_s']:.1f}"
          f" = {m['compile_ratio']:.2f}x | "
          f"{h['copy']} / {p['copy']} | "
          f"{h['copy_bytes'] / 1e9:.2f} / {p['copy_bytes'] / 1e9:.2f} | "
          f"{h['gather']} / {p['gather']} | "
          f"{h['scatter']} ({h['scatter_not_unique']}) / {p['scatter']} "
          f"({p['scatter_not_unique']}) | {h['select']} / {p['select']} | "
          f"{h['entry_instructions']} / {p['entry_instructions']} | "
          + (f"{k['plain_step']} / {k['idle_step']} / "
             f"{k['transition_step']} | " if (k := m.get('kernels')) else
             ' |')
          + (f"{c.get('plain_step', math.nan):.3f} / "
             f"{c['idle_step']:.3f} / {c['transition_step']:.3f} / "
             f"{c['segment_per_step']:.3f} | " if (c := m.get('copied_gb'))
             else ' |') + f"{m.get('starts', 'rows')} |")


HEADER = (
    '| model | dtype | loop | lanes | slots | S | segment FLOPs / plain '
    'step | segment bytes / plain step | transition step bytes | idle step '
    'bytes | transition share | planned FLOPs | planned bytes | compile s: '
    'segment / S plain steps | copies | GB copied | gathers | scatters '
    '(not unique) | selects | entry instructions | kernels per step: plain '
    '/ idle / transition | GB copied per step: plain / idle / transition '
    '/ segment | starts |\n'
    '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|'
    '---:|---:|---:|---:|---:|---:|---:|---:|---|')


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--models', default='transformer_large,femnist')
  ap.add_argument('--loops', default='unroll,scan')
  ap.add_argument('--segment_steps', type=int, default=4)
  ap.add_argument('--compute_dtype', default='float32')
  ap.add_argument('--starts', default='rows',
                  help='how lane-steps write the next clients into the '
                  'lane states (LaneStreams.starts), comma-separated: '
                  + ', '.join(streaming.STARTS))
  ap.add_argument('--shapes', default='',
                  help='model:lanes:slots,... in place of CONFIGS (e.g. '
                  'femnist:50:32, the lanes and slots of an H200 plan)')
  ap.add_argument('--target', default='cpu',
                  help='what to compile for: cpu, h200 (XLA:GPU without '
                  'a device; see use_target) or a GpuTargetConfig file')
  ap.add_argument('--output', default='')
  args = ap.parse_args(argv)
  target = use_target(args.target)
  rows = []
  import os  # pylint: disable=g-import-not-at-top
  lines = [f'command: `python benchmarks/bench_lane_cost.py '
           f'{" ".join(argv if argv is not None else sys.argv[1:])}`',
           f'jax {jax.__version__}, {target}, '
           f'{platform.machine()}, {os.cpu_count()} CPU threads',
           'transition shares: femnist from '
           + ('real FEMNIST writers' if os.environ.get('FEDLITE_DATA_DIR')
              else 'synthetic example counts')
           + ', language models from synthetic example counts']
  if args.target != 'cpu':
    lines.append(
        'XLA:GPU compiled on this CPU machine: jax-cuda12-plugin and '
        f'jax-cuda12-pjrt {jax.__version__} on PYTHONPATH, no GPU; its '
        'programs carry no cost analysis (the ratio columns are n/a); '
        'kernels, copies and compile seconds are XLA:GPU\'s (no GEMM '
        'autotuning without a device)')
  print(HEADER)
  shapes = dict(CONFIGS)
  for item in filter(None, args.shapes.split(',')):
    name, lanes, slots = item.split(':')
    shapes[name] = (int(lanes), int(slots))
  for name in args.models.split(','):
    lanes, slots = shapes[name]
    for starts in args.starts.split(','):
      for loop in args.loops.split(','):
        m = measure(name, lanes, slots, args.segment_steps, loop,
                    args.compute_dtype, starts)
        rows.append(m)
        print(_row(m), flush=True)
        if args.output:
          _write(args.output, lines, rows)


def _write(path: str, lines: list[str], rows: list[dict]) -> None:
  with open(path, 'w') as f:
    f.write('# A lane-step against the plain vmapped step: '
            'bench_lane_cost.py\n\n')
    f.write('\n'.join(f'- {x}' for x in lines) + '\n\n')
    f.write(HEADER + '\n' + '\n'.join(_row(m) for m in rows) + '\n\n')
    f.write('- Every ratio is over one plain vmapped grad + SGD step on the '
            'same lanes (XLA:CPU cost analysis). Segment: per lane-step '
            '(unrolled: the segment / S; scan: the loop body, counted once; '
            'a lax.cond counted as its costlier branch; the loop over the '
            'slots\' starts counted in full). Transition / idle '
            'step: the lane-step compiled alone, its states and sums donated '
            '(its conditional counted as the finalization and the starts) / '
            'the masked step compiled alone plus what the lane-step\'s idle '
            'branch copies (read and written). '
            'Transition share: steps of a planned 100-client '
            'round at which clients end. Planned: the share-weighted mean '
            'of the transition and idle steps (fixed: the loop body, which '
            'every step runs). Compile s: the segment '
            'program / S plain steps unrolled in one program. HLO columns: '
            'segment / S plain steps (scatters without unique indices in '
            'parentheses; GB copied: what the copies outside fusions read '
            'and write, XLA\'s copies of carried buffers). Kernels per step: '
            'the instructions one run executes outside fusions (a loop\'s '
            'body times its trip count, a conditional its costlier branch), '
            'each a launch on a GPU: the plain step, an idle step (the '
            'lane-step, its conditional counted as the idle branch), a '
            'transition step (XLA:CPU\'s fusion, a proxy for XLA:GPU\'s). '
            'GB copied per step: what the copies outside fusions read and '
            'write in one run of the plain step, of an idle and a transition '
            'lane-step (compiled alone) and of a segment\'s step on its path '
            'of the most kernels (its loop\'s copies of the carried states '
            'included; host: the planned mean of its programs\' runs).\n\n')
    f.write(f'<!-- rows: {json.dumps(rows)} -->\n')


if __name__ == '__main__':
  main()
