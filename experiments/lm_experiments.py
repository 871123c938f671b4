#!/usr/bin/env python3
"""Small-scale efficient-LM experiments on real Shakespeare, over 3 seeds.

  FEDLITE_DATA_DIR=/path/to/data python experiments/lm_experiments.py

Ro et al. (2022): upload / download quantization (the Figure 5 grid of
download x upload bits, TernGrad with and without clipping), partial
variable training (PVT), MimeLite, and pretraining followed by federated
training, each against the 32/32-bit FedAdam baseline
``experiments/configs/shakespeare_sp_fedadam_transformer.flags``
(SentencePiece 4,096 ids, sequence length 30, ``transformer_tiny``, client
SGD 0.1 clipped at 16, batch 16, <= 1,200 examples per client, server Adam
1e-2, 10 clients x 100 rounds, test perplexity every 20 rounds) plus the
row's flags, for seeds 0-2 (same seed = same initialisation and cohorts).
FedProx and the CIFG-LSTM are compared in ``lm_seeds.py``, the LSTM at its
own swept learning rates.

The pretrained rows start from ``experiments/pretrain_centralized.py``
(CPython help pages, 1,000 Adam steps, seed 0; one checkpoint for all
seeds), run first. Each run is one ``experiments/run_experiment.py``
invocation in ``--runs_dir/<row>_seed<s>``; a finished run is read back, so
``--print_commands`` (the runner commands still to run, one per line) lets
the runs go in parallel, e.g. ``xargs -P``, before this script collects
them. Run them all on machines with the same library versions: each machine
trains its own SentencePiece model (sentencepiece 0.2.2 on Python 3.12 and
0.2.3 on Python 3.11 gave tokenizers with 46,921 vs 46,923 test tokens), and
the pretrained checkpoint's ids must match the tokenizer of every run that
starts from it. Perplexity per run: the mean of its last 3 evaluations.

Writes ``efficient_lm.json`` (rows under ``results`` with ``seeds``, paired
differences, a ``check`` that re-runs the 16-bit download + 8-bit upload row
for 5 rounds), ``efficient_lm.md`` and the figures ``efficient_lm.png`` and
``efficient_lm_fig5.png``. ``--report_only`` rewrites the .md and figures
from the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex

from absl import app
from absl import flags

import provenance
import stats

provenance.define_study_flags('efficient_lm', (0, 1, 2))
flags.DEFINE_integer('rounds', 100, 'Rounds per run.', lower_bound=1)
flags.DEFINE_enum('round_engine', 'auto', ['auto', 'loop', 'vmap'],
                  'Passed to every run as --round_engine (when not auto).')
flags.DEFINE_list('rows', [], 'Only these rows (names as in ROWS, e.g. '
                  'fedadam,down16_up8); default: all.')
flags.DEFINE_integer('check_rounds', 5, 'Rounds of the check run.',
                     lower_bound=1)
flags.DEFINE_bool('print_commands', False, 'Print the commands still to run '
                  '(the pretraining first, then one run per line) and exit.')
FLAGS = flags.FLAGS

NAME = 'efficient_lm'
BASE = 'experiments/configs/shakespeare_sp_fedadam_transformer.flags'
METRIC = 'perplexity'
PRETRAIN_STEPS = 1000
PRETRAIN_FILE = 'pretrained_transformer_tiny.params'
GRID_DOWN = (32, 16, 12, 8, 6, 4)
UPLOADS = ('32', '8', '6', '4', 'TernGrad clip', 'TernGrad no clip')
_UP_WORDS = {'TernGrad clip': 'TernGrad upload (clipped at 2.5 std)',
             'TernGrad no clip': 'TernGrad upload (no clipping)'}
CHECK_ROW = 'down16_up8'


@dataclasses.dataclass(frozen=True)
class Row:
  """One configuration: name, label, groups, download bits, upload, other
  flags, whether it starts from the pretrained checkpoint."""
  name: str
  label: str
  groups: tuple[str, ...]
  down: int = 32
  up: str = '32'
  extra: tuple[str, ...] = ()
  pretrained: bool = False

  def flags(self, pretrained_path: str) -> list[str]:
    f = [f'--flagfile={BASE}']
    if self.down != 32:
      f.append(f'--download=uniform_quantization:{self.down}')
    if self.up.isdigit() and self.up != '32':
      f.append(f'--upload=uniform_quantization:{self.up}')
    elif self.up.startswith('TernGrad'):
      f.append('--upload=terngrad' + (':none' if self.up == 'TernGrad no clip'
                                      else ''))
    if self.pretrained:
      f.append(f'--init_checkpoint={pretrained_path}')
    return f + list(self.extra)


def _grid_label(down: int, up: str) -> str:
  """'FedAdam, no compression (32 / 32 bits)', '16-bit download, 8-bit
  uniform upload', 'TernGrad upload (no clipping)'."""
  parts = [f'{down}-bit download'] if down != 32 else []
  if up.isdigit() and up != '32':
    parts.append(f'{up}-bit uniform upload')
  elif up != '32':
    parts.append(_UP_WORDS[up])
  return ', '.join(parts) or 'FedAdam, no compression (32 / 32 bits)'


def _grid(down: int, up: str, *groups: str) -> Row:
  """A Figure 5 cell, named like 'down16_up8', 'upload8', 'down16_terngrad'."""
  parts = [f'down{down}'] if down != 32 else []
  if up.isdigit() and up != '32':
    parts.append(f'up{up}' if parts else f'upload{up}')
  elif up.startswith('TernGrad'):
    parts.append('terngrad' if up == 'TernGrad clip' else 'terngrad_noclip')
  return Row('_'.join(parts) or 'fedadam', _grid_label(down, up),
             groups + ('grid',), down, up)


OVERVIEW = ('quant', 'pvt', 'algo', 'transfer')
ROWS = (
    _grid(32, '32', *OVERVIEW), _grid(32, '8', 'quant'),
    _grid(32, '4', 'quant'), _grid(32, 'TernGrad clip', 'quant'),
    _grid(32, 'TernGrad no clip', 'quant'), _grid(16, '8', 'quant'),
    Row('pvt40', 'PVT, 40% of the variables trained', ('pvt',),
        extra=('--pvt_fraction=0.4',)),
    Row('pvt20', 'PVT, 20% of the variables trained', ('pvt',),
        extra=('--pvt_fraction=0.2',)),
    Row('mime_lite', 'MimeLite (Adagrad base, lr 0.1)', ('algo',),
        extra=('--algorithm=mime_lite', '--mime_base_eps=0.001',
               '--server_lr=1.0')),
    Row('pretrained', 'FedAdam from a pretrained start', ('transfer',),
        pretrained=True),
    Row('efficient', 'pretrained + PVT 40% + 8-bit upload', ('transfer',),
        up='8', extra=('--pvt_fraction=0.4',), pretrained=True),
    _grid(32, '6'), _grid(16, '32'), _grid(16, '6'), _grid(16, '4'),
    _grid(12, '32'), _grid(12, '8'), _grid(12, '6'), _grid(12, '4'),
    _grid(16, 'TernGrad clip'), _grid(16, 'TernGrad no clip'),
    _grid(8, '8'), _grid(6, '8'), _grid(4, '8'),
)
#: (label, row a, row b): a - b in perplexity (negative: a is better), at
#: equal rounds.
PAIRS = (
    ('TernGrad no clipping - with clipping', 'terngrad_noclip', 'terngrad'),
    ('16-bit download + 8-bit upload - 8-bit upload', 'down16_up8', 'upload8'),
    ('PVT 20% - PVT 40%', 'pvt20', 'pvt40'),
    ('pretrained + PVT 40% + 8-bit upload - pretrained', 'efficient',
     'pretrained'),
    ('12-bit download + 8-bit upload - 8-bit upload', 'down12_up8', 'upload8'),
    ('8-bit download + 8-bit upload - 8-bit upload', 'down8_up8', 'upload8'),
    ('6-bit download + 8-bit upload - 8-bit upload', 'down6_up8', 'upload8'),
    ('4-bit download + 8-bit upload - 8-bit upload', 'down4_up8', 'upload8'),
)
#: (label, row a, row b): a after all rounds against b at equal upload bytes.
EQUAL_UPLOAD = (('PVT 40% - FedAdam, equal upload bytes', 'pvt40', 'fedadam'),
                ('PVT 20% - FedAdam, equal upload bytes', 'pvt20', 'fedadam'))


def _selected() -> list[Row]:
  """The rows of --rows (all by default).

  Raises:
    app.UsageError: a name that is not a row (one line, naming the rows).
  """
  names = [r.name for r in ROWS]
  bad = [n for n in FLAGS.rows if n not in names]
  if bad:
    raise app.UsageError(f'--rows={",".join(FLAGS.rows)}: {", ".join(bad)} '
                         f'not a row; rows: {", ".join(names)}.')
  return [r for r in ROWS if not FLAGS.rows or r.name in FLAGS.rows]


def _pretrain_path() -> str:
  return f'{FLAGS.runs_dir}/{PRETRAIN_FILE}'


def _pretrain_flags() -> list[str]:
  return ['--task=shakespeare', '--model=transformer_tiny',
          '--corpus=python_help', f'--steps={PRETRAIN_STEPS}', '--seed=0',
          f'--output={_pretrain_path()}']


def _pretrain() -> dict:
  """Phase 1 of transfer learning (experiments/pretrain_centralized.py),
  unless its checkpoint exists; its command and stored metadata."""
  script = 'experiments/pretrain_centralized.py'
  path = provenance.REPO / _pretrain_path()
  if not path.exists():
    provenance.run_script(script, _pretrain_flags())
  from fedlite_jax.training import state_io  # pylint: disable=g-import-not-at-top
  meta = state_io.read_metadata(path)
  meta.pop('task_tokenizer', None)  # A path on the machine that ran it.
  return {'command': shlex.join(['python', script, *_pretrain_flags()]),
          'metadata': meta}


def _flags(row: Row, seed: int, rounds: int, out: str) -> list[str]:
  engine = ([f'--round_engine={FLAGS.round_engine}']
            if FLAGS.round_engine != 'auto' else [])
  return (row.flags(_pretrain_path()) + engine +
          [f'--num_rounds={rounds}', f'--seed={seed}',
           f'--eval_every={min(rounds, 20)}', '--checkpoint_every=0',
           f'--output_dir={out}', '--noprogress'])


def _todo(seeds: list[int], rows: list[Row]) -> list[str]:
  """Runner commands of the runs not finished yet (pretraining first)."""
  lines = []
  if (any(r.pretrained for r in rows) and
      not (provenance.REPO / _pretrain_path()).exists()):
    lines.append(shlex.join(['python', 'experiments/pretrain_centralized.py',
                             *_pretrain_flags()]))
  for seed in seeds:
    for row in rows:
      out = f'{FLAGS.runs_dir}/{row.name}_seed{seed}'
      summary = provenance.REPO / out / 'summary.json'
      if (summary.exists() and
          json.loads(summary.read_text())['rounds'] == FLAGS.rounds):
        continue
      lines.append(shlex.join(['python', provenance.RUNNER,
                               *_flags(row, seed, FLAGS.rounds, out)]))
  return lines


def _total(r: dict) -> float:
  """Bytes per client-round, upload + download, of a row."""
  return r['upload_per_client_round'] + r['download_per_client_round']


def _kb(b: float) -> str:
  return f'{b / 1e6:.2f} MB' if b >= 1e6 else f'{b / 1e3:.1f} KB'


def _comparisons(data: dict) -> list[dict]:
  rows = {r['run']: r for r in data['results']}
  ppl = {n: {x['seed']: x[METRIC] for x in r['runs']} for n, r in rows.items()}
  base = [(f'{r["label"]} - FedAdam 32/32', r['run'], 'fedadam')
          for r in data['results'] if r['run'] != 'fedadam']
  return ([{'label': label, 'a': a, 'b': b, **stats.paired(ppl[a], ppl[b])}
           for label, a, b in base + list(PAIRS) if a in ppl and b in ppl] +
          [{'label': label, 'a': a, 'b': b,
            **stats.paired_at_equal_upload(rows[a], rows[b], METRIC)}
           for label, a, b in EQUAL_UPLOAD if a in rows and b in rows])


def _reading(c: dict) -> str:
  """What a paired comparison supports: a difference only when every seed
  agrees in sign."""
  if c['agree'] < c['n']:
    return 'no difference shown'
  return 'lower (better)' if c['mean'] < 0 else 'higher (worse)'


def _machines(data: dict) -> str:
  """'seed 0: <machine>; seeds 1, 2: <machine>' from the runs' records."""
  by = {}
  for r in data['results']:
    for run in r['runs']:
      m = run['machine']
      key = f'{m["platform"]}, JAX {m["jax"]} ({m["backend"]})'
      by.setdefault(key, set()).add(run['seed'])
  return '; '.join(
      f'seed{"s" * (len(v) > 1)} {", ".join(map(str, sorted(v)))}: {k}'
      for k, v in sorted(by.items(), key=lambda kv: min(kv[1])))


def _report(data: dict, out: pathlib.Path) -> None:
  data['comparisons'] = _comparisons(data)
  meta = data['meta']
  seeds = data['results'][0]['seeds']
  first = data['results'][0]['runs'][0]
  tail = [e['round'] for e in first['curve']][-meta['tail_evaluations']:]
  lines = [
      '# Efficient language-model FL on Shakespeare (Ro et al. 2022 shapes), '
      'over seeds', '', provenance.markdown_header(data['provenance']),
      f'**Small-scale runs, not the paper\'s 800 clients x 10,000 rounds on '
      f'StackOverflow.** Every run: `python {provenance.RUNNER} '
      f'--flagfile={BASE}` plus the row\'s flags (exact commands and commits '
      f'in `{NAME}.json`, `results[i].runs[j].command`): TFF Shakespeare '
      '(715 clients), SentencePiece 4,096 ids, sequence length 30, '
      '`transformer_tiny` (368,256 parameters), client SGD 0.1 clipped at 16, '
      f'server Adam 1e-2, 10 clients per round for {meta["rounds"]} rounds, '
      f'seeds {", ".join(map(str, seeds))} (same seed = same initialisation '
      'and cohorts; the pretrained rows share one checkpoint). Perplexity: '
      'test perplexity on all test snippets, the mean of each run\'s last '
      f'{len(tail)} evaluations (rounds {", ".join(map(str, tail))}), then '
      'mean ± std over seeds. A difference is read as one only when all '
      f'seeds agree in sign. Trained on (each seed on one machine): '
      f'{_machines(data)}. FedProx and '
      'the CIFG-LSTM (at its own swept rates) are compared in '
      '[lm_seeds.md](lm_seeds.md).', '',
      *([f'Pretraining (phase 1 of the pretrained rows): '
         f'`{data["pretraining"]["command"]}`.', '']
        if data.get('pretraining') else []),
      '## Rows', '',
      '| row | flags beyond the baseline | perplexity | next-token accuracy '
      '| upload / client-round | download / client-round | - FedAdam 32/32 '
      '(perplexity) |', '|---|---|---|---|---|---|---|']
  vs = {c['a']: c for c in data['comparisons'] if c['b'] == 'fedadam' and
        'rounds' not in c}
  for r in data['results']:
    diff = (f'{stats.fmt_paired(vs[r["run"]], 2)}: {_reading(vs[r["run"]])}'
            if r['run'] in vs else '-')
    lines.append(
        f'| {r["label"]} | `{" ".join(r["flags"]) or "-"}` | '
        f'{stats.fmt(r[METRIC], 1)} | {stats.fmt(r["accuracy"], 4)} | '
        f'{_kb(r["upload_per_client_round"])} | '
        f'{_kb(r["download_per_client_round"])} | {diff} |')
  lines += ['', '## Other paired comparisons', '',
            '| comparison (perplexity, negative = first row better) | '
            'difference | reading |', '|---|---|---|']
  for c in data['comparisons']:
    if c['b'] == 'fedadam' and 'rounds' not in c:
      continue
    note = ''
    if 'rounds' in c:
      pairs = sorted({tuple(v) for v in c['rounds'].values()})
      note = ' (rounds ' + ', '.join(f'{a} vs {b}' for a, b in pairs) + ')'
    lines.append(f'| {c["label"]}{note} | {stats.fmt_paired(c, 2)} | '
                 f'{_reading(c)} |')
  cells = {(r['down'], r['up']): r for r in data['results']
           if 'grid' in r['groups']}
  lines += ['', '## Figure 5 grid', '', 'Perplexity (mean ± std over seeds) '
            '/ bytes per client-round (upload + download); rows: download '
            'bits, columns: upload; "-" = not run.', '',
            '| download \\ upload | ' + ' | '.join(UPLOADS) + ' |',
            '|---' * (len(UPLOADS) + 1) + '|']
  for d in GRID_DOWN:
    lines.append(f'| {d} | ' + ' | '.join(
        f'{cells[(d, u)][METRIC]["mean"]:.1f} ± '
        f'{cells[(d, u)][METRIC]["std"]:.1f} / {_kb(_total(cells[(d, u)]))}'
        if (d, u) in cells else '-' for u in UPLOADS) + ' |')
  lines += [
      '', f'![perplexity by round]({NAME}.png)', '',
      f'*{NAME}.png: test perplexity by round, one panel per study: (a) '
      'upload / download quantization, (b) partial variable training, (c) '
      'FedAdam vs MimeLite, (d) pretraining and the efficient combination; '
      'mean over seeds with error bars of ± one standard deviation. The y '
      'axis is framed on the last two thirds of the rounds, where the rows '
      'separate.*', '',
      f'![Figure 5 grid]({NAME}_fig5.png)', '',
      f'*{NAME}_fig5.png: (a) perplexity (mean of the last '
      f'{len(tail)} evaluations, mean ± std over seeds) against bytes per '
      'client-round, upload + download (log x), every cell of the grid '
      '(labels: download / upload bits, T = TernGrad, nc = no clipping); '
      '(b) the same perplexity against download bits at 8-bit upload. The '
      'error bars are the spread over seeds, which the cells share (same '
      'seed = same cohorts and initialisation); the paired differences in '
      'the tables above resolve finer differences than the bars.*', '']
  (out / f'{NAME}.md').write_text(
      provenance.results_md(lines, data.get('check', {})))
  _plots(data, out)


def _plots(data: dict, out: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  plt.rcParams.update({'font.size': 9, 'axes.titlesize': 10,
                       'legend.fontsize': 7.5})
  titles = {'quant': '(a) Upload / download quantization',
            'pvt': '(b) Partial variable training (PVT)',
            'algo': '(c) Federated optimizer',
            'transfer': '(d) Pretraining and the efficient combination'}
  fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
  for ax, g in zip(axes.flat, OVERVIEW):
    lo, hi = np.inf, -np.inf
    for i, r in enumerate(r for r in data['results'] if g in r['groups']):
      rounds = [e['round'] for e in r['runs'][0]['curve'] if e['round'] > 0]
      vals = np.array([[e[METRIC] for e in run['curve'] if e['round'] > 0]
                       for run in r['runs']])
      mean = vals.mean(0)
      std = vals.std(0, ddof=1) if len(vals) > 1 else 0 * mean
      base = r['run'] == 'fedadam'
      ax.errorbar(rounds, mean, yerr=std, marker='o', ms=3, capsize=3,
                  label=r['label'], color='k' if base else f'C{i}',
                  lw=2.2 if base else 1.2, zorder=1 if base else 2)
      tail = slice(len(mean) // 3, None)
      lo = min(lo, float((mean - std)[tail].min()))
      hi = max(hi, float((mean + std)[tail].max()))
    if lo > hi:  # No row of this group (a --rows subset).
      ax.axis('off')
      continue
    pad = max(0.08 * (hi - lo), 1.0)
    ax.set(title=titles[g], xlabel='round', ylabel='test perplexity',
           ylim=(lo - pad, hi + pad))
    ax.legend(loc='upper right')
  fig.suptitle('Tiny Transformer LM on Shakespeare, FedAdam unless named; '
               f'10 clients per round, mean ± std over seeds '
               f'{", ".join(map(str, data["results"][0]["seeds"]))}',
               fontsize=10)
  fig.tight_layout()
  fig.savefig(out / f'{NAME}.png', dpi=110)
  plt.close(fig)

  cells = {(r['down'], r['up']): r for r in data['results']
           if 'grid' in r['groups']}
  fig, axes = plt.subplots(1, 2, figsize=(14, 5.6),
                           gridspec_kw={'width_ratios': [1.5, 1]})
  ax = axes[0]
  series = [(f'download {d} bits, uniform upload 32 / 8 / 6 / 4 bits',
             [(d, u) for u in UPLOADS if u.isdigit() and (d, u) in cells])
            for d in GRID_DOWN]
  single = [k for _, keys in series if len(keys) == 1 for k in keys]
  series = [x for x in series if len(x[1]) > 1]
  if single:
    series.append((f'{single[0][1]}-bit uniform upload, download '
                   f'{" / ".join(str(d) for d, _ in single)} bits', single))
  series += [(_UP_WORDS[u], [(d, u) for d in GRID_DOWN if (d, u) in cells])
             for u in UPLOADS if not u.isdigit()]
  for i, (label, keys) in enumerate(series):
    keys = sorted((k for k in keys if k in cells),
                  key=lambda k: _total(cells[k]))
    if not keys:
      continue
    xs = [_total(cells[k]) / 1e3 for k in keys]
    ys = [cells[k][METRIC]['mean'] for k in keys]
    es = [cells[k][METRIC]['std'] for k in keys]
    ax.errorbar(xs, ys, yerr=es, fmt='o-' if len(keys) > 1 else 'X',
                ms=5, capsize=3, color=f'C{i}', label=label)
    for x, y, (d, u) in zip(xs, ys, keys):
      tag = u if u.isdigit() else ('T' if u == 'TernGrad clip' else 'T-nc')
      ax.annotate(f'{d}/{tag}', (x, y), textcoords='offset points',
                  xytext=(4, 3), fontsize=6.5)
  ax.set_xscale('log')
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f'{x:,.0f}'))
  ax.xaxis.set_minor_formatter(ticker.FuncFormatter(
      lambda x, _: f'{x:,.0f}' if str(int(x))[0] in '2468' else ''))
  ax.set(xlabel='KB per client-round, upload + download (log scale)',
         ylabel='test perplexity (mean of the last 3 evaluations)',
         title='(a) Perplexity vs communication (labels: download / upload '
               'bits)')
  ax.legend(fontsize=7, loc='center right')
  ax = axes[1]
  keys = [(d, '8') for d in GRID_DOWN if (d, '8') in cells]
  ax.errorbar([d for d, _ in keys], [cells[k][METRIC]['mean'] for k in keys],
              yerr=[cells[k][METRIC]['std'] for k in keys], fmt='o-',
              capsize=3, color='C1', label='8-bit uniform upload')
  ax.set(xlabel='download bits', ylabel='test perplexity',
         title='(b) Download bits at 8-bit upload', xticks=list(GRID_DOWN))
  ax.legend()
  fig.suptitle('Download x upload quantization grid (Figure 5 shape), tiny '
               'Transformer, FedAdam, mean ± std over seeds', fontsize=10)
  fig.tight_layout()
  fig.savefig(out / f'{NAME}_fig5.png', dpi=110)
  plt.close(fig)


def main(argv):
  started = provenance.start_study(argv, NAME, _report)
  if started is None:
    return
  seeds, out = started
  rows = _selected()
  if FLAGS.print_commands:
    print('\n'.join(_todo(seeds, rows)))
    return
  pretraining = _pretrain() if any(r.pretrained for r in rows) else None
  by_name = {r.name: r for r in ROWS}

  def train(name: str, seed: int) -> dict:
    run = provenance.seeded_run(
        _flags(by_name[name], seed, FLAGS.rounds,
               f'{FLAGS.runs_dir}/{name}_seed{seed}'), FLAGS.rounds, seed,
        METRIC)
    run['accuracy'] = stats.tail_mean(run['curve'], 'accuracy')
    run['machine'] = json.loads((provenance.REPO / FLAGS.runs_dir /
                                 f'{name}_seed{seed}' /
                                 'summary.json').read_text())['machine']
    return run

  runs = provenance.seed_major([r.name for r in rows], seeds, train)
  def row_record(row: Row) -> dict:
    rs = [runs[row.name][s] for s in seeds]
    comm = rs[0]['communication']
    return {'run': row.name, 'label': row.label, 'groups': row.groups,
            'down': row.down, 'up': row.up, 'pretrained': row.pretrained,
            'flags': row.flags(_pretrain_path())[1:], 'seeds': seeds,
            METRIC: stats.summarize([r[METRIC] for r in rs]),
            'accuracy': stats.summarize([r['accuracy'] for r in rs]),
            'upload_per_client_round': comm['total_upload_bytes'] /
                                       comm['client_rounds'],
            'download_per_client_round': comm['total_download_bytes'] /
                                         comm['client_rounds'],
            'runs': rs}

  data = {'provenance': provenance.file_provenance(),
          'meta': {'base': BASE, 'rounds': FLAGS.rounds,
                   'tail_evaluations': stats.TAIL},
          'pretraining': pretraining,
          'results': [row_record(r) for r in rows]}
  check = by_name[CHECK_ROW]
  data['check'] = provenance.check_record(
      _flags(check, 0, FLAGS.check_rounds, f'{FLAGS.runs_dir}/check'),
      f'{CHECK_ROW} seed 0, {FLAGS.check_rounds} rounds')
  provenance.write_study(out, NAME, data, _report)


if __name__ == '__main__':
  app.run(main)
