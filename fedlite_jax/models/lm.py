"""CIFG-LSTM and Transformer next-token language models (Ro et al. 2022).

Source: Ro, Breiner, McConnaughey, Chen, Suresh, Kumar, Mathews, "Scaling
Language Model Size in Cross-Device Federated Learning" (2022), Section 3 and
Table 1 (architectures), Appendix A (sequence length 30, vocabulary 4K
SentencePiece). The LSTM is a CIFG-LSTM (coupled input and forget gate;
Greff et al. 2017, "LSTM: A Search Space Odyssey", Sec. 2 variant CIFG; used
for federated keyboard LMs by Hard et al. 2018) with a projection layer and
input/output embeddings tied; the Transformer is a causal decoder (Vaswani et
al. 2017) with tied embeddings.

Inputs / outputs: ``batch['x']`` int [B, T] token ids (PAD 0, BOS 1, EOS 2,
OOV/UNK 3 as in :mod:`fedlite_jax.datasets.sentencepiece_vocab`; the ids of
the word pipeline work too, with ``oov_id`` passed explicitly), ``T <=
max_length``; predictions: logits float32 [B, T, vocab_size].

CIFG-LSTM (one layer; parameters under ``'lstm'``)::

  e_t = E[x_t]                                 E: [V, D] 'embed/embedding'
  [a_i, a_g, a_o] = [e_t, p_{t-1}] @ W + b     W: [D + P, 3H] 'lstm/kernel'
  i_t = sigmoid(a_i - 1);  f_t = 1 - i_t       (coupled input-forget gate)
  c_t = f_t * c_{t-1} + i_t * tanh(a_g)
  h_t = sigmoid(a_o) * tanh(c_t)
  p_t = h_t @ W_p                              W_p: [H, P] 'lstm/projection'
  logits_t = p_t @ E^T + b_out                 b_out: [V] 'output_bias'

with ``P = D`` (the projection maps back to the embedding size so the output
layer can reuse ``E``), ``p_0 = c_0 = 0``. The ``- 1`` on the input gate is
the CIFG form of Haiku's/Keras' forget-gate bias of +1 (``f_t = 1 - i_t``
starts mostly open). No peepholes.

Transformer (pre-LayerNorm, causal; parameters under ``'block_k'``)::

  z_0 = sqrt(D) * E[x] + P_pos[:T]             P_pos: [max_length, D]
  z = z + Attn(LN_1(z));  z = z + MLP(LN_2(z))   (num_layers blocks)
  logits = LN_f(z) @ E^T + b_out

``Attn``: ``num_heads`` heads, separate [D, D] query/key/value/out kernels
with biases, causal mask; ``MLP``: Dense(D -> F), GELU, Dense(F -> D). We
chose pre-LN (as GPT-2; it trains without warm-up at the client learning
rates of Table 3) and 8 heads (Ro et al. do not give the head count; it does
not change the parameter count). No dropout (none is mentioned).

Initialization: embeddings truncated normal (2 std) with std ``1/sqrt(D)``
(so that tied logits start at O(1)); kernels Haiku's truncated normal with
``1/sqrt(fan_in)`` (:mod:`fedlite_jax.models.layers`); biases 0; LayerNorm
scale 1.

Parameter counts (``V = 4,096`` ids, ``max_length = 30``; from
:func:`count_params`, also checked by ``tests/test_lm_models.py``):

================== ============ =========== ====== ====== === ==========
preset             ours         paper       D      H / F  L   ours/paper
================== ============ =========== ====== ====== === ==========
lstm_small          4,728,832    4.7M        256    2,048  1   +0.6%
lstm_large         18,884,608    18.8M       1,024  2,048  1   +0.4%
transformer_small   4,090,624    4.1M        128    2,048  6   -0.2%
transformer_large  21,031,936    21.0M       512    2,048  6   +0.2%
================== ============ =========== ====== ====== === ==========

LSTM: ``V D`` (embedding, shared with the output layer) + ``(D + P) 3H +
3H`` (CIFG: 3 gate blocks instead of the LSTM's 4) + ``H P`` (projection) +
``V`` (output bias). Why this reading of Table 1: with D 256, H 2,048 and
V 4,096, a 4-gate LSTM with projection and tying has 5,779,456 parameters,
a CIFG with projection but an untied [P, V] output layer 5,777,408, and a
CIFG without projection (recurrence on the 2,048-wide h, [H, V] output
layer) 23.6M; only the CIFG with a projection back to D and tied embeddings
gives 4.7M (and 18.9M for D 1,024, where the alternatives give 23.1M /
23.1M / 31.5M). The
remaining +0.4..0.6% (about 0.03M / 0.08M) is within the paper's rounding
to one decimal plus details it does not give (biases, output bias 4,096,
exact vocabulary size). Transformer: ``V D + T D`` (token and position
embeddings) + per block ``4 (D^2 + D)`` (attention) + ``2 D F + F + D``
(MLP) + ``4 D`` (two LayerNorms) + ``2 D`` (final LayerNorm) + ``V``
(output bias); within 0.2% of the paper's counts.

Presets beyond Table 1: ``lstm_tiny`` (D 64, H 256) and ``transformer_tiny``
(D 64, F 256, 2 blocks, 4 heads) for CPU-sized experiments.

Loss: ``loss_reduction='sequence_sum'`` (default; FedJAX's StackOverflow
convention: per-sequence sum of token cross-entropies over non-PAD targets,
so ``fedjax.model_grad`` averages over sequences) or ``'token_mean'`` (the
per-sequence mean over its non-PAD targets).

Eval metrics: ``'loss'`` = mean token cross-entropy over non-PAD targets
(so perplexity = exp(loss); the runner adds 'perplexity'), ``'accuracy'`` =
token accuracy of the argmax over all ids counting only targets that are not
PAD, EOS or OOV, plus ``accuracy_no_eos``, ``num_tokens``,
``token_oov_rate``, ``sequence_loss``.

The models are exposed as ``fedjax.Model`` inside a
:class:`~fedlite_jax.models.split.SplitModel` whose split functions raise
``NotImplementedError``: with tied embeddings the only cut would share one
parameter between the client and the server part, so the models are not
offered for split learning (``cut_layer='none'``, ``cut_size=0``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import fedjax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlite_jax.models import layers
from fedlite_jax.models import split
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
    num_layers: LSTM layers (only 1 supported, as Table 1) or Transformer
      blocks.
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

PAPER_PARAM_COUNTS = {
    'lstm_small': 4.7e6,
    'lstm_large': 18.8e6,
    'transformer_small': 4.1e6,
    'transformer_large': 21.0e6,
}
"""Ro et al. 2022, Table 1 (# Parameters)."""


def _embed_init(embed_size: int):

  def init(key, shape, dtype=jnp.float32):
    std = 1.0 / math.sqrt(embed_size)
    return jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype) * std

  return init


class CIFGLSTM(nn.Module):
  """One CIFG-LSTM layer with an output projection (see module docstring).

  Parameters: ``kernel`` float32 [in + P, 3H] (rows for the input, then for
  the previous projected output; columns input gate, candidate, output gate),
  ``bias`` float32 [3H], ``projection`` float32 [H, P].

  Attributes:
    hidden_size: H.
    projection_size: P.
    unroll: ``unroll`` of the time scan (speed only).
  """
  hidden_size: int
  projection_size: int
  unroll: int = 1

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
    gates_x = jnp.swapaxes(inputs @ w_x + bias, 0, 1)  # [T, B, 3H]

    def step(carry, gx):
      p, c = carry
      a_i, a_g, a_o = jnp.split(gx + p @ w_p, 3, axis=-1)
      i = jax.nn.sigmoid(a_i - 1.0)
      c = (1.0 - i) * c + i * jnp.tanh(a_g)
      h = jax.nn.sigmoid(a_o) * jnp.tanh(c)
      p = h @ w_proj
      return (p, c), p

    carry = (jnp.zeros((batch, proj), jnp.float32),
             jnp.zeros((batch, hidden), jnp.float32))
    _, ps = jax.lax.scan(step, carry, gates_x, unroll=self.unroll)
    return jnp.swapaxes(ps, 0, 1)


class CIFGLSTMLM(nn.Module):
  """Embedding -> CIFG-LSTM with projection -> tied output layer.

  Attributes:
    vocab_size: V (output size).
    embed_size: D (= projection size P).
    hidden_size: H.
    unroll: time-scan unroll (speed only).
  """
  vocab_size: int
  embed_size: int
  hidden_size: int
  unroll: int = 1

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    del train  # No dropout.
    x = _check_tokens(batch)
    embed = nn.Embed(self.vocab_size, self.embed_size,
                     embedding_init=_embed_init(self.embed_size), name='embed')
    z = CIFGLSTM(self.hidden_size, self.embed_size, unroll=self.unroll,
                 name='lstm')(embed(x))
    out_bias = self.param('output_bias', nn.initializers.zeros_init(),
                          (self.vocab_size,), jnp.float32)
    return embed.attend(z) + out_bias


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention with [D, D] q/k/v/out kernels.

  Attributes:
    num_heads: number of heads (divides D).
  """
  num_heads: int

  @nn.compact
  def __call__(self, z: Array) -> Array:
    """float [B, T, D] -> float32 [B, T, D]; position t sees 0..t only."""
    b, t, d = z.shape
    hd = d // self.num_heads
    dense = lambda name: nn.Dense(d, kernel_init=layers.haiku_linear_init,
                                  name=name)
    split_heads = lambda a: a.reshape(b, t, self.num_heads, hd)
    q = split_heads(dense('query')(z))
    k = split_heads(dense('key')(z))
    v = split_heads(dense('value')(z))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(b, t, d)
    return dense('out')(out)


class TransformerBlock(nn.Module):
  """Pre-LN block: ``z + Attn(LN(z))``, then ``z + MLP(LN(z))``.

  Attributes:
    mlp_size: F.
    num_heads: attention heads.
  """
  mlp_size: int
  num_heads: int

  @nn.compact
  def __call__(self, z: Array) -> Array:
    d = z.shape[-1]
    z = z + CausalSelfAttention(self.num_heads, name='attention')(
        nn.LayerNorm(name='ln_attention')(z))
    h = nn.LayerNorm(name='ln_mlp')(z)
    h = nn.Dense(self.mlp_size, kernel_init=layers.haiku_linear_init,
                 name='mlp_in')(h)
    h = nn.Dense(d, kernel_init=layers.haiku_linear_init,
                 name='mlp_out')(jax.nn.gelu(h))
    return z + h


class TransformerLM(nn.Module):
  """Causal pre-LN Transformer with tied embeddings (module docstring).

  Attributes:
    vocab_size: V.
    embed_size: D.
    mlp_size: F.
    num_layers: blocks.
    num_heads: attention heads.
    max_length: positions with a learned embedding (T <= max_length).
  """
  vocab_size: int
  embed_size: int
  mlp_size: int
  num_layers: int
  num_heads: int
  max_length: int = DEFAULT_MAX_LENGTH

  @nn.compact
  def __call__(self, batch: Batch, train: bool) -> Array:
    del train  # No dropout.
    x = _check_tokens(batch)
    if x.shape[1] > self.max_length:
      raise ValueError(f'Sequence length {x.shape[1]} exceeds max_length='
                       f'{self.max_length} of the Transformer.')
    d = self.embed_size
    embed = nn.Embed(self.vocab_size, d, embedding_init=_embed_init(d),
                     name='embed')
    pos = self.param('pos_embedding', _embed_init(d), (self.max_length, d),
                     jnp.float32)
    z = embed(x) * math.sqrt(d) + pos[:x.shape[1]]
    for k in range(self.num_layers):
      z = TransformerBlock(self.mlp_size, self.num_heads, name=f'block_{k}')(z)
    z = nn.LayerNorm(name='ln_final')(z)
    out_bias = self.param('output_bias', nn.initializers.zeros_init(),
                          (self.vocab_size,), jnp.float32)
    return embed.attend(z) + out_bias


def _check_tokens(batch: Batch) -> Array:
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
    reduction: 'sequence_sum' (sum of token cross-entropies, FedJAX's) or
      'token_mean' (their mean over the sequence's non-PAD targets; 0 for an
      all-PAD sequence).

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
  """Perplexity-friendly metrics (module docstring), keyed by name."""
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
                 lstm_unroll: int = 1) -> nn.Module:
  """The Flax module of a preset / config (called as ``net(batch, train)``).

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
                      unroll=int(lstm_unroll))
  return TransformerLM(int(vocab_size), cfg.embed_size, cfg.hidden_size,
                       cfg.num_layers, cfg.num_heads, int(max_length))


def _sample_batch(max_length: int) -> dict[str, np.ndarray]:
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
  """Number of scalar parameters (see the table in the module docstring)."""
  return int(sum(math.prod(s.shape) for s in
                 jax.tree.leaves(param_shapes(model, vocab_size, max_length))))


def _no_split(*args, **kwargs):
  del args, kwargs
  raise NotImplementedError(
      'The CIFG-LSTM / Transformer language models tie the input and output '
      'embeddings, so they have no client/server split; use them with '
      'FedAvg-style algorithms only.')


def create_lm(model: str | LMConfig = 'transformer_small',
              vocab_size: int = DEFAULT_VOCAB_SIZE,
              *,
              max_length: int = DEFAULT_MAX_LENGTH,
              oov_id: int = DEFAULT_OOV_ID,
              loss_reduction: str = 'sequence_sum',
              lstm_unroll: int = 1) -> split.SplitModel:
  """Builds a language model as a ``fedjax.Model`` (in a SplitModel shell).

  Args:
    model: a preset name (:data:`PRESETS`: 'lstm_small', 'lstm_large',
      'transformer_small', 'transformer_large', 'lstm_tiny',
      'transformer_tiny') or an :class:`LMConfig`.
    vocab_size: V, the number of token ids (output size), e.g. 4,096 for the
      SentencePiece pipeline or ``info.num_classes`` of any text task.
    max_length: the longest sequence (Transformer position embeddings).
    oov_id: the OOV/UNK id excluded from 'accuracy' (3 for SentencePiece;
      ``info.oov_id`` for the word pipeline).
    loss_reduction: 'sequence_sum' or 'token_mean' (:func:`sequence_loss`).
    lstm_unroll: LSTM time-scan unroll (speed only).

  Returns:
    A :class:`~fedlite_jax.models.split.SplitModel`: ``.model`` is the
    ``fedjax.Model`` (jitted ``init``, ``apply_for_train``,
    ``apply_for_eval``; ``train_loss`` float32 [B]); ``cut_layer='none'``,
    ``cut_size=0``, and ``client_apply`` / ``server_apply`` raise
    ``NotImplementedError`` (tied embeddings; see the module docstring).

  Raises:
    ValueError: an unknown preset, bad sizes, oov_id outside [0, V) or an
      unknown loss_reduction.
  """
  net = build_module(model, vocab_size, max_length, lstm_unroll)
  if not 0 <= oov_id < vocab_size:
    raise ValueError(
        f'oov_id={oov_id} must be in [0, vocab_size={vocab_size}).')
  if loss_reduction not in LOSS_REDUCTIONS:
    raise ValueError(f'loss_reduction must be one of {LOSS_REDUCTIONS}, got '
                     f'{loss_reduction!r}.')
  sample = _sample_batch(max_length)

  @jax.jit
  def init(rng):
    return net.init({'params': rng}, sample, train=False)['params']

  @jax.jit
  def apply_for_train(params, batch, rng=None):
    del rng  # No dropout.
    return net.apply({'params': params}, batch, train=True)

  @jax.jit
  def apply_for_eval(params, batch):
    return net.apply({'params': params}, batch, train=False)

  def train_loss(batch, preds):
    return sequence_loss(batch, preds, loss_reduction)

  fj_model = fedjax.Model(
      init=init, apply_for_train=apply_for_train,
      apply_for_eval=apply_for_eval, train_loss=train_loss,
      eval_metrics=lm_eval_metrics(oov_id))
  return split.SplitModel(model=fj_model, cut_layer='none', cut_size=0,
                          client_apply=_no_split, server_apply=_no_split,
                          module=net)
