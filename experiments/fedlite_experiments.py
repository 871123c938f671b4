#!/usr/bin/env python3
"""FedLite's experiments (Wang et al. 2022, Figures 3-5) at CPU scale, over
seeds.

  FEDLITE_DATA_DIR=/path/to/data python experiments/fedlite_experiments.py

Every training run is one ``experiments/run_experiment.py`` invocation per
seed (``--seeds``, default 0, 1, 2; same seed = same initialisation and
cohorts across rows), in ``--runs_dir/<run>_seed<s>``: a finished run is
read back, an interrupted one resumes from its checkpoint. Seed-major: all
rows of the first seed before the next seed.

* ``femnist``: SplitFed (``experiments/configs/fedlite_femnist_small.flags``:
  ``--iterations`` 120, SGD 0.1, B = 20, 10 clients) and FedLite on it over
  a (q, L) grid at R = 1, lambda = 1e-3 per example (Figure 4 shape), the
  lambda ablation (0, 2e-4, 1e-2 at 490x; 0 at 1,197x: Figure 5 shape), and
  a FedAvg reference (``emnist_fedavg.flags``, 30 rounds).
* ``fig3``: Figure 3 shape, no training: quantization error vs compression
  ratio of k-means (q = 1), vanilla PQ (R = q) and grouped PQ on real
  activations: per seed, the client part of that seed's ``femnist``
  SplitFed run at iteration 60 (its checkpoint), eval mode, one batch of
  B = 20 from each of the first 10 training clients (the same examples for
  every seed; k-means initialisation from the seed).
* ``nwp``: next-word prediction, SplitFed vs FedLite at three (q, L)
  points (``fedlite_shakespeare_small.flags``: the StackOverflow LSTM on
  word-level Shakespeare, ``--nwp_iterations`` 100, Adam 0.01, lambda 0.016
  per example).

Test accuracy (and loss) every ``--eval_every`` / ``--nwp_eval_every`` (20)
iterations; a run's is the mean of its last 3 evaluations (iterations
80-120, NWP 60-100), rows give mean ± sample std over seeds.

Writes to ``--output_dir`` (default ``experiments/results``):
``fedlite_results.json`` (``provenance``, ``meta``, ``results``: one row per
run name with its ``seeds``, accuracy, exact bits and per-seed ``runs``;
``fig3``; ``comparisons``: per-seed paired differences; a ``check`` that
re-runs FedLite at 490x, lambda 1e-3, seed 0 for ``--check_iterations``,
20), ``fedlite_tables.md``, ``fedlite_fig3.png``, ``fedlite_fig4.png``,
``fedlite_fig5_lambda.png``, ``fedlite_nwp.png``.
``fedlite.md`` is the hand-written reading of the results.
``--report_only`` rewrites the .md and plots from the stored
``fedlite_results.json``.
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
from fedlite_jax.transforms import pq
from fedlite_jax.training import state_io
import provenance
import stats

provenance.define_study_flags('fedlite', (0, 1, 2))
flags.DEFINE_list('parts', ['femnist', 'fig3', 'nwp'], 'Parts to run.')
flags.DEFINE_list('runs', [], 'Only the training runs with these names.')
flags.DEFINE_integer('iterations', 120, 'FEMNIST iterations.', lower_bound=1)
flags.DEFINE_integer('nwp_iterations', 100, 'NWP iterations.', lower_bound=1)
flags.DEFINE_integer('eval_every', 20, 'FEMNIST: evaluate every N '
                     'iterations.', lower_bound=1)
flags.DEFINE_integer('nwp_eval_every', 20, 'NWP: evaluate every N '
                     'iterations.', lower_bound=1)
flags.DEFINE_integer('checkpoint_every', 60, 'Checkpoint every N iterations '
                     '(Figure 3 reads SplitFed\'s at iteration 60; the runner '
                     'keeps the last 2).', lower_bound=0)
flags.DEFINE_integer('check_iterations', 20, 'Iterations of the stored '
                     'check run.', lower_bound=1)
FLAGS = flags.FLAGS

NAME = 'fedlite_results'
FEMNIST = 'experiments/configs/fedlite_femnist_small.flags'
NWP = 'experiments/configs/fedlite_shakespeare_small.flags'
FEDAVG = 'experiments/configs/emnist_fedavg.flags'
FEDAVG_ROUNDS, FEDAVG_EVAL_EVERY = 30, 10
LAMBDA = 1e-3       # per example (= the paper's 5e-5 on a batch-mean loss)
NWP_LAMBDA = 0.016  # per example (1e-3 on a batch-mean loss of 16)
FEMNIST_GRID = ((288, 2, LAMBDA), (1152, 2, LAMBDA), (4608, 2, LAMBDA),
                (1152, 32, LAMBDA), (4608, 32, LAMBDA), (1152, 2, 0.0),
                (1152, 2, 2e-4), (1152, 2, 1e-2), (288, 2, 0.0))
NWP_GRID = ((48, 240), (24, 30), (12, 4))
FIG3_CLIENTS, FIG3_BATCH, FIG3_ITERATION, PHI = 10, 20, 60, 64.0
#: (label, run a, run b): lambda 1e-3 - lambda 0 at the same (q, L).
LAMBDA_PAIRS = (
    ('lambda 1e-3 − lambda 0 at 490x (q = 1,152, L = 2)',
     'femnist_fedlite_q1152_L2_lam0.001', 'femnist_fedlite_q1152_L2_lam0'),
    ('lambda 1e-3 − lambda 0 at 1,197x (q = 288, L = 2)',
     'femnist_fedlite_q288_L2_lam0.001', 'femnist_fedlite_q288_L2_lam0'))
#: FedLite / SplitFed accuracy per seed for this row (490x, lambda 1e-3).
RATIO_RUN = 'femnist_fedlite_q1152_L2_lam0.001'
CHECK_RUN = 'femnist_fedlite_q1152_L2_lam0.001'


def _catalog() -> dict[str, dict]:
  """run name -> part, label, quantizer (q, R, L, lambda per example), base
  flags, iterations and evaluation interval (from the flags)."""
  out = {}
  for part, base, grid, rounds, every in (
      ('femnist', FEMNIST, FEMNIST_GRID, FLAGS.iterations, FLAGS.eval_every),
      ('nwp', NWP, [(q, L, NWP_LAMBDA) for q, L in NWP_GRID],
       FLAGS.nwp_iterations, FLAGS.nwp_eval_every)):
    common = {'part': part, 'rounds': rounds, 'eval_every': min(every, rounds)}
    out[f'{part}_splitfed'] = {
        **common, 'label': 'SplitFed (no compression)', 'q': None, 'R': None,
        'L': None, 'lambda': None, 'flags': [f'--flagfile={base}']}
    for q, L, lam in grid:
      out[f'{part}_fedlite_q{q}_L{L}_lam{lam:g}'] = {
          **common, 'label': f'FedLite q = {q:,}, L = {L}, lambda = {lam:g}',
          'q': q, 'R': 1, 'L': L, 'lambda': lam,
          'flags': [f'--flagfile={base}', '--algorithm=fedlite',
                    f'--num_subvectors={q}', '--num_groups=1',
                    f'--num_centroids={L}', f'--correction_lambda={lam:g}']}
    if part == 'femnist':
      out['femnist_fedavg'] = {
          'part': part, 'rounds': FEDAVG_ROUNDS,
          'eval_every': FEDAVG_EVAL_EVERY,
          'label': f'FedAvg (reference, {FEDAVG_ROUNDS} rounds)', 'q': None,
          'R': None, 'L': None, 'lambda': None,
          'flags': [f'--flagfile={FEDAVG}']}
  return out


def _flags(name: str, seed: int, rounds: int, eval_every: int,
           checkpoint_every: int, out: str) -> list[str]:
  """run_experiment.py flags of run ``name``."""
  return _catalog()[name]['flags'] + [
      f'--num_rounds={rounds}', f'--eval_every={eval_every}',
      f'--seed={seed}', f'--checkpoint_every={checkpoint_every}',
      f'--output_dir={out}', '--noprogress']


def _run_dir(name: str, seed: int) -> str:
  return f'{FLAGS.runs_dir}/{name}_seed{seed}'


def _train(name: str, seed: int) -> dict:
  """One seed of run ``name`` (reused when finished): seeded_run's record
  plus ``loss`` (mean of the last evaluations) where the curve has it."""
  c = _catalog()[name]
  rec = provenance.seeded_run(
      _flags(name, seed, c['rounds'], c['eval_every'],
             FLAGS.checkpoint_every, _run_dir(name, seed)), c['rounds'], seed)
  if any('loss' in r for r in rec['curve']):
    rec['loss'] = stats.tail_mean(rec['curve'], 'loss')
  return rec


def _bits(run: dict) -> dict:
  """Exact bits and compression ratios of one run's ledger."""
  c = run['communication']
  keys = ('activation_compression', 'upload_compression_vs_splitfed',
          'upload_compression', 'total_compression', 'total_upload_bytes',
          'total_download_bytes')
  return {**{k: c.get(k) for k in keys},
          'total_bits': 8 * (c['total_upload_bytes'] +
                             c['total_download_bytes'])}


def _row(name: str, seeds: list[int], runs: dict[int, dict]) -> dict:
  """One row of ``results``: accuracy (and loss) over seeds, seed
  ``seeds[0]``'s bits, whether every seed had the same bits."""
  c = _catalog()[name]
  per_seed = [_bits(runs[s]) for s in seeds]
  same = all(b == per_seed[0] for b in per_seed)
  if not same:
    print(f'{name}: bits differ across seeds {seeds}', flush=True)
  row = {'part': c['part'], 'run': name, 'label': c['label'],
         **{k: c[k] for k in ('q', 'R', 'L', 'lambda')},
         'rounds': runs[seeds[0]]['rounds'], 'seeds': seeds,
         'accuracy': stats.summarize([runs[s]['accuracy'] for s in seeds])}
  if all('loss' in runs[s] for s in seeds):
    row['loss'] = stats.summarize([runs[s]['loss'] for s in seeds])
  return {**row, 'bits': per_seed[0], 'same_bits_every_seed': same,
          'total_bits_by_seed': [b['total_bits'] for b in per_seed],
          'runs': [runs[s] for s in seeds]}


def _fig3(seeds: list[int], split: dict[int, dict]) -> dict:
  """Quantization error vs ratio on each seed's SplitFed activations.

  Args:
    seeds: the seeds whose ``femnist_splitfed`` runs are in ``split``.
    split: seed -> that run's record (its checkpoint at iteration
      ``min(60, rounds)`` is read from ``--runs_dir``).

  Returns:
    ``rows`` (one per quantizer: relative error ||Z - Z~||_F^2 / ||Z||_F^2
    as ``stats.summarize`` over seeds), the checkpoints and commands read.

  Raises:
    FileNotFoundError: a seed's checkpoint is missing.
  """
  t0 = time.perf_counter()
  model = models.create_emnist_cnn(62)
  train, _, _ = datasets.load_federated_data('emnist', None)
  ids = list(train.client_ids())[:FIG3_CLIENTS]
  batches = []  # The same examples for every seed.
  for i, (_, cds) in enumerate(train.get_clients(ids)):
    ex = cds.all_examples()
    pick = np.random.default_rng(i).choice(len(ex['y']), FIG3_BATCH,
                                           replace=len(ex['y']) < FIG3_BATCH)
    batches.append({k: v[pick] for k, v in ex.items()})
  configs = [('k-means (q=1)', 1, 1, L) for L in (2, 4, 8, 16, 20)]
  configs += [(f'vanilla PQ (q=R={q})', q, q, L) for q in (288, 1152, 4608)
              for L in (2, 4, 8, 16)]
  configs += [(f'grouped PQ (q=4608, R={R})', 4608, R, L)
              for R in (2304, 1152, 384, 1) for L in (2, 4, 8, 16, 32)]
  configs += [('grouped PQ (q=1152, R=1)', 1152, 1, L)
              for L in (2, 4, 8, 16, 32)]
  fns = [jax.jit(jax.vmap(lambda x, k, q=q, R=R, L=L: pq.grouped_pq(
      x, k, q, R, L))) for _, q, R, L in configs]
  errors, ckpts, d = [], [], None
  for seed in seeds:
    it = min(FIG3_ITERATION, split[seed]['rounds'])
    ckpts_dir = (provenance.REPO / _run_dir('femnist_splitfed', seed) /
                 'checkpoints')
    # checkpoints/<it> (orbax), or the ckpt_<it>.msgpack of a finished run
    # written by fedlite_jax 644e428 or before (studies reuse such runs).
    ckpt = ckpts_dir / str(it)
    if not ckpt.exists():
      ckpt = ckpts_dir / f'ckpt_{it:08d}.msgpack'
    if not ckpt.exists():
      raise FileNotFoundError(
          f'{ckpts_dir / str(it)}: Figure 3 reads SplitFed\'s checkpoint at '
          f'iteration {it}; rerun that run with a --checkpoint_every '
          f'dividing {it} (the runner keeps its last 2 checkpoints).')
    params = state_io.load_init_params(
        ckpt, model.model.init(jax.random.PRNGKey(0))).params
    z = np.stack([np.asarray(model.client_apply(params['client'], b))
                  for b in batches])  # float32 [clients, B, d]
    d = z.shape[-1]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(batches))
    errors.append([float(np.mean(fn(z, keys).relative_error)) for fn in fns])
    ckpts.append(str(ckpt.relative_to(provenance.REPO))
                 if provenance.REPO in ckpt.parents else str(ckpt))
  rows = [{'curve': label, 'q': q, 'R': R, 'L': L,
           'compression': pq.pq_compression_ratio(d, FIG3_BATCH, q, R, L,
                                                  PHI),
           'relative_error': stats.summarize([e[i] for e in errors])}
          for i, (label, q, R, L) in enumerate(configs)]
  return {'iteration': min(FIG3_ITERATION, split[seeds[0]]['rounds']),
          'seeds': seeds, 'clients': FIG3_CLIENTS, 'batch_size': FIG3_BATCH,
          'checkpoints': ckpts,
          'splitfed_commands': [split[s]['command'] for s in seeds],
          'rows': rows, 'wall_seconds': time.perf_counter() - t0}


def _comparisons(results: list[dict]) -> list[dict]:
  """Per-seed paired differences (``stats.paired``) of each FedLite row -
  SplitFed (accuracy; NWP also loss), of ``LAMBDA_PAIRS``, and FedLite /
  SplitFed accuracy per seed of ``RATIO_RUN`` (rows present)."""
  rows = {r['run']: r for r in results}

  def per_seed(name, key):
    return {x['seed']: x[key] for x in rows[name]['runs']}

  out = []
  for part in ('femnist', 'nwp'):
    split = f'{part}_splitfed'
    if split not in rows:
      continue
    for r in results:
      if r['part'] != part or r['q'] is None:
        continue
      for key in ('accuracy', 'loss') if part == 'nwp' else ('accuracy',):
        if key in r and key in rows[split]:
          out.append({'label': f'{r["label"]} − SplitFed', 'a': r['run'],
                      'b': split, 'metric': key, 'kind': 'difference',
                      **stats.paired(per_seed(r['run'], key),
                                     per_seed(split, key))})
  for label, a, b in LAMBDA_PAIRS:
    if a in rows and b in rows:
      out.append({'label': label, 'a': a, 'b': b, 'metric': 'accuracy',
                  'kind': 'difference',
                  **stats.paired(per_seed(a, 'accuracy'),
                                 per_seed(b, 'accuracy'))})
  if RATIO_RUN in rows and 'femnist_splitfed' in rows:
    a = per_seed(RATIO_RUN, 'accuracy')
    b = per_seed('femnist_splitfed', 'accuracy')
    common = sorted(set(a) & set(b))
    out.append({'label': f'{rows[RATIO_RUN]["label"]} / SplitFed',
                'a': RATIO_RUN, 'b': 'femnist_splitfed', 'metric': 'accuracy',
                'kind': 'ratio', 'seeds': common,
                **stats.summarize([a[s] / b[s] for s in common])})
  return out


def _run_points(data: dict) -> dict[str, dict]:
  """name -> q, L, lambda per example, ratio, accuracy (mean, and its std
  over seeds), iterations of each stored row."""
  return {r['run']: {
      'q': r['q'], 'L': r['L'], 'lambda': r['lambda'],
      'ratio': r['bits']['activation_compression'],
      'accuracy': r['accuracy']['mean'], 'std': r['accuracy']['std'],
      'iterations': r['rounds']} for r in data['results']}


def _seed_text(data: dict) -> str:
  """'mean ± std over 3 seeds'."""
  return f'mean ± std over {len(data["results"][0]["seeds"])} seeds'


def _error(r: dict) -> tuple[float, float]:
  """A Figure 3 row's relative error: (mean, std over seeds)."""
  return r['relative_error']['mean'], r['relative_error']['std']


def _plots(data: dict, out: pathlib.Path) -> list[str]:
  """fedlite_fig3/fig4/fig5_lambda/nwp.png from ``data`` (the .json's):
  means with error bars of ± one sample std over seeds. Returns the names
  of the files written (a figure whose rows are absent is not drawn)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  plt.rcParams.update({'font.size': 9, 'axes.titlesize': 10,
                       'legend.fontsize': 8})
  pts = _run_points(data)
  seeds = _seed_text(data)
  written = []

  def draw(ax, xs, ys, es, fmt, **kw):
    """A line, with error bars where there is a spread over seeds."""
    if es is None or not any(es):
      return ax.plot(xs, ys, fmt, **kw)
    return ax.errorbar(xs, ys, yerr=es, fmt=fmt, capsize=3, **kw)

  def spans(ps):
    """Low and high ends (± std) of points ``ps``."""
    return ([p['accuracy'] - (p['std'] or 0) for p in ps] +
            [p['accuracy'] + (p['std'] or 0) for p in ps])

  def splitfed(axes, p, label=True):
    """SplitFed's mean (dashed) and ± one std (band)."""
    for a in axes:
      a.axhline(p['accuracy'], color='k', ls='--',
                label='SplitFed (no compression)' if label and a is axes[-1]
                else None)
      if p['std']:
        a.axhspan(p['accuracy'] - p['std'], p['accuracy'] + p['std'],
                  color='k', alpha=0.08, lw=0)

  def annotate(ax, xs, ys, texts, bars=False):
    """Labels each point of a line on the side its segments leave free;
    beside the point (clear of its error bar) when ``bars``."""
    for i, (x, y, text) in enumerate(zip(xs, ys, texts)):
      nb = [(j - i, ys[j]) for j in (i - 1, i + 1) if 0 <= j < len(ys)]
      if bars:  # Right of the point (left of the last), away from the line.
        last = i == len(xs) - 1
        up = ys[i - 1 if last else i + 1] < y if len(ys) > 1 else True
        kw = {'xytext': (-5 if last else 5, 3 if up else -3),
              'ha': 'right' if last else 'left',
              'va': 'bottom' if up else 'top'}
      elif all(v < y for _, v in nb):
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
    span = hi - lo if hi > lo else 0.01
    ax.set_ylim(lo - pad * span, hi + pad * span)

  def ratio_axis(ax, xs, at_points=False):
    """Log ratio axis framed on ``xs``; ticks at ``xs`` if ``at_points``."""
    ax.set_xscale('log')
    ax.set_xlim(min(xs) / 1.6, max(xs) * 1.6)
    if at_points:
      ax.set_xticks(sorted(set(xs)))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(
        lambda x, _: f'{x:,.0f}x' if x >= 1 else f'{x:g}x'))

  def save(fig, name):
    fig.tight_layout()
    fig.savefig(out / name, dpi=150)
    plt.close(fig)
    written.append(name)

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
      errs = [_error(r) for r in mine]
      draw(ax, [r['compression'] for r in mine], [e[0] for e in errs],
           [e[1] for e in errs], style,
           label=label.format(q=mine[0]['q'], R=mine[0]['R']))
    for r in (mine[0], mine[-1]):  # L at the ends of the last curve.
      ax.annotate(f'L = {r["L"]}', (r['compression'], _error(r)[0]),
                  textcoords='offset points', xytext=(6, -2), ha='left',
                  va='top', fontsize=7.5)
    ratio_axis(ax, [r['compression'] for r in rows])
    ax.set_ylim(0, None)
    ax.set(xlabel='activation compression ratio (phi = 64 bits per float)',
           ylabel='relative quantization error\n'
                  '||Z - Z~||$_F^2$ / ||Z||$_F^2$')
    ax.set_title(f'FEMNIST client activations (SplitFed client model, '
                 f'{seeds}):\nerror vs compression')
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
    ys = spans(fem.values())
    for L, style in ((32, 's-'), (2, 'o-')):
      mine = sorted((p for p in fem.values() if p['L'] == L),
                    key=lambda p: p['ratio'])
      if not mine:
        continue
      xs, acc = [p['ratio'] for p in mine], [p['accuracy'] for p in mine]
      draw(ax, xs, acc, [p['std'] for p in mine], style,
           label=f'FedLite, L = {L} codewords (R = 1)')
      annotate(ax, xs, acc, [f'q = {p["q"]:,}' for p in mine],
               bars=any(p['std'] for p in mine))
    if split:
      splitfed([ax], split)
      ys += spans([split])
    ratio_axis(ax, [p['ratio'] for p in fem.values()], at_points=True)
    frame(ax, ys, pad=0.15)
    p = next(iter(fem.values()))
    ax.set(xlabel='activation compression ratio (phi = 64)',
           ylabel='test accuracy',
           title=f'FEMNIST-105 after {p["iterations"]} iterations, {seeds},'
                 f'\nlambda = {LAMBDA:g} per example')
    ax.legend(loc='lower left')
    save(fig, 'fedlite_fig4.png')

  nwp = fedlite('nwp', NWP_LAMBDA)
  if nwp:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    mine = sorted(nwp.values(), key=lambda p: p['ratio'])
    xs, acc = [p['ratio'] for p in mine], [p['accuracy'] for p in mine]
    draw(ax, xs, acc, [p['std'] for p in mine], 'o-',
         label=f'FedLite (R = 1, lambda = {NWP_LAMBDA:g} per example)')
    annotate(ax, xs, acc, [f'q = {p["q"]}, L = {p["L"]}' for p in mine],
             bars=any(p['std'] for p in mine))
    ys = spans(mine)
    if 'nwp_splitfed' in pts:
      splitfed([ax], pts['nwp_splitfed'])
      ys += spans([pts['nwp_splitfed']])
    ratio_axis(ax, xs, at_points=True)
    frame(ax, ys, pad=0.2)
    ax.set(xlabel='activation compression ratio (phi = 64)',
           ylabel='test next-word accuracy\n(PAD, EOS, OOV excluded)',
           title=f'Shakespeare next-word prediction after '
                 f'{mine[0]["iterations"]} iterations,\n{seeds}')
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
      draw(ax, [p['lambda'] for p in pos], [p['accuracy'] for p in pos],
           [p['std'] for p in pos], '-', marker=marker, color=color,
           label=label)
      draw(ax0, [0] * len(zero), [p['accuracy'] for p in zero],
           [p['std'] for p in zero], marker, color=color)
      if zero and pos:  # Dotted across the break: 0 to the smallest lambda.
        fig.add_artist(patches.ConnectionPatch(
            (0, zero[0]['accuracy']), (pos[0]['lambda'], pos[0]['accuracy']),
            ax0.transData, ax.transData, ls=':', color=color, lw=1.2))
      ys += spans(mine)
    if split:
      splitfed([ax0, ax], split)
      ys += spans([split])
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
    fig.suptitle(f'FEMNIST-105 after {p["iterations"]} iterations, '
                 f'{seeds}: gradient correction', fontsize=10)
    ax.legend(loc='lower right')
    fig.subplots_adjust(left=0.11, right=0.98, bottom=0.19, top=0.91)
    fig.savefig(out / 'fedlite_fig5_lambda.png', dpi=150)
    plt.close(fig)
    written.append('fedlite_fig5_lambda.png')
  return written


#: Caption under each figure of ``fedlite_tables.md``.
CAPTIONS = {
    'fedlite_fig3.png':
        'Figure 3 shape. Relative quantization error ||Z − Z~||²_F / '
        '||Z||²_F against the activation compression ratio (phi = 64 bits '
        'per float) of k-means on whole vectors (q = 1), vanilla PQ (R = q) '
        'and grouped PQ (R codebook groups), points at L = 2 ... 32 '
        'codewords. Z: the client activations of each seed\'s SplitFed '
        'model at iteration {iteration}, one batch of 20 from each of the '
        'first 10 training clients. Mean over seeds, error bars ± one '
        'sample std (model and k-means initialisation differ per seed).',
    'fedlite_fig4.png':
        'Figure 4 shape. FEMNIST-105 test accuracy (mean of each run\'s '
        'last evaluations) against the activation compression ratio, '
        'FedLite at R = 1 and lambda = 1e-3 per example, one line per L '
        '(points labelled by q); dashed: SplitFed (shaded: ± one std). '
        'Mean over seeds, error bars ± one sample std.',
    'fedlite_fig5_lambda.png':
        'Figure 5 shape. FEMNIST-105 test accuracy against the '
        'gradient-correction lambda per example (log scale) at fixed '
        '(q, L), one line per compression ratio; lambda = 0 (the '
        'straight-through gradient) on its own axis segment, dotted across '
        'the break; dashed: SplitFed (shaded: ± one std). Mean over seeds, '
        'error bars ± one sample std.',
    'fedlite_nwp.png':
        'Next-word prediction on Shakespeare. Test accuracy (PAD, EOS and '
        'OOV excluded) against the activation compression ratio, FedLite at '
        'three (q, L) points, R = 1, lambda = 0.016 per example; dashed: '
        'SplitFed (shaded: ± one std). Mean over seeds, error bars ± one '
        'sample std.',
}


def _x(ratio: float | None) -> str:
  """A compression ratio: '1,197x', '25.4x'; '-' when absent."""
  if ratio is None:
    return '-'
  return f'{ratio:,.0f}x' if ratio >= 100 else f'{ratio:.1f}x'


def _mbit(r: dict) -> str:
  """Total bits in Mbit; mean (min–max) over seeds and † when they differ."""
  b = [v / 1e6 for v in r['total_bits_by_seed']]
  if r['same_bits_every_seed']:
    return f'{b[0]:,.1f}'
  return f'{sum(b) / len(b):,.1f} ({min(b):,.1f}–{max(b):,.1f}) †'


def _difference(c: dict) -> tuple[str, str]:
  """(mean ± std with sign agreement, per-seed values) of a comparison."""
  if c['kind'] == 'ratio':
    return (stats.fmt(c, 3), ', '.join(
        f'{s}: {v:.3f}' for s, v in zip(c['seeds'], c['values'])))
  scale, unit, digits = ((100, 'points', 1) if c['metric'] == 'accuracy'
                         else (1, 'loss', 3))
  text = (f'{c["mean"] * scale:+.{digits}f} ± {c["std"] * scale:.{digits}f} '
          f'{unit}, same sign in {c["agree"]}/{c["n"]} seeds')
  return text, ', '.join(f'{s}: {d * scale:+.{digits}f}'
                         for s, d in zip(c['seeds'], c['diffs']))


def _tables(data: dict, out: pathlib.Path, figures: list[str]) -> None:
  """Writes ``fedlite_tables.md``: every number from ``data``."""
  meta, results = data['meta'], data['results']
  seeds = ', '.join(map(str, results[0]['seeds']))

  def tail(part):
    r = next((r for r in results if r['part'] == part and
              r['run'] != 'femnist_fedavg'), None)
    if r is None:
      return ''
    its = [p['round'] for p in r['runs'][0]['curve']][
        -meta['tail_evaluations']:]
    return f'the evaluations at iterations {", ".join(map(str, its))}'

  runs = {r['run'] for r in results}
  parts = []
  if any(r['part'] == 'femnist' and r['run'] != 'femnist_fedavg'
         for r in results):
    parts.append(
        f'FEMNIST-105: {meta["iterations"]} iterations of `{FEMNIST}` (10 '
        'clients per iteration, B = 20, SGD 0.1 for both parts), test '
        f'accuracy on all test examples every {meta["eval_every"]} '
        f'iterations; a run\'s accuracy averages {tail("femnist")}.')
  if 'femnist_fedavg' in runs:
    parts.append(f'FedAvg: {meta["fedavg_rounds"]} rounds of `{FEDAVG}`.')
  if any(r['part'] == 'nwp' for r in results):
    parts.append(
        f'Next-word prediction: {meta["nwp_iterations"]} iterations of '
        f'`{NWP}` (10 clients x 16 sequences of 20 words, Adam 0.01), '
        f'evaluated every {meta["nwp_eval_every"]}; a run\'s accuracy and '
        f'loss average {tail("nwp")}.')
  lines = [
      '# FedLite experiments over seeds (Figures 3-5 shape, generated)', '',
      provenance.markdown_header(data['provenance']),
      ' '.join(parts) + f' Seeds {seeds} (same seed = same initialisation '
      'and cohorts across rows). A run\'s accuracy (and loss) is the mean of '
      f'its last {meta["tail_evaluations"]} evaluations, then mean ± sample '
      'std over seeds. Ratios at phi = 64 bits per float (the paper\'s). '
      'Each run\'s `experiments/run_experiment.py` command and commit are '
      f'in `{NAME}.json` (`results[i].runs[j]`). Small CPU-scale runs, not '
      'converged.', '']
  for part, title in (('femnist', 'FEMNIST-105 (Figures 4 and 5 shape)'),
                      ('nwp', 'Next-word prediction on Shakespeare')):
    rows = [r for r in results if r['part'] == part]
    if not rows:
      continue
    lines += [f'## {title}', '',
              '| row | activation ratio | upload vs SplitFed | total bits '
              '(Mbit) | accuracy (%) | loss |', '|---|---|---|---|---|---|']
    for r in rows:
      b = r['bits']
      loss = stats.fmt(r['loss'], 3) if 'loss' in r else '-'
      lines.append(
          f'| {r["label"]} | {_x(b["activation_compression"])} | '
          f'{_x(b["upload_compression_vs_splitfed"])} | {_mbit(r)} | '
          f'{stats.fmt(r["accuracy"], 1, 100)} | {loss} |')
    lines.append('')
  differ = [r['label'] for r in results if not r['same_bits_every_seed']]
  lines += [
      'Activation ratio: 32-bit activations against FedLite\'s codewords and '
      'codes per client-iteration; upload vs SplitFed: all client uploads '
      '(activations and labels) against SplitFed\'s; total bits: upload + '
      'download of a whole run, from the runs\' ledgers. ' + (
          f'† Bits differ across seeds ({"; ".join(differ)}): ratios of '
          f'seed {results[0]["seeds"][0]}, bits as mean (min–max).'
          if differ else 'Bits and ratios are the same for every seed.'),
      '']
  if data['comparisons']:
    lines += ['## Comparisons (paired by seed)', '',
              '| comparison (a − b; ratio a / b) | mean ± std over seeds | '
              'per seed |', '|---|---|---|']
    for c in data['comparisons']:
      text, per = _difference(c)
      what = ' (loss)' if c['metric'] == 'loss' else ''
      lines.append(f'| {c["label"]}{what} | {text} | {per} |')
    lines += ['', 'Differences: per seed, the two rows\' accuracies (in '
              'points) or losses; mean ± sample std over seeds, and how many '
              'seeds share the sign of the mean. Ratio: FedLite\'s accuracy '
              'over SplitFed\'s of the same seed.', '']
  if 'fig3' in data:
    f3 = data['fig3']
    lines += ['## Quantization error (Figure 3 shape)', '',
              f'Activations of the SplitFed client model at iteration '
              f'{f3["iteration"]} of each seed ('
              + ', '.join(f'`{c}`' for c in f3['checkpoints']) + '); '
              'relative error ||Z − Z~||²_F / ||Z||²_F, mean ± std over '
              'seeds.', '',
              '| method | q | R | L | ratio (phi 64) | relative error |',
              '|---|---|---|---|---|---|']
    lines += [f'| {r["curve"]} | {r["q"]} | {r["R"]} | {r["L"]} | '
              f'{_x(r["compression"])} | {stats.fmt(r["relative_error"], 4)} '
              '|' for r in f3['rows']]
    lines.append('')
  if figures:
    lines += ['## Figures', '']
  for name in figures:
    caption = CAPTIONS[name].format(
        iteration=data.get('fig3', {}).get('iteration'))
    lines += [f'![{name}]({name})', '', caption, '']
  (out / 'fedlite_tables.md').write_text(
      provenance.results_md(lines, data.get('check', {})))


def _report(data: dict, out: pathlib.Path) -> None:
  """Rewrites ``fedlite_tables.md`` and the plots from ``data`` (and stores
  its ``comparisons``)."""
  data['comparisons'] = _comparisons(data['results'])
  _tables(data, out, _plots(data, out))


def main(argv):
  started = provenance.start_study(argv, NAME, _report)
  if started is None:
    print(f'rewrote the report in {FLAGS.output_dir} from {NAME}.json')
    return
  seeds, out = started
  unknown = set(FLAGS.parts) - {'femnist', 'fig3', 'nwp'}
  if unknown:
    raise app.UsageError(f'--parts: unknown {sorted(unknown)}; allowed: '
                         'femnist, fig3, nwp.')
  catalog = _catalog()
  unknown = set(FLAGS.runs) - set(catalog)
  if unknown:
    raise app.UsageError(f'--runs: unknown {sorted(unknown)}; runs: '
                         f'{", ".join(catalog)}.')
  names = [n for n, c in catalog.items() if c['part'] in FLAGS.parts and
           (not FLAGS.runs or n in FLAGS.runs)]
  if 'fig3' in FLAGS.parts and 'femnist_splitfed' not in names:
    names.insert(0, 'femnist_splitfed')  # Its client models are read.
  if not names:
    raise app.UsageError(f'--parts={",".join(FLAGS.parts)} with --runs='
                         f'{",".join(FLAGS.runs)} selects no run.')
  data = {'provenance': provenance.file_provenance(),
          'meta': {'seeds': seeds, 'parts': FLAGS.parts, 'runs': names,
                   'iterations': FLAGS.iterations,
                   'nwp_iterations': FLAGS.nwp_iterations,
                   'fedavg_rounds': FEDAVG_ROUNDS,
                   'eval_every': FLAGS.eval_every,
                   'nwp_eval_every': FLAGS.nwp_eval_every,
                   'checkpoint_every': FLAGS.checkpoint_every,
                   'check_iterations': FLAGS.check_iterations,
                   'flagfiles': {'femnist': FEMNIST, 'nwp': NWP,
                                 'fedavg': FEDAVG},
                   'lambda_per_example': LAMBDA,
                   'nwp_lambda_per_example': NWP_LAMBDA, 'phi': PHI,
                   'tail_evaluations': stats.TAIL}}
  runs = provenance.seed_major(names, seeds, _train)
  data['results'] = [_row(n, seeds, runs[n]) for n in names]
  if 'fig3' in FLAGS.parts:
    data['fig3'] = _fig3(seeds, runs['femnist_splitfed'])
  data['check'] = provenance.check_record(
      _flags(CHECK_RUN, 0, FLAGS.check_iterations, FLAGS.check_iterations,
             0, f'{FLAGS.runs_dir}/check'),
      f'{CHECK_RUN} seed 0, {FLAGS.check_iterations} iterations')
  provenance.write_study(out, NAME, data, _report)


if __name__ == '__main__':
  app.run(main)
