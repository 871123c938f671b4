#!/usr/bin/env python3
"""FedLite's experiments (Wang et al. 2022, Figures 3-5) at CPU scale.

  python experiments/fedlite_experiments.py --data_dir=/path/to/data

Parts (``--parts``, comma-separated, run in this order):

* ``femnist``: Figure 4 shape on FEMNIST-105: test accuracy vs activation
  compression over a (q, L) grid (R = 1, lambda = 5e-5), with SplitFed and
  FedAvg references, and the Figure 5 lambda ablation (lambda = 0 vs 1e-5,
  5e-5, 5e-4 at 490x; 0 vs 5e-5 at 1,197x).
* ``fig3``: Figure 3 shape: quantization error vs compression ratio on real
  FEMNIST client activations (batches of B = 20 from 10 training clients,
  CNN client part after the ``femnist`` part's SplitFed run, eval mode) for
  k-means (q = 1), vanilla PQ (R = q) and grouped PQ (q = 4,608, R in
  {2,304, 1,152, 384, 1}, and the default q = 1,152, R = 1).
* ``nwp``: next-word prediction on real text: the StackOverflow NWP LSTM
  (vocab 10,000, embed 96, LSTM 670, d = 96 per token) on TFF Shakespeare
  (word-level, StackOverflow-style tokens) as a StackOverflow stand-in,
  SplitFed vs FedLite at three (q, L) points.

Every run: seed ``--seed``; cohorts from ``fedjax``'s
``UniformGetClientSampler(seed)``, client keys ``runner.client_rng(seed,
round, client)`` (as ``experiments/run_experiment.py``); one iteration = one
round. Results go to ``--output_dir`` (default ``experiments/results``):
``fedlite_results.json`` (every number; finished runs are reused unless
``--overwrite``), ``fedlite_tables.md``, ``fedlite_fig3.png``,
``fedlite_fig4.png``, ``fedlite_fig5_lambda.png``, ``fedlite_nwp.png``.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time
from typing import Any, Optional

from absl import app
from absl import flags

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import numpy as np
import optax

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.algorithms import split_accounting
from fedlite_jax.algorithms import splitfed as sf
from fedlite_jax.training import evaluation
from fedlite_jax.training import runner
from fedlite_jax.fedlite import pq

_REPO = pathlib.Path(__file__).resolve().parent.parent

flags.DEFINE_string('data_dir', None, 'Directory with femnist105/ and '
                    'shakespeare/ (else $FEDLITE_DATA_DIR).')
flags.DEFINE_string('output_dir', str(_REPO / 'experiments' / 'results'),
                    'Where results are written.')
flags.DEFINE_list('parts', ['femnist', 'fig3', 'nwp'], 'Parts to run.')
flags.DEFINE_integer('seed', 0, 'Run seed.')
flags.DEFINE_integer('iterations', 120, 'FEMNIST iterations per run.')
flags.DEFINE_float('lr', 0.1, 'FEMNIST SGD learning rate (both parts).')
flags.DEFINE_integer('fedavg_rounds', 30, 'FedAvg reference rounds.')
flags.DEFINE_integer('nwp_iterations', 100, 'NWP iterations per run.')
flags.DEFINE_integer('nwp_clients', 10, 'NWP clients per iteration.')
flags.DEFINE_integer('nwp_batch', 16, 'NWP sequences per client.')
flags.DEFINE_integer('nwp_seq_len', 20, 'NWP tokens per sequence.')
flags.DEFINE_float('nwp_lr', 0.01, 'NWP Adam learning rate (both parts).')
flags.DEFINE_bool('overwrite', False, 'Re-run finished runs.')
flags.DEFINE_list('runs', [], 'If set, only runs with these names (e.g. '
                  'femnist_fedlite_q288_L2_lam0, femnist_fedavg).')
FLAGS = flags.FLAGS

PHI = 64.0
FEMNIST_B = 20
FEMNIST_CLIENTS = 10
FEMNIST_LAMBDA = 5e-5
# The lambda grids below use the 'batch' scaling (lambda (Z - Z~) added to the
# gradient of a client's batch-mean loss), i.e. per-example lambda x B (the
# library default 'example'): FEMNIST 5e-5 here = 1e-3 per example.
LAMBDA_SCALING = 'batch'
# (q, L) grid for Figure 4, R = 1.
FEMNIST_GRID = ((288, 2), (1152, 2), (4608, 2), (1152, 32), (4608, 32))
# Figure 5: (q, L, lambda).
LAMBDA_GRID = ((1152, 2, 0.0), (1152, 2, 1e-5), (1152, 2, 5e-4),
               (288, 2, 0.0))
NWP_LAMBDA = 1e-3
NWP_GRID = ((48, 240), (24, 30), (12, 4))


# --------------------------------------------------------------- bookkeeping


class Results:
  """fedlite_results.json: finished runs by name, written after each run."""

  def __init__(self, path: pathlib.Path, overwrite: bool):
    self.path = path
    self.data = {}
    if path.exists() and not overwrite:
      self.data = json.loads(path.read_text())
    self.data.setdefault('runs', {})

  def done(self, name: str) -> bool:
    """True if ``name`` finished (or is excluded by ``--runs``)."""
    if FLAGS.runs and name not in FLAGS.runs:
      return True
    return name in self.data['runs']

  def put(self, name: str, record: dict) -> None:
    self.data['runs'][name] = record
    self.save()

  def save(self) -> None:
    self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True))


def machine() -> dict[str, Any]:
  return {'platform': platform.platform(), 'python': platform.python_version(),
          'jax': jax.__version__, 'backend': jax.default_backend(),
          'cpu_count': os.cpu_count(), 'load_avg_at_start': os.getloadavg()}


def run_split(name: str, split_model, train, batches, *, quantizer,
              optimizer, batch_size: int, clients_per_round: int,
              iterations: int, eval_at: tuple[int, ...], seed: int,
              metric: str = 'accuracy') -> dict:
  """Trains SplitFed/FedLite; returns the run record (evals, bits, timing)."""
  alg = sf.split_learning(split_model, optimizer, optimizer, batch_size,
                          quantizer=quantizer, phi=PHI)
  state = alg.init(split_model.model.init(jax.random.PRNGKey(seed)))
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, clients_per_round, seed)
  totals = {k: 0.0 for k in split_accounting.BIT_KEYS}
  evals, rel_errors, train_loss = [], [], []
  t_start = time.perf_counter()
  t_train = t_first = 0.0
  for r in range(iterations):
    clients = [(cid, cds, runner.client_rng(seed, r, cid))
               for cid, cds, _ in sampler.sample()]
    t0 = time.perf_counter()
    state, diags = alg.apply(state, clients)
    jax.block_until_ready(state)
    if r == 0:
      t_first = time.perf_counter() - t0  # Includes the compilation.
    else:
      t_train += time.perf_counter() - t0
    for d in diags.values():
      for k in totals:
        totals[k] += d[k]
    train_loss.append(float(np.mean([d['loss'] for d in diags.values()])))
    if quantizer is not None:
      rel_errors.append(float(np.mean(
          [d['relative_quantization_error'] for d in diags.values()])))
    if r + 1 in eval_at:
      m = evaluation.evaluate(split_model.model, state.params, batches)
      evals.append({'iteration': r + 1, **m})
      print(f'  {name} it {r + 1}: {metric}={m[metric]:.4f} '
            f'loss={m["loss"]:.4f}', flush=True)
  summary = split_accounting.communication_summary(totals)
  return {
      'algorithm': 'splitfed' if quantizer is None else 'fedlite',
      'q': None if quantizer is None else quantizer.num_subvectors,
      'R': None if quantizer is None else quantizer.num_groups,
      'L': None if quantizer is None else quantizer.num_centroids,
      'lambda': None if quantizer is None else quantizer.correction_lambda,
      'lambda_scaling': None if quantizer is None else quantizer.lambda_scaling,
      'lambda_per_example': None if quantizer is None else (
          quantizer.correction_lambda * (
              batch_size if quantizer.lambda_scaling == 'batch' else 1)),
      'iterations': iterations, 'seed': seed,
      'evals': evals, 'final': evals[-1],
      'train_loss_first10': float(np.mean(train_loss[:10])),
      'train_loss_last10': float(np.mean(train_loss[-10:])),
      'mean_relative_quantization_error': (
          float(np.mean(rel_errors)) if rel_errors else 0.0),
      **summary,
      'upload_bytes_per_client_iteration': totals['upload_bits'] / 8 / (
          iterations * clients_per_round),
      'seconds_per_iteration': t_train / max(iterations - 1, 1),
      'first_iteration_seconds': t_first,
      'wall_seconds': time.perf_counter() - t_start,
  }


# ------------------------------------------------------------------ FEMNIST


def femnist_part(results: Results, data_dir: Optional[str]):
  train, test, _ = datasets.load_federated_data('emnist', data_dir)
  batches = evaluation.eval_batches(test, 256, 0, FLAGS.seed)
  split_model = models.create_emnist_cnn(62)
  iters = FLAGS.iterations
  eval_at = tuple(sorted({iters // 3, 2 * iters // 3, iters}))
  common = dict(optimizer=optax.sgd(FLAGS.lr), batch_size=FEMNIST_B,
                clients_per_round=FEMNIST_CLIENTS, iterations=iters,
                eval_at=eval_at, seed=FLAGS.seed)
  runs = [('femnist_splitfed', None)]
  runs += [(f'femnist_fedlite_q{q}_L{L}_lam{FEMNIST_LAMBDA:g}',
            sf.QuantizerConfig(q, 1, L, correction_lambda=FEMNIST_LAMBDA,
                               lambda_scaling=LAMBDA_SCALING))
           for q, L in FEMNIST_GRID]
  runs += [(f'femnist_fedlite_q{q}_L{L}_lam{lam:g}',
            sf.QuantizerConfig(q, 1, L, correction_lambda=lam,
                               lambda_scaling=LAMBDA_SCALING))
           for q, L, lam in LAMBDA_GRID]
  for name, quantizer in runs:
    if results.done(name):
      continue
    print(f'[femnist] {name}', flush=True)
    record = run_split(name, split_model, train, batches, quantizer=quantizer,
                       **common)
    record['task'] = 'femnist105'
    record['lr'] = FLAGS.lr
    results.put(name, record)
  if not results.done('femnist_fedavg'):
    print('[femnist] fedavg', flush=True)
    results.put('femnist_fedavg', fedavg_reference(split_model, train,
                                                   batches))


def fedavg_reference(split_model, train, batches) -> dict:
  """FedAvg: 10 clients/round, 1 local epoch of batch-20 SGD(lr), server 1."""
  model = split_model.model
  alg = federated_averaging(
      fedjax.model_grad(model), optax.sgd(FLAGS.lr), optax.sgd(1.0),
      fedjax.ShuffleRepeatBatchHParams(batch_size=FEMNIST_B), engine='loop')
  state = alg.init(model.init(jax.random.PRNGKey(FLAGS.seed)))
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, FEMNIST_CLIENTS, FLAGS.seed)
  rounds = FLAGS.fedavg_rounds
  eval_at = {rounds // 3, 2 * rounds // 3, rounds}
  evals, up_bits, steps = [], 0.0, 0
  t0 = time.perf_counter()
  for r in range(rounds):
    clients = [(cid, cds, runner.client_rng(FLAGS.seed, r, cid))
               for cid, cds, _ in sampler.sample()]
    steps += sum(-(-len(cds) // FEMNIST_B) for _, cds, _ in clients)
    state, diags = alg.apply(state, clients)
    up_bits += sum(d['upload_bits'] for d in diags.values())
    if r + 1 in eval_at:
      m = evaluation.evaluate(model, state.params, batches)
      evals.append({'round': r + 1, **m})
      print(f'  fedavg round {r + 1}: accuracy={m["accuracy"]:.4f}',
            flush=True)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  return {
      'algorithm': 'fedavg', 'rounds': rounds, 'seed': FLAGS.seed,
      'lr': FLAGS.lr, 'server_lr': 1.0, 'evals': evals, 'final': evals[-1],
      'client_steps_per_round': steps / rounds,
      'upload_bits_per_client_round_phi64': PHI * num_params,
      'upload_bytes_per_client_round': up_bits / 8 / (rounds * FEMNIST_CLIENTS),
      'wall_seconds': time.perf_counter() - t0,
  }


# -------------------------------------------------------------------- Fig 3


def fig3_part(results: Results, data_dir: Optional[str]):
  if 'fig3' in results.data or (FLAGS.runs and 'fig3' not in FLAGS.runs):
    return
  train, _, _ = datasets.load_federated_data('emnist', data_dir)
  split_model = models.create_emnist_cnn(62)
  # The client model after SplitFed training (as the paper's "activations
  # trained via a two-layer CNN"): rerun SplitFed's first iterations.
  print('[fig3] training the client model (SplitFed)', flush=True)
  iters = min(FLAGS.iterations, 60)
  alg = sf.splitfed(split_model, optax.sgd(FLAGS.lr), optax.sgd(FLAGS.lr),
                    FEMNIST_B)
  state = alg.init(split_model.model.init(jax.random.PRNGKey(FLAGS.seed)))
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, FEMNIST_CLIENTS, FLAGS.seed)
  for r in range(iters):
    clients = [(cid, cds, runner.client_rng(FLAGS.seed, r, cid))
               for cid, cds, _ in sampler.sample()]
    state, _ = alg.apply(state, clients)
  wc = state.params['client']
  ids = list(train.client_ids())[:FEMNIST_CLIENTS]
  zs = []
  for i, (cid, cds) in enumerate(train.get_clients(ids)):
    batch = sf.client_batch(cds, FEMNIST_B, jax.random.PRNGKey(1000 + i))
    zs.append(np.asarray(split_model.client_apply(wc, batch, None)))
  z = np.stack(zs)  # [10, 20, 9216]
  keys = jax.random.split(jax.random.PRNGKey(FLAGS.seed), len(zs))

  configs = []
  for L in (2, 4, 8, 16, 20):
    configs.append(('k-means (q=1)', 1, 1, L))
  for q in (288, 1152, 4608):
    for L in (2, 4, 8, 16):
      configs.append((f'vanilla PQ (q=R={q})', q, q, L))
  for R in (2304, 1152, 384, 1):
    for L in (2, 4, 8, 16, 32):
      configs.append((f'grouped PQ (q=4608, R={R})', 4608, R, L))
  for L in (2, 4, 8, 16, 32):
    configs.append(('grouped PQ (q=1152, R=1)', 1152, 1, L))
  rows = []
  t0 = time.perf_counter()
  for label, q, R, L in configs:
    quantize = jax.jit(jax.vmap(
        lambda x, k, q=q, R=R, L=L: pq.grouped_pq(x, k, q, R, L)))
    res = quantize(z, keys)
    rows.append({
        'curve': label, 'q': q, 'R': R, 'L': L,
        'compression': pq.pq_compression_ratio(9216, FEMNIST_B, q, R, L, PHI),
        'relative_error': float(np.mean(res.relative_error)),
        'mse_per_vector': float(np.mean(res.quantization_error)),
    })
    print(f'  {label} L={L}: ratio {rows[-1]["compression"]:.1f} '
          f'rel.err {rows[-1]["relative_error"]:.4f}', flush=True)
  results.data['fig3'] = {
      'rows': rows, 'client_model_iterations': iters,
      'num_clients': len(zs), 'batch_size': FEMNIST_B,
      'kmeans_iters': pq.DEFAULT_NUM_ITERS,
      'wall_seconds': time.perf_counter() - t0}
  results.save()


# ---------------------------------------------------------------------- NWP


def nwp_part(results: Results, data_dir: Optional[str]):
  train, test, info = datasets.load_federated_data(
      'shakespeare', data_dir, sequence_length=FLAGS.nwp_seq_len)
  batches = evaluation.eval_batches(test, 256, 0, FLAGS.seed)
  split_model = models.create_stackoverflow_lstm(vocab_size=info.vocab_size)
  iters = FLAGS.nwp_iterations
  eval_at = tuple(sorted({iters // 2, iters}))
  common = dict(optimizer=optax.adam(FLAGS.nwp_lr),
                batch_size=FLAGS.nwp_batch,
                clients_per_round=FLAGS.nwp_clients, iterations=iters,
                eval_at=eval_at, seed=FLAGS.seed)
  runs = [('nwp_splitfed', None)] + [
      (f'nwp_fedlite_q{q}_L{L}_lam{NWP_LAMBDA:g}',
       sf.QuantizerConfig(q, 1, L, correction_lambda=NWP_LAMBDA,
                          lambda_scaling=LAMBDA_SCALING))
      for q, L in NWP_GRID]
  for name, quantizer in runs:
    if results.done(name):
      continue
    print(f'[nwp] {name}', flush=True)
    record = run_split(name, split_model, train, batches, quantizer=quantizer,
                       **common)
    record.update(task='shakespeare (word-level NWP, StackOverflow pipeline)',
                  lr=FLAGS.nwp_lr, optimizer='adam',
                  vectors_per_client=FLAGS.nwp_batch * FLAGS.nwp_seq_len)
    results.put(name, record)


# -------------------------------------------------------------- reporting


def _plots(results: Results, out: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  runs = results.data['runs']

  if 'fig3' in results.data:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    rows = results.data['fig3']['rows']
    for curve in dict.fromkeys(r['curve'] for r in rows):
      pts = sorted((r['compression'], r['relative_error']) for r in rows
                   if r['curve'] == curve)
      style = ('s--' if curve.startswith('k-means') else
               'o:' if curve.startswith('vanilla') else 'x-')
      ax.plot(*zip(*pts), style, label=curve)
    ax.set_xscale('log')
    ax.set_xlabel('compression ratio (phi = 64)')
    ax.set_ylabel('relative quantization error ||Z - Z~||^2 / ||Z||^2')
    ax.set_title('FEMNIST client activations (d = 9,216, B = 20)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / 'fedlite_fig3.png', dpi=120)
    plt.close(fig)

  fem = {k: v for k, v in runs.items() if k.startswith('femnist_fedlite')}
  if fem:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    main = [v for v in fem.values() if v['lambda'] == FEMNIST_LAMBDA]
    for q in sorted({v['q'] for v in main}):
      pts = sorted((v['activation_compression'], v['final']['accuracy'])
                   for v in main if v['q'] == q)
      ls = sorted({v['L'] for v in main if v['q'] == q})
      ax.plot(*zip(*pts), 'o-', label=f'FedLite q={q}, R=1, L in {ls}')
    if 'femnist_splitfed' in runs:
      ax.axhline(runs['femnist_splitfed']['final']['accuracy'], color='k',
                 ls='--', label='SplitFed')
    if 'femnist_fedavg' in runs:
      fa = runs['femnist_fedavg']
      ax.axhline(fa['final']['accuracy'], color='gray', ls=':',
                 label=f'FedAvg ({fa["rounds"]} rounds)')
    ax.set_xscale('log')
    ax.set_xlabel('activation compression ratio (phi = 64)')
    ax.set_ylabel('test accuracy')
    ax.set_title(f'FEMNIST-105, {FLAGS.iterations} iterations, lambda = '
                 f'{FEMNIST_LAMBDA * FEMNIST_B:g} per example')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / 'fedlite_fig4.png', dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for q, L in sorted({(v['q'], v['L']) for v in fem.values()}):
      pts = sorted((v['lambda'], v['final']['accuracy']) for v in fem.values()
                   if (v['q'], v['L']) == (q, L))
      if len(pts) < 2:
        continue
      ratio = next(v['activation_compression'] for v in fem.values()
                   if (v['q'], v['L']) == (q, L))
      # Per-example lambda (= B x the 'batch'-scaled value used); 0 drawn at
      # 1e-5.
      xs = [max(x * FEMNIST_B, 1e-5) for x, _ in pts]
      ax.plot(xs, [y for _, y in pts], 'o-',
              label=f'q={q}, L={L} ({ratio:.0f}x)')
    if 'femnist_splitfed' in runs:
      ax.axhline(runs['femnist_splitfed']['final']['accuracy'], color='k',
                 ls='--', label='SplitFed')
    ax.set_xscale('log')
    ax.set_xlabel('lambda per example (0 drawn at 1e-5)')
    ax.set_ylabel('test accuracy')
    ax.set_title('FEMNIST-105: gradient correction (Figure 5 shape)')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / 'fedlite_fig5_lambda.png', dpi=120)
    plt.close(fig)

  nwp = {k: v for k, v in runs.items() if k.startswith('nwp_')}
  if nwp:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    pts = sorted((v['activation_compression'], v['final']['accuracy'])
                 for k, v in nwp.items() if v['algorithm'] == 'fedlite')
    ax.plot(*zip(*pts), 'o-', label=f'FedLite (lambda = '
            f'{NWP_LAMBDA * FLAGS.nwp_batch:g} per example)')
    if 'nwp_splitfed' in nwp:
      ax.axhline(nwp['nwp_splitfed']['final']['accuracy'], color='k',
                 ls='--', label='SplitFed')
    ax.set_xscale('log')
    ax.set_xlabel('activation compression ratio (phi = 64)')
    ax.set_ylabel('test token accuracy (no PAD/EOS/OOV)')
    ax.set_ylim(0, None)  # The differences are small: do not zoom them up.
    ax.set_title(f'Shakespeare word-level NWP, SO LSTM, '
                 f'{FLAGS.nwp_iterations} iterations')
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / 'fedlite_nwp.png', dpi=120)
    plt.close(fig)


def _fmt_lambda(value: Optional[float]) -> str:
  return '-' if value is None else f'{value:g}'


def _tables(results: Results, out: pathlib.Path) -> None:
  runs = results.data['runs']
  lines = ['# FedLite experiment tables (generated)', '',
           f'machine: {json.dumps(results.data.get("machine", {}))}', '']
  split_rows = sorted(
      ((k, v) for k, v in runs.items() if v['algorithm'] != 'fedavg'),
      key=lambda kv: (kv[0].split('_')[0], kv[1]['algorithm'] != 'splitfed',
                      kv[1]['activation_compression'],
                      kv[1]['lambda'] or 0.0))
  if split_rows:
    lines += ['| run | q | R | L | lambda (scaling) | lambda per example | '
              'act. ratio (phi 64) | upload vs SplitFed | upload vs FedAvg | '
              'rel. quant. err | final acc | final loss | s/iter | wall s |',
              '|' + '---|' * 14]
    for k, v in split_rows:
      f = v['final']
      lines.append(
          f'| {k} | {v["q"] or "-"} | {v["R"] or "-"} | {v["L"] or "-"} | '
          f'{_fmt_lambda(v["lambda"])} ({v.get("lambda_scaling") or "-"}) | '
          f'{_fmt_lambda(v.get("lambda_per_example"))} | '
          f'{v["activation_compression"]:.1f} | '
          f'{v["upload_compression_vs_splitfed"]:.2f} | '
          f'{v["upload_compression_vs_fedavg"]:.1f} | '
          f'{v["mean_relative_quantization_error"]:.3f} | '
          f'{f["accuracy"]:.4f} | {f["loss"]:.4f} | '
          f'{v["seconds_per_iteration"]:.2f} | {v["wall_seconds"]:.0f} |')
    lines.append('')
  if 'femnist_fedavg' in runs:
    v = runs['femnist_fedavg']
    lines += [f'FedAvg: {v["rounds"]} rounds, final accuracy '
              f'{v["final"]["accuracy"]:.4f}, loss {v["final"]["loss"]:.4f}, '
              f'{v["client_steps_per_round"]:.0f} client steps per round, '
              f'wall {v["wall_seconds"]:.0f} s.', '']
  if 'fig3' in results.data:
    lines += ['| curve | q | R | L | ratio (phi 64) | relative error | '
              'MSE per vector |', '|' + '---|' * 7]
    for r in results.data['fig3']['rows']:
      lines.append(f'| {r["curve"]} | {r["q"]} | {r["R"]} | {r["L"]} | '
                   f'{r["compression"]:.1f} | {r["relative_error"]:.4f} | '
                   f'{r["mse_per_vector"]:.2f} |')
    lines.append('')
  (out / 'fedlite_tables.md').write_text('\n'.join(lines) + '\n')


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  results = Results(out / 'fedlite_results.json', FLAGS.overwrite)
  results.data.setdefault('machine', machine())
  results.data.setdefault('flags', {k: getattr(FLAGS, k) for k in (
      'seed', 'iterations', 'lr', 'fedavg_rounds', 'nwp_iterations',
      'nwp_clients', 'nwp_batch', 'nwp_seq_len', 'nwp_lr')})
  data_dir = FLAGS.data_dir or os.environ.get('FEDLITE_DATA_DIR')
  parts = {'femnist': femnist_part, 'fig3': fig3_part, 'nwp': nwp_part}
  for part in FLAGS.parts:
    if part not in parts:
      raise app.UsageError(f'--parts: unknown part {part!r}; allowed: '
                           f'{", ".join(parts)}.')
  for part in ('femnist', 'fig3', 'nwp'):
    if part in FLAGS.parts:
      t0 = time.perf_counter()
      before = json.dumps(results.data, sort_keys=True)
      parts[part](results, data_dir)
      if json.dumps(results.data, sort_keys=True) != before:  # Work was done.
        results.data.setdefault('part_wall_seconds', {})[part] = (
            time.perf_counter() - t0)
      results.save()
  _tables(results, out)
  _plots(results, out)


if __name__ == '__main__':
  app.run(main)
