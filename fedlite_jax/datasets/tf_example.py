"""Parses serialized ``tf.train.Example`` protos without TensorFlow.

Source: ``tensorflow/core/example/{example,feature}.proto``, decoded from the
protobuf wire format (https://protobuf.dev/programming-guides/encoding/) with
protobuf's merge semantics (packed or unpacked lists, unknown fields skipped,
last map entry wins).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

from fedlite_jax.datasets import schema

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_BYTES_LIST, _FLOAT_LIST, _INT64_LIST = 1, 2, 3
_KIND_NAMES = {0: '', _BYTES_LIST: 'bytes', _FLOAT_LIST: 'float',
               _INT64_LIST: 'int64'}
_UINT64 = (1 << 64) - 1


class DecodeError(ValueError):
  """Malformed protobuf bytes (truncated data, bad wire type, bad length)."""


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
  """Reads a base-128 varint at ``pos``; returns (value, next position)."""
  result = shift = 0
  while True:
    if pos >= end:
      raise DecodeError('truncated varint')
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if byte < 0x80:
      return result, pos
    shift += 7
    if shift >= 70:
      raise DecodeError('varint longer than 10 bytes')


# Single-byte varints are read inline; expected tags are compared as whole
# keys (field number << 3 | wire type).
def _key(buf: bytes, pos: int, end: int) -> tuple[int, int]:
  """Reads a field key (tag); returns (key, next position)."""
  byte = buf[pos]
  if byte < 0x80:
    return byte, pos + 1
  return _read_varint(buf, pos, end)


def _length(buf: bytes, pos: int, end: int) -> tuple[int, int]:
  """Reads a length prefix; returns (payload stop, payload start)."""
  if pos >= end:
    raise DecodeError('truncated length')
  byte = buf[pos]
  if byte < 0x80:
    start = pos + 1
    stop = start + byte
  else:
    length, start = _read_varint(buf, pos, end)
    stop = start + length
  if stop > end:
    raise DecodeError('length-delimited field runs past the end of its '
                      'message')
  return stop, start


def _skip(buf: bytes, pos: int, end: int, key: int) -> int:
  """Skips the value of an unknown field; returns the next position."""
  wire = key & 7
  if wire == _VARINT:
    return _read_varint(buf, pos, end)[1]
  if wire == _LEN:
    return _length(buf, pos, end)[0]
  if wire == _FIXED32:
    stop = pos + 4
  elif wire == _FIXED64:
    stop = pos + 8
  else:
    # Wire types 3/4 (groups) never occur in tf.train.Example.
    raise DecodeError(f'unsupported wire type {wire} (field {key >> 3})')
  if stop > end:
    raise DecodeError(f'field {key >> 3} runs past the end of its message')
  return stop


def _signed64(v: int) -> int:
  v &= _UINT64
  return v - (1 << 64) if v >> 63 else v


def _decode_list(buf: bytes, pos: int, end: int, kind: int,
                 values: list) -> None:
  """Appends a Bytes/Float/Int64List's raw values (bytes, '<f4' bytes, int)."""
  while pos < end:
    key, pos = _key(buf, pos, end)
    if key == 0x0A:  # value = 1, length-delimited (bytes, or packed).
      stop, start = _length(buf, pos, end)
      if kind == _BYTES_LIST:
        values.append(buf[start:stop])
      elif kind == _FLOAT_LIST:
        if (stop - start) % 4:
          raise DecodeError('packed float list length is not a multiple '
                            'of 4')
        values.append(buf[start:stop])
      else:
        p = start
        while p < stop:
          byte = buf[p]
          if byte < 0x80:
            values.append(byte)
            p += 1
          else:
            v, p = _read_varint(buf, p, stop)
            values.append(_signed64(v))
      pos = stop
    elif key == 0x0D and kind == _FLOAT_LIST:  # value = 1, unpacked float.
      if pos + 4 > end:
        raise DecodeError('truncated float')
      values.append(buf[pos:pos + 4])
      pos += 4
    elif key == 0x08 and kind == _INT64_LIST:  # value = 1, unpacked int64.
      v, pos = _read_varint(buf, pos, end)
      values.append(_signed64(v))
    else:
      pos = _skip(buf, pos, end, key)


def _decode_feature(buf: bytes, pos: int, end: int) -> tuple[int, list]:
  """Decodes a Feature into (kind, raw values); kind 0 = no list set."""
  kind, values = 0, []
  while pos < end:
    key, pos = _key(buf, pos, end)
    number = key >> 3
    if key & 7 == _LEN and number in (_BYTES_LIST, _FLOAT_LIST, _INT64_LIST):
      stop, start = _length(buf, pos, end)
      if number != kind:  # Another oneof member replaces the previous one.
        kind, values = number, []
      _decode_list(buf, start, stop, kind, values)
      pos = stop
    else:
      pos = _skip(buf, pos, end, key)
  return kind, values


def _decode_raw(buf: bytes) -> dict[str, tuple[int, list]]:
  """Decodes an Example into {feature name: (kind, raw values)}."""
  features = {}
  pos, end = 0, len(buf)
  while pos < end:
    key, pos = _key(buf, pos, end)
    if key != 0x0A:  # Example.features = 1.
      pos = _skip(buf, pos, end, key)
      continue
    stop, pos = _length(buf, pos, end)
    while pos < stop:  # Features: repeated FeatureEntry feature = 1.
      key, pos = _key(buf, pos, stop)
      if key != 0x0A:
        pos = _skip(buf, pos, stop, key)
        continue
      entry_stop, pos = _length(buf, pos, stop)
      name, value = b'', (0, [])
      while pos < entry_stop:  # FeatureEntry {key = 1; value = 2}.
        key, pos = _key(buf, pos, entry_stop)
        if key == 0x0A:
          field_stop, start = _length(buf, pos, entry_stop)
          name = buf[start:field_stop]
          pos = field_stop
        elif key == 0x12:
          field_stop, start = _length(buf, pos, entry_stop)
          value = _decode_feature(buf, start, field_stop)
          pos = field_stop
        else:
          pos = _skip(buf, pos, entry_stop, key)
      features[name.decode('utf-8')] = value
  return features


class Feature(NamedTuple):
  """One decoded ``tf.train.Feature``: ``kind`` ('bytes', 'float', 'int64';
  '' if no list is set) and 1-D ``values`` (object array of ``bytes``,
  float32, int64; empty float32 for '')."""
  kind: str
  values: np.ndarray


def _to_array(kind: int, raw: list) -> np.ndarray:
  if kind == _BYTES_LIST:
    out = np.empty(len(raw), dtype=object)
    out[:] = raw
    return out
  if kind == _FLOAT_LIST:
    return np.frombuffer(b''.join(raw), dtype='<f4').astype(np.float32)
  if kind == _INT64_LIST:
    return np.array(raw, dtype=np.int64)
  return np.zeros(0, np.float32)


def decode_example(serialized: bytes) -> dict[str, Feature]:
  """Decodes one serialized ``tf.train.Example`` into name -> :class:`Feature`.

  Raises:
    DecodeError: the bytes are not a valid wire-format message.
    UnicodeDecodeError: a feature name is not UTF-8.
  """
  return {name: Feature(_KIND_NAMES[kind], _to_array(kind, raw))
          for name, (kind, raw) in _decode_raw(bytes(serialized)).items()}


def parse_examples(
    serialized: Sequence[bytes],
    specs: Mapping[str, schema.FeatureSpec]) -> dict[str, np.ndarray]:
  """Parses serialized Examples into stacked arrays (``tf.io.parse_example``).

  As ``tf.io.parse_example`` with a ``FixedLenFeature`` (no default) per
  feature of ``specs`` (others ignored), then the cast TFF's loaders apply
  (e.g. int64 label -> int32): returns name -> ``[N, *spec.shape]`` array of
  ``spec.dtype`` for N ``serialized`` protos.

  Raises:
    DecodeError: malformed bytes.
    ValueError: a feature is missing, has the wrong list kind, or the wrong
      number of values (the message names the feature and example index).
  """
  kind_codes = {name: code for code, name in _KIND_NAMES.items()}
  plan = [(name, kind_codes[spec.kind], spec.size, []) for name, spec
          in specs.items()]
  for index, data in enumerate(serialized):
    features = _decode_raw(bytes(data))
    for name, kind, size, column in plan:
      entry = features.get(name)
      if entry is None:
        raise ValueError(f'Example {index}: feature {name!r} is missing '
                         f'(present: {sorted(features)}).')
      if entry[0] != kind:
        raise ValueError(
            f'Example {index}: feature {name!r} is a '
            f'{_KIND_NAMES[entry[0]] or "empty"} list, expected '
            f'{_KIND_NAMES[kind]}.')
      raw = entry[1]
      count = (sum(map(len, raw)) // 4 if kind == _FLOAT_LIST else len(raw))
      if count != size:
        raise ValueError(f'Example {index}: feature {name!r} has {count} '
                         f'values, expected {size} (shape '
                         f'{specs[name].shape}).')
      column.extend(raw)
  out = {}
  for name, kind, _, column in plan:
    spec = specs[name]
    flat = _to_array(kind, column)
    converted = flat.astype(spec.dtype, copy=False)
    if kind == _INT64_LIST and not np.array_equal(converted, flat):
      raise ValueError(f'Feature {name!r} has values outside {spec.dtype}.')
    out[name] = converted.reshape((len(serialized),) + spec.shape)
  return out
