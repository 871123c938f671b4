#!/usr/bin/env python3
"""Where a round's time goes: a profile of a few steady rounds.

Builds one configuration of ``bench_rounds.py`` (model, engine, cohort,
lanes, segment steps, data; its builders), runs ``--warmup_rounds`` rounds
that compile, then traces ``--rounds`` rounds with ``jax.profiler.trace``
(Python tracer off: it slowed GPU runs past their limit) and summarizes the
trace (``perfetto_trace.json.gz``):

* op time by class (:data:`CLASSES`, rules in :data:`CLASS_RULES`: the first
  rule whose words occur in the kernel name or its ``hlo_op`` wins; XLA:CPU's
  ``ynn_fusion`` kernels by the ops of their fused computation in the
  optimized HLO that ``--hlo_dump`` has XLA write) and the top kernels by total time with their counts. Each op counts its own time:
  an op event nested in another on the same thread is subtracted from the
  outer one, so the class times sum to the total op time;
* busy time: the union of the op intervals inside the traced rounds, as a
  share of the rounds' wall time;
* time outside ``lanes_segment``: the rounds' wall time minus the union of
  the ``jit_lanes_segment`` executions (from the first to the last op of
  each ``(hlo_module, run_id)``; with ``--segment_loop=host``, of the
  ``jit_lanes_step`` and ``jit_lanes_transition`` executions):
  ``lanes_begin``, ``lanes_finish``, the
  server update, the download, host work and idle time.

Which events are ops (``sources`` in the output says which applied):

* GPU: the events of the processes whose name contains ``GPU`` (kernels and
  copies on the device's streams; threads named ``Stream`` only, when there
  are any, so that derived lines are not counted twice);
* CPU: XLA:CPU's thunk events (those with an ``hlo_op`` argument) on the
  host's threads. Their time is host threads' time: with two threads
  running ops the total can exceed the wall time, the busy union cannot;
* otherwise the host's ``PjitFunction(<program>)`` events: dispatch spans
  of jitted programs, not device time.

Round wall times are measured on the host (``time.perf_counter`` around the
round and ``block_until_ready``); each traced round is also marked in the
trace (``TraceAnnotation``), and busy time and program spans are cut to
those marks. Tracing adds host overhead: the traced rounds are slower than
untraced ones (both are in the output).

The result goes to ``--output`` (JSON), rewritten after every phase, so a
killed run leaves what it had measured (``status`` says how far it got).

  python benchmarks/profile_rounds.py --model=femnist --engine=vmap \\
      --cohort=100 --output=/tmp/profile.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Iterable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rounds  # noqa: E402  (imports fedlite_jax first)
import jax  # noqa: E402
from fedlite_jax.models import layers  # noqa: E402
from fedlite_jax.rounds import device_rows  # noqa: E402
from fedlite_jax.rounds import stats as stats_lib  # noqa: E402
from fedlite_jax.rounds import streaming  # noqa: E402

#: Kernel classes, in the order the output lists them.
CLASSES = ('matmul', 'convolution', 'elementwise fusion', 'copy/transpose',
           'gather/scatter', 'reduce', 'other')
#: ``(class, words)``: a kernel belongs to the first class one of whose words
#: occurs in its lower-cased name or ``hlo_op``; else ``'other'``.
#: XLA:CPU's ``ynn_fusion`` (YNNPACK) kernels hold dots, reductions or
#: elementwise ops, and the name does not say which: ``'other'`` by name;
#: ``--hlo_dump`` (default) classes them by their ops (:func:`fusion_classes`).
#: Convolutions before
#: matmuls (cuDNN's implicit-GEMM kernels name both).
CLASS_RULES = (
    ('other', ('ynn_fusion',)),
    ('convolution', ('conv', 'fprop', 'dgrad', 'wgrad', 'implicit_gemm',
                     'winograd')),
    ('matmul', ('gemm', 'dot', 'matmul', 'cublas', 'cutlass', 'nvjet',
                'xmma')),
    ('gather/scatter', ('gather', 'scatter', 'dynamic-slice',
                        'dynamic_slice', 'dynamic-update-slice',
                        'dynamic_update_slice')),
    ('reduce', ('reduce', 'reduction')),
    ('copy/transpose', ('copy', 'transpose', 'memcpy', 'memset',
                        'concatenate')),
    ('elementwise fusion', ('fusion', 'wrapped_', 'loop_', 'elementwise')),
)
#: Marks of the traced rounds (``TraceAnnotation`` names).
ROUND_MARK = 'profile_rounds:round'
#: The program whose executions are the lane segments (with a ``'host'``
#: loop, also its step programs: ``streaming.STEP_PROGRAM_NAMES``).
SEGMENT_PROGRAM = 'lanes_segment'


def classify(name: str, hlo_op: str = '') -> str:
  """The :data:`CLASSES` entry of a kernel, by :data:`CLASS_RULES`."""
  text = f'{name} {hlo_op}'.lower()
  for cls, words in CLASS_RULES:
    if any(w in text for w in words):
      return cls
  return 'other'


def _body_class(opcodes: set[str]) -> str:
  """The class of a fused computation from the opcodes in its body."""
  for cls, ops in (('convolution', ('convolution',)), ('matmul', ('dot',)),
                   ('gather/scatter', ('gather', 'scatter', 'dynamic-slice',
                                       'dynamic-update-slice')),
                   ('reduce', ('reduce', 'reduce-window'))):
    if opcodes & set(ops):
      return cls
  return 'elementwise fusion'


def fusion_classes(dump_dir: str) -> dict[tuple[str, str], str]:
  """``{(module, fusion): class}`` for the ``ynn_fusion`` kernels of the
  optimized HLO text that ``--xla_dump_to`` wrote: a fusion whose body has
  a convolution is a convolution, else a dot a matmul, else a gather,
  scatter or dynamic slice gather/scatter, else a reduce reduce, else
  elementwise."""
  out: dict[tuple[str, str], str] = {}
  for path in glob.glob(os.path.join(dump_dir,
                                     '*after_optimizations.txt')):
    module = os.path.basename(path).split('.')[1]
    calls: dict[str, str] = {}
    bodies: dict[str, set[str]] = {}
    current = None
    with open(path) as f:
      for line in f:
        if line.startswith('%') and line.rstrip().endswith('{'):
          current = line[1:].split(' ', 1)[0]
          bodies[current] = set()
        elif line.startswith('}'):
          current = None
        elif ' = ' in line:
          lhs, rhs = line.strip().split(' = ', 1)
          op = re.search(r'([a-z][a-z0-9_-]*)\(', rhs)
          if not op:
            continue
          opcode = op.group(1)
          if current is not None:
            bodies[current].add(opcode)
          if opcode == 'fusion' and 'calls=%' in rhs:
            name = lhs.removeprefix('ROOT ').lstrip('%')
            calls[name] = rhs.split('calls=%', 1)[1].split(',')[0].split()[0]
    for name, comp in calls.items():
      if name.startswith('ynn_fusion') and comp in bodies:
        out[module, name] = _body_class(bodies[comp])
  return out


# --------------------------------------------------------------------------
# Trace parsing.

def find_trace(trace_dir: str) -> str:
  """The newest ``perfetto_trace.json.gz`` under ``trace_dir``."""
  found = sorted(glob.glob(os.path.join(trace_dir, '**',
                                        'perfetto_trace.json.gz'),
                           recursive=True), key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f'no perfetto_trace.json.gz under {trace_dir}')
  return found[-1]


def load_events(path: str) -> list[dict]:
  """The trace's events (a ``traceEvents`` list, or a bare list)."""
  with gzip.open(path, 'rt') as f:
    data = json.load(f)
  return data['traceEvents'] if isinstance(data, dict) else data


def _union(intervals: Iterable[tuple[float, float]]) -> float:
  total, end = 0.0, -float('inf')
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def _clip(intervals: Iterable[tuple[float, float]],
          windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
  out = []
  for a, b in intervals:
    for wa, wb in windows:
      lo, hi = max(a, wa), min(b, wb)
      if hi > lo:
        out.append((lo, hi))
  return out


def _self_times(events: list[dict]) -> list[float]:
  """Each event's duration less that of the events nested in it (same
  thread), in microseconds, in the order of ``events``."""
  own = [float(e.get('dur', 0.0)) for e in events]
  by_thread = collections.defaultdict(list)
  for i, e in enumerate(events):
    by_thread[e.get('pid'), e.get('tid')].append(i)
  for idx in by_thread.values():
    idx.sort(key=lambda i: (events[i]['ts'], -events[i].get('dur', 0.0)))
    stack: list[int] = []
    for i in idx:
      start = events[i]['ts']
      while stack and (events[stack[-1]]['ts'] +
                       events[stack[-1]].get('dur', 0.0)) <= start:
        stack.pop()
      if stack:
        own[stack[-1]] -= float(events[i].get('dur', 0.0))
      stack.append(i)
  return [max(t, 0.0) for t in own]


def _ops(events: list[dict]) -> tuple[list[dict], str]:
  """(op events, source) by the rules of the module docstring."""
  procs = {e['pid']: str(e.get('args', {}).get('name', '')) for e in events
           if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  threads = {(e['pid'], e.get('tid')): str(e.get('args', {}).get('name', ''))
             for e in events
             if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  spans = [e for e in events if e.get('ph') == 'X' and 'ts' in e]
  gpu = {p for p, n in procs.items() if 'GPU' in n}
  device = [e for e in spans if e['pid'] in gpu]
  if device:
    streams = {k for k in threads
               if k[0] in gpu and 'stream' in threads[k].lower()}
    if streams:
      device = [e for e in device if (e['pid'], e.get('tid')) in streams]
      return device, ('GPU kernels: events of the "GPU" processes\' '
                      '"Stream" threads')
    return device, 'GPU kernels: events of the "GPU" processes'
  cpu = [e for e in spans if 'hlo_op' in e.get('args', {})
         and not e['name'].startswith('end: ')]
  if cpu:
    return cpu, ('XLA:CPU thunk events (hlo_op/hlo_module arguments) on the '
                 'host threads: host thread time')
  return ([e for e in spans if e['name'].startswith('PjitFunction(')],
          'host PjitFunction(<program>) events: dispatch spans of jitted '
          'programs, not device time')


def _program(e: dict) -> str:
  args = e.get('args', {})
  if 'hlo_module' in args:
    return str(args['hlo_module'])
  name = e['name']
  if name.startswith('PjitFunction(') and name.endswith(')'):
    return 'jit_' + name[len('PjitFunction('):-1]
  return '?'


def host_calls(events: list[dict], windows: list[tuple[float, float]]
               ) -> dict[str, dict]:
  """``{program: {'calls', 'host_s', 'mean_ms'}}``: how long the host spent
  inside each jitted program's call (``PjitFunction(<program>)`` events,
  nested repeats of one call counted once) within ``windows``. A call that
  returns once its work is queued takes well under a millisecond; one
  whose host time is about its program's device span blocked until the
  program ended (on XLA:GPU: a loop or conditional whose predicate the
  host reads back)."""
  calls = sorted(
      (e for e in events if e.get('ph') == 'X'
       and str(e.get('name', '')).startswith('PjitFunction(')
       and any(a <= e['ts'] < b for a, b in windows)),
      key=lambda e: (e['pid'], e.get('tid'), e['ts'], -e.get('dur', 0.0)))
  ends: dict[tuple, float] = {}  # (pid, tid, name) -> end of the outer call
  out: dict[str, dict] = {}
  for e in calls:
    name, end = e['name'], e['ts'] + e.get('dur', 0.0)
    key = (e['pid'], e.get('tid'), name)
    if e['ts'] < ends.get(key, -1.0):
      continue  # Nested in a call of the same program.
    ends[key] = end
    c = out.setdefault(name[len('PjitFunction('):-1],
                       {'calls': 0, 'host_s': 0.0})
    c['calls'] += 1
    c['host_s'] += e.get('dur', 0.0) / 1e6
  for c in out.values():
    c['mean_ms'] = 1e3 * c['host_s'] / c['calls']
  return dict(sorted(out.items(), key=lambda kv: -kv[1]['host_s']))


def summarize(events: list[dict], windows: Optional[list] = None,
              top: int = 20,
              fusions: Optional[dict[tuple[str, str], str]] = None
              ) -> dict[str, Any]:
  """Summary of a trace's ops inside ``windows``.

  Args:
    events: trace events (:func:`load_events`).
    windows: ``[(start_us, end_us)]`` of the rounds, in the trace's clock;
      None: the :data:`ROUND_MARK` events of the trace. ValueError when
      there are none.
    top: kernels listed by total time.
    fusions: ``{(module, hlo_op): class}`` overriding the name rules
      (:func:`fusion_classes`).

  Returns:
    ``wall_s`` (sum of the windows), ``total_op_s`` (sum of the ops' own
    times, = the sum over ``classes``), ``classes`` (class -> ``{'s',
    'share', 'count'}``, share of ``total_op_s``), ``top_kernels``,
    ``busy_s`` and ``busy_share`` (of ``wall_s``), ``programs`` (module ->
    executions and span seconds), ``host_calls`` (:func:`host_calls`),
    ``segment_s``, ``outside_segment_s``
    and ``outside_segment_per_round_s`` (None when the ops name no
    program), ``sources``. Seconds throughout.
  """
  if windows is None:
    windows = sorted((e['ts'], e['ts'] + e.get('dur', 0.0)) for e in events
                     if e.get('ph') == 'X'
                     and str(e.get('name', '')).startswith(ROUND_MARK))
  if not windows:
    raise ValueError(f'no round windows: the trace has no {ROUND_MARK!r} '
                     'events and none were given')
  ops, source = _ops(events)
  inside = [e for e in ops
            if any(a <= e['ts'] < b for a, b in windows)]
  own = _self_times(inside)
  wall_us = sum(b - a for a, b in windows)
  classes = {c: {'s': 0.0, 'share': 0.0, 'count': 0} for c in CLASSES}
  kernels: dict[str, dict] = {}
  for e, t in zip(inside, own):
    hlo_op = str(e.get('args', {}).get('hlo_op', ''))
    cls = (fusions or {}).get((_program(e), hlo_op)) or classify(e['name'],
                                                                 hlo_op)
    classes[cls]['s'] += t / 1e6
    classes[cls]['count'] += 1
    k = kernels.setdefault(e['name'], {'name': e['name'], 'class': cls,
                                       'count': 0, 'total_s': 0.0})
    k['count'] += 1
    k['total_s'] += t / 1e6
  total = sum(c['s'] for c in classes.values())
  for c in classes.values():
    c['share'] = c['s'] / total if total else 0.0
  ranked = sorted(kernels.values(), key=lambda k: -k['total_s'])[:top]
  for k in ranked:
    k['share'] = k['total_s'] / total if total else 0.0
  busy = _union(_clip(((e['ts'], e['ts'] + e.get('dur', 0.0))
                       for e in inside), windows))
  # Program executions: first to last op of each (module, run_id).
  runs: dict[tuple, list[float]] = {}
  for e in inside:
    key = (_program(e), e.get('args', {}).get('run_id', id(e)))
    span = runs.setdefault(key, [e['ts'], e['ts'] + e.get('dur', 0.0)])
    span[0] = min(span[0], e['ts'])
    span[1] = max(span[1], e['ts'] + e.get('dur', 0.0))
  programs: dict[str, dict] = {}
  for (module, _), (a, b) in runs.items():
    p = programs.setdefault(module, {'executions': 0, 'spans': []})
    p['executions'] += 1
    p['spans'].append((a, b))
  for p in programs.values():
    p['span_s'] = _union(_clip(p.pop('spans'), windows)) / 1e6
  segment = sum(p['span_s'] for m, p in programs.items()
                if m.removeprefix('jit_') in streaming.STEP_PROGRAM_NAMES)
  # Ops without hlo_module: which program ran them is unknown.
  known = not inside or set(programs) != {'?'}
  return {
      'rounds': len(windows), 'wall_s': wall_us / 1e6,
      'op_events': len(inside), 'total_op_s': total, 'classes': classes,
      'top_kernels': ranked, 'busy_s': busy / 1e6,
      'busy_share': busy / wall_us if wall_us else 0.0,
      'programs': dict(sorted(programs.items(),
                              key=lambda kv: -kv[1]['span_s'])),
      'host_calls': host_calls(events, windows),
      'segment_s': segment if known else None,
      'outside_segment_s': wall_us / 1e6 - segment if known else None,
      'outside_segment_per_round_s': ((wall_us / 1e6 - segment) /
                                      len(windows) if known else None),
      'sources': {
          'ops': source,
          'wall': f'{ROUND_MARK} annotations around each round (host clock)',
          'programs': ('first to last op of each (hlo_module, run_id)'
                   if 'PjitFunction' not in source else
                   'PjitFunction dispatch spans') if known else
                  'none: the ops carry no hlo_module argument',
          'classes': 'CLASS_RULES on kernel names and hlo_op arguments' + (
              f'; {len(fusions)} ynn_fusion kernels by the ops of their '
              'fused computations in the optimized HLO' if fusions else ''),
      },
  }


# --------------------------------------------------------------------------
# Running.

def traced_rounds(alg, state, cohorts: list, trace_dir: str
                  ) -> tuple[Any, list[float], str]:
  """Runs ``alg.apply`` on each cohort under ``jax.profiler.trace``.

  Returns (state, host wall seconds per round, trace file, XLA compilations
  during the rounds: 0 in steady rounds). Each round is marked with a
  :data:`ROUND_MARK` annotation.
  """
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  walls = []
  with stats_lib.counting_compilations() as compiles, jax.profiler.trace(
      trace_dir, create_perfetto_trace=True, profiler_options=options):
    for i, cohort in enumerate(cohorts):
      with jax.profiler.TraceAnnotation(f'{ROUND_MARK} {i}'):
        t = time.perf_counter()
        state, _ = alg.apply(state, cohort)
        jax.block_until_ready(state.params)
        walls.append(time.perf_counter() - t)
  return state, walls, find_trace(trace_dir), compiles.total


def _write(path: Optional[str], result: dict) -> None:
  if not path or path == '-':
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(result, f, indent=1)
  os.replace(tmp, path)


def _print_summary(s: dict) -> None:
  print(f'traced rounds: {s["rounds"]}, wall {s["wall_s"]:.4g} s; ops: '
        f'{s["sources"]["ops"]}')
  print(f'op time {s["total_op_s"]:.4g} s over {s["op_events"]} events; '
        f'busy {s["busy_s"]:.4g} s = {100 * s["busy_share"]:.1f}% of the wall')
  if s['segment_s'] is None:
    print(f'outside {SEGMENT_PROGRAM}: unknown ({s["sources"]["programs"]})')
  else:
    print(f'outside {SEGMENT_PROGRAM}: {s["outside_segment_s"]:.4g} s '
          f'({s["outside_segment_per_round_s"]:.4g} s per round; '
          f'{SEGMENT_PROGRAM} {s["segment_s"]:.4g} s)')
  print('| class | s | share of op time | ops |\n|---|---:|---:|---:|')
  for c, v in s['classes'].items():
    print(f'| {c} | {v["s"]:.4g} | {100 * v["share"]:.1f}% | {v["count"]} |')
  print('| kernel | class | count | total s | share |\n'
        '|---|---|---:|---:|---:|')
  for k in s['top_kernels']:
    print(f'| {k["name"][:80]} | {k["class"]} | {k["count"]} |'
          f' {k["total_s"]:.4g} | {100 * k["share"]:.1f}% |')
  print('| program | executions | span s |\n|---|---:|---:|')
  for m, p in s['programs'].items():
    print(f'| {m} | {p["executions"]} | {p["span_s"]:.4g} |')
  print('| program called | calls | host s in the calls | mean ms |\n'
        '|---|---:|---:|---:|')
  for m, c in s.get('host_calls', {}).items():
    print(f'| {m} | {c["calls"]} | {c["host_s"]:.4g} | {c["mean_ms"]:.3g} |')


def run(args) -> dict:
  """Warm-up rounds, traced rounds, summary; the result dict (also written
  to ``args.output`` after every phase)."""
  result: dict[str, Any] = {
      'status': 'building', 'config': {
          k: getattr(args, k) for k in (
              'model', 'engine', 'cohort', 'warmup_rounds', 'rounds',
              'lanes_per_device', 'segment_steps', 'segment_loop',
              'prefetch', 'lane_starts', 'data_on_device', 'compute_dtype',
              'max_examples', 'seed')},
      'device': bench_rounds._machine()}  # pylint: disable=protected-access
  _write(args.output, result)
  batch_size = (bench_rounds.FEMNIST_BATCH if args.model == 'femnist' else
                bench_rounds.LM_BATCH)
  dtype = 'float32' if args.engine == 'fedjax_jit' else args.compute_dtype
  model = bench_rounds._model(  # pylint: disable=protected-access
      args.model, args.engine, dtype, conv=args.conv_implementation)
  clients, result['data'] = bench_rounds.population(
      args.model, args.cohort, args.seed, args.max_examples, args.data_dir)
  clients = bench_rounds.on_device(clients, args.engine, args.data_on_device)
  if args.cohort > len(clients):
    raise SystemExit(f'--cohort={args.cohort}: the population has '
                     f'{len(clients)} clients.')
  alg = bench_rounds._algorithm(  # pylint: disable=protected-access
      args.engine, model, batch_size, args)
  state = alg.init(model.init(jax.random.PRNGKey(args.seed)))
  result['status'] = 'warming up'
  result['warmup_round_s'] = []
  for r in range(args.warmup_rounds):
    t = time.perf_counter()
    state, _ = alg.apply(state, bench_rounds.fresh_cohort(
        clients, args.cohort, args.seed, r))
    jax.block_until_ready(state.params)
    result['warmup_round_s'].append(time.perf_counter() - t)
    _write(args.output, result)
  result['status'] = 'tracing'
  _write(args.output, result)
  cohorts = [bench_rounds.fresh_cohort(clients, args.cohort, args.seed, r)
             for r in range(args.warmup_rounds,
                            args.warmup_rounds + args.rounds)]
  _, walls, path, compiled = traced_rounds(alg, state, cohorts,
                                           args.trace_dir)
  result.update(status='parsing', traced_round_s=walls, trace_file=path,
                traced_compilations=compiled)
  _write(args.output, result)
  fusions = fusion_classes(args.hlo_dir) if args.hlo_dir else None
  result['summary'] = summarize(load_events(path), top=args.top,
                                fusions=fusions)
  if args.hlo_dir and not fusions:
    result['summary']['sources']['classes'] += (
        f'; no ynn_fusion in an optimized HLO under {args.hlo_dir}')
  result['summary']['host_wall_s'] = sum(walls)
  result['status'] = 'done'
  _write(args.output, result)
  return result


def parser() -> argparse.ArgumentParser:
  """The command line (also used by ``bench_rounds.py --profile``)."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--model', default='femnist',
                 choices=bench_rounds.MODELS)
  p.add_argument('--engine', default='vmap', choices=bench_rounds.ENGINES)
  p.add_argument('--cohort', type=int, default=10,
                 help='clients per round (fresh cohorts)')
  p.add_argument('--warmup_rounds', type=int, default=2,
                 help='untraced rounds first (they compile; on CPU the '
                 'vmap engine\'s second round compiled the server update '
                 'and download again)')
  p.add_argument('--rounds', type=int, default=2, help='traced rounds')
  p.add_argument('--lanes_per_device', default='auto',
                 help="vmap engine: lanes per device, int >= 1 or 'auto'")
  p.add_argument('--segment_steps', type=int, default=4,
                 help='vmap engine: local steps per compiled segment')
  p.add_argument('--segment_loop', default='auto',
                 choices=streaming.LOOPS,
                 help='vmap engine: unroll, scan, while, fixed or auto')
  p.add_argument('--prefetch', default=True,
                 action=argparse.BooleanOptionalAction,
                 help="vmap engine: make the next segment's inputs on a "
                 'worker thread (--no-prefetch: between calls)')
  p.add_argument('--lane_starts', default='rows', choices=streaming.STARTS,
                 help='vmap engine: LaneStreams.starts')
  p.add_argument('--data_on_device', default='auto',
                 choices=device_rows.SETTINGS,
                 help='vmap engine: examples on the device, batches as rows')
  p.add_argument('--compute_dtype', default='float32',
                 choices=('float32', 'bfloat16'))
  p.add_argument('--conv_implementation', default='auto',
                 choices=('auto',) + layers.CONV_IMPLEMENTATIONS,
                 help="the CNN's convolutions (bench_rounds.py's flag)")
  p.add_argument('--max_examples', type=int, default=0,
                 help='cap on examples per client (0: none)')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--data_dir', default=None,
                 help='FEMNIST data (default $FEDLITE_DATA_DIR)')
  p.add_argument('--top', type=int, default=20, help='kernels listed')
  p.add_argument('--trace_dir', default=None,
                 help='where the trace goes (default: a new temporary '
                 'folder)')
  p.add_argument('--output', default='-', help='JSON results file ("-": none)')
  p.add_argument('--hlo_dump', default=True,
                 action=argparse.BooleanOptionalAction,
                 help='dump the optimized HLO (XLA_FLAGS=--xla_dump_to, '
                 'under the trace folder; JAX\'s persistent compilation '
                 'cache off) to classify XLA:CPU\'s ynn_fusion kernels by '
                 'their ops')
  return p


def main(argv: Optional[list[str]] = None) -> dict:
  args = parser().parse_args(argv)
  if args.cohort < 1:
    raise SystemExit(f'--cohort must be >= 1; got {args.cohort}.')
  if args.warmup_rounds < 1 or args.rounds < 1:
    raise SystemExit(f'--warmup_rounds and --rounds must be >= 1; got '
                     f'{args.warmup_rounds} and {args.rounds}.')
  if args.lanes_per_device != 'auto' and not (
      args.lanes_per_device.isdigit() and int(args.lanes_per_device) >= 1):
    raise SystemExit(f"--lanes_per_device must be 'auto' or an int >= 1; "
                     f'got {args.lanes_per_device!r}.')
  args.trace_dir = args.trace_dir or tempfile.mkdtemp(
      prefix='profile_rounds_')
  args.hlo_dir = None
  if args.hlo_dump:  # Read when the backend starts, in run().
    # A program loaded from JAX's persistent cache is not compiled, so XLA
    # would not dump it.
    jax.config.update('jax_enable_compilation_cache', False)
    args.hlo_dir = os.path.join(args.trace_dir, 'hlo')
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_dump_to={args.hlo_dir}'
                               ' --xla_dump_hlo_as_text').strip()
  result = run(args)
  print(f'{args.model} {args.engine} cohort {args.cohort}: warm-up rounds '
        + ', '.join(f'{t:.3g}' for t in result['warmup_round_s'])
        + ' s; traced rounds '
        + ', '.join(f'{t:.3g}' for t in result['traced_round_s']) + ' s')
  if result['traced_compilations']:
    print(f'{result["traced_compilations"]} XLA compilations during the '
          'traced rounds: they are not steady (raise --warmup_rounds)')
  _print_summary(result['summary'])
  if args.output != '-':
    print(f'wrote {args.output}')
  return result


if __name__ == '__main__':
  main()
