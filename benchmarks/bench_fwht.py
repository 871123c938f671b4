"""Benchmark: jitted JAX FWHT and Fastfood vs NumPy and C references, one process.

Prints, per length n, the median wall time (ms) of
  * ``jax``: :func:`fedlite_jax.transforms.fwht.fwht` under ``jax.jit``;
  * ``c``: the in-place, cache-blocked, single-threaded C FWHT of
    ``benchmarks/c_fwht/fwht.c`` (built at run time with ``gcc -O3
    -march=native`` into a temporary directory, called through ``ctypes``;
    includes a copy of the input into the work buffer, like ``np_bfly``);
  * ``jax_vjp``: its reverse-mode pullback (should cost about the same);
  * ``jax_bfly``: a per-level radix-2 butterfly in JAX (the design rejected);
  * ``np_bfly``: an in-place radix-2 butterfly in NumPy (float32; includes a
    copy of the input into the work buffer);
  * ``scipy_mm``: ``x @ scipy.linalg.hadamard(n)`` (small n only);
and the ratios ``jax / c`` (the issue's goal: <= 2 for n >= 2**20),
``np_bfly / jax`` (and ``scipy_mm / jax``), then Fastfood
``A^T g`` and ``A s`` at the EMNIST-CNN size (D = 1,206,590, d = 16,384,
L = 2**21) against a NumPy implementation of the same operator. Also the
minor page faults per JAX call (the allocator trap of docs/DESIGN_NOTES.md:
XLA:CPU buffers >= 32 MiB are fresh mmaps; run with
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1`` or a
preloaded tcmalloc to remove them; measured here, the glibc tunables also need
``:glibc.malloc.trim_threshold=17179869184``, else the heap top is trimmed
after each call and refaulted).

Timing: ``block_until_ready``, warm-up calls, median of ``--repeats`` runs;
the implementations compared at one size are called round-robin (jax, c,
jax, c, ...) so that load from other processes hits them alike. On a shared,
noisy machine compare ratios from one run. Each size also prints a
machine-readable line ``ratio fwht n=2^K jax/c=R np/jax=R``.

Usage::

  python benchmarks/bench_fwht.py [--sizes 16,20,22,24] [--repeats 9]
      [--skip_fastfood] [--no_c] [--smoke]
  GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1 \
      python benchmarks/bench_fwht.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Callable, Optional

import fedlite_jax  # noqa: F401  (before fedjax)

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from fedlite_jax.transforms import fastfood as ff
from fedlite_jax.transforms.fwht import fwht


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


_C_SOURCE = pathlib.Path(__file__).resolve().parent / 'c_fwht' / 'fwht.c'
C_FLAGS = ('-O3', '-march=native', '-shared', '-fPIC')


def build_c_fwht(build_dir: Optional[str] = None
                 ) -> Callable[[np.ndarray], np.ndarray]:
  """Compiles ``c_fwht/fwht.c`` and returns an in-place float32 FWHT.

  Args:
    build_dir: where the shared library goes (default: a fresh temporary
      directory, deleted as soon as the library is loaded).

  Returns:
    ``fn(x)``: transforms the C-contiguous ``float32[n]`` array ``x`` in
    place (``n`` a power of two) and returns it.

  Raises:
    RuntimeError: if ``gcc`` is missing or the compilation fails.
  """
  cc = shutil.which('gcc') or shutil.which('cc')
  if cc is None:
    raise RuntimeError('no C compiler (gcc/cc) on PATH.')
  tmp = build_dir or tempfile.mkdtemp(prefix='c_fwht_')
  lib_path = os.path.join(tmp, 'libfwht.so')
  subprocess.run([cc, *C_FLAGS, str(_C_SOURCE), '-o', lib_path], check=True)
  lib = ctypes.CDLL(lib_path)
  if build_dir is None:
    shutil.rmtree(tmp, ignore_errors=True)  # The mapping stays valid.
  lib.fwht_f32.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
  lib.fwht_f32.restype = ctypes.c_int

  def fn(x: np.ndarray) -> np.ndarray:
    if x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
      raise ValueError('c fwht needs a contiguous 1-D float32 array.')
    rc = lib.fwht_f32(x.ctypes.data, x.size)
    if rc != 0:
      raise ValueError(f'c fwht failed (code {rc}) for length {x.size}.')
    return x

  return fn


def interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int,
                   warmup: int = 2) -> dict[str, tuple[float, float]]:
  """Round-robin timing: ``{name: (median ms, minor page faults per call)}``.

  Every repeat calls each function once, in order, so that machine noise
  (other processes on the shared cores) hits all of them alike.
  """
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {k: [] for k in fns}
  faults = {k: 0 for k in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - t0)
      faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
  return {k: (1e3 * statistics.median(times[k]), faults[k] / repeats)
          for k in fns}


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


def bench_fwht(sizes: list[int], repeats: int,
               c_fwht: Optional[Callable[[np.ndarray], np.ndarray]],
               bfly: bool = True) -> None:
  """Prints the FWHT table and one ``ratio fwht`` line per size."""
  jit_fwht = jax.jit(fwht)
  jit_vjp = jax.jit(lambda x, ct: jax.vjp(fwht, x)[1](ct)[0])
  jit_bfly = jax.jit(jax_butterfly)
  print(f'{"n":>10} {"jax":>9} {"jax_vjp":>9} {"c":>9} {"jax_bfly":>9} '
        f'{"np_bfly":>9} {"scipy_mm":>9} {"jax/c":>7} {"np/jax":>7} '
        f'{"mm/jax":>7} {"faults":>7}')
  for k in sizes:
    n = 1 << k
    rng = np.random.default_rng(k)
    x_np = rng.standard_normal(n).astype(np.float32)
    x = jnp.asarray(x_np)
    # Correctness guard against the NumPy reference.
    ref = np_fwht_inplace(x_np.copy())
    scale = np.abs(ref).max()
    err = np.abs(np.asarray(jit_fwht(x)) - ref).max() / scale
    assert err < 1e-5, (n, err)
    buf = np.empty_like(x_np)

    def np_run():
      np.copyto(buf, x_np)  # Fresh input each call (one extra copy pass).
      return np_fwht_inplace(buf)

    def c_run():
      np.copyto(buf, x_np)  # Same copy as np_run.
      return c_fwht(buf)

    fns = {'jax': lambda: jit_fwht(x), 'jax_vjp': lambda: jit_vjp(x, x)}
    if c_fwht is not None:
      err_c = np.abs(c_run() - ref).max() / scale
      assert err_c < 1e-5, (n, err_c)
      fns['c'] = c_run
    if bfly:
      fns['jax_bfly'] = lambda: jit_bfly(x)
    fns['np_bfly'] = np_run
    if n <= 4096:
      h = scipy.linalg.hadamard(n).astype(np.float32)
      fns['scipy_mm'] = lambda: x_np @ h
    res = interleaved_ms(fns, repeats)
    t_jax, faults = res['jax']

    def col(name, width=9):
      return f'{res[name][0]:{width}.3f}' if name in res else f'{"-":>{width}}'

    def ratio(num, den):
      return (f'{res[num][0] / res[den][0]:7.2f}'
              if num in res and den in res else f'{"-":>7}')

    print(f'{"2^" + str(k):>10} {col("jax")} {col("jax_vjp")} {col("c")} '
          f'{col("jax_bfly")} {col("np_bfly")} {col("scipy_mm")} '
          f'{ratio("jax", "c")} {ratio("np_bfly", "jax")} '
          f'{ratio("scipy_mm", "jax")} {faults:7.0f}', flush=True)
    line = f'ratio fwht n=2^{k}'
    if 'c' in res:
      line += f' jax/c={res["jax"][0] / res["c"][0]:.2f}'
      line += f' jax_vjp/c={res["jax_vjp"][0] / res["c"][0]:.2f}'
    line += f' np/jax={res["np_bfly"][0] / t_jax:.2f}'
    if 'c' in res:
      line += f' np/c={res["np_bfly"][0] / res["c"][0]:.2f}'
    print(line, flush=True)


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
    res = interleaved_ms({'jax': fj, 'numpy': fn}, repeats)
    (t_j, faults), (t_n, _) = res['jax'], res['numpy']
    print(f'{name:>10} {t_j:9.3f} {t_n:9.3f} {t_n / t_j:7.2f} {faults:7.0f}',
          flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', default='16,20,22,24',
                      help='comma list of log2(n)')
  parser.add_argument('--repeats', type=int, default=9)
  parser.add_argument('--skip_fastfood', action='store_true')
  parser.add_argument('--no_c', action='store_true',
                      help='skip the C reference (no compiler needed)')
  parser.add_argument('--no_bfly', action='store_true',
                      help='skip the JAX radix-2 butterfly column')
  parser.add_argument('--smoke', action='store_true',
                      help='tiny sizes, 3 repeats (tests)')
  args = parser.parse_args()
  sizes = [int(v) for v in args.sizes.split(',')]
  repeats = args.repeats
  ff_sizes = dict(D=1_206_590, d=16_384)
  if args.smoke:
    sizes, repeats, ff_sizes = [10, 12, 16], 3, dict(D=50_000, d=1_024)
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'devices {jax.devices()}, '
        f'GLIBC_TUNABLES={os.environ.get("GLIBC_TUNABLES", "")!r}, '
        f'loadavg {open("/proc/loadavg").read().split()[:3]}')
  c_fwht = None if args.no_c else build_c_fwht()
  if c_fwht is not None:
    print(f'c reference: {_C_SOURCE.name} built with {" ".join(C_FLAGS)} '
          '(single thread)')
  bench_fwht(sizes, repeats, c_fwht, bfly=not args.no_bfly)
  if not args.skip_fastfood:
    bench_fastfood(repeats, **ff_sizes)


if __name__ == '__main__':
  main()
