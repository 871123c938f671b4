"""Quantization layer with FedLite's gradient correction.

Source: Wang et al., "FedLite", Section 4.2, equation 5: the client updates
with ``g~ = [dh/dz~ + lambda (z - z~)] du/dw_c``. ``lambda`` is per example;
for a batch-mean loss the correction is ``(lambda / B)(z - z~)`` (Appendix B,
equation 36). ``lambda = 0`` is the straight-through estimator.
"""

from __future__ import annotations

import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.transforms import pq

LossReduction = Literal['mean', 'sum']
# The default rng stream of FedLiteQuantizer's k-means initialization.
RNG_COLLECTION = 'quantize'


@jax.custom_vjp
def _corrected_identity(z: jax.Array, z_tilde: jax.Array,
                        coef: jax.Array) -> jax.Array:
  del z, coef
  return z_tilde


def _corrected_identity_fwd(z, z_tilde, coef):
  return z_tilde, (z - z_tilde, coef)


def _corrected_identity_bwd(res, g):
  residual, coef = res
  return (g + coef.astype(g.dtype) * residual.astype(g.dtype),
          jnp.zeros_like(residual), jnp.zeros_like(coef))


_corrected_identity.defvjp(_corrected_identity_fwd, _corrected_identity_bwd)


def correction_coefficient(lam: float | jax.Array,
                           num_vectors: int | float | jax.Array,
                           loss_reduction: LossReduction = 'mean'
                          ) -> float | jax.Array:
  """The factor ``coef`` of ``z - z~`` added to the cotangent of ``z``.

  Args:
    lam: FedLite's ``lambda`` (>= 0), per example as in equation 5.
    num_vectors: the denominator of a batch-mean loss.
    loss_reduction: ``'mean'`` (``lam / num_vectors``) or ``'sum'`` (``lam``).

  Raises:
    ValueError: an unknown ``loss_reduction``, a concrete negative ``lam``
      or a concrete non-positive ``num_vectors``.
  """
  if loss_reduction not in ('mean', 'sum'):
    raise ValueError(f"loss_reduction must be 'mean' or 'sum', got "
                     f'{loss_reduction!r}.')
  if isinstance(lam, (int, float, np.number)) and not lam >= 0:
    raise ValueError(f'lam (gradient-correction lambda) must be >= 0, got '
                     f'{lam!r}.')
  if loss_reduction == 'sum':
    return lam
  if isinstance(num_vectors, (int, float, np.number)) and not num_vectors > 0:
    raise ValueError(f'num_vectors (the batch-mean denominator) must be > 0, '
                     f'got {num_vectors!r}.')
  return lam / num_vectors


def vq_with_correction(z: jax.Array, z_tilde: jax.Array, lam: float | jax.Array,
                       *, loss_reduction: LossReduction = 'mean',
                       num_vectors: int | float | jax.Array | None = None,
                       vector_weights: jax.Array | None = None) -> jax.Array:
  """Returns ``z~`` with FedLite's corrected gradient for ``z`` (equation 5).

  Backward: the output's cotangent ``g`` becomes ``g + coef w (z - z_tilde)``
  for ``z`` and zero for the other inputs, with ``coef`` from
  :func:`correction_coefficient` and ``w`` the ``vector_weights``.

  Args:
    z: ``[..., d]`` activations of the client-side model.
    z_tilde: their quantization, ``z``'s shape and dtype; a constant.
    lam: ``lambda >= 0`` (0: straight-through); may be traced.
    loss_reduction: ``'mean'`` (``coef = lam / num_vectors``) for a loss
      averaging over activation vectors, ``'sum'`` (``coef = lam``).
    num_vectors: the mean's denominator (default ``prod(z.shape[:-1])``).
    vector_weights: optional float weights ``w`` of the vectors in the loss,
      broadcastable to ``z.shape[:-1]`` (e.g. client weights ``p_i`` of
      stacked activations, 0 at PAD positions); may be traced.

  Raises:
    ValueError: shapes or dtypes differ, ``z`` is a scalar, bad
      ``vector_weights`` shape, or as :func:`correction_coefficient`.
  """
  if z.shape != z_tilde.shape or z.dtype != z_tilde.dtype:
    raise ValueError(
        f'z and z_tilde must have the same shape and dtype, got '
        f'{z.shape} {z.dtype} and {z_tilde.shape} {z_tilde.dtype}.')
  if z.ndim < 1:
    raise ValueError('z must have a feature axis, got a scalar.')
  if num_vectors is None:
    num_vectors = math.prod(z.shape[:-1])
  coef = jnp.asarray(correction_coefficient(lam, num_vectors, loss_reduction),
                     jnp.float32)
  if vector_weights is not None:
    weights = jnp.asarray(vector_weights, jnp.float32)
    lead = tuple(z.shape[:-1])
    try:
      fits = np.broadcast_shapes(weights.shape, lead) == lead
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(f'vector_weights must broadcast to z.shape[:-1]={lead}, '
                       f'got shape {weights.shape}.')
    coef = coef * weights[..., None]
  return _corrected_identity(z, z_tilde, coef)


def quantize_with_correction(
    z: jax.Array, key: jax.Array, q: int, R: int, L: int,
    lam: float | jax.Array, num_iters: int = pq.DEFAULT_NUM_ITERS, *,
    phi: float = pq.DEFAULT_PHI,
    empty_cluster: pq.EmptyClusterRule = 'farthest',
    update_method: pq.UpdateMethod = 'auto',
    loss_reduction: LossReduction = 'mean',
    num_vectors: int | float | jax.Array | None = None,
) -> tuple[jax.Array, pq.PQResult]:
  """Grouped PQ of ``z`` (Section 4.1) + the corrected layer (Section 4.2).

  All ``prod(z.shape[:-1])`` vectors of ``z`` form one batch. Jittable
  (static ``q, R, L, num_iters`` and keyword options), vmappable.

  Args:
    z: ``[..., d]`` floating activations with at least one leading axis.
    key: PRNG key of the k-means initialization.
    q, R, L, num_iters, phi, empty_cluster, update_method: as
      :func:`fedlite_jax.transforms.pq.grouped_pq`.
    lam, loss_reduction, num_vectors: as :func:`vq_with_correction`.

  Returns:
    ``(z_tilde, result)``: ``z_tilde`` like ``z``; ``result`` the
    :class:`~fedlite_jax.transforms.pq.PQResult` of the flattened
    ``[prod(z.shape[:-1]), d]`` batch.

  Raises:
    ValueError: as :func:`~fedlite_jax.transforms.pq.grouped_pq` and
      :func:`vq_with_correction`, or if ``z`` has fewer than 2 axes.
  """
  if z.ndim < 2:
    raise ValueError(f'z must be [..., B, d] with at least 2 axes, got shape '
                     f'{z.shape}.')
  flat = jax.lax.stop_gradient(z).reshape(-1, z.shape[-1])
  result = pq.grouped_pq(flat, key, q, R, L, num_iters, phi=phi,
                         empty_cluster=empty_cluster,
                         update_method=update_method)
  z_tilde = vq_with_correction(
      z, result.reconstruction.reshape(z.shape), lam,
      loss_reduction=loss_reduction, num_vectors=num_vectors)
  return z_tilde, result


def input_derived_key(z: jax.Array, seed: int = 0) -> jax.Array:
  """A ``uint32[2]`` PRNG key from the values of ``z`` (no rng stream needed).

  ``fold_in(PRNGKey(seed), bits)``, ``bits`` those of ``z``'s float32 sum.
  """
  total = jnp.sum(jax.lax.stop_gradient(z).astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(total, jnp.uint32)
  return jax.random.fold_in(jax.random.PRNGKey(seed), bits)


class FedLiteQuantizer(nn.Module):
  """Flax layer: grouped PQ + gradient correction (Sections 4.1-4.2).

  Placed at the cut between client and server model (e.g. last layer of the
  client module of :func:`fedlite_jax.models.build_split_model`); no
  parameters. The k-means key is the ``key`` argument, else one from the
  ``rng_collection`` stream if ``apply`` gives it, else
  :func:`input_derived_key` of the input. Sows float32 scalars
  ``quantization_error``, ``relative_error`` and ``compression_ratio`` into
  ``'intermediates'``.

  Attributes:
    q, R, L, num_iters, phi, empty_cluster: as
      :func:`fedlite_jax.transforms.pq.grouped_pq`.
    lam: gradient-correction ``lambda``, per example (module docstring).
    loss_reduction: ``'mean'`` or ``'sum'``.
    rng_collection: the PRNG stream of the k-means initialization.
  """

  q: int
  R: int = 1
  L: int = 2
  lam: float = 0.0
  num_iters: int = pq.DEFAULT_NUM_ITERS
  phi: float = pq.DEFAULT_PHI
  empty_cluster: pq.EmptyClusterRule = 'farthest'
  loss_reduction: LossReduction = 'mean'
  rng_collection: str = RNG_COLLECTION

  @nn.compact
  def __call__(self, z: jax.Array, *, enabled: bool = True,
               num_vectors: int | float | jax.Array | None = None,
               key: jax.Array | None = None) -> jax.Array:
    """Quantizes ``z`` (``[..., d]``); returns ``z`` unchanged if disabled."""
    if not enabled:
      return z
    if key is None:
      key = (self.make_rng(self.rng_collection)
             if self.has_rng(self.rng_collection) else input_derived_key(z))
    z_tilde, result = quantize_with_correction(
        z, key, self.q, self.R, self.L, self.lam, self.num_iters, phi=self.phi,
        empty_cluster=self.empty_cluster, loss_reduction=self.loss_reduction,
        num_vectors=num_vectors)
    self.sow('intermediates', 'quantization_error', result.quantization_error)
    self.sow('intermediates', 'relative_error', result.relative_error)
    self.sow('intermediates', 'compression_ratio',
             jnp.asarray(result.compression_ratio, jnp.float32))
    return z_tilde
