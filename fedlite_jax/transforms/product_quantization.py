"""FedLite's grouped product quantizer as a communication transform.

Source: Wang et al., "FedLite: A Scalable Approach for Federated Learning on
Resource-constrained Clients" (2022), Sec. 4.1, Eq. 3-4. Split learning's
upload (:mod:`fedlite_jax.algorithms.splitfed`); a terminal stage. The Eq. 5
gradient correction is :func:`fedlite_jax.models.vq_layer.vq_with_correction`.
"""

from __future__ import annotations

from typing import Any

import jax

from fedlite_jax.transforms import pq, base

__all__ = ['product_quantization']


def product_quantization(num_subvectors: int, num_groups: int,
                         num_centroids: int,
                         num_iters: int = pq.DEFAULT_NUM_ITERS, *,
                         phi: float = pq.DEFAULT_PHI,
                         empty_cluster: str = 'farthest',
                         fold_leaf_index: bool = True) -> base.CommTransform:
  """Grouped product quantization of ``[B, d]`` activation batches (leaves).

  Stateless; ``decode`` returns the quantized batches ``Z~``.

  Args:
    num_subvectors: q, subvectors per vector (must divide d).
    num_groups: R, groups (must divide q; 1 = one shared codebook, the
      paper's default).
    num_centroids: L, centroids per group (``1 <= L <= B q / R``).
    num_iters: Lloyd iterations (>= 0).
    phi: bits per codebook float (the paper counts 64).
    empty_cluster: ``'farthest'`` or ``'keep'``.
    fold_leaf_index: leaf ``i`` seeds k-means with ``fold_in(key, i)``
      (True) or every leaf with ``key`` itself (False).

  Returns:
    A ``CommTransform``; bits per leaf: ``phi d R L / q + B q log2 L``.

  Raises:
    ValueError: (at ``encode``) a leaf that is not a 2-D floating batch, q not
      dividing d, R not dividing q, L outside ``[1, B q / R]``,
      ``num_iters < 0`` or ``phi <= 0``.
  """

  def encode(x: Any, state, key):
    spec = base.TreeSpec.of(x)
    leaves = jax.tree.leaves(x)
    results = [pq.grouped_pq(
        z, jax.random.fold_in(key, i) if fold_leaf_index else key,
        num_subvectors, num_groups, num_centroids, num_iters, phi=phi,
        empty_cluster=empty_cluster) for i, z in enumerate(leaves)]
    values = spec.treedef.unflatten([r.reconstruction for r in results])
    side = {'codebooks': [r.codebook for r in results],
            'codewords': [r.codewords for r in results]}
    bits = float(sum(r.message_bits for r in results))
    return base.Encoded(values, side, bits, 0.0, spec), state

  return base.CommTransform(base.no_state, encode, base.decode_values)
