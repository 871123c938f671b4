"""Feature schemas: the raw (unpreprocessed) features of each dataset.

Every on-disk format (FedJAX SQLite, TFF SQLite, TFF HDF5) is brought to one
schema (FedJAX's numpy dtypes), so preprocessing never depends on the source.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from fedlite_jax.datasets.errors import DatasetFormatError

KINDS = ('bytes', 'float', 'int64')


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One fixed-length feature of an example (``tf.io.FixedLenFeature``).

  Attributes:
    kind: the ``tf.train.Feature`` list: 'bytes', 'float' or 'int64'.
    shape: the per-example shape (``()`` for a scalar).
    dtype: numpy dtype of the stacked ``[N, *shape]`` array: 'object' (of
      ``bytes``) for bytes features, else e.g. 'float32', 'int32', 'int64'.
  """
  kind: str
  shape: tuple[int, ...] = ()
  dtype: str = 'object'

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f'FeatureSpec.kind must be one of {KINDS}, got '
                       f'{self.kind!r}.')
    if (self.kind == 'bytes') != (self.dtype == 'object'):
      raise ValueError(
          "FeatureSpec: bytes features (and only they) use dtype 'object'; "
          f'got kind={self.kind!r}, dtype={self.dtype!r}.')

  @property
  def size(self) -> int:
    """Number of values per example."""
    return int(np.prod(self.shape, dtype=np.int64))


def _bytes_array(values: np.ndarray, name: str, where: str) -> np.ndarray:
  """Converts fixed-length ('S') or object arrays of bytes/str to object."""
  if values.dtype.kind == 'S':
    # numpy's 'S' dtype drops trailing NUL bytes, as h5py's fixed-length
    # strings do on read; TFF's HDF5 files store text, which has none.
    flat = values.reshape(-1).tolist()
  elif values.dtype.kind == 'O':
    flat = [v.encode('utf-8') if isinstance(v, str) else v
            for v in values.reshape(-1).tolist()]
    if not all(isinstance(v, bytes) for v in flat):
      raise DatasetFormatError(
          f'{where}: feature {name!r} holds non-bytes objects.')
  elif values.dtype.kind == 'U':
    flat = [v.encode('utf-8') for v in values.reshape(-1).tolist()]
  else:
    raise DatasetFormatError(f'{where}: feature {name!r} should hold bytes, '
                             f'got dtype {values.dtype}.')
  out = np.empty(len(flat), dtype=object)
  out[:] = flat
  return out.reshape(values.shape)


def conform(examples: Mapping[str, np.ndarray],
            specs: Mapping[str, FeatureSpec],
            where: str) -> dict[str, np.ndarray]:
  """Checks and converts a client's examples ``[N, ...]`` to ``specs``.

  Returns the features of ``specs`` (others dropped), in order, each
  ``[N, *spec.shape]`` of ``spec.dtype`` (bytes: object arrays of ``bytes``).
  ``where`` names the source (e.g. file and client id) in errors.

  Raises:
    DatasetFormatError (a ValueError): a feature is missing, has the wrong
      shape or N, or values that do not fit ``spec.dtype``; the message
      starts with ``where``.
  """
  out = {}
  num = None
  for name, spec in specs.items():
    if name not in examples:
      raise DatasetFormatError(f'{where}: feature {name!r} is missing (found '
                               f'{sorted(examples)}).')
    values = np.asarray(examples[name])
    if tuple(values.shape[1:]) != spec.shape:
      raise DatasetFormatError(
          f'{where}: feature {name!r} has per-example shape '
          f'{tuple(values.shape[1:])}, expected {spec.shape}.')
    if num is None:
      num = values.shape[0]
    elif values.shape[0] != num:
      raise DatasetFormatError(
          f'{where}: feature {name!r} has {values.shape[0]} examples, other '
          f'features have {num}.')
    if spec.kind == 'bytes':
      values = _bytes_array(values, name, where)
    else:
      if values.dtype.kind not in 'biuf':
        raise DatasetFormatError(f'{where}: feature {name!r} should be '
                                 f'numeric, got dtype {values.dtype}.')
      converted = values.astype(spec.dtype)
      if spec.kind == 'int64' and not np.array_equal(converted, values):
        raise DatasetFormatError(f'{where}: feature {name!r} has values '
                                 f'that do not fit {spec.dtype}.')
      values = converted
    out[name] = values
  return out
