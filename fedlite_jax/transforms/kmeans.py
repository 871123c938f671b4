"""Batched Lloyd k-means of FedLite's grouped product quantizer (Section 4.1).

Pure JAX over independent groups ``[G, N, m]`` (clients x groups under
``jax.vmap``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp

# Centroids per block of the assignment's unrolled running minimum.
_ASSIGN_BLOCK = 32
# Subvectors up to this dimension get exact, unrolled distance computations.
_DIRECT_MAX_DIM = 8
_HIGHEST = lax.Precision.HIGHEST


def nearest(c: jax.Array, xt: jax.Array) -> jax.Array:
  """int32 ``[G, N]``: each point's nearest centroid (lowest index on ties).

  ``c``: ``[G, L, m]`` centroids; ``xt``: ``[G, m, N]`` points, transposed.
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

  ``method``: ``'segment_sum'`` (a scatter) or ``'onehot'`` (a ``[G, L, N]``
  one-hot contraction, deterministic on GPU).
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

  Returns ``new`` (``[G, L, m]``) with, per group, the lowest-indexed empty
  cluster moved onto the point of ``x`` (``[G, N, m]``) farthest from its
  centroid in ``c`` (lowest index on ties), unless every point equals its
  centroid; ``assign`` and ``counts`` are the step's.
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


def lloyd(x: jax.Array, c0: jax.Array, num_iters: int, empty_cluster: str,
          method: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``num_iters`` Lloyd steps and a final assignment, batched over groups.

  Returns ``(codebook [G, L, m], assignment int32 [G, N], reconstruction
  [G, N, m])`` for points ``x`` ``[G, N, m]`` and initial centroids ``c0``.
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
  # (except on the last trip): the final assignment comes out of the loop,
  # which has at least 2 trips (docs/notes/transforms.md).
  c, assign = lax.fori_loop(
      0, max(num_iters, 1) + 1, trip,
      (c0, jnp.zeros(x.shape[:2], jnp.int32)))
  return c, assign, jnp.take_along_axis(c, assign[:, :, None], axis=1)


LloydFn = Callable[[jax.Array, jax.Array],
                    tuple[jax.Array, jax.Array, jax.Array]]


@functools.lru_cache(maxsize=None)
def batched_lloyd(num_iters: int, empty_cluster: str, method: str) -> LloydFn:
  """:func:`lloyd` whose ``vmap`` folds the mapped axis into the group axis.

  ``C`` clients of ``R`` independent groups run as one problem of ``C R``
  groups.
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
