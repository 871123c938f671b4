"""Stochastic k-level uniform quantization (``k = 2**bits``) and its bit cost.

Source: Suresh et al., "Distributed Mean Estimation with Limited
Communication", ICML 2017, Sec. 2.2; upload and download in Ro et al.,
"Scaling Language Model Size in Cross-Device Federated Learning" (2022), Sec.
4 and App. C.
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


def validate_bits(bits: int) -> int:
  """``bits`` (bits per value, a static integer) as a Python ``int``.

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

  The significand precision ``finfo(dtype).nmant + 1``: 24 for float32, 53
  for float64, 11 for float16, 8 for bfloat16.
  """
  return int(jnp.finfo(dtype).nmant) + 1


def check_floating(x: Any, what: str) -> None:
  """Raises ``TypeError`` naming ``what`` unless ``x`` has a floating dtype."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f'{what} must have a floating dtype, got {dtype}.')


def as_layers(tree: PyTree, split: bool) -> PyTree:
  """``tree`` (one array if not ``split``) as floating JAX arrays.

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
  """``fn(leaf, split(key, num_leaves)[i])`` per leaf (``key`` if not split)."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  keys = jax.random.split(key, len(leaves)) if split else [key]
  return jax.tree.unflatten(treedef, [fn(x, k) for x, k in zip(leaves, keys)])


def _compute_dtype(dtype: Any) -> Any:
  """float64 for float64, else float32."""
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def clip_bound(x: jax.Array, clip_std: float, lo: Optional[jax.Array] = None,
               hi: Optional[jax.Array] = None) -> jax.Array:
  """``clip_std * std(x)`` (population std), ``+inf`` if ``max == min``.

  Args:
    x: floating array (one layer), at least one element.
    clip_std: ``c > 0``.
    lo, hi: ``min(x)`` and ``max(x)`` if known; computed otherwise.

  Returns:
    A scalar of ``x``'s dtype.
  """
  bound = clip_std * jnp.std(x)
  if lo is None or hi is None:
    lo, hi = _min_and_max(x)
  return jnp.where(hi == lo, jnp.inf, bound).astype(x.dtype)


def clip_by_std(x: jax.Array, clip_std: float) -> jax.Array:
  """``clip(x, -c sigma, c sigma)`` of a layer; a constant layer is unchanged.

  Source: Wen et al., "TernGrad", NeurIPS 2017, Sec. 3 (gradient clipping);
  ``sigma`` is the layer's population standard deviation.

  Args:
    x: floating array of any shape (one layer).
    clip_std: ``c > 0``.

  Returns:
    Array of ``x``'s shape and dtype.

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
  """``(min(x), max(x))`` in one read of ``x`` (a variadic ``lax.reduce``)."""
  init = (jnp.array(jnp.inf, x.dtype), jnp.array(-jnp.inf, x.dtype))
  lo, hi = lax.reduce(
      (x, x), init,
      lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])),
      tuple(range(x.ndim)))
  return lo, hi


def min_max(x: jax.Array, clip_std: Optional[float]):
  """``(clip(x), min(clip(x)), max(clip(x)))``; the clip is left to fuse.

  Args:
    x: floating array, at least one element.
    clip_std: ``None`` or ``c > 0`` (:func:`clip_by_std`).
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



def uniform_num_bits(tree: PyTree, bits: int, *,
                     zero_center: bool = False) -> float:
  """Bits of :func:`uniform_quantize_tree` (shapes read only).

  Per non-empty leaf: ``bits * size + 64`` (FedJAX's count), or
  ``bits * size + 32`` with ``zero_center``.

  Raises:
    TypeError, ValueError: as :func:`validate_bits`.
  """
  bits = validate_bits(bits)
  floats = FLOAT_BITS * (1 if zero_center else 2)
  sizes = (math.prod(leaf_shape(leaf)) for leaf in jax.tree.leaves(tree))
  return float(sum(bits * size + floats for size in sizes if size))


def _quantize_values(x: jax.Array, key: jax.Array, bits: int, zero_center: bool,
                     clip_std: Optional[float], generator: str) -> jax.Array:
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
  # No clamps on t: lo <= xc gives t >= 0; x == hi maps to k - 1 exactly,
  # and a t rounded above k - 1 gives a code that maps to hi below.
  t = jnp.where(xc >= hi, levels, (xc - lo) * scale)
  floor = jnp.floor(t)
  u = random_uniform(key, x.shape, dtype, generator)
  code = floor + (u < t - floor).astype(dtype)
  step = span / levels
  # End codes map to lo and hi exactly (also if span overflows); where()
  # is minimum() for non-NaN values, without its NaN handling.
  value = lo + code * step
  value = jnp.where(value > hi, hi, value)
  out = jnp.where(code >= levels, hi, jnp.where(code <= 0, lo, value))
  return out.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=(
    'split', 'bits', 'zero_center', 'clip_std', 'generator'))
def _quantize_jit(tree, key, *, split, bits, zero_center, clip_std, generator):
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


def uniform_quantize(x: jax.Array, key: jax.Array, bits: int, *,
                     zero_center: bool = False,
                     clip_std: Optional[float] = None,
                     generator: str = 'hash') -> base.Encoded:
  """Stochastic k-level uniform quantization of one layer (``k = 2**bits``).

  Levels ``B_r = lo + r (hi - lo) / (k - 1)``; ``x_i`` in ``[B_r, B_{r+1})``
  becomes ``B_{r+1}`` w.p. ``(x_i - B_r) / (B_{r+1} - B_r)``, else ``B_r``.
  ``E[Q(x_i)] = x_i``; ``Var <= (hi - lo)**2 / (4 (k - 1)**2)``.
  Identity at ``bits >= passthrough_bits(x.dtype)`` (still charged).
  Jittable (all but ``x`` and ``key`` static) and vmappable.

  Args:
    x: floating array of any shape: one layer, one (min, max).
    key: JAX PRNG key (raw ``uint32[2]`` or typed), used as is.
    bits: bits per value, a static integer in 1..32.
    zero_center: grid on ``[-max|x|, max|x|]`` (one float sent) instead of
      ``[min(x), max(x)]`` (two floats).
    clip_std: if set, :func:`clip_by_std` first (then unbiased for the
      clipped layer only).
    generator: ``'hash'`` (default) or ``'threefry'`` (``transforms.rng``).

  Returns:
    ``Encoded``: ``values`` has ``x``'s shape and dtype.
    Bits: ``bits * x.size + 64``; ``bits * x.size + 32`` with ``zero_center``;
    0 if empty.

  Raises:
    TypeError: non-integer ``bits`` or non-floating ``x``.
    ValueError: ``bits`` outside 1..32, unknown ``generator``, ``clip_std``
      not > 0.
  """
  return _quantize(x, key, bits, zero_center, clip_std, generator, False)


def uniform_quantize_tree(tree: PyTree, key: jax.Array, bits: int, *,
                          zero_center: bool = False,
                          clip_std: Optional[float] = None,
                          generator: str = 'hash') -> base.Encoded:
  """:func:`uniform_quantize` per leaf, key ``split(key, num_leaves)[i]``.

  Returns:
    ``Encoded`` like ``tree``; ``bits = uniform_num_bits(tree, bits,
    zero_center=zero_center)``.

  Raises:
    TypeError: non-integer ``bits`` or a non-floating leaf.
    ValueError: ``bits`` outside 1..32, unknown ``generator``, ``clip_std``
      not > 0.
  """
  return _quantize(tree, key, bits, zero_center, clip_std, generator, True)


def uniform_quantization(bits: int, *, zero_center: bool = False,
                         clip_std: Optional[float] = None,
                         generator: str = 'hash') -> base.CommTransform:
  """:func:`uniform_quantize_tree` as a stateless transform.

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
