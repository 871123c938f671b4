"""Benchmark: jitted JAX FWHT and Fastfood vs NumPy references, one process.

Prints, per length n, the median wall time (ms) of
  * ``jax``: :func:`fedlite_jax.igc.fwht.fwht` under ``jax.jit``;
  * ``jax_vjp``: its reverse-mode pullback (should cost about the same);
  * ``jax_bfly``: a per-level radix-2 butterfly in JAX (the design rejected);
  * ``np_bfly``: an in-place radix-2 butterfly in NumPy (float32; includes a
    copy of the input into the work buffer);
  * ``scipy_mm``: ``x @ scipy.linalg.hadamard(n)`` (small n only);
and the ratios ``np_bfly / jax`` (and ``scipy_mm / jax``), then Fastfood
``A^T g`` and ``A s`` at the EMNIST-CNN size (D = 1,206,590, d = 16,384,
L = 2**21) against a NumPy implementation of the same operator. Also the
minor page faults per JAX call (the allocator trap of ENGINEERING_NOTES.md:
XLA:CPU buffers >= 32 MiB are fresh mmaps; run with
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1`` or a
preloaded tcmalloc to remove them).

Timing: ``block_until_ready``, warm-up calls, median of ``--repeats`` runs.
The machines are shared and noisy: compare ratios from one run.

Usage::

  python benchmarks/bench_fwht.py [--min_log2 16] [--max_log2 24]
      [--repeats 9] [--skip_fastfood]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Callable

import fedlite_jax  # noqa: F401  (before fedjax)

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from fedlite_jax.igc import fastfood as ff
from fedlite_jax.igc.fwht import fwht


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2):
  """Median wall time of fn() in ms, and minor page faults per call."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
  return 1e3 * statistics.median(times), faults / repeats


def np_fwht_inplace(x: np.ndarray) -> np.ndarray:
  """Radix-2 butterfly over the last axis of a 1-D float array, in place."""
  n = x.shape[-1]
  h = 1
  while h < n:
    v = x.reshape(n // (2 * h), 2, h)
    a = v[:, 0, :].copy()
    v[:, 0, :] += v[:, 1, :]
    np.subtract(a, v[:, 1, :], out=v[:, 1, :])
    h *= 2
  return x


def jax_butterfly(x: jax.Array) -> jax.Array:
  """Radix-2 butterfly in JAX: log2(n) passes (for comparison only)."""
  n = x.shape[-1]
  h = 1
  while h < n:
    v = x.reshape(n // (2 * h), 2, h)
    x = jnp.stack([v[:, 0] + v[:, 1], v[:, 0] - v[:, 1]], axis=1).reshape(n)
    h *= 2
  return x


def np_fastfood_project(p: dict, g: np.ndarray) -> np.ndarray:
  """A^T g in NumPy, same operator as ff.fastfood_project."""
  u = np.zeros(p['L'], np.float32)
  u[:p['D']] = g
  np_fwht_inplace(u)
  u *= p['gauss']
  w = np.empty_like(u)
  w[p['perm']] = u  # Pi^T: scatter.
  np_fwht_inplace(w)
  return w[:p['d']] * p['signs'] * p['scale']


def np_fastfood_lift(p: dict, s: np.ndarray) -> np.ndarray:
  v = np.zeros(p['L'], np.float32)
  v[:p['d']] = s * p['signs']
  np_fwht_inplace(v)
  v = v[p['perm']]  # Pi: gather.
  v *= p['gauss']
  np_fwht_inplace(v)
  return v[:p['D']] * p['scale']


def bench_fwht(min_log2: int, max_log2: int, repeats: int) -> None:
  jit_fwht = jax.jit(fwht)
  jit_vjp = jax.jit(lambda x, ct: jax.vjp(fwht, x)[1](ct)[0])
  jit_bfly = jax.jit(jax_butterfly)
  print(f'{"n":>10} {"jax":>9} {"jax_vjp":>9} {"jax_bfly":>9} '
        f'{"np_bfly":>9} {"scipy_mm":>9} {"np/jax":>7} {"mm/jax":>7} '
        f'{"faults":>7}')
  sizes = sorted(set([10, 12] + list(range(min_log2, max_log2 + 1))))
  for k in sizes:
    n = 1 << k
    rng = np.random.default_rng(k)
    x_np = rng.standard_normal(n).astype(np.float32)
    x = jnp.asarray(x_np)
    # Correctness guard against the NumPy reference.
    ref = np_fwht_inplace(x_np.copy())
    err = np.abs(np.asarray(jit_fwht(x)) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, (n, err)
    t_jax, faults = _median_ms(lambda: jit_fwht(x), repeats)
    t_vjp, _ = _median_ms(lambda: jit_vjp(x, x), repeats)
    t_bfly, _ = _median_ms(lambda: jit_bfly(x), repeats)
    buf = np.empty_like(x_np)

    def np_run():
      np.copyto(buf, x_np)  # Fresh input each call (one extra copy pass).
      return np_fwht_inplace(buf)

    t_np, _ = _median_ms(np_run, repeats)
    if n <= 4096:
      h = scipy.linalg.hadamard(n).astype(np.float32)
      t_mm, _ = _median_ms(lambda: x_np @ h, repeats)
      mm = f'{t_mm:9.3f}'
      mm_ratio = f'{t_mm / t_jax:7.2f}'
    else:
      mm, mm_ratio = f'{"-":>9}', f'{"-":>7}'
    print(f'{"2^" + str(k):>10} {t_jax:9.3f} {t_vjp:9.3f} {t_bfly:9.3f} '
          f'{t_np:9.3f} {mm} {t_np / t_jax:7.2f} {mm_ratio} {faults:7.0f}',
          flush=True)


def bench_fastfood(repeats: int, D: int = 1_206_590, d: int = 16_384) -> None:
  t0 = time.perf_counter()
  p = ff.fastfood_params(0, D, d)
  jax.block_until_ready(p)
  t_params = 1e3 * (time.perf_counter() - t0)
  pn = dict(L=p.L, D=D, d=d, gauss=np.asarray(p.gauss),
            perm=np.asarray(p.perm), signs=np.asarray(p.signs, np.float32),
            scale=np.float32(p.scale))
  g_np = np.random.default_rng(0).standard_normal(D).astype(np.float32)
  s_np = np.random.default_rng(1).standard_normal(d).astype(np.float32)
  g, s = jnp.asarray(g_np), jnp.asarray(s_np)
  proj = jax.jit(ff.fastfood_project)
  lift = jax.jit(ff.fastfood_lift)
  ref = np_fastfood_project(pn, g_np)
  got = np.asarray(proj(p, g))
  assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
  ref = np_fastfood_lift(pn, s_np)
  got = np.asarray(lift(p, s))
  assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
  print(f'\nFastfood D={D:,} d={d:,} L=2^{p.L.bit_length() - 1} '
        f'(fastfood_params: {t_params:.0f} ms incl. compile)')
  print(f'{"op":>10} {"jax":>9} {"numpy":>9} {"np/jax":>7} {"faults":>7}')
  for name, fj, fn in (
      ('project', lambda: proj(p, g), lambda: np_fastfood_project(pn, g_np)),
      ('lift', lambda: lift(p, s), lambda: np_fastfood_lift(pn, s_np))):
    t_j, faults = _median_ms(fj, repeats)
    t_n, _ = _median_ms(fn, repeats)
    print(f'{name:>10} {t_j:9.3f} {t_n:9.3f} {t_n / t_j:7.2f} {faults:7.0f}',
          flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--min_log2', type=int, default=16)
  parser.add_argument('--max_log2', type=int, default=24)
  parser.add_argument('--repeats', type=int, default=9)
  parser.add_argument('--skip_fastfood', action='store_true')
  args = parser.parse_args()
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'devices {jax.devices()}')
  bench_fwht(args.min_log2, args.max_log2, args.repeats)
  if not args.skip_fastfood:
    bench_fastfood(args.repeats)


if __name__ == '__main__':
  main()
