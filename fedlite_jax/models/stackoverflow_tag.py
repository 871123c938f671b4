"""The Stack Overflow tag-prediction model: one dense layer on each side.

Source: FedLite (Wang et al., 2022, Section 5 and Appendix C.2, "SO Tag"):
client 5,000 x 2,000, server 2,000 x 1,000, d = 2,000, on TFF's Stack
Overflow tag prediction (bag of 5,000 words -> 1,000 tags, multi-label;
metric Keras ``Recall(top_k=5)``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.models import layers, split

Array = jax.Array
Batch = Mapping[str, Array]
Activation = Callable[[Array], Array]

CUT_LAYER = 'dense'
_REDUCTIONS = ('sum', 'mean')


class TagClient(nn.Module):
  """Client part: one dense layer ('dense') and an optional activation.

  Attributes:
    hidden_size: the output size (the cut size d).
    activation: applied to the dense output if not None.
  """
  hidden_size: int = 2000
  activation: Optional[Activation] = None

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    """Maps ``batch['x']`` float [B, num_words] to float32 [B, hidden_size].

    Raises:
      ValueError: if ``batch['x']`` is not of rank 2.
    """
    del train  # No dropout.
    x = batch['x']
    if x.ndim != 2:
      raise ValueError(f"Tag model expects batch['x'] of shape [B, num_words], "
                       f'got {x.shape}.')
    z = nn.Dense(self.hidden_size, name='dense',
                 kernel_init=layers.haiku_linear_init)(x.astype(jnp.float32))
    if self.activation is not None:
      z = self.activation(z)
    return z


class TagServer(nn.Module):
  """Server part: one dense layer ('dense') to the ``num_tags`` logits."""
  num_tags: int = 1000

  @nn.compact
  def __call__(self, activations: Array, batch: Batch, train: bool) -> Array:
    """Maps float32 [B, d] to logits float32 [B, num_tags]."""
    del batch, train
    return nn.Dense(self.num_tags, name='dense',
                    kernel_init=layers.haiku_linear_init)(activations)


def multilabel_loss(labels: Array, logits: Array,
                    reduction: str = 'sum') -> Array:
  """Sigmoid cross-entropy reduced over the last (tag) axis.

  Args:
    labels: float multi-hot [..., num_tags] (values in [0, 1]).
    logits: float [..., num_tags].
    reduction: ``'sum'`` or ``'mean'`` (as Keras ``BinaryCrossentropy``)
      over the tags; they differ by a factor num_tags.

  Returns:
    float32 [...].

  Raises:
    ValueError: if ``reduction`` is not ``'sum'`` or ``'mean'``.
  """
  if reduction not in _REDUCTIONS:
    raise ValueError(f'reduction must be one of {_REDUCTIONS}, got '
                     f'{reduction!r}.')
  per_tag = optax.sigmoid_binary_cross_entropy(logits,
                                               labels.astype(logits.dtype))
  return jnp.sum(per_tag, -1) if reduction == 'sum' else jnp.mean(per_tag, -1)


class _MeanMetric(fedjax.metrics.Metric):
  """A metric whose statistic is a ``MeanStat``, starting at 0 / 0."""

  def zero(self) -> fedjax.metrics.MeanStat:
    return fedjax.metrics.MeanStat.new(0., 0.)


@fedjax.dataclass
class MultiLabelLoss(_MeanMetric):
  """Mean over examples of :func:`multilabel_loss`.

  Attributes:
    reduction: over the tags, ``'sum'`` or ``'mean'``.
    target_key: key of the multi-hot labels in the example.
  """
  reduction: str = 'sum'
  target_key: str = 'y'

  def evaluate_example(self, example: Batch,
                       prediction: Array) -> fedjax.metrics.MeanStat:
    """``example[target_key]``: [num_tags]; ``prediction``: [num_tags]."""
    loss = multilabel_loss(example[self.target_key], prediction,
                           self.reduction)
    return fedjax.metrics.MeanStat.new(loss, 1.)


@fedjax.dataclass
class TopOneTagAccuracy(_MeanMetric):
  """Precision at 1: the top-1 tag is a true tag (0 for an untagged example).

  Attributes:
    target_key: key of the multi-hot labels in the example.
  """
  target_key: str = 'y'

  def evaluate_example(self, example: Batch,
                       prediction: Array) -> fedjax.metrics.MeanStat:
    """``example[target_key]``: [num_tags]; ``prediction``: [num_tags]."""
    labels = example[self.target_key]
    hit = labels[jnp.argmax(prediction, axis=-1)] > 0
    return fedjax.metrics.MeanStat.new(hit.astype(jnp.float32), 1.)


@fedjax.dataclass
class RecallAtK(_MeanMetric):
  """Micro-averaged recall of the top-k tags, as Keras ``Recall(top_k=k)``.

  Sum over examples of ``|topk & true|`` over the sum of ``|true|``.

  Attributes:
    k: the number of top predicted tags.
    target_key: key of the multi-hot labels in the example.
  """
  k: int = 5
  target_key: str = 'y'

  def evaluate_example(self, example: Batch,
                       prediction: Array) -> fedjax.metrics.MeanStat:
    """``example[target_key]``: [num_tags]; ``prediction``: [num_tags]."""
    is_true = example[self.target_key] > 0
    _, top_k = jax.lax.top_k(prediction, self.k)
    hits = jnp.sum(is_true[top_k]).astype(jnp.float32)
    num_true = jnp.sum(is_true, dtype=jnp.float32)
    return fedjax.metrics.MeanStat.new(hits, num_true)


def create_stackoverflow_tag_model(
    num_words: int = 5000,
    num_tags: int = 1000,
    hidden_size: int = 2000,
    activation: Optional[Activation] = None,
    loss_reduction: str = 'sum') -> split.SplitModel:
  """Creates FedLite's Stack Overflow tag-prediction model.

  ``batch['x']`` float32 [B, num_words] -> logits float32 [B, num_tags].
  Both dense layers have biases and Haiku's initializer.

  Args:
    num_words: size of the bag-of-words input.
    num_tags: number of tags (outputs).
    hidden_size: output size of the client's dense layer, the cut size d.
    activation: nonlinearity after the client's dense layer; None (default):
      none (a rank-d logistic regression); ``jax.nn.relu``: an MLP.
    loss_reduction: ``'sum'`` (default) or ``'mean'`` of the per-tag sigmoid
      cross-entropies in the per-example loss (:func:`multilabel_loss`).

  Returns:
    A :class:`~fedlite_jax.models.split.SplitModel` with ``cut_layer =
    'dense'``, ``cut_size = hidden_size`` and eval metrics ``'loss'``,
    ``'accuracy'`` (:class:`TopOneTagAccuracy`), ``'recall_at_5'``.

  Raises:
    ValueError: if a size is not positive, ``num_tags < 5``, or
      ``loss_reduction`` is not ``'sum'`` or ``'mean'``.
  """
  for name, value in (('num_words', num_words), ('num_tags', num_tags),
                      ('hidden_size', hidden_size)):
    if value < 1:
      raise ValueError(f'{name} must be >= 1, got {value}.')
  if num_tags < 5:
    raise ValueError(f'recall_at_5 needs num_tags >= 5, got {num_tags}.')
  if loss_reduction not in _REDUCTIONS:
    raise ValueError(f'loss_reduction must be one of {_REDUCTIONS}, got '
                     f'{loss_reduction!r}.')

  def train_loss(batch: Batch, preds: Array) -> Array:
    return multilabel_loss(batch['y'], preds, loss_reduction)

  return split.build_split_model(
      client=TagClient(hidden_size=hidden_size, activation=activation),
      server=TagServer(num_tags=num_tags),
      sample_batch={'x': np.zeros((1, num_words), np.float32),
                    'y': np.zeros((1, num_tags), np.float32)},
      train_loss=train_loss,
      eval_metrics={'loss': MultiLabelLoss(reduction=loss_reduction),
                    'accuracy': TopOneTagAccuracy(),
                    'recall_at_5': RecallAtK(k=5)},
      cut_layer=CUT_LAYER, cut_size=hidden_size)
