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
"""

from __future__ import annotations

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


def _plots(data: dict, out: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = data['runs']

  def save(ax, name, xlabel, ylabel, title):
    ax.set(xscale='log', xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    ax.figure.savefig(out / name, dpi=120)
    plt.close(ax.figure)

  def acc(r):
    return r['final']['accuracy']

  if 'fig3' in data:
    _, ax = plt.subplots(figsize=(6.5, 4.5))
    rows = data['fig3']['rows']
    for curve in dict.fromkeys(r['curve'] for r in rows):
      pts = sorted((r['compression'], r['relative_error']) for r in rows
                   if r['curve'] == curve)
      ax.plot(*zip(*pts), 'x-' if 'grouped' in curve else 'o:', label=curve)
    save(ax, 'fedlite_fig3.png', 'compression ratio (phi = 64)',
         'relative quantization error', 'FEMNIST client activations')
  for part, name in (('femnist', 'fedlite_fig4.png'), ('nwp',
                                                       'fedlite_nwp.png')):
    fl = [r for n, r in runs.items() if n.startswith(f'{part}_fedlite')
          and r['lambda'] == (LAMBDA if part == 'femnist' else NWP_LAMBDA)]
    if not fl:
      continue
    _, ax = plt.subplots(figsize=(6.5, 4.5))
    for q in sorted({r['q'] for r in fl}):
      pts = sorted((r['communication']['activation_compression'], acc(r))
                   for r in fl if r['q'] == q)
      ax.plot(*zip(*pts), 'o-', label=f'FedLite q={q}, R=1')
    for ref, style in ((f'{part}_splitfed', '--'), ('femnist_fedavg', ':')):
      if ref in runs and ref.startswith(part):
        ax.axhline(acc(runs[ref]), color='k', ls=style, label=ref)
    save(ax, name, 'activation compression ratio (phi = 64)',
         'test accuracy', f'{part}: accuracy vs compression')
  fem = [r for n, r in runs.items() if n.startswith('femnist_fedlite')]
  if fem:
    _, ax = plt.subplots(figsize=(6.5, 4.5))
    for q, L in sorted({(r['q'], r['L']) for r in fem}):
      pts = sorted((max(r['lambda'], 1e-5), acc(r)) for r in fem
                   if (r['q'], r['L']) == (q, L))
      if len(pts) > 1:
        ax.plot(*zip(*pts), 'o-', label=f'q={q}, L={L}')
    save(ax, 'fedlite_fig5_lambda.png', 'lambda per example (0 drawn at '
         '1e-5)', 'test accuracy', 'FEMNIST: gradient correction')


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
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  provenance.write_json(out / 'fedlite_results.json', data)
  _tables(data, out)
  _plots(data, out)
  print(f'wrote {out}/fedlite_results.json, fedlite_tables.md and the plots')


if __name__ == '__main__':
  app.run(main)
