"""Local Top-K sparsification: send the k largest-magnitude entries.

Sources: Aji & Heafield, "Sparse Communication for Distributed Gradient
Descent" (EMNLP 2017); Lin et al., "Deep Gradient Compression" (ICLR 2018,
error feedback); the local top-k baseline of Rothchild et al., "FetchSGD"
(ICML 2020) and Melas-Kyriazi & Wang (2022), Table 2.
Bits ``'log2'``: ``k * (32 + ceil(log2 D))`` (value + index per entry).
Bits ``'none'``: ``32 k`` (values only; FetchSGD's and Table 2's accounting).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedlite_jax.transforms.fastfood import check_int
from fedlite_jax.transforms import base


INDEX_BITS = ('log2', 'none')
"""Accepted ``index_bits`` accountings."""

__all__ = ['INDEX_BITS', 'top_k', 'topk_abs', 'topk_message_bits', 'scatter']


def _check_k(k: Any, D: int | None = None) -> int:
  """``k`` as an int >= 1 (and <= D if given), else ``ValueError``."""
  k = check_int(k, 'top-k: k')
  if D is not None and k > D:
    raise ValueError(f'top-k: k={k} exceeds the number of entries D={D}.')
  return k


def topk_message_bits(k: int, D: int, index_bits: str = 'log2') -> float:
  """Bits of one top-k message of k of D entries (see the module docstring).

  Raises:
    ValueError: bad k, D or index_bits.
  """
  D = check_int(D, 'D')
  k = _check_k(k, D)
  if index_bits not in INDEX_BITS:
    raise ValueError(f'index_bits must be one of {INDEX_BITS}; got '
                     f'{index_bits!r}.')
  per_index = (D - 1).bit_length() if index_bits == 'log2' else 0
  return float(k * (32 + per_index))


def topk_abs(v: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k entries of ``v: float[D]`` of largest ``|v|`` (ties: lower index).

  Returns:
    ``(v[idx] float[k], idx int32[k])``, in decreasing ``|v|`` order.
  """
  _, idx = jax.lax.top_k(jnp.abs(v), k)
  return v[idx], idx.astype(jnp.int32)


def scatter(values: jax.Array, indices: jax.Array, D: int) -> jax.Array:
  """Dense ``float[D]`` with ``values`` at ``indices`` and zeros elsewhere."""
  return jnp.zeros((D,), values.dtype).at[indices].set(values)


def top_k(k: int, index_bits: str = 'log2',
          error_feedback: bool = False) -> base.CommTransform:
  """Top-K sparsification of a raveled pytree as a ``CommTransform``.

  ``values``: ``float32[k]``; ``side``: ``{'indices': int32[k]}``; ``decode``
  scatters into zeros. State: ``()``, or ``{'residual': float32[D]}``.

  Args:
    k: entries kept per message (1 <= k <= D).
    index_bits: ``'log2'`` or ``'none'`` (see the module docstring).
    error_feedback: send ``ravel(x) + residual``, keep the unsent rest as the
      residual (Lin et al. 2018; Stich et al. 2018); sender state, so not
      for federated clients.

  Raises:
    ValueError: k < 1, k > D, unknown ``index_bits``.
  """
  k = _check_k(k)
  if index_bits not in INDEX_BITS:
    raise ValueError(f'index_bits must be one of {INDEX_BITS}; got '
                     f'{index_bits!r}.')

  def init(example):
    D = base.TreeSpec.of(example).size
    _check_k(k, D)
    if error_feedback:
      return {'residual': jnp.zeros((D,), jnp.float32)}
    return ()

  def encode(x, state, key):
    del key
    spec = base.TreeSpec.of(x)
    D = spec.size
    _check_k(k, D)
    v = spec.ravel(x, jnp.float32)
    if error_feedback:
      v = v + state['residual']
    values, idx = topk_abs(v, k)
    if error_feedback:
      state = {'residual': v.at[idx].set(0.0)}
    bits = topk_message_bits(k, D, index_bits)
    return base.Encoded(values, {'indices': idx}, 32.0 * k, bits - 32.0 * k,
                        spec), state

  def decode(message, state):
    spec = message.spec
    flat = scatter(message.values, message.side['indices'], spec.size)
    return spec.unravel(flat), state

  return base.CommTransform(init, encode, decode)
