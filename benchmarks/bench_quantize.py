#!/usr/bin/env python3
"""Quantize+dequantize a 20M-parameter update: vs memory bandwidth and FedJAX.

Times, in one process, stochastic k-level uniform quantization (Suresh et al.
2017; Ro et al. 2022 upload/download) and TernGrad (Wen et al. 2017) of a
float32 update, each call returning the dequantized values:

* ``fedlite_jax`` ``uniform_quantize`` / ``terngrad_quantize`` with the
  counter-based ``'hash'`` generator (fused into the quantizer's single pass)
  and with ``'threefry'`` (``jax.random.uniform``),
* FedJAX's ``fedjax.aggregators.compression.uniform_stochastic_quantize(v,
  2**bits, key)`` and ``terngrad_quantize(v, key)`` under ``jax.jit``,

on (1) one flat layer of ``--size`` values (default 20,000,000) and (2) a
model-shaped update, the 101 leaves of ``transformer_large`` (Ro et al.
Table 1, 21,031,936 parameters with 4,096 ids; ``*_tree`` / FedJAX's
``*_pytree``, per-leaf ranges). Other bit widths (``--sweep_bits``) are timed
for the hash generator only, fewer calls.

Memory-bandwidth estimate (docs/DESIGN_NOTES.md: the
limit for 20M floats is a few ms). Measured in the same process: a NumPy
``copyto`` of ``--size`` float32 and an XLA ``x + 1`` with the input buffer
donated; both move 8 bytes per value (read + write), and the faster one
gives the bandwidth ``B`` (the strictest estimate). Bytes-moved model of one
call, per float32 value, the passes our implementation needs (the layer is
80 MB, larger than the 32 MB L3 here, so every pass goes to memory):

* uniform k-level, TernGrad without clipping: 12 B = one read for min/max
  (one variadic reduction) + one read and one write for the fused
  quantize-dequantize pass;
* TernGrad with clipping at 2.5 std (the default): 20 B = + two reads for the
  standard deviation (mean, then centred squares);

so the estimate is ``bytes / B`` and the reported ratio ``time / estimate``
(goal: <= 2). Two modes (``--mode``): ``donate`` (the input buffer is donated
and reused for the output: the quantizer's own cost) and ``fresh`` (a new
output per call, as in normal use: on XLA:CPU every output >= 32 MiB is a
fresh glibc mmap, ~20k page faults per 80 MB call, which the bandwidth model
does not include). Calls are interleaved round-robin so that machine noise
hits every variant alike; the table gives median and min wall ms and the
process CPU ms per call (all threads; less sensitive to other jobs on a
shared machine). Compare ratios, not absolute times.

Usage:
  python benchmarks/bench_quantize.py [--size 20000000] [--bits 8]
      [--reps 10] [--mode fresh|donate|both] [--sweep_bits 1,2,4,16]
      [--no_tree] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from typing import Callable

import fedlite_jax  # noqa: F401  (compat patches before fedjax)
from fedlite_jax.transforms import ternary as tg
from fedlite_jax.transforms import uniform as q
from fedlite_jax.models import lm

from fedjax.aggregators import compression as fedjax_compression
import jax
import jax.numpy as jnp
import numpy as np

BYTES_PER_VALUE = {'uniform': 12, 'terngrad_clip': 20, 'terngrad_noclip': 12}


def _variants(bits: int) -> dict[str, tuple[Callable, str]]:
  """name -> (fn(x, key), bytes-model key)."""
  return {
      f'hash {bits}-bit': (lambda x, k: q.uniform_quantize(
          x, k, bits, generator='hash').values, 'uniform'),
      f'threefry {bits}-bit': (lambda x, k: q.uniform_quantize(
          x, k, bits, generator='threefry').values, 'uniform'),
      f'fedjax {bits}-bit': (
          lambda x, k: fedjax_compression.uniform_stochastic_quantize(
              x, 2**bits, k), 'uniform'),
      'terngrad hash': (lambda x, k: tg.terngrad_quantize(
          x, k, generator='hash').values, 'terngrad_clip'),
      'terngrad hash noclip': (lambda x, k: tg.terngrad_quantize(
          x, k, clip_std=None, generator='hash').values, 'terngrad_noclip'),
      'terngrad threefry': (lambda x, k: tg.terngrad_quantize(
          x, k, generator='threefry').values, 'terngrad_clip'),
      'terngrad fedjax': (fedjax_compression.terngrad_quantize,
                          'terngrad_clip'),
  }


def _tree_variants(bits: int) -> dict[str, tuple[Callable, str]]:
  return {
      f'tree hash {bits}-bit': (lambda t, k: q.uniform_quantize_tree(
          t, k, bits, generator='hash').values, 'uniform'),
      f'tree fedjax {bits}-bit': (
          lambda t, k: fedjax_compression.uniform_stochastic_quantize_pytree(
              t, 2**bits, k), 'uniform'),
      'tree terngrad hash': (lambda t, k: tg.terngrad_quantize_tree(
          t, k, generator='hash').values, 'terngrad_clip'),
      'tree terngrad fedjax': (fedjax_compression.terngrad_quantize_pytree,
                               'terngrad_clip'),
  }


def _cpu_seconds() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _minflt() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure_bandwidth(size: int, reps: int) -> dict[str, float]:
  """Bytes/s of a NumPy copy and of a donated XLA ``x + 1`` (8 B/value)."""
  src = np.random.RandomState(0).standard_normal(size).astype(np.float32)
  dst = np.empty_like(src)
  add = jax.jit(lambda a: a + 1.0, donate_argnums=0)
  buf = jnp.asarray(src)
  buf = add(buf).block_until_ready()
  np.copyto(dst, src)
  t_np, t_xla = [], []
  for _ in range(reps):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    t_np.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    buf = add(buf).block_until_ready()
    t_xla.append(time.perf_counter() - t0)
  moved = 8.0 * size
  return {'numpy copy': moved / min(t_np), 'xla donated add': moved /
          min(t_xla), 'numpy copy median': moved / statistics.median(t_np),
          'xla donated add median': moved / statistics.median(t_xla)}


def _time(fns: dict[str, Callable], make_arg: Callable, key: jax.Array,
          reps: int) -> dict[str, dict[str, float]]:
  """Round-robin timing; returns median/min wall ms, CPU ms, faults."""
  times = {name: [] for name in fns}
  cpu = {name: 0.0 for name in fns}
  faults = {name: 0 for name in fns}
  for rep in range(reps + 1):  # rep 0 compiles and warms up
    for name, f in fns.items():
      arg = make_arg()
      jax.block_until_ready(arg)
      f0, c0 = _minflt(), _cpu_seconds()
      t0 = time.perf_counter()
      out = jax.block_until_ready(f(arg, key))
      elapsed = time.perf_counter() - t0
      if rep:
        times[name].append(elapsed * 1e3)
        cpu[name] += (_cpu_seconds() - c0) * 1e3
        faults[name] += _minflt() - f0
      del out, arg
  return {name: {'median': statistics.median(ts), 'min': min(ts),
                 'cpu': cpu[name] / reps, 'faults': faults[name] / reps}
          for name, ts in times.items()}


def _print_table(title: str, stats: dict, models: dict[str, str],
                 num_values: int, bandwidth: float, base: str) -> None:
  print(f'\n{title}')
  print(f'{"variant":<24}{"median ms":>10}{"min ms":>8}{"cpu ms":>8}'
        f'{"faults":>8}{"est ms":>8}{"x est":>7}{"x est(min)":>11}'
        f'{"  x " + base:>18}')
  ref = stats[base]['median']
  for name, s in stats.items():
    est = BYTES_PER_VALUE[models[name]] * num_values / bandwidth * 1e3
    print(f'{name:<24}{s["median"]:>10.1f}{s["min"]:>8.1f}{s["cpu"]:>8.1f}'
          f'{s["faults"]:>8.0f}{est:>8.1f}{s["median"] / est:>7.2f}'
          f'{s["min"] / est:>11.2f}{s["median"] / ref:>18.2f}')


def _print_ratios(mode: str, stats: dict, models: dict[str, str],
                  num_values: int, bandwidth: float) -> None:
  for name, s in stats.items():
    if 'hash' not in name:
      continue
    est = BYTES_PER_VALUE[models[name]] * num_values / bandwidth * 1e3
    print(f'ratio [{mode}] {name} / bandwidth estimate = '
          f'{s["median"] / est:.2f} (median), {s["min"] / est:.2f} (min); '
          f'goal <= 2: {"met" if s["median"] / est <= 2 else "not met"}')
  for name in stats:
    if 'fedjax' in name:
      ours = name.replace('fedjax', 'hash')
      if ours in stats:
        print(f'ratio [{mode}] {name} / {ours} = '
              f'{stats[name]["median"] / stats[ours]["median"]:.2f}')
    if 'threefry' in name:
      ours = name.replace('threefry', 'hash')
      print(f'ratio [{mode}] {name} / {ours} = '
            f'{stats[name]["median"] / stats[ours]["median"]:.2f}')


def run_flat(size: int, bits: int, reps: int, mode: str,
             bandwidth: float) -> None:
  """One flat float32 layer of ``size`` values, every variant."""
  donate = mode == 'donate'
  x = jax.random.normal(jax.random.PRNGKey(0), (size,), jnp.float32)
  key = jax.random.PRNGKey(1)
  variants = _variants(bits)
  fns = {name: jax.jit(f, donate_argnums=(0,) if donate else ())
         for name, (f, _) in variants.items()}
  make_arg = (lambda: x + 0.0) if donate else (lambda: x)
  stats = _time(fns, make_arg, key, reps)
  models = {name: m for name, (_, m) in variants.items()}
  _print_table(f'{size:,} float32 values (one layer), mode={mode}, {reps} '
               f'timed calls each', stats, models, size, bandwidth,
               f'hash {bits}-bit')
  _print_ratios(mode, stats, models, size, bandwidth)


def run_sweep(size: int, sweep: list[int], reps: int, bandwidth: float
              ) -> None:
  """Hash generator, other bit widths, donated buffers."""
  x = jax.random.normal(jax.random.PRNGKey(0), (size,), jnp.float32)
  key = jax.random.PRNGKey(1)
  fns = {f'hash {b}-bit': jax.jit(
      lambda v, k, b=b: q.uniform_quantize(v, k, b, generator='hash').values,
      donate_argnums=0) for b in sweep}
  stats = _time(fns, lambda: x + 0.0, key, reps)
  models = {name: 'uniform' for name in fns}
  _print_table(f'bit-width sweep, hash generator, {size:,} values, '
               f'mode=donate, {reps} calls each', stats, models, size,
               bandwidth, f'hash {sweep[0]}-bit')
  for name, s in stats.items():
    est = 12 * size / bandwidth * 1e3
    print(f'ratio [sweep] {name} / bandwidth estimate = '
          f'{s["median"] / est:.2f} (median), {s["min"] / est:.2f} (min)')


def run_tree(model: str, bits: int, reps: int, bandwidth: float) -> None:
  """A model-shaped update (per-leaf quantization), fresh outputs."""
  shapes = lm.param_shapes(model)
  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  tree = jax.tree.unflatten(treedef, [
      jax.random.normal(k, s.shape, jnp.float32) * 1e-3
      for k, s in zip(keys, leaves)])
  size = sum(s.size for s in leaves)
  key = jax.random.PRNGKey(1)
  variants = _tree_variants(bits)
  fns = {name: jax.jit(f) for name, (f, _) in variants.items()}
  stats = _time(fns, lambda: tree, key, reps)
  models = {name: m for name, (_, m) in variants.items()}
  _print_table(f'{model} update: {size:,} float32 values in {len(leaves)} '
               f'leaves (largest {max(s.size for s in leaves):,}), '
               f'mode=fresh, {reps} calls each', stats, models, size,
               bandwidth, f'tree hash {bits}-bit')
  _print_ratios('tree', stats, models, size, bandwidth)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', type=int, default=20_000_000)
  parser.add_argument('--bits', type=int, default=8)
  parser.add_argument('--reps', type=int, default=10)
  parser.add_argument('--mode', choices=('fresh', 'donate', 'both'),
                      default='both')
  parser.add_argument('--sweep_bits', default='1,2,4,16',
                      help='comma list ("" = none), hash only')
  parser.add_argument('--tree_model', default='transformer_large')
  parser.add_argument('--no_tree', action='store_true')
  parser.add_argument('--smoke', action='store_true',
                      help='1M values, 2 calls, transformer_tiny tree')
  args = parser.parse_args()
  if args.smoke:
    args.size, args.reps, args.sweep_bits = 1_000_000, 2, '4'
    args.tree_model = 'transformer_tiny'
  load = os.getloadavg()
  print(f'machine: {platform.platform()}, nproc={os.cpu_count()}, loadavg '
        f'at start={load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, jax '
        f'{jax.__version__} ({jax.default_backend()})')
  bw = measure_bandwidth(args.size, max(5, args.reps))
  bandwidth = max(bw['numpy copy'], bw['xla donated add'])
  print('memory bandwidth (8 B moved per float32, best of '
        f'{max(5, args.reps)}): numpy copy {bw["numpy copy"] / 1e9:.1f} GB/s '
        f'(median {bw["numpy copy median"] / 1e9:.1f}), XLA donated add '
        f'{bw["xla donated add"] / 1e9:.1f} GB/s (median '
        f'{bw["xla donated add median"] / 1e9:.1f}); estimate uses '
        f'{bandwidth / 1e9:.1f} GB/s')
  print('bytes-moved model per value: uniform / TernGrad no clip 12 B '
        '(min/max read + quantize read + write), TernGrad clip 20 B (+ 2 '
        'reads for std); estimate = bytes / bandwidth')
  modes = ('donate', 'fresh') if args.mode == 'both' else (args.mode,)
  for mode in modes:
    run_flat(args.size, args.bits, args.reps, mode, bandwidth)
  sweep = [int(b) for b in args.sweep_bits.split(',') if b.strip()]
  if sweep:
    run_sweep(args.size, sweep, max(2, args.reps // 2), bandwidth)
  if not args.no_tree:
    run_tree(args.tree_model, args.bits, args.reps, bandwidth)
  print(f'loadavg at end={os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
  main()
