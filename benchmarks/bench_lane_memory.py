#!/usr/bin/env python3
"""Peak memory of a vmapped round follows the lanes, not the cohort.

Runs ``experiments/run_experiment.py`` for one round of a task (default
Shakespeare, its task defaults) in separate processes, each process's peak
resident memory read from ``resource.getrusage(RUSAGE_CHILDREN)``:

* reference: ``--round_engine=vmap``, ``C`` clients on ``C`` lanes;
* streamed: ``N`` clients on ``C`` lanes (each lane streams ``N / C``);
* wide: ``N`` clients on ``N`` lanes;
* loop: ``N`` clients on the loop engine (the result every vmapped run
  must give).

It prints each run's peak RSS as a ratio to the reference, the final test
loss against the loop engine's (relative difference), the executed /
useful local steps and sequential steps from ``summary.json``'s ``engine``
section, and writes the table to ``--output`` (markdown).

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_lane_memory.py
  python benchmarks/bench_lane_memory.py --task=embedded_mnist --clients=20 --lanes=5
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNNER = REPO / 'experiments' / 'run_experiment.py'


def _run(args: argparse.Namespace, name: str, flags: list[str],
         out_dir: pathlib.Path) -> dict:
  """One runner process; its peak RSS (GiB), wall time and summary."""
  out = out_dir / name
  command = [sys.executable, str(RUNNER), f'--task={args.task}',
             '--num_rounds=1', f'--seed={args.seed}', '--noprogress',
             f'--output_dir={out}', *args.extra, *flags]
  # Peak RSS of this child alone: RUSAGE_CHILDREN's ru_maxrss is the maximum
  # over waited-for children, so each run is measured in a fresh helper.
  probe = ('import resource, subprocess, sys; '
           'subprocess.run(sys.argv[1:], check=True); '
           'print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)')
  t0 = time.perf_counter()
  done = subprocess.run([sys.executable, '-c', probe, *command],
                        capture_output=True, text=True, check=False)
  wall = time.perf_counter() - t0
  if done.returncode != 0:
    sys.exit(f'{name} failed ({shlex.join(command)}):\n{done.stderr[-3000:]}')
  rss_kib = int(done.stdout.strip().splitlines()[-1])
  summary = json.loads((out / 'summary.json').read_text())
  return {'name': name, 'command': shlex.join(command),
          'peak_rss_gib': rss_kib / 2**20, 'wall_s': wall,
          'loss': float(summary['final_eval']['loss']),
          'engine': summary.get('engine', {})}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--task', default='shakespeare')
  parser.add_argument('--clients', type=int, default=40, help='N')
  parser.add_argument('--lanes', type=int, default=10, help='C')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--skip_wide', action='store_true',
                      help='Skip the N-clients-on-N-lanes run.')
  parser.add_argument('--output', default=str(
      REPO / 'benchmarks' / 'results' / 'lane_memory.md'))
  parser.add_argument('extra', nargs='*',
                      help='More runner flags (after --), e.g. --data_dir=...')
  args = parser.parse_args()
  n, c = args.clients, args.lanes
  runs = []
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    plan = [
        ('loop', [f'--clients_per_round={n}', '--round_engine=loop']),
        (f'vmap {c} clients on {c} lanes', [
            f'--clients_per_round={c}', '--round_engine=vmap',
            f'--lanes_per_device={c}']),
        (f'vmap {n} clients on {c} lanes', [
            f'--clients_per_round={n}', '--round_engine=vmap',
            f'--lanes_per_device={c}']),
    ]
    if not args.skip_wide:
      plan.append((f'vmap {n} clients on {n} lanes', [
          f'--clients_per_round={n}', '--round_engine=vmap',
          f'--lanes_per_device={n}']))
    for name, flags in plan:
      runs.append(_run(args, name, flags, tmp))
      print(f"{name}: peak RSS {runs[-1]['peak_rss_gib']:.2f} GiB, "
            f"{runs[-1]['wall_s']:.0f} s, loss {runs[-1]['loss']:.7g}",
            flush=True)
  loop, ref = runs[0], runs[1]
  lines = [
      f'# Peak memory of a vmapped round: {n} clients on {c} lanes',
      '',
      f'Command: `python benchmarks/bench_lane_memory.py {shlex.join(sys.argv[1:])}`',
      f'(task {args.task}, 1 round, seed {args.seed}; {platform.machine()}, '
      f'Python {platform.python_version()}; each run a separate process, '
      'peak resident memory of that process).',
      '',
      '| run | peak RSS (GiB) | vs reference | final loss | rel. diff vs loop '
      '| executed / useful steps | sequential steps | wall (s) |',
      '|---|---|---|---|---|---|---|---|',
  ]
  for r in runs:
    eng = r['engine']
    ratio = (eng.get('executed_steps', 0) / eng['useful_steps']
             if eng.get('useful_steps') else float('nan'))
    rel = abs(r['loss'] - loop['loss']) / abs(loop['loss'])
    lines.append(
        f"| {r['name']}{' (reference)' if r is ref else ''} | "
        f"{r['peak_rss_gib']:.2f} | {r['peak_rss_gib'] / ref['peak_rss_gib']:.2f}x"
        f" | {r['loss']:.7g} | {rel:.1e} | {ratio:.3f} | "
        f"{eng.get('sequential_steps', '-')} | {r['wall_s']:.0f} |")
  lines += ['', 'Commands:', '']
  lines += [f'- {r["name"]}: `{r["command"]}`' for r in runs]
  text = '\n'.join(lines) + '\n'
  print(text)
  pathlib.Path(args.output).write_text(text)


if __name__ == '__main__':
  main()
