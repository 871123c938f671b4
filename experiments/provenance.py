"""Provenance and runner calls shared by the experiment scripts.

Every results file under ``experiments/results/`` records the commit it was
produced at (``git rev-parse HEAD``, and ``dirty: true`` when code differed
from that commit), the exact command that produced it, and for each of its
runs the ``experiments/run_experiment.py`` command that trained it: each run
is one runner invocation, and its numbers are read back from the runner's
``summary.json`` and ``metrics.jsonl``.

Imported by the scripts next to it (``python experiments/<script>.py`` puts
this folder first on ``sys.path``); tests add the folder themselves.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import app
from absl import flags

import stats

from fedlite_jax.training import outputs

REPO = pathlib.Path(__file__).resolve().parent.parent
RUNNER = 'experiments/run_experiment.py'
#: Paths whose changes do not make the code differ from the commit (the
#: results being regenerated are written there while a script runs).
RESULTS_DIR = 'experiments/results'


def git_state(repo: pathlib.Path = REPO) -> dict[str, Any]:
  """``{'commit': HEAD sha (40 hex), 'dirty': bool}`` of ``repo``.

  ``dirty`` is True when a tracked file outside ``experiments/results/``
  differs from HEAD or an untracked, not ignored file exists there.

  Raises:
    RuntimeError: ``repo`` is not a git checkout or git is missing (one line
      naming the folder).
  """
  try:
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo,
                            capture_output=True, text=True,
                            check=True).stdout.strip()
    status = subprocess.run(
        ['git', 'status', '--porcelain', '--', '.', f':!{RESULTS_DIR}'],
        cwd=repo, capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    raise RuntimeError(f'{repo}: cannot read the git commit ({e}); results '
                       'must be produced from a git checkout.') from None
  return {'commit': commit, 'dirty': bool(status.strip())}


def command_line(argv: Optional[Sequence[str]] = None) -> str:
  """``python <argv...>`` as one shell-quoted line (default ``sys.argv``).

  A script path under the repository is written relative to it (commands
  are run from the repository root).
  """
  argv = list(sys.argv if argv is None else argv)
  if argv:
    path = pathlib.Path(argv[0])
    if path.is_absolute() and REPO in path.resolve().parents:
      argv[0] = str(path.resolve().relative_to(REPO))
  return shlex.join(['python'] + argv)


def file_provenance() -> dict[str, Any]:
  """The file-level record: ``commit``, ``dirty``, ``command`` (this
  process's command line) and ``utc`` (start time)."""
  return {**git_state(), 'command': command_line(),
          'utc': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}


def markdown_header(prov: dict[str, Any]) -> str:
  """One Markdown paragraph naming the command and commit of ``prov``, and
  the commits its runs were trained at when they are not only that one
  (finished runs are reused when a study restarts: :func:`run_or_reuse`)."""
  dirty = ' (with uncommitted changes: `dirty: true`)' if prov['dirty'] else ''
  head = (f'Produced at commit `{prov["commit"]}`{dirty} on {prov["utc"]} by '
          f'(from the repository root, with `FEDLITE_DATA_DIR` set):\n\n'
          f'    {prov["command"]}\n')
  runs = prov.get('run_commits', {})
  if not runs or list(runs) == [prov['commit']]:
    return head
  same = {True: 'identical across them', False: 'NOT identical across them',
          None: 'not compared (git could not)'}[prov['training_code_same']]
  return head + (
      '\nIts runs were trained at ' + ', '.join(
          f'`{c[:7]}` ({n} run{"s" * (n > 1)})' for c, n in runs.items()) +
      ' (a restarted study reuses finished runs); the training code '
      f'(`{"`, `".join(TRAINING_CODE)}`) is {same}.\n')


#: What a run's result depends on, compared between the commits of a study's
#: runs (:func:`record_run_commits`).
TRAINING_CODE = ('fedlite_jax', RUNNER)


def record_run_commits(data: dict) -> None:
  """Records in ``data['provenance']`` the commits of its results' runs
  (``run_commits``: commit -> runs) and whether :data:`TRAINING_CODE` is
  the same at all of them (``training_code_same``: bool, None when git
  cannot compare them)."""
  commits: dict[str, int] = {}
  for row in data.get('results', []):
    for run in row.get('runs', []) if isinstance(row, dict) else []:
      if isinstance(run, dict) and run.get('commit'):
        commits[run['commit']] = commits.get(run['commit'], 0) + 1
  if not commits:
    return
  first, *rest = commits
  codes = set()
  for c in rest:  # git diff --quiet: 0 same, 1 differs, else an error.
    try:
      codes.add(subprocess.run(
          ['git', 'diff', '--quiet', first, c, '--', *TRAINING_CODE],
          cwd=REPO, capture_output=True, check=False).returncode)
    except OSError:
      codes.add(-1)
  same = None if codes - {0, 1} else 1 not in codes
  data['provenance']['run_commits'] = commits
  data['provenance']['training_code_same'] = same


def run_script(script: str, flags: Sequence[str]) -> dict[str, Any]:
  """Runs ``python <script> <flags>`` from the repository root.

  Args:
    script: path relative to the repository root, e.g. ``RUNNER``.
    flags: its command-line flags.

  Returns:
    ``{'command' (one shell-quoted line), 'commit', 'dirty' (at the start),
    'stdout', 'wall_seconds'}``.

  Raises:
    RuntimeError: the script exited non-zero (its last output lines).
  """
  record = {**git_state(), 'command': shlex.join(['python', script, *flags])}
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, script, *flags], cwd=REPO,
                        capture_output=True, text=True)
  if proc.returncode != 0:
    tail = '\n'.join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise RuntimeError(f'{record["command"]} exited {proc.returncode}:\n'
                       f'{tail}')
  return {**record, 'stdout': proc.stdout,
          'wall_seconds': time.perf_counter() - t0}


def run_experiment(flags: Sequence[str]) -> dict[str, Any]:
  """Runs ``python experiments/run_experiment.py <flags>`` (one run).

  Args:
    flags: run_experiment.py flags; must include ``--output_dir`` (relative
      to the repository root, or absolute).

  Returns:
    ``{'command', 'commit', 'dirty', 'summary' (summary.json), 'curve'
    (metrics.jsonl rows: one per round, evaluations with ``eval/*``),
    'wall_seconds' (the whole process: start-up, data
    loading, compilation, training, evaluation)}``.

  Raises:
    ValueError: no ``--output_dir=`` in ``flags``.
    RuntimeError: the run exited non-zero (its last output lines).
  """
  out = [f for f in flags if f.startswith('--output_dir=')]
  if not out:
    raise ValueError(f'run_experiment flags {list(flags)} lack --output_dir=.')
  out_dir = REPO / out[-1].split('=', 1)[1]
  record = run_script(RUNNER, flags)
  del record['stdout']
  summary = json.loads((out_dir / 'summary.json').read_text())
  curve = outputs.read_metrics(out_dir / 'metrics.jsonl')
  return {**record, 'summary': summary, 'curve': curve}


def run_or_reuse(flags: Sequence[str], rounds: int) -> dict[str, Any]:
  """:func:`run_experiment`, unless its ``--output_dir`` holds a finished run.

  A finished run (``summary.json`` with ``rounds`` rounds) is read back; an
  unfinished one resumes from its latest checkpoint (the runner's
  ``--resume``), so a long study can be stopped and restarted.

  Returns:
    As :func:`run_experiment`; ``commit`` and ``dirty`` are those the run
    recorded, ``wall_seconds`` None for a reused run.
  """
  out = [f for f in flags if f.startswith('--output_dir=')]
  if out:
    out_dir = REPO / out[-1].split('=', 1)[1]
    summary = out_dir / 'summary.json'
    if summary.exists():
      s = json.loads(summary.read_text())
      if s['rounds'] == rounds:
        curve = outputs.read_metrics(out_dir / 'metrics.jsonl')
        return {'command': shlex.join(['python', RUNNER, *flags]),
                'commit': s['code']['commit'], 'dirty': s['code']['dirty'],
                'wall_seconds': None, 'summary': s, 'curve': curve}
  return run_experiment(flags)


def define_study_flags(name: str, seeds: Sequence[int]) -> None:
  """A seeded study's common flags: --output_dir, --runs_dir (``runs/<name>``),
  --seeds and --report_only."""
  flags.DEFINE_string('output_dir', str(REPO / RESULTS_DIR),
                      'Where results go.')
  flags.DEFINE_string('runs_dir', f'runs/{name}', 'Per-run output '
                      'directories (relative to the repository root).')
  flags.DEFINE_list('seeds', [str(s) for s in seeds], 'Seeds.')
  flags.DEFINE_bool('report_only', False, 'Rewrite the .md and figures from '
                    'the stored JSON.')


def start_study(argv: Sequence[str], name: str,
                report: Callable[[dict, pathlib.Path], None]
                ) -> tuple[list[int], pathlib.Path] | None:
  """A study's seeds (``--seeds`` as integers) and output folder; None once
  ``--report_only`` has rewritten the report from ``<name>.json``.

  Raises:
    app.UsageError: extra arguments, or a seed that is not an integer.
  """
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {list(argv[1:])}')
  values = flags.FLAGS.seeds
  try:
    seeds = [int(v) for v in values]
  except ValueError:
    raise app.UsageError(f'--seeds={",".join(values)}: integers only.') from None
  out = pathlib.Path(flags.FLAGS.output_dir)
  if flags.FLAGS.report_only:
    report(json.loads((out / f'{name}.json').read_text()), out)
    return None
  return seeds, out


def seed_major(names: Sequence[str], seeds: Sequence[int],
               train: Callable[[str, int], dict]) -> dict[str, dict]:
  """``{name: {seed: train(name, seed)}}``, seed-major (first seeds first)."""
  runs = {name: {} for name in names}
  for seed in seeds:
    for name in names:
      runs[name][seed] = train(name, seed)
  return runs


def check_record(flags: Sequence[str], label: str) -> dict[str, Any]:
  """A results file's ``check``: a fresh run of ``flags`` and its curve (the
  evaluation rows, ``stats.eval_rows``)."""
  rec = run_experiment(list(flags) + ['--noresume', '--overwrite'])
  return {'label': label, **{k: rec[k] for k in ('command', 'commit', 'dirty')},
          'curve': stats.eval_rows(rec['curve'])}


def seeded_run(flags: Sequence[str], rounds: int, seed: int,
               metric: str = 'accuracy') -> dict[str, Any]:
  """One run of a seeded study (:func:`run_or_reuse`), as its JSON stores it:
  command, commit, seed, evaluation curve, ``metric`` (mean of the last
  ``stats.TAIL`` evaluations) and the summary's ``communication``."""
  rec = run_or_reuse(flags, rounds)
  s = rec['summary']
  curve = stats.eval_rows(rec['curve'])
  run = next(f for f in reversed(flags) if f.startswith('--output_dir='))
  print(f'{run.split("/")[-1]}: {s["final_eval"]}', flush=True)
  return {'command': rec['command'], 'commit': rec['commit'],
          'dirty': rec['dirty'], 'seed': seed, 'rounds': s['rounds'],
          'curve': curve, metric: stats.tail_mean(curve, metric),
          'communication': s['communication']}


def write_study(out: pathlib.Path, name: str, data: dict,
                report: Callable[[dict, pathlib.Path], None]) -> None:
  """Writes ``<out>/<name>.json`` and the report's .md and .png."""
  out.mkdir(parents=True, exist_ok=True)
  record_run_commits(data)
  report(data, out)
  write_json(out / f'{name}.json', data)
  print(f'wrote {out}/{name}.json, .md and .png')


def write_json(path: pathlib.Path, data: Any) -> None:
  """Writes ``data`` as indented JSON (``default=str`` for odd values)."""
  path.write_text(json.dumps(data, indent=1, default=str) + '\n')

#: A check's tolerance: this many times its measured spread, at least the
#: float-noise floor (experiments/measure_check_spread.py).
TOLERANCE_FACTOR = 3.0
FLOAT_NOISE = {'loss_rel': 1e-5, 'accuracy_examples': 1.0}


def _rows_tolerance_md_line(spread: Mapping[str, Any],
                            tol: Mapping[str, Any]) -> str:
  """:func:`tolerance_md_line` for a script's own per-row check (``rows``)."""
  def per_row(d):
    return '; '.join(f'{run} ' + ', '.join(
        f'{k[:-4]} {v:.2g}' for k, v in keys.items())
                     for run, keys in d.items())
  orders = '; '.join(d['description'] for d in spread['orders'].values())
  return (f'check tolerance, relative per row: {per_row(tol["rows"])} (the '
          f'larger of {TOLERANCE_FACTOR:g}x the spread, {per_row(spread["rows"])}'
          f', measured under: {orders}; and the float-noise floor '
          f'{FLOAT_NOISE["loss_rel"]:g}; per order in the check\'s "spread").')


def tolerance_md_line(spread: Mapping[str, Any], tol: Mapping[str, Any]) -> str:
  """The ``.md``'s one-line statement of the check's tolerance."""
  if 'rows' in tol:
    return _rows_tolerance_md_line(spread, tol)
  unit = 'tokens' if 'token' in spread['count_source'] else 'examples'
  head = (f'check tolerance: loss rel {tol["loss_rel"]:.2g}, accuracy '
          f'{tol["accuracy_examples"]:g} {unit} of {spread["count"]:,.0f}, '
          'bytes exact')
  floor = (f'float-noise floor loss rel {FLOAT_NOISE["loss_rel"]:g}, '
           f'accuracy {FLOAT_NOISE["accuracy_examples"]:g} {unit[:-1]}')
  if not spread['orders']:
    return f'{head} ({floor}; {spread["note"]}).'
  orders = '; '.join(d['description'] for d in spread['orders'].values())
  kind = ('stochastic rounding' if spread['stochastic_rounding'] else
          'no stochastic rounding')
  return (f'{head} (the larger of {TOLERANCE_FACTOR:g}x the spread, loss rel '
          f'{spread["loss_rel"]:.2g} and accuracy '
          f'{spread["accuracy_examples"]:g} {unit}, measured under: {orders}; '
          f'and the {floor}; {kind}; per order in the check\'s "spread").')


def results_md(lines: list[str], check: Mapping[str, Any]) -> str:
  """A results ``.md``'s text: ``lines``, then the check's tolerance line
  (:func:`tolerance_md_line`) when the check states its spread."""
  if 'spread' not in check or 'tolerance' not in check:
    return '\n'.join(lines)
  lines = list(lines)
  while lines and not lines[-1].strip():
    lines.pop()
  return '\n'.join(lines + ['', tolerance_md_line(check['spread'],
                                                  check['tolerance'])]) + '\n'
