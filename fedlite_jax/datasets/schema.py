"""Feature schemas: the raw (unpreprocessed) features of each dataset.

A :class:`FeatureSpec` says what one feature of one example looks like, in the
same terms as TensorFlow's ``tf.io.FixedLenFeature`` (which TFF's loaders use)
and with the numpy dtype FedJAX's own SQLite files store. Every on-disk format
(FedJAX SQLite, TFF SQLite, TFF HDF5) is brought to this one schema, so the
preprocessing downstream never needs to know where the data came from.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from fedlite_jax.datasets.errors import DatasetFormatError

KINDS = ('bytes', 'float', 'int64')


@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One fixed-length feature of an example.

  Attributes:
    kind: the ``tf.train.Feature`` list it is stored in: 'bytes', 'float' or
      'int64' (``bytes_list``, ``float_list``, ``int64_list``).
    shape: the per-example shape (``()`` for a scalar), as in
      ``tf.io.FixedLenFeature(shape=...)``.
    dtype: the numpy dtype of the stacked array ``[N, *shape]``: 'object' for
      bytes features (an object array of ``bytes``, FedJAX's convention), else
      e.g. 'float32', 'int32', 'int64'.
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
    """Number of values per example (the product of ``shape``)."""
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
  """Checks and converts a client's examples to ``specs``.

  Args:
    examples: feature name -> array ``[N, ...]`` as read from a file (extra
      features are dropped).
    specs: the expected features.
    where: names the source in error messages (e.g. file and client id).

  Returns:
    A dict with exactly the features of ``specs``, in ``specs`` order, each of
    shape ``[N, *spec.shape]`` and dtype ``spec.dtype``; bytes features become
    object arrays of ``bytes``.

  Raises:
    DatasetFormatError (a ValueError): a feature is missing, has the wrong
      per-example shape, the features disagree on N, or numeric values do
      not fit ``spec.dtype``; the message starts with ``where``.
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
