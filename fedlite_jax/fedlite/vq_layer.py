"""Quantization layer with FedLite's gradient correction (Section 4.2).

The server only sees the quantized activations ``z~`` and returns
``dh/dz~``; the client needs ``dh/dz``. FedLite approximates it to first order,
``dh/dz ~ dh/dz~ + H (z - z~)``, replaces the Hessian ``H`` by ``lambda I``
and updates the client model with (equation 5)

    g~ = [dh(w_s; z~)/dz~ + lambda (z - z~)] du(w_c; xi)/dw_c.

:func:`vq_with_correction` is that rule as a ``jax.custom_vjp``: its forward
pass returns ``z~`` (so the server-side model and the loss see the quantized
activations) and its backward pass returns ``cotangent + coef (z - z~)`` for
``z`` and nothing for ``z~`` (no gradient reaches the codebook, which is
rebuilt from scratch on every batch). ``lambda = 0`` is the straight-through
estimator ``z + stop_gradient(z~ - z)``.

**Scaling of lambda.** Equation 5 is per example, and the paper's analysis
(Appendix B, equation 36) averages the corrected per-example gradients over
the batch, ``(1/|B|) sum_xi [dh/dz~ + lambda (z - z~)] du/dw_c``. With a loss
that is a batch *mean* the incoming cotangent is already ``(1/B) dh/dz~``, so
the correction must be ``(lambda / B)(z - z~)`` to reproduce it:
``loss_reduction='mean'`` (default) uses ``coef = lambda / num_vectors``, where
``num_vectors`` defaults to the number of activation vectors in ``z`` (pass the
loss's actual denominator, e.g. the count of non-padding tokens, when it
differs). ``loss_reduction='sum'`` uses ``coef = lambda`` for summed losses.
Either way the client gradient equals the gradient of the paper's surrogate
loss (Section 4.2, equation 6; Appendix A, equations 8-10) with the loss's own
reduction, ``sum_i w ||z_i - z^_i||^2 + w lambda/2 ||z_i - z~_i||^2`` with
``z^_i = z_i - dh/dz~_i / 2`` and ``z^, z~`` held fixed (``w = 1/B`` for a
mean).
"""

from __future__ import annotations

import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.fedlite import pq

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

  Returns:
    ``coef``; a Python float when the inputs are.

  Raises:
    ValueError: for an unknown ``loss_reduction``, a concrete negative ``lam``
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


def vq_with_correction(z: jax.Array,
                       z_tilde: jax.Array,
                       lam: float | jax.Array,
                       *,
                       loss_reduction: LossReduction = 'mean',
                       num_vectors: int | float | jax.Array | None = None,
                       vector_weights: jax.Array | None = None
                      ) -> jax.Array:
  """Returns ``z~`` with FedLite's corrected gradient for ``z`` (equation 5).

  Forward: ``z_tilde``. Backward: the cotangent ``g`` of the output becomes
  ``g + coef w (z - z_tilde)`` for ``z`` and zero for ``z_tilde``, ``lam``
  and ``w``, with ``coef`` from :func:`correction_coefficient` (module
  docstring) and ``w`` the per-vector ``vector_weights`` (default 1). This is
  the one implementation of equation 5 in the library; split learning
  (:mod:`fedlite_jax.algorithms.splitfed`) and :class:`FedLiteQuantizer` use
  it.

  Args:
    z: ``[..., d]`` activations of the client-side model (differentiable).
    z_tilde: their quantization, same shape and dtype as ``z`` (e.g.
      ``grouped_pq(stop_gradient(z), ...).reconstruction``); treated as a
      constant.
    lam: ``lambda >= 0``; 0 gives the straight-through estimator. May be a
      traced scalar.
    loss_reduction: ``'mean'`` if the loss averages over activation vectors
      (then ``coef = lam / num_vectors``), ``'sum'`` if it sums them
      (``coef = lam``).
    num_vectors: the mean's denominator; defaults to the number of vectors in
      ``z``, ``prod(z.shape[:-1])``.
    vector_weights: optional float weights of the vectors in the loss,
      broadcastable to ``z.shape[:-1]``: a weighted loss ``sum_i p_i l_i``
      over several clients' stacked activations (``w = p_i`` for client
      ``i``), and 0 for vectors that carry no loss (e.g. PAD positions).
      May be traced.

  Returns:
    An array equal to ``z_tilde``.

  Raises:
    ValueError: if shapes or dtypes differ, ``z`` is a scalar,
      ``vector_weights`` does not broadcast to ``z.shape[:-1]``, or for
      invalid ``lam``/``loss_reduction``/``num_vectors``.
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
    z: jax.Array,
    key: jax.Array,
    q: int,
    R: int,
    L: int,
    lam: float | jax.Array,
    num_iters: int = pq.DEFAULT_NUM_ITERS,
    *,
    phi: float = pq.DEFAULT_PHI,
    empty_cluster: pq.EmptyClusterRule = 'farthest',
    update_method: pq.UpdateMethod = 'auto',
    loss_reduction: LossReduction = 'mean',
    num_vectors: int | float | jax.Array | None = None,
) -> tuple[jax.Array, pq.PQResult]:
  """Grouped PQ of ``z`` (Section 4.1) + the corrected layer (Section 4.2).

  The ``prod(z.shape[:-1])`` vectors of ``z`` form one batch (e.g. the
  ``128 x 30`` token activations of an SO NWP client batch) that is quantized
  with :func:`fedlite_jax.fedlite.pq.grouped_pq` on ``stop_gradient(z)``;
  the result goes through :func:`vq_with_correction`. Jittable (static
  ``q, R, L, num_iters`` and keyword options), vmappable over clients.

  Args:
    z: ``[..., d]`` floating activations with at least one leading axis.
    key: PRNG key for the k-means initialization.
    q: subvectors per vector.
    R: groups.
    L: centroids per group.
    lam: gradient-correction ``lambda`` (>= 0).
    num_iters: Lloyd iterations.
    phi: bits per float in the message size.
    empty_cluster: see :func:`fedlite_jax.fedlite.pq.grouped_pq`.
    update_method: see :func:`fedlite_jax.fedlite.pq.grouped_pq`.
    loss_reduction: see :func:`vq_with_correction`.
    num_vectors: see :func:`vq_with_correction`.

  Returns:
    ``(z_tilde, result)``: ``z_tilde`` has ``z``'s shape and dtype; ``result``
    is the :class:`~fedlite_jax.fedlite.pq.PQResult` of the flattened
    ``[prod(z.shape[:-1]), d]`` batch (message size, error, codebook, ...).

  Raises:
    ValueError: as :func:`~fedlite_jax.fedlite.pq.grouped_pq` and
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
  """A PRNG key determined by the values of ``z`` (no rng stream needed).

  ``fold_in(PRNGKey(seed), bits)`` with ``bits`` the uint32 bit pattern of the
  float32 sum of ``stop_gradient(z)``: the same input gives the same key,
  different inputs almost always different keys. Jittable and vmappable.

  Args:
    z: a floating array of any shape.
    seed: the base seed.

  Returns:
    A ``uint32[2]`` PRNG key.
  """
  total = jnp.sum(jax.lax.stop_gradient(z).astype(jnp.float32))
  bits = jax.lax.bitcast_convert_type(total, jnp.uint32)
  return jax.random.fold_in(jax.random.PRNGKey(seed), bits)


class FedLiteQuantizer(nn.Module):
  """Flax layer: grouped PQ + gradient correction (Sections 4.1-4.2).

  Place it at the cut between the client-side and server-side model (e.g. as
  the last layer of the client module of
  :func:`fedlite_jax.models.build_split_model`). Each call quantizes all
  vectors of its input as one batch and returns ``z~`` with the corrected
  gradient. Its k-means key is, in this order: the ``key`` argument; a key
  from the ``rng_collection`` stream when ``apply`` provides one
  (``rngs={'quantize': key}``; ``build_split_model`` passes one whenever it
  is given a training key); otherwise :func:`input_derived_key` of the input
  (deterministic, different for different inputs), so the layer needs no rng
  (e.g. in ``apply_for_eval``). It has no parameters. It sows
  ``quantization_error``, ``relative_error`` and ``compression_ratio``
  (float32 scalars) into the ``'intermediates'`` collection.

  Attributes:
    q: subvectors per vector.
    R: groups.
    L: centroids per group.
    lam: gradient-correction ``lambda`` (per example; see the module
      docstring for the ``1/B`` of a batch-mean loss).
    num_iters: Lloyd iterations.
    phi: bits per float in the message size.
    empty_cluster: ``'farthest'`` or ``'keep'``.
    loss_reduction: ``'mean'`` or ``'sum'``.
    rng_collection: name of the PRNG stream for the k-means initialization.
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
  def __call__(self,
               z: jax.Array,
               *,
               enabled: bool = True,
               num_vectors: int | float | jax.Array | None = None,
               key: jax.Array | None = None
              ) -> jax.Array:
    """Quantizes ``z`` (``[..., d]``); returns ``z`` unchanged if disabled.

    ``key`` (optional) is the k-means PRNG key; see the class docstring for
    the fallbacks.
    """
    if not enabled:
      return z
    if key is None:
      key = (self.make_rng(self.rng_collection)
             if self.has_rng(self.rng_collection) else input_derived_key(z))
    z_tilde, result = quantize_with_correction(
        z, key, self.q, self.R, self.L,
        self.lam, self.num_iters, phi=self.phi,
        empty_cluster=self.empty_cluster, loss_reduction=self.loss_reduction,
        num_vectors=num_vectors)
    self.sow('intermediates', 'quantization_error', result.quantization_error)
    self.sow('intermediates', 'relative_error', result.relative_error)
    self.sow('intermediates', 'compression_ratio',
             jnp.asarray(result.compression_ratio, jnp.float32))
    return z_tilde
