"""Grouped product quantization of activation batches (FedLite, Section 4.1).

FedLite (Wang et al., "FedLite: A Scalable Approach for Federated Learning on
Resource-constrained Clients", Section 4.1, Figure 2) compresses a client's
batch of activations ``Z`` (``B`` vectors of dimension ``d``) as follows:

1. split every vector ``z^(j)`` into ``q`` subvectors ``z^(j,s)`` of dimension
   ``d / q``;
2. stack the subvectors into ``R`` groups **by subvector index**: group ``r``
   (0-based) holds ``z^(j,s)`` for every ``j`` in the batch and every ``s`` in
   the ``r``-th block of ``q / R`` consecutive indices,
   ``s in [r q/R, (r+1) q/R)``. (Grouping by *batch* index instead, as some
   public re-implementations do, is a different and wrong quantizer; with
   ``R = 1`` the two coincide.)
3. run k-means with ``L`` centroids in every group; the ``R x L`` centroids are
   the *codebook*, the index of each subvector's nearest centroid in its group
   (equation 4) is its *codeword*, and the quantized batch ``Z~`` replaces
   every subvector by its centroid (equation 3).

The message holds the codebook and the codewords: ``phi d R L / q + B q log2 L``
bits instead of ``phi d B`` (``phi`` bits per float, 64 in all of the paper's
ratios; ``log2 L`` is not rounded up). ``q = 1`` is plain k-means on whole
vectors and ``R = q`` is vanilla product quantization.

Everything here is pure JAX: :func:`grouped_pq` jit-compiles with static
``q, R, L, num_iters`` and options, works inside an outer ``jax.jit``, and can
be ``jax.vmap``-ed over a leading client axis (one key per client; the vmap
folds clients into the group axis, see :func:`_batched_lloyd`).

k-means details, which the paper leaves open:

* **Initialization** (:func:`kmeans_init_indices`): stratified sampling of
  distinct points. The ``N = B q / R`` points of a group are split into ``L``
  contiguous strata ``[floor(l N / L), floor((l + 1) N / L))`` and centroid
  ``l`` starts at a uniformly random point of stratum ``l`` (one uniform draw
  per centroid, independent per group). The indices are distinct because
  ``L <= N``; unlike ``jax.random.choice(replace=False)`` (a full sort of
  ``N`` keys, ~7 ms per client at the FEMNIST setting on XLA:CPU) it costs
  ``O(R L)``. Points of a group are ordered batch-major (point ``n`` is
  vector ``n // (q/R)``, subvector ``r q/R + n % (q/R)``), so the strata are
  runs of consecutive examples of the batch.
* **Lloyd iterations**: exactly ``num_iters`` (assign, update) steps, then one
  final assignment, so the codewords are always the nearest centroids of the
  returned codebook (``num_iters = 0`` returns the initial points as the
  codebook). Ties go to the lowest centroid index. The mean squared error is
  non-increasing in ``num_iters`` (for a fixed key).
* **Empty clusters** are handled deterministically, per group and iteration:
  ``'keep'`` keeps an empty cluster's previous centroid (as
  ``scipy.cluster.vq.kmeans2``); ``'farthest'`` (default) moves the
  lowest-indexed empty cluster onto the point farthest from its centroid
  (lowest point index on ties), like scikit-learn's relocation, unless every
  point already coincides with its centroid; further empty clusters wait for
  later iterations. With ``'farthest'`` and ``L >=`` the number of distinct
  subvectors in every group, enough iterations give an exact reconstruction.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Literal

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

EmptyClusterRule = Literal['farthest', 'keep']
UpdateMethod = Literal['auto', 'segment_sum', 'onehot']

#: Bits per floating-point number in all of the paper's ratios (footnote 3).
DEFAULT_PHI = 64.0
#: Default number of Lloyd iterations (the paper does not say).
DEFAULT_NUM_ITERS = 20

# Centroids are scanned in blocks of this many when assigning points: inside a
# block an unrolled running minimum (jnp.argmin over an axis of >= ~31 hits a
# slow XLA:CPU path: 2.5 ms vs 0.1 ms for 32 x 23,040 distances), across
# blocks a fori_loop (fully unrolled code for L = 960 compiled for 40 s and ran
# 1000x slower). Measured on XLA:CPU, see benchmarks/bench_pq.py.
_ASSIGN_BLOCK = 32
# Subvectors up to this dimension get exact, unrolled distance computations.
_DIRECT_MAX_DIM = 8
_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class PQResult:
  """Output of :func:`grouped_pq` for one batch (one client).

  Array fields get a leading client axis under ``jax.vmap``; the three size
  fields are static Python floats (pytree metadata), identical for every
  client of a vmapped call.

  Attributes:
    codebook: float32 ``[R, L, d // q]``; ``codebook[r, l]`` is centroid ``l``
      of group ``r`` (subvector indices ``s`` with ``s // (q // R) == r``).
    codewords: int32 ``[B, q]``; ``codewords[j, s]`` is the centroid index in
      ``[0, L)`` of subvector ``s`` of vector ``j`` (equation 4).
    reconstruction: ``[B, d]`` with ``z``'s dtype; the quantized batch
      ``Z~`` (equation 3): subvector ``s`` of row ``j`` is
      ``codebook[s // (q // R), codewords[j, s]]``.
    quantization_error: float32 scalar; mean over the ``B`` vectors of the
      squared Euclidean error, ``sum_j ||z_j - z~_j||^2 / B`` (units of
      ``z`` squared).
    relative_error: float32 scalar; ``||Z - Z~||_F^2 / ||Z||_F^2`` (0 when
      ``Z`` is all zeros).
    message_bits: codebook + codewords, ``phi d R L / q + B q log2(L)``.
    uncompressed_bits: ``phi d B``.
    compression_ratio: ``uncompressed_bits / message_bits``.
  """

  codebook: jax.Array
  codewords: jax.Array
  reconstruction: jax.Array
  quantization_error: jax.Array
  relative_error: jax.Array
  message_bits: float
  uncompressed_bits: float
  compression_ratio: float


jax.tree_util.register_dataclass(
    PQResult,
    data_fields=['codebook', 'codewords', 'reconstruction',
                 'quantization_error', 'relative_error'],
    meta_fields=['message_bits', 'uncompressed_bits', 'compression_ratio'])


def _check_int(name: str, value: object, minimum: int) -> int:
  if (isinstance(value, bool) or
      not isinstance(value, (int, np.integer)) or value < minimum):
    raise ValueError(
        f'{name} must be an integer >= {minimum}, got {value!r}.')
  return int(value)


def _check_phi(phi: object) -> float:
  if (isinstance(phi, bool) or
      not isinstance(phi, (int, float, np.integer, np.floating)) or
      not (phi > 0 and math.isfinite(phi))):
    raise ValueError(
        f'phi (bits per float) must be a positive number, got {phi!r}.')
  return float(phi)


def validate_pq_config(d: int, B: int, q: int, R: int, L: int) -> None:
  """Checks a grouped-PQ configuration (Section 4.1).

  Args:
    d: activation dimension (``>= 1``).
    B: vectors in the batch (``>= 1``).
    q: subvectors per vector; must divide ``d``.
    R: number of groups; must divide ``q``.
    L: centroids per group; ``1 <= L <= B q / R`` (k-means cannot have more
      centroids than its group has subvectors).

  Raises:
    ValueError: naming the offending value and what is allowed.
  """
  d = _check_int('d (activation dimension)', d, 1)
  B = _check_int('B (number of vectors)', B, 1)
  q = _check_int('q (subvectors per vector)', q, 1)
  R = _check_int('R (number of groups)', R, 1)
  L = _check_int('L (centroids per group)', L, 1)
  if d % q:
    raise ValueError(
        f'q (subvectors per vector) must divide d={d}, got q={q}.')
  if q % R:
    raise ValueError(f'R (number of groups) must divide q={q}, got R={R}.')
  points = B * (q // R)
  if L > points:
    raise ValueError(
        f'L (centroids per group) must be at most the number of subvectors '
        f'in a group, B*q/R = {B}*{q}/{R} = {points}; got L={L}.')


def uncompressed_bits(d: int, B: int, phi: float = DEFAULT_PHI) -> float:
  """Size of an uncompressed batch of ``B`` activations, ``phi d B`` bits."""
  d = _check_int('d (activation dimension)', d, 1)
  B = _check_int('B (number of vectors)', B, 1)
  return _check_phi(phi) * d * B


def pq_message_bits(d: int, B: int, q: int, R: int, L: int,
                    phi: float = DEFAULT_PHI) -> float:
  """Grouped-PQ message size in bits, ``phi d R L / q + B q log2(L)``.

  Section 4.1: the codebook is ``R L`` centroids of ``d / q`` floats of ``phi``
  bits each; the codewords are ``B q`` indices of ``log2 L`` bits each (not
  rounded up, as in the paper's ratios). Needs no data.

  Args:
    d: activation dimension.
    B: number of activation vectors in the batch.
    q: subvectors per vector (divides ``d``).
    R: groups (divides ``q``).
    L: centroids per group (``1 <= L <= B q / R``).
    phi: bits per float (the paper uses 64).

  Returns:
    The message size in bits (a Python float).

  Raises:
    ValueError: for an invalid configuration (see :func:`validate_pq_config`)
      or a non-positive ``phi``.
  """
  validate_pq_config(d, B, q, R, L)
  return _check_phi(phi) * d * R * L / q + B * q * math.log2(L)


def pq_compression_ratio(d: int, B: int, q: int, R: int, L: int,
                         phi: float = DEFAULT_PHI) -> float:
  """``phi d B / pq_message_bits(...)``, e.g. 490.2 for FEMNIST (Section 5).

  Raises:
    ValueError: as :func:`pq_message_bits`.
  """
  return uncompressed_bits(d, B, phi) / pq_message_bits(d, B, q, R, L, phi)


def kmeans_init_indices(key: jax.Array, num_groups: int, num_points: int,
                        num_centroids: int) -> jax.Array:
  """Stratified random initial-centroid indices, distinct within each group.

  Centroid ``l`` of group ``r`` starts at a uniformly random point of stratum
  ``[floor(l N / L), floor((l + 1) N / L))``, where ``N = num_points`` and
  ``L = num_centroids``: ``lo + min(floor(u size), size - 1)`` with
  ``u = jax.random.uniform(key, (R, L))`` (float32, so uniform up to a relative
  bias below ``size * 2**-23``; ``jax.random.randint`` doubled the compile time
  of the whole quantizer). No sort and no permutation; see the module
  docstring.

  Args:
    key: a JAX PRNG key (typed or raw uint32).
    num_groups: ``R``.
    num_points: ``N``, points per group (``B q / R`` in grouped PQ).
    num_centroids: ``L``, with ``1 <= L <= N``.

  Returns:
    int32 ``[R, L]``, strictly increasing along the last axis.

  Raises:
    ValueError: if ``L > N`` or a size is not a positive integer.
  """
  num_groups = _check_int('R (number of groups)', num_groups, 1)
  num_points = _check_int('N (points per group)', num_points, 1)
  num_centroids = _check_int('L (centroids per group)', num_centroids, 1)
  if num_centroids > num_points:
    raise ValueError(f'L (centroids per group) must be at most the number of '
                     f'points per group N={num_points}, got L={num_centroids}.')
  edges = (np.arange(num_centroids + 1, dtype=np.int64) * num_points //
           num_centroids)
  lo = edges[:-1].astype(np.int32)
  size = np.diff(edges).astype(np.int32)
  u = jax.random.uniform(key, (num_groups, num_centroids), jnp.float32)
  offset = jnp.floor(u * size.astype(np.float32)).astype(jnp.int32)
  return lo + jnp.minimum(offset, size - 1)


def _nearest(c: jax.Array, xt: jax.Array) -> jax.Array:
  """Index of the nearest centroid of every point, batched over groups.

  Squared distances are formed in blocks of ``_ASSIGN_BLOCK`` centroids and
  reduced with an unrolled running minimum (strict ``<``: the lowest index
  wins ties). For subvectors of dimension ``m <= _DIRECT_MAX_DIM`` they are
  exact sums of squared differences, unrolled over the ``m`` coordinates (4x
  faster than a matmul with an inner dimension of 4 on XLA:CPU); for larger
  ``m``, ``||c||^2 - 2 x.c`` (one matmul per block; ``||x||^2`` is constant
  per point and dropped).

  Args:
    c: ``[G, L, m]`` centroids.
    xt: ``[G, m, N]`` points, transposed (points on the minor axis, so that
      the per-centroid rows of the distance matrix are contiguous).

  Returns:
    int32 ``[G, N]``.
  """
  g, num_centroids, m = c.shape
  n = xt.shape[-1]
  direct = m <= _DIRECT_MAX_DIM
  cc = jnp.sum(c * c, axis=-1)
  block = min(num_centroids, _ASSIGN_BLOCK)
  num_blocks = -(-num_centroids // block)
  pad = num_blocks * block - num_centroids
  if pad:
    # Padding centroids are at +inf distance and never chosen.
    c = jnp.concatenate(
        [c, jnp.full((g, pad, m), jnp.inf if direct else 0, c.dtype)], axis=1)
    cc = jnp.concatenate([cc, jnp.full((g, pad), jnp.inf, cc.dtype)], axis=1)
  c = c.reshape(g, num_blocks, block, m)
  cc = cc.reshape(g, num_blocks, block)

  def scan_block(b, carry):
    best, arg = carry
    cb = lax.dynamic_index_in_dim(c, b, axis=1, keepdims=False)
    if direct:
      rows = []
      for l in range(block):
        dist = jnp.square(xt[:, 0] - cb[:, l, 0:1])
        for k in range(1, m):
          dist = dist + jnp.square(xt[:, k] - cb[:, l, k:k + 1])
        rows.append(dist)
    else:
      ccb = lax.dynamic_index_in_dim(cc, b, axis=1, keepdims=False)
      dist = ccb[:, :, None] - 2.0 * jnp.einsum(
          'glm,gmn->gln', cb, xt, precision=_HIGHEST)
      rows = [dist[:, l] for l in range(block)]
    for l, dist in enumerate(rows):
      closer = dist < best
      best = jnp.where(closer, dist, best)
      arg = jnp.where(closer, b * block + l, arg)
    return best, arg

  init = (jnp.full((g, n), jnp.inf, xt.dtype), jnp.zeros((g, n), jnp.int32))
  if num_blocks == 1:
    _, arg = scan_block(0, init)
  else:
    _, arg = lax.fori_loop(0, num_blocks, scan_block, init)
  return arg


def _cluster_sums(x: jax.Array, assign: jax.Array, num_centroids: int,
                  method: str) -> tuple[jax.Array, jax.Array]:
  """Per-cluster sums ``[G, L, m]`` and int32 counts ``[G, L]``.

  ``method='segment_sum'`` scatters (fastest on XLA:CPU: 0.1-0.2 ms at the
  paper's settings vs 0.6-90 ms for the one-hot matmul at L >= 30);
  ``'onehot'`` contracts a ``[G, L, N]`` one-hot with the points
  (deterministic where scatter-adds are atomic, e.g. GPUs).
  """
  g, n, m = x.shape
  if method == 'segment_sum':
    ids = (assign + num_centroids *
           jnp.arange(g, dtype=jnp.int32)[:, None]).reshape(-1)
    sums = jax.ops.segment_sum(x.reshape(g * n, m), ids, g * num_centroids)
    counts = jax.ops.segment_sum(jnp.ones((g * n,), jnp.int32), ids,
                                 g * num_centroids)
    return (sums.reshape(g, num_centroids, m),
            counts.reshape(g, num_centroids))
  onehot = assign[:, None, :] == lax.broadcasted_iota(
      jnp.int32, (1, num_centroids, 1), 1)
  sums = jnp.einsum('gln,gnm->glm', onehot.astype(x.dtype), x,
                    precision=_HIGHEST)
  counts = jnp.sum(onehot, axis=-1, dtype=jnp.int32)
  return sums, counts


def _relocate_empty(x: jax.Array, c: jax.Array, assign: jax.Array,
                    counts: jax.Array, new: jax.Array) -> jax.Array:
  """The ``'farthest'`` empty-cluster rule for one Lloyd step.

  Args:
    x: ``[G, N, m]`` points.
    c: ``[G, L, m]`` centroids the points were assigned to.
    assign: int32 ``[G, N]`` nearest centroid of each point under ``c``.
    counts: int32 ``[G, L]`` points per cluster.
    new: ``[G, L, m]`` updated centroids (means; ``c`` where empty).

  Returns:
    ``new`` with, in every group that has an empty cluster and a point not
    equal to its centroid, the lowest-indexed empty cluster moved onto the
    point farthest from its centroid (lowest point index on ties).
  """
  g, n, _ = x.shape
  num_centroids = c.shape[1]
  dist = jnp.sum(
      jnp.square(x - jnp.take_along_axis(c, assign[:, :, None], axis=1)),
      axis=-1)
  far_val = jnp.max(dist, axis=1, keepdims=True)
  far = jnp.min(jnp.where(dist == far_val,
                          lax.broadcasted_iota(jnp.int32, (g, n), 1), n),
                axis=1)
  far = jnp.minimum(far, n - 1)  # Only reached with NaN distances.
  point = jnp.take_along_axis(x, far[:, None, None], axis=1)  # [G, 1, m]
  centroid_ids = lax.broadcasted_iota(jnp.int32, (g, num_centroids), 1)
  first_empty = jnp.min(
      jnp.where(counts == 0, centroid_ids, num_centroids), axis=1)
  move = (centroid_ids == first_empty[:, None]) & (far_val > 0)
  return jnp.where(move[..., None], point, new)


def _lloyd(x: jax.Array, c0: jax.Array, num_iters: int,
           empty_cluster: str,
           method: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``num_iters`` Lloyd steps and a final assignment, batched over groups.

  Args:
    x: ``[G, N, m]`` points.
    c0: ``[G, L, m]`` initial centroids.
    num_iters: Lloyd steps.
    empty_cluster: ``'farthest'`` or ``'keep'``.
    method: ``'segment_sum'`` or ``'onehot'`` (see :func:`_cluster_sums`).

  Returns:
    ``(codebook [G, L, m], assignment int32 [G, N], reconstruction [G, N, m])``.
  """
  num_centroids = c0.shape[1]
  xt = jnp.swapaxes(x, 1, 2)

  def trip(i, carry):
    c, _ = carry
    assign = _nearest(c, xt)
    sums, counts = _cluster_sums(x, assign, num_centroids, method)
    new = jnp.where((counts > 0)[..., None],
                    sums / jnp.maximum(counts, 1)[..., None].astype(x.dtype),
                    c)
    if empty_cluster == 'farthest':
      new = lax.cond(jnp.any(counts == 0),
                     functools.partial(_relocate_empty, x, c, assign, counts),
                     lambda new: new, new)
    return jnp.where(i < num_iters, new, c), assign

  # Trip i assigns the points to the centroids of trip i and updates them
  # (except on the last trip), so the loop yields the final codebook and the
  # assignment to it. The assignment must come out of a loop: computed after
  # it, XLA:CPU fuses its unrolled select chain into the gather c[assign] and
  # into every consumer of that, and LLVM ran for minutes at L = 32 (a one-hot
  # matmul instead cost 1.7 ms per client at the SO NWP setting; tracking the
  # nearest centroid's value in the running minimum 2 ms). At least 2 trips,
  # since XLA inlines single-trip loops.
  c, assign = lax.fori_loop(
      0, max(num_iters, 1) + 1, trip,
      (c0, jnp.zeros(x.shape[:2], jnp.int32)))
  return c, assign, jnp.take_along_axis(c, assign[:, :, None], axis=1)


_LloydFn = Callable[[jax.Array, jax.Array],
                    tuple[jax.Array, jax.Array, jax.Array]]


@functools.lru_cache(maxsize=None)
def _batched_lloyd(num_iters: int, empty_cluster: str,
                   method: str) -> _LloydFn:
  """:func:`_lloyd` whose ``vmap`` folds the mapped axis into the group axis.

  Groups are independent k-means problems, so ``C`` clients of ``R`` groups
  are one problem with ``C R`` groups. ``jax.vmap`` of the plain code instead
  batched every scatter, loop and unrolled slice: 2.6x slower per client than
  a Python loop over clients at the FEMNIST setting on XLA:CPU; folded, it is
  on par with the loop (and one program on accelerators).
  """

  @jax.custom_batching.custom_vmap
  def run(x, c0):
    return _lloyd(x, c0, num_iters, empty_cluster, method)

  @run.def_vmap
  def _rule(axis_size, in_batched, x, c0):
    x_batched, c0_batched = in_batched
    if not x_batched:
      x = jnp.broadcast_to(x, (axis_size,) + x.shape)
    if not c0_batched:
      c0 = jnp.broadcast_to(c0, (axis_size,) + c0.shape)
    lead = x.shape[:2]
    outs = run(x.reshape((-1,) + x.shape[2:]),
               c0.reshape((-1,) + c0.shape[2:]))
    return (tuple(o.reshape(lead + o.shape[1:]) for o in outs),
            (True, True, True))

  return run


def group_subvectors(z: jax.Array, q: int, R: int) -> jax.Array:
  """``[B, d] -> [R, B q / R, d / q]``: the groups of Section 4.1.

  Point ``n`` of group ``r`` is subvector ``s = r q/R + n % (q/R)`` of vector
  ``j = n // (q/R)``.
  """
  num_vectors, d = z.shape
  g = q // R
  return z.reshape(num_vectors, R, g, d // q).transpose(1, 0, 2, 3).reshape(
      R, num_vectors * g, d // q)


def ungroup_subvectors(x: jax.Array, num_vectors: int) -> jax.Array:
  """Inverse of :func:`group_subvectors`: ``[R, B q/R, m] -> [B, q m]``."""
  r, n, m = x.shape
  g = n // num_vectors
  return x.reshape(r, num_vectors, g, m).transpose(1, 0, 2, 3).reshape(
      num_vectors, r * g * m)


def grouped_pq(z: jax.Array,
               key: jax.Array,
               q: int,
               R: int,
               L: int,
               num_iters: int = DEFAULT_NUM_ITERS,
               *,
               phi: float = DEFAULT_PHI,
               empty_cluster: EmptyClusterRule = 'farthest',
               update_method: UpdateMethod = 'auto') -> PQResult:
  """FedLite's grouped product quantizer (Section 4.1, equations 3-4).

  Args:
    z: ``[B, d]`` floating activations of one client's batch. k-means runs in
      float32 (float64 if ``z`` is float64).
    key: PRNG key for the k-means initialization (:func:`kmeans_init_indices`,
      one ``[R, L]`` draw); the result is a deterministic function of
      ``(z, key)`` and the options on a given backend.
    q: subvectors per vector, dividing ``d``. ``q = 1``: plain k-means.
    R: groups, dividing ``q``. ``R = q``: vanilla product quantization;
      ``R = 1`` (one shared codebook) is the paper's default.
    L: centroids per group, ``1 <= L <= B q / R``.
    num_iters: Lloyd iterations (``>= 0``), followed by a final assignment.
    phi: bits per float for the message size (paper: 64).
    empty_cluster: ``'farthest'`` or ``'keep'`` (module docstring).
    update_method: how cluster sums are formed: ``'segment_sum'`` (a scatter;
      fastest on CPU), ``'onehot'`` (a one-hot matmul; deterministic on GPU,
      where scatter-adds are atomic), or ``'auto'`` (``'segment_sum'`` when
      the default backend is CPU, else ``'onehot'``).

  Returns:
    A :class:`PQResult`. Under differentiation the quantizer is a constant:
    ``codebook`` and ``reconstruction`` have zero derivative and the errors
    differentiate as functions of ``z`` with ``Z~`` fixed. (FedLite's
    gradient through the quantizer is :mod:`fedlite_jax.fedlite.vq_layer`.)

  Raises:
    ValueError: if ``z`` is not a 2-D floating array, for an invalid
      ``q, R, L`` (:func:`validate_pq_config`), ``num_iters < 0``, a
      non-positive ``phi``, or an unknown ``empty_cluster``/``update_method``.
  """
  if z.ndim != 2:
    raise ValueError(f'z must be a [B, d] batch of activations, got shape '
                     f'{z.shape}.')
  if not jnp.issubdtype(z.dtype, jnp.floating):
    raise ValueError(f'z must have a floating dtype, got {z.dtype}.')
  validate_pq_config(z.shape[1], z.shape[0], q, R, L)
  num_iters = _check_int('num_iters', num_iters, 0)
  phi = _check_phi(phi)
  if empty_cluster not in ('farthest', 'keep'):
    raise ValueError(f"empty_cluster must be 'farthest' or 'keep', got "
                     f'{empty_cluster!r}.')
  if update_method == 'auto':
    update_method = ('segment_sum' if jax.default_backend() == 'cpu'
                     else 'onehot')
  if update_method not in ('segment_sum', 'onehot'):
    raise ValueError(f"update_method must be 'auto', 'segment_sum' or "
                     f"'onehot', got {update_method!r}.")
  return _grouped_pq(z, key, int(q), int(R), int(L), num_iters, phi,
                     empty_cluster, update_method)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _grouped_pq(z: jax.Array, key: jax.Array, q: int, R: int, L: int,
                num_iters: int, phi: float, empty_cluster: str,
                update_method: str) -> PQResult:
  """:func:`grouped_pq` after validation and normalization of its options."""
  num_vectors, d = z.shape
  compute_dtype = jnp.promote_types(z.dtype, jnp.float32)
  zc = z.astype(compute_dtype)
  # k-means is a constant for autodiff (custom_vmap has no JVP rule); only
  # the error terms below see z.
  x = group_subvectors(lax.stop_gradient(zc), q, R)  # [R, N, m]
  init = kmeans_init_indices(key, R, x.shape[1], L)
  c0 = jnp.take_along_axis(x, init[:, :, None], axis=1)
  codebook, assign, recon = _batched_lloyd(num_iters, empty_cluster,
                                           update_method)(x, c0)
  recon = ungroup_subvectors(recon, num_vectors)
  codewords = ungroup_subvectors(assign[:, :, None], num_vectors)
  sq_err = jnp.sum(jnp.square(zc - recon), dtype=jnp.float32)
  sq_norm = jnp.sum(jnp.square(zc), dtype=jnp.float32)
  message = pq_message_bits(d, num_vectors, q, R, L, phi)
  uncompressed = uncompressed_bits(d, num_vectors, phi)
  return PQResult(
      codebook=codebook,
      codewords=codewords,
      reconstruction=recon.astype(z.dtype),
      quantization_error=sq_err / num_vectors,
      relative_error=jnp.where(sq_norm > 0,
                               sq_err / jnp.where(sq_norm > 0, sq_norm, 1), 0.),
      message_bits=message,
      uncompressed_bits=uncompressed,
      compression_ratio=uncompressed / message)
