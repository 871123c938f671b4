#!/usr/bin/env python3
"""XLA:CPU with glibc's defaults, with huge pages, and with glibc tuned.

glibc is set when a process starts (huge pages: ``GLIBC_TUNABLES``) or
before JAX starts its threads (tuned: ``FEDLITE_CPU_ALLOCATOR``), once per
process (``fedlite_jax.cpu_allocator``), so this script runs each
measurement in a child process per mode, one after another, and prints the
speed-up of each mode over glibc's defaults (``system``):

* lane steps: ``bench_lane_step.py`` (ms per step: a one-client step, the
  plain vmapped step over ``--lanes`` lanes, a lane segment's step);
* runner rounds: ``experiments/run_experiment.py`` (its embedded default
  data, or ``--runner_flags``), per ``--engines`` entry, ``engine`` or
  ``engine:segment_loop``, ``--runs`` runs per mode, alternating (the
  median over runs of each run's median round after the first, the largest
  peak resident memory of a run, and whether every run's final test
  metrics agree to the last printed digit: the allocator must not change
  results).

  FEDLITE_DATA_DIR=... python benchmarks/bench_cpu_allocator.py \\
      --runner_flags='--task=emnist --clients_per_round=20' \\
      --output=benchmarks/results/cpu_allocator.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
#: The children's environment per mode (fedlite_jax.cpu_allocator's names).
MODES = {
    'system': {'FEDLITE_CPU_ALLOCATOR': 'system',
               'FEDLITE_CPU_HUGE_PAGES': '0'},
    'huge_pages': {'FEDLITE_CPU_ALLOCATOR': 'system',
                   'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1'},
    'tuned': {'FEDLITE_CPU_ALLOCATOR': 'tuned', 'FEDLITE_CPU_HUGE_PAGES': '0'},
}


def _child(cmd: list[str], mode: str) -> tuple[str, float]:
  """Runs ``cmd`` with the allocator ``mode``: (stdout, peak RSS in MB).
  Raises RuntimeError with the end of its stderr if it fails."""
  env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
  env.update(MODES[mode])
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
    proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=out, stderr=err)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    if proc.returncode:
      raise RuntimeError(f'{" ".join(cmd)} ({mode}) exited '
                         f'{proc.returncode}: {err.read()[-3000:]}')
    return out.read(), usage.ru_maxrss / 1024


def lane_steps(model: str, kinds: str, lanes: int, repeats: int,
               mode: str) -> dict[str, float]:
  """ms per call of each lane-step kind under ``mode``."""
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, 'steps.jsonl')
    _child([sys.executable, os.path.join(_HERE, 'bench_lane_step.py'),
            f'--models={model}', '--dtypes=float32', f'--kinds={kinds}',
            f'--lanes={lanes}', f'--repeats={repeats}', f'--output={path}'],
           mode)
    with open(path) as f:
      rows = [json.loads(line) for line in f]
  return {f"{r['kind']} ({r['lanes']} lanes)": r['ms'] for r in rows}


def runner_round(engine: str, rounds: int, flags: str, mode: str) -> dict:
  """The runner's steady s/round (median of ``time/train_seconds`` after
  round 1), peak RSS (MB) and final metrics line."""
  engine, _, loop = engine.partition(':')
  if loop:
    flags += f' --segment_loop={loop}'
  with tempfile.TemporaryDirectory() as d:
    out, rss = _child(
        [sys.executable, os.path.join(_REPO, 'experiments', 'run_experiment.py'),
         f'--num_rounds={rounds}', f'--round_engine={engine}',
         f'--output_dir={d}/run', '--noprogress', *shlex.split(flags)], mode)
    with open(os.path.join(d, 'run', 'metrics.jsonl')) as f:
      seconds = [r['time/train_seconds'] for r in map(json.loads, f)
                 if 'time/train_seconds' in r]
  metrics = re.search(r'test accuracy .*', out)
  if not metrics or len(seconds) < 2:
    raise RuntimeError(f'no test accuracy or < 2 rounds in: {out[-2000:]}')
  return {'s': statistics.median(seconds[1:]), 'rss_mb': rss,
          'metrics': metrics.group(0)}


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--model', default='femnist',
                  help='bench_lane_step model ("" skips the lane steps)')
  ap.add_argument('--kinds', default='client,vmap,segment')
  ap.add_argument('--lanes', type=int, default=10)
  ap.add_argument('--repeats', type=int, default=5)
  ap.add_argument('--engines', default='loop,vmap,vmap:host',
                  help='runner engines[:segment loop] ("" skips the runner)')
  ap.add_argument('--rounds', type=int, default=10)
  ap.add_argument('--runs', type=int, default=3,
                  help='runner runs per mode, the modes alternating')
  ap.add_argument('--runner_flags', default='',
                  help='more runner flags ("": the embedded default data)')
  ap.add_argument('--output', default='', help='markdown ("": none)')
  a = ap.parse_args(argv)
  modes = tuple(MODES)
  rows = []
  if a.model:
    got = {m: lane_steps(a.model, a.kinds, a.lanes, a.repeats, m)
           for m in modes}
    for name in got['system']:
      rows.append({'what': f'{a.model} {name}, ms per step',
                   **{m: got[m][name] for m in modes}, 'rss': '',
                   'same': ''})
      print(_line(rows[-1]), flush=True)
  for engine in filter(None, a.engines.split(',')):
    got = {m: [] for m in modes}
    for _ in range(a.runs):
      for m in modes:
        got[m].append(runner_round(engine, a.rounds, a.runner_flags, m))
    name = engine.replace(':', ' engine, segment loop ')
    rows.append({
        'what': f'runner, {name}{"" if ":" in engine else " engine"}, '
                's/round',
        **{m: statistics.median(r['s'] for r in got[m]) for m in modes},
        'rss': ' / '.join(f"{max(r['rss_mb'] for r in got[m]):.0f}"
                          for m in modes),
        'same': 'yes' if len({r['metrics'] for m in modes
                              for r in got[m]}) == 1 else 'NO',
        'runs': {m: [round(r['s'], 3) for r in got[m]] for m in modes}})
    print(_line(rows[-1]), flush=True)
  if a.output:
    with open(a.output, 'w') as f:
      f.write(_markdown(rows, a))
  return rows


def _line(r: dict) -> str:
  return (f"{r['what']:>48} " + ' '.join(f'{r[m]:>9.3f}' for m in MODES)
          + f" {r['system'] / r['huge_pages']:>6.2f}x "
          f"{r['system'] / r['tuned']:>6.2f}x {r['rss']:>20} {r['same']}")


def _markdown(rows: list[dict], a) -> str:
  lines = [
      '# XLA:CPU with glibc\'s defaults, huge pages, and tuned '
      '(`fedlite_jax.cpu_allocator`)', '',
      'Regenerate: `' + ('FEDLITE_DATA_DIR=... ' if a.runner_flags else '')
      + 'python benchmarks/bench_cpu_allocator.py '
      f'--model={a.model} --kinds={a.kinds} '
      f'--lanes={a.lanes} --repeats={a.repeats} --engines={a.engines} '
      f'--rounds={a.rounds} --runs={a.runs} --runner_flags={shlex.quote(a.runner_flags)} '
      f'--output={a.output}`', '',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPUs, '
      f'{platform.libc_ver()[0]} {platform.libc_ver()[1]}. One child process '
      'per row and mode (in the order of the columns); the runner rows run FedAvg, seed 0, '
      f'with `{a.runner_flags or "the embedded default data"}`, {a.rounds} '
      f'rounds, {a.runs} runs per mode alternating (s/round: the median of '
      'the runs\' median rounds after round 1).', '',
      '| measured | system | huge pages | tuned | speed-up, huge pages | '
      'speed-up, tuned | peak RSS MB (system / huge pages / tuned) | '
      'same test metrics |',
      '|---|---:|---:|---:|---:|---:|---:|---|']
  for r in rows:
    lines.append(f"| {r['what']} | {r['system']:.3f} | "
                 f"{r['huge_pages']:.3f} | {r['tuned']:.3f} | "
                 f"{r['system'] / r['huge_pages']:.2f}x | "
                 f"{r['system'] / r['tuned']:.2f}x | {r['rss']} | "
                 f"{r['same']} |")
  lines.append('')
  for r in rows:
    if 'runs' in r:
      lines.append(f"- {r['what']}, each run: " + '; '.join(
          f"{m} {r['runs'][m]}" for m in MODES))
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  main()
