"""Local Top-K sparsification: send the k largest-magnitude entries.

Sources: Aji & Heafield, "Sparse Communication for Distributed Gradient
Descent" (EMNLP 2017); Lin et al., "Deep Gradient Compression" (ICLR 2018,
error feedback); the "local top-k" baseline of Rothchild et al., "FetchSGD"
(ICML 2020) and Melas-Kyriazi & Wang (2022), Table 2.

The whole update pytree is raveled into one vector of length D (leaves in
``jax.tree.leaves`` order) and the k entries of largest ``|x_i|`` are kept
(``jax.lax.top_k``; ties go to the lower index).

Bits (``index_bits``, an explicit choice):

* ``'log2'`` (default): ``k * (32 + ceil(log2 D))`` -- a float32 value and a
  ``ceil(log2 D)``-bit index per kept entry; what a real message needs.
* ``'none'``: ``32 k`` -- values only, FetchSGD's / CommEfficient's
  accounting (``upload_bytes = 4 k``; Melas-Kyriazi & Wang's Table 2 uses it:
  D / k = 2,489 for k = 50,000), kept to compare with the papers.

Error feedback (``error_feedback=True``, Lin et al. 2018 / Stich et al.
2018): the sender keeps the residual ``e`` (its state) and sparsifies ``x +
e``; the new residual is what was not sent. It is sender-side state, so a
federated client would have to keep it between its (rare) participations;
the algorithms in :mod:`fedlite_jax.algorithms` do not use it (see
``FetchSGD`` for server-side error feedback).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedlite_jax.igc.fastfood import check_int
from fedlite_jax.transforms import base


INDEX_BITS = ('log2', 'none')

__all__ = ['INDEX_BITS', 'top_k', 'topk_abs', 'topk_message_bits', 'scatter']


def _check_k(k: Any, D: int | None = None) -> int:
  k = check_int(k, 'top-k: k')
  if D is not None and k > D:
    raise ValueError(f'top-k: k={k} exceeds the number of entries D={D}.')
  return k


def topk_message_bits(k: int, D: int, index_bits: str = 'log2') -> float:
  """Size of one top-k message in bits (see the module docstring).

  Args:
    k: entries kept (1 <= k <= D).
    D: vector length (>= 1).
    index_bits: ``'log2'`` (``k * (32 + ceil(log2 D))``) or ``'none'``
      (``32 k``).

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
  """The k entries of largest magnitude of a 1-D vector.

  Args:
    v: ``float[D]``.
    k: 1 <= k <= D.

  Returns:
    ``(values float[k], indices int32[k])`` with ``values = v[indices]``, in
    decreasing ``|v|`` order.
  """
  _, idx = jax.lax.top_k(jnp.abs(v), k)
  return v[idx], idx.astype(jnp.int32)


def scatter(values: jax.Array, indices: jax.Array, D: int) -> jax.Array:
  """Dense ``float[D]`` with ``values`` at ``indices`` and zeros elsewhere."""
  return jnp.zeros((D,), values.dtype).at[indices].set(values)


def top_k(k: int, index_bits: str = 'log2',
          error_feedback: bool = False) -> base.CommTransform:
  """Top-K sparsification of a pytree as a :class:`CommTransform`.

  ``encode(x)``: ``values = v[idx]`` (``float32[k]``), ``side = {'indices':
  int32[k]}`` for ``v = ravel(x) (+ residual)``; ``decode`` scatters the
  values into zeros and unravels. State: ``()``, or ``{'residual':
  float32[D]}`` with ``error_feedback``.

  Args:
    k: entries kept per message (>= 1; at most D, checked at ``init`` and
      ``encode``).
    index_bits: ``'log2'`` or ``'none'`` (see the module docstring).
    error_feedback: keep and re-add the unsent residual (sender state).

  Returns:
    A :class:`~fedlite_jax.transforms.CommTransform`.

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
