#!/usr/bin/env python3
"""Compilations of whole training runs on the vmap engine, and their steps.

Runs ``experiments/run_experiment.py --round_engine=vmap`` for each task
(fresh cohorts every round, as training does) and reads ``summary.json``'s
``engine`` section: XLA compilations counted from JAX's own compile events
(every program; the client program ``lanes_begin``/``lanes_segment``/
``lanes_finish`` apart) and their seconds, lanes, steps per segment, and
per round (``metrics.jsonl``) the sequential steps against the bound
``max(ceil(useful / lanes), longest client) + segment_steps``, the rounds
that compiled the client program, and executed / useful lane-steps. Writes
a markdown table.

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_run_compilations.py

Every run compiles every program (JAX's persistent cache off). With
``--compilation_cache``, each run is made twice with the runner's
``--compilation_cache_dir`` on a fresh folder: cold (the reference, in the
same script), then the same flags again, as a second seed or a resumed run
would; the table adds the second run's compile and wall seconds and whether
its final evaluation equals the first's.

  python benchmarks/bench_run_compilations.py --runs=emnist --rounds=2 \
      --clients=20 --compilation_cache
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNNER = REPO / 'experiments' / 'run_experiment.py'

#: name -> runner flags (besides the engine, rounds and cohort).
RUNS = {
    'shakespeare': ['--task=shakespeare'],
    'emnist': ['--task=emnist'],
    'emnist_25_lanes': ['--task=emnist', '--lanes_per_device=25'],
    'shakespeare_transformer': ['--task=shakespeare',
                                '--model=transformer_large'],
}


def run(name: str, flags: list[str], args, out: pathlib.Path,
        cache_dir: pathlib.Path | None = None) -> dict:
  """One runner process; its summary's engine section and metrics rows
  (``cache_dir``: the runner's ``--compilation_cache_dir``, else none)."""
  if cache_dir is not None:
    flags = [*flags, f'--compilation_cache_dir={cache_dir}']
  command = [sys.executable, str(RUNNER), *flags, '--round_engine=vmap',
             f'--num_rounds={args.rounds}',
             f'--clients_per_round={args.clients}',
             f'--eval_every={args.rounds}', f'--seed={args.seed}',
             '--noprogress', '--checkpoint_every=0', f'--output_dir={out}']
  if (out / 'summary.json').exists() and (out / 'wall_s').exists():
    wall = float((out / 'wall_s').read_text())  # Finished: read back.
  else:
    t0 = time.perf_counter()
    # Without cache_dir every program compiles in the run (no persistent
    # cache): the compile seconds are what a fresh run pays.
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE=str(
        cache_dir is not None).lower())
    done = subprocess.run(command, capture_output=True, text=True,
                          check=False, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
      sys.exit(f'{name} failed ({shlex.join(command)}):\n'
               f'{done.stderr[-3000:]}')
    (out / 'wall_s').write_text(repr(wall))
  summary = json.loads((out / 'summary.json').read_text())
  rows = [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()
          if l.strip()]
  # The command as a user types it: no interpreter or checkout paths.
  shown = (shlex.join(['python', str(RUNNER.relative_to(REPO)),
                        *command[2:-1]]) + f' --output_dir=<tmp>/{out.name}')
  if cache_dir is not None:
    shown = shown.replace(str(cache_dir), '<tmp>/xla')
  return {'name': name, 'command': shown, 'wall_s': wall,
          'engine': summary['engine'], 'rows': rows,
          'seconds_per_round': summary['seconds_per_round'],
          'final_eval': summary['final_eval']}


def _shown_argv(argv: list[str]) -> list[str]:
  """The flags that decide the results (not where files go)."""
  return [a for a in argv
          if not a.startswith(('--work_dir', '--output', '--note'))]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--runs', default=','.join(RUNS),
                      help=f'comma list of {", ".join(RUNS)}')
  parser.add_argument('--rounds', type=int, default=20)
  parser.add_argument('--clients', type=int, default=100)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument(
      '--work_dir', default=None,
      help='keep the runs in <work_dir>/<run>; a finished run there is read '
      'back, not run again (default: a temporary folder)')
  parser.add_argument(
      '--note', default='',
      help='a sentence on the conditions (e.g. the machine\'s load), added '
      'to the results file')
  parser.add_argument(
      '--compilation_cache', action='store_true',
      help='run each twice on a fresh --compilation_cache_dir: cold, then '
      'warm')
  parser.add_argument('--output', default=None, help='default: benchmarks/'
                      'results/compilations_cpu.md (compilation_cache_cpu.md '
                      'with --compilation_cache)')
  args = parser.parse_args()
  args.output = args.output or str(
      REPO / 'benchmarks' / 'results' /
      f'{"compilation_cache" if args.compilation_cache else "compilations"}'
      '_cpu.md')
  names = args.runs.split(',')
  bad = [n for n in names if n not in RUNS]
  if bad:
    sys.exit(f'--runs: unknown {bad}; allowed: {", ".join(RUNS)}.')
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      work = pathlib.Path(args.work_dir or tmp)
      cache = work / f'{name}_xla' if args.compilation_cache else None
      if cache is not None and not (work / name / 'summary.json').exists():
        shutil.rmtree(cache, ignore_errors=True)  # Cold: a fresh cache.
      results.append(run(name, RUNS[name], args, work / name, cache))
      if cache is not None:
        results[-1]['warm'] = run(name, RUNS[name], args,
                                  work / f'{name}_warm', cache)
      for r in (results[-1], results[-1].get('warm')):
        if r is not None:
          e = r['engine']
          print(f"{name}: {e['client_program_compilations']} client-program "
                f"compilations, {e['compilations']} in all, "
                f"{e['compile_seconds']:.1f} s compiling, {r['wall_s']:.0f} "
                's', flush=True)
  lines = [
      f'# Compilations of {args.rounds}-round runs on the vmap engine',
      '',
      f'Command: `python benchmarks/bench_run_compilations.py '
      f'{shlex.join(_shown_argv(sys.argv[1:]))}`',
      f'({args.clients} clients per round, a fresh cohort every round, seed '
      f'{args.seed}; {platform.machine()}, Python '
      f'{platform.python_version()}; one process per run).'
      + (f' {args.note}' if args.note else ''),
      '',
      '| run | lanes | steps per segment | client-program compilations '
      '| all compilations | compile s | sequential steps per round '
      '| executed / useful | s/round | wall s |',
      '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
  ]
  for r in results:
    e = r['engine']
    lines.append(
        f"| {r['name']} | {e['lanes']} | {e['segment_steps']} | "
        f"{e['client_program_compilations']} | {e['compilations']} | "
        f"{e['compile_seconds']:.0f} | "
        f"{e['sequential_steps'] / args.rounds:.1f} | "
        f"{e['executed_steps'] / e['useful_steps']:.3f} | "
        f"{r['seconds_per_round']:.1f} | {r['wall_s']:.0f} |")
  if args.compilation_cache:
    lines += ['', 'The same flags again on the cache the first run filled '
              '(`--compilation_cache_dir`; JAX counts a program loaded from '
              'it as a compilation):', '',
              '| run | compile s, cold | compile s, warm | cold / warm | '
              'wall s, cold | wall s, warm | same final evaluation |',
              '|---|---:|---:|---:|---:|---:|---|']
    for r in results:
      cold, warm = r['engine']['compile_seconds'], r['warm']['engine'][
          'compile_seconds']
      lines.append(
          f"| {r['name']} | {cold:.1f} | {warm:.1f} | {cold / warm:.1f}x | "
          f"{r['wall_s']:.0f} | {r['warm']['wall_s']:.0f} | "
          f"{r['final_eval'] == r['warm']['final_eval']} |")
  lines += ['', 'Per round (`metrics.jsonl`): sequential steps against the '
            'bound `max(ceil(useful / lanes), longest client) + '
            'segment_steps`, and the client-program compilations of each '
            'round:', '']
  for r in results:
    e = r['engine']
    rows = [x for x in r['rows'] if x.get('engine/segments')]
    over = [x for x in rows if x['engine/sequential_steps'] > max(
        -(-x['engine/useful_steps'] // e['lanes']),
        x['engine/longest_client_steps']) + e['segment_steps']]
    compiled = [x['round'] for x in r['rows']
                if x.get('engine/client_program_compilations')]
    lines.append(f"- {r['name']}: {len(rows)} rounds, {len(over)} above the "
                 f'bound; the client program compiled in round(s) '
                 f'{compiled}')
  lines += ['', 'Commands:', '']
  lines += [f'- {r["name"]}: `{r["command"]}`' for r in results]
  lines += [f'- {r["name"]}, warm: `{r["warm"]["command"]}`'
            for r in results if 'warm' in r]
  text = '\n'.join(lines) + '\n'
  print(text)
  pathlib.Path(args.output).write_text(text)


if __name__ == '__main__':
  main()
