#!/usr/bin/env python3
"""Rounds as training runs them: round engines x cohort sizes x models.

For each model, engine and cohort size it runs ``--rounds`` FedAvg rounds,
each on a FRESH cohort drawn from the population (as training does), and
prints the steady round time, the wall time of the whole run with
compilation, the compilations of the run (JAX's own compile events) and
their seconds, peak memory, sequential steps per round, executed/useful
local steps, the host share of a round and the model FLOP utilization.
Engines:

* ``loop``, ``vmap``: ``fedlite_jax.algorithms.federated_averaging`` with
  our round engines (``vmap``: ``--lanes_per_device`` lanes that stream
  clients, ``--segment_steps`` steps per compiled segment),
* ``fedjax_jit``: ``fedjax.algorithms.fed_avg`` with FedJAX's default ``jit``
  ``for_each_client`` backend (always float32: the reference),
* ``fedjax_vmap``: the same FedJAX algorithm with
  ``fedlite_jax.rounds.VmapBackend()``.

Models: the EMNIST CNN on FEMNIST (``femnist``; the real writers under
``--data_dir`` / ``$FEDLITE_DATA_DIR`` when present, a cohort larger than
the writers repeats writers under new ids; else shape-equal synthetic 28x28x1
images, 62 classes), and the language models of ``fedlite_jax.models.lm``
(Ro et al. 2022, Table 1: ``lstm_small`` = Small CIFG-LSTM 4.7M,
``transformer_large`` = Large Transformer 21.0M; CPU presets ``lstm_tiny``,
``transformer_tiny``) on shape-equal synthetic tokens (SentencePiece
vocabulary 4,096, sequence length 30, client batch 16). Synthetic
populations hold ``max(4 x cohort, 1,000)`` clients whose example counts
are lognormal (FEMNIST: median 200, sigma 0.45, in [8, 500], batch 20; LM:
median 48 sequences, sigma 1.0, in [1, 256]), drawn from ``--seed``.

Measurement (per model and engine, in its own process with ``--isolate``;
cohorts, example counts and PRNG keys are the same in every process, from
``--seed``, the round and the client):

* s/round: median of the rounds after the first (steady state); run wall:
  every round, compilation included; compilations: XLA compilations during
  the run (``jax.monitoring``), the client program's (``lanes_*`` /
  ``loop_*``) apart, and their seconds.
* sequential steps: local steps the round runs one after another (the loop
  engine and FedJAX's jit backend: every useful step; the vmap engine: its
  lane plan's steps), mean over rounds; executed/useful: lane-steps run,
  masked ones included, over useful steps.
* peak memory: ``device.memory_stats()['peak_bytes_in_use']`` (GPU/TPU), the
  process's peak RSS (CPU); the peak up to that cohort's timed rounds,
  read before its profiled round (``--fixed_cost``), whose trace buffers
  are the profiler's (a smaller cohort's profiled round before it counts).
* host share: seconds preparing client batches on the host (FedJAX's
  batching, and stacking a segment's batches) / the round's wall seconds.
* MFU: FLOPs of one client step x useful steps / wall seconds / the
  device's peak FLOP/s. The step's FLOPs are XLA's ``cost_analysis()`` of
  the jitted gradient + SGD step on one batch as lowered for the CPU (not
  compiled: XLA:GPU's compiled count leaves cuDNN convolutions out), on
  every backend; LSTM time loop unrolled so that XLA counts every step. Peaks: :data:`PEAK_FLOPS` by ``device_kind``
  (dense TF32 for float32 on NVIDIA GPUs, JAX's default matmul precision;
  dense BF16 with ``--compute_dtype=bfloat16``; bf16 on TPU); on CPU a
  2048x2048 float32 matmul measured in the same process.

* fixed s of profiled round (``vmap``, ``fedjax_vmap``; ``--fixed_cost``):
  one extra round under ``jax.profiler.trace``, its wall time minus its
  ``lanes_segment`` executions in the trace (``fixed_cost``): what a round
  costs besides its lane segments. Tracing adds host time to that round:
  its wall time is printed beside it.
* vs FedJAX jit / vs loop: that engine's s/round at the same model and
  cohort / the row's; those engines run first for each model, so every
  printed row carries its ratios.

A configuration that cannot run (out of memory, engine error, time budget:
``--max_seconds`` per configuration, by :func:`estimate_seconds` and
:func:`skip_reason`) prints a row with the reason. The table goes to
``benchmarks/results/rounds_<device>.md`` (``--output``), rewritten after
every row, so a killed run keeps the rows it finished; the notes give each
configuration's whole wall time beside its runs' time. ``--profile`` runs
``benchmarks/profile_rounds.py`` on each row's configuration after it.
``--variants`` adds vmap rows in the vmap configuration's process, each
with some of its flags changed (e.g. ``data_on_device=off;lane_starts=
scatter``), after the row with the flags as given: an A/B on the same
cohorts, data and machine without a process start and data load per
variant; the notes give each one's s/round against that row.

  python benchmarks/bench_rounds.py            # GPU: 10, 100, 1,000 clients
  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_rounds.py \\
      --models=femnist --engines=loop,vmap --cohorts=10 --no-isolate
  python benchmarks/bench_rounds.py --models=femnist --engines=vmap \\
      --cohorts=100 --variants='data_on_device=off;segment_loop=fixed'
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
from jax.experimental.compilation_cache import compilation_cache

from fedlite_jax import cpu_allocator
from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.algorithms import batching as batching_lib
from fedlite_jax.algorithms import federated_averaging
from fedlite_jax.models import layers
from fedlite_jax.models import lm
from fedlite_jax.rounds import VmapBackend
from fedlite_jax.rounds import device_rows
from fedlite_jax.rounds import stats as stats_lib
from fedlite_jax.rounds import streaming
from fedlite_jax.training.loop import client_rngs

ENGINES = ('loop', 'vmap', 'fedjax_jit', 'fedjax_vmap')
#: Engines whose client programs are lanes_begin / lanes_segment /
#: lanes_finish (the fixed-cost column).
LANE_ENGINES = ('vmap', 'fedjax_vmap')
#: Engines run first for each model, so that every later row's ratios
#: against them can be printed with the row.
REFERENCE_ENGINES = ('fedjax_jit', 'loop')
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
#: Dense BF16 peaks of the NVIDIA GPUs above (data sheets), for
#: ``--compute_dtype=bfloat16``; TPUs' entries above are already bf16.
PEAK_BF16_FLOPS = (
    ('H100 PCIe', 756e12),
    ('H100', 989.4e12),
    ('H200', 989.4e12),
    ('A100', 312e12),
)

FEMNIST_BATCH = 20
LM_BATCH = 16
LM_LENGTH = lm.DEFAULT_MAX_LENGTH
LM_VOCAB = lm.DEFAULT_VOCAB_SIZE

#: ``--variants`` options (the vmap engine's flags of the same names) and
#: their allowed values (a type where any value of it is allowed).
VARIANT_OPTIONS: dict[str, Any] = {
    'lanes_per_device': str,
    'segment_steps': int,
    'segment_loop': streaming.LOOPS,
    'prefetch': bool,
    'lane_starts': streaming.STARTS,
    'data_on_device': device_rows.SETTINGS,
    'conv_implementation': ('auto',) + layers.CONV_IMPLEMENTATIONS,
    'compute_dtype': ('float32', 'bfloat16'),
}


def parse_variants(text: str) -> list[dict[str, Any]]:
  """``--variants``: ``'a=x,b=y;c=z'`` -> ``[{'a': x, 'b': y}, {'c': z}]``,
  values converted to the option's type (``prefetch``: true/false).

  Raises:
    SystemExit: one line naming the bad item and what is allowed.
  """
  variants = []
  for item in filter(None, (t.strip() for t in (text or '').split(';'))):
    variant: dict[str, Any] = {}
    for pair in item.split(','):
      key, sep, value = (p.strip() for p in pair.partition('='))
      allowed = VARIANT_OPTIONS.get(key)
      if not sep or allowed is None:
        raise SystemExit(
            f'--variants: {pair!r} is not option=value with an option of '
            f'{", ".join(VARIANT_OPTIONS)}.')
      if allowed is bool:
        if value not in ('true', 'false'):
          raise SystemExit(f'--variants: {key}={value!r}: allowed values '
                           'are true, false.')
        variant[key] = value == 'true'
      elif allowed is int:
        if not (value.isdigit() and int(value) >= 1):
          raise SystemExit(f'--variants: {key}={value!r}: must be an int '
                           '>= 1.')
        variant[key] = int(value)
      elif allowed is str:
        if value != 'auto' and not (value.isdigit() and int(value) >= 1):
          raise SystemExit(f"--variants: {key}={value!r}: must be 'auto' or "
                           'an int >= 1.')
        variant[key] = value
      else:
        if value not in allowed:
          raise SystemExit(f'--variants: {key}={value!r}: allowed values '
                           f'are {", ".join(allowed)}.')
        variant[key] = value
    variants.append(variant)
  return variants


def variant_label(variant: dict[str, Any]) -> str:
  """``'a=x,b=y'`` (``''`` for the flags as given)."""
  return ','.join(f'{k}={str(v).lower() if isinstance(v, bool) else v}'
                  for k, v in variant.items())


# --------------------------------------------------------------------------
# Data: a population of clients, a fresh cohort every round.

def _lognormal_counts(n: int, median: float, sigma: float, lo: int, hi: int,
                      rng: np.random.RandomState) -> np.ndarray:
  return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))),
                 lo, hi).astype(int)


def _synthetic_population(model: str, size: int, seed: int,
                          max_examples: int) -> list[tuple[bytes, Any]]:
  """``size`` synthetic clients: views into one shared example pool."""
  rng = np.random.RandomState(seed)
  if model == 'femnist':
    counts = _lognormal_counts(size, 200, 0.45, 8, 500, rng)
    pool_n = 1024
    pool = {'x': rng.uniform(0, 1, (pool_n, 28, 28, 1)).astype(np.float32),
            'y': rng.randint(0, 62, pool_n).astype(np.int32)}
  else:
    counts = _lognormal_counts(size, 48, 1.0, 1, 256, rng)
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


def _femnist_population(data_dir: Optional[str], size: int,
                        max_examples: int):
  """Real FEMNIST writers (repeated under new ids up to ``size``), or None."""
  if data_dir not in _FEMNIST:
    try:
      _FEMNIST[data_dir] = datasets.load_federated_data('emnist', data_dir)[0]
    except Exception:  # pylint: disable=broad-except  # No data: synthetic.
      _FEMNIST[data_dir] = None
  train = _FEMNIST[data_dir]
  if train is None:
    return None
  ids = sorted(cid for cid, _ in train.client_sizes())
  writers = dict(train.get_clients(ids))
  clients = []
  for i in range(max(size, len(ids))):
    cid = ids[i % len(ids)]
    cds = writers[cid]
    if max_examples:
      cds = cds[:max_examples]
    clients.append((cid if i < len(ids) else cid + f'#{i}'.encode(), cds))
  return clients


def population(model: str, cohort: int, seed: int, max_examples: int,
               data_dir: Optional[str]) -> tuple[list, str]:
  """``(clients, data description)``: at least ``max(4 cohort, 1000)``
  synthetic clients, or the real FEMNIST writers (repeated under new ids
  when the cohort is larger)."""
  if model == 'femnist':
    real = _femnist_population(data_dir, cohort, max_examples)
    if real is not None:
      return real, 'real FEMNIST'
  size = max(4 * cohort, 1000)
  return _synthetic_population(model, size, seed, max_examples), 'synthetic'


def on_device(clients: list, engine: str, setting: str) -> list:
  """``clients`` with their examples in a ``RowTable`` on the device
  (``--data_on_device``, as the runner's: ``auto`` is on for the vmap
  engine on GPU/TPU when the table fits), else as they are."""
  if engine != 'vmap' or setting == 'off':
    return clients
  table = device_rows.RowTable(clients)
  if setting == 'auto' and not device_rows.table_memory_ok(table.nbytes)[0]:
    return clients
  return [(cid, table.dataset(cid, cds)) for cid, cds in clients]


def fresh_cohort(clients: list, cohort: int, seed: int, round_num: int
                 ) -> list:
  """Round ``round_num``'s cohort: ``cohort`` clients drawn without
  replacement, with their PRNG keys (the runner's ``client_rngs``)."""
  rng = np.random.RandomState([seed, round_num])
  pick = rng.choice(len(clients), size=cohort, replace=False)
  keys = client_rngs(seed, round_num, [clients[i][0] for i in pick])
  return [(clients[i][0], clients[i][1], key) for i, key in zip(pick, keys)]


# --------------------------------------------------------------------------
# Host time (wraps FedJAX's batching and the stacking of a segment's
# batches for the duration of the benchmark).

class HostClock:
  """Seconds spent preparing client batches on the host; FedJAX batches."""

  def __init__(self):
    self.seconds = 0.0
    self.batches = 0

  def reset(self) -> None:
    self.seconds, self.batches = 0.0, 0


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
  saved = (cds_cls.shuffle_repeat_batch, cds_cls.padded_batch,
           streaming._stack,  # pylint: disable=protected-access
           batching_lib.ClientBatches.__getitem__)

  def batching(original):
    def wrapped(self, *args, **kwargs):
      return _TimedBatches(original(self, *args, **kwargs), clock)
    return wrapped

  def timed(original):
    def wrapped(*args, **kwargs):
      t = time.perf_counter()
      try:
        return original(*args, **kwargs)
      finally:
        clock.seconds += time.perf_counter() - t
    return wrapped

  cds_cls.shuffle_repeat_batch = batching(saved[0])
  cds_cls.padded_batch = batching(saved[1])
  streaming._stack = timed(saved[2])  # pylint: disable=protected-access
  # Our batching (made on first access, inside the round engines).
  batching_lib.ClientBatches.__getitem__ = timed(saved[3])
  try:
    yield clock
  finally:
    cds_cls.shuffle_repeat_batch, cds_cls.padded_batch = saved[:2]
    streaming._stack = saved[2]  # pylint: disable=protected-access
    batching_lib.ClientBatches.__getitem__ = saved[3]


# --------------------------------------------------------------------------
# Device facts.

def device_name() -> str:
  kind = jax.devices()[0].device_kind
  return re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_') or 'device'


def peak_flops_table(kind: str, dtype: str = 'float32') -> Optional[float]:
  """The :data:`PEAK_FLOPS` (bfloat16: :data:`PEAK_BF16_FLOPS`) entry for a
  ``device_kind``, or None."""
  tables = ((PEAK_BF16_FLOPS, PEAK_FLOPS) if dtype == 'bfloat16' else
            (PEAK_FLOPS,))
  for table in tables:
    for key, flops in table:
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
  """XLA's FLOP count of one client step (gradient + SGD update, one batch)
  as lowered for the CPU, on any backend: uncompiled, so that no backend
  compiles it (XLA:GPU's compiled count leaves out cuDNN convolutions;
  XLA:CPU took 3-18 s per process to compile the step)."""
  grad_fn = fedjax.model_grad(model)

  def step(p, b):
    g = grad_fn(p, b, jax.random.PRNGKey(0))
    return jax.tree.map(lambda x, y: x - 0.1 * y, p, g)

  cpu = jax.devices('cpu')[0]
  params, batch = jax.device_put((params, batch), cpu)
  with jax.default_device(cpu):
    cost = jax.jit(step).lower(params, batch).cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float((cost or {}).get('flops', float('nan')))


# --------------------------------------------------------------------------
# One (model, engine) process.

def _model(name: str, engine: str = 'loop', dtype: str = 'float32',
           for_flops: bool = False, conv: str = 'auto') -> fedjax.Model:
  """The model; the CNN's convolutions ``conv`` (``'auto'``: im2col on the
  vmapped engines, as the runner's ``--conv_implementation=auto``, else
  ``lax``), FedJAX's reference in float32 with ``lax`` convolutions."""
  compute = None if dtype == 'float32' or engine == 'fedjax_jit' else dtype
  if name == 'femnist':
    if conv == 'auto' or engine == 'fedjax_jit':
      conv = 'im2col' if engine in ('vmap', 'fedjax_vmap') else 'lax'
    if for_flops:
      conv, compute = 'lax', None
    return models.create_emnist_cnn(62, conv_implementation=conv,
                                    compute_dtype=compute).model
  unroll = LM_LENGTH if for_flops else 1
  return lm.create_lm(name, LM_VOCAB, lstm_unroll=unroll,
                      compute_dtype=None if for_flops else compute).model


def _algorithm(engine: str, model: fedjax.Model, batch_size: int, args):
  grad_fn = fedjax.model_grad(model)
  # Process-wide (each configuration runs in its own process).
  streaming.LaneStreams.prefetch = bool(getattr(args, 'prefetch', True))
  streaming.LaneStreams.starts = getattr(args, 'lane_starts', 'rows')
  if engine in ('loop', 'vmap'):
    hp = fedjax.ShuffleRepeatBatchHParams(batch_size=batch_size)
    lanes = (args.lanes_per_device if args.lanes_per_device == 'auto' else
             int(args.lanes_per_device))
    options = (dict(lanes_per_device=lanes, segment_steps=args.segment_steps,
                    segment_loop=args.segment_loop)
               if engine == 'vmap' else {})
    return federated_averaging(grad_fn, optax.sgd(0.1), optax.sgd(1.0), hp,
                               engine=engine, **options)
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


def estimate_seconds(last: Optional[tuple[int, float, float]], cohort: int,
                     rounds: int) -> float:
  """Seconds a cohort's run is expected to take, from the last cohort run
  by the same process, ``last = (cohort, s/round, compile s)``: compile s +
  s/round x (cohort / last cohort) x rounds; 0.0 when ``last`` is None (the
  first cohort always runs)."""
  if not last:
    return 0.0
  return last[2] + last[1] * cohort / last[0] * rounds


def skip_reason(estimate: float, max_seconds: float, now: float,
                deadline: float) -> Optional[str]:
  """Why a cohort estimated at ``estimate`` s is not run (None: it runs):
  over ``--max_seconds``, or past the run's ``deadline`` (seconds since the
  epoch, as ``now``)."""
  if estimate > max_seconds:
    return f'estimated {estimate:.0f} s > --max_seconds={max_seconds:g}'
  if now + estimate > deadline:
    return 'over the run\'s --total_seconds budget'
  return None


def fixed_cost(alg, state, cohort: list) -> dict[str, Any]:
  """One profiled round's time outside its ``lanes_segment`` executions.

  Runs ``alg.apply(state, cohort)`` under ``jax.profiler.trace`` (Python
  tracer off) and returns ``fixed_s`` (the round's wall time minus the
  union of its ``jit_lanes_segment`` executions, first to last op of each;
  ``profile_rounds.summarize``), ``profiled_round_s`` (the traced round's
  host wall time: tracing slows it), ``profiled_compilations`` (XLA
  compilations in it: 0 when steady) and ``fixed_source`` (which trace
  events gave the ops).
  """
  import shutil  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import profile_rounds  # pylint: disable=import-outside-toplevel
  trace_dir = tempfile.mkdtemp(prefix='bench_rounds_trace_')
  try:
    _, walls, path, compiled = profile_rounds.traced_rounds(
        alg, state, [cohort], trace_dir)
    summary = profile_rounds.summarize(profile_rounds.load_events(path))
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)
  if summary['segment_s'] is None:  # No column; the note says why.
    return {'fixed_source': summary['sources']['programs']}
  return {'fixed_s': summary['outside_segment_per_round_s'],
          'profiled_round_s': walls[0], 'profiled_compilations': compiled,
          'fixed_source': summary['sources']['ops']}


def _useful_steps(cohort: list, batch_size: int) -> int:
  return sum(-(-len(cds) // batch_size) for _, cds, _ in cohort)


def run_worker(args, emit: bool = False,
               on_row: Optional[Any] = None) -> list[dict]:
  """Rows for one model and engine over the cohorts (ascending);
  ``on_row(row)`` is called as each row is finished."""
  name, engine = args.models, args.engines
  batch_size = FEMNIST_BATCH if name == 'femnist' else LM_BATCH
  kind = jax.devices()[0].device_kind
  clock = HostClock()
  rows = []
  flops = None
  deadline = args.deadline or math.inf
  variants = [{}] + (parse_variants(args.variants) if engine == 'vmap'
                     else [])
  for variant in variants:
    vargs = argparse.Namespace(**{**vars(args), **variant})
    dtype = 'float32' if engine == 'fedjax_jit' else vargs.compute_dtype
    peak = peak_flops_table(kind, dtype)
    peak_source = f'table ({kind}, {dtype})'
    if peak is None:
      peak, peak_source = _cpu_reference_flops(), 'measured f32 matmul'
    model = _model(name, engine, dtype, conv=vargs.conv_implementation)
    params = model.init(jax.random.PRNGKey(args.seed))
    flops = _run_variant(vargs, variant, model, params, batch_size, dtype,
                         (peak, peak_source), clock, flops, deadline, rows,
                         emit, on_row)
  return rows


def _run_variant(args, variant: dict, model, params, batch_size: int,
                 dtype: str, peak_info: tuple, clock: HostClock,
                 flops: Optional[float], deadline: float, rows: list[dict],
                 emit: bool, on_row) -> Optional[float]:
  """:func:`run_worker`'s rows of one variant (``{}``: the flags as given)
  over the cohorts, appended to ``rows``; returns the step FLOPs (counted
  once per worker)."""
  name, engine = args.models, args.engines
  peak, peak_source = peak_info
  last = None  # (cohort, seconds per round, compile seconds) of the last one
  failed = None
  for cohort in sorted(args.cohorts):
    row = {'model': name, 'engine': engine, 'cohort': cohort,
           'dtype': dtype}
    if variant:
      row['variant'] = variant_label(variant)
    rows.append(row)
    if failed:
      row['skip'] = f'not run: {failed}'
      _done(row, emit, on_row)
      continue
    why = skip_reason(estimate_seconds(last, cohort, args.rounds),
                      args.max_seconds, time.time(), deadline)
    if why:
      row['skip'] = why
      _done(row, emit, on_row)
      continue
    t_load = time.perf_counter()
    clients, row['data'] = population(name, cohort, args.seed,
                                      args.max_examples, args.data_dir)
    clients = on_device(clients, engine, args.data_on_device)
    if cohort > len(clients):
      row['skip'] = f'the population has {len(clients)} clients'
      _done(row, emit, on_row)
      continue
    row['load_s'] = time.perf_counter() - t_load
    try:
      if flops is None:
        first = fresh_cohort(clients, 1, args.seed, 0)[0][1]
        batch = next(iter(first.padded_batch(batch_size=batch_size)))
        batch = {k: v for k, v in batch.items()
                 if k != fedjax.EXAMPLE_MASK_KEY}
        flops = step_flops(_model(name, for_flops=True), params, batch)
      alg = _algorithm(engine, model, batch_size, args)
      state = alg.init(params)
      walls, hosts, useful, executed, sequential = [], [], [], [], []
      start = time.perf_counter()
      with timing_host(clock), stats_lib.recording_stats() as rec, \
          stats_lib.counting_compilations() as compiles:
        for r in range(args.rounds):
          cohort_r = fresh_cohort(clients, cohort, args.seed, r)
          useful.append(_useful_steps(cohort_r, batch_size))
          clock.reset()
          t0 = time.perf_counter()
          state, _ = alg.apply(state, cohort_r)
          jax.block_until_ready(state.params)
          walls.append(time.perf_counter() - t0)
          hosts.append(clock.seconds)
          counts = rec.take()
          if counts['clients']:
            if counts['useful_steps'] != useful[-1]:
              raise AssertionError(
                  f'engine counted {counts["useful_steps"]} useful steps, '
                  f'expected {useful[-1]}')
            executed.append(counts['executed_steps'])
            sequential.append(counts['sequential_steps'])
            for key in ('lanes', 'segment_steps', 'slots', 'rows_on_device'):
              row[key] = counts[key]
          else:  # FedJAX's jit backend: one call per useful step.
            if clock.batches != useful[-1]:
              raise AssertionError(f'FedJAX ran {clock.batches} batches, '
                                   f'expected {useful[-1]}')
            executed.append(clock.batches)
            sequential.append(clock.batches)
          elapsed = time.perf_counter() - start
          if r >= 1 and r + 1 < args.rounds and (  # At least one steady round.
              elapsed + walls[-1] > args.max_seconds or
              time.time() + walls[-1] > deadline):
            break
      row['run_s'] = time.perf_counter() - start
      # Before the profiled round: the profiler's trace buffers are not the
      # engine's memory (a 50-client FEMNIST round's trace added ~0.5 GB).
      mem, mem_source = peak_memory_bytes()
      if args.fixed_cost and engine in LANE_ENGINES:
        # An extra round, untimed above: its cohort is round `rounds`'.
        row.update(fixed_cost(alg, state, fresh_cohort(
            clients, cohort, args.seed, args.rounds)))
    except Exception as err:  # pylint: disable=broad-except
      row['skip'] = _short(err)
      failed = f'failed at cohort {cohort}'
      _done(row, emit, on_row)
      continue
    steady = walls[1:] or walls
    wall = statistics.median(steady)
    last = (cohort, wall, compiles.total_seconds)
    mean_useful = float(np.mean(useful))
    row.update(
        rounds=len(walls), s_per_round=wall, rounds_per_s=1 / wall,
        first_round_s=walls[0], compilations=compiles.total,
        client_program_compilations=compiles.count(
            *stats_lib.CLIENT_PROGRAMS),
        compile_s=compiles.total_seconds,
        compile_s_by_program={k: round(v, 3) for k, v in
                              compiles.seconds.most_common()},
        peak_mem_bytes=mem,
        mem_source=mem_source + (' (the process\'s, variants before '
                                 'included)' if variant else ''),
        useful_steps=mean_useful,
        executed_steps=float(np.mean(executed)),
        sequential_steps=float(np.mean(sequential)),
        host_share=sum(hosts) / sum(walls), step_flops=flops,
        mfu=flops * float(np.mean([u for u in useful[1:]] or useful)) /
        wall / peak, peak_flops=peak, peak_source=peak_source)
    _done(row, emit, on_row)
  return flops


def _done(row: dict, emit: bool, on_row) -> None:
  if emit:
    print('ROW ' + json.dumps(row), flush=True)
  if on_row:
    on_row(row)


def _worker_cmd(args, model: str, engine: str) -> list[str]:
  cmd = [sys.executable, os.path.abspath(__file__), '--worker',
         f'--models={model}', f'--engines={engine}',
         f'--cohorts={",".join(map(str, args.cohorts))}',
         f'--rounds={args.rounds}', f'--max_seconds={args.max_seconds}',
         f'--lanes_per_device={args.lanes_per_device}',
         f'--segment_steps={args.segment_steps}',
         f'--segment_loop={args.segment_loop}',
         f'--compute_dtype={args.compute_dtype}',
         f'--conv_implementation={args.conv_implementation}',
         f'--max_examples={args.max_examples}', f'--seed={args.seed}']
  if args.data_dir:
    cmd.append(f'--data_dir={args.data_dir}')
  cmd.append('--fixed_cost' if args.fixed_cost else '--no-fixed_cost')
  cmd.append('--prefetch' if args.prefetch else '--no-prefetch')
  cmd.append(f'--lane_starts={args.lane_starts}')
  cmd.append(f'--data_on_device={args.data_on_device}')
  cmd.append(f'--variants={args.variants}')
  return cmd


def die_with_parent(parent: int) -> bool:
  """Makes this process (a worker in its own session, so that its budget
  can kill its process group) get SIGKILL when its parent dies, e.g. when
  ``timeout`` ends the benchmark: a worker left running would hold the
  device while the next measurement runs. Linux's ``PR_SET_PDEATHSIG``.

  Returns:
    False where the system has no ``prctl`` (not Linux): the worker then
    outlives a killed parent. Exits at once if ``parent`` is already gone.
  """
  import ctypes  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return False
  prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  if os.getppid() != parent:  # The parent died before the line above.
    os._exit(1)  # pylint: disable=protected-access
  return True


def _run_isolated(args, model: str, engine: str, budget: float,
                  on_row: Optional[Any] = None) -> list[dict]:
  """The worker's rows, each passed to ``on_row`` as the worker prints it;
  rows it could not finish within ``budget`` s are skips."""
  import signal  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  cmd = _worker_cmd(args, model, engine) + [
      f'--deadline={time.time() + budget:.0f}', f'--parent={os.getpid()}']
  done: dict[tuple[str, int], dict] = {}
  final = None
  killed = []

  def kill(proc):
    killed.append(True)
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)

  with tempfile.TemporaryFile('w+') as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                            text=True, start_new_session=True)
    timer = threading.Timer(budget + 60, kill, (proc,))
    timer.start()
    try:
      for line in proc.stdout:
        if line.startswith('ROW '):
          row = json.loads(line[4:])
          done[row.get('variant', ''), row['cohort']] = row
          if on_row:
            on_row(row)
        elif line.startswith('ROWS '):
          final = json.loads(line[5:])
      code = proc.wait()
    finally:
      timer.cancel()
    err.seek(0)
    stderr = err.read()
  if code == 0 and final is not None:
    return final
  if killed:
    why = f'process killed after {budget + 60:.0f} s'
  else:
    tail = (stderr.strip().splitlines() or ['no output'])[-1]
    why = f'process exited {code}: {tail[:160]}'
  rows = []
  variants = [{}] + (parse_variants(args.variants) if engine == 'vmap'
                     else [])
  for variant in variants:
    label = variant_label(variant)
    for c in sorted(args.cohorts):
      if (label, c) in done:
        rows.append(done[label, c])
        continue
      rows.append({'model': model, 'engine': engine, 'cohort': c,
                   'dtype': 'float32' if engine == 'fedjax_jit' else
                   variant.get('compute_dtype', args.compute_dtype),
                   'skip': why})
      if label:
        rows[-1]['variant'] = label
      if on_row:
        on_row(rows[-1])
  return rows


# --------------------------------------------------------------------------
# Report.

def _ratios(rows: list[dict], engine: str) -> dict[int, str]:
  """Row index -> ``engine``'s s/round / this row's, same model and cohort
  in the same run."""
  ref = {(r['model'], r['cohort']): r['s_per_round'] for r in rows
         if r['engine'] == engine and 'skip' not in r}
  return {i: f'{ref[(r["model"], r["cohort"])] / r["s_per_round"]:.2f}x'
          for i, r in enumerate(rows)
          if 'skip' not in r and (r['model'], r['cohort']) in ref}


def _fmt_row(row: dict, vs_jit: str = '', vs_loop: str = '') -> str:
  engine = row['engine'] + (f' [{row["variant"]}]' if row.get('variant')
                            else '')
  head = (f'| {row["model"]} | {engine} | {row.get("dtype", "")} |'
          f' {row["cohort"]:,} |')
  if 'skip' in row:
    return head + f' skipped: {row["skip"]} |' + ' |' * 11
  fixed = (f'{row["fixed_s"]:.3g} of {row["profiled_round_s"]:.3g}' + (
      f' ({row["profiled_compilations"]} compilations in it)'
      if row.get('profiled_compilations') else '') if 'fixed_s' in row
           else '')
  return head + (
      f' {row["s_per_round"]:.3g} | {vs_jit} | {vs_loop} | {fixed} |'
      f' {row["run_s"]:.3g} ({row["rounds"]}) |'
      f' {row["compilations"]} ({row["client_program_compilations"]}) |'
      f' {row["compile_s"]:.3g} |'
      f' {row["peak_mem_bytes"] / 2**20:,.0f} |'
      f' {row["sequential_steps"]:,.1f} |'
      f' {row["executed_steps"] / row["useful_steps"]:.2f}x |'
      f' {100 * row["host_share"]:.1f}% | {100 * row["mfu"]:.2f}%'
      + (f' of {row["peak_flops"] / 1e9:.0f} GFLOP/s'
         if row['peak_source'].startswith('measured') else '') + ' |')


def _table_row(rows: list[dict], i: int) -> str:
  """Row ``i`` of ``rows`` with its ratios against the rows so far."""
  jit, loop = _ratios(rows, 'fedjax_jit'), _ratios(rows, 'loop')
  return _fmt_row(rows[i], jit.get(i, ''), loop.get(i, ''))


def _table(rows: list[dict]) -> str:
  return '\n'.join([TABLE_HEAD] + [_table_row(rows, i)
                                   for i in range(len(rows))])


TABLE_HEAD = (
    '| model | engine | dtype | cohort | s/round | vs FedJAX jit | vs loop '
    '| fixed s of profiled round | run s (rounds) '
    '| compilations (client program) | compile s '
    '| peak mem (MiB) | sequential steps | executed / useful | host share '
    '| MFU |\n'
    '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:'
    '|---:|---:|')


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
  allocator = (f', CPU allocator {cpu_allocator.STATE}'
               if jax.default_backend() == 'cpu' else '')
  return (f'{len(devs)} x {devs[0].device_kind} ({jax.default_backend()}); '
          f'host {cpu}, {os.cpu_count()} CPU threads{allocator}')


def _defaults(args) -> None:
  cpu = jax.default_backend() == 'cpu'
  if args.models is None:
    args.models = ('femnist,lstm_tiny,transformer_tiny' if cpu else
                   'femnist,lstm_small,transformer_large')
  if args.cohorts is None:
    args.cohorts = '10' if cpu else '10,100,1000'
  if args.rounds is None:
    args.rounds = 4 if cpu else 5
  if args.max_seconds is None:
    args.max_seconds = 300.0 if cpu else 150.0
  if args.total_seconds is None:
    args.total_seconds = 3600.0 if cpu else 1800.0
  if args.extra is None:
    args.extra = '' if cpu else 'transformer_large:vmap:800'
  if args.profile_rounds < 1:
    raise SystemExit(f'--profile_rounds must be >= 1; got '
                     f'{args.profile_rounds}.')
  args.cohorts = [int(c) for c in str(args.cohorts).split(',')]
  bad = [c for c in args.cohorts if c < 1]
  if bad:
    raise SystemExit(f'--cohorts must be positive ints; got {bad}.')
  if args.lanes_per_device != 'auto' and not (
      args.lanes_per_device.isdigit() and int(args.lanes_per_device) >= 1):
    raise SystemExit(f"--lanes_per_device must be 'auto' or an int >= 1; "
                     f'got {args.lanes_per_device!r}.')
  parse_variants(args.variants)  # A bad one: one line, before any run.
  args.extra_runs = []
  for item in filter(None, args.extra.split(',')):
    parts = item.split(':')
    if (len(parts) != 3 or parts[0] not in MODELS or parts[1] not in ENGINES
        or not parts[2].isdigit()):
      raise SystemExit(f'--extra: {item!r} is not model:engine:cohort with a '
                       f'model of {", ".join(MODELS)} and an engine of '
                       f'{", ".join(ENGINES)}.')
    args.extra_runs.append((parts[0], parts[1], int(parts[2])))


def main(argv: Optional[list[str]] = None) -> None:
  # Compile seconds are what a fresh run pays: no program is loaded from
  # JAX's persistent compilation cache (a load counts as a compilation, in
  # less time), in this process or a child.
  os.environ['JAX_ENABLE_COMPILATION_CACHE'] = 'false'
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--models', default=None,
                      help=f'comma list of {", ".join(MODELS)} (default: '
                      'femnist,lstm_small,transformer_large on GPU/TPU; '
                      'femnist,lstm_tiny,transformer_tiny on CPU)')
  parser.add_argument('--engines', default=','.join(ENGINES),
                      help=f'comma list of {", ".join(ENGINES)}')
  parser.add_argument('--cohorts', default=None,
                      help='clients per round, comma list (default 10,100,'
                      '1000; 10 on CPU)')
  parser.add_argument('--rounds', type=int, default=None,
                      help='rounds of the run, each on a fresh cohort; '
                      's/round is the median after the first (default 5; 4 '
                      'on CPU)')
  parser.add_argument('--max_seconds', type=float, default=None,
                      help='time budget per configuration (default 150; 300 on '
                      'CPU)')
  parser.add_argument('--lanes_per_device', default='auto',
                      help="vmap engine: lanes per device, int >= 1 or 'auto'")
  parser.add_argument('--segment_steps', type=int, default=4,
                      help='vmap engine: local steps per compiled segment')
  parser.add_argument('--segment_loop', default='auto',
                      choices=streaming.LOOPS,
                      help='vmap engine: unroll, scan (an on-device loop of '
                      'segment_steps steps), while (a loop of the planned '
                      'steps), fixed (segment_steps steps, no conditional) '
                      'or auto (scan; unroll on CPU for a lax convolution)')
  parser.add_argument('--prefetch', default=True,
                      action=argparse.BooleanOptionalAction,
                      help='vmap engine: make the next segment\'s inputs on '
                      'a worker thread while a segment runs (--no-prefetch: '
                      'between calls, the reference)')
  parser.add_argument('--lane_starts', default='rows',
                      choices=streaming.STARTS,
                      help='vmap engine: how a lane-step writes the next '
                      'clients into the lane states (LaneStreams.starts)')
  parser.add_argument('--data_on_device', default='auto',
                      choices=device_rows.SETTINGS,
                      help='vmap engine: the clients\' examples on the '
                      'device once, batches sent as row indices (as the '
                      'runner\'s flag; auto: on GPU/TPU when they fit)')
  parser.add_argument('--compute_dtype', default='float32',
                      choices=('float32', 'bfloat16'),
                      help='our engines\' and VmapBackend\'s model '
                      'computation dtype (FedJAX jit: always float32)')
  parser.add_argument('--conv_implementation', default='auto',
                      choices=('auto',) + layers.CONV_IMPLEMENTATIONS,
                      help='the CNN\'s convolutions on our engines and '
                      'VmapBackend: lax (a vmapped lax convolution is a '
                      'grouped convolution), im2col (matmuls) or auto '
                      '(im2col on the vmapped engines, as the runner); '
                      'FedJAX jit: always lax')
  parser.add_argument('--variants', default='',
                      help='vmap engine: more rows in the same process, '
                      'each with some of its flags changed, as a '
                      'semicolon list of comma lists of option=value ('
                      f'options: {", ".join(VARIANT_OPTIONS)}; prefetch=true'
                      '|false), e.g. "data_on_device=off;lane_starts='
                      'scatter"; the notes give each one\'s s/round against '
                      'the row with the flags as given')
  parser.add_argument('--extra', default=None,
                      help='comma list of model:engine:cohort runs of one '
                      'round after the table (default on GPU/TPU: '
                      'transformer_large:vmap:800; none on CPU)')
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
  parser.add_argument('--fixed_cost', default=True,
                      action=argparse.BooleanOptionalAction,
                      help='vmap and fedjax_vmap rows: profile one extra '
                      'round for the time outside lanes_segment')
  parser.add_argument('--profile', action='store_true',
                      help='after each row, benchmarks/profile_rounds.py on '
                      'its configuration (own process; JSON beside '
                      '--output)')
  parser.add_argument('--profile_rounds', type=int, default=2,
                      help='--profile: traced rounds (after one warm-up)')
  parser.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--deadline', type=float, default=0,
                      help=argparse.SUPPRESS)
  parser.add_argument('--parent', type=int, default=0,
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
    if args.parent and not die_with_parent(args.parent):
      print('warning: no prctl here; this worker outlives a killed parent',
            file=sys.stderr)
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
  if args.variants and 'vmap' not in engine_list:
    raise SystemExit(f'--variants={args.variants} changes vmap rows; '
                     f'--engines={args.engines} runs no vmap engine.')
  command = 'python benchmarks/bench_rounds.py ' + ' '.join(
      sys.argv[1:] if argv is None else argv)
  header = [f'command: `{command.strip()}`',
            f'machine: {_machine()}',
            f'jax {jax.__version__}, jaxlib '
            f'{_version("jaxlib")}, fedjax {_version("fedjax")}, python '
            f'{platform.python_version()}',
            f'cohorts {args.cohorts}, {args.rounds} rounds on fresh cohorts '
            '(s/round: median after the first), '
            f'--max_seconds={args.max_seconds:g}, '
            f'--lanes_per_device={args.lanes_per_device}, '
            f'--segment_steps={args.segment_steps}, '
            f'--segment_loop={args.segment_loop}, '
            f'--{"" if args.prefetch else "no-"}prefetch, '
            f'--lane_starts={args.lane_starts}, '
            f'--data_on_device={args.data_on_device}, '
            f'--compute_dtype={args.compute_dtype}, '
            f'--conv_implementation={args.conv_implementation}, '
            f'--total_seconds={args.total_seconds:g}'
            + (f', --variants={args.variants}' if args.variants else '')]
  print('\n'.join(header), flush=True)
  print(TABLE_HEAD, flush=True)
  output = args.output or os.path.join(
      os.path.dirname(os.path.abspath(__file__)), 'results',
      f'rounds_{device_name()}.md')
  rows: list[dict] = []

  def add_row(row: dict) -> None:
    rows.append(row)
    print(_table_row(rows, len(rows) - 1), flush=True)
    if output != '-':  # A killed run keeps the rows it finished.
      _write_report(output, [(header, rows)])

  # The reference engines first, so that each row's ratios can be printed.
  engine_list = ([e for e in REFERENCE_ENGINES if e in engine_list] +
                 [e for e in engine_list if e not in REFERENCE_ENGINES])
  configs = [argparse.Namespace(**{**vars(args), 'models': m, 'engines': e})
             for m in model_list for e in engine_list]
  configs += [argparse.Namespace(**{**vars(args), 'models': m, 'engines': e,
                                    'cohorts': [c], 'rounds': 1,
                                    'variants': ''})
              for m, e, c in args.extra_runs]
  end = time.time() + args.total_seconds
  # A vmap configuration runs its variants too: a share per variant.
  weights = [1 + (len(parse_variants(sub.variants))
                  if sub.engines == 'vmap' else 0) for sub in configs]
  for i, sub in enumerate(configs):
    t = time.perf_counter()
    first = len(rows)
    # Fair share of what is left of the run's budget.
    budget = (max(end - time.time(), 0) * weights[i] / sum(weights[i:]))
    if args.isolate:
      _run_isolated(sub, sub.models, sub.engines, budget, on_row=add_row)
    else:
      sub.deadline = end
      run_worker(sub, on_row=add_row)
    for row in rows[first:]:  # The configuration's whole time.
      row['config_s'] = time.perf_counter() - t
    if args.profile:
      for row in rows[first:]:  # Variants: not profiled.
        if 'skip' not in row and 'variant' not in row:
          row['profile'] = _profile(sub, row, output, budget)
    if output != '-':
      _write_report(output, [(header, rows)])
  for n in _notes(rows):
    print(n)
  if output != '-':
    print(f'wrote {output}')


def _profile(args, row: dict, output: str, budget: float) -> str:
  """Runs ``profile_rounds.py`` on a row's configuration in its own process;
  the JSON's path, or why there is none."""
  stem = (os.path.splitext(output)[0] if output != '-' else
          os.path.join(os.getcwd(), 'rounds'))
  path = f'{stem}_profile_{row["model"]}_{row["engine"]}_{row["cohort"]}.json'
  cmd = [sys.executable, os.path.join(os.path.dirname(
      os.path.abspath(__file__)), 'profile_rounds.py'),
         f'--model={row["model"]}', f'--engine={row["engine"]}',
         f'--cohort={row["cohort"]}',
         f'--lanes_per_device={args.lanes_per_device}',
         f'--segment_steps={args.segment_steps}',
         f'--segment_loop={args.segment_loop}',
         f'--compute_dtype={args.compute_dtype}',
         f'--conv_implementation={args.conv_implementation}',
         f'--max_examples={args.max_examples}', f'--seed={args.seed}',
         f'--rounds={args.profile_rounds}', f'--output={path}',
         '--prefetch' if args.prefetch else '--no-prefetch',
         f'--lane_starts={args.lane_starts}',
         f'--data_on_device={args.data_on_device}']
  if args.data_dir:
    cmd.append(f'--data_dir={args.data_dir}')
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=max(budget, 60), check=False)
  except subprocess.TimeoutExpired:
    return f'{path} (killed after {max(budget, 60):.0f} s: partial)'
  if proc.returncode:
    tail = (proc.stderr.strip().splitlines() or ['no output'])[-1]
    return f'{path} (exited {proc.returncode}: {tail[:160]})'
  print(proc.stdout, end='', flush=True)
  return path


def _notes(rows: list[dict]) -> list[str]:
  done = [r for r in rows if 'skip' not in r]
  notes = []
  if done:
    r0 = done[0]
    notes.append(
        f'peak memory: {r0["mem_source"]}; MFU against '
        f'{r0["peak_flops"] / 1e12:.3g} TFLOP/s ({r0["peak_source"]}), step '
        'FLOPs from XLA\'s cost analysis of the step lowered for the CPU; '
        'vs FedJAX jit / vs loop: that '
        'engine\'s s/round at the same model and cohort in the same run / '
        'this row\'s; run s: the whole run, compilation included; '
        'compilations: every XLA compilation of the run (the client '
        'program\'s); data: ' +
        ', '.join(sorted({f'{r["model"]}: {r["data"]}' for r in done})))
    for r in done:
      if r['engine'] == 'vmap' and 'lanes' in r:
        notes.append(
            f'{r["model"]} vmap'
            + (f' [{r["variant"]}]' if r.get('variant') else '') +
            f' cohort {r["cohort"]}: {r["lanes"]} lanes, '
            f'{r["segment_steps"]} steps per segment, {r["slots"]} '
            f'finalization slot(s) per step; batches '
            + ('gathered on the device' if r.get('rows_on_device') else
               'sent by the host') + '; first round '
            f'{r["first_round_s"]:.3g} s; compile s by program: ' + ', '.join(
                f'{k} {v:.3g}' for k, v in list(
                    r.get('compile_s_by_program', {}).items())[:6]))
  default = {(r['model'], r['cohort']): r['s_per_round'] for r in done
             if r['engine'] == 'vmap' and not r.get('variant')}
  against = [f'{r["model"]} cohort {r["cohort"]} [{r["variant"]}] '
             f'{default[r["model"], r["cohort"]] / r["s_per_round"]:.2f}x'
             for r in done if r.get('variant')
             and (r['model'], r['cohort']) in default]
  if against:
    notes.append('variants, the vmap row with the flags as given / the '
                 'variant\'s s/round (same process; > 1: the variant is '
                 'faster): ' + '; '.join(against))
  if any('fixed_source' in r for r in done):
    source = next(r['fixed_source'] for r in done if 'fixed_source' in r)
    notes.append(
        'fixed s of profiled round: one extra round (a fresh cohort, after '
        'the timed ones) under jax.profiler.trace; its wall time minus its '
        'lanes_segment executions (first to last op of each; ops from '
        f'{source}): lanes_begin, lanes_finish, the server update, the '
        'download, host work and idle time. Tracing adds host time to the '
        'profiled round (its wall time is the second number)')
  configs: dict[tuple[str, str], list[dict]] = {}
  for r in rows:
    if 'config_s' in r:
      configs.setdefault((r['model'], r['engine']), []).append(r)
  if configs:
    notes.append('configuration wall s (process start, imports, data, model '
                 'and FLOP count included) vs its runs\' run s: ' + '; '.join(
                     f'{m} {e}: {rs[0]["config_s"]:.3g} vs '
                     f'{sum(r.get("run_s", 0) for r in rs):.3g}'
                     for (m, e), rs in configs.items()))
  for r in rows:
    if 'profile' in r:
      notes.append(f'profile of {r["model"]} {r["engine"]} cohort '
                   f'{r["cohort"]}: {r["profile"]}')
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
  # As the experiment binary with the vmap engine: glibc's huge pages for
  # XLA:CPU's buffers, here and in the configurations' processes
  # (FEDLITE_CPU_HUGE_PAGES=0: glibc's defaults); the machine line says which.
  cpu_allocator.restart_with_huge_pages()
  main()
