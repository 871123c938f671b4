"""``--tokenizer`` and ``--model`` for the text tasks.

Source: Ro et al. (2022): a 4K SentencePiece vocabulary trained on the
training split (seed 0, cached), sequence length 30, and the Table 1 models.
Config fields missing from ``config`` take their defaults.
"""

from __future__ import annotations

from typing import Any, Optional

from fedlite_jax import datasets
from fedlite_jax.datasets import sentencepiece_vocab
from fedlite_jax.models import lm

TOKENIZERS = ('word', 'sentencepiece')
DEFAULT_SP_MODEL = 'lstm_small'


def load_text_data(config: Any, task: str):
  """``(train, test, DatasetInfo)`` of a text task with ``config.tokenizer``.

  Raises:
    ValueError: an unknown tokenizer (naming the allowed ones).
    DatasetNotFoundError: the task's files are missing.
  """
  tokenizer = getattr(config, 'tokenizer', 'word')
  if tokenizer not in TOKENIZERS:
    raise ValueError(f'--tokenizer={tokenizer!r}: allowed values are '
                     f'{", ".join(TOKENIZERS)}.')
  if tokenizer == 'sentencepiece':
    return sentencepiece_vocab.load_sentencepiece_data(
        task, config.data_dir, sequence_length=config.sequence_length,
        vocab_size=getattr(config, 'sp_vocab_size',
                           sentencepiece_vocab.DEFAULT_VOCAB_SIZE),
        allow_download=config.allow_download)
  return datasets.load_federated_data(
      task, config.data_dir, sequence_length=config.sequence_length,
      vocab_size=config.vocab_size, allow_download=config.allow_download)


def build_lm(config: Any, info: datasets.DatasetInfo) -> Optional[Any]:
  """The ``--model`` preset sized for ``info``'s vocabulary and sequence
  length; without ``--model``, ``lstm_small`` for SentencePiece data and
  None (the task's default model) otherwise.

  Raises:
    ValueError: an unknown preset (naming the allowed ones) or a task that
      is not next-token prediction.
  """
  name = getattr(config, 'model', None)
  if name is None:
    if not info.task.endswith('_sp'):
      return None
    name = DEFAULT_SP_MODEL
  if name not in lm.PRESETS:
    raise ValueError(f'--model={name!r}: allowed values are '
                     f'{", ".join(lm.PRESETS)}.')
  if info.sequence_length is None or info.oov_id is None:
    raise ValueError(f'--model={name} is a language model; task '
                     f'{info.task!r} is not next-token prediction.')
  return lm.create_lm(
      name, vocab_size=info.num_classes, max_length=info.sequence_length,
      oov_id=info.oov_id,
      loss_reduction=getattr(config, 'lm_loss_reduction', 'sequence_sum'),
      compute_dtype=(None if getattr(config, 'compute_dtype', 'float32') ==
                     'float32' else config.compute_dtype))
