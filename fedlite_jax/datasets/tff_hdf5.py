"""Reads TFF's legacy HDF5 federated datasets with h5py.

Before its SQLite files, TFF distributed each split as one HDF5 file (e.g.
``fed_emnist_train.h5``, ``shakespeare_train.h5``, ``stackoverflow_train.h5``)
laid out as ``/examples/<client_id>/<feature>``, one dataset per feature with
the examples along the first axis (``tff.simulation.HDF5ClientData``).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import h5py
import numpy as np

from fedlite_jax.datasets import schema
from fedlite_jax.datasets.errors import DatasetFormatError


def iter_clients(
    path: str, specs: Mapping[str, schema.FeatureSpec]
) -> Iterator[tuple[bytes, dict[str, np.ndarray]]]:
  """Streams the clients of a TFF HDF5 file, one at a time.

  Args:
    path: the ``.h5`` file.
    specs: the features to read; each is checked and converted with
      :func:`fedlite_jax.datasets.schema.conform` (fixed-length 'S' strings
      become object arrays of bytes, like FedJAX's files).

  Yields:
    (client id as UTF-8 bytes, examples dict), in the order h5py lists the
    group's members (sorted by name, as ``HDF5ClientData.client_ids``).

  Raises:
    DatasetFormatError (a ValueError): not an HDF5 file, no ``/examples``
      group, or a client does not match ``specs`` (names the file).
  """
  try:
    f = h5py.File(path, 'r')
  except OSError as e:
    raise DatasetFormatError(f'{path} is not a readable HDF5 file: {e}.') from e
  with f:
    if 'examples' not in f:
      raise DatasetFormatError(f'{path} has no /examples group; not a TFF '
                               'HDF5 federated dataset.')
    group = f['examples']
    for client_id in group:
      client = group[client_id]
      examples = {name: client[name][()] for name in specs if name in client}
      yield client_id.encode('utf-8'), schema.conform(
          examples, specs, where=f'{path}:/examples/{client_id}')
