"""Tests for the hand-written tf.train.Example decoder.

The byte literals below were produced ONCE by the ``protobuf`` runtime
(google.protobuf 7.36, upb), from a descriptor declaring TensorFlow's real
``tf.train.Example`` schema (package ``tensorflow``; ``Example{features=1}``,
``Features{map<string, Feature> feature=1}``, ``Feature{oneof kind
{bytes_list=1, float_list=2, int64_list=3}}``, ``*List{repeated value=1}``)
built with ``descriptor_pb2`` + ``message_factory``, filled as::

  f = ex.features.feature
  f['pixels'].float_list.value.extend([0.0, 0.5, 1.0, -2.25])
  f['label'].int64_list.value.append(7)
  f['score'].int64_list.value.extend([-3, 300])
  f['tokens'].bytes_list.value.extend([b'hello world', b'\\xff\\x00bin'])
  f['nothing']                          # a Feature with no list set
  f['no_values'].bytes_list.SetInParent()  # an empty bytes list
  ex.SerializeToString(deterministic=True)

``_PACKED`` uses the proto3 schema (packed float / int64 lists, as TensorFlow
writes them); ``_UNPACKED`` the same schema declared proto2 without
``packed``, so protobuf wrote one tag per value. They are pasted as fixed
literals so that the decoder is never checked against an encoder that could
share its bugs.
"""

import sqlite3

import numpy as np
import pytest

from fedlite_jax.datasets import schema
from fedlite_jax.datasets import tf_example
from fedlite_jax.datasets import tff_sqlite

_PACKED = (
    b'\n\x8b\x01\n\x0e\n\x05label\x12\x05\x1a\x03\n\x01\x07\n\x0f\n\tno_values'
    b'\x12\x02\n\x00\n\x0b\n\x07nothing\x12\x00\n\x1e\n\x06pixels\x12\x14\x12'
    b'\x12\n\x10\x00\x00\x00\x00\x00\x00\x00?\x00\x00\x80?\x00\x00\x10\xc0\n'
    b'\x19\n\x05score\x12\x10\x1a\x0e\n\x0c\xfd\xff\xff\xff\xff\xff\xff\xff'
    b'\xff\x01\xac\x02\n \n\x06tokens\x12\x16\n\x14\n\x0bhello world\n\x05'
    b'\xff\x00bin')
_UNPACKED = (
    b'\n\x8c\x01\n\r\n\x05label\x12\x04\x1a\x02\x08\x07\n\x0f\n\tno_values'
    b'\x12\x02\n\x00\n\x0b\n\x07nothing\x12\x00\n \n\x06pixels\x12\x16\x12'
    b'\x14\r\x00\x00\x00\x00\r\x00\x00\x00?\r\x00\x00\x80?\r\x00\x00\x10\xc0'
    b'\n\x19\n\x05score\x12\x10\x1a\x0e\x08\xfd\xff\xff\xff\xff\xff\xff\xff'
    b'\xff\x01\x08\xac\x02\n \n\x06tokens\x12\x16\n\x14\n\x0bhello world\n'
    b'\x05\xff\x00bin')

_SPECS = {
    'pixels': schema.FeatureSpec('float', (2, 2), 'float32'),
    'label': schema.FeatureSpec('int64', (), 'int32'),
    'score': schema.FeatureSpec('int64', (2,), 'int64'),
    'tokens': schema.FeatureSpec('bytes', (2,)),
}


def _check_decoded(features):
  assert set(features) == {'pixels', 'label', 'score', 'tokens', 'nothing',
                           'no_values'}
  assert features['pixels'].kind == 'float'
  assert features['pixels'].values.dtype == np.float32
  np.testing.assert_array_equal(features['pixels'].values,
                                [0.0, 0.5, 1.0, -2.25])
  assert features['label'].kind == 'int64'
  assert features['label'].values.dtype == np.int64
  np.testing.assert_array_equal(features['label'].values, [7])
  np.testing.assert_array_equal(features['score'].values, [-3, 300])
  assert features['tokens'].kind == 'bytes'
  assert list(features['tokens'].values) == [b'hello world', b'\xff\x00bin']
  assert features['nothing'].kind == ''
  assert features['nothing'].values.size == 0
  assert features['no_values'].kind == 'bytes'
  assert features['no_values'].values.size == 0


@pytest.mark.parametrize('data', [_PACKED, _UNPACKED],
                         ids=['packed', 'unpacked'])
def test_decode_example_matches_protobuf_bytes(data):
  _check_decoded(tf_example.decode_example(data))


def test_unknown_fields_are_skipped():
  # Field 7 (varint 1), field 9 (length-delimited b'xy') and field 3 (fixed32)
  # appended to the top-level Example: protobuf parsers ignore unknown fields.
  extra = b'\x38\x01' + b'\x4a\x02xy' + b'\x1d\x00\x00\x00\x00'
  _check_decoded(tf_example.decode_example(_PACKED + extra))


def test_parse_examples_stacks_and_casts():
  out = tf_example.parse_examples([_PACKED, _UNPACKED, _PACKED], _SPECS)
  assert out['pixels'].shape == (3, 2, 2)
  assert out['pixels'].dtype == np.float32
  np.testing.assert_array_equal(out['pixels'][1], [[0.0, 0.5], [1.0, -2.25]])
  assert out['label'].dtype == np.int32
  np.testing.assert_array_equal(out['label'], [7, 7, 7])
  assert out['score'].dtype == np.int64
  np.testing.assert_array_equal(out['score'], [[-3, 300]] * 3)
  assert out['tokens'].dtype == object
  assert out['tokens'].shape == (3, 2)
  assert out['tokens'][2, 1] == b'\xff\x00bin'


def test_parse_examples_empty_batch():
  out = tf_example.parse_examples([], _SPECS)
  assert out['pixels'].shape == (0, 2, 2)
  assert out['tokens'].shape == (0, 2)


@pytest.mark.parametrize('specs, message', [
    ({'absent': schema.FeatureSpec('bytes')}, "feature 'absent' is missing"),
    ({'label': schema.FeatureSpec('float', (), 'float32')},
     "feature 'label' is a int64 list, expected float"),
    ({'pixels': schema.FeatureSpec('float', (3,), 'float32')},
     "feature 'pixels' has 4 values, expected 3"),
    ({'nothing': schema.FeatureSpec('bytes')},
     "feature 'nothing' is a empty list"),
])
def test_parse_examples_errors_name_the_feature(specs, message):
  with pytest.raises(ValueError, match=message):
    tf_example.parse_examples([_PACKED], specs)


def test_parse_examples_rejects_out_of_range_cast():
  with pytest.raises(ValueError, match="'score' has values outside int8"):
    tf_example.parse_examples(
        [_PACKED], {'score': schema.FeatureSpec('int64', (2,), 'int8')})


@pytest.mark.parametrize('data', [
    _PACKED[:-3],  # Truncated inside a bytes value.
    b'\n\x8b',  # Truncated varint.
    b'\x0b\x00',  # Wire type 3 (start group) is not supported.
])
def test_malformed_bytes_raise_decode_error(data):
  with pytest.raises(tf_example.DecodeError):
    tf_example.decode_example(data)


def test_feature_spec_validates():
  with pytest.raises(ValueError, match='kind'):
    schema.FeatureSpec('string')
  with pytest.raises(ValueError, match="dtype 'object'"):
    schema.FeatureSpec('bytes', (), 'float32')


def test_literal_examples_through_a_tff_sqlite_file(tmp_path):
  path = str(tmp_path / 'literal.sqlite')
  connection = sqlite3.connect(path)
  connection.executescript("""
    CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,
                           serialized_example_proto BLOB NOT NULL);
    CREATE TABLE client_metadata (client_id TEXT NOT NULL,
                                  split_name TEXT NOT NULL,
                                  num_examples INTEGER NOT NULL);""")
  rows = [('train', 'b', _UNPACKED), ('train', 'a', _PACKED),
          ('train', 'b', _PACKED), ('test', 'a', _UNPACKED)]
  connection.executemany('INSERT INTO examples VALUES (?, ?, ?)', rows)
  connection.executemany('INSERT INTO client_metadata VALUES (?, ?, ?)',
                         [('a', 'train', 1), ('b', 'train', 2),
                          ('a', 'test', 1)])
  connection.commit()
  connection.close()
  clients = list(tff_sqlite.iter_clients(path, 'train', _SPECS))
  assert [c for c, _ in clients] == [b'a', b'b']  # Sorted client ids.
  examples = clients[1][1]
  np.testing.assert_array_equal(examples['score'], [[-3, 300], [-3, 300]])
  np.testing.assert_array_equal(examples['pixels'][0],
                                [[0.0, 0.5], [1.0, -2.25]])
  assert examples['tokens'][1, 0] == b'hello world'
  assert tff_sqlite.split_names(path) == ['test', 'train']
