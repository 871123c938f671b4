"""Flax layers and initializers that reproduce Haiku's (and so FedJAX's).

Source: Haiku's defaults (``haiku/_src/basic.py``, ``conv.py``, ``embed.py``,
``recurrent.py``). Parameter shapes equal Haiku's, so FedJAX parameters copy
into these layers one to one.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Dtype = Any


def haiku_linear_init(key: Array,
                      shape: Sequence[int],
                      dtype: Dtype = jnp.float32) -> Array:
  """Haiku's default ``Linear``/``ConvND`` weight initializer.

  Truncated normal on [-2, 2] times ``1 / sqrt(fan_in)``, with no correction
  for the truncation (Flax's ``lecun_normal`` has one: ~14% larger weights).

  Args:
    key: a PRNG key.
    shape: kernel shape; the last axis is the output, all others fan-in
      (``[in, out]`` dense, ``[kh, kw, in, out]`` conv, as Haiku and Flax).
    dtype: the parameter dtype.

  Raises:
    ValueError: if ``shape`` has fewer than two axes.
  """
  if len(shape) < 2:
    raise ValueError(f'haiku_linear_init needs a kernel shape of rank >= 2, '
                     f'got {tuple(shape)}.')
  fan_in = int(np.prod(shape[:-1]))
  stddev = 1.0 / np.sqrt(fan_in)
  return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) * stddev


def haiku_embed_init(key: Array,
                     shape: Sequence[int],
                     dtype: Dtype = jnp.float32) -> Array:
  """Haiku's default ``Embed`` initializer: truncated normal, stddev 1."""
  return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)


class LSTM(nn.Module):
  """A single LSTM layer run over a batch of sequences, as ``hk.LSTM``.

  From ``h_0 = c_0 = 0``, Haiku's gate order and forget-gate bias::

    [i, g, f, o] = [x_t, h_{t-1}] @ kernel + bias   # [in + H, 4H], [4H]
    c_t = sigmoid(f + 1) * c_{t-1} + sigmoid(i) * tanh(g)
    h_t = sigmoid(o) * tanh(c_t)

  Attributes:
    hidden_size: the LSTM state size H.
    unroll: ``unroll`` of the time ``scan`` (speed only).
  """
  hidden_size: int
  unroll: int = 1

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Maps inputs float [B, T, in] to h_1..h_T float32 [B, T, H].

    Raises:
      ValueError: if ``inputs`` is not of rank 3.
    """
    if inputs.ndim != 3:
      raise ValueError(f'LSTM expects inputs of shape [B, T, in], got '
                       f'{inputs.shape}.')
    batch_size, _, in_size = inputs.shape
    hidden = self.hidden_size
    kernel = self.param('kernel', haiku_linear_init,
                        (in_size + hidden, 4 * hidden), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros_init(), (4 * hidden,),
                      jnp.float32)
    w_x, w_h = kernel[:in_size], kernel[in_size:]
    # [T, B, 4H]: the input contribution of every time step at once.
    gates_x = jnp.swapaxes(inputs @ w_x + bias, 0, 1)

    def step(carry, gx):
      h, c = carry
      i, g, f, o = jnp.split(gx + h @ w_h, 4, axis=-1)
      c = jax.nn.sigmoid(f + 1.0) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
      h = jax.nn.sigmoid(o) * jnp.tanh(c)
      return (h, c), h

    zeros = jnp.zeros((batch_size, hidden), jnp.float32)
    _, hs = jax.lax.scan(step, (zeros, zeros), gates_x, unroll=self.unroll)
    return jnp.swapaxes(hs, 0, 1)
