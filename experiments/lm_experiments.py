#!/usr/bin/env python3
"""Small-scale efficient-LM experiments on real Shakespeare (Ro et al. 2022).

  FEDLITE_DATA_DIR=/path/to/data python experiments/lm_experiments.py

Every run is one ``experiments/run_experiment.py`` invocation on
``experiments/configs/shakespeare_sp_fedadam_transformer.flags`` (the
32/32-bit FedAdam baseline: SentencePiece 4,096 ids, sequence length 30,
``transformer_tiny``, client SGD 0.1 clipped at 16, batch 16, <= 1,200
examples per client, server Adam 1e-2, 10 clients x 100 rounds) plus the
run's own flags (``--download``, ``--upload`` stages, ``--pvt_fraction``,
``--algorithm``, ``--model``, ``--init_checkpoint``).
The pretrained runs start from ``experiments/pretrain_centralized.py``
(CPython help pages, 1,000 Adam steps), run first by this script. Every run
starts from scratch (``--noresume --overwrite``).

Writes ``experiments/results/efficient_lm.{json,md}`` and the plots
``efficient_lm.png``, ``efficient_lm_fig5.png``,
``efficient_lm_lstm_vs_transformer.png``; the JSON holds the commit and
command of the file and of every run, and each run's numbers from its
``summary.json`` / ``metrics.jsonl``. ``--only`` / ``--groups`` write
``efficient_lm_partial.*``. Groups: quant, pvt, algo, arch, transfer (the
overview) and grid (Figure 5: download {32, 16, 12, 8, 6, 4} x upload
{32, 8, 6, 4} bits and TernGrad with / without clipping).

``--report_only`` trains nothing: it rewrites the .md and plots from
``efficient_lm.json``, or, where only the previous version's per-run files
``efficient_lm_runs/*.json`` are stored (as now), redraws the plots from
them and leaves the hand-maintained ``efficient_lm.md`` as it is.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from absl import app
from absl import flags

import provenance

flags.DEFINE_integer('rounds', None, 'Rounds per run (default: the '
                     'flagfile\'s 100).', lower_bound=1)
flags.DEFINE_integer('seed', None, 'Run seed (default: the flagfile\'s 0).')
flags.DEFINE_list('only', [], 'Run only these run names.')
flags.DEFINE_list('groups', [], 'Run only the runs of these groups.')
flags.DEFINE_string('runs_dir', 'runs/efficient_lm', 'Per-run output '
                    'directories (relative to the repository root).')
flags.DEFINE_string('results_dir', str(provenance.REPO / 'experiments' /
                                       'results'), 'Where results go.')
flags.DEFINE_bool('report_only', False, 'No training: rewrite the .md/.png '
                  'from <stem>.json; without one, redraw only the .png from '
                  'the previous version\'s per-run files <stem>_runs/*.json '
                  '(its .md is then hand-maintained and left as it is).')
FLAGS = flags.FLAGS

BASE = 'experiments/configs/shakespeare_sp_fedadam_transformer.flags'
PRETRAIN_STEPS = 1000
OVERVIEW = ('quant', 'pvt', 'algo', 'arch', 'transfer')
GRID_DOWN = (32, 16, 12, 8, 6, 4)
UPLOADS = ('32', '8', '6', '4', 'TernGrad clip', 'TernGrad no clip')
_MARKER = '<!-- hand-written findings below: kept when regenerating -->'
_UP_WORDS = {'TernGrad clip': 'TernGrad upload (clipped at 2.5 std)',
             'TernGrad no clip': 'TernGrad upload (no clipping)'}


@dataclasses.dataclass(frozen=True)
class Run:
  """One run: name, label, groups, download bits, upload, other flags."""
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
  """A legend name: 'FedAdam, no compression (32 / 32 bits)',
  '16-bit download, 8-bit uniform upload', 'TernGrad upload (no clipping)'.
  """
  parts = [f'{down}-bit download'] if down != 32 else []
  if up.isdigit() and up != '32':
    parts.append(f'{up}-bit uniform upload')
  elif up != '32':
    parts.append(_UP_WORDS[up])
  return ', '.join(parts) or 'FedAdam, no compression (32 / 32 bits)'


def _grid(down: int, up: str, *groups: str) -> Run:
  """A Figure 5 cell, named like 'down16_up8', 'upload8', 'down16_terngrad'."""
  parts = [f'down{down}'] if down != 32 else []
  if up.isdigit() and up != '32':
    parts.append(f'up{up}' if parts else f'upload{up}')
  elif up.startswith('TernGrad'):
    parts.append('terngrad' if up == 'TernGrad clip' else 'terngrad_noclip')
  return Run('_'.join(parts) or 'fedadam', _grid_label(down, up),
             groups + ('grid',), down, up)


RUNS = [
    _grid(32, '32', *OVERVIEW), _grid(32, '8', 'quant'),
    _grid(32, '4', 'quant'), _grid(32, 'TernGrad clip', 'quant'),
    _grid(32, 'TernGrad no clip', 'quant'), _grid(16, '8', 'quant'),
    Run('pvt40', 'PVT, 40% of the variables trained', ('pvt',),
        extra=('--pvt_fraction=0.4',)),
    Run('pvt20', 'PVT, 20% of the variables trained', ('pvt',),
        extra=('--pvt_fraction=0.2',)),
    Run('fedprox', 'FedProx (mu = 0.01, server Adam)', ('algo',),
        extra=('--algorithm=fedprox', '--fedprox_mu=0.01')),
    Run('mime_lite', 'MimeLite (Adagrad base, lr 0.1)',
        ('algo',), extra=('--algorithm=mime_lite', '--mime_base_eps=0.001',
                          '--server_lr=1.0')),
    Run('lstm', 'CIFG-LSTM (tiny), FedAdam', ('arch',),
        extra=('--model=lstm_tiny',)),
    Run('pretrained', 'FedAdam from a pretrained start', ('transfer',),
        pretrained=True),
    Run('efficient', 'pretrained + PVT 40% + 8-bit upload', ('transfer',),
        up='8', extra=('--pvt_fraction=0.4',), pretrained=True),
    _grid(32, '6'), _grid(16, '32'), _grid(16, '6'), _grid(16, '4'),
    _grid(12, '32'), _grid(12, '8'), _grid(12, '6'), _grid(12, '4'),
    _grid(16, 'TernGrad clip'), _grid(16, 'TernGrad no clip'),
    _grid(8, '8'), _grid(6, '8'), _grid(4, '8'),
]


def _pretrain(path: str) -> dict:
  """Phase 1 of transfer learning: experiments/pretrain_centralized.py."""
  rec = provenance.run_script('experiments/pretrain_centralized.py', [
      '--task=shakespeare', '--model=transformer_tiny', '--corpus=python_help',
      f'--steps={PRETRAIN_STEPS}', f'--seed={FLAGS.seed or 0}',
      f'--output={path}'])
  stdout = rec.pop('stdout')
  meta = json.loads(stdout[stdout.index('{'):])
  meta.pop('task_tokenizer', None)  # A path on the machine that ran it.
  return {**rec, 'metadata': meta}


def _record(run: Run, flags_: list[str], rec: dict) -> dict:
  s = rec.pop('summary')
  comm = s['communication']
  return {'name': run.name, 'label': run.label, 'groups': run.groups,
          'down': run.down, 'up': run.up, 'pretrained': run.pretrained,
          'flags': flags_[1:], **rec,
          'model': s['flags']['model'], 'rounds': s['rounds'],
          'seed': s['flags']['seed'],
          'clients_per_round': s['flags']['clients_per_round'],
          'num_params': s['model']['num_params'],
          'final': s['final_eval'],
          'upload_per_client_round': comm['total_upload_bytes'] /
                                     comm['client_rounds'],
          'download_per_client_round': comm['total_download_bytes'] /
                                       comm['client_rounds'],
          'seconds_per_round': s['seconds_per_round'],
          'machine': s['machine']}


def _kb(b: float) -> str:
  return f'{b / 1e6:.2f} MB' if b >= 1e6 else f'{b / 1e3:.2f} KB'


def _ppl(r: dict) -> float:
  return r['final']['perplexity']


def _readable_model(r: dict) -> str:
  name = {'transformer_tiny': 'Transformer', 'lstm_tiny': 'CIFG-LSTM'}.get(
      r['model'], r['model'])
  return f'{name} (tiny, {r["num_params"]:,} parameters)'


def _frame(ax, ys: list[float], pad: float = 0.06) -> None:
  """y axis on the data: linear below a 10x range, else log."""
  lo, hi = min(ys), max(ys)
  if hi >= 10 * lo:
    ax.set_yscale('log')
  else:
    ax.set_ylim(lo - pad * (hi - lo), hi + pad * (hi - lo))


def _after_start(r: dict) -> list[dict]:
  """Evaluations after round 0 (the start, ~6,000 perplexity, would squeeze
  the range where the runs differ)."""
  return [c for c in r['curve'] if c['round'] > 0]


def _plots(runs: dict[str, dict], out: pathlib.Path, stem: str) -> None:
  """``<stem>.png`` (overview), ``<stem>_fig5.png`` (download x upload
  grid), ``<stem>_lstm_vs_transformer.png``. Curves by round leave round 0
  out; y axes are framed on the plotted data (linear below a 10x range)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  plt.rcParams.update({'font.size': 9, 'axes.titlesize': 10,
                       'legend.fontsize': 7.5})
  base = runs.get('fedadam')
  any_r = next(iter(runs.values()))
  setting = (f'{any_r["clients_per_round"]} clients x {any_r["rounds"]} '
             f'rounds, seed {any_r["seed"]} (one seed, no spread)')

  # One color per run across panels (a), (e) and (f); the baseline black,
  # thick and underneath, so a run equal to it stays visible.
  colors = {}
  for r in runs.values():
    if {'quant', 'transfer'} & set(r['groups']) and r is not base:
      colors[r['name']] = f'C{len(colors) % 10}'

  def style(r, i):
    if r is base:
      return {'color': 'k', 'lw': 2.6, 'zorder': 1}
    return {'color': colors.get(r['name'], f'C{i}'), 'zorder': 2}

  def curve(ax, r, key='perplexity', **kw):
    rows = _after_start(r)
    ax.plot([c['round'] for c in rows], [c[key] for c in rows],
            marker='o', ms=3, **kw)
    return [c[key] for c in rows]

  titles = {'quant': '(a) Upload / download quantization',
            'pvt': '(b) Partial variable training (PVT)',
            'algo': '(c) Federated optimizer',
            'arch': '(d) Architecture',
            'transfer': '(e) Pretraining and the efficient combination'}
  fig, axes = plt.subplots(2, 3, figsize=(15, 8.6))
  for ax, g in zip(axes.flat, OVERVIEW):
    ys = []
    for i, r in enumerate(r for r in runs.values() if g in r['groups']):
      ys += curve(ax, r, label=_readable_model(r) + ', FedAdam'
                  if g == 'arch' else r['label'], **style(r, i - 1))
    _frame(ax, ys)
    ax.set(title=titles[g], xlabel='round', ylabel='test perplexity')
    ax.legend(loc='upper right')
  ax, ys = axes.flat[5], []
  for r in runs.values():
    if {'quant', 'transfer'} & set(r['groups']):
      rows = _after_start(r)
      ax.plot([c['upload_bytes'] / r['clients_per_round'] / 1e6
               for c in rows], [c['perplexity'] for c in rows], marker='o',
              ms=3, label=r['label'], **style(r, 0))
      ys += [c['perplexity'] for c in rows]
  _frame(ax, ys)
  ax.set_xscale('log')
  ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f'{x:g}'))
  ax.set(title='(f) Perplexity vs cumulative upload',
         xlabel='cumulative upload per client slot (MB, log scale)',
         ylabel='test perplexity')
  ax.legend(loc='upper right', fontsize=7)
  fig.suptitle(f'Tiny Transformer LM on Shakespeare, FedAdam unless named; '
               f'{setting}; round 0 not drawn', fontsize=10)
  fig.tight_layout()
  fig.savefig(out / f'{stem}.png', dpi=110)
  plt.close(fig)

  cells = {(r['down'], r['up']): r for r in runs.values()
           if 'grid' in r['groups']}
  if cells:
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.2),
                             gridspec_kw={'width_ratios': [1.4, 1, 1]})
    ax, ys = axes[0], []
    uniform = [u for u in UPLOADS if u.isdigit()]
    lines = [(f'download {d} bits, uniform upload 32 / 8 / 6 / 4 bits',
              [(d, u) for u in uniform]) for d in GRID_DOWN]
    lines = [(label, [c for c in keys if c in cells]) for label, keys in lines]
    extra = [c for label, keys in lines if len(keys) == 1 for c in keys]
    lines = [(label, keys) for label, keys in lines if len(keys) > 1]
    if extra:  # Download-only sweeps (one cell per download level).
      ups = sorted({u for _, u in extra})
      lines.append((f'uniform upload {" / ".join(ups)} bits, download '
                    f'{" / ".join(str(d) for d, _ in extra)} bits',
                    [(d, u) for d, u in extra]))
    for i, (label, keys) in enumerate(lines):
      keys.sort(key=lambda k: _total(cells[k]))
      xs = [_total(cells[k]) / 1e3 for k in keys]
      ys = [_ppl(cells[k]) for k in keys]
      ax.plot(xs, ys, 'o-', color=f'C{i}', label=label)
      for j, (x, y, (d, u)) in enumerate(zip(xs, ys, keys)):
        # Falling lines: labels above-right; the right ends alternate below
        # and above (their points sit close together at ~180).
        end = j == len(keys) - 1 and ys[j - 1] > y
        off = ((0, 5 if i % 2 else -6) if end else
               (4, 3) if j == 0 or ys[j - 1] > y else (4, -9))
        ax.annotate(f'{d}/{u}', (x, y), textcoords='offset points',
                    xytext=off, fontsize=6.5, ha='center' if end else 'left',
                    va='bottom' if off[1] > 0 else 'top')
    for up, marker in (('TernGrad clip', 'X'), ('TernGrad no clip', 'P')):
      keys = [(d, up) for d in GRID_DOWN if (d, up) in cells]
      if keys:
        ax.plot([_total(cells[k]) / 1e3 for k in keys],
                [_ppl(cells[k]) for k in keys], marker, ms=8, color='0.3',
                ls='none', label=f'{_UP_WORDS[up]}, download '
                f'{" / ".join(str(d) for d, _ in keys)} bits')
        for d, _ in keys:
          ax.annotate(f'{d}/T{"" if up == "TernGrad clip" else "-nc"}',
                      (_total(cells[(d, up)]) / 1e3, _ppl(cells[(d, up)])),
                      textcoords='offset points', xytext=(5, 3),
                      fontsize=6.5)
    ys = [_ppl(c) for c in cells.values()]
    _frame(ax, ys)
    ax.set_xscale('log')
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(
        lambda x, _: f'{x:,.0f}'))
    ax.xaxis.set_minor_formatter(ticker.FuncFormatter(
        lambda x, _: f'{x:,.0f}' if str(int(x))[0] in '2357' else ''))
    ax.tick_params(axis='x', which='minor', labelsize=7)
    ax.set(xlabel='KB per client-round, upload + download (log scale)',
           ylabel=f'test perplexity after {any_r["rounds"]} rounds',
           title='(a) Final perplexity vs communication\n'
                 '(labels: download / upload bits; T = TernGrad, '
                 'nc = no clipping)')
    ax.legend(loc='upper center', bbox_to_anchor=(0.5, -0.15), ncol=2,
              fontsize=7)
    for ax, keys, title in (
        (axes[1], [(d, '8') for d in GRID_DOWN],
         '(b) Download bits, 8-bit uniform upload'),
        (axes[2], [(16, u) for u in UPLOADS],
         '(c) Upload, 16-bit download')):
      ys = []
      for i, k in enumerate(k for k in keys if k in cells):
        d, u = k
        ys += curve(ax, cells[k], color=f'C{i}', label=(
            f'{d}-bit download' if ax is axes[1] else
            f'{u}-bit uniform upload' if u.isdigit() else _UP_WORDS[u]))
      if base:
        ys += curve(ax, base, color='k', ls='--', lw=1.2,
                    label='no compression (32 / 32 bits)')
      _frame(ax, ys)
      ax.set(title=title, xlabel='round', ylabel='test perplexity')
      ax.legend(loc='upper right')
    fig.suptitle(f'Download x upload quantization grid (Figure 5 shape), '
                 f'tiny Transformer, FedAdam; {setting}; round 0 not drawn',
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f'{stem}_fig5.png', dpi=110)
    plt.close(fig)

  arch = [r for r in runs.values() if 'arch' in r['groups']]
  if len(arch) == 2:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3))
    for ax, key, ylabel in ((axes[0], 'perplexity', 'test perplexity'),
                            (axes[1], 'accuracy',
                             'test next-token accuracy')):
      ys = []
      for i, r in enumerate(arch):
        ys += curve(ax, r, key, color=f'C{i}', label=_readable_model(r))
      _frame(ax, ys)
      ax.set(xlabel='round', ylabel=ylabel)
      ax.legend(loc='upper right' if key == 'perplexity' else 'lower right')
    fig.suptitle('Tiny Transformer vs tiny CIFG-LSTM, FedAdam, same learning '
                 f'rates; {setting}; round 0 not drawn', fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f'{stem}_lstm_vs_transformer.png', dpi=110)
    plt.close(fig)


def _total(r: dict) -> float:
  return r['upload_per_client_round'] + r['download_per_client_round']


def _stored_runs(path: pathlib.Path) -> dict[str, dict]:
  """The previous script's per-run files (``<stem>_runs/*.json``: ``spec``,
  ``rows``, bytes per client-round) as this script's run records, in the
  order of ``RUNS``, labelled as ``RUNS`` labels them. A transformer_tiny
  FedAdam run without PVT or pretraining is a cell of the grid."""
  labels = {r.name: r.label for r in RUNS}
  order = {r.name: i for i, r in enumerate(RUNS)}
  ups = {'none': '32', 'terngrad': 'TernGrad clip',
         'terngrad_noclip': 'TernGrad no clip'}
  runs = []
  files = sorted(path.glob('*.json'))
  if not files:
    raise FileNotFoundError(f'{path}: no per-run .json files (and no '
                            f'{path.name[:-5]}.json) to plot.')
  for f in files:
    d = json.loads(f.read_text())
    s = d['spec']
    cell = (s['algorithm'], s['model'], s['pvt'], s['pretrained']) == (
        'fedavg', 'transformer_tiny', 1.0, False)
    runs.append({
        'name': s['name'], 'label': labels.get(s['name'], s['label']),
        'groups': tuple(dict.fromkeys(s['group'] + ['grid'] * cell)),
        'down': s['download_bits'],
        'up': ups.get(s['upload'], str(s['upload_bits'])),
        'pretrained': s['pretrained'], 'model': s['model'],
        'rounds': d['rounds'], 'seed': d['seed'],
        'clients_per_round': d['clients_per_round'],
        'num_params': d['num_params'], 'curve': d['rows'],
        'final': {k: d['rows'][-1][k] for k in ('perplexity', 'accuracy')},
        'upload_per_client_round': d['upload_bytes_per_client_round'],
        'download_per_client_round': d['download_bytes_per_client_round']})
  runs.sort(key=lambda r: order.get(r['name'], len(order)))
  return {r['name']: r for r in runs}


def _captions(runs: dict[str, dict]) -> dict[str, str]:
  """Caption of each plot (stem suffix -> text), written under it."""
  r = next(iter(runs.values()))

  def start(subset):  # Round-0 perplexity, the curves' omitted start.
    names = {}
    for x in subset:
      c = x['curve'][0]
      if c['round'] == 0:
        name = _readable_model(x).split(' (')[0]
        if x.get('pretrained', any(f.startswith('--init_checkpoint=')
                                   for f in x.get('flags', ()))):
          name = f'pretrained {name}'
        names.setdefault(name, f'{name} {c["perplexity"]:,.1f}')
    return (f'Curves start at round {_after_start(r)[0]["round"]}; round 0 '
            f'is omitted (its test perplexity: {", ".join(names.values())}).'
            if names else '')

  seed = (f'{r["clients_per_round"]} clients x {r["rounds"]} rounds, seed '
          f'{r["seed"]} only: one seed, no spread, so no difference between '
          'runs is resolved here. Linear y axes where a panel\'s range is '
          'under 10x, else log.')
  grid = [x for x in runs.values() if 'grid' in x['groups']]
  arch = [x for x in runs.values() if 'arch' in x['groups']]
  return {
      '': 'Test perplexity by round, one panel per study: (a) upload / '
          'download quantization, (b) partial variable training, (c) '
          'FedAdam / FedProx / MimeLite, (d) Transformer vs CIFG-LSTM, (e) '
          'pretraining and pretrained + PVT 40% + 8-bit upload; (f) '
          'perplexity against cumulative upload per client slot (log x). '
          f'FedAdam without compression in black. {seed} '
          f'{start(runs.values())}',
      '_fig5': '(a) Final test perplexity against bytes per client-round '
               '(upload + download, log x), every cell of the grid (point '
               'labels: download / upload bits); (b) perplexity by round at '
               '8-bit upload for each download width; (c) perplexity by '
               f'round at 16-bit download for each upload. {seed} '
               f'{start(grid)}',
      '_lstm_vs_transformer': 'Test perplexity (left) and next-token '
                              'accuracy (right) by round, tiny Transformer '
                              'and tiny CIFG-LSTM with the same learning '
                              f'rates. {seed} {start(arch)}'}


def _markdown(data: dict, path: pathlib.Path, stem: str) -> None:
  runs = {r['name']: r for r in data['runs']}
  any_r = data['runs'][0]
  m = any_r['machine']
  lines = [
      '# Efficient language-model FL, small scale (Ro et al. 2022 shapes)', '',
      provenance.markdown_header(data['provenance']),
      '**Small-scale CPU runs, not a reproduction of the paper\'s numbers.** '
      f'Every run: `python {provenance.RUNNER} --flagfile={BASE}` plus the '
      'flags in the table (its exact command and commit are in '
      '`efficient_lm.json`, `runs[i].command`): TFF Shakespeare (715 '
      'clients) standing in for StackOverflow, SentencePiece 4,096 ids, '
      'sequence length 30, `transformer_tiny` (or `lstm_tiny`), '
      f'{any_r["clients_per_round"]} clients per round for '
      f'{any_r["rounds"]} rounds, seed {any_r["seed"]}; test perplexity on '
      'all test snippets. One seed: differences of a few percent are within '
      f'run-to-run noise. Machine: {m["platform"]}, JAX {m["jax"]} '
      f'({m["backend"]}); total wall time '
      f'{data["total_wall_seconds"] / 60:.1f} min.', '',
      '| run | groups | flags beyond the baseline | params | final ppl | '
      'best ppl | final acc | upload / client-round | download / '
      'client-round | s / round |', '|---' * 10 + '|']
  for r in data['runs']:
    lines.append(
        f'| {r["name"]} | {", ".join(r["groups"])} | '
        f'`{" ".join(r["flags"]) or "-"}` | '
        f'{r["num_params"]:,} | {_ppl(r):.2f} | '
        f'{min(c["perplexity"] for c in r["curve"]):.2f} | '
        f'{r["final"]["accuracy"]:.4f} | '
        f'{_kb(r["upload_per_client_round"])} | '
        f'{_kb(r["download_per_client_round"])} | '
        f'{r["seconds_per_round"]:.2f} |')
  rounds = sorted({c['round'] for r in data['runs'] for c in r['curve']})
  lines += ['', '## Perplexity by round (round 0: the pretrained start)', '',
            '| round | ' + ' | '.join(runs) + ' |',
            '|---' * (len(runs) + 1) + '|']
  for n in rounds:
    lines.append(f'| {n} | ' + ' | '.join(
        next((f'{c["perplexity"]:.1f}' for c in r['curve']
              if c['round'] == n), '') for r in runs.values()) + ' |')
  if data.get('pretraining'):
    p = data['pretraining']
    meta = ', '.join(f'{k} {v}' for k, v in p['metadata'].items())
    lines += ['', f'Pretraining (phase 1 of the pretrained runs): '
              f'`{p["command"]}`: {meta}.']
  cells = {(r['down'], r['up']): r for r in data['runs']
           if 'grid' in r['groups']}
  if cells:
    lines += ['', '## Figure 5 grid', '', 'Final test perplexity / bytes per '
              'client-round (upload + download); rows: download bits, '
              'columns: upload; "-" = not run.', '',
              '| download \\ upload | ' + ' | '.join(UPLOADS) + ' |',
              '|---' * (len(UPLOADS) + 1) + '|']
    for d in GRID_DOWN:
      lines.append(f'| {d} | ' + ' | '.join(
          f'{_ppl(cells[(d, u)]):.1f} / {_kb(_total(cells[(d, u)]))}'
          if (d, u) in cells else '-' for u in UPLOADS) + ' |')
  caps = _captions(runs)
  for suffix, alt in (('', 'curves'), ('_fig5', 'Figure 5 grid'),
                      ('_lstm_vs_transformer', 'Transformer vs LSTM')):
    lines += ['', f'![{alt}]({stem}{suffix}.png)', '',
              f'*{stem}{suffix}.png: {caps[suffix]}*']
  lines.append('')
  text = '\n'.join(lines)
  if path.exists() and _MARKER in path.read_text():
    text += '\n' + _MARKER + path.read_text().split(_MARKER, 1)[1]
  path.write_text(text)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  out = pathlib.Path(FLAGS.results_dir)
  partial = bool(FLAGS.only or FLAGS.groups)
  stem = 'efficient_lm_partial' if partial else 'efficient_lm'
  if not FLAGS.report_only:
    data = {'provenance': provenance.file_provenance(), 'runs': []}
    t0 = time.perf_counter()
    todo = [r for r in RUNS if not partial or r.name in FLAGS.only or
            set(r.groups) & set(FLAGS.groups)]
    pretrained = f'{FLAGS.runs_dir}/pretrained_transformer_tiny.params'
    if any(r.pretrained for r in todo):
      data['pretraining'] = _pretrain(pretrained)
    overrides = [f'--num_rounds={FLAGS.rounds}'] * bool(FLAGS.rounds) + \
        [f'--seed={FLAGS.seed}'] * (FLAGS.seed is not None)
    for run in todo:
      flags_ = run.flags(pretrained) + overrides
      rec = provenance.run_experiment(flags_ + [
          f'--output_dir={FLAGS.runs_dir}/{run.name}', '--noresume',
          '--overwrite', '--noprogress'])
      data['runs'].append(_record(run, flags_, rec))
      print(f'{run.name}: ppl {_ppl(data["runs"][-1]):.2f}', flush=True)
    data['total_wall_seconds'] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    provenance.write_json(out / f'{stem}.json', data)
  if FLAGS.report_only and not (out / f'{stem}.json').exists():
    _plots(_stored_runs(out / f'{stem}_runs'), out, stem)
    print(f'wrote the plots of {out / stem}_runs/*.json; {stem}.md left as '
          'it is')
    return
  data = json.loads((out / f'{stem}.json').read_text())
  _markdown(data, out / f'{stem}.md', stem)
  _plots({r['name']: r for r in data['runs']}, out, stem)
  print(f'wrote {out / stem}.json/.md and the plots')


if __name__ == '__main__':
  app.run(main)
