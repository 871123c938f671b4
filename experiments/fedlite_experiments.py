#!/usr/bin/env python3
"""FedLite's experiments (Wang et al. 2022, Figures 3-5) at CPU scale.

  FEDLITE_DATA_DIR=/path/to/data python experiments/fedlite_experiments.py

Every training run is one ``experiments/run_experiment.py`` invocation,
started from scratch (``--noresume --overwrite``):

* ``femnist``: SplitFed (``experiments/configs/fedlite_femnist_small.flags``:
  120 iterations, SGD 0.1, B = 20, 10 clients) and FedLite on it over a
  (q, L) grid at R = 1, lambda = 1e-3 per example (Figure 4 shape), the
  lambda ablation (0, 2e-4, 1e-2 at 490x; 0 at 1,197x: Figure 5 shape), and
  a FedAvg reference (``emnist_fedavg.flags``, 30 rounds).
* ``fig3``: Figure 3 shape, no training: quantization error vs compression
  ratio of k-means (q = 1), vanilla PQ (R = q) and grouped PQ on real
  activations: the client part of the ``femnist`` SplitFed run after 60
  iterations (its checkpoint), eval mode, one batch of B = 20 from each of
  the first 10 training clients.
* ``nwp``: next-word prediction, SplitFed vs FedLite at three (q, L)
  points (``fedlite_shakespeare_small.flags``: the StackOverflow LSTM on
  word-level Shakespeare, 100 iterations, Adam 0.01, lambda 0.016 per
  example).

Writes to ``--output_dir`` (default ``experiments/results``):
``fedlite_results.json`` (the commit and command of the file and of every
run, and every number read from the runs' ``summary.json`` /
``metrics.jsonl``), ``fedlite_tables.md``, ``fedlite_fig3.png``,
``fedlite_fig4.png``, ``fedlite_fig5_lambda.png``, ``fedlite_nwp.png``.
``fedlite.md`` is the hand-written reading of these results.
``--report_only`` redraws the plots from the stored ``fedlite_results.json``
without training (both its layouts: this script's and the previous one's).
"""

from __future__ import annotations

import json
import pathlib
import time

from absl import app
from absl import flags

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import jax
import numpy as np

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.fedlite import pq
from fedlite_jax.training import init_params
import provenance

flags.DEFINE_string('output_dir', str(provenance.REPO / 'experiments' /
                                      'results'), 'Where results go.')
flags.DEFINE_string('runs_dir', 'runs/fedlite', 'Per-run output directories '
                    '(relative to the repository root).')
flags.DEFINE_list('parts', ['femnist', 'fig3', 'nwp'], 'Parts to run.')
flags.DEFINE_list('runs', [], 'Only the training runs with these names.')
flags.DEFINE_integer('seed', None, 'Run seed (default: the flagfiles\' 0).')
flags.DEFINE_integer('iterations', None, 'FEMNIST iterations (default 120).',
                     lower_bound=1)
flags.DEFINE_integer('nwp_iterations', None, 'NWP iterations (default 100).',
                     lower_bound=1)
flags.DEFINE_bool('report_only', False, 'No training: redraw the four plots '
                  'from --output_dir\'s fedlite_results.json. The .md files '
                  'are left as they are (the stored tables were written by '
                  'the previous version of this script).')
FLAGS = flags.FLAGS

FEMNIST = 'experiments/configs/fedlite_femnist_small.flags'
NWP = 'experiments/configs/fedlite_shakespeare_small.flags'
FEDAVG = 'experiments/configs/emnist_fedavg.flags'
LAMBDA = 1e-3       # per example (= the paper's 5e-5 on a batch-mean loss)
NWP_LAMBDA = 0.016  # per example (1e-3 on a batch-mean loss of 16)
FEMNIST_GRID = ((288, 2, LAMBDA), (1152, 2, LAMBDA), (4608, 2, LAMBDA),
                (1152, 32, LAMBDA), (4608, 32, LAMBDA), (1152, 2, 0.0),
                (1152, 2, 2e-4), (1152, 2, 1e-2), (288, 2, 0.0))
NWP_GRID = ((48, 240), (24, 30), (12, 4))
FIG3_CLIENTS, FIG3_BATCH, FIG3_ITERATION, PHI = 10, 20, 60, 64.0


def _split_runs(part: str, base: str) -> list[tuple[str, dict, list[str]]]:
  """(name, quantizer settings, flags) of a part's SplitFed/FedLite runs."""
  grid = (FEMNIST_GRID if part == 'femnist' else
          [(q, L, NWP_LAMBDA) for q, L in NWP_GRID])
  runs = [(f'{part}_splitfed', {}, [f'--flagfile={base}'])]
  for q, L, lam in grid:
    runs.append((f'{part}_fedlite_q{q}_L{L}_lam{lam:g}',
                 {'q': q, 'R': 1, 'L': L, 'lambda': lam},
                 [f'--flagfile={base}', '--algorithm=fedlite',
                  f'--num_subvectors={q}', '--num_groups=1',
                  f'--num_centroids={L}', f'--correction_lambda={lam:g}']))
  return runs


def _train(name: str, quantizer: dict, flags_: list[str],
           rounds: int | None) -> dict:
  flags_ = flags_ + [f'--num_rounds={rounds}'] * bool(rounds) + \
      [f'--seed={FLAGS.seed}'] * (FLAGS.seed is not None)
  rec = provenance.run_experiment(flags_ + [
      f'--output_dir={FLAGS.runs_dir}/{name}', '--noresume', '--overwrite',
      '--noprogress'])
  s = rec.pop('summary')
  print(f'{name}: {s["final_eval"]}', flush=True)
  return {**quantizer, **rec, 'rounds': s['rounds'],
          'seed': s['flags']['seed'], 'final': s['final_eval'],
          'communication': s['communication'],
          'seconds_per_round': s['seconds_per_round'],
          'machine': s['machine']}


def _fig3(runs: dict) -> dict:
  """Quantization error vs ratio on the SplitFed run's activations."""
  t0 = time.perf_counter()
  split = runs['femnist_splitfed']
  ckpt = (provenance.REPO / FLAGS.runs_dir / 'femnist_splitfed' /
          'checkpoints' /
          f'ckpt_{min(FIG3_ITERATION, split["rounds"]):08d}.msgpack')
  split_model = models.create_emnist_cnn(62)
  params = init_params.load_init_params(
      ckpt, split_model.model.init(jax.random.PRNGKey(0))).params
  train, _, _ = datasets.load_federated_data('emnist', None)
  ids = list(train.client_ids())[:FIG3_CLIENTS]
  zs = []
  for i, (_, cds) in enumerate(train.get_clients(ids)):
    ex = cds.all_examples()
    pick = np.random.default_rng(i).choice(len(ex['y']), FIG3_BATCH,
                                           replace=len(ex['y']) < FIG3_BATCH)
    batch = {k: v[pick] for k, v in ex.items()}
    zs.append(np.asarray(split_model.client_apply(params['client'], batch)))
  z = np.stack(zs)  # float32 [clients, B, d]
  d = z.shape[-1]
  keys = jax.random.split(jax.random.PRNGKey(0), len(zs))
  configs = [('k-means (q=1)', 1, 1, L) for L in (2, 4, 8, 16, 20)]
  configs += [(f'vanilla PQ (q=R={q})', q, q, L) for q in (288, 1152, 4608)
              for L in (2, 4, 8, 16)]
  configs += [(f'grouped PQ (q=4608, R={R})', 4608, R, L)
              for R in (2304, 1152, 384, 1) for L in (2, 4, 8, 16, 32)]
  configs += [('grouped PQ (q=1152, R=1)', 1152, 1, L)
              for L in (2, 4, 8, 16, 32)]
  rows = []
  for label, q, R, L in configs:
    res = jax.jit(jax.vmap(lambda x, k, q=q, R=R, L=L: pq.grouped_pq(
        x, k, q, R, L)))(z, keys)
    rows.append({'curve': label, 'q': q, 'R': R, 'L': L,
                 'compression': pq.pq_compression_ratio(d, FIG3_BATCH, q, R,
                                                        L, PHI),
                 'relative_error': float(np.mean(res.relative_error))})
  return {'checkpoint': str(ckpt.relative_to(provenance.REPO)),
          'splitfed_command': split['command'], 'rows': rows,
          'wall_seconds': time.perf_counter() - t0}


def _run_points(runs: dict) -> dict[str, dict]:
  """name -> q, L, lambda per example, ratio, accuracy of each stored run.

  Reads both record layouts of ``fedlite_results.json``: this script's
  (``communication.activation_compression``, ``lambda`` per example) and the
  previous script's, which the stored file holds (``activation_compression``,
  ``lambda_per_example``; its ``lambda`` is the batch-mean value).
  """
  pts = {}
  for name, r in runs.items():
    comm = r.get('communication', r)
    pts[name] = {
        'q': r.get('q'), 'L': r.get('L'),
        'lambda': r.get('lambda_per_example', r.get('lambda')),
        'ratio': comm.get('activation_compression'),
        'accuracy': r['final']['accuracy'],
        'iterations': r.get('iterations', r.get('rounds')),
        'seed': r.get('seed')}
  return pts


def _plots(data: dict, out: pathlib.Path) -> None:
  """fedlite_fig3/fig4/fig5_lambda/nwp.png from ``data`` (the .json's)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  plt.rcParams.update({'font.size': 9, 'axes.titlesize': 10,
                       'legend.fontsize': 8})
  pts = _run_points(data['runs'])

  def annotate(ax, xs, ys, texts):
    """Labels each point of a line on the side its segments leave free."""
    for i, (x, y, text) in enumerate(zip(xs, ys, texts)):
      nb = [(j - i, ys[j]) for j in (i - 1, i + 1) if 0 <= j < len(ys)]
      if all(v < y for _, v in nb):
        kw = {'xytext': (0, 6), 'ha': 'center', 'va': 'bottom'}
      elif all(v > y for _, v in nb):
        kw = {'xytext': (0, -7), 'ha': 'center', 'va': 'top'}
      else:  # Monotone through the point: above-right if it falls.
        falls = any((v - y) * d < 0 for d, v in nb)
        kw = {'xytext': (6, 5 if falls else -5), 'ha': 'left',
              'va': 'bottom' if falls else 'top'}
      ax.annotate(text, (x, y), textcoords='offset points', fontsize=7.5,
                  **kw)

  def frame(ax, ys, pad=0.08):
    lo, hi = min(ys), max(ys)
    ax.set_ylim(lo - pad * (hi - lo), hi + pad * (hi - lo))

  def ratio_axis(ax, xs):
    ax.set_xscale('log')
    ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(
        lambda x, _: f'{x:,.0f}x' if x >= 1 else f'{x:g}x'))

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(out / name, dpi=150)
    plt.close(fig)

  if 'fig3' in data:
    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    rows = data['fig3']['rows']
    kinds = {'k': ('k-means (whole vector, q = 1)', 's--'),
             'v': ('vanilla PQ (q = R = {q:,})', 'o:'),
             'g': ('grouped PQ (q = {q:,}, R = {R:,})', 'x-')}
    for curve in dict.fromkeys(r['curve'] for r in rows):
      mine = sorted((r for r in rows if r['curve'] == curve),
                    key=lambda r: r['compression'])
      label, style = kinds[curve[0]]
      ax.plot([r['compression'] for r in mine],
              [r['relative_error'] for r in mine], style,
              label=label.format(q=mine[0]['q'], R=mine[0]['R']))
    for r in (mine[0], mine[-1]):  # L at the ends of the last curve.
      ax.annotate(f'L = {r["L"]}', (r['compression'], r['relative_error']),
                  textcoords='offset points', xytext=(6, -2), ha='left',
                  va='top', fontsize=7.5)
    ratio_axis(ax, [r['compression'] for r in rows])
    ax.set_ylim(0, None)
    ax.set(xlabel='activation compression ratio (phi = 64 bits per float)',
           ylabel='relative quantization error\n'
                  '||Z - Z~||$_F^2$ / ||Z||$_F^2$')
    seed = data['runs'].get('femnist_splitfed', {}).get('seed')
    ax.set_title(f'FEMNIST client activations (one client model, seed '
                 f'{seed}): error vs compression')
    ax.legend(title='q subvectors, R codebook groups\n(points: L codewords)',
              title_fontsize=7.5, fontsize=7.5)
    save(fig, 'fedlite_fig3.png')

  def fedlite(part, lam):
    return {n: p for n, p in pts.items()
            if n.startswith(f'{part}_fedlite') and p['lambda'] == lam}

  split = pts.get('femnist_splitfed')
  fem = fedlite('femnist', LAMBDA)
  if fem:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ys = [p['accuracy'] for p in fem.values()]
    for L, style in ((32, 's-'), (2, 'o-')):
      mine = sorted((p for p in fem.values() if p['L'] == L),
                    key=lambda p: p['ratio'])
      if not mine:
        continue
      xs, acc = [p['ratio'] for p in mine], [p['accuracy'] for p in mine]
      ax.plot(xs, acc, style, label=f'FedLite, L = {L} codewords (R = 1)')
      annotate(ax, xs, acc, [f'q = {p["q"]:,}' for p in mine])
    if split:
      ax.axhline(split['accuracy'], color='k', ls='--',
                 label='SplitFed (no compression)')
      ys.append(split['accuracy'])
    ratio_axis(ax, [p['ratio'] for p in fem.values()])
    frame(ax, ys, pad=0.15)
    p = next(iter(fem.values()))
    ax.set(xlabel='activation compression ratio (phi = 64)',
           ylabel='test accuracy',
           title=f'FEMNIST-105 after {p["iterations"]} iterations, one seed '
                 f'({p["seed"]}), lambda = {LAMBDA:g} per example')
    ax.legend(loc='lower left')
    save(fig, 'fedlite_fig4.png')

  nwp = fedlite('nwp', NWP_LAMBDA)
  if nwp:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    mine = sorted(nwp.values(), key=lambda p: p['ratio'])
    xs, ys = [p['ratio'] for p in mine], [p['accuracy'] for p in mine]
    ax.plot(xs, ys, 'o-',
            label=f'FedLite (R = 1, lambda = {NWP_LAMBDA:g} per example)')
    annotate(ax, xs, ys, [f'q = {p["q"]}, L = {p["L"]}' for p in mine])
    if 'nwp_splitfed' in pts:
      ax.axhline(pts['nwp_splitfed']['accuracy'], color='k', ls='--',
                 label='SplitFed (no compression)')
      ys.append(pts['nwp_splitfed']['accuracy'])
    ratio_axis(ax, [p['ratio'] for p in mine])
    frame(ax, ys, pad=0.2)
    ax.set(xlabel='activation compression ratio (phi = 64)',
           ylabel='test next-word accuracy\n(PAD, EOS, OOV excluded)',
           title=f'Shakespeare next-word prediction after '
                 f'{mine[0]["iterations"]} iterations, one seed '
                 f'({mine[0]["seed"]})')
    ax.legend(loc='lower right')
    save(fig, 'fedlite_nwp.png')

  fem = {n: p for n, p in pts.items() if n.startswith('femnist_fedlite')}
  series = {}
  for p in fem.values():
    series.setdefault((p['ratio'], p['q'], p['L']), []).append(p)
  series = {k: sorted(v, key=lambda p: p['lambda']) for k, v in
            sorted(series.items()) if len(v) > 1}
  if series:
    # lambda = 0 has its own panel: a log axis has no 0, and drawing it at a
    # small lambda would put it on a value the paper uses.
    fig, (ax0, ax) = plt.subplots(
        1, 2, sharey=True, figsize=(6.8, 4.4),
        gridspec_kw={'width_ratios': [1, 5], 'wspace': 0.06})
    ys = []
    for i, ((ratio, q, L), mine) in enumerate(series.items()):
      color, marker = f'C{i}', 'os^v'[i % 4]
      zero = [p for p in mine if p['lambda'] == 0]
      pos = [p for p in mine if p['lambda'] > 0]
      label = f'FedLite, {ratio:,.0f}x (q = {q:,}, L = {L})'
      ax.plot([p['lambda'] for p in pos], [p['accuracy'] for p in pos],
              '-', marker=marker, color=color, label=label)
      ax0.plot([0] * len(zero), [p['accuracy'] for p in zero], marker,
               color=color)
      if zero and pos:  # Dotted across the break: 0 to the smallest lambda.
        fig.add_artist(patches.ConnectionPatch(
            (0, zero[0]['accuracy']), (pos[0]['lambda'], pos[0]['accuracy']),
            ax0.transData, ax.transData, ls=':', color=color, lw=1.2))
      ys += [p['accuracy'] for p in mine]
    if split:
      for a in (ax0, ax):
        a.axhline(split['accuracy'], color='k', ls='--',
                  label='SplitFed (no compression)' if a is ax else None)
      ys.append(split['accuracy'])
    frame(ax, ys, pad=0.1)
    lams = [p['lambda'] for v in series.values() for p in v if p['lambda']]
    ax.set_xscale('log')
    ax.set_xlim(min(lams) / 2.5, max(lams) * 2.5)
    ax.set_xticks(sorted(set(lams)), [f'{x:g}' for x in sorted(set(lams))])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax0.set_xlim(-1, 1)
    ax0.set_xticks([0], ['0\n(straight-\nthrough)'])
    ax0.set_ylabel('test accuracy')
    ax.set_xlabel('gradient-correction lambda per example (log scale)')
    ax.tick_params(left=False)
    ax0.spines['right'].set_visible(False)
    ax.spines['left'].set_visible(False)
    for a in (ax0, ax):  # Break marks (//) where the x axis is cut.
      a.plot([1 if a is ax0 else 0] * 2, [0, 1], transform=a.transAxes,
             marker=[(-1, -1.5), (1, 1.5)], markersize=8, ls='none',
             color='k', mec='k', mew=1, clip_on=False)
    p = next(iter(fem.values()))
    fig.suptitle(f'FEMNIST-105 after {p["iterations"]} iterations, one seed '
                 f'({p["seed"]}): gradient correction', fontsize=10)
    ax.legend(loc='lower right')
    fig.subplots_adjust(left=0.11, right=0.98, bottom=0.19, top=0.91)
    fig.savefig(out / 'fedlite_fig5_lambda.png', dpi=150)
    plt.close(fig)


def _tables(data: dict, out: pathlib.Path) -> None:
  lines = ['# FedLite experiment tables (generated)', '',
           provenance.markdown_header(data['provenance']),
           'Each run is one `experiments/run_experiment.py` run; its command '
           'and commit are in `fedlite_results.json` (`runs.<name>.command`). '
           'Ratios at phi = 64 bits per float (the paper\'s); accuracy at each '
           'evaluation (iteration: accuracy).', '',
           '| run | q | R | L | lambda per example | act. ratio | upload vs '
           'SplitFed | upload vs FedAvg | accuracy by iteration | final loss '
           '| s/iter | wall s |', '|' + '---|' * 12]
  for name, r in data['runs'].items():
    c = r['communication']
    curve = ', '.join(f'{p["round"]}: {p["accuracy"]:.4f}' for p in r['curve'])
    ratios = ' | '.join(
        f'{c[k]:.1f}' if k in c else '-' for k in (
            'activation_compression', 'upload_compression_vs_splitfed',
            'upload_compression_vs_fedavg'))
    lines.append(
        f'| {name} | {r.get("q", "-")} | {r.get("R", "-")} | '
        f'{r.get("L", "-")} | {r.get("lambda", "-")} | {ratios} | {curve} | '
        f'{r["final"]["loss"]:.4f} | {r["seconds_per_round"]:.2f} | '
        f'{r["wall_seconds"]:.0f} |')
  if 'fig3' in data:
    f3 = data['fig3']
    lines += ['', f'Figure 3: activations of `{f3["checkpoint"]}`.', '',
              '| curve | q | R | L | ratio (phi 64) | relative error |',
              '|' + '---|' * 6]
    lines += [f'| {r["curve"]} | {r["q"]} | {r["R"]} | {r["L"]} | '
              f'{r["compression"]:.1f} | {r["relative_error"]:.4f} |'
              for r in f3['rows']]
  (out / 'fedlite_tables.md').write_text('\n'.join(lines) + '\n')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  out = pathlib.Path(FLAGS.output_dir)
  if FLAGS.report_only:
    _plots(json.loads((out / 'fedlite_results.json').read_text()), out)
    print(f'wrote the plots in {out} from its fedlite_results.json')
    return
  unknown = set(FLAGS.parts) - {'femnist', 'fig3', 'nwp'}
  if unknown:
    raise app.UsageError(f'--parts: unknown {sorted(unknown)}; allowed: '
                         'femnist, fig3, nwp.')
  data = {'provenance': provenance.file_provenance(), 'runs': {}}
  todo = []
  if 'femnist' in FLAGS.parts:
    todo += [(*r, FLAGS.iterations) for r in _split_runs('femnist', FEMNIST)]
    todo.append(('femnist_fedavg', {}, [f'--flagfile={FEDAVG}',
                                        '--num_rounds=30'], None))
  if 'nwp' in FLAGS.parts:
    todo += [(*r, FLAGS.nwp_iterations) for r in _split_runs('nwp', NWP)]
  for name, quantizer, flags_, rounds in todo:
    if not FLAGS.runs or name in FLAGS.runs:
      data['runs'][name] = _train(name, quantizer, flags_, rounds)
  if 'fig3' in FLAGS.parts:
    if 'femnist_splitfed' not in data['runs']:  # Its client model is used.
      data['runs']['femnist_splitfed'] = _train(
          *_split_runs('femnist', FEMNIST)[0], FLAGS.iterations)
    data['fig3'] = _fig3(data['runs'])
  out.mkdir(parents=True, exist_ok=True)
  provenance.write_json(out / 'fedlite_results.json', data)
  _tables(data, out)
  _plots(data, out)
  print(f'wrote {out}/fedlite_results.json, fedlite_tables.md and the plots')


if __name__ == '__main__':
  app.run(main)
