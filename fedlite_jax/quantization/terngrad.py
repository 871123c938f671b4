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
:func:`fedlite_jax.quantization.uniform.clip_by_std`).

Cost: ``log2(3)`` bits per value (an ideal ternary code, e.g. 5 trits per
byte gives 1.6) plus one float32 (``s``) per non-empty layer. FedJAX's
``terngrad_quantizer`` charges two floats per layer; the values are the same.

Randomness: as in :mod:`fedlite_jax.quantization.uniform` (``generator`` is
``'hash'`` or ``'threefry'``; per-leaf keys ``jax.random.split(key, n)``).
Computation is in float32 (float64 for float64 layers) and cast back.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from fedlite_jax.quantization import rng as rng_lib
from fedlite_jax.quantization import uniform as uniform_lib

PyTree = Any
Quantized = uniform_lib.Quantized

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
    size = math.prod(uniform_lib.leaf_shape(leaf))
    if size:
      total += BITS_PER_VALUE * size + uniform_lib.FLOAT_BITS
  return total


def _ternarize(v: jax.Array, key: jax.Array, clip_std: Optional[float],
               generator: str) -> jax.Array:
  """TernGrad on one layer; arguments already validated (traceable)."""
  if v.size == 0:
    return v
  dtype = jnp.float64 if v.dtype == jnp.float64 else jnp.float32
  vc, lo, hi = uniform_lib.min_max(v.astype(dtype), clip_std)
  s = jnp.maximum(hi, -lo)  # max |clip(v)|, reduced from v itself.
  prob = jnp.abs(vc) / jnp.where(s > 0, s, 1).astype(dtype)  # 1 at |v| == s.
  u = rng_lib.random_uniform(key, v.shape, dtype, generator)
  out = jnp.where(u < prob, jnp.sign(vc) * s, jnp.zeros((), dtype))
  return out.astype(v.dtype)


@functools.partial(jax.jit, static_argnames=('clip_std', 'generator'))
def _ternarize_jit(v, key, *, clip_std, generator):
  return _ternarize(v, key, clip_std, generator)


@functools.partial(jax.jit, static_argnames=('clip_std', 'generator'))
def _ternarize_tree_jit(tree, key, *, clip_std, generator):
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(
      treedef, [_ternarize(leaf, keys[i], clip_std, generator)
                for i, leaf in enumerate(leaves)])


def _validate(clip_std: Optional[float], generator: str) -> None:
  rng_lib.validate_generator(generator)
  if clip_std is not None and not clip_std > 0:
    raise ValueError(f'clip_std must be None or > 0, got {clip_std!r}.')


def terngrad_quantize(v: jax.Array,
                      key: jax.Array,
                      *,
                      clip_std: Optional[float] = DEFAULT_CLIP_STD,
                      generator: str = 'hash') -> Quantized:
  """TernGrad on one layer (Wen et al. 2017, Sec. 3).

  Jittable (``clip_std`` and ``generator`` static) and vmappable.

  Args:
    v: floating array of any shape (one layer).
    key: JAX PRNG key (raw or typed).
    clip_std: clip to ``+-clip_std * std(v)`` before ternarizing (default
      2.5, TernGrad's ``c``); ``None`` disables clipping. With clipping,
      ``s = max|clip(v)|`` and the result is unbiased for ``clip(v)``, not
      for ``v``.
    generator: ``'hash'`` (default) or ``'threefry'``
      (``jax.random.uniform(key, v.shape)``).

  Returns:
    ``Quantized(values, num_bits)``: ``values`` (``v``'s shape and dtype) in
    ``{0, -s, +s}``; ``num_bits = log2(3) * v.size + 32`` (0 if empty).

  Raises:
    TypeError: non-floating ``v``.
    ValueError: unknown ``generator`` or ``clip_std`` not > 0.
  """
  _validate(clip_std, generator)
  v = jnp.asarray(v)
  uniform_lib.check_floating(v, 'v')
  values = _ternarize_jit(v, key, clip_std=clip_std, generator=generator)
  return Quantized(values, terngrad_num_bits(v))


def terngrad_quantize_tree(tree: PyTree,
                           key: jax.Array,
                           *,
                           clip_std: Optional[float] = DEFAULT_CLIP_STD,
                           generator: str = 'hash') -> Quantized:
  """:func:`terngrad_quantize` per leaf (one leaf = one layer, own ``s``).

  Leaf ``i`` uses ``jax.random.split(key, num_leaves)[i]`` (as FedJAX's
  ``terngrad_quantize_pytree``).

  Args:
    tree: pytree of floating arrays.
    key: JAX PRNG key.
    clip_std: as in :func:`terngrad_quantize` (per leaf).
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    ``Quantized(values, num_bits)`` with ``num_bits = terngrad_num_bits(tree)``.

  Raises:
    TypeError: a non-floating leaf.
    ValueError: unknown ``generator`` or ``clip_std`` not > 0.
  """
  _validate(clip_std, generator)
  tree = jax.tree.map(jnp.asarray, tree)
  for leaf in jax.tree.leaves(tree):
    uniform_lib.check_floating(leaf, 'every leaf')
  values = _ternarize_tree_jit(tree, key, clip_std=clip_std,
                               generator=generator)
  return Quantized(values, terngrad_num_bits(tree))
