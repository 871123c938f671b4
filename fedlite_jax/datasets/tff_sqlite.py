"""Reads TFF's SQLite federated datasets without TensorFlow.

TFF (``tff.simulation.datasets.sql_client_data``) stores a dataset as::

  examples(split_name TEXT, client_id TEXT, serialized_example_proto BLOB)
  client_metadata(client_id TEXT, split_name TEXT, num_examples INTEGER)

with one serialized ``tf.train.Example`` per row, e.g.
``~/.tff/emnist_all.sqlite`` (splits 'all_train', 'all_test',
'digits_only_train', 'digits_only_test'), ``~/.tff/stackoverflow.sqlite`` ('train', 'heldout', 'test') and
``~/.tff/shakespeare.sqlite`` ('train', 'test').

Clients are read one at a time with FedJAX's own
``fedjax.core.sqlite_federated_data.TFFSQLiteClientsIterator`` (client ids in
sorted order, examples in rowid order), and each client's protos are parsed
with :func:`fedlite_jax.datasets.tf_example.parse_examples`.
"""

from __future__ import annotations

import sqlite3
from typing import Iterator, Mapping

from fedjax.core import sqlite_federated_data
import numpy as np

from fedlite_jax.datasets import errors
from fedlite_jax.datasets import schema
from fedlite_jax.datasets import sqlite_header
from fedlite_jax.datasets import tf_example


def split_names(path: str) -> list[str]:
  """The ``split_name`` values present in a TFF SQLite file, sorted.

  Raises:
    DatasetFormatError (a ValueError): the file is not a TFF SQLite dataset
      (not an SQLite database, truncated, or no ``client_metadata`` table).
  """
  sqlite_header.check_sqlite_file(path)
  try:
    connection = sqlite3.connect(path)
    try:
      rows = connection.execute(
          'SELECT DISTINCT split_name FROM client_metadata;').fetchall()
    finally:
      connection.close()
  except sqlite3.DatabaseError as e:
    raise errors.DatasetFormatError(
        f'{path} is not a TFF SQLite dataset (expected tables examples and '
        f'client_metadata): {e}.') from e
  return sorted(r[0] for r in rows)


def iter_clients(
    path: str, split_name: str, specs: Mapping[str, schema.FeatureSpec]
) -> Iterator[tuple[bytes, dict[str, np.ndarray]]]:
  """Streams one split of a TFF SQLite file, one client at a time.

  Args:
    path: the TFF SQLite file.
    split_name: TFF's split name inside the file (e.g. 'all_train').
    specs: the features to parse (see :mod:`fedlite_jax.datasets.schema`).

  Yields:
    (client id as UTF-8 bytes, FedJAX's convention; examples dict with the
    features of ``specs``, arrays ``[N, *shape]``).

  Raises:
    DatasetNotFoundError: the file has no split ``split_name``.
    DatasetFormatError (a ValueError): not a TFF SQLite file, or an example
      does not match ``specs``.
  """
  available = split_names(path)
  if split_name not in available:
    raise errors.DatasetNotFoundError(
        f'{path} has no split_name {split_name!r}; it has {available}.')

  def parse(serialized: list[bytes]) -> dict[str, np.ndarray]:
    try:
      return tf_example.parse_examples(serialized, specs)
    except ValueError as e:  # Includes tf_example.DecodeError.
      raise errors.DatasetFormatError(
          f'{path}, split {split_name!r}: {e}') from e

  clients = sqlite_federated_data.TFFSQLiteClientsIterator(
      path, parse, split_name)
  try:
    for client_id, dataset in clients:
      yield client_id.encode('utf-8'), dataset.raw_examples
  except sqlite3.DatabaseError as e:
    raise errors.DatasetFormatError(
        f'{path} is not a readable TFF SQLite dataset (tables examples and '
        f'client_metadata): {e}.') from e
