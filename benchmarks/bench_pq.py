"""Benchmark: FedLite grouped PQ (fedlite_jax.transforms.pq) vs faiss and SciPy.

Two parts (``--parts``, comma-separated; default both):

``clients``: the quantizer per client at the FEMNIST setting (B = 20,
d = 9,216, q = 1,152, ``--iters`` = 20 Lloyd iterations), ``--clients``
clients, for L in ``--L`` (default 2, 8, 32):

* grouped PQ, R = 1 (the paper's default). Grouping is by subvector index
  (``pq.group_subvectors``): with R = 1 all ``B q = 23,040`` subvectors of
  dimension ``d / q = 8`` form one group with one codebook, i.e. one k-means
  with L centroids over 23,040 points of dimension 8. Compared:

  - ``ours vmap``: ``pq.grouped_pq`` ``jax.vmap``-ed over the clients, one
    jitted call (time / clients);
  - ``ours seq``: one jitted ``pq.grouped_pq`` call per client;
  - ``faiss``: ``faiss.Kmeans(8, L, niter=iters)`` on the same 23,040
    subvectors, single-threaded (``faiss.omp_set_num_threads(1)``), then the
    final assignment (``index.search``), i.e. the codewords, as ours;
  - ``scipy``: ``scipy.cluster.vq.kmeans2`` (``minit='matrix'``, ``iter`` =
    iters) and the final ``vq`` assignment (``--no_scipy`` to skip).

* vanilla PQ, R = q = 1,152 (one codebook per subvector index, each
  learned from the B = 20 subvectors with that index; L <= B, so L = 32 is
  not a valid configuration and is skipped): ours (vmap, seq) against
  ``faiss.ProductQuantizer(9216, 1152, log2 L)`` (``train`` + ``
  compute_codes``; ``cp.niter`` = iters), which is exactly this quantizer.

Every method starts from the same initial centroids
(``pq.kmeans_init_indices`` of the client's key; faiss through
``init_centroids`` / ``Train_hot_start``; faiss's point subsampling is
switched off with ``max_points_per_centroid``), so the relative quantization
errors ``||Z - Z~||^2 / ||Z||^2`` (mean over clients, computed the same way
for every method) should agree up to the empty-cluster rules (ours
``'farthest'``, faiss splits the largest cluster, scipy keeps the old
centroid) and float rounding. Printed beside the times.

``settings``: the earlier table (one client, jitted and vmapped, both
empty-cluster rules, scipy and scikit-learn when installed) at FEMNIST
q in {1,152, 2,304}, L in {2, 32} and the SO NWP setting.

Activations (``--activations``): ``synthetic`` (default; ReLU of correlated
Gaussians, fixed seed) or ``femnist``: real FEMNIST-105 batches (the first
batch of ``--clients`` sampled training clients, ``FEDLITE_DATA_DIR``) pushed
through the EMNIST CNN's client part at its seeded initialization (eval mode).

Timing: one warm-up (compilation) call per method, then ``--repeats`` rounds
in which the methods run one after the other (interleaved, so machine noise
hits them alike); median and minimum per client are printed. On a shared
machine compare the ratios of one run. faiss is imported lazily; without
it its columns are skipped with a message. JAX uses every core the process
may use (XLA:CPU's thread pool); for a strictly single-core comparison, run
under ``taskset -c 0`` (the header prints the usable CPUs). The lines
starting with ``RATIO`` are the summary (faiss/ours > 1: ours faster).

Usage:
  python benchmarks/bench_pq.py [--parts clients,settings] [--repeats 7]
      [--clients 10] [--L 2,8,32] [--activations synthetic|femnist]
  python benchmarks/bench_pq.py --smoke   # seconds; used by the tests
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any, Callable, Optional

import fedlite_jax  # noqa: F401  (before fedjax)
import jax
import numpy as np
from scipy.cluster import vq as scipy_vq

from fedlite_jax.transforms import pq

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
FEMNIST_B = 20
FEMNIST_D = 9216
FEMNIST_Q = 1152


def activations(rng: np.random.Generator, num_vectors: int,
                d: int) -> np.ndarray:
  mix = rng.normal(size=(16, d)) / 4
  return np.maximum(rng.normal(size=(num_vectors, 16)) @ mix, 0).astype(
      np.float32)


def femnist_activations(num_clients: int, batch_size: int,
                        seed: int = 0) -> np.ndarray:
  """``[C, B, 9216]`` EMNIST-CNN cut-layer activations of real FEMNIST data.

  The first batch (``splitfed.client_batch``) of each of ``num_clients``
  training clients drawn by FedJAX's ``UniformGetClientSampler(seed)``, with
  the client keys of round 0 (``runner.client_rng``), through the client
  part of ``models.create_emnist_cnn(62)`` at ``model.init(PRNGKey(seed))``,
  without dropout. Needs ``FEDLITE_DATA_DIR``.
  """
  # pylint: disable=g-import-not-at-top
  import fedjax
  from fedlite_jax import datasets
  from fedlite_jax import models
  from fedlite_jax.algorithms import splitfed
  from fedlite_jax.training import runner
  # pylint: enable=g-import-not-at-top
  train, _, _ = datasets.load_federated_data('emnist')
  split_model = models.create_emnist_cnn(62)
  wc, _ = split_model.split_params(
      split_model.model.init(jax.random.PRNGKey(seed)))
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, num_clients, seed)
  forward = jax.jit(lambda w, b: split_model.client_apply(w, b, None))
  out = []
  for cid, cds, _ in sampler.sample():
    batch = splitfed.client_batch(cds, batch_size,
                                  runner.client_rng(seed, 0, cid))
    out.append(np.asarray(forward(wc, batch), np.float32))
  return np.stack(out)


def import_faiss() -> Optional[Any]:
  """faiss single-threaded, or None (with a message) if it is missing."""
  try:
    import faiss  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    print(f'SKIP faiss: cannot import faiss ({e}); install the benchmark '
          "extra (pip install -e '.[bench]' or pip install faiss-cpu) for "
          'the faiss columns.', flush=True)
    return None
  faiss.omp_set_num_threads(1)
  return faiss


def best_ms(fn: Callable[[], object], repeats: int) -> float:
  fn()  # warm-up (compilation for JAX)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return 1e3 * min(times)


def interleaved_ms(fns: dict[str, Callable[[], object]],
                   repeats: int) -> dict[str, list[float]]:
  """Milliseconds of every call of every fn, round-robin after a warm-up."""
  for fn in fns.values():
    fn()
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      times[name].append(1e3 * (time.perf_counter() - start))
  return times


def relative_error(z: np.ndarray, recon: np.ndarray) -> float:
  z = z.astype(np.float64)
  return float(np.sum(np.square(z - recon)) / np.sum(np.square(z)))


# ------------------------------------------------------------ clients part


class _Methods:
  """The methods of the ``clients`` part for one (R, L), on C clients."""

  def __init__(self, zs: np.ndarray, keys: jax.Array, R: int, L: int,
               iters: int, faiss: Optional[Any], use_scipy: bool):
    self.zs, self.keys, self.R, self.L, self.iters = zs, keys, R, L, iters
    self.faiss = faiss
    self.num_clients, self.b, self.d = zs.shape
    self.q = FEMNIST_Q
    self.m = self.d // self.q
    self.zj = jax.device_put(zs)
    self.zl = [jax.device_put(z) for z in zs]
    self.kl = [keys[i] for i in range(self.num_clients)]
    # Groups [C, R, N, m] and the initial centroids [C, R, L, m] ours uses.
    self.x = np.stack([np.asarray(pq.group_subvectors(z, self.q, R))
                       for z in zs])
    self.c0 = np.stack([
        np.take_along_axis(
            x, np.asarray(pq.kmeans_init_indices(
                k, R, x.shape[1], L))[:, :, None], axis=1)
        for x, k in zip(self.x, self.kl)])
    self.vmapped = jax.jit(jax.vmap(
        lambda z, k: pq.grouped_pq(z, k, self.q, R, L, iters)))
    self.use_scipy = use_scipy and R == 1

  def fns(self) -> dict[str, Callable[[], object]]:
    out = {
        'ours vmap': lambda: jax.block_until_ready(
            self.vmapped(self.zj, self.keys).codewords),
        'ours seq': lambda: [
            pq.grouped_pq(z, k, self.q, self.R, self.L,
                          self.iters).codewords.block_until_ready()
            for z, k in zip(self.zl, self.kl)],
    }
    if self.faiss is not None:
      out['faiss'] = lambda: [self.faiss_one(i)
                              for i in range(self.num_clients)]
    if self.use_scipy:
      out['scipy'] = lambda: [self.scipy_one(i)
                              for i in range(self.num_clients)]
    return out

  def faiss_one(self, i: int) -> np.ndarray:
    """faiss quantization of client ``i``; returns ``Z~`` ``[B, d]``."""
    faiss = self.faiss
    if self.R == 1:
      x = self.x[i, 0]
      km = faiss.Kmeans(self.m, self.L, niter=self.iters, seed=0,
                        max_points_per_centroid=1 << 30,
                        min_points_per_centroid=1)
      km.train(x, init_centroids=self.c0[i, 0])
      _, assign = km.index.search(x, 1)
      # R = 1: point n is subvector n % q of vector n // q (a reshape).
      return km.centroids[assign[:, 0]].reshape(self.b, self.d)
    if self.R != self.q:
      raise ValueError('faiss ProductQuantizer is vanilla PQ (R = q).')
    quantizer = faiss.ProductQuantizer(self.d, self.q, int(math.log2(self.L)))
    quantizer.cp.niter = self.iters
    quantizer.cp.max_points_per_centroid = 1 << 30
    quantizer.cp.min_points_per_centroid = 1
    quantizer.train_type = faiss.ProductQuantizer.Train_hot_start
    faiss.copy_array_to_vector(self.c0[i].reshape(-1), quantizer.centroids)
    quantizer.train(self.zs[i])
    return quantizer.decode(quantizer.compute_codes(self.zs[i]))

  def scipy_one(self, i: int) -> np.ndarray:
    x = self.x[i, 0]
    code, _ = scipy_vq.kmeans2(x, self.c0[i, 0], iter=self.iters,
                               minit='matrix', missing='warn')
    assign, _ = scipy_vq.vq(x, code, check_finite=False)
    return code[assign].reshape(self.b, self.d)

  def errors(self) -> dict[str, float]:
    """Mean relative quantization error over the clients, per method."""
    res = self.vmapped(self.zj, self.keys)
    out = {'ours': float(np.mean([
        relative_error(z, r) for z, r in
        zip(self.zs, np.asarray(res.reconstruction))]))}
    if self.faiss is not None:
      out['faiss'] = float(np.mean([
          relative_error(self.zs[i], self.faiss_one(i))
          for i in range(self.num_clients)]))
    if self.use_scipy:
      out['scipy'] = float(np.mean([
          relative_error(self.zs[i], self.scipy_one(i))
          for i in range(self.num_clients)]))
    return out


def clients_part(args: argparse.Namespace, faiss: Optional[Any]) -> None:
  """The per-client FEMNIST table against faiss (module docstring)."""
  if args.activations == 'femnist':
    zs = femnist_activations(args.clients, FEMNIST_B)
  else:
    rng = np.random.default_rng(0)
    zs = np.stack([activations(rng, FEMNIST_B, FEMNIST_D)
                   for _ in range(args.clients)])
  keys = jax.random.split(jax.random.key(0), args.clients)
  print(f'\n## Per client, FEMNIST setting: B = {FEMNIST_B}, d = '
        f'{FEMNIST_D}, q = {FEMNIST_Q}, {args.iters} Lloyd iterations, '
        f'{args.clients} clients, {args.activations} activations; ms per '
        f'client, median (min) of {args.repeats} interleaved repeats; '
        f'rel err = ||Z - Z~||^2 / ||Z||^2, mean over clients')
  names = ['ours vmap', 'ours seq', 'faiss', 'scipy']
  header = (f'{"quantizer":11s} {"R":>5s} {"L":>3s} {"ratio":>7s} | ' +
            ' | '.join(f'{n:>17s}' for n in names) + ' | ' +
            ' '.join(f'{"err " + n.split()[0]:>10s}'
                     for n in ('ours', 'faiss', 'scipy')))
  print(header)
  print('-' * len(header))
  ratio_lines = []
  for label, R in (('grouped', 1), ('vanilla PQ', FEMNIST_Q)):
    for num_centroids in args.L:
      if num_centroids > FEMNIST_B * FEMNIST_Q // R:
        print(f'{label:11s} {R:5d} {num_centroids:3d}  skipped: L > B q / R '
              f'= {FEMNIST_B * FEMNIST_Q // R} (not a valid configuration)')
        continue
      if R != 1 and args.no_vanilla:
        continue
      methods = _Methods(zs, keys, R, num_centroids, args.iters, faiss,
                         not args.no_scipy)
      times = interleaved_ms(methods.fns(), args.repeats)
      med = {k: statistics.median(v) / args.clients for k, v in times.items()}
      low = {k: min(v) / args.clients for k, v in times.items()}
      errs = methods.errors()
      cells = []
      for n in names:
        cells.append(f'{med[n]:8.2f} ({low[n]:6.2f})' if n in med
                     else f'{"-":>17s}')
      err_cells = [f'{errs[n]:10.5f}' if n in errs else f'{"-":>10s}'
                   for n in ('ours', 'faiss', 'scipy')]
      ratio = pq.pq_compression_ratio(FEMNIST_D, FEMNIST_B, FEMNIST_Q, R,
                                      num_centroids)
      print(f'{label:11s} {R:5d} {num_centroids:3d} {ratio:7.1f} | ' +
            ' | '.join(cells) + ' | ' + ' '.join(err_cells), flush=True)
      for ref in ('faiss', 'scipy'):
        if ref in med:
          ratio_lines.append(
              f'RATIO {ref}/ours {label} R={R} L={num_centroids}: '
              f'vs vmap {med[ref] / med["ours vmap"]:.2f}x, '
              f'vs seq {med[ref] / med["ours seq"]:.2f}x (medians; > 1: ours '
              f'faster); rel err ours {errs["ours"]:.5f}, {ref} '
              f'{errs[ref]:.5f}')
  if faiss is None:
    print('(faiss columns skipped: faiss is not installed)')
  print()
  for line in ratio_lines:
    print(line)


# ----------------------------------------------------------- settings part


def settings_part(args: argparse.Namespace) -> None:
  """The one-client table at several settings (module docstring)."""
  print(f'\n## One client, {args.iters} Lloyd iterations, R = 1; ms per '
        f'client (min of {args.repeats})')
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--parts', default='clients,settings',
                      help='comma list of clients, settings')
  parser.add_argument('--repeats', type=int, default=7)
  parser.add_argument('--clients', type=int, default=10)
  parser.add_argument('--iters', type=int, default=20)
  parser.add_argument('--L', default='2,8,32',
                      help='centroids for the clients part (comma list)')
  parser.add_argument('--activations', default='synthetic',
                      choices=['synthetic', 'femnist'])
  parser.add_argument('--no_scipy', action='store_true',
                      help='skip scipy in the clients part')
  parser.add_argument('--no_vanilla', action='store_true',
                      help='skip the vanilla-PQ (R = q) rows')
  parser.add_argument('--smoke', action='store_true',
                      help='tiny run for the tests: clients part, 2 clients, '
                      '1 repeat, L = 2')
  args = parser.parse_args()
  if args.smoke:
    args.parts, args.repeats, args.clients, args.L = 'clients', 1, 2, '2'
  args.L = [int(v) for v in args.L.split(',') if v]
  parts = [p for p in args.parts.split(',') if p]
  unknown = set(parts) - {'clients', 'settings'}
  if unknown:
    parser.error(f'unknown --parts {sorted(unknown)}')

  print(f'jax {jax.__version__} on {jax.default_backend()}; usable CPUs '
        f'{len(os.sched_getaffinity(0))} of {os.cpu_count()}; load average '
        f'{os.getloadavg()}')
  faiss = import_faiss() if 'clients' in parts else None
  if faiss is not None:
    print(f'faiss {faiss.__version__}, omp threads '
          f'{faiss.omp_get_max_threads()}')
  if 'clients' in parts:
    clients_part(args, faiss)
  if 'settings' in parts:
    settings_part(args)


if __name__ == '__main__':
  import warnings  # pylint: disable=g-import-not-at-top
  warnings.filterwarnings('ignore', message='One of the clusters is empty')
  main()
