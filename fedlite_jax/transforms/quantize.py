"""Quantizers of :mod:`fedlite_jax.quantization` as communication transforms.

Thin adapters: ``encode`` runs the quantizer with the given key and returns
the dequantized values (what the receiver reconstructs) with the quantizer's
bit count; ``decode`` is the identity on those values. One leaf = one layer
(own min/max), as in the quantizers themselves. Stateless.

* :func:`uniform_quantization`: stochastic k-level uniform quantization
  (Suresh et al. 2017; Ro et al. 2022, App. C): ``bits * size + 64`` per
  leaf (``+ 32`` with ``zero_center``).
* :func:`terngrad`: TernGrad (Wen et al. 2017): ``log2(3) * size + 32`` per
  leaf.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from fedlite_jax import quantization
from fedlite_jax.quantization import rng as quantization_rng
from fedlite_jax.transforms import base

__all__ = ['terngrad', 'uniform_quantization']


def _quantizer(quantize_tree: Callable[..., quantization.Quantized],
               clip_std: Optional[float], generator: str) -> base.CommTransform:
  """A stateless transform sending ``quantize_tree``'s dequantized values.

  ``encode`` returns ``quantize_tree(x, key, clip_std=clip_std,
  generator=generator)``'s values and bit count; ``decode`` is the identity.

  Raises:
    ValueError: ``clip_std <= 0`` or an unknown ``generator``.
  """
  if clip_std is not None and not clip_std > 0:
    raise ValueError(f'clip_std must be None or > 0; got {clip_std!r}.')
  quantization_rng.validate_generator(generator)

  def encode(x, state, key):
    q = quantize_tree(x, key, clip_std=clip_std, generator=generator)
    return base.Encoded(q.values, (), float(q.num_bits), 0.0, None), state

  return base.CommTransform(base.no_state, encode, base.decode_values)


def uniform_quantization(bits: int,
                         *,
                         zero_center: bool = False,
                         clip_std: Optional[float] = None,
                         generator: str = 'hash') -> base.CommTransform:
  """Stochastic uniform quantization (``2**bits`` levels per leaf).

  Args:
    bits: bits per value, 1..32 (static).
    zero_center: grid ``[-max|x|, max|x|]`` (one float sent per leaf).
    clip_std: optional clipping at ``clip_std * std`` before quantizing.
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    A :class:`~fedlite_jax.transforms.CommTransform`.

  Raises:
    TypeError, ValueError: as :func:`fedlite_jax.quantization.validate_bits`
      (here), ``clip_std <= 0``, an unknown ``generator``, and non-floating
      inputs (at ``encode``).
  """
  bits = quantization.validate_bits(bits)
  return _quantizer(
      functools.partial(quantization.uniform_quantize_tree, bits=bits,
                        zero_center=zero_center), clip_std, generator)


def terngrad(*, clip_std: Optional[float] = quantization.DEFAULT_CLIP_STD,
             generator: str = 'hash') -> base.CommTransform:
  """TernGrad ternarization per leaf (``log2(3)`` bits per value + 32).

  Args:
    clip_std: clipping at ``clip_std * std`` (TernGrad's 2.5), or None.
    generator: ``'hash'`` or ``'threefry'``.

  Returns:
    A :class:`~fedlite_jax.transforms.CommTransform`.

  Raises:
    ValueError: ``clip_std <= 0`` or an unknown ``generator``.
  """
  return _quantizer(quantization.terngrad_quantize_tree, clip_std, generator)
