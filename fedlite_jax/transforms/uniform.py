"""Stochastic k-level uniform quantization, its bit cost and its random numbers.

Source: Suresh et al., "Distributed Mean Estimation with Limited
Communication", ICML 2017, Sec. 2.2, as used for upload and download by Ro et
al., "Scaling Language Model Size in Cross-Device Federated Learning" (2022),
Sec. 4 and App. C.

For one layer ``x`` with ``k = 2**bits`` levels ``B_r = lo + r (hi - lo) /
(k - 1)``, a value in ``[B_r, B_{r+1})`` becomes ``B_{r+1}`` with probability
``(x_i - B_r) / (B_{r+1} - B_r)``, else ``B_r``: ``E[Q(x_i)] = x_i``,
``Var <= (hi - lo)**2 / (4 (k - 1)**2)``.

* ``zero_center=False`` (the paper's default): ``[min(x), max(x)]``, cost
  ``bits * size + 64`` bits per layer. ``zero_center=True``: ``[-m, m]``,
  ``m = max|x|``, cost ``bits * size + 32`` (our reading of Ro et al.'s
  undefined "zero-centering"; centring on the mean would change nothing).
* ``clip_std=c`` clips the layer to ``[-c std, c std]`` first (TernGrad, Wen
  et al. 2017, Sec. 3); unbiased for the clipped layer only.
* At ``bits >=`` the dtype's significand bits (24 for float32) the grid is
  finer than the dtype: the layer passes through unchanged and ``bits`` per
  value are still charged (:func:`passthrough_bits`).
* Random numbers (:data:`GENERATORS`): ``'threefry'`` is
  ``jax.random.uniform``; ``'hash'`` (default) is a counter-based lowbias32
  hash of the flat index with two seeds drawn from the key, exactly uniform
  per element over keys and fused into the quantizer (at most 2**32
  elements). Pytree leaf ``i`` uses ``jax.random.split(key, n)[i]``.

The full reasoning (range readings, float precision, the hash's properties)
is in docs/DESIGN_NOTES.md, "Uniform quantizer".
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from fedlite_jax.transforms import base
# Re-exported: the random numbers of the quantizers.
from fedlite_jax.transforms.rng import (  # noqa: F401
    GENERATORS, hash_bits, hash_uniform, random_uniform, validate_generator)
from fedlite_jax.common import PyTree, FLOAT_BITS


MIN_BITS = 1
MAX_BITS = 32
"""Bits charged for each float sent alongside the codes (min, max, scale)."""

def validate_bits(bits: int) -> int:
  """Checks ``bits`` and returns it as a Python ``int``.

  Args:
    bits: bits per value; a static Python (or NumPy) integer.

  Returns:
    ``int(bits)``.

  Raises:
    TypeError: if ``bits`` is not an integer (e.g. a float, a bool or a
      traced value).
    ValueError: if ``bits`` is outside ``[MIN_BITS, MAX_BITS] = [1, 32]``.
  """
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
    raise TypeError(
        f'bits must be a static Python integer, got {bits!r} '
        f'({type(bits).__name__}).')
  bits = int(bits)
  if not MIN_BITS <= bits <= MAX_BITS:
    raise ValueError(
        f'bits must be in [{MIN_BITS}, {MAX_BITS}] (k = 2**bits levels), '
        f'got {bits}.')
  return bits


def validate_options(clip_std: Optional[float], generator: str) -> None:
  """Raises ``ValueError`` for an unknown ``generator`` or ``clip_std <= 0``."""
  validate_generator(generator)
  if clip_std is not None and not clip_std > 0:
    raise ValueError(f'clip_std must be None or > 0, got {clip_std!r}.')


def passthrough_bits(dtype: Any) -> int:
  """Smallest ``bits`` at which :func:`uniform_quantize` is the identity.

  Args:
    dtype: a floating dtype.

  Returns:
    The significand precision ``finfo(dtype).nmant + 1`` in bits: 24 for
    float32, 53 for float64, 11 for float16, 8 for bfloat16.
  """
  return int(jnp.finfo(dtype).nmant) + 1


def check_floating(x: Any, what: str) -> None:
  """Raises ``TypeError`` naming ``what`` unless ``x`` has a floating dtype."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f'{what} must have a floating dtype, got {dtype}.')


def as_layers(tree: PyTree, split: bool) -> PyTree:
  """``tree`` as JAX arrays, every leaf checked to be floating.

  ``split=False``: ``tree`` is one array (``jnp.asarray``); else a pytree.

  Raises:
    TypeError: a non-floating array or leaf.
  """
  if not split:
    tree = jnp.asarray(tree)
    check_floating(tree, 'x')
    return tree
  tree = jax.tree.map(jnp.asarray, tree)
  for leaf in jax.tree.leaves(tree):
    check_floating(leaf, 'every leaf')
  return tree


def per_layer(fn: Callable[[jax.Array, jax.Array], jax.Array], tree: PyTree,
              key: jax.Array, split: bool) -> PyTree:
  """``fn(leaf, leaf_key)`` on every leaf (one leaf = one layer).

  Leaf ``i`` gets ``jax.random.split(key, num_leaves)[i]`` (as FedJAX's
  ``*_quantize_pytree``); with ``split=False`` (``tree`` one array) ``key``
  itself.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  keys = jax.random.split(key, len(leaves)) if split else [key]
  return jax.tree.unflatten(treedef,
                            [fn(leaf, keys[i]) for i, leaf in enumerate(leaves)])


def _compute_dtype(dtype: Any) -> Any:
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def clip_bound(x: jax.Array, clip_std: float,
               lo: Optional[jax.Array] = None,
               hi: Optional[jax.Array] = None) -> jax.Array:
  """The clipping threshold ``clip_std * std(x)`` of :func:`clip_by_std`.

  Args:
    x: floating array (one layer), at least one element.
    clip_std: ``c > 0``.
    lo, hi: ``min(x)`` and ``max(x)`` if the caller already has them (saves
      a pass over ``x``); computed here otherwise.

  Returns:
    A scalar of ``x``'s dtype: ``c * std(x)`` (population standard
    deviation), or ``+inf`` for a constant layer (``max == min``), which is
    therefore never clipped.
  """
  bound = clip_std * jnp.std(x)
  if lo is None or hi is None:
    lo, hi = _min_and_max(x)
  return jnp.where(hi == lo, jnp.inf, bound).astype(x.dtype)


def clip_by_std(x: jax.Array, clip_std: float) -> jax.Array:
  """l-infinity clipping of a layer at ``clip_std`` standard deviations.

  Source: Wen et al., "TernGrad", NeurIPS 2017, Sec. 3 ("gradient
  clipping"): ``f(x_i) = x_i`` if ``|x_i| <= c * sigma`` else
  ``sign(x_i) * c * sigma``, with ``sigma`` the (population) standard
  deviation of the layer.

  Args:
    x: floating array of any shape (one layer).
    clip_std: ``c > 0``.

  Returns:
    Array of ``x``'s shape and dtype (computed in float32, or float64 for
    float64). A constant layer (``max == min``, where ``sigma`` is 0 up to
    rounding and clipping would zero it) is returned unchanged.

  Raises:
    ValueError: if ``clip_std <= 0``.
  """
  if not clip_std > 0:
    raise ValueError(f'clip_std must be > 0, got {clip_std!r}.')
  if x.size == 0:
    return x
  xc = x.astype(_compute_dtype(x.dtype))
  bound = clip_bound(xc, clip_std)
  return jnp.clip(xc, -bound, bound).astype(x.dtype)


def _min_and_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(min(x), max(x))`` in one pass over ``x`` (a variadic ``lax.reduce``).

  ``jnp.min`` and ``jnp.max`` compile to two separate reductions on XLA:CPU,
  i.e. two reads of the layer from memory; the variadic form reads it once
  (``benchmarks/bench_quantize.py``). Min and max are exact, so the result
  does not depend on the reduction order. NaN-propagating like ``jnp.min``.
  """
  init = (jnp.array(jnp.inf, x.dtype), jnp.array(-jnp.inf, x.dtype))
  lo, hi = lax.reduce(
      (x, x), init,
      lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])),
      tuple(range(x.ndim)))
  return lo, hi


def min_max(x: jax.Array, clip_std: Optional[float]):
  """Clipped layer and its min and max, without materializing the clip.

  Args:
    x: floating array, at least one element.
    clip_std: ``None`` or ``c > 0`` (:func:`clip_by_std`).

  Returns:
    ``(clipped x, min, max)``. The reductions run on ``x`` itself (clipping
    is monotone, so ``min(clip(x)) = clip(min(x))``), so XLA fuses the clip
    into the consumer's elementwise pass instead of writing a clipped copy.
    Min and max come from ONE variadic reduction (:func:`_min_and_max`):
    one read of ``x`` instead of two.
  """
  lo, hi = _min_and_max(x)
  if clip_std is None:
    return x, lo, hi
  bound = clip_bound(x, clip_std, lo, hi)
  return (jnp.clip(x, -bound, bound), jnp.clip(lo, -bound, bound),
          jnp.clip(hi, -bound, bound))


def leaf_shape(leaf: Any) -> tuple[int, ...]:
  """Shape of an array, ``ShapeDtypeStruct`` or Python scalar (no data read)."""
  shape = getattr(leaf, 'shape', None)
  return tuple(np.shape(leaf) if shape is None else shape)


# ---------------------------------------------------------------- quantizer


def uniform_num_bits(tree: PyTree, bits: int, *,
                     zero_center: bool = False) -> float:
  """Message size of :func:`uniform_quantize_tree` (or of one array).

  ``sum over non-empty leaves of (bits * leaf.size + 32 * F)`` with ``F = 2``
  floats per layer (min, max) or ``F = 1`` with ``zero_center`` (max |x|).
  Matches FedJAX's ``uniform_stochastic_quantizer(num_levels=2**bits)``
  (``log2(num_levels) * size + 64`` per leaf) for ``zero_center=False``.
  Empty leaves cost 0 bits.

  Args:
    tree: an array or a pytree of arrays (anything with a ``shape``, e.g.
      ``jax.ShapeDtypeStruct``); only shapes are read.
    bits: bits per value, 1..32.
    zero_center: as in :func:`uniform_quantize`.

  Returns:
    Size in bits, a Python float holding an exact integer.

  Raises:
    TypeError, ValueError: as :func:`validate_bits`.
  """
  bits = validate_bits(bits)
  floats = FLOAT_BITS * (1 if zero_center else 2)
  sizes = (math.prod(leaf_shape(leaf)) for leaf in jax.tree.leaves(tree))
  return float(sum(bits * size + floats for size in sizes if size))


def _quantize_values(x: jax.Array, key: jax.Array, bits: int,
                     zero_center: bool, clip_std: Optional[float],
                     generator: str) -> jax.Array:
  """The quantizer on one layer; arguments already validated (traceable)."""
  if x.size == 0:
    return x
  dtype = _compute_dtype(x.dtype)
  xc, lo, hi = min_max(x.astype(dtype), clip_std)
  if bits >= passthrough_bits(x.dtype):
    return xc.astype(x.dtype)
  if zero_center:
    # max|x| from the min and max: no |x| array feeds a reduction.
    hi = jnp.maximum(hi, -lo)
    lo = -hi
  span = hi - lo
  levels = float(2**bits - 1)  # Exact in float32 for bits <= 24.
  scale = levels / jnp.where(span > 0, span, 1).astype(dtype)
  # t >= 0 without a clamp: lo <= xc, so the rounded xc - lo is >= 0 (also
  # with zero_center and clipping, where lo <= min(xc)). x == hi maps to
  # k - 1 exactly (also covers span == 0). Rounding can push t slightly
  # above k - 1 for x just below hi; then floor(t) >= k - 1 and the code
  # maps to hi below, exactly what clamping t to k - 1 gave (the code was
  # k - 1 -> hi), so no upper clamp either: fewer operations in the single
  # fused pass, bit-identical results for finite inputs.
  t = jnp.where(xc >= hi, levels, (xc - lo) * scale)
  floor = jnp.floor(t)
  u = random_uniform(key, x.shape, dtype, generator)
  code = floor + (u < t - floor).astype(dtype)
  step = span / levels
  # The end codes map to lo and hi exactly (also if span overflows to inf).
  # ``where(v > hi, hi, v)`` is ``minimum(v, hi)`` for non-NaN v, without
  # the NaN-propagating minimum's extra instructions on x86.
  value = lo + code * step
  value = jnp.where(value > hi, hi, value)
  out = jnp.where(code >= levels, hi, jnp.where(code <= 0, lo, value))
  return out.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=(
    'split', 'bits', 'zero_center', 'clip_std', 'generator'))
def _quantize_jit(tree, key, *, split, bits, zero_center, clip_std,
                  generator):
  return per_layer(
      lambda x, k: _quantize_values(x, k, bits, zero_center, clip_std,
                                    generator), tree, key, split)


def _quantize(tree: PyTree, key: jax.Array, bits: int, zero_center: bool,
              clip_std: Optional[float], generator: str,
              split: bool) -> base.Encoded:
  """:func:`uniform_quantize` (``split=False``) or its tree form."""
  bits = validate_bits(bits)
  validate_options(clip_std, generator)
  tree = as_layers(tree, split)
  if clip_std is None and all(bits >= passthrough_bits(leaf.dtype)
                              for leaf in jax.tree.leaves(tree)):
    values = tree  # Identity (see the module docstring); nothing to compile.
  else:
    values = _quantize_jit(tree, key, split=split, bits=bits,
                           zero_center=zero_center, clip_std=clip_std,
                           generator=generator)
  return base.Encoded(
      values, (), uniform_num_bits(tree, bits, zero_center=zero_center), 0.0)


def uniform_quantize(x: jax.Array,
                     key: jax.Array,
                     bits: int,
                     *,
                     zero_center: bool = False,
                     clip_std: Optional[float] = None,
                     generator: str = 'hash') -> base.Encoded:
  """Stochastic k-level uniform quantization of one layer (``k = 2**bits``).

  Suresh et al. 2017, Sec. 2.2; Ro et al. 2022, App. C. See the module
  docstring for the levels, the variance, ``zero_center``, and the float
  precision rules (identity at ``bits >= passthrough_bits(x.dtype)``, i.e.
  24..32 for float32). Jittable (``bits``, ``zero_center``, ``clip_std`` and
  ``generator`` must be static) and vmappable (e.g. over clients: min and max
  are then per client).

  Args:
    x: floating array of any shape: one layer, quantized with one (min, max).
    key: JAX PRNG key (raw ``uint32[2]`` or typed), used as is.
    bits: bits per value, a static integer in 1..32 (``bits=1``: 2 levels,
      min and max).
    zero_center: grid on ``[-max|x|, max|x|]`` (one float sent) instead of
      ``[min(x), max(x)]`` (two floats).
    clip_std: if set (``c > 0``), clip ``x`` to ``+-c * std(x)`` first
      (:func:`clip_by_std`); the result is unbiased for the clipped layer.
    generator: ``'hash'`` (fast counter-based, default) or ``'threefry'``
      (``jax.random.uniform(key, x.shape)``).

  Returns:
    :class:`~fedlite_jax.transforms.Encoded`: ``values`` has ``x``'s shape
    and dtype; ``bits = value_bits = bits * x.size + 64`` (``+ 32`` with
    ``zero_center``; 0 for an empty array).

  Raises:
    TypeError: non-integer ``bits`` or non-floating ``x``.
    ValueError: ``bits`` outside 1..32, unknown ``generator``, ``clip_std``
      not > 0.
  """
  return _quantize(x, key, bits, zero_center, clip_std, generator, False)


def uniform_quantize_tree(tree: PyTree,
                          key: jax.Array,
                          bits: int,
                          *,
                          zero_center: bool = False,
                          clip_std: Optional[float] = None,
                          generator: str = 'hash') -> base.Encoded:
  """:func:`uniform_quantize` applied per leaf (one leaf = one layer).

  Leaf ``i`` uses ``jax.random.split(key, num_leaves)[i]`` (as FedJAX's
  ``uniform_stochastic_quantize_pytree``), its own min/max and its own floats.

  Args:
    tree: pytree of floating arrays (e.g. model parameters or a model delta).
    key: JAX PRNG key.
    bits: bits per value, 1..32 (static).
    zero_center: as in :func:`uniform_quantize`.
    clip_std: as in :func:`uniform_quantize`, per leaf.
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    :class:`~fedlite_jax.transforms.Encoded`: ``values`` has ``tree``'s
    structure, shapes and dtypes; ``bits = uniform_num_bits(tree, bits,
    zero_center=zero_center)``.

  Raises:
    TypeError: non-integer ``bits`` or a non-floating leaf.
    ValueError: ``bits`` outside 1..32, unknown ``generator``, ``clip_std``
      not > 0.
  """
  return _quantize(tree, key, bits, zero_center, clip_std, generator, True)


def uniform_quantization(bits: int,
                         *,
                         zero_center: bool = False,
                         clip_std: Optional[float] = None,
                         generator: str = 'hash') -> base.CommTransform:
  """:func:`uniform_quantize_tree` as a stateless transform.

  ``encode(x, state, key)`` is ``uniform_quantize_tree(x, key, bits, ...)``
  (``2**bits`` levels per leaf); ``decode`` returns its values.

  Args:
    bits: bits per value, 1..32 (static).
    zero_center: grid ``[-max|x|, max|x|]`` (one float sent per leaf).
    clip_std: optional clipping at ``clip_std * std`` before quantizing.
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    A :class:`~fedlite_jax.transforms.CommTransform`.

  Raises:
    TypeError, ValueError: as :func:`validate_bits` and
      :func:`validate_options` (here), non-floating inputs (at ``encode``).
  """
  bits = validate_bits(bits)
  validate_options(clip_std, generator)

  def encode(x, state, key):
    return uniform_quantize_tree(x, key, bits, zero_center=zero_center,
                                 clip_std=clip_std, generator=generator), state

  return base.CommTransform(base.no_state, encode, base.decode_values)
