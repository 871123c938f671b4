"""Reads TFF's SQLite federated datasets without TensorFlow.

Layout (``tff.simulation.datasets.sql_client_data``): tables
``examples(split_name, client_id, serialized_example_proto)`` (one
``tf.train.Example`` per row) and ``client_metadata(client_id, split_name,
num_examples)``.
"""

from __future__ import annotations

import sqlite3
from typing import Iterator, Mapping

from fedjax.core import sqlite_federated_data
import numpy as np

from fedlite_jax.datasets import errors, schema, sqlite_header, tf_example


def split_names(path: str) -> list[str]:
  """The sorted ``split_name`` values of a TFF SQLite file.

  Raises:
    DatasetFormatError (a ValueError): not a TFF SQLite dataset.
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
  """Streams TFF split ``split_name`` (e.g. 'all_train') of ``path``.

  Yields:
    (client id as UTF-8 bytes, examples of ``specs``), one client at a time,
    sorted by id, examples in rowid order (``TFFSQLiteClientsIterator``).

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
