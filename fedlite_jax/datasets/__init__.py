"""Federated datasets as ``fedjax.FederatedData``, without TensorFlow.

Entry point: :func:`load_federated_data` (tasks in ``TASKS``; default
'embedded_mnist'), returning ``(train, test, info)``. File search order:
:mod:`fedlite_jax.datasets.locate`; overview: ``datasets/README.md``.
"""

from fedlite_jax.datasets.api import DEFAULT_TASK, load_federated_data, TASKS
from fedlite_jax.datasets.embedded_mnist import load_embedded_mnist
from fedlite_jax.datasets.emnist import load_data as load_emnist
from fedlite_jax.datasets.errors import DatasetFormatError, DatasetNotFoundError
from fedlite_jax.datasets.info import BOS, DatasetInfo, EOS, PAD
from fedlite_jax.datasets.partition import (
    client_ids, dirichlet_label_skew, partition_to_federated_data)
from fedlite_jax.datasets.shakespeare import (
    load_snippets as load_shakespeare_snippets,
    load_word_data as load_shakespeare_words, words_from_text)
from fedlite_jax.datasets.stackoverflow import (
    load_raw as load_stackoverflow_raw,
    load_tag_prediction as load_stackoverflow_tag,
    load_word_prediction as load_stackoverflow_nwp)
from fedlite_jax.datasets.tf_example import decode_example, parse_examples
from fedlite_jax.datasets.word_pipeline import (
    TagPredictionEncoder, WordTokenizer)
