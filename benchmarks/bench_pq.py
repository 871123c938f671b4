"""Benchmark: FedLite grouped PQ (fedlite_jax.fedlite.pq) vs NumPy/SciPy.

Times one client's quantization (k-means with a fixed number of Lloyd
iterations from the same initial centroids) at the paper's settings:

* FEMNIST: B = 20, d = 9,216, q in {1,152, 2,304}, L in {2, 32}, R = 1;
* SO NWP: 3,840 vectors (128 sequences x 30 tokens) of d = 96, q = 24,
  L = 30, R = 1;

for ``grouped_pq`` (jitted; both empty-cluster rules), the same vmapped over
``--clients`` clients (time per client), and ``scipy.cluster.vq.kmeans2``
(``minit='matrix'``, same initial points, ``iter`` = the same number of Lloyd
steps; it keeps empty clusters like ``empty_cluster='keep'``). Also
scikit-learn's ``KMeans`` (Lloyd, ``n_init=1``, same init, ``tol=0``) when
installed; it stops early once assignments no longer change.

Data: ReLU of correlated Gaussians (a stand-in for post-convolution
activations), fixed seed. Timings are the minimum over ``--repeats`` runs
(after a warm-up/compile run) in one process; the machines are shared, so
compare ratios from one run. No timing is asserted anywhere.

Usage: python benchmarks/bench_pq.py [--repeats 7] [--clients 10]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import fedlite_jax  # noqa: F401  (before fedjax; none is used here)
import jax
import numpy as np
from scipy.cluster import vq as scipy_vq

from fedlite_jax.fedlite import pq

try:
  from sklearn.cluster import KMeans  # pylint: disable=g-import-not-at-top
except ImportError:  # pragma: no cover
  KMeans = None

SETTINGS = (
    # name, B, d, q, L
    ('FEMNIST', 20, 9216, 1152, 2),
    ('FEMNIST', 20, 9216, 1152, 32),
    ('FEMNIST', 20, 9216, 2304, 2),
    ('FEMNIST', 20, 9216, 2304, 32),
    ('SO NWP', 3840, 96, 24, 30),
)


def activations(rng: np.random.Generator, num_vectors: int,
                d: int) -> np.ndarray:
  mix = rng.normal(size=(16, d)) / 4
  return np.maximum(rng.normal(size=(num_vectors, 16)) @ mix, 0).astype(
      np.float32)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
  fn()  # warm-up (compilation for JAX)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return 1e3 * min(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--clients', type=int, default=10)
  parser.add_argument('--iters', type=int, default=20)
  args = parser.parse_args()

  print(f'jax {jax.__version__} on {jax.default_backend()}, '
        f'{args.iters} Lloyd iterations, R = 1; ms per client (min of '
        f'{args.repeats})')
  header = (f'{"setting":8s} {"B":>5s} {"d":>5s} {"q":>5s} {"L":>3s} '
            f'{"ratio":>7s} | {"jax":>7s} {"keep":>7s} {"vmap":>7s} '
            f'{"compile":>8s} | {"kmeans2":>8s} {"x":>5s} | {"sklearn":>8s}'
            f' {"x":>5s}')
  print(header)
  print('-' * len(header))
  rng = np.random.default_rng(0)
  key = jax.random.key(0)
  for name, b, d, q, num_centroids in SETTINGS:
    z = activations(rng, b, d)
    zj = jax.device_put(z)
    run = lambda rule: pq.grouped_pq(  # pylint: disable=g-long-lambda
        zj, key, q, 1, num_centroids, args.iters,
        empty_cluster=rule).codewords.block_until_ready()
    start = time.perf_counter()
    run('farthest')
    compile_s = time.perf_counter() - start
    jax_ms = best_ms(lambda: run('farthest'), args.repeats)
    keep_ms = best_ms(lambda: run('keep'), args.repeats)

    zs = jax.device_put(np.stack([activations(rng, b, d)
                                  for _ in range(args.clients)]))
    keys = jax.random.split(key, args.clients)
    batched = jax.jit(jax.vmap(lambda z, k: pq.grouped_pq(
        z, k, q, 1, num_centroids, args.iters).codewords))
    vmap_ms = best_ms(lambda: batched(zs, keys).block_until_ready(),
                      args.repeats) / args.clients

    points = np.asarray(pq.group_subvectors(z, q, 1))[0].astype(np.float64)
    init = np.asarray(pq.kmeans_init_indices(key, 1, len(points),
                                             num_centroids))[0]
    scipy_ms = best_ms(
        lambda: scipy_vq.kmeans2(points, points[init], iter=args.iters,
                                 minit='matrix', missing='warn'),
        args.repeats)
    row = (f'{name:8s} {b:5d} {d:5d} {q:5d} {num_centroids:3d} '
           f'{pq.pq_compression_ratio(d, b, q, 1, num_centroids):7.1f} | '
           f'{jax_ms:7.2f} {keep_ms:7.2f} {vmap_ms:7.2f} {compile_s:7.1f}s | '
           f'{scipy_ms:8.2f} {scipy_ms / jax_ms:5.1f}')
    if KMeans is not None:
      km = KMeans(num_centroids, init=points[init], n_init=1,
                  max_iter=args.iters, tol=0.0, algorithm='lloyd')
      sk_ms = best_ms(lambda: km.fit(points), args.repeats)
      row += f' | {sk_ms:8.2f} {sk_ms / jax_ms:5.1f}'
    print(row, flush=True)
  print('x = reference time / jax time (> 1: JAX faster). keep: '
        "empty_cluster='keep'; vmap: per client, vmapped over "
        f'{args.clients} clients.')


if __name__ == '__main__':
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.filterwarnings('ignore', message='One of the clusters is empty')
  main()
