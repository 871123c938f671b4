#!/usr/bin/env python3
"""Bandwidth vs accuracy on FEMNIST-105: intrinsic gradient compression and
baselines (the shape of Melas-Kyriazi & Wang 2022, Figure 1 / Table 2).

  FEDLITE_DATA_DIR=/path/to/data python experiments/igc_bandwidth_accuracy.py

Each row is one ``experiments/run_experiment.py`` invocation on a flagfile
``experiments/configs/igc_femnist_*.flags`` (plus the row's options, e.g.
``--intrinsic_dim=1024``): uncompressed SGD (one local step per round),
FedAvg with 2 and 5 local steps (for R/2 and R/5 rounds: the same number of
examples as R one-step rounds), local Top-K, FetchSGD, and static /
time-varying / K-subspace / K-subspace + time-varying intrinsic compression
at several d. Every method takes one local SGD step per round on a batch of
20 examples per client (10 clients per round), the paper's protocol. Every
run starts from scratch (``--noresume --overwrite``), so the results are
those of the code at the recorded commit.

Writes ``experiments/results/igc_femnist.{md,png,json}``: the JSON holds the
commit and command of the file and of every run (its run_experiment.py
command line), the numbers read from each run's ``summary.json`` and
``metrics.jsonl``, and a ``check`` run (``CHECK_LABEL``, a compressed row,
for ``--check_rounds`` rounds) that ``tests/test_experiment_results.py``
re-runs. Per-run outputs go to ``--runs_dir``.

Compression columns: ``up`` / ``down`` / ``total`` from the communication
ledger (against 32 bits x D per client-round each way; total = 2 / (1/up +
1/down)); ``vs SGD`` = total bits of the uncompressed-SGD run / this run's
total bits, at the same number of examples processed (equals ``total`` for
one-step methods; s for FedAvg with s local steps and R/s rounds -- the
paper's FedAvg accounting).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

from absl import app
from absl import flags

import numpy as np

import provenance

flags.DEFINE_integer('rounds', None, 'R: rounds of the one-step methods '
                     '(default: the flagfiles\' 100).', lower_bound=1)
flags.DEFINE_integer('seed', None, 'Run seed (default: the flagfiles\' 0).')
flags.DEFINE_string('runs_dir', 'runs/igc_femnist',
                    'Per-run output directories (relative to the repository '
                    'root).')
flags.DEFINE_string('results_dir', str(provenance.REPO / 'experiments' /
                                       'results'),
                    'Where igc_femnist.{md,png,json} go.')
flags.DEFINE_list('only', [], 'Run only these labels or slugs (writes '
                  'igc_femnist_partial.*).')
flags.DEFINE_integer('check_rounds', 5, 'Rounds of the stored check run (0: '
                     'none).', lower_bound=0)
flags.DEFINE_bool('report_only', False,
                  'Rewrite the .md/.png from the saved .json (no training).')
FLAGS = flags.FLAGS

_NOTES_MARKER = '<!-- hand-written findings below: kept when regenerating -->'
_CONFIGS = 'experiments/configs'


@dataclasses.dataclass(frozen=True)
class Setup:
  """One row: a label, its flagfile and option overrides, a round divisor."""
  label: str
  family: str
  flagfile: str
  options: dict
  round_divisor: int = 1


def setups() -> list[Setup]:
  s = [Setup('SGD (uncompressed)', 'uncompressed', 'igc_femnist_sgd', {})]
  for steps in (2, 5):
    s.append(Setup(f'FedAvg ({steps} local steps)', 'fedavg',
                   f'igc_femnist_fedavg{steps}', {}, round_divisor=steps))
  for k in (12_000, 60_000):
    s.append(Setup(f'Local Top-K (k={k:,})', 'topk', 'igc_femnist_topk',
                   {'upload': f'top_k:{k}:log2'}))
  s.append(Setup('FetchSGD (5x50,000, k=12,000)', 'fetchsgd',
                 'igc_femnist_fetchsgd', {'topk_k': 12_000}))
  for d in (1024, 4096, 16384, 65536):
    s.append(Setup(f'IGC static (d={d:,})', 'igc_static',
                   'igc_femnist_static', {'intrinsic_dim': d}))
  for d in (1024, 4096):
    s.append(Setup(f'IGC time-varying (d={d:,})', 'igc_time_varying',
                   'igc_femnist_time_varying', {'intrinsic_dim': d}))
  s.append(Setup('IGC K-subspace (d=4,096, K=8)', 'igc_k_subspace',
                 'igc_femnist_k_subspace',
                 {'intrinsic_dim': 4096, 'num_subspaces': 8}))
  s.append(Setup('IGC K-subspace + TV (d=1,024, K=4)',
                 'igc_k_subspace_time_varying',
                 'igc_femnist_k_subspace_time_varying',
                 {'intrinsic_dim': 1024, 'num_subspaces': 4}))
  return s


def _slug(label: str) -> str:
  """'IGC static (d=4,096)' -> 'igc_static_d4096'."""
  out = ''.join(c if c.isalnum() else ('' if c in ',=' else '_')
                for c in label.lower())
  while '__' in out:
    out = out.replace('__', '_')
  return out.strip('_')


def run_flags(setup: Setup, slug: str, rounds: int | None) -> list[str]:
  """run_experiment.py flags of ``setup`` (``rounds``: R, else the file's)."""
  flags_ = [f'--flagfile={_CONFIGS}/{setup.flagfile}.flags']
  flags_ += [f'--{k}={v}' for k, v in setup.options.items()]
  if rounds is not None:
    flags_.append(f'--num_rounds={max(1, rounds // setup.round_divisor)}')
  if FLAGS.seed is not None:
    flags_.append(f'--seed={FLAGS.seed}')
  return flags_ + [f'--output_dir={FLAGS.runs_dir}/{slug}', '--noresume',
                   '--overwrite', '--checkpoint_every=0', '--noprogress']


def _row(setup: Setup, run: dict) -> dict:
  summary = run['summary']
  comm = summary['communication']
  return {
      'label': setup.label, 'family': setup.family,
      'options': setup.options, 'rounds': summary['rounds'],
      'seed': summary['flags']['seed'],
      'client_lr': summary['flags']['client_lr'],
      'accuracy': summary['final_eval']['accuracy'],
      'loss': summary['final_eval']['loss'],
      'upload_compression': comm['upload_compression'],
      'download_compression': comm['download_compression'],
      'total_compression': comm['total_compression'],
      'total_bits': 8 * (comm['total_upload_bytes'] +
                         comm['total_download_bytes']),
      'seconds_per_round': summary['seconds_per_round'],
      'wall_seconds': run['wall_seconds'],
      'command': run['command'], 'commit': run['commit'],
      'dirty': run['dirty'], 'curve': run['curve'],
  }


def _fmt(x: float) -> str:
  if not np.isfinite(x):
    return str(x)
  if x >= 100:
    return f'{x:,.0f}'
  return f'{x:.3g}'


def _write_table(data: dict, path: pathlib.Path) -> None:
  results = data['results']
  meta = data['meta']
  base = next((r for r in results if r['family'] == 'uncompressed'), None)
  lines = [
      '# Intrinsic gradient compression on FEMNIST-105: bandwidth vs accuracy',
      '',
      provenance.markdown_header(data['provenance']),
      'Each row is one `experiments/run_experiment.py` run; its exact command '
      'and commit are in `igc_femnist.json` (`results[i].command`). '
      f'R = {meta["rounds"]} one-step rounds, seed {meta["seed"]}, client '
      f'learning rate {meta["client_lr"]}. Task `emnist` on FEMNIST-105 (105 '
      'real writers, 62 classes; FedJAX EMNIST CNN, D = 1,206,590), 10 '
      'clients per round, one local SGD step on a batch of 20 examples per '
      'client per round (the paper\'s protocol), server SGD at rate 1, test '
      'accuracy on all 1,685 test examples after the last round. One seed: '
      'differences of ~1 point are within run-to-run noise.',
      '',
      f'Machine: {meta["machine"]}. Total wall time '
      f'{data["total_wall_seconds"] / 60:.1f} min (includes start-up, '
      'compilation and evaluation of every run).',
      '',
      '| method | rounds | test acc. | test loss | up | down | total | vs SGD '
      '| s/round | wall s |',
      '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in results:
    vs = base['total_bits'] / r['total_bits'] if base else float('nan')
    lines.append(
        f"| {r['label']} | {r['rounds']} | {100 * r['accuracy']:.1f}% | "
        f"{r['loss']:.3f} | {_fmt(r['upload_compression'])}x | "
        f"{_fmt(r['download_compression'])}x | "
        f"{_fmt(r['total_compression'])}x | {_fmt(vs)}x | "
        f"{r['seconds_per_round']:.2f} | {r['wall_seconds']:.0f} |")
  lines += ['', 'One seed per row: the table gives each method\'s accuracy and '
            'bandwidth; comparisons between rows are made over seeds in '
            '`igc_seeds.md`.']
  lines += [
      '',
      'Columns: `up` / `down` / `total`: compression from the communication '
      'ledger against 32 bits x D per client-round each way (total = 2 / '
      '(1/up + 1/down), Table 2\'s definition). `vs SGD`: bits of the '
      'uncompressed-SGD run / bits of this run, at equal examples processed '
      '(FedAvg with s local steps runs R/s rounds). Top-K upload counts 32 + '
      'ceil(log2 D) = 53 bits per kept entry (value + index); Top-K and '
      'FetchSGD download the weights changed since the client last '
      'participated (FetchSGD\'s accounting); IGC bits follow Table 1 '
      '(static d/d, time-varying d/2d, K-subspace d(+index)/dK). '
      '`s/round`: mean wall time of a round (client work + server update; '
      'the first round includes compilation).',
  ]
  text = '\n'.join(lines) + '\n'
  if path.exists() and _NOTES_MARKER in path.read_text():
    # Keep hand-written findings below the marker across regenerations.
    text += '\n' + _NOTES_MARKER + path.read_text().split(_NOTES_MARKER, 1)[1]
  path.write_text(text)


def _plot(results: list[dict], path: pathlib.Path, meta: dict) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  base = next((r for r in results if r['family'] == 'uncompressed'), None)
  styles = {
      'uncompressed': ('k', '*'), 'fedavg': ('tab:gray', 's'),
      'topk': ('tab:orange', 'v'), 'fetchsgd': ('tab:red', '^'),
      'igc_static': ('tab:blue', 'o'), 'igc_time_varying': ('tab:green', 'D'),
      'igc_k_subspace': ('tab:purple', 'P'),
      'igc_k_subspace_time_varying': ('tab:brown', 'X'),
  }
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  for family, (color, marker) in styles.items():
    rs = sorted((r for r in results if r['family'] == family),
                key=lambda r: r['total_bits'], reverse=True)
    if not rs:
      continue
    xs = [base['total_bits'] / r['total_bits'] if base else
          r['total_compression'] for r in rs]
    ys = [100 * r['accuracy'] for r in rs]
    ax.plot(xs, ys, color=color, marker=marker, label=family,
            linestyle='-' if len(rs) > 1 else 'none')
    for r, x, y in zip(rs, xs, ys):
      d = r['options'].get('intrinsic_dim') or r['options'].get('topk_k') or (
          int(r['options']['upload'].split(':')[1])
          if str(r['options'].get('upload', '')).startswith('top_k:')
          else None)
      if d:
        ax.annotate(f'{d:,}', (x, y), textcoords='offset points',
                    xytext=(4, 4), fontsize=7, color=color)
  ax.set_xscale('log')
  ax.set_xlabel('total compression vs uncompressed SGD (same examples)')
  ax.set_ylabel('test accuracy (%)')
  ax.set_title(f'FEMNIST-105, {meta["rounds"]} one-step rounds, seed '
               f'{meta["seed"]}')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=8, loc='best')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _meta(results: list[dict]) -> dict:
  """R, seed, client lr and machine of the table (from its first row)."""
  first = results[0]
  m = first['machine']
  return {'rounds': first['rounds'] * first['round_divisor'],
          'seed': first['seed'], 'client_lr': first['client_lr'],
          'machine': f'{m["platform"]}, {os.cpu_count()} cores, jax '
                     f'{m["jax"]} ({m["backend"]})'}


#: The row the stored check re-runs: compressed, so it exercises IGC code.
CHECK_LABEL = 'IGC time-varying (d=1,024)'


def _check_run(setup: Setup) -> dict:
  """``setup`` for ``--check_rounds`` rounds: the row the test re-runs."""
  run = provenance.run_experiment(
      run_flags(setup, 'check', FLAGS.check_rounds) +
      [f'--eval_every={FLAGS.check_rounds}'])
  return {'label': setup.label, 'command': run['command'],
          'commit': run['commit'], 'dirty': run['dirty'],
          'curve': run['curve']}


def _write_outputs(data: dict, out: pathlib.Path, stem: str) -> None:
  _write_table(data, out / f'{stem}.md')
  _plot(data['results'], out / f'{stem}.png', data['meta'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  out = pathlib.Path(FLAGS.results_dir)
  stem = 'igc_femnist' if not FLAGS.only else 'igc_femnist_partial'
  if FLAGS.report_only:
    _write_outputs(json.loads((out / f'{stem}.json').read_text()), out, stem)
    print(f'rewrote {out / stem}.md/.png from {stem}.json')
    return
  prov = provenance.file_provenance()
  todo = [s for s in setups() if not FLAGS.only or s.label in FLAGS.only
          or _slug(s.label) in FLAGS.only]
  t0 = time.perf_counter()
  results = []
  for s in todo:
    run = provenance.run_experiment(run_flags(s, _slug(s.label), FLAGS.rounds))
    r = {**_row(s, run), 'round_divisor': s.round_divisor,
         'machine': run['summary']['machine']}
    results.append(r)
    print(f"{r['label']:<40} acc {100 * r['accuracy']:5.1f}%  total "
          f"{r['total_compression']:8.1f}x  {r['seconds_per_round']:.2f} "
          f"s/round  wall {r['wall_seconds']:.0f} s", flush=True)
  data = {'provenance': prov, 'meta': _meta(results),
          'total_wall_seconds': time.perf_counter() - t0, 'results': results}
  if FLAGS.check_rounds:
    data['check'] = _check_run(next((s for s in todo if s.label == CHECK_LABEL),
                                    todo[0]))
  out.mkdir(parents=True, exist_ok=True)
  provenance.write_json(out / f'{stem}.json', data)
  _write_outputs(data, out, stem)
  print(f'wrote {out / stem}.md/.png/.json; total '
        f'{data["total_wall_seconds"] / 60:.1f} min')


if __name__ == '__main__':
  app.run(main)
