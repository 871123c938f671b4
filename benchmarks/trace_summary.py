"""A profiled round's trace, summarized: ``bench_rounds.py --profile``.

:func:`traced_rounds` runs rounds under ``jax.profiler.trace`` (Python
tracer off: it slowed GPU runs past their limit), each marked by a
:data:`ROUND_MARK` annotation. :func:`summarize` reads the Perfetto trace:
op time by class (:data:`CLASS_RULES` on kernel names and ``hlo_op``; each
op's own time, nested ops subtracted, so classes sum to the op time), the
top kernels, busy time (the union of the ops inside the rounds over their
wall time), each XLA program's executions and span (first to last op of
each ``(hlo_module, run_id)``) and the time outside ``jit_lanes_segment``.
Ops: on GPU the events of the ``GPU`` processes (their ``Stream`` threads
when named); on CPU XLA's thunk events (host threads' time).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import time
from typing import Any, Iterable, Optional

import jax

from fedlite_jax.rounds import stats as stats_lib

CLASSES = ('matmul', 'convolution', 'elementwise fusion', 'copy/transpose',
           'gather/scatter', 'reduce', 'other')
#: ``(class, words)``: the first class with a word in the kernel's name or
#: ``hlo_op`` wins (convolutions first: cuDNN's implicit GEMMs name both;
#: XLA:CPU's ``ynn_fusion`` does not say what it fuses).
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
ROUND_MARK = 'bench_rounds:round'
SEGMENT_MODULE = 'jit_lanes_segment'


def classify(name: str, hlo_op: str = '') -> str:
  """The :data:`CLASSES` entry of a kernel, by :data:`CLASS_RULES`."""
  text = f'{name} {hlo_op}'.lower()
  for cls, words in CLASS_RULES:
    if any(w in text for w in words):
      return cls
  return 'other'


def load_events(path: str) -> list[dict]:
  """The events of a ``perfetto_trace.json.gz``."""
  with gzip.open(path, 'rt') as f:
    data = json.load(f)
  return data['traceEvents'] if isinstance(data, dict) else data


def _union(intervals: Iterable[tuple[float, float]]) -> float:
  total, end = 0.0, -float('inf')
  for a, b in sorted(intervals):
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def _clip(intervals, windows) -> list[tuple[float, float]]:
  return [(max(a, wa), min(b, wb)) for a, b in intervals
          for wa, wb in windows if min(b, wb) > max(a, wa)]


def _self_times(events: list[dict]) -> list[float]:
  """Each event's duration less its nested events' (same thread), in us."""
  own = [float(e.get('dur', 0.0)) for e in events]
  by_thread = collections.defaultdict(list)
  for i, e in enumerate(events):
    by_thread[e.get('pid'), e.get('tid')].append(i)
  for idx in by_thread.values():
    idx.sort(key=lambda i: (events[i]['ts'], -events[i].get('dur', 0.0)))
    stack: list[int] = []
    for i in idx:
      while stack and (events[stack[-1]]['ts'] + events[stack[-1]].get(
          'dur', 0.0)) <= events[i]['ts']:
        stack.pop()
      if stack:
        own[stack[-1]] -= float(events[i].get('dur', 0.0))
      stack.append(i)
  return [max(t, 0.0) for t in own]


def _ops(events: list[dict]) -> tuple[list[dict], str]:
  """(op events, source) by the rules of the module docstring."""
  meta = {(e.get('name'), e['pid'], e.get('tid')): str(
      e.get('args', {}).get('name', '')) for e in events if e.get('ph') == 'M'}
  gpu = {p for (kind, p, _), n in meta.items()
         if kind == 'process_name' and 'GPU' in n}
  spans = [e for e in events if e.get('ph') == 'X' and 'ts' in e]
  device = [e for e in spans if e['pid'] in gpu]
  if device:
    streams = {(p, t) for (kind, p, t), n in meta.items()
               if kind == 'thread_name' and p in gpu and 'stream' in n.lower()}
    if streams:
      return ([e for e in device if (e['pid'], e.get('tid')) in streams],
              'GPU kernels: events of the "GPU" processes\' "Stream" threads')
    return device, 'GPU kernels: events of the "GPU" processes'
  return ([e for e in spans if 'hlo_op' in e.get('args', {})
           and not e['name'].startswith('end: ')],
          'XLA:CPU thunk events (hlo_op/hlo_module arguments) on the host '
          'threads: host thread time')


def summarize(events: list[dict], windows: Optional[list] = None,
              top: int = 20) -> dict[str, Any]:
  """Summary of a trace's ops inside ``windows``.

  Args:
    events: trace events (:func:`load_events`).
    windows: ``[(start_us, end_us)]`` of the rounds; None: the trace's
      :data:`ROUND_MARK` events (ValueError when there are none).
    top: kernels listed by total time.

  Returns:
    ``rounds``, ``wall_s``, ``op_events``, ``total_op_s`` (= the sum over
    ``classes``: class -> ``{'s', 'share', 'count'}``), ``top_kernels``,
    ``busy_s``, ``busy_share``, ``programs`` (module -> ``executions``,
    ``span_s``), ``segment_s``, ``outside_segment_s``,
    ``outside_segment_per_round_s`` (None when no op names its program),
    ``sources``. Seconds throughout.
  """
  if windows is None:
    windows = sorted((e['ts'], e['ts'] + e.get('dur', 0.0)) for e in events
                     if e.get('ph') == 'X'
                     and str(e.get('name', '')).startswith(ROUND_MARK))
  if not windows:
    raise ValueError(f'no round windows: the trace has no {ROUND_MARK!r} '
                     'events and none were given')
  ops, source = _ops(events)
  inside = [e for e in ops if any(a <= e['ts'] < b for a, b in windows)]
  wall = sum(b - a for a, b in windows) / 1e6
  classes = {c: {'s': 0.0, 'share': 0.0, 'count': 0} for c in CLASSES}
  kernels: dict[str, dict] = {}
  runs: dict[tuple, list[float]] = {}
  for e, t in zip(inside, _self_times(inside)):
    cls = classify(e['name'], str(e.get('args', {}).get('hlo_op', '')))
    classes[cls]['s'] += t / 1e6
    classes[cls]['count'] += 1
    k = kernels.setdefault(e['name'], {'name': e['name'], 'class': cls,
                                       'count': 0, 'total_s': 0.0})
    k['count'] += 1
    k['total_s'] += t / 1e6
    end = e['ts'] + e.get('dur', 0.0)
    args = e.get('args', {})
    span = runs.setdefault((str(args.get('hlo_module', '?')),
                            args.get('run_id', id(e))), [e['ts'], end])
    span[0], span[1] = min(span[0], e['ts']), max(span[1], end)
  total = sum(c['s'] for c in classes.values())
  for c in list(classes.values()) + list(kernels.values()):
    c['share'] = c.get('s', c.get('total_s', 0.0)) / total if total else 0.0
  busy = _union(_clip(((e['ts'], e['ts'] + e.get('dur', 0.0))
                       for e in inside), windows)) / 1e6
  programs: dict[str, dict] = {}
  for (module, _), span in runs.items():
    p = programs.setdefault(module, {'executions': 0, 'spans': []})
    p['executions'] += 1
    p['spans'].append(tuple(span))
  for p in programs.values():
    p['span_s'] = _union(_clip(p.pop('spans'), windows)) / 1e6
  known = not inside or set(programs) != {'?'}
  segment = programs.get(SEGMENT_MODULE, {}).get('span_s', 0.0)
  return {
      'rounds': len(windows), 'wall_s': wall, 'op_events': len(inside),
      'total_op_s': total, 'classes': classes,
      'top_kernels': sorted(kernels.values(), key=lambda k: -k['total_s'])[
          :top],
      'busy_s': busy, 'busy_share': busy / wall if wall else 0.0,
      'programs': dict(sorted(programs.items(),
                              key=lambda kv: -kv[1]['span_s'])),
      'segment_s': segment if known else None,
      'outside_segment_s': wall - segment if known else None,
      'outside_segment_per_round_s': ((wall - segment) / len(windows)
                                      if known else None),
      'sources': {'ops': source, 'wall': f'{ROUND_MARK} annotations',
                  'programs': ('first to last op of each (hlo_module, '
                               'run_id)') if known else
                  'none: the ops carry no hlo_module argument'},
  }


def traced_rounds(alg, state, cohorts: list, trace_dir: str
                  ) -> tuple[Any, list[float], str, int]:
  """``alg.apply`` on each cohort under ``jax.profiler.trace``.

  Returns:
    (state, host wall seconds per round, the trace file, XLA compilations
    during the rounds: 0 when they are steady).
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
  found = sorted(glob.glob(os.path.join(trace_dir, '**', '*perfetto_trace*'),
                          recursive=True), key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f'no perfetto_trace.json.gz under {trace_dir}')
  return state, walls, found[-1], compiles.total


def summary_lines(s: dict, top: int = 8) -> list[str]:
  """The summary as text: totals, op time by class, the top kernels."""
  return [f'{s["rounds"]} profiled round(s), wall {s["wall_s"]:.4g} s, op '
          f'time {s["total_op_s"]:.4g} s, busy {100 * s["busy_share"]:.1f}%'
          + ('' if s['segment_s'] is None else ', outside lanes_segment '
             f'{s["outside_segment_per_round_s"]:.4g} s per round')
          + f' (ops: {s["sources"]["ops"]})',
          'by class: ' + ', '.join(f'{c} {100 * v["share"]:.1f}%'
                                   for c, v in s['classes'].items())] + [
              f'  {k["total_s"]:.4g} s ({100 * k["share"]:.1f}%, '
              f'{k["count"]} ops, {k["class"]}): {k["name"][:80]}'
              for k in s['top_kernels'][:top]]
