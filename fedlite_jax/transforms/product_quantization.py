"""FedLite's grouped product quantizer as a communication transform.

Source: Wang et al., "FedLite: A Scalable Approach for Federated Learning on
Resource-constrained Clients" (2022), Section 4.1, equations 3-4: a batch of
``B`` activation vectors of dimension ``d`` is cut into ``q`` subvectors
each; the subvectors of each of ``R`` groups are clustered by k-means into
``L`` centroids (:func:`fedlite_jax.fedlite.grouped_pq`); the client sends
the codebook and one codeword per subvector, ``phi d R L / q + B q log2 L``
bits (:func:`fedlite_jax.fedlite.pq_message_bits`).

Each leaf of the encoded pytree is one ``[B, d]`` activation batch (leaf
``i`` draws its k-means initialization from ``fold_in(key, i)``, or from
``key`` itself with ``fold_leaf_index=False``); ``decode`` returns the
quantized batch ``Z~``. Stateless. A terminal stage: a transform chained
after it would re-encode ``Z~`` value by value, not the codebook.

This is the algorithms' one entry point to the quantizer (split learning's
upload, :mod:`fedlite_jax.algorithms.splitfed`). The gradient correction of
equation 5 belongs to the layer that uses ``Z~`` in a model
(:func:`fedlite_jax.fedlite.vq_with_correction`); this transform is the
message.
"""

from __future__ import annotations

from typing import Any

import jax

from fedlite_jax.fedlite import pq
from fedlite_jax.transforms import base

__all__ = ['product_quantization']


def product_quantization(num_subvectors: int, num_groups: int,
                         num_centroids: int,
                         num_iters: int = pq.DEFAULT_NUM_ITERS, *,
                         phi: float = pq.DEFAULT_PHI,
                         empty_cluster: str = 'farthest',
                         fold_leaf_index: bool = True) -> base.CommTransform:
  """Grouped product quantization of ``[B, d]`` activation batches.

  Args:
    num_subvectors: q, subvectors per vector (must divide d).
    num_groups: R, groups (must divide q; 1 = one shared codebook, the
      paper's default).
    num_centroids: L, centroids per group (``1 <= L <= B q / R``).
    num_iters: Lloyd iterations (>= 0).
    phi: bits per codebook float (the paper counts 64).
    empty_cluster: ``'farthest'`` or ``'keep'``.
    fold_leaf_index: True: leaf ``i`` draws its k-means initialization from
      ``fold_in(key, i)``; False: every leaf from ``key`` itself (for a
      caller that derives one key per message, e.g. split learning's
      ``fold_in(client key, 2)`` for a one-array message).

  Returns:
    A stateless :class:`CommTransform`; ``value_bits`` = the sum over leaves
    of ``phi d R L / q + B q log2 L``.

  Raises:
    ValueError: (at ``encode`` / ``message_bits``) a leaf that is not a 2-D
      floating batch, q not dividing d, R not dividing q, L outside ``[1, B q
      / R]`` (each naming the value and what is allowed), ``num_iters < 0``
      or ``phi <= 0``.
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
