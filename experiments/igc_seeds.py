#!/usr/bin/env python3
"""Time-varying and K-subspace vs static IGC on FEMNIST-105, over 5 seeds.

  FEDLITE_DATA_DIR=/path/to/data python experiments/igc_seeds.py

Melas-Kyriazi & Wang (2022) find time-varying intrinsic compression
(Algorithm 3: a new subspace A_e each epoch, one epoch = one pass over the
clients = ceil(105 / 10) = 11 rounds here) better than static (Algorithm 1)
at small d, and K subspaces better than one. This script runs the rows of
``igc_bandwidth_accuracy.py`` that those claims compare -- static and
time-varying at d = 1,024 and 4,096, K-subspace (d = 4,096, K = 8) -- for
seeds 0-4 (same seed = same initialisation, cohorts and subspaces), 100
one-step rounds, test accuracy every 25 rounds.

Each run is one ``experiments/run_experiment.py`` invocation in
``--runs_dir/<row>_seed<s>`` (a finished run is read back). Writes
``igc_seeds.json`` (rows under ``results`` with ``seeds``; per-seed accuracy
= mean of the last 3 evaluations; paired differences; a ``check`` that
re-runs the time-varying d = 1,024 row for 5 rounds), ``igc_seeds.md`` and
``igc_seeds.png``. ``--report_only`` rewrites the .md and .png.
"""

from __future__ import annotations

import pathlib

from absl import app
from absl import flags

import provenance
import stats

provenance.define_study_flags('igc_seeds', range(5))
flags.DEFINE_integer('rounds', 100, 'Rounds per run.', lower_bound=1)
FLAGS = flags.FLAGS

_CONFIGS = 'experiments/configs'
#: (name, label, flagfile, options).
ROWS = (
    ('static_d1024', 'static, d = 1,024', 'igc_femnist_static',
     {'intrinsic_dim': 1024}),
    ('time_varying_d1024', 'time-varying, d = 1,024',
     'igc_femnist_time_varying', {'intrinsic_dim': 1024}),
    ('static_d4096', 'static, d = 4,096', 'igc_femnist_static',
     {'intrinsic_dim': 4096}),
    ('time_varying_d4096', 'time-varying, d = 4,096',
     'igc_femnist_time_varying', {'intrinsic_dim': 4096}),
    ('k_subspace_d4096_K8', 'K-subspace, d = 4,096, K = 8',
     'igc_femnist_k_subspace', {'intrinsic_dim': 4096, 'num_subspaces': 8}),
)
#: (label, row a, row b): claims of the form "a beats b".
PAIRS = (('time-varying - static, d = 1,024', 'time_varying_d1024',
          'static_d1024'),
         ('time-varying - static, d = 4,096', 'time_varying_d4096',
          'static_d4096'),
         ('K-subspace (K = 8) - static, d = 4,096', 'k_subspace_d4096_K8',
          'static_d4096'))
CHECK_ROW, CHECK_ROUNDS = 'time_varying_d1024', 5


def _flags(name: str, seed: int, rounds: int, eval_every: int | None,
           out: str) -> list[str]:
  _, _, flagfile, options = next(r for r in ROWS if r[0] == name)
  return ([f'--flagfile={_CONFIGS}/{flagfile}.flags'] +
          [f'--{k}={v}' for k, v in options.items()] +
          [f'--num_rounds={rounds}', f'--seed={seed}'] +
          [f'--eval_every={eval_every}'] * bool(eval_every) +
          ['--checkpoint_every=0', f'--output_dir={out}', '--noprogress'])


def _train(name: str, seed: int) -> dict:
  return provenance.seeded_run(
      _flags(name, seed, FLAGS.rounds, None,
             f'{FLAGS.runs_dir}/{name}_seed{seed}'), FLAGS.rounds, seed)


def _report(data: dict, out: pathlib.Path) -> None:
  rows = {r['run']: r for r in data['results']}
  acc = {n: {x['seed']: x['accuracy'] for x in r['runs']}
         for n, r in rows.items()}
  data['comparisons'] = [{'label': label, 'a': a, 'b': b,
                          **stats.paired(acc[a], acc[b])}
                         for label, a, b in PAIRS]
  seeds = rows[ROWS[0][0]]['seeds']
  lines = [
      '# IGC on FEMNIST-105: time-varying and K-subspace vs static, over '
      'seeds', '', provenance.markdown_header(data['provenance']),
      f'{data["meta"]["rounds"]} one-step rounds of the `igc_femnist_*.flags` files '
      '(10 clients per round, batch 20, client SGD 0.3, server SGD 1), seeds '
      f'{", ".join(map(str, seeds))}; same seed = same initialisation, '
      'cohorts and subspaces. Time-varying: a new subspace each epoch of '
      '11 rounds (one pass over the 105 clients, Algorithm 3). Accuracy: '
      'test accuracy on all test examples, mean of the last 3 evaluations '
      '(rounds 50, 75, 100) of each run, then mean ± std over seeds.', '',
      '| row | total compression | accuracy (%) |', '|---|---|---|']
  for r in data['results']:
    lines.append(f'| {r["label"]} | {r["total_compression"]:,.0f}x | '
                 f'{stats.fmt(r["accuracy"], 1, 100)} |')
  lines += ['', '| comparison | accuracy difference (points) |', '|---|---|']
  lines += [f'| {c["label"]} | {stats.fmt_paired(c, 1, 100)} |'
            for c in data['comparisons']]
  lines += ['', '![accuracy by round](igc_seeds.png)', '',
            'Figure: test accuracy by round, mean over seeds with a band of '
            '± one standard deviation, per row.', '']
  (out / 'igc_seeds.md').write_text(
      provenance.results_md(lines, data.get('check', {})))
  stats.plot_seed_bands(
      data['results'], out / 'igc_seeds.png', xlabel='round',
      title='FEMNIST-105 IGC (mean ± std over seeds)', scale=100,
      ylabel='test accuracy (%)')


def main(argv):
  started = provenance.start_study(argv, 'igc_seeds', _report)
  if started is None:
    return
  seeds, out = started
  data = {'provenance': provenance.file_provenance(),
          'meta': {'rounds': FLAGS.rounds, 'tail_evaluations': stats.TAIL}}
  runs = provenance.seed_major([r[0] for r in ROWS], seeds, _train)
  data['results'] = [
      {'run': name, 'label': label, 'options': options, 'seeds': seeds,
       'accuracy': stats.summarize([runs[name][s]['accuracy']
                                    for s in seeds]),
       'total_compression': runs[name][seeds[0]]['communication'][
           'total_compression'],
       'runs': [runs[name][s] for s in seeds]}
      for name, label, _, options in ROWS]
  data['check'] = provenance.check_record(
      _flags(CHECK_ROW, 0, CHECK_ROUNDS, CHECK_ROUNDS,
             f'{FLAGS.runs_dir}/check'),
      f'{CHECK_ROW} seed 0, {CHECK_ROUNDS} rounds')
  provenance.write_study(out, 'igc_seeds', data, _report)


if __name__ == '__main__':
  app.run(main)
