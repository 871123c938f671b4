#!/usr/bin/env python3
"""Rounds/second vs device count, and the vmapped FedJAX backend vs ``jit``.

Part 1 (``--part=devices``): FedAvg on the EMNIST CNN with the clients of a
round split over a ``jax.sharding`` mesh of N devices (the vmap engine), for
each N in ``--devices``; each N runs in its own subprocess because the
device count is fixed when JAX starts (on CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=N``, devices that SHARE
the machine's cores, so CPU numbers show the overhead of the layout, not
real scaling). The single-device loop engine (the CPU default) and the
1-device vmap engine are the references printed in the same table.

Part 2 (``--part=backend``): ``fedjax.algorithms.fed_avg`` unmodified, with
FedJAX's ``jit`` backend and with ``fedlite_jax.rounds.VmapBackend`` on the
same clients, batches and keys, in one process: rounds/second and the ratio.

Timing: warm-up rounds (compilation) excluded, then the median over
``--rounds`` timed rounds; on a shared machine compare ratios.

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_scaling.py
  python benchmarks/bench_scaling.py --devices=1,2,4 --rounds=3 --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import optax

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.training.runner import client_rng
from fedlite_jax.rounds import VmapBackend
from fedlite_jax.rounds import make_client_mesh
from fedlite_jax.rounds import use_client_mesh


def _setup(args):
  task = args.task or ('emnist' if os.environ.get('FEDLITE_DATA_DIR')
                       else 'embedded_mnist')
  train, _, info = datasets.load_federated_data(task)
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, args.clients_per_round, seed=0)
  cap = args.max_examples
  cohorts = []
  for r in range(args.warmup + args.rounds):
    sampler.set_round_num(r)
    cohorts.append([(cid, cds[:cap] if cap else cds, client_rng(0, r, cid))
                    for cid, cds, _ in sampler.sample()])
  return task, info.num_classes, cohorts


def _time_rounds(apply, state, cohorts, warmup):
  times = []
  for i, cohort in enumerate(cohorts):
    t0 = time.perf_counter()
    state, _ = apply(state, cohort)
    jax.block_until_ready(state)
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _devices_worker(args) -> dict:
  """Runs inside a subprocess with the forced device count."""
  task, num_classes, cohorts = _setup(args)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=args.batch_size)
  params = models.create_emnist_cnn(num_classes).model.init(
      jax.random.PRNGKey(0))
  out = {'task': task, 'num_devices': jax.local_device_count(),
         'backend': jax.default_backend()}
  engines = [('vmap', 'vmap')]
  if jax.local_device_count() == 1:
    engines.insert(0, ('loop', 'loop'))
  for label, engine in engines:
    # Convolutions as the runner's --conv_implementation=auto builds them:
    # im2col matmuls where clients run vmapped (the same parameters).
    model = models.create_emnist_cnn(
        num_classes, conv_implementation='lax' if engine == 'loop'
        else 'im2col').model
    with use_client_mesh(make_client_mesh()):
      alg = federated_averaging(fedjax.model_grad(model), optax.sgd(0.1),
                                optax.sgd(1.0), hp, engine=engine)
    out[label] = _time_rounds(alg.apply, alg.init(params), cohorts,
                              args.warmup)
  return out


def _part_devices(args) -> None:
  rows = []
  for n in [int(x) for x in args.devices.split(',')]:
    env = dict(os.environ)
    env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                        f' --xla_force_host_platform_device_count={n}')
    cmd = [sys.executable, __file__, '--worker'] + [
        f'--{k}={v}' for k, v in vars(args).items()
        if v is not None and k not in ('worker', 'part', 'smoke')]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
      raise RuntimeError(f'worker for {n} devices failed:\n{proc.stderr}')
    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  base = rows[0]
  print(f'\n[devices] FedAvg, EMNIST CNN, task {base["task"]}, '
        f'{args.clients_per_round} clients/round, backend {base["backend"]}')
  print('devices | engine | s/round | rounds/s | vs 1-device vmap | '
        'vs loop (CPU default)')
  loop = base.get('loop')
  if loop:
    print(f'{base["num_devices"]} | loop | {loop:.3f} | {1 / loop:.2f} | '
          f'{base["vmap"] / loop:.2f}x | 1.00x')
  for row in rows:
    print(f'{row["num_devices"]} | vmap (mesh) | {row["vmap"]:.3f} | '
          f'{1 / row["vmap"]:.2f} | {base["vmap"] / row["vmap"]:.2f}x | '
          + (f'{loop / row["vmap"]:.2f}x' if loop else 'n/a'))


def _part_backend(args) -> None:
  task, _, cohorts = _setup(args)
  model = fedjax.models.emnist.create_conv_model(only_digits=False) \
      if task == 'emnist' else fedjax.models.emnist.create_conv_model(
          only_digits=True)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=args.batch_size, seed=0)
  params = model.init(jax.random.PRNGKey(0))
  results = {}
  for name, backend in (('jit', 'jit'), ('vmap', VmapBackend())):
    # FedJAX binds the backend when the algorithm calls for_each_client,
    # i.e. at construction: build it inside the context.
    with fedjax.for_each_client_backend(backend):
      alg = fedjax.algorithms.fed_avg.federated_averaging(
          fedjax.model_grad(model), fedjax.optimizers.sgd(0.1),
          fedjax.optimizers.sgd(1.0), hp)
    results[name] = _time_rounds(alg.apply, alg.init(params), cohorts,
                                 args.warmup)
  print(f'\n[backend] fedjax.algorithms.fed_avg (FedJAX haiku CNN), task '
        f'{task}, {args.clients_per_round} clients/round, '
        f'{jax.local_device_count()} {jax.default_backend()} device(s)')
  print('backend | s/round | rounds/s')
  for name, t in results.items():
    print(f'{name} | {t:.3f} | {1 / t:.2f}')
  print(f'ratio vmap/jit rounds per second: '
        f'{results["jit"] / results["vmap"]:.2f}x')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--part', default='devices,backend')
  parser.add_argument('--task', default=None)
  parser.add_argument('--devices', default='1,2,4')
  parser.add_argument('--clients_per_round', type=int, default=8)
  parser.add_argument('--batch_size', type=int, default=20)
  parser.add_argument('--max_examples', type=int, default=0,
                      help='cap on examples per client (0: none)')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--warmup', type=int, default=1)
  parser.add_argument('--smoke', action='store_true',
                      help='tiny setting for the test suite')
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.smoke:
    args.devices, args.clients_per_round = '1,2', 4
    args.max_examples, args.rounds, args.warmup = 20, 1, 1
  if args.worker:
    print(json.dumps(_devices_worker(args)))
    return
  print(f'jax {jax.__version__}, load average '
        f'{open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "n/a"}')
  parts = args.part.split(',')
  if 'devices' in parts:
    _part_devices(args)
  if 'backend' in parts:
    _part_backend(args)


if __name__ == '__main__':
  main()
