"""TernGrad: stochastic ternarization of a layer, with its bit cost.

Source: Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to
Reduce Communication in Distributed Deep Learning", NeurIPS 2017, Sec. 3:
``ternarize(v) = s * sign(v) o b`` with ``s = ||v||_inf`` and independent
``b_i ~ Bernoulli(|v_i| / s)`` (unbiased: ``E = v``), applied layer-wise, with
optional gradient clipping ``f(v_i) = clip(v_i, -c sigma, c sigma)``
(``sigma`` = standard deviation of the layer, ``c = 2.5``) before
ternarizing. Used on upload by Ro et al., "Scaling Language Model Size in
Cross-Device Federated Learning" (2022), App. C, "with and without" the
l-infinity clipping, at ``log2(3) ~= 1.585`` bits per parameter.

For one layer ``v`` (after optional clipping): values become ``0`` or
``sign(v_i) * s``; ``P(nonzero) = |v_i| / s``; ``E[Q(v_i)] = v_i``;
``Var[Q(v_i)] = s |v_i| - v_i**2``. With clipping the quantizer is unbiased
for the *clipped* layer and therefore biased with respect to the unclipped
one (by ``clip(v) - v`` on the clipped coordinates). ``|v_i| == s`` maps to
``sign(v_i) * s`` exactly; an all-zero layer stays zero; a constant layer is
returned unchanged (clipping is skipped for it, see
:func:`fedlite_jax.transforms.uniform.clip_by_std`).

Cost: ``log2(3)`` bits per value (an ideal ternary code, e.g. 5 trits per
byte gives 1.6) plus one float32 (``s``) per non-empty layer. FedJAX's
``terngrad_quantizer`` charges two floats per layer; the values are the same.

Randomness: as in :mod:`fedlite_jax.transforms.uniform` (``generator`` is
``'hash'`` or ``'threefry'``; per-leaf keys ``jax.random.split(key, n)``).
Computation is in float32 (float64 for float64 layers) and cast back.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from fedlite_jax.transforms import base
from fedlite_jax.transforms import uniform
from fedlite_jax.common import PyTree


DEFAULT_CLIP_STD = 2.5
"""TernGrad's clipping constant ``c`` (Wen et al. 2017)."""

BITS_PER_VALUE = math.log2(3)


def terngrad_num_bits(tree: PyTree) -> float:
  """Message size of :func:`terngrad_quantize_tree` (or of one array).

  ``sum over non-empty leaves of (log2(3) * leaf.size + 32)``.

  Args:
    tree: an array or pytree of arrays (anything with a ``shape``).

  Returns:
    Size in bits (Python float).
  """
  total = 0.0
  for leaf in jax.tree.leaves(tree):
    size = math.prod(uniform.leaf_shape(leaf))
    if size:
      total += BITS_PER_VALUE * size + uniform.FLOAT_BITS
  return total


def _ternarize(v: jax.Array, key: jax.Array, clip_std: Optional[float],
               generator: str) -> jax.Array:
  """TernGrad on one layer; arguments already validated (traceable)."""
  if v.size == 0:
    return v
  dtype = jnp.float64 if v.dtype == jnp.float64 else jnp.float32
  vc, lo, hi = uniform.min_max(v.astype(dtype), clip_std)
  s = jnp.maximum(hi, -lo)  # max |clip(v)|, reduced from v itself.
  prob = jnp.abs(vc) / jnp.where(s > 0, s, 1).astype(dtype)  # 1 at |v| == s.
  u = uniform.random_uniform(key, v.shape, dtype, generator)
  out = jnp.where(u < prob, jnp.sign(vc) * s, jnp.zeros((), dtype))
  return out.astype(v.dtype)


@functools.partial(jax.jit,
                   static_argnames=('split', 'clip_std', 'generator'))
def _ternarize_jit(tree, key, *, split, clip_std, generator):
  return uniform.per_layer(
      lambda v, k: _ternarize(v, k, clip_std, generator), tree, key, split)


def _terngrad(tree: PyTree, key: jax.Array, clip_std: Optional[float],
              generator: str, split: bool) -> base.Encoded:
  """:func:`terngrad_quantize` (``split=False``) or its tree form."""
  uniform.validate_options(clip_std, generator)
  tree = uniform.as_layers(tree, split)
  values = _ternarize_jit(tree, key, split=split, clip_std=clip_std,
                          generator=generator)
  return base.Encoded(values, (), terngrad_num_bits(tree), 0.0)


def terngrad_quantize(v: jax.Array,
                      key: jax.Array,
                      *,
                      clip_std: Optional[float] = DEFAULT_CLIP_STD,
                      generator: str = 'hash') -> base.Encoded:
  """TernGrad on one layer (Wen et al. 2017, Sec. 3).

  Jittable (``clip_std`` and ``generator`` static) and vmappable.

  Args:
    v: floating array of any shape (one layer).
    key: JAX PRNG key (raw or typed), used as is.
    clip_std: clip to ``+-clip_std * std(v)`` before ternarizing (default
      2.5, TernGrad's ``c``); ``None`` disables clipping. With clipping,
      ``s = max|clip(v)|`` and the result is unbiased for ``clip(v)``, not
      for ``v``.
    generator: ``'hash'`` (default) or ``'threefry'``
      (``jax.random.uniform(key, v.shape)``).

  Returns:
    :class:`~fedlite_jax.transforms.Encoded`: ``values`` (``v``'s shape and
    dtype) in ``{0, -s, +s}``; ``bits = value_bits = log2(3) * v.size + 32``
    (0 if empty).

  Raises:
    TypeError: non-floating ``v``.
    ValueError: unknown ``generator`` or ``clip_std`` not > 0.
  """
  return _terngrad(v, key, clip_std, generator, False)


def terngrad_quantize_tree(tree: PyTree,
                           key: jax.Array,
                           *,
                           clip_std: Optional[float] = DEFAULT_CLIP_STD,
                           generator: str = 'hash') -> base.Encoded:
  """:func:`terngrad_quantize` per leaf (one leaf = one layer, own ``s``).

  Leaf ``i`` uses ``jax.random.split(key, num_leaves)[i]`` (as FedJAX's
  ``terngrad_quantize_pytree``).

  Args:
    tree: pytree of floating arrays.
    key: JAX PRNG key.
    clip_std: as in :func:`terngrad_quantize` (per leaf).
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    :class:`~fedlite_jax.transforms.Encoded` with ``bits =
    terngrad_num_bits(tree)``.

  Raises:
    TypeError: a non-floating leaf.
    ValueError: unknown ``generator`` or ``clip_std`` not > 0.
  """
  return _terngrad(tree, key, clip_std, generator, True)


def terngrad(*, clip_std: Optional[float] = DEFAULT_CLIP_STD,
             generator: str = 'hash') -> base.CommTransform:
  """:func:`terngrad_quantize_tree` as a stateless transform.

  ``log2(3)`` bits per value plus 32 per leaf; ``decode`` returns the values.

  Args:
    clip_std: clipping at ``clip_std * std`` (TernGrad's 2.5), or None.
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    A :class:`~fedlite_jax.transforms.CommTransform`.

  Raises:
    ValueError: ``clip_std <= 0`` or an unknown ``generator``.
  """
  uniform.validate_options(clip_std, generator)

  def encode(x, state, key):
    return terngrad_quantize_tree(x, key, clip_std=clip_std,
                                  generator=generator), state

  return base.CommTransform(base.no_state, encode, base.decode_values)
