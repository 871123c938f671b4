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
flags.DEFINE_bool('report_only', False, 'Rewrite the .md/.png from the .json.')
FLAGS = flags.FLAGS

BASE = 'experiments/configs/shakespeare_sp_fedadam_transformer.flags'
PRETRAIN_STEPS = 1000
OVERVIEW = ('quant', 'pvt', 'algo', 'arch', 'transfer')
GRID_DOWN = (32, 16, 12, 8, 6, 4)
UPLOADS = ('32', '8', '6', '4', 'TernGrad clip', 'TernGrad no clip')
_MARKER = '<!-- hand-written findings below: kept when regenerating -->'


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


def _grid(down: int, up: str, *groups: str) -> Run:
  """A Figure 5 cell, named like 'down16_up8', 'upload8', 'down16_terngrad'."""
  parts = [f'down{down}'] if down != 32 else []
  if up.isdigit() and up != '32':
    parts.append(f'up{up}' if parts else f'upload{up}')
  elif up.startswith('TernGrad'):
    parts.append('terngrad' if up == 'TernGrad clip' else 'terngrad_noclip')
  return Run('_'.join(parts) or 'fedadam', f'download {down} / upload {up}',
             groups + ('grid',), down, up)


RUNS = [
    _grid(32, '32', *OVERVIEW), _grid(32, '8', 'quant'),
    _grid(32, '4', 'quant'), _grid(32, 'TernGrad clip', 'quant'),
    _grid(32, 'TernGrad no clip', 'quant'), _grid(16, '8', 'quant'),
    Run('pvt40', 'PVT 40%', ('pvt',), extra=('--pvt_fraction=0.4',)),
    Run('pvt20', 'PVT 20%', ('pvt',), extra=('--pvt_fraction=0.2',)),
    Run('fedprox', 'FedProx mu=0.01 (server Adam)', ('algo',),
        extra=('--algorithm=fedprox', '--fedprox_mu=0.01')),
    Run('mime_lite', 'MimeLite (Adagrad base 0.1, eps 1e-3, server 1.0)',
        ('algo',), extra=('--algorithm=mime_lite', '--mime_base_eps=0.001',
                          '--server_lr=1.0')),
    Run('lstm', 'CIFG-LSTM tiny, FedAdam', ('arch',),
        extra=('--model=lstm_tiny',)),
    Run('pretrained', 'FedAdam from pretrained', ('transfer',),
        pretrained=True),
    Run('efficient', 'pretrained + PVT 40% + upload 8-bit', ('transfer',),
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
          'down': run.down, 'up': run.up, 'flags': flags_[1:], **rec,
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


def _plots(runs: dict[str, dict], out: pathlib.Path, stem: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  def curve(ax, r, x='round', **kw):
    rows = [c for c in r['curve'] if c['upload_bytes'] > 0 or x == 'round']
    xs = [c[x] / (r['clients_per_round'] if x != 'round' else 1)
          for c in rows]
    ax.plot(xs, [c['perplexity'] for c in rows], marker='.', **kw)

  fig, axes = plt.subplots(2, 3, figsize=(16, 9))
  for ax, g in zip(axes.flat, OVERVIEW):
    for r in runs.values():
      if g in r['groups']:
        curve(ax, r, label=r['label'])
    ax.set(title=g, xlabel='round', ylabel='test perplexity', yscale='log')
    ax.legend(fontsize=7)
  ax = axes.flat[5]
  for r in runs.values():
    if {'quant', 'transfer'} & set(r['groups']):
      curve(ax, r, 'upload_bytes', label=r['label'])
  ax.set(xscale='log', yscale='log', ylabel='test perplexity',
         xlabel='cumulative upload bytes per client slot')
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / f'{stem}.png', dpi=110)
  plt.close(fig)

  cells = {(r['down'], r['up']): r for r in runs.values()
           if 'grid' in r['groups']}
  if cells:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for d in GRID_DOWN:
      pts = [cells[(d, u)] for u in UPLOADS if (d, u) in cells]
      ax.plot([_total(p) / 1e3 for p in pts], [_ppl(p) for p in pts], 'o-',
              label=f'download {d} bits')
      for p in pts:
        ax.annotate(f'{d}/{p["up"]}', (_total(p) / 1e3, _ppl(p)), fontsize=6)
    ax.set(xscale='log', xlabel='KB per client-round (upload + download)',
           ylabel='final test perplexity',
           title='Figure 5 shape (labels: download/upload bits)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f'{stem}_fig5.png', dpi=110)
    plt.close(fig)

  arch = [r for r in runs.values() if 'arch' in r['groups']]
  if len(arch) == 2:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in arch:
      curve(ax, r, label=f'{r["model"]} ({r["num_params"]:,} params)')
    ax.set(yscale='log', xlabel='round', ylabel='test perplexity',
           title='Tiny Transformer vs tiny CIFG-LSTM, FedAdam')
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f'{stem}_lstm_vs_transformer.png', dpi=110)
    plt.close(fig)


def _total(r: dict) -> float:
  return r['upload_per_client_round'] + r['download_per_client_round']


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
  lines += ['', f'![curves]({stem}.png)', f'![Figure 5 grid]({stem}_fig5.png)',
            f'![Transformer vs LSTM]({stem}_lstm_vs_transformer.png)', '']
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
  data = json.loads((out / f'{stem}.json').read_text())
  _markdown(data, out / f'{stem}.md', stem)
  _plots({r['name']: r for r in data['runs']}, out, stem)
  print(f'wrote {out / stem}.json/.md and the plots')


if __name__ == '__main__':
  app.run(main)
