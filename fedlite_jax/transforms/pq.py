"""Grouped product quantization of activation batches.

Source: Wang et al., "FedLite: A Scalable Approach for Federated Learning on
Resource-constrained Clients", Section 4.1, Figure 2, equations 3-4.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.checks import check_int
from fedlite_jax.transforms import kmeans

EmptyClusterRule = Literal['farthest', 'keep']
UpdateMethod = Literal['auto', 'segment_sum', 'onehot']

#: Bits per floating-point number in all of the paper's ratios (footnote 3).
DEFAULT_PHI = 64.0
#: Default number of Lloyd iterations (the paper does not say).
DEFAULT_NUM_ITERS = 20


@dataclasses.dataclass(frozen=True)
class PQResult:
  """Output of :func:`grouped_pq` for one batch (one client).

  Under ``jax.vmap`` the arrays get a leading client axis; the three sizes
  are static Python floats (pytree metadata).

  Attributes:
    codebook: float32 ``[R, L, d // q]``; centroid ``l`` of group ``r``
      (subvectors ``s`` with ``s // (q // R) == r``).
    codewords: int32 ``[B, q]`` in ``[0, L)``; centroid of subvector ``s``
      of vector ``j`` (equation 4).
    reconstruction: ``[B, d]``, ``z``'s dtype; ``Z~`` (equation 3), row
      ``j``'s subvector ``s`` is ``codebook[s // (q // R), codewords[j, s]]``.
    quantization_error: float32 scalar ``sum_j ||z_j - z~_j||^2 / B`` (units
      of ``z`` squared).
    relative_error: float32 scalar ``||Z - Z~||_F^2 / ||Z||_F^2`` (0 if Z=0).
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
    q: subvectors per vector; divides ``d``.
    R: groups; divides ``q``.
    L: centroids per group, ``1 <= L <= B q / R`` (subvectors per group).

  Raises:
    ValueError: naming the bad value and what is allowed.
  """
  d = check_int(d, 'd (activation dimension)')
  B = check_int(B, 'B (number of vectors)')
  q = check_int(q, 'q (subvectors per vector)')
  R = check_int(R, 'R (number of groups)')
  L = check_int(L, 'L (centroids per group)')
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
  d = check_int(d, 'd (activation dimension)')
  B = check_int(B, 'B (number of vectors)')
  return _check_phi(phi) * d * B


def pq_message_bits(d: int, B: int, q: int, R: int, L: int,
                    phi: float = DEFAULT_PHI) -> float:
  """Grouped-PQ message size in bits (a float), ``phi d R L / q + B q log2 L``.

  Section 4.1: ``R L`` centroids of ``d / q`` floats of ``phi`` bits, and
  ``B q`` codewords of ``log2 L`` bits (not rounded up, as in the paper).

  Args:
    d, B, q, R, L: as :func:`validate_pq_config`.
    phi: bits per float (the paper uses 64).

  Raises:
    ValueError: an invalid configuration (:func:`validate_pq_config`) or a
      non-positive ``phi``.
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
  """int32 ``[R, L]`` stratified initial-centroid indices, increasing per group.

  Centroid ``l`` of group ``r`` is a uniformly random point of stratum
  ``[floor(l N / L), floor((l + 1) N / L))``, from one float32
  ``jax.random.uniform(key, (R, L))`` draw.

  Args:
    key: a JAX PRNG key (typed or raw uint32).
    num_groups: ``R``.
    num_points: ``N``, points per group (``B q / R`` in grouped PQ).
    num_centroids: ``L``, with ``1 <= L <= N``.

  Raises:
    ValueError: if ``L > N`` or a size is not a positive integer.
  """
  num_groups = check_int(num_groups, 'R (number of groups)')
  num_points = check_int(num_points, 'N (points per group)')
  num_centroids = check_int(num_centroids, 'L (centroids per group)')
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


def group_subvectors(z: jax.Array, q: int, R: int) -> jax.Array:
  """``[B, d] -> [R, B q / R, d / q]``: the groups of Section 4.1.

  Point ``n`` of group ``r`` is subvector ``r q/R + n % (q/R)`` of vector
  ``n // (q/R)``.
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


def grouped_pq(z: jax.Array, key: jax.Array, q: int, R: int, L: int,
               num_iters: int = DEFAULT_NUM_ITERS, *, phi: float = DEFAULT_PHI,
               empty_cluster: EmptyClusterRule = 'farthest',
               update_method: UpdateMethod = 'auto') -> PQResult:
  """FedLite's grouped product quantizer (Section 4.1, equations 3-4).

  Args:
    z: ``[B, d]`` floating activations of one client's batch; k-means runs
      in float32 (float64 for float64 ``z``).
    key: PRNG key of the k-means initialization (:func:`kmeans_init_indices`).
    q: subvectors per vector, dividing ``d``; ``q = 1`` is plain k-means.
    R: groups, dividing ``q``; ``R = q`` is vanilla product quantization,
      ``R = 1`` (one shared codebook) the paper's default.
    L: centroids per group, ``1 <= L <= B q / R``.
    num_iters: Lloyd iterations (``>= 0``), then a final assignment.
    phi: bits per float in the message size (paper: 64).
    empty_cluster: ``'farthest'`` or ``'keep'``
      (:mod:`fedlite_jax.transforms.kmeans`).
    update_method: ``'segment_sum'`` (a scatter), ``'onehot'`` (a matmul;
      deterministic on GPU) or ``'auto'`` (the former on CPU).

  Returns:
    A :class:`PQResult`; under differentiation only its errors depend on
    ``z`` (FedLite's gradient: :mod:`fedlite_jax.models.vq_layer`).

  Raises:
    ValueError: ``z`` not a 2-D floating array, an invalid ``q, R, L``
      (:func:`validate_pq_config`), ``num_iters < 0``, a non-positive
      ``phi``, or an unknown ``empty_cluster``/``update_method``.
  """
  if z.ndim != 2:
    raise ValueError(f'z must be a [B, d] batch of activations, got shape '
                     f'{z.shape}.')
  if not jnp.issubdtype(z.dtype, jnp.floating):
    raise ValueError(f'z must have a floating dtype, got {z.dtype}.')
  validate_pq_config(z.shape[1], z.shape[0], q, R, L)
  num_iters = check_int(num_iters, 'num_iters', minimum=0)
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


def quantization_errors(z: jax.Array,
                        z_tilde: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The float32 errors of :class:`PQResult` for ``[B, d]`` ``z`` and ``Z~``.

  ``(sum_j ||z_j - z~_j||^2 / B, ||Z - Z~||_F^2 / ||Z||_F^2)`` (0 for
  ``Z = 0``), differentiable in ``z``.
  """
  zc = z.astype(jnp.promote_types(z.dtype, jnp.float32))
  sq_err = jnp.sum(jnp.square(zc - z_tilde.astype(zc.dtype)),
                   dtype=jnp.float32)
  sq_norm = jnp.sum(jnp.square(zc), dtype=jnp.float32)
  relative = jnp.where(sq_norm > 0,
                       sq_err / jnp.where(sq_norm > 0, sq_norm, 1), 0.)
  return sq_err / z.shape[0], relative


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7, 8))
def _grouped_pq(z: jax.Array, key: jax.Array, q: int, R: int, L: int,
                num_iters: int, phi: float, empty_cluster: str,
                update_method: str) -> PQResult:
  """:func:`grouped_pq` after validation and normalization of its options."""
  num_vectors, d = z.shape
  compute_dtype = jnp.promote_types(z.dtype, jnp.float32)
  zc = z.astype(compute_dtype)
  # k-means is a constant for autodiff; only the errors below see z.
  x = group_subvectors(lax.stop_gradient(zc), q, R)  # [R, N, m]
  init = kmeans_init_indices(key, R, x.shape[1], L)
  c0 = jnp.take_along_axis(x, init[:, :, None], axis=1)
  codebook, assign, recon = kmeans.batched_lloyd(num_iters, empty_cluster,
                                                 update_method)(x, c0)
  recon = ungroup_subvectors(recon, num_vectors)
  codewords = ungroup_subvectors(assign[:, :, None], num_vectors)
  error, relative = quantization_errors(z, recon)
  message = pq_message_bits(d, num_vectors, q, R, L, phi)
  uncompressed = uncompressed_bits(d, num_vectors, phi)
  return PQResult(
      codebook=codebook, codewords=codewords,
      reconstruction=recon.astype(z.dtype), quantization_error=error,
      relative_error=relative, message_bits=message,
      uncompressed_bits=uncompressed, compression_ratio=uncompressed / message)
