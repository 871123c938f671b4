"""The Stack Overflow next-word-prediction LSTM, split before the output layer.

Source: Reddi et al., 2020, "Adaptive Federated Optimization" (Stack Overflow
NWP), as FedJAX's ``fedjax.models.stackoverflow.create_lstm_model``; split as
in FedLite (Wang et al., 2022, Appendix C.2): client "Embedding + LSTM +
Dense", server "Dense". Token ids (FedJAX's): PAD 0, BOS 1, EOS 2, words 3 ..
vocab_size + 2, OOV vocab_size + 3.
"""

from __future__ import annotations

from typing import Mapping, Optional

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.models import layers, lm, split
from fedlite_jax.common import PAD_ID

Array = jax.Array
Batch = Mapping[str, Array]

BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL_TOKENS = 4  # PAD, BOS, EOS, OOV.
CUT_LAYER = 'projection'
# The model's sizes in FedJAX's create_lstm_model (Reddi et al., 2020).
DEFAULT_VOCAB_SIZE = 10000
DEFAULT_EMBED_SIZE = 96
DEFAULT_LSTM_HIDDEN_SIZE = 670


def oov_id(vocab_size: int) -> int:
  """The OOV token id for a vocabulary of ``vocab_size`` words."""
  return vocab_size + 3


def full_vocab_size(vocab_size: int) -> int:
  """The number of output classes: words plus PAD, BOS, EOS and OOV."""
  return vocab_size + NUM_SPECIAL_TOKENS


class StackOverflowClient(nn.Module):
  """Client: embedding, then ``lstm_num_layers`` x (LSTM, tanh, projection).

  Attributes: the arguments of :func:`create_stackoverflow_lstm`.
  """
  vocab_size: int = DEFAULT_VOCAB_SIZE
  embed_size: int = DEFAULT_EMBED_SIZE
  lstm_hidden_size: int = DEFAULT_LSTM_HIDDEN_SIZE
  lstm_num_layers: int = 1
  projection_size: int = DEFAULT_EMBED_SIZE
  lstm_unroll: int = 1

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    """Maps token ids ``batch['x']`` int [B, T] to float32 [B, T, d].

    Raises:
      ValueError: if ``batch['x']`` is not an integer array of rank 2.
    """
    del train  # No dropout.
    x = batch['x']
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"Stack Overflow LSTM expects integer batch['x'] of "
                       f'shape [B, T], got {x.dtype} {x.shape}.')
    z = nn.Embed(full_vocab_size(self.vocab_size), self.embed_size,
                 embedding_init=layers.haiku_embed_init, name='embed')(x)
    for k in range(self.lstm_num_layers):
      z = layers.LSTM(self.lstm_hidden_size, unroll=self.lstm_unroll,
                      name=f'lstm_{k}')(z)
      z = jnp.tanh(z)
      z = nn.Dense(self.projection_size, kernel_init=layers.haiku_linear_init,
                   name=f'projection_{k}')(z)
    return z


class StackOverflowServer(nn.Module):
  """Server part: one dense layer to the ``vocab_size + 4`` outputs."""
  vocab_size: int = DEFAULT_VOCAB_SIZE

  @nn.compact
  def __call__(self, activations: Array, batch: Batch, train: bool) -> Array:
    """Maps float32 [B, T, d] to logits float32 [B, T, vocab_size + 4]."""
    del batch, train
    return nn.Dense(full_vocab_size(self.vocab_size), name='logits',
                    kernel_init=layers.haiku_linear_init)(activations)


def sequence_train_loss(batch: Batch, preds: Array,
                        expected_length: Optional[float] = None) -> Array:
  """FedJAX's per-sequence loss: summed token cross-entropy, PAD excluded.

  :func:`fedlite_jax.models.lm.sequence_loss`, optionally scaled.

  Args:
    batch: ``batch['y']``: int target ids [B, T]; PAD (0) targets are ignored.
    preds: logits float32 [B, T, V].
    expected_length: if given, the sums are multiplied by ``1 /
      expected_length`` (FedJAX's option).

  Returns:
    float32 [B]: one loss per sequence.
  """
  sentence_loss = lm.sequence_loss(batch, preds, 'sequence_sum')
  if expected_length is not None:
    sentence_loss = sentence_loss * (1.0 / expected_length)
  return sentence_loss


def eval_metrics(vocab_size: int) -> dict[str, fedjax.metrics.Metric]:
  """FedJAX's NWP eval metrics plus ``'loss'`` and ``'accuracy'``, by name.

  ``'loss'``: mean token cross-entropy over non-PAD targets (= ``token_loss``;
  perplexity = exp(loss)). ``'accuracy'``: argmax accuracy over all
  ``vocab_size + 4`` outputs, counting only targets that are not PAD, EOS or
  OOV (TFF's ``accuracy_no_oov_no_eos``).
  """
  pad, eos, oov = PAD_ID, EOS_ID, oov_id(vocab_size)
  logits_mask = tuple(-np.inf if i in (PAD_ID, BOS_ID, EOS_ID, oov) else 0.0
                      for i in range(full_vocab_size(vocab_size)))
  m = fedjax.metrics
  return {
      'loss': m.SequenceTokenCrossEntropyLoss(masked_target_values=(pad,)),
      'accuracy': m.SequenceTokenAccuracy(masked_target_values=(pad, eos, oov)),
      # FedJAX's create_lstm_model metrics, unchanged.
      'accuracy_in_vocab': m.SequenceTokenAccuracy(
          masked_target_values=(pad, eos), logits_mask=logits_mask),
      'accuracy_no_eos': m.SequenceTokenAccuracy(
          masked_target_values=(pad, eos)),
      'num_tokens': m.SequenceTokenCount(masked_target_values=(pad,)),
      'sequence_length': m.SequenceLength(masked_target_values=(pad,)),
      'sequence_loss': m.SequenceCrossEntropyLoss(masked_target_values=(pad,)),
      'token_loss': m.SequenceTokenCrossEntropyLoss(
          masked_target_values=(pad,)),
      'token_oov_rate': m.SequenceTokenOOVRate(
          oov_target_values=(oov,), masked_target_values=(pad,)),
      'truncation_rate': m.SequenceTruncationRate(
          eos_target_value=eos, masked_target_values=(pad,)),
  }


def create_stackoverflow_lstm(vocab_size: int = DEFAULT_VOCAB_SIZE,
                              embed_size: int = DEFAULT_EMBED_SIZE,
                              lstm_hidden_size: int = DEFAULT_LSTM_HIDDEN_SIZE,
                              lstm_num_layers: int = 1,
                              projection_size: Optional[int] = None,
                              expected_length: Optional[float] = None,
                              lstm_unroll: int = 1) -> split.SplitModel:
  """Creates the Stack Overflow NWP LSTM, split after the projection.

  ``batch['x']`` int32 [B, T] -> logits float32 [B, T, vocab_size + 4].
  Defaults (10,000 words, 96, 670, 1 layer): client 3,080,360 parameters
  ('embed', 'lstm_0', 'projection_0'), server 970,388 ('logits'), total
  4,050,748 = FedJAX's model (without ``share_input_output_embeddings``).

  Args:
    vocab_size: number of words, without PAD, BOS, EOS and OOV.
    embed_size: input embedding size.
    lstm_hidden_size: LSTM state size.
    lstm_num_layers: number of (LSTM, tanh, projection) blocks.
    projection_size: output size of the projections, the cut size d
      (default: ``embed_size``, as FedJAX).
    expected_length: see :func:`sequence_train_loss`.
    lstm_unroll: ``unroll`` of the scan over time steps (speed only).

  Returns:
    A :class:`~fedlite_jax.models.split.SplitModel` with ``cut_layer =
    'projection'``, ``cut_size = projection_size`` (activations [B, T, d]).

  Raises:
    ValueError: if a size is not positive.
  """
  projection_size = embed_size if projection_size is None else projection_size
  for name, value in (('vocab_size', vocab_size), ('embed_size', embed_size),
                      ('lstm_hidden_size', lstm_hidden_size),
                      ('lstm_num_layers', lstm_num_layers),
                      ('projection_size', projection_size),
                      ('lstm_unroll', lstm_unroll)):
    if value < 1:
      raise ValueError(f'{name} must be >= 1, got {value}.')
  if expected_length is not None and expected_length <= 0:
    raise ValueError(f'expected_length must be > 0, got {expected_length}.')

  def train_loss(batch: Batch, preds: Array) -> Array:
    return sequence_train_loss(batch, preds, expected_length)

  return split.build_split_model(
      client=StackOverflowClient(
          vocab_size=vocab_size, embed_size=embed_size,
          lstm_hidden_size=lstm_hidden_size, lstm_num_layers=lstm_num_layers,
          projection_size=projection_size, lstm_unroll=lstm_unroll),
      server=StackOverflowServer(vocab_size=vocab_size),
      sample_batch={'x': np.zeros((1, 1), np.int32),
                    'y': np.zeros((1, 1), np.int32)},
      train_loss=train_loss, eval_metrics=eval_metrics(vocab_size),
      cut_layer=CUT_LAYER, cut_size=projection_size)
