"""Benchmark: one FedLite iteration vs one SplitFed iteration (EMNIST CNN).

Real FEMNIST-105 data (task ``emnist``, ``FEDLITE_DATA_DIR``), the EMNIST CNN
split after ``flatten`` (d = 9,216), a cohort of ``--clients`` (10) clients,
``--batch_size`` (20) examples per client, SGD 10^-1.5 on both sides. FedLite:
grouped PQ with q = ``--q`` (1,152), R = ``--R`` (1), L in ``--L`` (2, 8, 32),
20 Lloyd iterations, lambda = 5e-5 on the batch-mean loss ('batch'
scaling; = 1e-3 per example, as ``experiments/fedlite_experiments.py``).

Every algorithm gets the same cohorts (FedJAX's
``UniformGetClientSampler(seed)``), the same client keys
(``runner.client_rng``), hence the same batches and dropout masks, and starts
from the same model state every time (the cost of an iteration does not
depend on the parameter values). ``--warmup`` cohorts are run first (they
include compilation, reported separately); then, for each of ``--repeats``
cohorts, every algorithm runs one iteration (``alg.apply``, blocking on the
new state) one after the other, so machine noise hits them alike.

Printed per algorithm: median and min ms per iteration, the quantization
overhead ``median(FedLite) / median(SplitFed) - 1`` in percent, and the
median of the per-cohort paired overheads (more robust on a loaded machine).
``pq alone``: ``pq.grouped_pq`` vmapped over the cohort on the same batches'
activations (client part in eval mode), one jitted call, median ms -- the
quantizer's own share. Lines starting with ``RATIO`` are the summary.

Usage:
  FEDLITE_DATA_DIR=<data> python benchmarks/bench_fedlite_iteration.py
      [--repeats 7] [--L 2,8,32] [--clients 10]
  FEDLITE_DATA_DIR=<data> python benchmarks/bench_fedlite_iteration.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import numpy as np
import optax

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import splitfed as sf
from fedlite_jax.training import runner
from fedlite_jax.transforms import pq

LAMBDA = 5e-5
LAMBDA_SCALING = 'batch'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--clients', type=int, default=10)
  parser.add_argument('--batch_size', type=int, default=20)
  parser.add_argument('--q', type=int, default=1152)
  parser.add_argument('--R', type=int, default=1)
  parser.add_argument('--L', default='2,8,32')
  parser.add_argument('--iters', type=int, default=pq.DEFAULT_NUM_ITERS,
                      help='Lloyd iterations')
  parser.add_argument('--lr', type=float, default=10**-1.5)
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--warmup', type=int, default=1)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--reverse', action='store_true',
                      help='run the algorithms in reverse order on each '
                      'timed cohort (order effects)')
  parser.add_argument('--smoke', action='store_true',
                      help='tiny run for the tests: 2 clients, L = 2, '
                      '1 warm-up and 1 timed iteration')
  args = parser.parse_args()
  if args.warmup < 1 or args.repeats < 1:
    parser.error('--warmup and --repeats must be >= 1')
  if args.smoke:
    args.clients, args.L, args.repeats, args.warmup = 2, '2', 1, 1
  levels = [int(v) for v in args.L.split(',') if v]

  if not os.environ.get('FEDLITE_DATA_DIR'):
    sys.exit('bench_fedlite_iteration: set FEDLITE_DATA_DIR to the directory '
             'holding femnist105/ (real FEMNIST data).')
  print(f'jax {jax.__version__} on {jax.default_backend()}; usable CPUs '
        f'{len(os.sched_getaffinity(0))} of {os.cpu_count()}; load average '
        f'{os.getloadavg()}', flush=True)
  train, _, info = datasets.load_federated_data('emnist')
  split_model = models.create_emnist_cnn(info.num_classes)
  params = split_model.model.init(jax.random.PRNGKey(args.seed))

  algs = {'SplitFed': sf.splitfed(split_model, optax.sgd(args.lr),
                                  optax.sgd(args.lr), args.batch_size)}
  for level in levels:
    quantizer = sf.QuantizerConfig(
        num_subvectors=args.q, num_groups=args.R, num_centroids=level,
        correction_lambda=LAMBDA, lambda_scaling=LAMBDA_SCALING,
        kmeans_iters=args.iters)
    algs[f'FedLite L={level}'] = sf.fedlite(
        split_model, optax.sgd(args.lr), optax.sgd(args.lr),
        args.batch_size, quantizer)
  states = {name: alg.init(params) for name, alg in algs.items()}

  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, args.clients, args.seed)
  cohorts = [[(cid, cds, runner.client_rng(args.seed, r, cid))
              for cid, cds, _ in sampler.sample()]
             for r in range(args.warmup + args.repeats)]

  def run(name, cohort) -> float:
    start = time.perf_counter()
    new_state, _ = algs[name].apply(states[name], cohort)
    jax.block_until_ready(new_state)
    return 1e3 * (time.perf_counter() - start)

  first_ms = {}
  for r in range(args.warmup):
    for name in algs:
      t = run(name, cohorts[r])
      if r == 0:
        first_ms[name] = t
  times = {name: [] for name in algs}
  order = list(algs)[::-1] if args.reverse else list(algs)
  for cohort in cohorts[args.warmup:]:
    for name in order:
      times[name].append(run(name, cohort))

  # The quantizer alone on the same batches' activations (eval mode).
  wc, _ = split_model.split_params(params)
  forward = jax.jit(jax.vmap(lambda b: split_model.client_apply(wc, b, None)))
  pq_alone = {}
  for level in levels:
    vq = jax.jit(jax.vmap(lambda z, k, level=level: pq.grouped_pq(
        z, k, args.q, args.R, level, args.iters).codewords))
    samples = []
    for i, cohort in enumerate([cohorts[0]] + cohorts[args.warmup:]):
      batches = [sf.client_batch(cds, args.batch_size, rng)
                 for _, cds, rng in cohort]
      z = forward({k: np.stack([b[k] for b in batches])
                   for k in batches[0]})
      keys = kmeans_keys(cohort)
      jax.block_until_ready(z)
      start = time.perf_counter()
      vq(z, keys).block_until_ready()
      if i:  # The first one compiles.
        samples.append(1e3 * (time.perf_counter() - start))
    pq_alone[level] = statistics.median(samples)

  base = times['SplitFed']
  base_med = statistics.median(base)
  print(f'\n## One iteration, EMNIST CNN on FEMNIST-105: {args.clients} '
        f'clients x B = {args.batch_size}, q = {args.q}, R = {args.R}, '
        f'{args.iters} Lloyd iterations; ms per iteration over '
        f'{args.repeats} cohorts after {args.warmup} warm-up')
  header = (f'{"algorithm":13s} | {"median":>8s} {"min":>8s} | '
            f'{"overhead":>9s} {"paired":>8s} | {"pq alone":>8s} | '
            f'{"1st call":>9s}')
  print(header)
  print('-' * len(header))
  lines = []
  for name, ts in times.items():
    med = statistics.median(ts)
    if name == 'SplitFed':
      over = paired = '-'
      alone = '-'
    else:
      level = int(name.split('=')[1])
      over = f'{100 * (med / base_med - 1):+8.1f}%'
      paired_pct = 100 * statistics.median(
          [t / b - 1 for t, b in zip(ts, base)])
      paired = f'{paired_pct:+7.1f}%'
      alone = f'{pq_alone[level]:8.1f}'
      lines.append(
          f'RATIO FedLite/SplitFed L={level}: {med / base_med:.3f}x '
          f'(quantization overhead {100 * (med / base_med - 1):+.1f}% of '
          f'medians, {paired_pct:+.1f}% paired median; pq alone '
          f'{pq_alone[level]:.1f} ms = '
          f'{100 * pq_alone[level] / base_med:.1f}% of a SplitFed iteration)')
    print(f'{name:13s} | {med:8.1f} {min(ts):8.1f} | {over:>9s} {paired:>8s}'
          f' | {alone:>8s} | {first_ms[name] / 1e3:8.1f}s', flush=True)
  print()
  for line in lines:
    print(line)


def kmeans_keys(cohort) -> jax.Array:
  """The k-means keys FedLite derives from the clients' keys."""
  fold = sf._KMEANS_FOLD  # pylint: disable=protected-access
  return jax.vmap(lambda k: jax.random.fold_in(k, fold))(
      np.stack([np.asarray(rng) for _, _, rng in cohort]))


if __name__ == '__main__':
  main()
