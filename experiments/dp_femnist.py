#!/usr/bin/env python3
"""DP-FedAvg with and without compression on FEMNIST-105, over 3 seeds.

  FEDLITE_DATA_DIR=/path/to/data python experiments/dp_femnist.py

Rows: {no compression (``fedavg``, one local step), 8-bit uploads
(``--upload=uniform_quantization:8``), IGC static (d = 4,096)} x epsilon
{inf (no ``--dp_*`` flags), clip (DP-FedAvg's clipping and uniform weights
with z = 0: no noise, epsilon inf), 8, 4, 2} at delta = 1e-6 after
``--rounds`` rounds (``--dp_target_epsilon``: z calibrated by
dp_accounting's RDP). The clip rows separate what the noise costs from what
clipping and the fixed denominator cost.
Clip norm C = 0.5 of each client's decoded upload (one-step updates have
norm ~0.75 in rounds 1-2, so most are clipped); under IGC the clip and the
noise are in the d-dimensional subspace (docs/runner.md). Accounting
assumption: a production cohort of M = 100 clients drawn from a population of
N = 100,000 (q = 0.001, delta < 1/N); the noise on the 10 simulated clients'
sum is the cohort's, std z C 10 / 100 (``--dp_noise_cohort_size``,
``--dp_population``). The training setting is that of
``igc_femnist_static.flags`` (10 clients per round, batch 20, client SGD 0.3,
server SGD 1); same seed = same initialisation, cohorts, subspace and noise.
Without DP, ``fedavg`` weights clients by their examples (its default); with
DP uniformly (a fixed denominator); IGC weights uniformly in both.

Writes ``dp_femnist.json`` (rows under ``results`` with ``seeds``;
per-seed accuracy = mean of the last 3 evaluations; upload / download bits
per round; paired differences; a ``check`` re-running IGC at epsilon 8 for
``--check_rounds`` rounds), ``dp_femnist.md`` and ``dp_femnist.png``
(accuracy vs epsilon per compression). ``--compressions`` / ``--epsilons``
pick a subset (tests); ``--report_only`` rewrites the .md and .png.
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

import femnist_setting
import provenance
import stats

provenance.define_study_flags('dp_femnist', range(3))
flags.DEFINE_integer('rounds', 100, 'Rounds per run.', lower_bound=1)
flags.DEFINE_integer('check_rounds', 3, 'Rounds of the check run.',
                     lower_bound=1)
flags.DEFINE_list('compressions', ['none', 'upload8', 'igc4096'],
                  'Compressions (rows).')
flags.DEFINE_list('epsilons', ['inf', 'clip', '8', '4', '2'],
                  'Epsilons (inf: no DP; clip: clipping without noise).')
FLAGS = flags.FLAGS

DELTA, CLIP, COHORT, POPULATION = 1e-6, 0.5, 100, 100_000
_TRAIN = (*femnist_setting.TRAIN, '--clients_per_round=10',
          '--server_lr=1.0')
#: name: (label, flags).
COMPRESSIONS = {
    'none': ('no compression', femnist_setting.FULL),
    'upload8': ('8-bit uploads', (*femnist_setting.FULL,
                                  '--upload=uniform_quantization:8')),
    'igc4096': (femnist_setting.IGC_LABEL, femnist_setting.IGC),
}
CHECK = ('igc4096', '8')


def _flags(comp: str, eps: str, seed: int, rounds: int, out: str) -> list[str]:
  noise = ('--dp_noise_multiplier=0' if eps == 'clip' else
           f'--dp_target_epsilon={eps}')
  dp = [] if eps == 'inf' else [
      f'--dp_clip={CLIP}', noise, f'--dp_delta={DELTA}',
      f'--dp_noise_cohort_size={COHORT}', f'--dp_population={POPULATION}']
  return [*COMPRESSIONS[comp][1], *_TRAIN, *dp, f'--num_rounds={rounds}',
          f'--seed={seed}', f'--eval_every={max(1, rounds // 4)}',
          '--checkpoint_every=0', f'--output_dir={out}', '--noprogress']


def _name(comp: str, eps: str) -> str:
  return f'{comp}_eps{eps}'


def _train(name: str, seed: int) -> dict:
  comp, eps = name.rsplit('_eps', 1)
  out = f'{FLAGS.runs_dir}/{name}_seed{seed}'
  rec = provenance.seeded_run(_flags(comp, eps, seed, FLAGS.rounds, out),
                              FLAGS.rounds, seed)
  p = json.loads((provenance.REPO / out / 'summary.json').read_text()).get(
      'privacy')
  rec['privacy'] = p and {k: p[k] for k in ('epsilon', 'noise_multiplier')}
  return rec


def _report(data: dict, out: pathlib.Path) -> None:
  rows = {r['run']: r for r in data['results']}
  acc = {n: {x['seed']: x['accuracy'] for x in r['runs']}
         for n, r in rows.items()}
  comps = list(dict.fromkeys(r['compression'] for r in data['results']))
  epss = list(dict.fromkeys(r['epsilon'] for r in data['results']))
  label = lambda e: {'inf': 'no DP', 'clip': 'clip only'}.get(
      e, f'epsilon {e}')
  nums = [e for e in epss if e not in ('inf', 'clip')]
  # Each DP row against no DP and against clipping alone (the noise's
  # cost); each compression against none; each epsilon against the largest.
  refs = [(e, r) for r in ('inf', 'clip') for e in epss
          if e != r and e != 'inf'] + [(e, nums[0]) for e in nums[1:]]
  pairs = [(f'{COMPRESSIONS[c][0]}: {label(e)} - {label(r)}', _name(c, e),
            _name(c, r)) for c in comps for e, r in refs] + [
                (f'{label(e)}: {COMPRESSIONS[c][0]} - no compression',
                 _name(c, e), _name('none', e))
                for e in epss for c in comps if c != 'none']
  data['comparisons'] = [{'label': label, 'a': a, 'b': b,
                          **stats.paired(acc[a], acc[b])}
                         for label, a, b in pairs if a in acc and b in acc]
  m = data['meta']
  lines = [
      '# DP-FedAvg with compression on FEMNIST-105, over seeds', '',
      provenance.markdown_header(data['provenance']),
      f'{m["rounds"]} one-step rounds (10 clients per round, batch 20, '
      'client SGD 0.3, server SGD 1). Epsilon "clip": DP-FedAvg\'s clipping '
      'and uniform weights without noise (z = 0). DP: each decoded upload '
      'clipped to '
      f'C = {m["clip"]} (under IGC: its d coordinates), Gaussian noise on the '
      f'sum, z calibrated to epsilon at delta = {m["delta"]} after the '
      f'rounds, assuming a production cohort of {m["cohort"]} clients from '
      f'a population of {m["population"]:,} (q = '
      f'{m["cohort"] / m["population"]}); the noise on the 10 simulated '
      'clients\' sum is the cohort\'s. FedAvg weights clients by examples '
      'without DP and uniformly with it; IGC uniformly. Accuracy: test '
      'accuracy on all test '
      'examples, mean of the last 3 evaluations of each run, then mean ± std '
      'over seeds.', '',
      '| compression | epsilon | z | accuracy (%) | upload bits / round | '
      'download bits / round |', '|---|---|---|---|---|---|']
  for r in data['results']:
    z = r['noise_multiplier']
    lines.append(
        f'| {r["label"]} | {r["epsilon"]} | '
        f'{"-" if z is None else format(z, ".3f")} | '
        f'{stats.fmt(r["accuracy"], 1, 100)} | '
        f'{r["upload_bits_per_round"]:,.0f} | '
        f'{r["download_bits_per_round"]:,.0f} |')
  lines += stats.comparison_lines(data['comparisons'])
  lines += ['',
            '![accuracy vs epsilon](dp_femnist.png)', '',
            'Figure: test accuracy vs epsilon (inf = no DP), mean ± std over '
            'seeds, per compression.', '']
  (out / 'dp_femnist.md').write_text(
      provenance.results_md(lines, data.get('check', {})))
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for c in comps:
    got = [rows[_name(c, e)] for e in epss if _name(c, e) in rows]
    ax.errorbar([epss.index(r['epsilon']) for r in got],
                [100 * r['accuracy']['mean'] for r in got],
                [100 * r['accuracy']['std'] for r in got], marker='o',
                capsize=3, label=COMPRESSIONS[c][0])
  ax.set_xticks(range(len(epss)), epss)
  ax.set(xlabel=f'epsilon (delta = {m["delta"]})',
         ylabel='test accuracy (%)', title='FEMNIST-105 DP-FedAvg')
  ax.legend()
  fig.tight_layout()
  fig.savefig(out / 'dp_femnist.png', dpi=120)
  plt.close(fig)


def main(argv):
  started = provenance.start_study(argv, 'dp_femnist', _report)
  if started is None:
    return
  seeds, out = started
  for c in FLAGS.compressions:
    if c not in COMPRESSIONS:
      raise app.UsageError(f'--compressions: {c} not one of '
                           f'{", ".join(COMPRESSIONS)}.')
  names = [_name(c, e) for c in FLAGS.compressions for e in FLAGS.epsilons]
  data = {'provenance': provenance.file_provenance(),
          'meta': {'rounds': FLAGS.rounds, 'tail_evaluations': stats.TAIL,
                   'delta': DELTA, 'clip': CLIP, 'cohort': COHORT,
                   'population': POPULATION}}
  runs = provenance.seed_major(names, seeds, _train)
  data['results'] = []
  for name in names:
    comp, eps = name.rsplit('_eps', 1)
    first = runs[name][seeds[0]]
    comm = first['communication']
    data['results'].append({
        'run': name, 'label': COMPRESSIONS[comp][0], 'compression': comp,
        'epsilon': eps, 'seeds': seeds,
        'noise_multiplier': (first['privacy'] or {}).get('noise_multiplier'),
        'accuracy': stats.summarize([runs[name][s]['accuracy']
                                     for s in seeds]),
        'upload_bits_per_round': 8 * comm['total_upload_bytes'] /
                                 comm['rounds'],
        'download_bits_per_round': 8 * comm['total_download_bytes'] /
                                   comm['rounds'],
        'runs': [runs[name][s] for s in seeds]})
  data['check'] = provenance.check_record(
      _flags(*CHECK, 0, FLAGS.check_rounds, f'{FLAGS.runs_dir}/check'),
      f'{_name(*CHECK)} seed 0, {FLAGS.check_rounds} rounds')
  provenance.write_study(out, 'dp_femnist', data, _report)


if __name__ == '__main__':
  app.run(main)
