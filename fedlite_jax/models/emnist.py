"""The EMNIST / FEMNIST CNN, split after the flatten layer.

Source: Reddi et al., 2020, "Adaptive Federated Optimization" (the CNN with
dropout), as FedJAX's ``fedjax.models.emnist.create_conv_model``; split as in
FedLite (Wang et al., 2022, Section 5 and Appendix C.2): "two convolutional
layers [...] on the clients and two dense layers on the server".
"""

from __future__ import annotations

from typing import Any, Mapping

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.models import layers, split

Array = jax.Array
Batch = Mapping[str, Array]

IMAGE_SHAPE = (28, 28, 1)
CUT_LAYER = 'flatten'
CUT_SIZE = 12 * 12 * 64  # 9,216.


def _max_pool_2x2(x: Array) -> Array:
  """``nn.max_pool(x, (2, 2), strides=(2, 2))`` for even H, W: [B, H, W, C]
  -> [B, H/2, W/2, C]."""
  b, h, w, c = x.shape
  return jnp.max(x.reshape(b, h // 2, 2, w // 2, 2, c), axis=(2, 4))


class EmnistClient(nn.Module):
  """Client: conv 32, conv 64 (3x3 VALID, relu), max-pool, dropout, flatten.

  Attributes:
    dropout_rate: dropout rate after the max-pool (FedJAX: 0.25).
    conv_implementation: ``'lax'`` or ``'im2col'``
      (:data:`~fedlite_jax.models.layers.CONV_IMPLEMENTATIONS`).
    dtype: the computation dtype (None: float32); parameters stay float32.
  """
  dropout_rate: float = 0.25
  conv_implementation: str = 'lax'
  dtype: Any = None

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    """Maps ``batch['x']`` float32 [B, 28, 28, 1] to float32 [B, 9216].

    Raises:
      ValueError: if ``batch['x']`` is not of shape [B, 28, 28, 1].
    """
    x = batch['x']
    if x.ndim != 4 or tuple(x.shape[1:]) != IMAGE_SHAPE:
      raise ValueError(
          f"EMNIST CNN expects batch['x'] of shape [B, 28, 28, 1], got "
          f'{x.shape}.')
    x = x.astype(jnp.float32)
    conv = (layers.im2col_conv_general_dilated
            if self.conv_implementation == 'im2col' else None)
    for name, channels in (('conv1', 32), ('conv2', 64)):
      x = nn.Conv(channels, (3, 3), padding='VALID', name=name,
                  kernel_init=layers.haiku_linear_init,
                  conv_general_dilated=conv, dtype=self.dtype)(x)
      x = nn.relu(x)
    x = _max_pool_2x2(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
    return x.reshape((x.shape[0], -1))


class EmnistServer(nn.Module):
  """Server part: dense 128, relu, dropout, dense to the classes.

  Attributes:
    num_classes: 62 (digits and letters) or 10 (digits only).
    hidden_units: width of the hidden dense layer (FedJAX: 128).
    dropout_rate: dropout rate after the hidden layer (FedJAX: 0.5).
    dtype: the computation dtype (None: float32); logits are float32.
  """
  num_classes: int = 62
  hidden_units: int = 128
  dropout_rate: float = 0.5
  dtype: Any = None

  @nn.compact
  def __call__(self, activations: Array, batch: Batch, train: bool) -> Array:
    """Maps activations float32 [B, 9216] to logits float32 [B, C]."""
    del batch
    z = nn.Dense(self.hidden_units, name='dense1', dtype=self.dtype,
                 kernel_init=layers.haiku_linear_init)(activations)
    z = nn.relu(z)
    z = nn.Dropout(self.dropout_rate)(z, deterministic=not train)
    logits = nn.Dense(self.num_classes, name='dense2', dtype=self.dtype,
                      kernel_init=layers.haiku_linear_init)(z)
    return logits.astype(jnp.float32)


def train_loss(batch: Batch, preds: Array) -> Array:
  """Per-example softmax cross-entropy float32 [B] of logits [B, C].

  ``batch['y']``: integer class labels [B] (floats are cast).
  """
  labels = batch['y'].astype(jnp.int32)
  return optax.softmax_cross_entropy_with_integer_labels(preds, labels)


def create_emnist_cnn(num_classes: int = 62, client_dropout_rate: float = 0.25,
                      server_dropout_rate: float = 0.5,
                      conv_implementation: str = 'lax',
                      compute_dtype: Any = None) -> split.SplitModel:
  """Creates the EMNIST CNN of Reddi et al. (2020), split after ``flatten``.

  ``batch['x']`` float32 [B, 28, 28, 1] -> logits float32 [B, num_classes].
  Client ('conv1', 'conv2'): 18,816 parameters; server ('dense1',
  'dense2'): 1,187,774 for 62 classes. Initializers (Haiku's, see
  :mod:`fedlite_jax.models.layers`), dropout rates, loss and metrics are
  FedJAX's, and parameter shapes equal FedJAX's Haiku ones.

  Args:
    num_classes: 62 (FEMNIST: digits, upper and lower case) or 10 (digits).
    client_dropout_rate: dropout after the max-pool (client side).
    server_dropout_rate: dropout after the hidden dense layer (server side).
    conv_implementation: ``'lax'`` or ``'im2col'`` (equal to float rounding;
      :func:`~fedlite_jax.models.layers.im2col_conv_general_dilated`).
    compute_dtype: e.g. ``jnp.bfloat16`` for mixed precision (parameters
      and logits stay float32); None: float32.

  Returns:
    A :class:`~fedlite_jax.models.split.SplitModel` with ``cut_layer =
    'flatten'`` and ``cut_size = 9216``; ``model.eval_metrics`` are ``'loss'``
    and ``'accuracy'``.

  Raises:
    ValueError: if ``num_classes < 2``, a dropout rate is not in [0, 1), or
      an unknown ``conv_implementation``.
  """
  layers.check_conv_implementation(conv_implementation)
  if num_classes < 2:
    raise ValueError(f'num_classes must be >= 2, got {num_classes}.')
  for rate in (client_dropout_rate, server_dropout_rate):
    if not 0.0 <= rate < 1.0:
      raise ValueError(f'dropout rates must be in [0, 1), got {rate}.')
  return split.build_split_model(
      client=EmnistClient(dropout_rate=client_dropout_rate,
                          conv_implementation=conv_implementation,
                          dtype=compute_dtype),
      server=EmnistServer(num_classes=num_classes,
                          dropout_rate=server_dropout_rate,
                          dtype=compute_dtype),
      sample_batch={'x': np.zeros((1,) + IMAGE_SHAPE, np.float32),
                    'y': np.zeros((1,), np.int32)},
      train_loss=train_loss,
      eval_metrics={'loss': fedjax.metrics.CrossEntropyLoss(),
                    'accuracy': fedjax.metrics.Accuracy()},
      cut_layer=CUT_LAYER, cut_size=CUT_SIZE)
