"""TernGrad: stochastic ternarization of a layer, with its bit cost.

Source: Wen et al., "TernGrad", NeurIPS 2017, Sec. 3: ``s * sign(v) o b``,
``s = ||v||_inf``, ``b_i ~ Bernoulli(|v_i| / s)`` (unbiased), per layer, after
optional clipping at ``c sigma`` (c = 2.5); upload in Ro et al. (2022), App. C.
Bits: ``log2(3) * size + 32`` per non-empty layer (one float32 ``s``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from fedlite_jax.transforms import base, uniform
from fedlite_jax.common import PyTree


DEFAULT_CLIP_STD = 2.5
"""TernGrad's clipping constant ``c`` (Wen et al. 2017)."""

BITS_PER_VALUE = math.log2(3)
"""Bits per ternary value (an ideal ternary code)."""


def terngrad_num_bits(tree: PyTree) -> float:
  """Bits of :func:`terngrad_quantize_tree` (shapes read only).

  ``sum over non-empty leaves of (log2(3) * leaf.size + 32)``.
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


def terngrad_quantize(v: jax.Array, key: jax.Array, *,
                      clip_std: Optional[float] = DEFAULT_CLIP_STD,
                      generator: str = 'hash') -> base.Encoded:
  """TernGrad on one layer (Wen et al. 2017, Sec. 3); jittable, vmappable.

  Args:
    v: floating array of any shape (one layer).
    key: JAX PRNG key (raw or typed), used as is.
    clip_std: clip to ``+-clip_std * std(v)`` first (then unbiased for
      ``clip(v)`` only), or None.
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    ``Encoded``: ``values`` (``v``'s shape and dtype) in ``{0, -s, +s}``;
    ``bits = log2(3) * v.size + 32`` (0 if empty).

  Raises:
    TypeError: non-floating ``v``.
    ValueError: unknown ``generator`` or ``clip_std`` not > 0.
  """
  return _terngrad(v, key, clip_std, generator, False)


def terngrad_quantize_tree(tree: PyTree, key: jax.Array, *,
                           clip_std: Optional[float] = DEFAULT_CLIP_STD,
                           generator: str = 'hash') -> base.Encoded:
  """:func:`terngrad_quantize` per leaf, key ``split(key, num_leaves)[i]``.

  Returns:
    ``Encoded`` with ``bits = terngrad_num_bits(tree)``.

  Raises:
    TypeError: a non-floating leaf.
    ValueError: unknown ``generator`` or ``clip_std`` not > 0.
  """
  return _terngrad(tree, key, clip_std, generator, True)


def terngrad(*, clip_std: Optional[float] = DEFAULT_CLIP_STD,
             generator: str = 'hash') -> base.CommTransform:
  """:func:`terngrad_quantize_tree` as a stateless transform.

  Raises:
    ValueError: ``clip_std <= 0`` or an unknown ``generator``.
  """
  uniform.validate_options(clip_std, generator)

  def encode(x, state, key):
    return terngrad_quantize_tree(x, key, clip_std=clip_std,
                                  generator=generator), state

  return base.CommTransform(base.no_state, encode, base.decode_values)
