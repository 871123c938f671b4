"""Uniform random numbers of the stochastic quantizers, by generator name.

``'threefry'``: ``jax.random.uniform``. ``'hash'``: a counter-based lowbias32
hash (Wellons, hash-prospector) of the flat element index.
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
  """32 pseudo-random bits per element: ``mix(mix(i ^ s0) + s1)``.

  ``i`` is the row-major flat index, ``(s0, s1) = jax.random.bits(key, (2,),
  uint32)``.

  Args:
    key: a JAX PRNG key (raw ``uint32[2]`` or typed).
    shape: output shape (static).

  Returns:
    ``uint32`` array of ``shape``.

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


def hash_uniform(key: jax.Array, shape: Sequence[int],
                 dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """Uniform numbers in [0, 1) from :func:`hash_bits`.

  Args:
    key: a JAX PRNG key.
    shape: output shape (static).
    dtype: ``float32`` (step ``2**-24``), ``float64`` (step ``2**-32``) or
      another floating dtype (float32 values cast).

  Returns:
    Array of ``shape`` and ``dtype``.

  Raises:
    ValueError: if ``shape`` has more than 2**32 elements.
  """
  bits = hash_bits(key, shape)
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float64:
    return bits.astype(jnp.float64) * 2.0**-32
  # The top 24 bits fit a float32 mantissa exactly (via int32).
  u = (bits >> jnp.uint32(8)).astype(jnp.int32).astype(jnp.float32)
  return (u * jnp.float32(2.0**-24)).astype(dtype)


def random_uniform(key: jax.Array, shape: Sequence[int],
                   dtype: jnp.dtype = jnp.float32,
                   generator: str = 'hash') -> jax.Array:
  """Uniform numbers in [0, 1) from the named generator.

  Args:
    key: a JAX PRNG key (raw or typed).
    shape: output shape (static).
    dtype: a floating dtype.
    generator: ``'hash'`` (:func:`hash_uniform`) or ``'threefry'``
      (``jax.random.uniform``).

  Raises:
    ValueError: for an unknown ``generator``, or a ``'hash'`` request of more
      than 2**32 elements.
  """
  validate_generator(generator)
  if generator == 'threefry':
    return jax.random.uniform(key, tuple(shape), dtype)
  return hash_uniform(key, shape, dtype)

