#!/usr/bin/env python3
"""Where a round's host time goes: wall seconds per phase of steady rounds.

Builds one configuration of ``bench_rounds.py`` (the options of
``profile_rounds.py``), wraps the round's host-side phases with
``time.perf_counter`` and runs ``--warmup_rounds`` + ``--rounds`` rounds on
fresh cohorts. Per traced round it prints the round's wall time and the
seconds spent (inclusive, so nested phases overlap their parents):

* ``make_work``: local batching of the cohort (``rc.make_work``);
* ``engine``: the round engine's call, and in it, for the vmap engine,
  ``stack`` (a segment's batches stacked on the host; on the prefetch
  thread, which also cuts the batches), ``wait inputs`` (the caller waiting
  for the prefetch thread: host-bound segments), ``device_put``, the
  host side of each lane program's call (``call lanes_*``: dispatch, or the
  wait where a call blocks) and ``per_client`` (the wait for the round's
  diagnostics and their split per client);
* ``server_update``, ``client_diagnostics``, ``download_bits``.

A phase that waits for the device (``per_client``, a blocking call) holds
device time; the rest is host time the device may idle through.

  python benchmarks/round_phases.py --model=femnist --engine=vmap \\
      --cohort=100 --output=/tmp/phases.json
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rounds  # noqa: E402  (imports fedlite_jax first)
import jax  # noqa: E402
import profile_rounds  # noqa: E402

from fedlite_jax.algorithms import rounds_common as rc  # noqa: E402
from fedlite_jax.rounds import engine as engine_lib  # noqa: E402
from fedlite_jax.rounds import streaming  # noqa: E402


class Phases:
  """Seconds and calls per phase name, since the last :meth:`reset`."""

  def __init__(self):
    self.seconds = collections.defaultdict(float)
    self.calls = collections.Counter()

  def reset(self) -> None:
    self.seconds.clear()
    self.calls.clear()

  def timed(self, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      t = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        self.seconds[name] += time.perf_counter() - t
        self.calls[name] += 1
    return wrapper


@contextlib.contextmanager
def instrument(phases: Phases):
  """Wraps the phases (module doc) while open; restores the originals."""
  saved = []

  def wrap(owner, attr: str, name: str, fn=None) -> None:
    saved.append((owner, attr, vars(owner).get(attr, getattr(owner, attr))))
    setattr(owner, attr, fn or phases.timed(name, getattr(owner, attr)))

  for attr in ('make_work', 'server_update', 'client_diagnostics',
               'download_bits'):
    wrap(rc, attr, attr)
  wrap(streaming, '_stack', 'stack')
  wrap(streaming.LaneStreams, '_per_client', 'per_client')
  wrap(streaming.LaneStreams, '_ready', '',
       staticmethod(phases.timed('wait inputs',
                                 streaming.LaneStreams._ready)))  # pylint: disable=protected-access
  wrap(engine_lib.VmapEngine, '__call__', 'engine')
  wrap(engine_lib.LoopEngine, '__call__', 'engine')
  wrap(jax, 'device_put', 'device_put')
  build = streaming.LaneStreams._build  # pylint: disable=protected-access

  def timed_build(self, segment_steps, loop):
    programs = build(self, segment_steps, loop)
    return tuple(phases.timed(f'call {name}', p) for name, p in
                 zip(streaming.PROGRAM_NAMES, programs))
  wrap(streaming.LaneStreams, '_build', '', timed_build)
  try:
    yield phases
  finally:
    for owner, attr, original in reversed(saved):
      setattr(owner, attr, original)


def run(args) -> dict:
  """The rounds (module doc); the result dict."""
  with instrument(Phases()) as phases:
    return _run(args, phases)


def _run(args, phases: Phases) -> dict:
  batch_size = (bench_rounds.FEMNIST_BATCH if args.model == 'femnist' else
                bench_rounds.LM_BATCH)
  dtype = 'float32' if args.engine == 'fedjax_jit' else args.compute_dtype
  model = bench_rounds._model(  # pylint: disable=protected-access
      args.model, args.engine, dtype)
  clients, data = bench_rounds.population(
      args.model, args.cohort, args.seed, args.max_examples, args.data_dir)
  clients = bench_rounds.on_device(clients, args.engine, args.data_on_device)
  alg = bench_rounds._algorithm(  # pylint: disable=protected-access
      args.engine, model, batch_size, args)
  state = alg.init(model.init(jax.random.PRNGKey(args.seed)))
  out = {'config': vars(args), 'data': data,
         'device': bench_rounds._machine(),  # pylint: disable=protected-access
         'rounds': []}
  for r in range(args.warmup_rounds + args.rounds):
    cohort = bench_rounds.fresh_cohort(clients, args.cohort, args.seed, r)
    phases.reset()
    t = time.perf_counter()
    state, _ = alg.apply(state, cohort)
    jax.block_until_ready(state.params)
    wall = time.perf_counter() - t
    row = {'round': r + 1, 'warmup': r < args.warmup_rounds, 'wall_s': wall,
           'phases_s': dict(phases.seconds), 'calls': dict(phases.calls)}
    out['rounds'].append(row)
    parts = ', '.join(f'{k} {1e3 * v:.1f}' for k, v in sorted(
        phases.seconds.items(), key=lambda kv: -kv[1]))
    print(f"round {r + 1}{' (warm-up)' if row['warmup'] else ''}: "
          f'{1e3 * wall:.1f} ms; ms per phase: {parts}', flush=True)
  if args.output and args.output != '-':
    with open(args.output, 'w') as f:
      json.dump(out, f, indent=1)
  return out


def main(argv=None) -> None:
  p = profile_rounds.parser()
  p.description = __doc__.splitlines()[0]
  run(p.parse_args(argv))


if __name__ == '__main__':
  main()
