"""Uniform random numbers for stochastic rounding: threefry or a fast hash.

Stochastic quantization needs one uniform number per quantized value. On
XLA:CPU, ``jax.random.uniform`` (threefry2x32) dominates the cost: about 100 ms
of a 120 ms quantization of 20M float32 values
(docs/DESIGN_NOTES.md, "Random numbers"). This module offers two
generators, selected by name:

* ``'threefry'``: ``jax.random.uniform(key, shape, dtype)``, JAX's own
  generator (threefry2x32 for keys made by ``jax.random.PRNGKey`` /
  ``jax.random.key``; whatever implementation the key carries otherwise).
* ``'hash'``: a counter-based generator. Two 32-bit seeds ``(s0, s1)`` are
  drawn once from the key with ``jax.random.bits`` (one tiny threefry call);
  element ``i`` (row-major flat index) gets
  ``h_i = mix(mix(i ^ s0) + s1)``, where ``mix`` is the "lowbias32" integer
  finalizer (Wellons, https://github.com/skeeto/hash-prospector: xorshift 16,
  multiply 0x7feb352d, xorshift 15, multiply 0x846ca68b, xorshift 16; a
  bijection of uint32). Everything is elementwise integer arithmetic, so XLA
  fuses it into the quantizer's single loop: no random buffer is written.

Properties of ``'hash'`` (what the tests check statistically):

* Exact marginals: for any fixed element ``i``, if the key's seed bits are
  uniform then ``mix(i ^ s0) + s1`` is uniform on uint32 (``s1`` is uniform and
  independent of ``s0``), and ``mix`` is a bijection, so ``h_i`` is exactly
  uniform on uint32. Stochastic rounding driven by it is therefore unbiased in
  expectation over keys (up to the output grid of the uniforms, below).
* Within one call, ``i -> h_i`` is a bijection (no repeated value) and
  neighbouring elements are decorrelated by the avalanche of ``mix``; across
  keys the whole stream changes. It is *not* a cryptographic generator and not
  a stream JAX defines: the same key gives different numbers with ``'hash'``
  and ``'threefry'``.
* Counters are 32-bit: arrays with more than 2**32 elements would repeat
  counters (``ValueError``).

Uniform outputs: float32 results are ``(h >> 8) * 2**-24`` (24 random bits,
values in [0, 1 - 2**-24]); float64 results are ``h * 2**-32`` (32 random
bits). So ``P(u < p)`` differs from ``p`` by less than ``2**-24`` (float32) or
``2**-32`` (float64).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

GENERATORS = ('hash', 'threefry')
"""Names accepted by :func:`random_uniform` and by ``generator=``."""

_MAX_HASH_ELEMENTS = 2**32


def validate_generator(generator: str) -> None:
  """Raises ``ValueError`` unless ``generator`` is one of :data:`GENERATORS`."""
  if generator not in GENERATORS:
    raise ValueError(
        f'generator must be one of {GENERATORS}, got {generator!r}.')


def _lowbias32(x: jax.Array) -> jax.Array:
  """Wellons' lowbias32 finalizer: a bijection of uint32 with strong mixing."""
  x = x ^ (x >> jnp.uint32(16))
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> jnp.uint32(15))
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> jnp.uint32(16))


def hash_bits(key: jax.Array, shape: Sequence[int]) -> jax.Array:
  """32 pseudo-random bits per element from a key and the element's index.

  Args:
    key: a JAX PRNG key (raw ``uint32[2]`` from ``jax.random.PRNGKey`` or a
      typed key from ``jax.random.key``).
    shape: output shape (static).

  Returns:
    ``uint32`` array of ``shape``: ``mix(mix(i ^ s0) + s1)`` for the row-major
    flat index ``i``, with ``(s0, s1) = jax.random.bits(key, (2,), uint32)``.

  Raises:
    ValueError: if ``shape`` has more than 2**32 elements.
  """
  shape = tuple(int(d) for d in shape)
  size = math.prod(shape)
  if size > _MAX_HASH_ELEMENTS:
    raise ValueError(
        f'hash generator supports at most 2**32 elements, got {size}.')
  seeds = jax.random.bits(key, (2,), jnp.uint32)
  index = lax.iota(jnp.uint32, size).reshape(shape)
  return _lowbias32(_lowbias32(index ^ seeds[0]) + seeds[1])


def hash_uniform(key: jax.Array,
                 shape: Sequence[int],
                 dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """Uniform numbers in [0, 1) from :func:`hash_bits` (counter-based, fast).

  Args:
    key: a JAX PRNG key.
    shape: output shape (static).
    dtype: ``float32`` (24 random bits per value, step ``2**-24``) or
      ``float64`` (32 random bits, step ``2**-32``; needs ``jax_enable_x64``).
      Other floating dtypes get the float32 values cast to them.

  Returns:
    Array of ``shape`` and ``dtype`` with values in [0, 1).

  Raises:
    ValueError: if ``shape`` has more than 2**32 elements.
  """
  bits = hash_bits(key, shape)
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float64:
    return bits.astype(jnp.float64) * 2.0**-32
  # The top 24 bits fit a float32 mantissa exactly; an int32 conversion is
  # cheaper than uint32 on CPUs without unsigned vector conversions.
  u = (bits >> jnp.uint32(8)).astype(jnp.int32).astype(jnp.float32)
  return (u * jnp.float32(2.0**-24)).astype(dtype)


def random_uniform(key: jax.Array,
            shape: Sequence[int],
            dtype: jnp.dtype = jnp.float32,
            generator: str = 'hash') -> jax.Array:
  """Uniform numbers in [0, 1) from the named generator.

  Args:
    key: a JAX PRNG key (raw or typed).
    shape: output shape (static).
    dtype: a floating dtype.
    generator: ``'hash'`` (:func:`hash_uniform`) or ``'threefry'``
      (``jax.random.uniform(key, shape, dtype)``).

  Returns:
    Array of ``shape`` and ``dtype`` with values in [0, 1).

  Raises:
    ValueError: for an unknown ``generator``, or a ``'hash'`` request of more
      than 2**32 elements.
  """
  validate_generator(generator)
  if generator == 'threefry':
    return jax.random.uniform(key, tuple(shape), dtype)
  return hash_uniform(key, shape, dtype)
