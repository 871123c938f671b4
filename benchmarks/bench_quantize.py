"""Time stochastic uniform quantization: fast hash vs threefry vs FedJAX.

Quantizes one float32 layer (default 20M values, 8 bits) in one process with

* ``fedlite_jax`` ``uniform_quantize(generator='hash')`` (counter-based hash
  fused into the quantizer),
* ``fedlite_jax`` ``uniform_quantize(generator='threefry')``
  (``jax.random.uniform``),
* FedJAX's ``uniform_stochastic_quantize(v, 2**bits, key)`` under ``jax.jit``,
* optionally TernGrad with both generators (``--terngrad``),

and prints median and min milliseconds per call, minor page faults per call
and the ratios to the hash generator. Calls are interleaved round-robin so
machine noise hits every variant alike; compare ratios, not absolute times
(``../shared/docs/ENGINEERING_NOTES.md``: shared machines, 2x swings).

Two modes (``--mode``): ``fresh`` (a new output buffer per call, as in normal
use; on XLA:CPU each output >= 32 MiB is a fresh glibc mmap whose page faults
cost tens of ms) and ``donate`` (the input buffer is donated and reused for
the output, which isolates the quantizer's own compute).

Usage:
  python benchmarks/bench_quantize.py [--size 20000000] [--bits 8]
      [--reps 10] [--mode fresh|donate|both] [--terngrad]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Callable

import fedlite_jax  # noqa: F401  (compat patches before fedjax)
from fedlite_jax import quantization as q

from fedjax.aggregators import compression as fedjax_compression
import jax
import jax.numpy as jnp


def _variants(bits: int, terngrad: bool) -> dict[str, Callable]:
  out = {
      'hash': lambda x, k: q.uniform_quantize(x, k, bits,
                                              generator='hash').values,
      'threefry': lambda x, k: q.uniform_quantize(
          x, k, bits, generator='threefry').values,
      'fedjax': lambda x, k: fedjax_compression.uniform_stochastic_quantize(
          x, 2**bits, k),
  }
  if terngrad:
    out['terngrad-hash'] = lambda x, k: q.terngrad_quantize(
        x, k, generator='hash').values
    out['terngrad-threefry'] = lambda x, k: q.terngrad_quantize(
        x, k, generator='threefry').values
    out['terngrad-fedjax'] = fedjax_compression.terngrad_quantize
  return out


def _minflt() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(size: int, bits: int, reps: int, mode: str, terngrad: bool) -> None:
  """Benchmarks every variant in one ``mode`` and prints a table."""
  donate = mode == 'donate'
  x = jax.random.normal(jax.random.PRNGKey(0), (size,), jnp.float32)
  key = jax.random.PRNGKey(1)
  fns = {name: jax.jit(f, donate_argnums=(0,) if donate else ())
         for name, f in _variants(bits, terngrad).items()}
  times = {name: [] for name in fns}
  faults = {name: 0 for name in fns}
  for rep in range(reps + 1):  # rep 0 compiles and warms up
    for name, f in fns.items():
      arg = (x + 0.0).block_until_ready() if donate else x
      f0 = _minflt()
      t0 = time.perf_counter()
      out = f(arg, key).block_until_ready()
      elapsed = time.perf_counter() - t0
      if rep:
        times[name].append(elapsed * 1e3)
        faults[name] += _minflt() - f0
      del out, arg
  base = statistics.median(times['hash'])
  print(f'\n{size:,} float32 values, {bits} bits, mode={mode}, '
        f'{reps} timed calls each, backend={jax.default_backend()}')
  print(f'{"variant":<20}{"median ms":>10}{"min ms":>9}'
        f'{"faults/call":>13}{"x hash":>8}')
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f'{name:<20}{med:>10.1f}{min(ts):>9.1f}'
          f'{faults[name] / reps:>13.0f}{med / base:>8.2f}')
  med = {n: statistics.median(ts) for n, ts in times.items()}
  print(f'threefry / hash = {med["threefry"] / med["hash"]:.1f}x; '
        f'fedjax / hash = {med["fedjax"] / med["hash"]:.1f}x; '
        f'fedjax / threefry = {med["fedjax"] / med["threefry"]:.2f}x')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', type=int, default=20_000_000)
  parser.add_argument('--bits', type=int, default=8)
  parser.add_argument('--reps', type=int, default=10)
  parser.add_argument('--mode', choices=('fresh', 'donate', 'both'),
                      default='both')
  parser.add_argument('--terngrad', action='store_true')
  args = parser.parse_args()
  modes = ('fresh', 'donate') if args.mode == 'both' else (args.mode,)
  for mode in modes:
    run(args.size, args.bits, args.reps, mode, args.terngrad)


if __name__ == '__main__':
  main()
