#!/usr/bin/env python3
"""Benchmark: Fastfood ``A^T g`` (project) and ``A s`` (lift): time vs D, peak memory.

Melas-Kyriazi & Wang (2022), Section 3.2: a product with the D x d Fastfood
matrix costs O(L log L) time and O(L) memory (L = 2**ceil(log2 max(D, d))),
never D x d. This script measures both claims for
:func:`fedlite_jax.transforms.fastfood.fastfood_project` / ``fastfood_lift``:

* **Time** (in this process, one size after another): median ms per call of
  the jitted JAX operator and of a NumPy reference of the same operator that
  uses the C FWHT of ``benchmarks/c_fwht/fwht.c`` (``np+c``; the two are
  called round-robin, so load hits both alike), ``ns / (L log2 L)`` (flat
  if the cost is ~L log L), and the ratio ``jax / np+c``.
* **Peak memory** (a fresh subprocess per size, default glibc allocator:
  ``GLIBC_TUNABLES`` is removed from its environment): the child builds ``A``
  (``fastfood_params``), then for each operator resets the RSS high-water
  mark (``echo 5 > /proc/self/clear_refs``) and reads ``VmHWM`` from
  ``/proc/self/status`` after the first call (compilation included) and
  after ``repeats`` further calls. Printed: the parameter arrays' bytes
  (``12 L``), each operator's peak minus the RSS before it (MiB and bytes
  per L), and what a dense ``A`` would take (``4 D d`` bytes).

``--gpt2``: one size, D = 124,439,808 (GPT-2), d = 2**16, L = 2**27, timed
and measured in one fresh subprocess (~2 GB of parameters; building ``A``
takes ~40 s here).

Lines starting ``ratio fastfood`` and ``memory fastfood`` are
machine-readable. The machine is shared and noisy: compare ratios.

Usage::

  python benchmarks/bench_fastfood.py [--sizes 65536,...] [--d 16384]
  python benchmarks/bench_fastfood.py --gpt2
  python benchmarks/bench_fastfood.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Callable, Optional

import fedlite_jax  # noqa: F401  (before fedjax)

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.transforms import fastfood as ff

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fwht  # noqa: E402  (sibling script: C FWHT, timers)

GPT2_D = 124_439_808
GPT2_d = 1 << 16
DEFAULT_SIZES = (1 << 16, 1 << 18, 1 << 20, 1_206_590, 4_000_000, 8_000_000,
                 16_000_000)

FwhtFn = Callable[[np.ndarray], np.ndarray]


def np_params(p: ff.FastfoodParams) -> dict:
  """The parameters as NumPy arrays (for the reference implementation)."""
  return dict(L=p.L, D=p.D, d=p.d, gauss=np.asarray(p.gauss),
              perm=np.asarray(p.perm), inv_perm=np.asarray(p.inv_perm),
              signs=np.asarray(p.signs, np.float32),
              scale=np.float32(p.scale))


def ref_project(p: dict, g: np.ndarray, fwht_fn: FwhtFn,
                work: np.ndarray) -> np.ndarray:
  """``A^T g`` in NumPy with an in-place FWHT (same shortcut as ours).

  ``work`` is a preallocated ``float32[L]`` buffer (reused across calls).
  """
  L, D, d = p['L'], p['D'], p['d']
  m = 1 << (d - 1).bit_length()
  work[:D] = g
  work[D:] = 0.0
  fwht_fn(work)
  work *= p['gauss']
  w = work[p['inv_perm']]                       # Pi^T (gather)
  w = w.reshape(L // m, m).sum(axis=0)          # first_m H_L = H_m sum_blocks
  fwht_fn(w)
  return w[:d] * p['signs'] * p['scale']


def ref_lift(p: dict, s: np.ndarray, fwht_fn: FwhtFn) -> np.ndarray:
  """``A s`` in NumPy with an in-place FWHT (same shortcut as ours)."""
  L, D, d = p['L'], p['D'], p['d']
  m = 1 << (d - 1).bit_length()
  v = np.zeros(m, np.float32)
  v[:d] = s * p['signs']
  fwht_fn(v)
  v = np.tile(v, L // m)[p['perm']]             # H_L Pad_L, then Pi
  v *= p['gauss']
  fwht_fn(v)
  return v[:D] * p['scale']


def _status_kib(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1])
  raise KeyError(field)


def _reset_hwm() -> bool:
  """Resets VmHWM to the current RSS (Linux >= 4.0); False if not allowed."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def child_measure(D: int, d: int, repeats: int) -> dict:
  """Runs in a fresh process: time and peak RSS of each operator."""
  out = {'D': D, 'd': d}
  t0 = time.perf_counter()
  p = ff.fastfood_params(0, D, d)
  jax.block_until_ready(p)
  out['params_s'] = time.perf_counter() - t0
  out['L'] = p.L
  out['params_bytes'] = int(sum(x.nbytes for x in jax.tree.leaves(p)))
  g = jnp.asarray(np.random.default_rng(0).standard_normal(D, np.float32))
  s = jnp.asarray(np.random.default_rng(1).standard_normal(d, np.float32))
  jax.block_until_ready((g, s))
  out['rss_after_params_mib'] = _status_kib('VmRSS') / 1024
  out['hwm_after_params_mib'] = _status_kib('VmHWM') / 1024
  for name, fn in (('project', lambda: ff.fastfood_project(p, g)),
                   ('lift', lambda: ff.fastfood_lift(p, s))):
    base = _status_kib('VmRSS')
    out['hwm_reset'] = _reset_hwm()
    jax.block_until_ready(fn())  # Compiles.
    first = _status_kib('VmHWM') - base
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times.append(time.perf_counter() - t0)
    steady = _status_kib('VmHWM') - base
    out[name] = {'peak_first_mib': first / 1024, 'peak_mib': steady / 1024,
                 'ms': 1e3 * float(np.median(times))}
  out['final_hwm_mib'] = _status_kib('VmHWM') / 1024
  return out


def run_child(D: int, d: int, repeats: int) -> dict:
  """Starts a fresh interpreter for :func:`child_measure`; parses its JSON."""
  cmd = [sys.executable, os.path.abspath(__file__), '--_child',
         f'{D},{d},{repeats}']
  # Default glibc allocator in the child: buffers >= the mmap threshold are
  # fresh mappings returned to the OS on free, so the high-water mark shows
  # each operator's working set. (With mmap_max=0 the heap keeps pages freed
  # while building A and the operators reuse them: the HWM would not move.)
  env = {k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}
  proc = subprocess.run(cmd, check=True, capture_output=True, text=True,
                        env=env)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def print_memory(res: dict) -> None:
  L, D, d = res['L'], res['D'], res['d']
  dense_gib = 4 * D * d / 2**30
  print(f'\nPeak memory, fresh process: D={D:,} d={d:,} L=2^{L.bit_length() - 1}'
        f' (params: {res["params_bytes"] / 2**20:.1f} MiB = '
        f'{res["params_bytes"] / L:.1f} B/L, built in '
        f'{res["params_s"]:.1f} s; RSS after params '
        f'{res["rss_after_params_mib"]:.0f} MiB; HWM reset supported: '
        f'{res["hwm_reset"]}; dense A would be {dense_gib:,.1f} GiB)')
  print(f'{"op":>8} {"ms":>10} {"peak-base MiB (1st call)":>25} '
        f'{"peak-base MiB":>14} {"B per L":>8}')
  for op in ('project', 'lift'):
    r = res[op]
    peak = max(r['peak_mib'], r['peak_first_mib'])
    print(f'{op:>8} {r["ms"]:10.2f} {r["peak_first_mib"]:25.1f} '
          f'{r["peak_mib"]:14.1f} {peak * 2**20 / L:8.1f}')
    print(f'memory fastfood D={D} d={d} op={op} peak_mib={peak:.1f} '
          f'bytes_per_L={peak * 2**20 / L:.1f} '
          f'params_mib={res["params_bytes"] / 2**20:.1f} '
          f'dense_A_gib={dense_gib:.1f} ms={r["ms"]:.2f}', flush=True)


def bench_time(sizes: list[int], d: int, repeats: int,
               c_fwht: Optional[FwhtFn]) -> None:
  """Time vs D in this process; prints the table and ``ratio`` lines."""
  fwht_fn = c_fwht or bench_fwht.np_fwht_inplace
  ref_name = 'np+c' if c_fwht is not None else 'np'
  print(f'\nTime vs D (d={d:,}; median of {repeats}; ns/LlogL = time / '
        f'(L log2 L); {ref_name}: NumPy + {"C" if c_fwht else "NumPy"} '
        'FWHT reference)')
  print(f'{"D":>12} {"L":>6} {"op":>8} {"jax ms":>9} {ref_name + " ms":>9} '
        f'{"jax/" + ref_name:>8} {"jax ns/LlogL":>13} {"ref ns/LlogL":>13}')
  for D in sizes:
    p = ff.fastfood_params(0, D, d)
    pn = np_params(p)
    L = p.L
    llogl = L * math.log2(L)
    g_np = np.random.default_rng(0).standard_normal(D).astype(np.float32)
    s_np = np.random.default_rng(1).standard_normal(d).astype(np.float32)
    g, s = jnp.asarray(g_np), jnp.asarray(s_np)
    work = np.empty(L, np.float32)
    # Correctness guard: both implementations compute the same operator.
    for got, ref in (
        (ff.fastfood_project(p, g), ref_project(pn, g_np, fwht_fn, work)),
        (ff.fastfood_lift(p, s), ref_lift(pn, s_np, fwht_fn))):
      got = np.asarray(got)
      assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), D
    for op, fj, fr in (
        ('project', lambda p=p, g=g: ff.fastfood_project(p, g),
         lambda pn=pn, g_np=g_np, work=work: ref_project(pn, g_np, fwht_fn,
                                                         work)),
        ('lift', lambda p=p, s=s: ff.fastfood_lift(p, s),
         lambda pn=pn, s_np=s_np: ref_lift(pn, s_np, fwht_fn))):
      res = bench_fwht.interleaved_ms({'jax': fj, 'ref': fr}, repeats)
      tj, tr = res['jax'][0], res['ref'][0]
      print(f'{D:>12,} {"2^" + str(L.bit_length() - 1):>6} {op:>8} '
            f'{tj:9.2f} {tr:9.2f} {tj / tr:8.2f} {1e6 * tj / llogl:13.3f} '
            f'{1e6 * tr / llogl:13.3f}', flush=True)
      print(f'ratio fastfood D={D} L={L} op={op} jax/{ref_name}={tj / tr:.2f} '
            f'jax_ns_per_LlogL={1e6 * tj / llogl:.3f} jax_ms={tj:.2f}',
            flush=True)
    del p, pn, work


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', default=','.join(map(str, DEFAULT_SIZES)),
                      help='comma list of D')
  parser.add_argument('--d', type=int, default=1 << 14,
                      help='intrinsic dimension')
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--memory_sizes', default='1206590,4000000,16000000',
                      help='comma list of D measured in fresh subprocesses')
  parser.add_argument('--gpt2', action='store_true',
                      help='only GPT-2 scale (D=124,439,808, d=2^16, '
                      'L=2^27), in a fresh subprocess')
  parser.add_argument('--no_c', action='store_true',
                      help='NumPy FWHT in the reference (no compiler)')
  parser.add_argument('--smoke', action='store_true',
                      help='tiny sizes, 2 repeats (tests)')
  parser.add_argument('--_child', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._child:
    D, d, repeats = (int(v) for v in args._child.split(','))
    print(json.dumps(child_measure(D, d, repeats)))
    return
  print(f'jax {jax.__version__}, backend {jax.default_backend()}, '
        f'GLIBC_TUNABLES={os.environ.get("GLIBC_TUNABLES", "")!r}, '
        f'loadavg {open("/proc/loadavg").read().split()[:3]}', flush=True)
  if args.gpt2:
    print_memory(run_child(GPT2_D, GPT2_d, 3))
    return
  sizes = [int(v) for v in args.sizes.split(',')]
  mem_sizes = [int(v) for v in args.memory_sizes.split(',') if v]
  d, repeats = args.d, args.repeats
  if args.smoke:
    sizes, mem_sizes, d, repeats = [50_000, 200_000], [200_000], 1024, 2
  c_fwht = None if args.no_c else bench_fwht.build_c_fwht()
  bench_time(sizes, d, repeats, c_fwht)
  for D in mem_sizes:
    print_memory(run_child(D, d, repeats))


if __name__ == '__main__':
  main()
