#!/usr/bin/env python3
"""Round time of static IGC vs uncompressed SGD/FedAvg, same process, real data.

One round of :func:`fedlite_jax.algorithms.igc.intrinsic_gradient_compression`
(static: K = 1, no time variation; Melas-Kyriazi & Wang 2022, Algorithm 1)
against one round of IGC's SGD baseline,
:func:`fedlite_jax.algorithms.fedopt.federated_averaging` with client weight 1
and no upload transform (uncompressed SGD for one local step, FedAvg for more),
both built as the experiment runner builds ``--algorithm=igc_static`` and
``--algorithm=sgd`` (``algo_igc.py`` / ``algo_baselines.py``): the EMNIST CNN
of :func:`fedlite_jax.models.create_emnist_cnn` (1,206,590 parameters), client
SGD, server SGD at rate 1, the default round engine. Both see the same
sampled FEMNIST-105 clients, the same batches and the same PRNG keys
(:func:`fedlite_jax.training.runner.client_rng`).

IGC's extra work per round: one ``A^T delta`` per client (L = 2**21 for this
model) inside the client's compiled ``final`` step, and one ``A sigma`` on the
server. The overhead is ``median(IGC round) / median(SGD round) - 1`` (the
issue's target: <= 15%). ``--warmup`` rounds (other cohorts) absorb
compilation; the timed rounds alternate (SGD, IGC, SGD, ...) so that load
from other processes hits both alike. Printed per local-step setting: the
table and a machine-readable line ``ratio igc_round local_steps=S
igc/sgd=R overhead_pct=P``.

Usage::

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_igc_round.py
  python benchmarks/bench_igc_round.py --data_dir=/path/to/data \\
      --local_steps=1,10 --intrinsic_dim=16384 --rounds=7
  python benchmarks/bench_igc_round.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import fedlite_jax  # noqa: F401  (before fedjax)
import fedjax
import jax
import optax

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import igc
from fedlite_jax.training.runner import client_rng
from fedlite_jax.transforms import fastfood as ff


def build(grad_fn, local_steps: int, batch_size: int, d: int, lr: float,
          client_ids) -> dict[str, fedjax.FederatedAlgorithm]:
  """The two algorithms, configured as the runner does."""
  sgd = fedopt.federated_averaging(  # IGC's SGD baseline (runner's 'sgd').
      grad_fn, optax.sgd(lr), optax.sgd(1.0),
      fedopt.batch_hparams(batch_size, local_steps), weighting='uniform',
      download_accounting='dense', client_ids=client_ids, name='sgd')
  igc_static = igc.intrinsic_gradient_compression(
      grad_fn, optax.sgd(lr), optax.sgd(1.0), batch_size=batch_size,
      intrinsic_dim=d, local_steps=local_steps, num_subspaces=1,
      time_varying=False, seed=0, client_ids=client_ids)
  # The same algorithm simulated with one projection of the summed deltas
  # on the server (--igc_project_on_server; equal to float rounding).
  igc_server = igc.intrinsic_gradient_compression(
      grad_fn, optax.sgd(lr), optax.sgd(1.0), batch_size=batch_size,
      intrinsic_dim=d, local_steps=local_steps, num_subspaces=1,
      time_varying=False, seed=0, client_ids=client_ids,
      project_on_server=True)
  return {'sgd': sgd, 'igc_static': igc_static, 'igc_server': igc_server}


def time_round_pair(algs, params, cohorts, warmup: int,
                    reverse: bool = False) -> dict[str, list]:
  """Runs warm-up rounds, then alternates timed rounds; seconds per round.
  ``reverse``: the algorithms run in reverse order on each cohort (to see
  whether the first one on a cohort pays for something the others reuse)."""
  states = {name: alg.init(params) for name, alg in algs.items()}
  for cohort in cohorts[:warmup]:
    for name, alg in algs.items():
      states[name], _ = alg.apply(states[name], cohort)
      jax.block_until_ready(states[name].params)
  times = {name: [] for name in algs}
  order = list(algs.items())[::-1] if reverse else list(algs.items())
  for cohort in cohorts[warmup:]:
    for name, alg in order:
      t0 = time.perf_counter()
      states[name], _ = alg.apply(states[name], cohort)
      jax.block_until_ready(states[name].params)
      times[name].append(time.perf_counter() - t0)
  return times


def time_projection(D: int, d: int, repeats: int = 7) -> tuple[float, float]:
  """Median ms of one A^T g and one A s at this size (for the breakdown)."""
  p = ff.fastfood_params(0, D, d)
  g = jax.numpy.ones((D,), jax.numpy.float32)
  s = jax.numpy.ones((d,), jax.numpy.float32)
  out = []
  for fn in (lambda: ff.fastfood_project(p, g), lambda: ff.fastfood_lift(p, s)):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t0)
    out.append(1e3 * statistics.median(ts))
  return out[0], out[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data_dir', default=None,
                      help='directory with femnist105/ (else FEDLITE_DATA_DIR)')
  parser.add_argument('--clients_per_round', type=int, default=10)
  parser.add_argument('--batch_size', type=int, default=20)
  parser.add_argument('--local_steps', default='1,10',
                      help='comma list; each value is one comparison')
  parser.add_argument('--intrinsic_dim', type=int, default=16_384)
  parser.add_argument('--client_lr', type=float, default=0.1)
  parser.add_argument('--rounds', type=int, default=7, help='timed rounds')
  parser.add_argument('--warmup', type=int, default=2, help='untimed rounds')
  parser.add_argument('--reverse', action='store_true',
                      help='run the algorithms in reverse order on each '
                      'timed cohort (order effects)')
  parser.add_argument('--smoke', action='store_true',
                      help='2 clients, 1 step, 1+1 rounds, d=1024 (tests)')
  args = parser.parse_args()
  data_dir = args.data_dir or os.environ.get('FEDLITE_DATA_DIR')
  if not data_dir or not os.path.isdir(os.path.join(data_dir, 'femnist105')):
    sys.exit('bench_igc_round.py needs FEMNIST-105: pass --data_dir or set '
             'FEDLITE_DATA_DIR to the directory holding femnist105/.')
  steps_list = [int(v) for v in args.local_steps.split(',')]
  cpr, rounds, warmup, d = (args.clients_per_round, args.rounds, args.warmup,
                            args.intrinsic_dim)
  if args.smoke:
    cpr, rounds, warmup, d, steps_list = 2, 1, 1, 1024, [1]

  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'GLIBC_TUNABLES={os.environ.get("GLIBC_TUNABLES", "")!r}, '
        f'loadavg {open("/proc/loadavg").read().split()[:3]}', flush=True)
  train, _, info = datasets.load_federated_data('emnist', data_dir)
  model = models.create_emnist_cnn(info.num_classes).model
  grad_fn = fedjax.model_grad(model)
  params = model.init(jax.random.PRNGKey(0))
  D = sum(x.size for x in jax.tree.leaves(params))
  client_ids = list(train.client_ids())
  L = ff.padded_length(D, d)
  t_proj, t_lift = time_projection(D, d)
  print(f'EMNIST CNN D={D:,}, d={d:,}, L=2^{L.bit_length() - 1}; '
        f'{cpr} clients/round, batch {args.batch_size}; {warmup} warm-up + '
        f'{rounds} timed rounds per setting; alone: A^T g {t_proj:.1f} ms, '
        f'A s {t_lift:.1f} ms (expected extra per round ~ {cpr} x A^T g + '
        f'A s = {cpr * t_proj + t_lift:.0f} ms)', flush=True)

  sampler = fedjax.client_samplers.UniformGetClientSampler(train, cpr, seed=0)
  cohorts = []
  for r in range(warmup + rounds):
    cohorts.append([(cid, cds, client_rng(0, r, cid))
                    for cid, cds, _ in sampler.sample()])

  print(f'{"local steps":>11} {"sgd s/round":>12} {"igc s/round":>12} '
        f'{"igc-sgd ms":>11} {"igc/sgd":>8} {"overhead":>9}')
  for steps in steps_list:
    algs = build(grad_fn, steps, args.batch_size, d, args.client_lr,
                 client_ids)
    times = time_round_pair(algs, params, cohorts, warmup, args.reverse)
    t_sgd = statistics.median(times['sgd'])
    t_igc = statistics.median(times['igc_static'])
    # Per-round paired ratios (same cohort, adjacent in time) as a check.
    paired = statistics.median(
        a / b for a, b in zip(times['igc_static'], times['sgd']))
    print(f'{steps:>11} {t_sgd:12.3f} {t_igc:12.3f} '
          f'{1e3 * (t_igc - t_sgd):11.0f} {t_igc / t_sgd:8.3f} '
          f'{100 * (t_igc / t_sgd - 1):8.1f}%', flush=True)
    print(f'ratio igc_round local_steps={steps} igc/sgd={t_igc / t_sgd:.3f} '
          f'overhead_pct={100 * (t_igc / t_sgd - 1):.1f} '
          f'paired_median_ratio={paired:.3f} sgd_s={t_sgd:.3f} '
          f'igc_s={t_igc:.3f}', flush=True)
    t_srv = statistics.median(times['igc_server'])
    print(f'ratio igc_round_project_on_server local_steps={steps} '
          f'igc/sgd={t_srv / t_sgd:.3f} '
          f'overhead_pct={100 * (t_srv / t_sgd - 1):.1f} igc_s={t_srv:.3f}',
          flush=True)


if __name__ == '__main__':
  main()
