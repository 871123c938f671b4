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


def haiku_linear_init(key: Array, shape: Sequence[int],
                      dtype: Dtype = jnp.float32) -> Array:
  """Haiku's default ``Linear``/``ConvND`` weight initializer.

  Truncated normal on [-2, 2] times ``1 / sqrt(fan_in)``, with no correction
  for the truncation.

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


def haiku_embed_init(key: Array, shape: Sequence[int],
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



#: Convolution implementations of the CNNs: ``'lax'`` (``lax.conv``) and
#: ``'im2col'`` (:func:`im2col_conv_general_dilated`).
CONV_IMPLEMENTATIONS = ('lax', 'im2col')


def check_conv_implementation(name: str) -> str:
  """``name`` if in :data:`CONV_IMPLEMENTATIONS`, else ``ValueError``."""
  if name not in CONV_IMPLEMENTATIONS:
    raise ValueError(f'conv_implementation={name!r}: allowed values are '
                     f'{", ".join(CONV_IMPLEMENTATIONS)}.')
  return name


def im2col_conv_general_dilated(lhs: Array, rhs: Array, window_strides,
                                padding, lhs_dilation=None, rhs_dilation=None,
                                dimension_numbers=None, feature_group_count=1,
                                precision=None) -> Array:
  """``lax.conv_general_dilated`` for flax's ``nn.Conv`` as one matmul.

  NHWC input ``[B, H, W, C]``, HWIO kernel ``[kh, kw, C, O]``, stride 1, no
  dilation or groups: the ``kh * kw`` shifted slices of the (padded) input
  are concatenated on the channels, ``[B, H', W', kh kw C]``, and multiplied
  by the kernel as a ``[kh kw C, O]`` matrix. Equal to ``lax.conv`` to
  float rounding.

  Raises:
    ValueError: another layout, a stride, dilation or feature groups.
  """
  dims = dimension_numbers
  nhwc = (isinstance(dims, jax.lax.ConvDimensionNumbers) and
          tuple(dims.lhs_spec) == (0, 3, 1, 2) and
          tuple(dims.rhs_spec) == (3, 2, 0, 1) and
          tuple(dims.out_spec) == (0, 3, 1, 2))
  plain = lambda v: v is None or all(int(x) == 1 for x in v)
  if not (nhwc and plain(window_strides) and plain(lhs_dilation) and
          plain(rhs_dilation) and feature_group_count == 1):
    raise ValueError(
        'im2col convolutions take 2-D NHWC inputs with stride 1 and no '
        f'dilation or feature groups; got strides {window_strides}, '
        f'dilations {lhs_dilation}/{rhs_dilation}, groups '
        f'{feature_group_count}.')
  kh, kw, cin, cout = rhs.shape
  if isinstance(padding, str):
    if padding not in ('SAME', 'VALID'):
      raise ValueError(f"im2col padding must be 'SAME', 'VALID' or pairs; got "
                       f'{padding!r}.')
    padding = ([((k - 1) // 2, k - 1 - (k - 1) // 2) for k in (kh, kw)]
               if padding == 'SAME' else [(0, 0), (0, 0)])
  lhs = jnp.pad(lhs, [(0, 0)] + [tuple(p) for p in padding] + [(0, 0)])
  height, width = lhs.shape[1] - kh + 1, lhs.shape[2] - kw + 1
  cols = [lhs[:, i:i + height, j:j + width, :]
          for i in range(kh) for j in range(kw)]
  return jnp.einsum('bhwk,ko->bhwo', jnp.concatenate(cols, axis=-1),
                    rhs.reshape(kh * kw * cin, cout), precision=precision)
