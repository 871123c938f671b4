"""Reads TFF's legacy HDF5 federated datasets with h5py.

Layout (``tff.simulation.HDF5ClientData``): ``/examples/<client_id>/<feature>``,
examples along the first axis, one file per split.
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

  Yields:
    (client id as UTF-8 bytes, examples of ``specs``), sorted by client id.

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
