"""CIFG-LSTM and Transformer next-token language models with tied embeddings.

Source: Ro et al., "Scaling Language Model Size in Cross-Device Federated
Learning" (2022), Sec. 3 and Table 1 (architectures), Appendix A (sequence
length 30, 4K SentencePiece vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.models import layers, split
from fedlite_jax.common import PAD_ID

Array = jax.Array
Batch = Mapping[str, Array]

BOS_ID = 1
EOS_ID = 2
DEFAULT_OOV_ID = 3
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_LENGTH = 30
LOSS_REDUCTIONS = ('sequence_sum', 'token_mean')
ARCHITECTURES = ('lstm', 'transformer')


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Architecture of a language model.

  Attributes:
    architecture: 'lstm' (CIFG-LSTM with projection) or 'transformer'.
    embed_size: D, the (tied) embedding size.
    hidden_size: LSTM: H, the cell size; Transformer: F, the MLP size.
    num_layers: LSTM layers (only 1, as Table 1) or Transformer blocks.
    num_heads: Transformer attention heads (must divide D); ignored by LSTM.
  """
  architecture: str
  embed_size: int
  hidden_size: int
  num_layers: int = 1
  num_heads: int = 8

  def validate(self) -> None:
    """Raises ``ValueError`` naming the bad field."""
    if self.architecture not in ARCHITECTURES:
      raise ValueError(f'architecture must be one of {ARCHITECTURES}, got '
                       f'{self.architecture!r}.')
    for name in ('embed_size', 'hidden_size', 'num_layers', 'num_heads'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
    if self.architecture == 'lstm' and self.num_layers != 1:
      raise ValueError(f'The CIFG-LSTM has one layer (Ro et al. Table 1); '
                       f'got num_layers={self.num_layers}.')
    if (self.architecture == 'transformer' and
        self.embed_size % self.num_heads):
      raise ValueError(f'num_heads={self.num_heads} must divide '
                       f'embed_size={self.embed_size}.')


PRESETS: dict[str, LMConfig] = {
    # Ro et al. 2022, Table 1.
    'lstm_small': LMConfig('lstm', 256, 2048, 1),
    'lstm_large': LMConfig('lstm', 1024, 2048, 1),
    'transformer_small': LMConfig('transformer', 128, 2048, 6, 8),
    'transformer_large': LMConfig('transformer', 512, 2048, 6, 8),
    # Smaller presets for CPU experiments (not in the paper).
    'lstm_tiny': LMConfig('lstm', 64, 256, 1),
    'transformer_tiny': LMConfig('transformer', 64, 256, 2, 4),
}
"""``--model`` values. Table 1 sizes plus two CPU-sized presets."""

PAPER_PARAM_COUNTS = {'lstm_small': 4.7e6, 'lstm_large': 18.8e6,
                      'transformer_small': 4.1e6, 'transformer_large': 21.0e6}
"""Ro et al. 2022, Table 1 (# Parameters)."""


def _embed_init(embed_size: int):
  """Truncated normal (2 std), std ``1/sqrt(D)``: tied logits start at O(1)."""
  std = 1.0 / math.sqrt(embed_size)
  return lambda key, shape, dtype=jnp.float32: (
      jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) * std)


class CIFGLSTM(nn.Module):
  """One CIFG-LSTM layer with an output projection (no peepholes).

  Coupled input and forget gate (Greff et al. 2017, "LSTM: A Search Space
  Odyssey", Sec. 2; keyboard LMs: Hard et al. 2018); ``p_0 = c_0 = 0``::

    [a_i, a_g, a_o] = [x_t, p_{t-1}] @ kernel + bias  # [in + P, 3H], [3H]
    i_t = sigmoid(a_i - 1);  f_t = 1 - i_t  # -1: a forget-gate bias of +1
    c_t = f_t * c_{t-1} + i_t * tanh(a_g)
    h_t = sigmoid(a_o) * tanh(c_t);  p_t = h_t @ projection  # [H, P]

  Attributes:
    hidden_size, projection_size: H, P.
    unroll: ``unroll`` of the time scan (speed only).
    dtype: the matmuls' dtype (None: float32); the cell state and outputs
      stay float32.
  """
  hidden_size: int
  projection_size: int
  unroll: int = 1
  dtype: Any = None

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Maps float [B, T, in] to the projected outputs float32 [B, T, P]."""
    batch, _, in_size = inputs.shape
    hidden, proj = self.hidden_size, self.projection_size
    kernel = self.param('kernel', layers.haiku_linear_init,
                        (in_size + proj, 3 * hidden), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros_init(), (3 * hidden,),
                      jnp.float32)
    w_proj = self.param('projection', layers.haiku_linear_init,
                        (hidden, proj), jnp.float32)
    w_x, w_p = kernel[:in_size], kernel[in_size:]
    if self.dtype is None:
      mm = jnp.matmul
    else:  # Mixed precision: products in dtype, accumulated state float32.
      mm = lambda a, w: jnp.matmul(a.astype(self.dtype), w.astype(
          self.dtype)).astype(jnp.float32)
    gates_x = jnp.swapaxes(mm(inputs, w_x) + bias, 0, 1)  # [T, B, 3H]

    def step(carry, gx):
      p, c = carry
      a_i, a_g, a_o = jnp.split(gx + mm(p, w_p), 3, axis=-1)
      i = jax.nn.sigmoid(a_i - 1.0)
      c = (1.0 - i) * c + i * jnp.tanh(a_g)
      h = jax.nn.sigmoid(a_o) * jnp.tanh(c)
      p = mm(h, w_proj)
      return (p, c), p

    carry = (jnp.zeros((batch, proj), jnp.float32),
             jnp.zeros((batch, hidden), jnp.float32))
    _, ps = jax.lax.scan(step, carry, gates_x, unroll=self.unroll)
    return jnp.swapaxes(ps, 0, 1)


class CIFGLSTMLM(nn.Module):
  """Embedding E [V, D] -> CIFG-LSTM (P = D) -> ``p_t @ E^T + output_bias``.

  Attributes:
    vocab_size, embed_size, hidden_size: V, D (= P), H.
    unroll: time-scan unroll (speed only).
    dtype: the computation dtype (None: float32); logits are float32.
  """
  vocab_size: int
  embed_size: int
  hidden_size: int
  unroll: int = 1
  dtype: Any = None

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    del train  # No dropout.
    x = _check_tokens(batch)
    embed = nn.Embed(self.vocab_size, self.embed_size, dtype=self.dtype,
                     embedding_init=_embed_init(self.embed_size), name='embed')
    z = CIFGLSTM(self.hidden_size, self.embed_size, unroll=self.unroll,
                 dtype=self.dtype, name='lstm')(embed(x))
    out_bias = self.param('output_bias', nn.initializers.zeros_init(),
                          (self.vocab_size,), jnp.float32)
    return embed.attend(z).astype(jnp.float32) + out_bias


class CausalSelfAttention(nn.Module):
  """Causal self-attention, ``num_heads`` heads; [D, D] q/k/v/out kernels;
  ``dtype``: the computation dtype (None: float32; softmax in float32)."""
  num_heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, z: Array) -> Array:
    """float [B, T, D] -> float32 [B, T, D]; position t sees 0..t only."""
    b, t, d = z.shape
    hd = d // self.num_heads
    dense = lambda name: nn.Dense(d, kernel_init=layers.haiku_linear_init,
                                  dtype=self.dtype, name=name)
    split_heads = lambda a: a.reshape(b, t, self.num_heads, hd)
    q = split_heads(dense('query')(z))
    k = split_heads(dense('key')(z))
    v = split_heads(dense('value')(z))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    if self.dtype is None:
      weights = jax.nn.softmax(logits, axis=-1)
    else:
      weights = jax.nn.softmax(logits.astype(jnp.float32),
                               axis=-1).astype(v.dtype)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(b, t, d)
    return dense('out')(out)


class TransformerBlock(nn.Module):
  """Pre-LN block: ``z + Attn(LN(z))``, then ``z + MLP(LN(z))``.

  MLP: Dense(D -> mlp_size), GELU, Dense(mlp_size -> D). ``dtype``: the
  computation dtype (None: float32).
  """
  mlp_size: int
  num_heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, z: Array) -> Array:
    d = z.shape[-1]
    dt = self.dtype
    z = z + CausalSelfAttention(self.num_heads, dtype=dt, name='attention')(
        nn.LayerNorm(dtype=dt, name='ln_attention')(z))
    h = nn.LayerNorm(dtype=dt, name='ln_mlp')(z)
    h = nn.Dense(self.mlp_size, kernel_init=layers.haiku_linear_init,
                 dtype=dt, name='mlp_in')(h)
    h = nn.Dense(d, kernel_init=layers.haiku_linear_init, dtype=dt,
                 name='mlp_out')(jax.nn.gelu(h))
    return z + h


class TransformerLM(nn.Module):
  """Causal pre-LN Transformer (Vaswani et al. 2017) with tied embeddings::

    z = sqrt(D) * E[x] + pos_embedding[:T]
    z = z + Attn(LN(z));  z = z + MLP(LN(z))     (num_layers blocks)
    logits = LN_f(z) @ E^T + output_bias

  No dropout. Kernels: Haiku's init (:mod:`fedlite_jax.models.layers`).

  Attributes:
    vocab_size, embed_size, mlp_size: V, D, F.
    num_layers, num_heads: blocks, attention heads.
    max_length: positions with a learned embedding (T <= max_length).
    dtype: the computation dtype (None: float32); parameters and logits
      are float32.
  """
  vocab_size: int
  embed_size: int
  mlp_size: int
  num_layers: int
  num_heads: int
  max_length: int = DEFAULT_MAX_LENGTH
  dtype: Any = None

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    del train  # No dropout.
    x = _check_tokens(batch)
    if x.shape[1] > self.max_length:
      raise ValueError(f'Sequence length {x.shape[1]} exceeds max_length='
                       f'{self.max_length} of the Transformer.')
    d = self.embed_size
    dt = self.dtype
    embed = nn.Embed(self.vocab_size, d, embedding_init=_embed_init(d),
                     dtype=dt, name='embed')
    pos = self.param('pos_embedding', _embed_init(d), (self.max_length, d),
                     jnp.float32)
    z = embed(x) * math.sqrt(d) + pos[:x.shape[1]]
    if dt is not None:
      z = z.astype(dt)
    for k in range(self.num_layers):
      z = TransformerBlock(self.mlp_size, self.num_heads, dtype=dt,
                           name=f'block_{k}')(z)
    z = nn.LayerNorm(dtype=dt, name='ln_final')(z)
    out_bias = self.param('output_bias', nn.initializers.zeros_init(),
                          (self.vocab_size,), jnp.float32)
    return embed.attend(z).astype(jnp.float32) + out_bias


def _check_tokens(batch: Batch) -> Array:
  """``batch['x']``, checked to be int [B, T]."""
  x = batch['x']
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"Language models expect integer batch['x'] of shape "
                     f'[B, T], got {x.dtype} {x.shape}.')
  return x


def sequence_loss(batch: Batch, preds: Array,
                  reduction: str = 'sequence_sum') -> Array:
  """Per-sequence training loss over non-PAD targets.

  Args:
    batch: ``batch['y']`` int [B, T] targets; PAD (0) targets are ignored.
    preds: logits float32 [B, T, V].
    reduction: 'sequence_sum' (sum of token cross-entropies, FedJAX's:
      ``fedjax.model_grad`` then averages over sequences) or 'token_mean'
      (their mean; 0 for an all-PAD sequence).

  Returns:
    float32 [B].

  Raises:
    ValueError: an unknown reduction.
  """
  if reduction not in LOSS_REDUCTIONS:
    raise ValueError(f'loss reduction must be one of {LOSS_REDUCTIONS}, got '
                     f'{reduction!r}.')
  targets = batch['y'].astype(jnp.int32)
  mask = targets != PAD_ID
  token_loss = optax.softmax_cross_entropy_with_integer_labels(preds, targets)
  total = jnp.sum(jnp.where(mask, token_loss, 0.0), axis=-1)
  if reduction == 'token_mean':
    total = total / jnp.maximum(jnp.sum(mask, axis=-1), 1)
  return total


def lm_eval_metrics(oov_id: int = DEFAULT_OOV_ID
                    ) -> dict[str, fedjax.metrics.Metric]:
  """Eval metrics over non-PAD targets, keyed by name.

  ``'loss'``: mean token cross-entropy (perplexity = exp(loss));
  ``'accuracy'``: argmax token accuracy counting only targets that are not
  PAD, EOS or ``oov_id``; also ``accuracy_no_eos``, ``num_tokens``,
  ``token_oov_rate``, ``sequence_loss``.
  """
  m = fedjax.metrics
  pad, eos = PAD_ID, EOS_ID
  return {
      'loss': m.SequenceTokenCrossEntropyLoss(masked_target_values=(pad,)),
      'accuracy': m.SequenceTokenAccuracy(
          masked_target_values=(pad, eos, oov_id)),
      'accuracy_no_eos': m.SequenceTokenAccuracy(
          masked_target_values=(pad, eos)),
      'num_tokens': m.SequenceTokenCount(masked_target_values=(pad,)),
      'token_oov_rate': m.SequenceTokenOOVRate(
          oov_target_values=(oov_id,), masked_target_values=(pad,)),
      'sequence_loss': m.SequenceCrossEntropyLoss(masked_target_values=(pad,)),
  }


def resolve_config(model: str | LMConfig) -> LMConfig:
  """A preset name or an :class:`LMConfig`, validated.

  Raises:
    ValueError: an unknown preset (naming the allowed ones) or a bad config.
  """
  if isinstance(model, str):
    if model not in PRESETS:
      raise ValueError(f'Unknown language model {model!r}; presets: '
                       f'{", ".join(PRESETS)}.')
    model = PRESETS[model]
  model.validate()
  return model


def build_module(model: str | LMConfig, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 max_length: int = DEFAULT_MAX_LENGTH,
                 lstm_unroll: int = 1, dtype: Any = None) -> nn.Module:
  """The Flax module of a preset / config (called as ``net(batch, train)``);
  ``dtype``: its computation dtype (None: float32).

  Raises:
    ValueError: bad preset, config, vocab_size or max_length.
  """
  cfg = resolve_config(model)
  for name, value in (('vocab_size', vocab_size), ('max_length', max_length),
                      ('lstm_unroll', lstm_unroll)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
        or value < 1:
      raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
  if cfg.architecture == 'lstm':
    return CIFGLSTMLM(int(vocab_size), cfg.embed_size, cfg.hidden_size,
                      unroll=int(lstm_unroll), dtype=dtype)
  return TransformerLM(int(vocab_size), cfg.embed_size, cfg.hidden_size,
                       cfg.num_layers, cfg.num_heads, int(max_length),
                       dtype=dtype)


def _sample_batch(max_length: int) -> dict[str, np.ndarray]:
  """Zeros int32 [1, max_length] for ``init``."""
  return {'x': np.zeros((1, max_length), np.int32),
          'y': np.zeros((1, max_length), np.int32)}


def param_shapes(model: str | LMConfig, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 max_length: int = DEFAULT_MAX_LENGTH) -> Any:
  """Parameter pytree of ``jax.ShapeDtypeStruct`` (nothing materialized)."""
  net = build_module(model, vocab_size, max_length)
  return jax.eval_shape(
      lambda k: net.init({'params': k}, _sample_batch(max_length),
                         train=False)['params'], jax.random.PRNGKey(0))


def count_params(model: str | LMConfig, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 max_length: int = DEFAULT_MAX_LENGTH) -> int:
  """Number of scalar parameters (Ro et al. 2022, Table 1: within 1%).

  LSTM: ``V D + (D + P) 3H + 3H + H P + V``; Transformer: ``V D + T D +
  L (4 (D^2 + D) + 2 D F + F + D + 4 D) + 2 D + V``.
  """
  return int(sum(math.prod(s.shape) for s in
                 jax.tree.leaves(param_shapes(model, vocab_size, max_length))))


def _no_split(*unused_args, **unused_kwargs):
  """Raises ``NotImplementedError``: tied embeddings cross any cut."""
  raise NotImplementedError(
      'The CIFG-LSTM / Transformer language models tie the input and output '
      'embeddings, so they have no client/server split; use them with '
      'FedAvg-style algorithms only.')


def create_lm(model: str | LMConfig = 'transformer_small',
              vocab_size: int = DEFAULT_VOCAB_SIZE, *,
              max_length: int = DEFAULT_MAX_LENGTH,
              oov_id: int = DEFAULT_OOV_ID,
              loss_reduction: str = 'sequence_sum', lstm_unroll: int = 1,
              compute_dtype: Any = None) -> split.SplitModel:
  """Builds a language model as a ``fedjax.Model`` (in a SplitModel shell).

  ``batch['x']``, ``batch['y']``: int [B, T] token ids, T <= max_length (PAD
  0, BOS 1, EOS 2, OOV 3 in :mod:`fedlite_jax.datasets.sentencepiece_vocab`);
  predictions: logits float32 [B, T, vocab_size].

  Args:
    model: a preset name (:data:`PRESETS`) or an :class:`LMConfig`.
    vocab_size: V, the number of token ids, e.g. 4,096 (SentencePiece) or
      ``info.num_classes`` of any text task.
    max_length: the longest sequence (Transformer position embeddings).
    oov_id: the OOV id excluded from 'accuracy' (``info.oov_id`` for words).
    loss_reduction: 'sequence_sum' or 'token_mean' (:func:`sequence_loss`).
    lstm_unroll: LSTM time-scan unroll (speed only).
    compute_dtype: e.g. ``jnp.bfloat16`` for mixed precision (parameters,
      logits and losses stay float32); None: float32.

  Returns:
    A :class:`~fedlite_jax.models.split.SplitModel` whose ``.model`` is the
    jitted ``fedjax.Model`` (metrics :func:`lm_eval_metrics`);
    ``cut_layer='none'``, ``cut_size=0``; ``client_apply`` and
    ``server_apply`` raise ``NotImplementedError`` (tied embeddings).

  Raises:
    ValueError: an unknown preset, bad sizes, oov_id outside [0, V) or an
      unknown loss_reduction.
  """
  net = build_module(model, vocab_size, max_length, lstm_unroll,
                     compute_dtype)
  if not 0 <= oov_id < vocab_size:
    raise ValueError(
        f'oov_id={oov_id} must be in [0, vocab_size={vocab_size}).')
  if loss_reduction not in LOSS_REDUCTIONS:
    raise ValueError(f'loss_reduction must be one of {LOSS_REDUCTIONS}, got '
                     f'{loss_reduction!r}.')
  sample = _sample_batch(max_length)
  apply = lambda params, batch, train: net.apply({'params': params}, batch,
                                                 train=train)
  fj_model = fedjax.Model(
      init=jax.jit(lambda rng: net.init({'params': rng}, sample,
                                        train=False)['params']),
      # No dropout: the rng is unused.
      apply_for_train=jax.jit(lambda p, b, rng=None: apply(p, b, True)),
      apply_for_eval=jax.jit(lambda p, b: apply(p, b, False)),
      train_loss=functools.partial(sequence_loss, reduction=loss_reduction),
      eval_metrics=lm_eval_metrics(oov_id))
  return split.SplitModel(model=fj_model, cut_layer='none', cut_size=0,
                          client_apply=_no_split, server_apply=_no_split,
                          module=net)
