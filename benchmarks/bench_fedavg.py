#!/usr/bin/env python3
"""FedAvg rounds/second: ours (each round engine) vs fedjax.algorithms.fed_avg.

Same process, same model (our flax EMNIST CNN, or FedJAX's haiku CNN with
--model=haiku), same sampled clients, batches and PRNG keys; prints rounds per
second for each execution path and the ratio against FedJAX. Compile time is
excluded by ``--warmup`` rounds on other cohorts; the timed rounds are then
interleaved (ours, FedJAX, ours, ...) so that machine noise hits both alike.

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_fedavg.py
  python benchmarks/bench_fedavg.py --engines=loop,vmap --rounds=5

Without FEDLITE_DATA_DIR it uses the embedded MNIST task.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import fedlite_jax  # noqa: F401
import fedjax
import jax
import optax

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.training.runner import client_rng


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--task', default=None,
                      help='emnist (default when FEDLITE_DATA_DIR is set) or '
                      'embedded_mnist')
  parser.add_argument('--model', default='flax', choices=['flax', 'haiku'])
  parser.add_argument('--clients_per_round', type=int, default=10)
  parser.add_argument('--batch_size', type=int, default=20)
  parser.add_argument('--rounds', type=int, default=5, help='timed rounds')
  parser.add_argument('--warmup', type=int, default=2, help='untimed rounds')
  parser.add_argument('--engines', default='loop,vmap',
                      help='comma list of loop and vmap')
  args = parser.parse_args()
  task = args.task or ('emnist' if os.environ.get('FEDLITE_DATA_DIR')
                       else 'embedded_mnist')
  train, _, info = datasets.load_federated_data(task)
  if args.model == 'flax':
    model = models.create_emnist_cnn(info.num_classes).model
  else:
    model = fedjax.models.emnist.create_conv_model(
        only_digits=info.num_classes == 10)
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=args.batch_size)
  params = model.init(jax.random.PRNGKey(0))

  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, args.clients_per_round, seed=0)
  cohorts = []
  for r in range(args.warmup + args.rounds):
    cohorts.append([(cid, cds, client_rng(0, r, cid))
                    for cid, cds, _ in sampler.sample()])
  steps = [sum(-(-len(cds) // args.batch_size) for _, cds, _ in c)
           for c in cohorts[args.warmup:]]

  def fedjax_alg():
    # FedJAX's fed_avg takes one batching seed for all clients and rounds.
    return fedjax.algorithms.fed_avg.federated_averaging(
        grad_fn, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=args.batch_size, seed=0))

  algs = {'fedjax.fed_avg (jit backend)': fedjax_alg()}
  for engine in args.engines.split(','):
    if engine not in ('loop', 'vmap'):
      raise SystemExit(f'--engines: unknown {engine!r}; allowed: loop, vmap.')
    algs[f'ours {engine} engine'] = federated_averaging(
        grad_fn, optax.sgd(0.1), optax.sgd(1.0), hp, engine=engine)

  states = {name: alg.init(params) for name, alg in algs.items()}
  for cohort in cohorts[:args.warmup]:
    for name, alg in algs.items():
      states[name], _ = alg.apply(states[name], cohort)
      jax.block_until_ready(states[name].params)
  times = {name: [] for name in algs}
  for cohort in cohorts[args.warmup:]:
    for name, alg in algs.items():
      t0 = time.perf_counter()
      states[name], _ = alg.apply(states[name], cohort)
      jax.block_until_ready(states[name].params)
      times[name].append(time.perf_counter() - t0)

  print(f'task={task} model={args.model} backend={jax.default_backend()} '
        f'devices={jax.device_count()} clients/round={args.clients_per_round} '
        f'batch={args.batch_size} timed rounds={args.rounds} '
        f'(mean {statistics.mean(steps):.1f} client-steps/round)')
  ref = statistics.median(times['fedjax.fed_avg (jit backend)'])
  print(f'{"path":34s} {"s/round (median)":>17s} {"rounds/s":>9s} '
        f'{"vs FedJAX":>10s}')
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f'{name:34s} {med:17.3f} {1 / med:9.2f} {ref / med:9.2f}x')


if __name__ == '__main__':
  main()
