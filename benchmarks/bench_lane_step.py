#!/usr/bin/env python3
"""What one lane-step takes on the device, next to what its arithmetic costs.

Times compiled steps on real (random) arrays, median of ``--repeats`` runs
after a warm-up, rotating 3 input sets (``block_until_ready`` around each),
and reads each compiled program's FLOPs and bytes from the backend's own
``cost_analysis()``. Kinds of step, per model and compute dtype:

* ``client``: one client's gradient + SGD step on its batch (what FedJAX's
  ``jit`` backend runs per step);
* ``shared``: one gradient + SGD step of ONE model over the batches of all
  ``L`` lanes (``L x B`` examples): the same FLOPs as ``L`` lanes with
  large shared-weight matrix products, an ideal for a lane-step;
* ``vmap``: the plain vmapped gradient + SGD step over ``L`` lanes, each with
  its own parameters (``fedjax.model_grad``, no bookkeeping), per lane count
  of ``--lanes``;
* ``idle``: the vmap engine's masked step (the runner's FedAvg client update,
  ``streaming``'s per-lane ``where``);
* ``idle_cond``: the engine's lane-step where no client ends, as a segment
  runs it (``streaming.lane_step`` with its ``lax.cond``, the idle branch
  taken: no finalization, no starts): against ``idle`` (measured
  with it) it times the lane-step's bookkeeping on a step without
  transitions; its cost columns are those of the masked
  step compiled alone, plus the idle branch's copy read from the optimized
  HLO (cost analysis charges a conditional its costlier branch); measured
  last;
* ``transition``: the engine's lane-step that finalizes ``slots`` clients
  and starts new ones before stepping (``streaming.lane_step`` without its
  conditional);
* ``segment``: the engine's ``lanes_segment`` program of ``S`` steps
  (``--segment_loop``), per step.

Printed per row: ms per call and per lane-step, the ratio to ``L`` client
steps run one after another, achieved TFLOP/s and GB/s (cost-analysis
counts over measured time). Rows go to ``--output`` (JSON lines) as they
are measured. On CPU this runs the tiny models (a test runs it there).

  python benchmarks/bench_lane_step.py --models=transformer_large,femnist \\
      --output=/tmp/lane_step.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_lane_cost as blc  # noqa: E402  (imports fedlite_jax first)
import fedjax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fedlite_jax.models import lm  # noqa: E402
from fedlite_jax.rounds import streaming  # noqa: E402

KINDS = ('client', 'shared', 'vmap', 'idle', 'idle_cond', 'transition',
         'segment')
#: Lanes per model: the vmapped step at two lane counts (a step's fixed
#: cost, ``lanes.AUTO_STEP_COST_LANES``); the larger one for the other
#: kinds (the engine's plans on one large GPU before the cost rule: 39
#: Transformer lanes for 100 clients, 51 CNN lanes).
LANES = {'transformer_large': (8, 39), 'femnist': (51, 100),
         'transformer_tiny': (2, 4)}


def _arrays(name: str, lanes: int, sets: int, seed: int) -> list[dict]:
  """``sets`` random ``[lanes, ...]`` batches of one step."""
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(sets):
    shape = blc.batch_shape(name, lanes)
    if name == 'femnist':
      out.append({'x': rng.rand(*shape['x'].shape).astype(np.float32),
                  'y': rng.randint(0, 62, shape['y'].shape).astype(np.int32)})
    else:
      out.append({k: rng.randint(1, lm.DEFAULT_VOCAB_SIZE, s.shape).astype(
          np.int32) for k, s in shape.items()})
  return [jax.device_put(b) for b in out]


def _time(fn: Callable, args_sets: list[tuple], repeats: int) -> float:
  """Median seconds of ``fn(*args)`` over ``repeats`` runs (after one per
  input set), rotating the input sets."""
  for a in args_sets:
    jax.block_until_ready(fn(*a))
  times = []
  for i in range(repeats):
    a = args_sets[i % len(args_sets)]
    t = time.perf_counter()
    jax.block_until_ready(fn(*a))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def _cost(compiled) -> dict:
  try:
    return blc._cost(compiled)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return {'flops': float('nan'), 'bytes': float('nan')}


def measure(name: str, dtype: str, lanes: tuple[int, ...], kinds: tuple,
            slots: int, segment_steps: int, loop: str, repeats: int,
            seed: int = 0, emit: Callable[[dict], None] = print,
            starts: str = 'rows') -> list[dict]:
  """Rows of one model and dtype (see module doc)."""
  model = blc.build_model(name, dtype)
  grad = fedjax.model_grad(model)
  key = jax.random.PRNGKey(seed)
  rows = []

  def sgd(p, b, k):
    g = grad(p, b, k)
    return jax.tree.map(lambda w, d: w - 0.1 * d, p, g)

  def row(kind, L, fn, args_sets, steps=1, compile_args=None, cost=None):
    jitted = jax.jit(fn)
    t = time.perf_counter()
    compiled = jitted.lower(*(compile_args or args_sets[0])).compile()
    compile_s = time.perf_counter() - t
    sec = _time(compiled, args_sets, repeats) / steps
    if cost is None:
      cost = _cost(compiled)
      cost = {k: v / (steps if loop == 'unroll' or kind != 'segment' else 1)
              for k, v in cost.items()}
    else:
      cost = cost(compiled)
    r = {'model': name, 'dtype': dtype, 'kind': kind, 'lanes': L,
         'starts': starts,
         'ms': sec * 1e3, 'ms_per_lane_step': sec * 1e3 / L,
         'flops': cost['flops'], 'bytes': cost['bytes'],
         'tflops_per_s': cost['flops'] / sec / 1e12,
         'gb_per_s': cost['bytes'] / sec / 1e9, 'compile_s': compile_s,
         'device': jax.devices()[0].device_kind}
    rows.append(r)
    emit(r)
    return r

  def lane_params(L):
    return jax.vmap(model.init)(jax.random.split(key, L))

  if 'client' in kinds:
    p = model.init(key)
    sets = [(p, jax.tree.map(lambda x: x[0], b), key)
            for b in _arrays(name, 1, 3, seed)]
    row('client', 1, sgd, sets)
  big = max(lanes)
  if 'shared' in kinds:
    p = model.init(key)
    sets = [(p, jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), b),
             key) for b in _arrays(name, big, 3, seed)]
    row('shared', big, sgd, sets)
  if 'vmap' in kinds:
    for L in lanes:
      p, ks = lane_params(L), jax.random.split(key, L)
      sets = [(p, b, ks) for b in _arrays(name, L, 3, seed)]
      row('vmap', L, jax.vmap(sgd), sets)

  rest = [k for k in ('idle', 'idle_cond', 'transition', 'segment')
          if k in kinds]
  if not rest:
    return rows
  program, shared = blc.client_program(model, model.init(key))
  L, S = big, segment_steps
  states = jax.vmap(program.init, in_axes=(None, 0))(
      shared, {'rng': jax.random.split(key, L)})
  acc = jax.tree.map(lambda a: jnp.zeros((1,) + a.shape, a.dtype),
                     program.final(shared, jax.tree.map(
                         lambda a: a[0], states))[0])
  batches = _arrays(name, L, 3, seed)

  def inputs(b, steps):
    lead = lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], steps)
                                      + a.shape[1:]) if steps else a
    fin = jnp.arange(slots, dtype=jnp.int32)
    return streaming.StepInputs(
        batch=jax.tree.map(lead, b),
        active=lead(jnp.ones((L,), bool)),
        fin_lane=lead(fin), fin_weight=lead(jnp.ones((slots,), jnp.float32)),
        start_input={'rng': lead(jax.random.split(key, slots))},
        start_on=lead(jnp.ones((slots,), bool)))

  step = lambda st, b: (program.carried_step(st, b), None)
  def idle(states, x):
    stepped = jax.vmap(program.carried_step)(states, x.batch)
    return streaming._where_rows(x.active, stepped, states)  # pylint: disable=protected-access
  if 'idle' in kinds or 'idle_cond' in kinds:
    row('idle', L, idle, [(states, inputs(b, 0)) for b in batches])
  if 'transition' in kinds:
    body = streaming.lane_step(program.init, step, program.final,
                               skip_idle=False, starts=starts)
    row('transition', L, body,
        [(shared, states, acc, inputs(b, 0)) for b in batches])
  if 'segment' in kinds:
    streams = streaming.LaneStreams(program.init, step, program.final)
    streams.starts = starts
    seg = streams._build(S, loop)[1]  # pylint: disable=protected-access
    # Clients end at the segment's first step only (slots of them).
    def seg_inputs(b):
      x = inputs(b, S)
      later = jnp.arange(S) > 0
      return streaming.StepInputs(
          batch=x.batch, active=x.active,
          fin_lane=jnp.where(later[None], -1, x.fin_lane),
          fin_weight=jnp.where(later[None], 0.0, x.fin_weight),
          start_input=x.start_input,
          start_on=x.start_on & ~later[None])
    n = jnp.asarray(S, jnp.int32)

    def segment(states, acc, x):
      return seg(shared, states, acc, x, n, None)
    # The segment donates its states and sums: fresh copies per call.
    sets = [(states, acc, seg_inputs(b)) for b in batches]
    copy = lambda t: jax.tree.map(jnp.copy, t)
    row('segment', L,
        lambda s, a, x: segment(copy(s), copy(a), x), sets, steps=S)
  if 'idle_cond' in kinds:  # Last: its HLO reading may fail elsewhere.
    in_cond = streaming.lane_step(program.init, step, program.final,
                                  skip_idle=True, starts=starts)

    def no_ends(b):
      x = inputs(b, 0)
      return dataclasses.replace(
          x, start_on=jnp.zeros_like(x.start_on),
          fin_lane=jnp.full_like(x.fin_lane, -1),
          fin_weight=jnp.zeros_like(x.fin_weight))
    # Cost analysis charges a conditional its costlier branch: count the
    # masked step, and the copy that the idle branch makes.
    idle_only = jax.jit(blc.idle_lane_step(program),
                        donate_argnums=(1,)).lower(
        shared, states, acc, no_ends(batches[0])).compile()
    row('idle_cond', L, in_cond,
        [(shared, states, acc, no_ends(b)) for b in batches],
        cost=lambda c: {'flops': _cost(idle_only)['flops'],
                        'bytes': _cost(idle_only)['bytes'] + _copy_bytes(c)})
  return rows


def _copy_bytes(compiled) -> float:
  """The idle branch's copy (``bench_lane_cost.idle_branch_copy_bytes``);
  NaN, said on stdout, where the optimized HLO has another form."""
  try:
    return float(blc.idle_branch_copy_bytes(compiled.as_text()))
  except ValueError as e:
    print(f'idle_cond: copy bytes not read: {e}', flush=True)
    return float('nan')


def _line(r: dict) -> str:
  return (f"{r['model']:>18} {r['dtype']:>8} {r['kind']:>10} "
          f"{r['lanes']:>4} {r['ms']:>9.3f} {r['ms_per_lane_step']:>8.3f} "
          f"{r.get('vs_client', float('nan')):>7.2f} "
          f"{r['tflops_per_s']:>7.2f} {r['gb_per_s']:>8.1f} "
          f"{r['compile_s']:>7.1f}")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  cpu = jax.default_backend() == 'cpu'
  ap.add_argument('--models', default='transformer_tiny' if cpu else
                  'transformer_large,femnist')
  ap.add_argument('--dtypes', default='float32,bfloat16')
  ap.add_argument('--kinds', default=','.join(KINDS))
  ap.add_argument('--lanes', default='',
                  help='comma list per run (default: per model, LANES)')
  ap.add_argument('--slots', type=int, default=8)
  ap.add_argument('--segment_steps', type=int, default=4)
  ap.add_argument('--segment_loop', default='scan',
                  choices=streaming.LOOPS[1:])
  ap.add_argument('--starts', default='rows', choices=streaming.STARTS,
                  help='how the engine\'s lane-steps start clients')
  ap.add_argument('--repeats', type=int, default=10)
  ap.add_argument('--output', default='', help='JSON lines ("": none)')
  args = ap.parse_args(argv)
  kinds = tuple(args.kinds.split(','))
  bad = set(kinds) - set(KINDS)
  if bad:
    ap.error(f'--kinds: {sorted(bad)} not in {KINDS}')
  print(f"{'model':>18} {'dtype':>8} {'kind':>10} {'L':>4} {'ms':>9} "
        f"{'ms/lane':>8} {'vs 1x':>7} {'TFLOP/s':>7} {'GB/s':>8} "
        f"{'comp s':>7}", flush=True)
  out = open(args.output, 'a') if args.output else None
  for name in args.models.split(','):
    lanes = (tuple(int(x) for x in args.lanes.split(',')) if args.lanes
             else LANES[name])
    for dtype in args.dtypes.split(','):
      client: dict[str, Any] = {}

      def emit(r, client=client):
        if r['kind'] == 'client':
          client['ms'] = r['ms']
        if client:
          r['vs_client'] = client['ms'] / r['ms_per_lane_step']
        print(_line(r), flush=True)
        if out:
          out.write(json.dumps(r) + '\n')
          out.flush()
      try:
        measure(name, dtype, lanes, kinds, min(args.slots, min(lanes)),
                args.segment_steps, args.segment_loop, args.repeats,
                emit=emit, starts=args.starts)
      except Exception as e:  # pylint: disable=broad-except
        print(f'{name} {dtype}: failed: {type(e).__name__}: {e}', flush=True)
        if out is None:
          raise


if __name__ == '__main__':
  main()
