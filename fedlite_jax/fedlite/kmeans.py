"""Batched Lloyd k-means of FedLite's grouped product quantizer (Section 4.1).

The k-means of :func:`fedlite_jax.fedlite.pq.grouped_pq`, batched over
independent groups ``[G, N, m]`` (``G`` = groups, or clients x groups under
``jax.vmap``), in pure JAX. The paper leaves the details open; here:

* **Lloyd iterations**: exactly ``num_iters`` (assign, update) steps, then one
  final assignment, so the codewords are always the nearest centroids of the
  returned codebook (``num_iters = 0`` returns the initial points as the
  codebook). Ties go to the lowest centroid index. The mean squared error is
  non-increasing in ``num_iters`` (for fixed initial centroids).
* **Empty clusters** are handled deterministically, per group and iteration:
  ``'keep'`` keeps an empty cluster's previous centroid (as
  ``scipy.cluster.vq.kmeans2``); ``'farthest'`` moves the lowest-indexed empty
  cluster onto the point farthest from its centroid (lowest point index on
  ties), like scikit-learn's relocation, unless every point already
  coincides with its centroid; further empty clusters wait for later
  iterations. With ``'farthest'`` and ``L >=`` the number of distinct points
  in every group, enough iterations give an exact reconstruction.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp

# Centroids are scanned in blocks of this many when assigning points: inside a
# block an unrolled running minimum (jnp.argmin over a long axis hits a slow
# XLA:CPU path), across blocks a fori_loop (fully unrolled code for large L
# compiles and runs far slower). See benchmarks/bench_pq.py.
_ASSIGN_BLOCK = 32
# Subvectors up to this dimension get exact, unrolled distance computations.
_DIRECT_MAX_DIM = 8
_HIGHEST = lax.Precision.HIGHEST


def nearest(c: jax.Array, xt: jax.Array) -> jax.Array:
  """Index of the nearest centroid of every point, batched over groups.

  Squared distances are formed in blocks of ``_ASSIGN_BLOCK`` centroids and
  reduced with an unrolled running minimum (strict ``<``: the lowest index
  wins ties). For subvectors of dimension ``m <= _DIRECT_MAX_DIM`` they are
  exact sums of squared differences, unrolled over the ``m`` coordinates
  (faster than a matmul with a tiny inner dimension on XLA:CPU); for larger
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


def cluster_sums(x: jax.Array, assign: jax.Array, num_centroids: int,
                  method: str) -> tuple[jax.Array, jax.Array]:
  """Per-cluster sums ``[G, L, m]`` and int32 counts ``[G, L]``.

  ``method='segment_sum'`` scatters (fastest on XLA:CPU);
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


def relocate_empty(x: jax.Array, c: jax.Array, assign: jax.Array,
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


def lloyd(x: jax.Array, c0: jax.Array, num_iters: int,
           empty_cluster: str,
           method: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``num_iters`` Lloyd steps and a final assignment, batched over groups.

  Args:
    x: ``[G, N, m]`` points.
    c0: ``[G, L, m]`` initial centroids.
    num_iters: Lloyd steps.
    empty_cluster: ``'farthest'`` or ``'keep'``.
    method: ``'segment_sum'`` or ``'onehot'`` (see :func:`cluster_sums`).

  Returns:
    ``(codebook [G, L, m], assignment int32 [G, N], reconstruction [G, N, m])``.
  """
  num_centroids = c0.shape[1]
  xt = jnp.swapaxes(x, 1, 2)

  def trip(i, carry):
    c, _ = carry
    assign = nearest(c, xt)
    sums, counts = cluster_sums(x, assign, num_centroids, method)
    new = jnp.where((counts > 0)[..., None],
                    sums / jnp.maximum(counts, 1)[..., None].astype(x.dtype),
                    c)
    if empty_cluster == 'farthest':
      new = lax.cond(jnp.any(counts == 0),
                     functools.partial(relocate_empty, x, c, assign, counts),
                     lambda new: new, new)
    return jnp.where(i < num_iters, new, c), assign

  # Trip i assigns the points to the centroids of trip i and updates them
  # (except on the last trip), so the loop yields the final codebook and the
  # assignment to it. The assignment must come out of a loop: computed after
  # it, XLA:CPU fuses its unrolled select chain into the gather c[assign] and
  # into every consumer of that and compilation blows up for large L (a
  # one-hot matmul or tracking the nearest centroid's value instead cost more
  # at run time). At least 2 trips, since XLA inlines single-trip loops.
  c, assign = lax.fori_loop(
      0, max(num_iters, 1) + 1, trip,
      (c0, jnp.zeros(x.shape[:2], jnp.int32)))
  return c, assign, jnp.take_along_axis(c, assign[:, :, None], axis=1)


LloydFn = Callable[[jax.Array, jax.Array],
                    tuple[jax.Array, jax.Array, jax.Array]]


@functools.lru_cache(maxsize=None)
def batched_lloyd(num_iters: int, empty_cluster: str,
                   method: str) -> LloydFn:
  """:func:`lloyd` whose ``vmap`` folds the mapped axis into the group axis.

  Groups are independent k-means problems, so ``C`` clients of ``R`` groups
  are one problem with ``C R`` groups. ``jax.vmap`` of the plain code instead
  batched every scatter, loop and unrolled slice and ran slower than a Python
  loop over clients on XLA:CPU; folded, it is one program of ``C R`` groups.
  """

  @jax.custom_batching.custom_vmap
  def run(x, c0):
    return lloyd(x, c0, num_iters, empty_cluster, method)

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
