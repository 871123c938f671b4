"""Count sketch of an update vector (FetchSGD's compressor).

Sources: Charikar, Chen & Farach-Colton, "Finding Frequent Items in Data
Streams" (ICALP 2002); Rothchild et al., "FetchSGD" (ICML 2020), Alg. 1.

``S[r, c] = sum_{i: h_r(i) = c} s_r(i) v_i`` (linear in ``v``); the estimate
of ``v_i`` is ``median_r s_r(i) S[r, h_r(i)]`` (NumPy's median: use odd
``rows``). With ``fmix32`` MurmurHash3's finalizer, ``kb_r = fmix32(seed XOR
fmix32(2r + 1))`` and ``ks_r = fmix32(seed XOR fmix32(2r + 2))``:

* ``h_r(i) = fmix32(i XOR kb_r) mod cols``
* ``s_r(i) = +1 if fmix32(i XOR ks_r) < 2**31 else -1``

Bits: ``32 * rows * cols`` per sketch (float32 table), as in FetchSGD.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.transforms.fastfood import check_int, check_seed
from fedlite_jax.transforms import base, topk as topk_lib

__all__ = [
    'count_sketch', 'fmix32_int', 'hashes_at', 'median_rows',
    'sketch_hashes', 'sketch_message_bits', 'sketch_vector', 'unsketch']

_MEDIAN_NETWORK_MAX_ROWS = 15


def fmix32_int(x: int) -> int:
  """MurmurHash3's 32-bit finalizer of ``x mod 2**32`` (a bijection, 0 -> 0)."""
  x &= 0xFFFFFFFF
  x ^= x >> 16
  x = (x * 0x85EBCA6B) & 0xFFFFFFFF
  x ^= x >> 13
  x = (x * 0xC2B2AE35) & 0xFFFFFFFF
  x ^= x >> 16
  return x


def _fmix32(x: jax.Array) -> jax.Array:
  """fmix32 on uint32 arrays (wrapping multiplication)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _row_keys(seed: int, rows: int) -> tuple[list[int], list[int]]:
  """``(kb_r, ks_r)`` for r < rows; validates ``seed``."""
  seed = check_seed(seed, 'sketch seed')
  kb = [fmix32_int(seed ^ fmix32_int(2 * r + 1)) for r in range(rows)]
  ks = [fmix32_int(seed ^ fmix32_int(2 * r + 2)) for r in range(rows)]
  return kb, ks


def sketch_hashes(seed: int, rows: int, cols: int,
                  D: int) -> tuple[jax.Array, jax.Array]:
  """Bucket and sign hashes of coordinates ``0..D-1``.

  Args:
    seed: sketch seed in ``[0, 2**32)`` (shared by clients and server).
    rows: number of rows (>= 1).
    cols: number of columns (>= 1).
    D: vector length (>= 1).

  Returns:
    ``(buckets int32[rows, D] in [0, cols), signs float32[rows, D] in
    {-1, +1})``.

  Raises:
    ValueError: non-positive sizes or a bad seed.
  """
  D = check_int(D, 'D')
  return hashes_at(seed, rows, cols, jnp.arange(D, dtype=jnp.int32))


def hashes_at(seed: int, rows: int, cols: int,
              indices: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Bucket and sign hashes of the coordinates ``indices`` (int, any shape).

  Returns:
    ``(buckets int32[rows, *indices.shape], signs float32[rows,
    *indices.shape])``.
  """
  rows = check_int(rows, 'sketch rows')
  cols = check_int(cols, 'sketch cols')
  kb, ks = _row_keys(seed, rows)
  i = jnp.asarray(indices).astype(jnp.uint32)[None]
  shape = (rows,) + (1,) * (i.ndim - 1)
  kb = jnp.asarray(np.asarray(kb, np.uint32)).reshape(shape)
  ks = jnp.asarray(np.asarray(ks, np.uint32)).reshape(shape)
  buckets = (_fmix32(i ^ kb) % jnp.uint32(cols)).astype(jnp.int32)
  signs = jnp.where(_fmix32(i ^ ks) < jnp.uint32(2**31), 1.0, -1.0)
  return buckets, signs.astype(jnp.float32)


def sketch_message_bits(rows: int, cols: int) -> float:
  """Bits of one sketch: ``32 * rows * cols`` (float32 table)."""
  return float(32 * check_int(rows, 'sketch rows') *
               check_int(cols, 'sketch cols'))


def sketch_vector(v: jax.Array, seed: int, rows: int, cols: int) -> jax.Array:
  """The count sketch ``float32[rows, cols]`` of ``v: float[D]``.

  ``seed``, ``rows``, ``cols``: as :func:`sketch_hashes` (static ints).
  """
  D = v.shape[-1]
  buckets, signs = sketch_hashes(seed, rows, cols, D)
  flat_index = buckets + (jnp.arange(rows, dtype=jnp.int32) * cols)[:, None]
  table = jax.ops.segment_sum((signs * v.astype(jnp.float32)[None]).ravel(),
                              flat_index.ravel(), num_segments=rows * cols)
  return table.reshape(rows, cols)


def median_rows(x: jax.Array) -> jax.Array:
  """Median over axis 0 (NumPy's), a min/max sorting network for <= 15 rows."""
  n = x.shape[0]
  if n > _MEDIAN_NETWORK_MAX_ROWS:
    return jnp.median(x, axis=0)
  rows = [x[i] for i in range(n)]
  for p in range(n):
    for i in range(p % 2, n - 1, 2):
      lo = jnp.minimum(rows[i], rows[i + 1])
      hi = jnp.maximum(rows[i], rows[i + 1])
      rows[i], rows[i + 1] = lo, hi
  if n % 2:
    return rows[n // 2]
  return 0.5 * (rows[n // 2 - 1] + rows[n // 2])


def unsketch(table: jax.Array, seed: int, D: int) -> jax.Array:
  """``float32[D]`` estimates ``median_r s_r(i) S[r, h_r(i)]`` of a table.

  Args:
    table: ``float32[rows, cols]``.
    seed: the sketch seed.
    D: vector length.
  """
  rows, cols = table.shape
  buckets, signs = sketch_hashes(seed, rows, cols, D)
  est = jnp.take_along_axis(table, buckets, axis=1) * signs
  return median_rows(est)


def count_sketch(rows: int, cols: int, seed: int = 0,
                 k: Optional[int] = None) -> base.CommTransform:
  """Count sketch of a raveled pytree as a stateless ``CommTransform``.

  ``values``: ``float32[rows, cols]`` (``32 rows cols`` bits); ``decode``:
  the estimates, or only the top-k in magnitude (FetchSGD's unsketch).

  Args:
    rows: sketch rows (>= 1; odd recommended).
    cols: sketch columns (>= 1).
    seed: hash seed in ``[0, 2**32)``.
    k: if set, ``decode`` keeps the top-k estimates (1 <= k <= D).

  Raises:
    ValueError: non-positive sizes, bad seed, k < 1 (here) or k > D (at
      ``init``).
  """
  rows = check_int(rows, 'sketch rows')
  cols = check_int(cols, 'sketch cols')
  _row_keys(seed, rows)
  if k is not None:
    k = check_int(k, 'k')
  bits = sketch_message_bits(rows, cols)

  def init(example):
    D = base.TreeSpec.of(example).size
    if k is not None and k > D:
      raise ValueError(f'count_sketch: k={k} exceeds D={D}.')
    return ()

  def encode(x, state, key):
    del key
    spec = base.TreeSpec.of(x)
    table = sketch_vector(spec.ravel(x, jnp.float32), seed, rows, cols)
    return base.Encoded(table, (), bits, 0.0, spec), state

  def decode(message, state):
    spec = message.spec
    est = unsketch(message.values, seed, spec.size)
    if k is not None:
      values, idx = topk_lib.topk_abs(est, k)
      est = topk_lib.scatter(values, idx, spec.size)
    return spec.unravel(est), state

  return base.CommTransform(init, encode, decode)
