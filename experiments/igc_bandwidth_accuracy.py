#!/usr/bin/env python3
"""Bandwidth vs accuracy on FEMNIST-105 over seeds: intrinsic gradient
compression (static, time-varying, K-subspace) against uncompressed SGD,
FedAvg (2 and 5 local steps), local Top-K and FetchSGD (the shape of
Melas-Kyriazi & Wang 2022, Figure 1 / Table 2).

  FEDLITE_DATA_DIR=/path/to/data python experiments/igc_bandwidth_accuracy.py

Each row (``setups()``) is one ``experiments/run_experiment.py`` run per seed
(0-2) of an ``experiments/configs/igc_femnist_*.flags`` file plus the row's
options, in ``--runs_dir/<row>_seed<s>`` (a finished run is read back).
FedAvg with s local steps runs R/s rounds (the examples of R one-step
rounds). Writes ``igc_femnist.json`` (per row: seeds, accuracy over seeds,
bits, per-seed runs; paired comparisons; a ``check`` that re-runs the
time-varying d = 1,024 row for 5 rounds), ``igc_femnist.md`` and
``igc_femnist.png``; with ``--only``, ``igc_femnist_partial.*``.
``--report_only`` rewrites the .md and .png from the JSON.
"""

from __future__ import annotations

import dataclasses
import pathlib

from absl import app
from absl import flags

import provenance
import stats

provenance.define_study_flags('igc_femnist', range(3))
flags.DEFINE_integer('rounds', 100, 'R: rounds of the one-step rows (FedAvg '
                     'with s local steps runs R/s).', lower_bound=1)
flags.DEFINE_integer('eval_every', 20, 'Evaluate every this many one-step '
                     'rounds (FedAvg with s local steps: every eval_every/s '
                     'rounds, the same examples).', lower_bound=1)
flags.DEFINE_list('only', [], 'Run only these rows, by slug (e.g. '
                  'igc_static_d4096; an unknown one lists them); writes '
                  'igc_femnist_partial.*.')
FLAGS = flags.FLAGS

_CONFIGS = 'experiments/configs'
#: Families whose download bits depend on the run: the weights changed since
#: a client last took part (``--download_accounting=changed``).
_RUN_DEPENDENT_BITS = ('topk', 'fetchsgd')
#: Protocol flags of the flagfiles that the .md states.
_PROTOCOL = ('task', 'clients_per_round', 'client_batch_size', 'client_lr',
             'server_lr')


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


#: (row a, row b): the comparisons "a - b" the .md reports (row labels).
PAIRS = (
    ('IGC time-varying (d=1,024)', 'IGC static (d=1,024)'),
    ('IGC time-varying (d=4,096)', 'IGC static (d=4,096)'),
    ('IGC K-subspace (d=4,096, K=8)', 'IGC static (d=4,096)'),
    ('FetchSGD (5x50,000, k=12,000)', 'Local Top-K (k=12,000)'),
    ('IGC static (d=65,536)', 'Local Top-K (k=12,000)'),
    ('IGC static (d=65,536)', 'Local Top-K (k=60,000)'),
    ('IGC static (d=16,384)', 'Local Top-K (k=12,000)'),
    ('IGC static (d=65,536)', 'SGD (uncompressed)'),
)
#: The row the stored check re-runs (compressed, so it exercises IGC code).
CHECK_LABEL, CHECK_ROUNDS = 'IGC time-varying (d=1,024)', 5


def _slug(label: str) -> str:
  """'IGC static (d=4,096)' -> 'igc_static_d4096'."""
  out = ''.join(c if c.isalnum() else ('' if c in ',=' else '_')
                for c in label.lower())
  while '__' in out:
    out = out.replace('__', '_')
  return out.strip('_')


def _setup(label: str) -> Setup:
  return next(s for s in setups() if s.label == label)


def run_flags(setup: Setup, seed: int, rounds: int, eval_every: int,
              out: str) -> list[str]:
  """run_experiment.py flags of ``setup`` (``rounds``, ``eval_every``: its
  own rounds, already divided by the round divisor)."""
  return ([f'--flagfile={_CONFIGS}/{setup.flagfile}.flags'] +
          [f'--{k}={v}' for k, v in setup.options.items()] +
          [f'--num_rounds={rounds}', f'--seed={seed}',
           f'--eval_every={eval_every}', '--checkpoint_every=0',
           f'--output_dir={out}', '--noprogress'])


def _rounds(setup: Setup) -> tuple[int, int]:
  """``setup``'s rounds and evaluation interval (R/s, eval_every/s)."""
  return (max(1, FLAGS.rounds // setup.round_divisor),
          max(1, FLAGS.eval_every // setup.round_divisor))


def _train(label: str, seed: int) -> dict:
  setup = _setup(label)
  rounds, eval_every = _rounds(setup)
  return provenance.seeded_run(
      run_flags(setup, seed, rounds, eval_every,
                f'{FLAGS.runs_dir}/{_slug(label)}_seed{seed}'), rounds, seed)


def _bits(run: dict) -> dict:
  c = run['communication']
  return {'upload_compression': c['upload_compression'],
          'download_compression': c['download_compression'],
          'total_compression': c['total_compression'],
          'total_bits': 8 * (c['total_upload_bytes'] +
                             c['total_download_bytes'])}


def _row(setup: Setup, seeds: list[int], runs: dict[int, dict]) -> dict:
  """One row of ``results``: accuracy over seeds, seed 0's bits (asserted
  equal across seeds unless the family's download depends on the run)."""
  per_seed = [_bits(runs[s]) for s in seeds]
  same = all(b == per_seed[0] for b in per_seed)
  if not same and setup.family not in _RUN_DEPENDENT_BITS:
    raise ValueError(f'{setup.label}: bits differ across seeds {seeds}: '
                     f'{per_seed}')
  return {'run': _slug(setup.label), 'label': setup.label,
          'family': setup.family, 'options': setup.options,
          'round_divisor': setup.round_divisor,
          'rounds': runs[seeds[0]]['rounds'], 'seeds': seeds,
          'accuracy': stats.summarize([runs[s]['accuracy'] for s in seeds]),
          **per_seed[0], 'same_bits_every_seed': same,
          'total_bits_by_seed': [b['total_bits'] for b in per_seed],
          'runs': [runs[s] for s in seeds]}


def _comparisons(results: list[dict]) -> list[dict]:
  """Paired per-seed accuracy differences of ``PAIRS`` (rows present)."""
  acc = {r['label']: {x['seed']: x['accuracy'] for x in r['runs']}
         for r in results}
  return [{'label': f'{a} − {b}', 'a': a, 'b': b,
           **stats.paired(acc[a], acc[b])}
          for a, b in PAIRS if a in acc and b in acc]


def _num(x: float) -> str:
  """Whole from 100 up ('77,222'), else 3 significant figures ('65.5')."""
  return f'{x:,.0f}' if abs(x) >= 100 else f'{x:.3g}'


def _x(x: float) -> str:
  """A compression ratio: '1,178x', '18.4x', '5.88x'."""
  return f'{_num(x)}x'


def _mbit(r: dict) -> str:
  """Total bits in Mbit; mean (min-max) over seeds when they differ."""
  b = [v / 1e6 for v in r['total_bits_by_seed']]
  if r['same_bits_every_seed']:
    return _num(b[0])
  return f'{_num(sum(b) / len(b))} ({_num(min(b))}–{_num(max(b))})'


def _tail_rounds(r: dict) -> str:
  rounds = [p['round'] for p in r['runs'][0]['curve']][-stats.TAIL:]
  return f'{r["rounds"]} ({", ".join(map(str, rounds))})'


def _report(data: dict, out: pathlib.Path) -> None:
  """Writes ``<name>.md`` and ``<name>.png`` from ``data`` (and stores its
  ``comparisons``)."""
  name = data['meta']['name']
  results = data['results']
  data['comparisons'] = _comparisons(results)
  meta, p = data['meta'], data['meta']['protocol']
  labels = {r['label'] for r in results}
  varying = [r['label'] for r in results if not r['same_bits_every_seed']]
  lines = [
      '# Intrinsic gradient compression on FEMNIST-105: bandwidth vs '
      'accuracy, over seeds', '',
      provenance.markdown_header(data['provenance']),
      f'R = {meta["rounds"]} one-step rounds of the `igc_femnist_*.flags` '
      f'files (task `{p["task"]}`, D = {meta["num_params"]:,} parameters; '
      f'{p["clients_per_round"]} clients per round, one local SGD step on a '
      f'batch of {p["client_batch_size"]} per client, client learning rate '
      f'{p["client_lr"]} for every method, server SGD at rate '
      f'{p["server_lr"]}); FedAvg with s local steps runs R/s rounds, the '
      f'same number of examples. Seeds {", ".join(map(str, meta["seeds"]))}:'
      ' same seed = same initialisation, cohorts and subspaces across rows. '
      f'Test accuracy on all test examples every {meta["eval_every"]} '
      'one-step rounds (FedAvg with s local steps: every '
      f'{meta["eval_every"]}/s rounds, the same examples); a run\'s accuracy is the '
      f'mean of its last {meta["tail_evaluations"]} evaluations (the rounds '
      'in brackets), then mean ± sample std over seeds. Each run\'s '
      '`run_experiment.py` command and commit are in '
      f'`{name}.json` (`results[i].runs[j].command`).', '',
      '| row | rounds (evaluations averaged) | compression up / down / total '
      '| total bits (Mbit) | accuracy (%) |', '|---|---|---|---|---|']
  for r in results:
    mark = ' †' if not r['same_bits_every_seed'] else ''
    lines.append(
        f'| {r["label"]} | {_tail_rounds(r)} | '
        f'{_x(r["upload_compression"])} / {_x(r["download_compression"])} / '
        f'{_x(r["total_compression"])}{mark} | {_mbit(r)} | '
        f'{stats.fmt(r["accuracy"], 1, 100)} |')
  lines += [
      '', 'Compression: from the communication ledger, against 32 bits x D '
      'per client-round each way; total = 2 / (1/up + 1/down). Total bits: '
      'upload + download of the whole run.' + (
          ' † Bits differ across seeds (the download counts the weights '
          'changed since a client last took part): compression of seed '
          f'{meta["seeds"][0]}, bits as mean (min–max) over seeds.'
          if varying else ' Bits are the same for every seed.')]
  if data['comparisons']:
    lines += ['', '| comparison (a − b) | total bits a / b (Mbit) | accuracy '
              'difference (points, per seed) |', '|---|---|---|']
    rows = {r['label']: r for r in results}
    for c in data['comparisons']:
      lines.append(f'| {c["label"]} | {_mbit(rows[c["a"]])} / '
                   f'{_mbit(rows[c["b"]])} | {stats.fmt_paired(c, 1, 100)} |')
    lines += ['', 'Comparisons: per-seed differences of the two rows\' '
              'accuracies, mean ± sample std, and how many seeds share the '
              'sign of the mean.']
  missing = [f'{a} − {b}' for a, b in PAIRS
             if a not in labels or b not in labels]
  if missing:
    lines += ['', f'Not compared (rows not run): {"; ".join(missing)}.']
  lines += ['', f'![accuracy vs bits]({name}.png)', '',
            'Figure: test accuracy (mean over seeds, error bars ± one sample '
            'standard deviation) against the total upload + download bits of '
            'a run (log scale), one marker per method family.', '']
  (out / f'{name}.md').write_text(
      provenance.results_md(lines, data.get('check', {})))
  _plot(data, out / f'{name}.png')


#: family -> (matplotlib colormap, marker).
_STYLES = {
    'uncompressed': ('Greys', '*'), 'fedavg': ('Greys', 's'),
    'topk': ('Oranges', 'v'), 'fetchsgd': ('Reds', '^'),
    'igc_static': ('Blues', 'o'), 'igc_time_varying': ('Greens', 'D'),
    'igc_k_subspace': ('Purples', 'P'),
    'igc_k_subspace_time_varying': ('RdPu', 'X'),
}


def _plot(data: dict, path: pathlib.Path) -> None:
  """Accuracy (mean ± std over seeds) against total bits, log x."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(9, 4.8))
  lo, hi = [], []
  for family, (cmap, marker) in _STYLES.items():
    rs = sorted((r for r in data['results'] if r['family'] == family),
                key=lambda r: r['total_bits'])
    shades = plt.get_cmap(cmap)(np.linspace(0.85, 0.45, max(len(rs), 1)))
    if len(rs) > 1:
      ax.plot([np.mean(r['total_bits_by_seed']) for r in rs],
              [100 * r['accuracy']['mean'] for r in rs],
              color=shades[0], alpha=0.4, lw=1)
    for r, color in zip(rs, shades):
      mean, std = 100 * r['accuracy']['mean'], 100 * r['accuracy']['std']
      ax.errorbar(np.mean(r['total_bits_by_seed']), mean, yerr=std,
                  marker=marker, ms=8 if marker == '*' else 6, capsize=3,
                  color=color, linestyle='none', label=r['label'])
      lo.append(mean - std)
      hi.append(mean + std)
  pad = 0.1 * (max(hi) - min(lo)) if max(hi) > min(lo) else 1.0
  meta = data['meta']
  ax.set(xscale='log', ylim=(min(lo) - pad, max(hi) + pad),
         xlabel='total upload + download bits of a run',
         ylabel='test accuracy (%)',
         title=f'FEMNIST-105, R = {meta["rounds"]} one-step rounds (mean ± '
               f'std over {len(meta["seeds"])} seeds)')
  ax.grid(True, which='major', alpha=0.3)
  ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _protocol(flagfile: str) -> dict:
  """The ``_PROTOCOL`` flags of ``flagfile`` (as written there)."""
  lines = (provenance.REPO / _CONFIGS / f'{flagfile}.flags').read_text()
  values = dict(line[2:].split('=', 1) for line in lines.splitlines()
                if line.startswith('--') and '=' in line)
  return {k: values[k] for k in _PROTOCOL}


def main(argv):
  name = 'igc_femnist_partial' if FLAGS.only else 'igc_femnist'
  started = provenance.start_study(argv, name, _report)
  if started is None:
    return
  seeds, out = started
  todo = [s for s in setups() if not FLAGS.only or s.label in FLAGS.only
          or _slug(s.label) in FLAGS.only]
  unknown = set(FLAGS.only) - {s.label for s in todo} - {
      _slug(s.label) for s in todo}
  if not todo or unknown:
    raise app.UsageError(f'--only: unknown rows {sorted(unknown)}; rows: '
                         f'{[_slug(s.label) for s in setups()]}')
  data = {'provenance': provenance.file_provenance(),
          'meta': {'name': name, 'rounds': FLAGS.rounds,
                   'eval_every': FLAGS.eval_every, 'seeds': seeds,
                   'tail_evaluations': stats.TAIL,
                   'protocol': _protocol(setups()[0].flagfile)}}
  runs = provenance.seed_major([s.label for s in todo], seeds, _train)
  data['meta']['num_params'] = runs[todo[0].label][seeds[0]][
      'communication']['num_params']
  data['results'] = [_row(s, seeds, runs[s.label]) for s in todo]
  data['check'] = provenance.check_record(
      run_flags(_setup(CHECK_LABEL), 0, CHECK_ROUNDS, CHECK_ROUNDS,
                f'{FLAGS.runs_dir}/check'),
      f'{CHECK_LABEL} seed 0, {CHECK_ROUNDS} rounds')
  provenance.write_study(out, name, data, _report)


if __name__ == '__main__':
  app.run(main)
