#!/usr/bin/env python3
"""Rounds at accelerator scale: round engines x cohort sizes x models.

For each model, engine and cohort size it times FedAvg rounds and prints
rounds/s, peak memory, padded/useful local steps, the host share of a round
and the model FLOP utilization (MFU). Engines:

* ``loop``, ``vmap``: ``fedlite_jax.algorithms.federated_averaging`` with
  our round engines (``vmap``: chunks of ``--clients_per_chunk`` clients),
* ``fedjax_jit``: ``fedjax.algorithms.fed_avg`` with FedJAX's default ``jit``
  ``for_each_client`` backend,
* ``fedjax_vmap``: the same FedJAX algorithm with
  ``fedlite_jax.rounds.VmapBackend()``.

Models: the EMNIST CNN on FEMNIST (``femnist``; real data from
``--data_dir`` / ``$FEDLITE_DATA_DIR`` when present, a cohort larger than the
writers there repeats writers; else shape-equal synthetic 28x28x1 images, 62
classes), and the language models of ``fedlite_jax.models.lm`` (Ro et al.
2022, Table 1: ``lstm_small`` = Small CIFG-LSTM 4.7M, ``transformer_large``
= Large Transformer 21.0M; CPU presets ``lstm_tiny``, ``transformer_tiny``)
on shape-equal synthetic tokens (SentencePiece vocabulary 4,096, sequence
length 30, client batch 16). Synthetic per-client example counts are
lognormal (FEMNIST: median 200, sigma 0.45, in [8, 500], batch 20; LM:
median 48 sequences, sigma 1.0, in [1, 256]), drawn from ``--seed``.

Measurement (per model and engine, in its own process so that peak memory
is that configuration's; the clients, example counts and PRNG keys are the
same in every process, derived from ``--seed``, the round and the client):
the SAME sampled cohort every round (new keys, so new batch orders, each
round; the shapes repeat), one untimed warm-up round (compilation), then
``--rounds`` timed rounds (median).

* peak memory: ``device.memory_stats()['peak_bytes_in_use']`` (GPU/TPU), the
  process's peak RSS (CPU); the peak up to that cohort (cohorts run in
  ascending order).
* padded/useful: local steps executed (masked ones included) / useful local
  steps per round, from ``fedlite_jax.rounds.engine.recording_stats()``;
  FedJAX's ``jit`` backend runs exactly the useful steps; for
  ``VmapBackend`` the rows x steps of its vmapped programs.
* host share: seconds spent preparing client batches on the host (FedJAX's
  ``shuffle_repeat_batch`` / ``padded_batch`` iteration, and stacking the
  batches of a vmapped program, i.e. ``VmappedClients.__call__`` outside
  its compiled program) / the round's wall seconds.
* MFU: FLOPs of one client step (``cost_analysis()`` of the jitted gradient
  + SGD step on one batch; LSTM time loop unrolled so that XLA counts every
  step) x useful steps / wall seconds / the device's peak FLOP/s (table
  :data:`PEAK_FLOPS` by ``device_kind``: dense TF32 for float32 on NVIDIA
  GPUs (JAX's default matmul precision), bf16 on TPU). On CPU the peak is
  measured in the same process: a 2048x2048 float32 matmul.

A configuration that cannot run (out of memory, engine error, time budget:
``--max_seconds`` per configuration, estimated from the previous cohort
and the first timed round) prints a row with the reason. The table goes to
``benchmarks/results/rounds_<device>.md`` (``--output``).

  python benchmarks/bench_rounds.py            # GPU: 10, 100, 500 clients, < 30 min
  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_rounds.py \\
      --models=femnist --engines=loop --cohorts=10
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.models import lm
from fedlite_jax.rounds import VmapBackend
from fedlite_jax.rounds import engine as engine_lib
from fedlite_jax.training.runner import client_rng

ENGINES = ('loop', 'vmap', 'fedjax_jit', 'fedjax_vmap')
LM_MODELS = tuple(lm.PRESETS)
MODELS = ('femnist',) + LM_MODELS

#: Dense peak FLOP/s per device for the float32 programs benchmarked here,
#: matched by substring of ``device_kind`` in order: NVIDIA GPUs run float32
#: matmuls as TF32 under JAX's default precision, TPUs as bf16 passes.
#: Sources: NVIDIA H100/H200/A100 data sheets (dense TF32), Google Cloud TPU
#: system architecture pages (bf16 per chip; v2/v3 JAX devices are cores).
PEAK_FLOPS = (
    ('H100 PCIe', 378e12),
    ('H100', 494.7e12),   # SXM / HBM3
    ('H200', 494.7e12),
    ('A100', 156e12),
    ('TPU v6 lite', 918e12),
    ('TPU v5 lite', 197e12),
    ('TPU v5p', 459e12),
    ('TPU v5', 459e12),
    ('TPU v4', 275e12),
    ('TPU v3', 61.5e12),
    ('TPU v2', 22.5e12),
)

FEMNIST_BATCH = 20
LM_BATCH = 16
LM_LENGTH = lm.DEFAULT_MAX_LENGTH
LM_VOCAB = lm.DEFAULT_VOCAB_SIZE


# --------------------------------------------------------------------------
# Data.

def _lognormal_counts(n: int, median: float, sigma: float, lo: int, hi: int,
                      rng: np.random.RandomState) -> np.ndarray:
  return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))),
                 lo, hi).astype(int)


def _synthetic_clients(model: str, cohort: int, seed: int,
                       max_examples: int) -> list[tuple[bytes, Any]]:
  """``cohort`` synthetic clients: views into one shared example pool."""
  rng = np.random.RandomState(seed)
  if model == 'femnist':
    counts = _lognormal_counts(cohort, 200, 0.45, 8, 500, rng)
    pool_n = 1024
    pool = {'x': rng.uniform(0, 1, (pool_n, 28, 28, 1)).astype(np.float32),
            'y': rng.randint(0, 62, pool_n).astype(np.int32)}
  else:
    counts = _lognormal_counts(cohort, 48, 1.0, 1, 256, rng)
    pool_n = 1024
    tokens = rng.randint(4, LM_VOCAB, (pool_n, LM_LENGTH + 1)).astype(np.int32)
    pool = {'x': tokens[:, :-1], 'y': tokens[:, 1:]}
  if max_examples:
    counts = np.minimum(counts, max_examples)
  clients = []
  for i, n in enumerate(counts):
    start = rng.randint(0, pool_n - n + 1)
    clients.append((f'synthetic{i:05d}'.encode(), fedjax.ClientDataset(
        {k: v[start:start + n] for k, v in pool.items()})))
  return clients


_FEMNIST: dict[Optional[str], Any] = {}


def _femnist_clients(data_dir: Optional[str], cohort: int, seed: int,
                     max_examples: int):
  """Real FEMNIST writers (repeated with new ids if too few), or None."""
  if data_dir not in _FEMNIST:
    try:
      _FEMNIST[data_dir] = datasets.load_federated_data('emnist', data_dir)[0]
    except Exception:  # pylint: disable=broad-except  # No data: synthetic.
      _FEMNIST[data_dir] = None
  train = _FEMNIST[data_dir]
  if train is None:
    return None
  ids = sorted(cid for cid, _ in train.client_sizes())
  rng = np.random.RandomState(seed)
  order = rng.permutation(len(ids))
  clients = []
  for i in range(cohort):
    cid = ids[order[i % len(ids)]]
    cds = train.get_client(cid)
    if max_examples:
      cds = cds[:max_examples]
    clients.append((cid if i < len(ids) else cid + f'#{i}'.encode(), cds))
  return clients


# --------------------------------------------------------------------------
# Host-time and executed-step accounting (wraps FedJAX's batching and the
# vmapped program's host side for the duration of the benchmark).

class HostClock:
  """Seconds spent preparing client batches on the host, and vmapped rows x steps."""

  def __init__(self):
    self.seconds = 0.0
    self.batches = 0
    self.vmapped_steps = 0

  def reset(self) -> None:
    self.seconds, self.batches, self.vmapped_steps = 0.0, 0, 0


class _TimedBatches:

  def __init__(self, iterable, clock: HostClock):
    self._iterable, self._clock = iterable, clock

  def __iter__(self):
    t = time.perf_counter()
    it = iter(self._iterable)
    self._clock.seconds += time.perf_counter() - t
    while True:
      t = time.perf_counter()
      try:
        batch = next(it)
      except StopIteration:
        self._clock.seconds += time.perf_counter() - t
        return
      self._clock.seconds += time.perf_counter() - t
      self._clock.batches += 1
      yield batch


@contextlib.contextmanager
def timing_host(clock: HostClock):
  """Installs the host-time wrappers; restores the originals on exit."""
  cds_cls = fedjax.ClientDataset
  vc_cls = engine_lib.VmappedClients
  saved = (cds_cls.shuffle_repeat_batch, cds_cls.padded_batch,
           vc_cls.__call__)

  def batching(original):
    def wrapped(self, *args, **kwargs):
      return _TimedBatches(original(self, *args, **kwargs), clock)
    return wrapped

  def vmapped_call(self, shared_input, client_batches, client_inputs, steps,
                   cohort_size=None, **kwargs):
    run = self._run  # pylint: disable=protected-access
    spent = [0.0]

    def timed_run(*args):
      t = time.perf_counter()
      out = run(*args)
      spent[0] += time.perf_counter() - t
      return out

    self._run = timed_run  # pylint: disable=protected-access
    t0 = time.perf_counter()
    try:
      out = saved[2](self, shared_input, client_batches, client_inputs,
                     steps, cohort_size, **kwargs)
    finally:
      self._run = run  # pylint: disable=protected-access
    clock.seconds += time.perf_counter() - t0 - spent[0]
    rows = kwargs.get('lanes') or cohort_size or len(client_batches)
    clock.vmapped_steps += int(rows) * int(steps)
    return out

  cds_cls.shuffle_repeat_batch = batching(saved[0])
  cds_cls.padded_batch = batching(saved[1])
  vc_cls.__call__ = vmapped_call
  try:
    yield clock
  finally:
    cds_cls.shuffle_repeat_batch, cds_cls.padded_batch = saved[:2]
    vc_cls.__call__ = saved[2]


# --------------------------------------------------------------------------
# Device facts.

def device_name() -> str:
  kind = jax.devices()[0].device_kind
  return re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_') or 'device'


def peak_flops_table(kind: str) -> Optional[float]:
  """The :data:`PEAK_FLOPS` entry for a ``device_kind``, or None."""
  for key, flops in PEAK_FLOPS:
    if key.lower() in kind.lower():
      return flops
  return None


def measured_matmul_flops(n: int = 2048, reps: int = 5) -> float:
  """FLOP/s of the best of ``reps`` float32 [n,n]@[n,n] matmuls (CPU reference)."""
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = math.inf
  for _ in range(reps):
    t = time.perf_counter()
    f(a).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return 2 * n**3 / best


_REFERENCE: list[float] = []


def _cpu_reference_flops() -> float:
  """measured_matmul_flops, once per process."""
  if not _REFERENCE:
    _REFERENCE.append(measured_matmul_flops())
  return _REFERENCE[0]


def peak_memory_bytes() -> tuple[int, str]:
  """(bytes, source): the device allocator's peak, else the process peak RSS."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends without stats.
    stats = None
  if stats and 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use']), 'device peak_bytes_in_use'
  return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          'process peak RSS')


def step_flops(model: fedjax.Model, params: Any, batch: dict) -> float:
  """XLA's FLOP count of one client step (gradient + SGD update, one batch)."""
  grad_fn = fedjax.model_grad(model)

  def step(p, b):
    g = grad_fn(p, b, jax.random.PRNGKey(0))
    return jax.tree.map(lambda x, y: x - 0.1 * y, p, g)

  cost = jax.jit(step).lower(params, batch).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float((cost or {}).get('flops', float('nan')))


# --------------------------------------------------------------------------
# One (model, engine) process.

def _model(name: str, for_flops: bool = False) -> fedjax.Model:
  if name == 'femnist':
    return models.create_emnist_cnn(62).model
  unroll = LM_LENGTH if for_flops else 1
  return lm.create_lm(name, LM_VOCAB, lstm_unroll=unroll).model


def _algorithm(engine: str, model: fedjax.Model, batch_size: int,
               clients_per_chunk):
  grad_fn = fedjax.model_grad(model)
  if engine in ('loop', 'vmap'):
    hp = fedjax.ShuffleRepeatBatchHParams(batch_size=batch_size)
    return federated_averaging(grad_fn, optax.sgd(0.1), optax.sgd(1.0), hp,
                               engine=engine,
                               clients_per_chunk=clients_per_chunk)
  backend = 'jit' if engine == 'fedjax_jit' else VmapBackend()
  # FedJAX binds the backend when the algorithm is built.
  with fedjax.for_each_client_backend(backend):
    return fedjax.algorithms.fed_avg.federated_averaging(
        grad_fn, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=batch_size, seed=0))


def _short(err: BaseException) -> str:
  text = f'{type(err).__name__}: {err}'.splitlines()[0]
  if 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower():
    return 'out of memory: ' + text[:160]
  return text[:200]


def run_worker(args, emit: bool = False) -> list[dict]:
  """Rows for one model and engine over the cohorts (ascending)."""
  name, engine = args.models, args.engines
  batch_size = FEMNIST_BATCH if name == 'femnist' else LM_BATCH
  model = _model(name)
  params = model.init(jax.random.PRNGKey(args.seed))
  cpc = (args.clients_per_chunk if args.clients_per_chunk == 'auto'
         else int(args.clients_per_chunk))
  kind = jax.devices()[0].device_kind
  peak = peak_flops_table(kind)
  peak_source = f'table ({kind})'
  if peak is None:
    peak, peak_source = _cpu_reference_flops(), 'measured f32 matmul'
  clock = HostClock()
  rows = []
  flops = None
  data_source = 'synthetic'
  last = None  # (cohort, seconds per round, compile seconds) of the last cohort
  deadline = args.deadline or math.inf
  failed = None
  for cohort in sorted(args.cohorts):
    row = {'model': name, 'engine': engine, 'cohort': cohort}
    rows.append(row)
    if failed:
      row['skip'] = f'not run: {failed}'
      continue
    estimate = 0.0 if not last else (
        last[2] + last[1] * cohort / last[0] * (args.rounds + 1))
    if estimate > args.max_seconds:
      row['skip'] = (f'estimated {estimate:.0f} s > '
                     f'--max_seconds={args.max_seconds:g}')
      continue
    if time.time() + estimate > deadline:
      row['skip'] = 'over the run\'s --total_seconds budget'
      continue
    clients = None
    t_load = time.perf_counter()
    if name == 'femnist':
      clients = _femnist_clients(args.data_dir, cohort, args.seed,
                                 args.max_examples)
      if clients is not None:
        data_source = 'real FEMNIST'
    if clients is None:
      clients = _synthetic_clients(name, cohort, args.seed, args.max_examples)
    row['data'] = data_source
    row['load_s'] = time.perf_counter() - t_load
    useful = sum(-(-len(cds) // batch_size) for _, cds in clients)
    try:
      if flops is None:
        batch = next(iter(clients[0][1].padded_batch(batch_size=batch_size)))
        batch = {k: v for k, v in batch.items()
                 if k != fedjax.EXAMPLE_MASK_KEY}
        flops = step_flops(_model(name, for_flops=True), params, batch)
      alg = _algorithm(engine, model, batch_size, cpc)
      state = alg.init(params)

      def cohort_for(r):
        return [(cid, cds, client_rng(args.seed, r, cid))
                for cid, cds in clients]

      start = time.perf_counter()
      with timing_host(clock), engine_lib.recording_stats() as rec:
        state, _ = alg.apply(state, cohort_for(0))
        jax.block_until_ready(state.params)
        row['warmup_s'] = time.perf_counter() - start
        rec.take()
        walls, hosts, padded = [], [], []
        for r in range(1, args.rounds + 1):
          clock.reset()
          t0 = time.perf_counter()
          state, _ = alg.apply(state, cohort_for(r))
          jax.block_until_ready(state.params)
          walls.append(time.perf_counter() - t0)
          hosts.append(clock.seconds)
          stats = rec.take()
          if stats['clients']:
            if stats['client_steps'] != useful:
              raise AssertionError(f'engine counted {stats["client_steps"]} '
                                   f'useful steps, expected {useful}')
            padded.append(stats['padded_steps'])
            row['clients_per_chunk'] = stats['clients_per_chunk']
            row['chunks'] = stats['chunks']
          elif engine == 'fedjax_vmap':
            padded.append(clock.vmapped_steps)
          else:  # FedJAX's jit backend: one call per useful step.
            if clock.batches != useful:
              raise AssertionError(f'FedJAX ran {clock.batches} batches, '
                                   f'expected {useful}')
            padded.append(clock.batches)
          elapsed = time.perf_counter() - start
          if (elapsed + walls[-1] > args.max_seconds or
              time.time() + walls[-1] > deadline):
            break
    except Exception as err:  # pylint: disable=broad-except
      row['skip'] = _short(err)
      failed = f'failed at cohort {cohort}'
      continue
    wall = statistics.median(walls)
    last = (cohort, wall, max(row['warmup_s'] - wall, 0.0))
    mem, mem_source = peak_memory_bytes()
    row.update(
        rounds=len(walls), s_per_round=wall, rounds_per_s=1 / wall,
        peak_mem_bytes=mem, mem_source=mem_source, useful_steps=useful,
        padded_steps=max(padded), host_share=sum(hosts) / sum(walls),
        step_flops=flops, mfu=flops * useful / wall / peak, peak_flops=peak,
        peak_source=peak_source)
    if emit:
      print('ROW ' + json.dumps(row), flush=True)
  return rows


def _worker_cmd(args, model: str, engine: str) -> list[str]:
  cmd = [sys.executable, os.path.abspath(__file__), '--worker',
         f'--models={model}', f'--engines={engine}',
         f'--cohorts={",".join(map(str, args.cohorts))}',
         f'--rounds={args.rounds}', f'--max_seconds={args.max_seconds}',
         f'--clients_per_chunk={args.clients_per_chunk}',
         f'--max_examples={args.max_examples}', f'--seed={args.seed}']
  if args.data_dir:
    cmd.append(f'--data_dir={args.data_dir}')
  return cmd


def _run_isolated(args, model: str, engine: str, budget: float
                  ) -> list[dict]:
  """The worker's rows; rows it could not finish within ``budget`` s are skips."""
  cmd = _worker_cmd(args, model, engine) + [
      f'--deadline={time.time() + budget:.0f}']
  why = None
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=budget + 60)
    stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
  except subprocess.TimeoutExpired as err:
    stdout = (err.stdout or b'').decode() if isinstance(
        err.stdout, bytes) else (err.stdout or '')
    stderr, code = '', None
    why = f'process killed after {budget + 60:.0f} s'
  lines = stdout.splitlines()
  final = [l for l in lines if l.startswith('ROWS ')]
  if code == 0 and final:
    return json.loads(final[-1][5:])
  if why is None:
    tail = (stderr.strip().splitlines() or ['no output'])[-1]
    why = f'process exited {code}: {tail[:160]}'
  done = {}
  for l in lines:
    if l.startswith('ROW '):
      row = json.loads(l[4:])
      done[row['cohort']] = row
  return [done.get(c) or {'model': model, 'engine': engine, 'cohort': c,
                          'skip': why} for c in sorted(args.cohorts)]


# --------------------------------------------------------------------------
# Report.

def _speedups(rows: list[dict]) -> dict[int, str]:
  """Row index -> FedJAX ``jit`` s/round / this row's s/round, same run."""
  ref = {(r['model'], r['cohort']): r['s_per_round'] for r in rows
         if r['engine'] == 'fedjax_jit' and 'skip' not in r}
  return {i: f'{ref[(r["model"], r["cohort"])] / r["s_per_round"]:.2f}x'
          for i, r in enumerate(rows)
          if 'skip' not in r and (r['model'], r['cohort']) in ref}


def _fmt_row(row: dict, speedup: str = '') -> str:
  head = f'| {row["model"]} | {row["engine"]} | {row["cohort"]:,} |'
  if 'skip' in row:
    return head + f' skipped: {row["skip"]} | | | | | | |'
  return head + (
      f' {row["rounds_per_s"]:.3g} | {row["s_per_round"]:.3g} | {speedup} |'
      f' {row["peak_mem_bytes"] / 2**20:,.0f} |'
      f' {row["padded_steps"]:,} / {row["useful_steps"]:,}'
      f' ({row["padded_steps"] / row["useful_steps"]:.2f}x) |'
      f' {100 * row["host_share"]:.1f}% | {100 * row["mfu"]:.2f}%'
      + (f' of {row["peak_flops"] / 1e9:.0f} GFLOP/s'
         if row['peak_source'].startswith('measured') else '') + ' |')


def _table(rows: list[dict]) -> str:
  ups = _speedups(rows)
  return '\n'.join([TABLE_HEAD] + [_fmt_row(r, ups.get(i, ''))
                                   for i, r in enumerate(rows)])


TABLE_HEAD = ('| model | engine | cohort | rounds/s | s/round | vs FedJAX jit '
              '| peak mem (MiB) | padded / useful steps | host share | MFU |\n'
              '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return '?'


def _machine() -> str:
  cpu = platform.processor() or platform.machine()
  try:
    for line in open('/proc/cpuinfo'):
      if line.startswith('model name'):
        cpu = line.split(':', 1)[1].strip()
        break
  except OSError:
    pass
  devs = jax.devices()
  return (f'{len(devs)} x {devs[0].device_kind} ({jax.default_backend()}); '
          f'host {cpu}, {os.cpu_count()} CPU threads')


def _defaults(args) -> None:
  cpu = jax.default_backend() == 'cpu'
  if args.models is None:
    args.models = ('femnist,lstm_tiny,transformer_tiny' if cpu else
                   'femnist,lstm_small,transformer_large')
  if args.cohorts is None:
    args.cohorts = '10' if cpu else '10,100,500'
  if args.rounds is None:
    args.rounds = 2 if cpu else 3
  if args.max_seconds is None:
    args.max_seconds = 120.0 if cpu else 150.0
  if args.total_seconds is None:
    args.total_seconds = 3600.0 if cpu else 1800.0
  args.cohorts = [int(c) for c in str(args.cohorts).split(',')]
  bad = [c for c in args.cohorts if c < 1]
  if bad:
    raise SystemExit(f'--cohorts must be positive ints; got {bad}.')
  if args.clients_per_chunk != 'auto' and not (
      args.clients_per_chunk.isdigit()):
    raise SystemExit(f"--clients_per_chunk must be 'auto' or an int >= 0; "
                     f'got {args.clients_per_chunk!r}.')


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--models', default=None,
                      help=f'comma list of {", ".join(MODELS)} (default: '
                      'femnist,lstm_small,transformer_large on GPU/TPU; '
                      'femnist,lstm_tiny,transformer_tiny on CPU)')
  parser.add_argument('--engines', default=','.join(ENGINES),
                      help=f'comma list of {", ".join(ENGINES)}')
  parser.add_argument('--cohorts', default=None,
                      help='clients per round, comma list (default 10,100,500; '
                      '10 on CPU)')
  parser.add_argument('--rounds', type=int, default=None,
                      help='timed rounds (default 3; 2 on CPU)')
  parser.add_argument('--max_seconds', type=float, default=None,
                      help='time budget per configuration (default 150; 120 on '
                      'CPU)')
  parser.add_argument('--clients_per_chunk', default='auto',
                      help="vmap engine: clients per chunk, int (0: whole "
                      "cohort) or 'auto'")
  parser.add_argument('--data_dir', default=None,
                      help='FEMNIST data (default $FEDLITE_DATA_DIR)')
  parser.add_argument('--max_examples', type=int, default=0,
                      help='cap on examples per client (0: none; smoke tests)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--output', default=None,
                      help='results file (default benchmarks/results/'
                      'rounds_<device>.md; "-": none)')
  parser.add_argument('--isolate', default=True,
                      action=argparse.BooleanOptionalAction,
                      help='one process per model and engine (peak memory '
                      'per configuration; survives crashes)')
  parser.add_argument('--total_seconds', type=float, default=None,
                      help='time budget of the whole run, shared fairly by '
                      'the (model, engine) processes (default 1800; 3600 on '
                      'CPU)')
  parser.add_argument('--merge', default=None,
                      help='comma list of results files of this script: '
                      'writes them as one file (--output), one section '
                      'each, and runs nothing')
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--deadline', type=float, default=0,
                      help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.merge:
    if not args.output or args.output == '-':
      raise SystemExit('--merge needs --output=<file>.')
    _write_report(args.output, [run for path in args.merge.split(',')
                                for run in read_report(path)])
    print(f'wrote {args.output}')
    return
  _defaults(args)
  if args.worker:
    print('ROWS ' + json.dumps(run_worker(args, emit=True)), flush=True)
    return
  model_list = args.models.split(',')
  engine_list = args.engines.split(',')
  for m in model_list:
    if m not in MODELS:
      raise SystemExit(f'--models: unknown {m!r}; allowed: {", ".join(MODELS)}.')
  for e in engine_list:
    if e not in ENGINES:
      raise SystemExit(f'--engines: unknown {e!r}; allowed: '
                       f'{", ".join(ENGINES)}.')
  command = 'python benchmarks/bench_rounds.py ' + ' '.join(
      sys.argv[1:] if argv is None else argv)
  header = [f'command: `{command.strip()}`',
            f'machine: {_machine()}',
            f'jax {jax.__version__}, jaxlib '
            f'{_version("jaxlib")}, fedjax {_version("fedjax")}, python '
            f'{platform.python_version()}',
            f'cohorts {args.cohorts}, {args.rounds} timed rounds after one '
            f'warm-up round, --max_seconds={args.max_seconds:g}, '
            f'--clients_per_chunk={args.clients_per_chunk}, '
            f'--total_seconds={args.total_seconds:g}']
  print('\n'.join(header), flush=True)
  print(TABLE_HEAD, flush=True)
  rows = []
  configs = [(m, e) for m in model_list for e in engine_list]
  end = time.time() + args.total_seconds
  for i, (m, e) in enumerate(configs):
    if args.isolate:
      # Fair share of what is left of the run's budget.
      budget = max(end - time.time(), 0) / (len(configs) - i)
      got = _run_isolated(args, m, e, budget)
    else:
      sub = argparse.Namespace(**{**vars(args), 'models': m, 'engines': e,
                                  'deadline': end})
      got = run_worker(sub)
    for row in got:
      print(_fmt_row(row), flush=True)  # Ratios: in the file.
    rows.extend(got)
  for n in _notes(rows):
    print(n)
  output = args.output or os.path.join(
      os.path.dirname(os.path.abspath(__file__)), 'results',
      f'rounds_{device_name()}.md')
  if output != '-':
    _write_report(output, [(header, rows)])
    print(f'wrote {output}')


def _notes(rows: list[dict]) -> list[str]:
  done = [r for r in rows if 'skip' not in r]
  notes = []
  if done:
    r0 = done[0]
    notes.append(f'peak memory: {r0["mem_source"]}; MFU against '
                 f'{r0["peak_flops"] / 1e12:.3g} TFLOP/s ({r0["peak_source"]}); '
                 'vs FedJAX jit: FedJAX\'s `jit` s/round at the same model and '
                 'cohort in the same run / this row\'s; data: ' +
                 ', '.join(sorted({f'{r["model"]}: {r["data"]}'
                                   for r in done})))
    for r in done:
      if r['data'] != 'synthetic':
        notes.append(
            f'{r["model"]} {r["engine"]} cohort {r["cohort"]}: reading the '
            f'cohort\'s {r["data"]} clients from storage took '
            f'{r["load_s"]:.3g} s, once, before the timed rounds (not in the '
            f'host share; per round it would be '
            f'{100 * (r["host_share"] * r["s_per_round"] + r["load_s"]) / (r["s_per_round"] + r["load_s"]):.1f}%)')
      if 'chunks' in r and r['engine'] == 'vmap':
        notes.append(f'{r["model"]} vmap cohort {r["cohort"]}: '
                     f'clients_per_chunk={r["clients_per_chunk"]}, '
                     f'{r["chunks"]} chunk(s)')
  return notes


def _write_report(output: str, runs: list[tuple[list[str], list[dict]]]
                  ) -> None:
  """Writes one section per (header lines, rows) run, rows kept as JSON."""
  pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
  parts = ['# Rounds at accelerator scale: bench_rounds.py\n']
  for i, (header, rows) in enumerate(runs):
    if len(runs) > 1:
      parts.append(f'## Run {i + 1}\n')
    parts += ['\n'.join(f'- {h}' for h in header) + '\n', _table(rows) + '\n',
              '\n'.join(f'- {n}' for n in _notes(rows)) + '\n',
              '<!-- header: ' + json.dumps(header) + ' -->\n'
              '<!-- rows: ' + json.dumps(rows) + ' -->\n']
  with open(output, 'w') as f:
    f.write('\n'.join(parts))


def read_report(path: str) -> list[tuple[list[str], list[dict]]]:
  """The (header lines, rows) runs of a file that :func:`main` wrote."""
  text = pathlib.Path(path).read_text()
  rows = [json.loads(m) for m in re.findall(r'<!-- rows: (.*) -->', text)]
  heads = [json.loads(m) for m in re.findall(r'<!-- header: (.*) -->', text)]
  if not heads:  # Files written before headers were stored: the bullets.
    heads = [[l[2:] for l in text.split('\n\n')[1].splitlines()]]
  if not rows or len(heads) != len(rows):
    raise SystemExit(f'--merge: {path} holds no bench_rounds.py rows.')
  return list(zip(heads, rows))


if __name__ == '__main__':
  main()
