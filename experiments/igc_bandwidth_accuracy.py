#!/usr/bin/env python3
"""Bandwidth vs accuracy on FEMNIST-105: intrinsic gradient compression and
baselines (the shape of Melas-Kyriazi & Wang 2022, Figure 1 / Table 2).

  FEDLITE_DATA_DIR=/path/to/data python experiments/igc_bandwidth_accuracy.py

Runs, in-process through ``fedlite_jax.training.run`` (each run is also a
flagfile in ``experiments/configs/igc_*.flags`` for
``experiments/run_experiment.py``): uncompressed SGD (one local step per
round), FedAvg with 2 and 5 local steps (for R/2 and R/5 rounds: the same
number of examples as R one-step rounds), local Top-K, FetchSGD, and static /
time-varying / K-subspace / K-subspace + time-varying intrinsic compression at
several d. Every method takes one local SGD step per round on a batch of 20
examples per client (10 clients per round), the paper's protocol.

Writes ``experiments/results/igc_femnist.{md,png,json}``; per-run outputs
(metrics.jsonl, summary.json, checkpoints) go to ``--runs_dir`` and a rerun
resumes finished runs from their final checkpoint instead of retraining.

Compression columns: ``up`` / ``down`` / ``total`` from the communication
ledger (against 32 bits x D per client-round each way; total = 2 / (1/up +
1/down)); ``vs SGD`` = total bits of the uncompressed-SGD run / this run's
total bits, at the same number of examples processed (equals ``total`` for
one-step methods; s for FedAvg with s local steps and R/s rounds -- the
paper's FedAvg accounting).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import time

from absl import app
from absl import flags
from absl import logging

import fedlite_jax  # noqa: F401  (FedJAX compatibility first)
import jax
import numpy as np

from fedlite_jax.training import algo_baselines  # noqa: F401  (registers)
from fedlite_jax.training import algo_igc  # noqa: F401  (registers)
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run

_REPO = pathlib.Path(__file__).resolve().parent.parent

flags.DEFINE_integer('rounds', 100, 'R: rounds of the one-step methods.')
flags.DEFINE_integer('seed', 0, 'Run seed (sampling, init, subspaces).')
flags.DEFINE_float('client_lr', 0.3, 'Client SGD learning rate (all runs).')
flags.DEFINE_string('runs_dir', str(_REPO / 'runs' / 'igc_femnist'),
                    'Per-run output directories.')
flags.DEFINE_string('results_dir', str(_REPO / 'experiments' / 'results'),
                    'Where igc_femnist.{md,png,json} go.')
flags.DEFINE_string('data_dir', None, 'Data directory (else FEDLITE_DATA_DIR).')
flags.DEFINE_list('only', [], 'Run only these labels (default: all).')
flags.DEFINE_integer('eval_every', 25, 'Evaluate every N rounds.')
flags.DEFINE_bool('report_only', False,
                  'Rewrite the .md/.png from the saved .json (no training).')
FLAGS = flags.FLAGS

_NOTES_MARKER = '<!-- hand-written findings below: kept when regenerating -->'


@dataclasses.dataclass(frozen=True)
class Setup:
  """One run: a label, the algorithm and its options, a round divisor."""
  label: str
  family: str
  algorithm: str
  options: dict
  round_divisor: int = 1


def setups() -> list[Setup]:
  s = []
  s.append(Setup('SGD (uncompressed)', 'uncompressed', 'sgd', {}))
  for steps in (2, 5):
    s.append(Setup(f'FedAvg ({steps} local steps)', 'fedavg', 'sgd',
                   {'local_steps': steps}, round_divisor=steps))
  for k in (12_000, 60_000):
    s.append(Setup(f'Local Top-K (k={k:,})', 'topk', 'topk',
                   {'topk_k': k}))
  s.append(Setup('FetchSGD (5x50,000, k=12,000)', 'fetchsgd', 'fetchsgd',
                 {'sketch_rows': 5, 'sketch_cols': 50_000,
                  'topk_k': 12_000}))
  for d in (1024, 4096, 16384, 65536):
    s.append(Setup(f'IGC static (d={d:,})', 'igc_static', 'igc_static',
                   {'intrinsic_dim': d}))
  for d in (1024, 4096):
    s.append(Setup(f'IGC time-varying (d={d:,})', 'igc_time_varying',
                   'igc_time_varying', {'intrinsic_dim': d}))
  s.append(Setup('IGC K-subspace (d=4,096, K=8)', 'igc_k_subspace',
                 'igc_k_subspace', {'intrinsic_dim': 4096,
                                    'num_subspaces': 8}))
  s.append(Setup('IGC K-subspace + TV (d=1,024, K=4)',
                 'igc_k_subspace_time_varying',
                 'igc_k_subspace_time_varying',
                 {'intrinsic_dim': 1024, 'num_subspaces': 4}))
  return s


def _slug(label: str) -> str:
  """'IGC static (d=4,096)' -> 'igc_static_d4096'."""
  out = ''.join(c if c.isalnum() else ('' if c in ',=' else '_')
                for c in label.lower())
  while '__' in out:
    out = out.replace('__', '_')
  return out.strip('_')


def _run_one(setup: Setup) -> dict:
  rounds = FLAGS.rounds // setup.round_divisor
  config = RunConfig(
      task='emnist', algorithm=setup.algorithm, num_rounds=rounds,
      clients_per_round=10, client_batch_size=20, client_optimizer='sgd',
      client_lr=FLAGS.client_lr, server_optimizer='sgd', server_lr=1.0,
      eval_every=min(FLAGS.eval_every, rounds), eval_num_clients=0,
      seed=FLAGS.seed, data_dir=FLAGS.data_dir,
      output_dir=str(pathlib.Path(FLAGS.runs_dir) / _slug(setup.label)),
      checkpoint_every=0, progress=False, options=dict(setup.options))
  out_dir = pathlib.Path(config.output_dir)
  wall_file = out_dir / 'wall_seconds.json'
  t0 = time.perf_counter()
  summary = run(config)  # Resumes a finished run from its last checkpoint.
  wall = time.perf_counter() - t0
  if wall_file.exists() and json.loads(wall_file.read_text())['rounds'] == \
      rounds:
    wall = json.loads(wall_file.read_text())['wall_seconds']  # Trained before.
  else:
    wall_file.write_text(json.dumps({'rounds': rounds, 'wall_seconds': wall}))
  comm = summary['communication']
  bits = 8 * (comm['total_upload_bytes'] + comm['total_download_bytes'])
  return {
      'label': setup.label, 'family': setup.family,
      'algorithm': setup.algorithm, 'options': setup.options,
      'rounds': rounds, 'seed': FLAGS.seed,
      'accuracy': summary['final_eval']['accuracy'],
      'loss': summary['final_eval']['loss'],
      'upload_compression': comm['upload_compression'],
      'download_compression': comm['download_compression'],
      'total_compression': comm['total_compression'],
      'total_bits': bits,
      'seconds_per_round': summary['seconds_per_round'],
      'wall_seconds': wall,
      'curve': [json.loads(line) for line in
                (pathlib.Path(config.output_dir) / 'metrics.jsonl')
                .read_text().splitlines()],
  }


def _fmt(x: float) -> str:
  if not np.isfinite(x):
    return str(x)
  if x >= 100:
    return f'{x:,.0f}'
  return f'{x:.3g}'


def _write_table(results: list[dict], path: pathlib.Path, meta: dict,
                 machine: str, total_wall: float) -> None:
  base = next((r for r in results if r['family'] == 'uncompressed'), None)
  lines = [
      '# Intrinsic gradient compression on FEMNIST-105: bandwidth vs accuracy',
      '',
      'Generated by `experiments/igc_bandwidth_accuracy.py` '
      f'(`--rounds={meta["rounds"]} --seed={meta["seed"]} '
      f'--client_lr={meta["client_lr"]}`). Task `emnist` on FEMNIST-105 (105 '
      'real writers, 62 classes; FedJAX EMNIST CNN, D = 1,206,590), 10 '
      'clients per round, one local SGD step on a batch of 20 examples per '
      'client per round (the paper\'s protocol), server SGD at rate 1, test '
      'accuracy on all 1,685 test examples after the last round. One seed: '
      'differences of ~1 point are within run-to-run noise.',
      '',
      f'Machine: {machine}. Total wall time {total_wall / 60:.1f} min '
      '(includes compilation and evaluation).',
      '',
      '| method | rounds | test acc. | test loss | up | down | total | vs SGD '
      '| s/round | wall s |',
      '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in results:
    vs = base['total_bits'] / r['total_bits'] if base else float('nan')
    lines.append(
        f"| {r['label']} | {r['rounds']} | {100 * r['accuracy']:.1f}% | "
        f"{r['loss']:.3f} | {_fmt(r['upload_compression'])}x | "
        f"{_fmt(r['download_compression'])}x | "
        f"{_fmt(r['total_compression'])}x | {_fmt(vs)}x | "
        f"{r['seconds_per_round']:.2f} | {r['wall_seconds']:.0f} |")
  by_label = {r['label']: r for r in results}
  pairs = []
  for r in results:
    if r['family'] == 'igc_time_varying':
      d = r['options']['intrinsic_dim']
      st = by_label.get(f'IGC static (d={d:,})')
      if st:
        pairs.append(
            f'- d = {d:,}: time-varying {100 * r["accuracy"]:.1f}% '
            f'(total {_fmt(r["total_compression"])}x) vs static '
            f'{100 * st["accuracy"]:.1f}% (total '
            f'{_fmt(st["total_compression"])}x).')
  if pairs:
    lines += ['', '## Time-varying vs static at small d', ''] + pairs
  lines += [
      '',
      'Columns: `up` / `down` / `total`: compression from the communication '
      'ledger against 32 bits x D per client-round each way (total = 2 / '
      '(1/up + 1/down), Table 2\'s definition). `vs SGD`: bits of the '
      'uncompressed-SGD run / bits of this run, at equal examples processed '
      '(FedAvg with s local steps runs R/s rounds). Top-K upload counts 32 + '
      'ceil(log2 D) = 53 bits per kept entry (value + index); Top-K and '
      'FetchSGD download the weights changed since the client last '
      'participated (FetchSGD\'s accounting); IGC bits follow Table 1 '
      '(static d/d, time-varying d/2d, K-subspace d(+index)/dK). '
      '`s/round`: mean wall time of a round (client work + server update; '
      'the first round includes compilation).',
  ]
  text = '\n'.join(lines) + '\n'
  if path.exists() and _NOTES_MARKER in path.read_text():
    # Keep hand-written findings below the marker across regenerations.
    text += '\n' + _NOTES_MARKER + path.read_text().split(_NOTES_MARKER, 1)[1]
  path.write_text(text)


def _plot(results: list[dict], path: pathlib.Path, meta: dict) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  base = next((r for r in results if r['family'] == 'uncompressed'), None)
  styles = {
      'uncompressed': ('k', '*'), 'fedavg': ('tab:gray', 's'),
      'topk': ('tab:orange', 'v'), 'fetchsgd': ('tab:red', '^'),
      'igc_static': ('tab:blue', 'o'), 'igc_time_varying': ('tab:green', 'D'),
      'igc_k_subspace': ('tab:purple', 'P'),
      'igc_k_subspace_time_varying': ('tab:brown', 'X'),
  }
  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  for family, (color, marker) in styles.items():
    rs = sorted((r for r in results if r['family'] == family),
                key=lambda r: r['total_bits'], reverse=True)
    if not rs:
      continue
    xs = [base['total_bits'] / r['total_bits'] if base else
          r['total_compression'] for r in rs]
    ys = [100 * r['accuracy'] for r in rs]
    ax.plot(xs, ys, color=color, marker=marker, label=family,
            linestyle='-' if len(rs) > 1 else 'none')
    for r, x, y in zip(rs, xs, ys):
      d = r['options'].get('intrinsic_dim') or r['options'].get('topk_k')
      if d:
        ax.annotate(f'{d:,}', (x, y), textcoords='offset points',
                    xytext=(4, 4), fontsize=7, color=color)
  ax.set_xscale('log')
  ax.set_xlabel('total compression vs uncompressed SGD (same examples)')
  ax.set_ylabel('test accuracy (%)')
  ax.set_title(f'FEMNIST-105, {meta["rounds"]} one-step rounds, seed '
               f'{meta["seed"]}')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=8, loc='best')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  out = pathlib.Path(FLAGS.results_dir)
  stem = 'igc_femnist' if not FLAGS.only else 'igc_femnist_partial'
  if FLAGS.report_only:
    saved = json.loads((out / f'{stem}.json').read_text())
    _write_table(saved['results'], out / f'{stem}.md', saved['flags'],
                 saved['machine'], saved['total_wall_seconds'])
    _plot(saved['results'], out / f'{stem}.png', saved['flags'])
    print(f'rewrote {out / stem}.md/.png from {stem}.json')
    return
  todo = [s for s in setups() if not FLAGS.only or s.label in FLAGS.only
          or _slug(s.label) in FLAGS.only]
  t0 = time.perf_counter()
  results = []
  for s in todo:
    r = _run_one(s)
    results.append(r)
    print(f"{r['label']:<40} acc {100 * r['accuracy']:5.1f}%  total "
          f"{r['total_compression']:8.1f}x  {r['seconds_per_round']:.2f} "
          f"s/round  wall {r['wall_seconds']:.0f} s", flush=True)
  total_wall = time.perf_counter() - t0
  machine = (f'{platform.processor() or platform.machine()}, '
             f'{os.cpu_count()} cores, {platform.system()}, jax '
             f'{jax.__version__} ({jax.default_backend()})')
  meta = {'rounds': FLAGS.rounds, 'seed': FLAGS.seed,
          'client_lr': FLAGS.client_lr}
  out.mkdir(parents=True, exist_ok=True)
  _write_table(results, out / f'{stem}.md', meta, machine, total_wall)
  _plot(results, out / f'{stem}.png', meta)
  (out / f'{stem}.json').write_text(json.dumps(
      {'flags': meta, 'machine': machine, 'total_wall_seconds': total_wall,
       'results': results}, indent=1, default=str))
  print(f'wrote {out / stem}.md/.png/.json; total {total_wall / 60:.1f} min')


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)
