#!/usr/bin/env python3
"""The efficient-LM comparisons on Shakespeare, over 3 seeds.

  FEDLITE_DATA_DIR=/path/to/data python experiments/lm_seeds.py

Ro et al. (2022) compare upload quantization, partial variable training
(PVT), FedProx and the CIFG-LSTM against the FedAdam Transformer. This
script runs those rows of ``lm_experiments.py`` (the 32/32-bit FedAdam
baseline ``experiments/configs/shakespeare_sp_fedadam_transformer.flags``:
``transformer_tiny``, 10 clients x 100 rounds, test perplexity every 20
rounds) for seeds 0-2 (same seed = same initialisation and cohorts):
8-bit uniform upload, PVT 40%, FedProx mu in {0.1, 1}, and ``lstm_tiny`` at
the client/server learning rates of its own 7-point sweep (seed 0,
``--sweep_rounds`` rounds: the 5 points the Transformer's rates came from,
plus two around the LSTM's best of those, so that its pick is not at an edge).

Perplexity per run: the mean of its last 3 evaluations (rounds 60, 80, 100).
PVT is also compared at equal upload bytes: PVT 40% after 100 rounds against
FedAdam at its evaluation whose cumulative upload is closest to PVT's.

Each run is one ``experiments/run_experiment.py`` invocation in
``--runs_dir/<row>_seed<s>`` (a finished run is read back). Writes
``lm_seeds.json`` (rows under ``results`` with ``seeds``, the sweep, paired
differences, a ``check`` that re-runs the 8-bit upload row for 5 rounds),
``lm_seeds.md`` and ``lm_seeds.png``. ``--report_only`` rewrites the .md and
.png from the JSON.
"""

from __future__ import annotations

import json
import pathlib

from absl import app
from absl import flags

import provenance
import stats

provenance.define_study_flags('lm_seeds', (0, 1, 2))
flags.DEFINE_integer('rounds', 100, 'Rounds per run.', lower_bound=1)
flags.DEFINE_integer('sweep_rounds', 40, 'Rounds per LSTM sweep run.',
                     lower_bound=1)
FLAGS = flags.FLAGS

BASE = 'experiments/configs/shakespeare_sp_fedadam_transformer.flags'
METRIC = 'perplexity'
#: (name, label, flags added to BASE).
ROWS = (
    ('fedadam', 'Transformer, FedAdam 32/32 bits', ()),
    ('upload8', 'Transformer, upload 8-bit uniform',
     ('--upload=uniform_quantization:8',)),
    ('pvt40', 'Transformer, PVT 40%', ('--pvt_fraction=0.4',)),
    ('fedprox_mu0.1', 'Transformer, FedProx mu 0.1',
     ('--algorithm=fedprox', '--fedprox_mu=0.1')),
    ('fedprox_mu1', 'Transformer, FedProx mu 1',
     ('--algorithm=fedprox', '--fedprox_mu=1')),
    ('lstm', 'CIFG-LSTM, FedAdam (swept rates)', ('--model=lstm_tiny',)),
)
#: The LSTM sweep: (client lr, server Adam lr), the Transformer's 5 points
#: and two beyond the best of them, (0.1, 0.03): a larger server and a
#: smaller client rate.
SWEEP = ((0.1, 0.01), (0.3, 0.01), (1.0, 0.01), (0.1, 0.003), (0.1, 0.03),
         (0.1, 0.1), (0.03, 0.03))
#: (label, row a, row b): a - b in perplexity (negative: a is better).
PAIRS = (('upload 8-bit - 32-bit', 'upload8', 'fedadam'),
         ('PVT 40% - FedAdam, equal rounds', 'pvt40', 'fedadam'),
         ('FedProx mu 0.1 - FedAdam', 'fedprox_mu0.1', 'fedadam'),
         ('FedProx mu 1 - FedAdam', 'fedprox_mu1', 'fedadam'),
         ('CIFG-LSTM - Transformer', 'lstm', 'fedadam'))
CHECK_ROW, CHECK_ROUNDS = 'upload8', 5


def _flags(name: str, seed: int, rounds: int, out: str,
           extra: tuple[str, ...] = ()) -> list[str]:
  row = next(r for r in ROWS if r[0] == name)
  return ([f'--flagfile={BASE}', *row[2], *extra,
           f'--num_rounds={rounds}', f'--seed={seed}'] +
          [f'--eval_every={min(rounds, 20)}', '--checkpoint_every=0',
           f'--output_dir={out}', '--noprogress'])


def _rates(client: float, server: float) -> tuple[str, str]:
  return f'--client_lr={client:g}', f'--server_lr={server:g}'


def _sweep() -> list[dict]:
  """Sweep points; one whose run diverged (the runner stops a run worse than
  chance, summary status 'failed') has perplexity None and its reason."""
  out = []
  for client, server in SWEEP:
    rel = f'{FLAGS.runs_dir}/sweep_lstm_c{client:g}_s{server:g}'
    point = {'client_lr': client, 'server_lr': server}
    summary = provenance.REPO / rel / 'summary.json'
    try:
      rec = provenance.seeded_run(
          _flags('lstm', 0, FLAGS.sweep_rounds, rel, _rates(client, server)),
          FLAGS.sweep_rounds, 0, METRIC)
    except RuntimeError:
      if not summary.exists() or json.loads(
          summary.read_text()).get('status') != 'failed':
        raise
    status = json.loads(summary.read_text())
    if status.get('status') == 'failed':
      failure = status['failure']
      out.append({**point, 'perplexity': None, 'diverged': failure})
      print(f'sweep ({client:g}, {server:g}): diverged: {failure}')
      continue
    out.append({**point, 'perplexity': rec['curve'][-1][METRIC], 'run': rec})
  return out


def _equal_bytes(rows: dict[str, dict]) -> dict:
  """PVT 40% at its last evaluation vs FedAdam at the evaluation whose
  cumulative upload is closest to PVT's, per seed."""
  return {'label': 'PVT 40% - FedAdam, equal upload bytes', 'a': 'pvt40',
          'b': 'fedadam', **stats.paired_at_equal_upload(
              rows['pvt40'], rows['fedadam'], METRIC)}


def _report(data: dict, out: pathlib.Path) -> None:
  rows = {r['run']: r for r in data['results']}
  ppl = {n: {x['seed']: x[METRIC] for x in r['runs']} for n, r in rows.items()}
  data['comparisons'] = [{'label': label, 'a': a, 'b': b,
                          **stats.paired(ppl[a], ppl[b])}
                         for label, a, b in PAIRS] + [_equal_bytes(rows)]
  best = data['lstm_rates']
  seeds = data['results'][0]['seeds']
  tail = [e['round'] for e in data['results'][0]['runs'][0]['curve']][
      -data['meta']['tail_evaluations']:]
  lines = [
      '# Efficient language-model FL on Shakespeare, over seeds', '',
      provenance.markdown_header(data['provenance']),
      f'{data["meta"]["rounds"]} rounds of `{BASE}` (real Shakespeare, SentencePiece '
      '4,096 ids, sequence length 30, 10 clients per round, client SGD 0.1 '
      'clipped at 16, server Adam 1e-2; `transformer_tiny` 368,256 '
      'parameters, `lstm_tiny` 381,696) plus each row\'s flags, seeds '
      f'{", ".join(map(str, seeds))} (same seed = same initialisation and '
      'cohorts). Perplexity: test perplexity on all test snippets, the mean '
      f'of the last {len(tail)} evaluations (rounds '
      f'{", ".join(map(str, tail))}) of each run, then mean '
      '± std over seeds. Upload: bytes per client per round. Small-scale CPU '
      'runs, not the paper\'s 800 x 10,000.', '',
      '| row | perplexity | upload / client-round |', '|---|---|---|']
  for r in data['results']:
    up = r['runs'][0]['communication']
    per = up['total_upload_bytes'] / max(up['client_rounds'], 1)
    lines.append(f'| {r["label"]} | {stats.fmt(r[METRIC], 1)} | '
                 f'{per / 1e3:,.1f} KB |')
  lines += ['', '| comparison (perplexity, negative = first row better) | '
            'difference |', '|---|---|']
  for c in data['comparisons']:
    note = ''
    if 'rounds' in c:
      pairs = sorted({tuple(v) for v in c['rounds'].values()})
      note = ' (rounds ' + ', '.join(f'{a} vs {b}' for a, b in pairs) + ')'
    lines.append(f'| {c["label"]}{note} | {stats.fmt_paired(c, 1)} |')
  lines += [
      '', f'CIFG-LSTM learning rates: a sweep of {len(data["sweep"])} '
      f'(client, server) points at {data["meta"]["sweep_rounds"]} rounds, '
      'seed 0, picked by final test perplexity: '
      + ', '.join(f'({s["client_lr"]:g}, {s["server_lr"]:g}): ' + (
          f'{s["perplexity"]:.1f}' if s['perplexity'] is not None else
          f'diverged ({s["diverged"].split(" is ")[0]})')
                  for s in data['sweep'])
      + f'; chosen ({best[0]:g}, {best[1]:g}).', '',
      '![perplexity by round](lm_seeds.png)', '',
      'Figure: test perplexity by round, mean over seeds with error bars of '
      '± one standard deviation, per row.', '']
  (out / 'lm_seeds.md').write_text(
      provenance.results_md(lines, data.get('check', {})))
  stats.plot_seed_bands(
      data['results'], out / 'lm_seeds.png', xlabel='round', key=METRIC,
      ylabel='test perplexity', title='Shakespeare LM (mean ± std over seeds)')


def main(argv):
  started = provenance.start_study(argv, 'lm_seeds', _report)
  if started is None:
    return
  seeds, out = started
  sweep = _sweep()
  best = min((s for s in sweep if s['perplexity'] is not None),
             key=lambda s: s['perplexity'])
  rates = _rates(best['client_lr'], best['server_lr'])

  def train(name: str, seed: int) -> dict:
    return provenance.seeded_run(
        _flags(name, seed, FLAGS.rounds, f'{FLAGS.runs_dir}/{name}_seed{seed}',
               rates if name == 'lstm' else ()), FLAGS.rounds, seed, METRIC)

  runs = provenance.seed_major([r[0] for r in ROWS], seeds, train)
  data = {'provenance': provenance.file_provenance(),
          'meta': {'base': BASE, 'rounds': FLAGS.rounds,
                   'sweep_rounds': FLAGS.sweep_rounds,
                   'tail_evaluations': stats.TAIL},
          'sweep': sweep, 'lstm_rates': [best['client_lr'],
                                         best['server_lr']],
          'results': [
              {'run': name, 'label': label, 'seeds': seeds,
               METRIC: stats.summarize([runs[name][s][METRIC]
                                            for s in seeds]),
               'runs': [runs[name][s] for s in seeds]}
              for name, label, _ in ROWS]}
  data['check'] = provenance.check_record(
      _flags(CHECK_ROW, 0, CHECK_ROUNDS, f'{FLAGS.runs_dir}/check'),
      f'{CHECK_ROW} seed 0, {CHECK_ROUNDS} rounds')
  provenance.write_study(out, 'lm_seeds', data, _report)


if __name__ == '__main__':
  app.run(main)
