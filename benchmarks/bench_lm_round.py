#!/usr/bin/env python3
"""Efficient-LM round cost: FedAvg + PVT 40% + 8-bit upload vs plain FedAvg.

Ro et al., "Scaling Language Model Size in Cross-Device Federated Learning"
(2022) train the Small/Large Transformer with partial variable training (PVT,
40% of the parameters trained per client per round) and 8-bit uniform upload
quantization. This benchmark times, in one process, on real TFF Shakespeare
clients (SentencePiece 4,096 ids) and the same cohorts, batches and PRNG keys:

* a round of plain FedAvg (``fedlite_jax.algorithms.federated_averaging``),
* a round of ``federated_averaging`` with PVT 40% + 8-bit uniform
  upload (the client computes the full gradient and zeroes the frozen
  variables),

and reports each round's time and its overhead in percent over FedAvg
(negative = faster), then one client step (gradient + clipped SGD update, one
batch) for the full model vs the PVT step over several sampled masks, as
ratios. Rounds and steps are interleaved round-robin so
that machine noise hits every variant alike; compile time is excluded
(``--warmup`` rounds on other cohorts). On a shared machine compare the
ratios, not the absolute times (docs/DESIGN_NOTES.md).

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_lm_round.py
  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_lm_round.py --smoke

``--smoke`` (the test suite): ``transformer_tiny``, 2 clients, 1 timed round,
a few steps; it checks the plumbing, not the numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from typing import Any, Callable

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import numpy as np
import optax

from fedlite_jax import transforms
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.transforms import pvt
from fedlite_jax.datasets import sentencepiece_vocab
from fedlite_jax.training.runner import client_rng
from fedlite_jax.models import lm


def _median_ms(ts: list[float]) -> float:
  return statistics.median(ts) * 1e3


def _cpu_seconds() -> float:
  """Process CPU time (all threads): less sensitive than wall time to other
  jobs on a shared machine (it still includes their cache/memory effects)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _cohorts(train: fedjax.FederatedData, args: argparse.Namespace
             ) -> list[list[tuple[bytes, fedjax.ClientDataset, jax.Array]]]:
  """Warm-up + timed cohorts of clients with at least one full batch."""
  rng = np.random.RandomState(args.seed)
  ids = [cid for cid, n in train.client_sizes() if n >= args.batch_size]
  cohorts = []
  for r in range(args.warmup + args.rounds):
    chosen = rng.choice(len(ids), args.clients, replace=False)
    cohort = []
    for i in sorted(chosen):
      cid = ids[i]
      cds = train.get_client(cid)
      cohort.append((cid, cds[:args.max_examples],
                     client_rng(args.seed, r, cid)))
    cohorts.append(cohort)
  return cohorts


def _time_rounds(algs: dict[str, fedjax.FederatedAlgorithm], params: Any,
                 cohorts: list, warmup: int
                 ) -> tuple[dict[str, list[float]], dict[str, float]]:
  """Wall seconds per timed round and mean CPU seconds per round."""
  states = {name: alg.init(params) for name, alg in algs.items()}
  times = {name: [] for name in algs}
  cpu = {name: 0.0 for name in algs}
  for r, cohort in enumerate(cohorts):
    for name, alg in algs.items():
      c0 = _cpu_seconds()
      t0 = time.perf_counter()
      states[name], _ = alg.apply(states[name], cohort)
      jax.block_until_ready(states[name].params)
      if r >= warmup:
        times[name].append(time.perf_counter() - t0)
        cpu[name] += _cpu_seconds() - c0
  n = max(1, len(cohorts) - warmup)
  return times, {name: c / n for name, c in cpu.items()}


def _step_fns(grad_fn: Callable, plan: pvt.PVTPlan,
              optimizer: optax.GradientTransformation) -> dict[str, Callable]:
  """One client step (gradient + optimizer update) per variant, jitted."""

  def update(params, opt_state, grads, mask=None):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    if mask is not None:
      updates = pvt.apply_mask(updates, mask)
    return optax.apply_updates(params, updates), opt_state

  def full(params, opt_state, batch, rng, mask):
    del mask
    return update(params, opt_state, grad_fn(params, batch, rng))

  def pvt_masked(params, opt_state, batch, rng, mask):
    grads = pvt.apply_mask(grad_fn(params, batch, rng), mask)
    return update(params, opt_state, grads, mask)

  return {'full step': jax.jit(full),
          'PVT step, masked full grad': jax.jit(pvt_masked)}


def _time_steps(fns: dict[str, Callable], params: Any, opt_state: Any,
                batch: dict, masks: list[np.ndarray], reps: int
                ) -> tuple[dict[str, list[float]], dict[str, float]]:
  """Wall seconds per step call and mean CPU ms per step."""
  key = jax.random.PRNGKey(0)
  for fn in fns.values():  # compile
    jax.block_until_ready(fn(params, opt_state, batch, key, masks[0]))
  times = {name: [] for name in fns}
  cpu = {name: 0.0 for name in fns}
  for _ in range(reps):
    for mask in masks:
      for name, fn in fns.items():
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, opt_state, batch, key, mask))
        times[name].append(time.perf_counter() - t0)
        cpu[name] += _cpu_seconds() - c0
  n = reps * len(masks)
  return times, {name: 1e3 * c / n for name, c in cpu.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--data_dir', default=None,
                      help='Shakespeare data (default: FEDLITE_DATA_DIR)')
  parser.add_argument('--model', default='transformer_small',
                      choices=sorted(lm.PRESETS))
  parser.add_argument('--clients', type=int, default=8, help='cohort size')
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--seq_len', type=int, default=30)
  parser.add_argument('--max_examples', type=int, default=64,
                      help='examples per client (64 = 4 local steps)')
  parser.add_argument('--rounds', type=int, default=3, help='timed rounds')
  parser.add_argument('--warmup', type=int, default=1, help='untimed rounds')
  parser.add_argument('--pvt', type=float, default=0.4)
  parser.add_argument('--upload', default='uniform_quantization:8',
                      help='upload stages (transforms.parse_chain), as the '
                      "runner's --upload")
  parser.add_argument('--num_masks', type=int, default=8,
                      help='PVT masks the client-step timing averages over')
  parser.add_argument('--step_reps', type=int, default=5)
  parser.add_argument('--engine', default='loop', choices=['loop', 'vmap'])
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--smoke', action='store_true',
                      help='tiny settings for the test suite')
  args = parser.parse_args()
  if args.smoke:
    args.model, args.clients, args.rounds, args.warmup = (
        'transformer_tiny', 2, 1, 1)
    args.max_examples, args.num_masks, args.step_reps = 32, 2, 2
  load = os.getloadavg()
  data_dir = args.data_dir or os.environ.get('FEDLITE_DATA_DIR')
  train, _, info = sentencepiece_vocab.load_shakespeare_sp(
      data_dir, sequence_length=args.seq_len)
  model = lm.create_lm(args.model, vocab_size=info.num_classes,
                       max_length=args.seq_len, oov_id=info.oov_id).model
  params = model.init(jax.random.PRNGKey(args.seed))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=args.batch_size,
                                        num_epochs=1)
  client_opt = optax.chain(optax.clip_by_global_norm(16.0), optax.sgd(0.1))
  server_opt = optax.adam(1e-2, b1=0.9, b2=0.999, eps=1e-8)
  upload = transforms.parse_chain(args.upload)
  name, _, bits = args.upload.partition(':')
  label = f'PVT {args.pvt:.0%} + ' + (
      f'{bits}-bit upload' if name == 'uniform_quantization' and
      bits.isdigit() else f'{args.upload} upload')
  algs = {
      'FedAvg': federated_averaging(grad_fn, client_opt, server_opt, hp,
                                    engine=args.engine),
      label: fedopt.federated_averaging(
          grad_fn, client_opt, server_opt, hp, engine=args.engine,
          compression=fedopt.Compression(upload=upload,
                                         pvt_fraction=args.pvt)),
  }
  cohorts = _cohorts(train, args)
  steps = [sum(-(-len(cds) // args.batch_size) for _, cds, _ in c)
           for c in cohorts[args.warmup:]]

  print(f'machine: {platform.platform()}, nproc={os.cpu_count()}, '
        f'loadavg at start={load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, '
        f'jax {jax.__version__} ({jax.default_backend()}), '
        f'engine={args.engine}')
  print(f'model={args.model} ({num_params:,} params), vocab '
        f'{info.num_classes}, seq_len={args.seq_len}, batch='
        f'{args.batch_size}, {args.clients} Shakespeare clients/round '
        f'(<= {args.max_examples} examples each, mean '
        f'{statistics.mean(steps):.1f} client-steps/round), '
        f'{args.rounds} timed rounds after {args.warmup} warm-up')

  times, cpu = _time_rounds(algs, params, cohorts, args.warmup)
  base = _median_ms(times['FedAvg'])
  base_min = min(times['FedAvg'])
  print(f'\n{"round":44s}{"median s":>9s}{"min s":>7s}{"cpu s":>7s}'
        f'{"overhead (median / min / cpu)":>32s}')
  for name, ts in times.items():
    med = _median_ms(ts)
    print(f'{name:44s}{med / 1e3:9.3f}{min(ts):7.3f}{cpu[name]:7.3f}'
          f'{100 * (med / base - 1):+12.1f}% {100 * (min(ts) / base_min - 1):+7.1f}%'
          f' {100 * (cpu[name] / cpu["FedAvg"] - 1):+7.1f}%')
  for name, ts in times.items():
    if name != 'FedAvg':
      print(f'ratio round {name} / FedAvg = {_median_ms(ts) / base:.3f} '
            f'(overhead {100 * (_median_ms(ts) / base - 1):+.1f}% median '
            f'wall, {100 * (min(ts) / base_min - 1):+.1f}% min wall, '
            f'{100 * (cpu[name] / cpu["FedAvg"] - 1):+.1f}% CPU)')

  plan = pvt.make_plan(params, args.pvt)
  masks = [np.asarray(pvt.sample_mask(plan, jax.random.PRNGKey(1000 + i)))
           for i in range(args.num_masks)]
  fractions = [pvt.realized_fraction(plan, m) for m in masks]
  batch = next(iter(cohorts[0][0][1].padded_batch(
      fedjax.PaddedBatchHParams(batch_size=args.batch_size))))
  fns = _step_fns(grad_fn, plan, client_opt)
  step_times, step_cpu = _time_steps(fns, params, client_opt.init(params),
                                     batch, masks, args.step_reps)
  full = _median_ms(step_times['full step'])
  print(f'\nclient step (1 batch of {args.batch_size} x {args.seq_len}), '
        f'{args.num_masks} PVT masks x {args.step_reps} reps; trained '
        f'fraction per mask mean {np.mean(fractions):.3f} (min '
        f'{min(fractions):.3f}, max {max(fractions):.3f}):')
  print(f'{"step":30s}{"median ms":>10s}{"min ms":>8s}{"cpu ms":>8s}'
        f'{"x full (median/min/cpu)":>26s}')
  full_min = min(step_times['full step'])
  for name, ts in step_times.items():
    med = _median_ms(ts)
    print(f'{name:30s}{med:10.1f}{min(ts) * 1e3:8.1f}{step_cpu[name]:8.1f}'
          f'{med / full:10.3f}{min(ts) / full_min:8.3f}'
          f'{step_cpu[name] / step_cpu["full step"]:8.3f}')
  name = 'PVT step, masked full grad'
  print(f'ratio {name} / full step = '
        f'{_median_ms(step_times[name]) / full:.3f} (median wall), '
        f'{min(step_times[name]) / full_min:.3f} (min wall), '
        f'{step_cpu[name] / step_cpu["full step"]:.3f} (CPU)')
  print(f'loadavg at end={os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
  main()
