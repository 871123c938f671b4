"""Tests for finding, converting and downloading datasets.

TFF SQLite files are written here with ``tf.train.Example`` protos serialized
by the ``protobuf`` runtime (a dynamic descriptor declaring TensorFlow's real
schema), never by the library's own code. FedJAX-format files are written with
FedJAX's ``SQLiteFederatedDataBuilder``. ``$HOME`` points at a temporary
directory, so ``~/.cache/fedjax`` and ``~/.tff`` are empty unless a test fills
them, and network access is made to fail.
"""

import os
import shutil
import socket
import sqlite3

import fedlite_jax  # noqa: F401  (applies FedJAX fixes; import before fedjax)
import fedjax  # pylint: disable=g-bad-import-order
from fedjax.datasets import downloads
from google.protobuf import descriptor_pb2
from google.protobuf import descriptor_pool
from google.protobuf import message_factory
import h5py
import numpy as np
import pytest

from fedlite_jax import datasets
from fedlite_jax.datasets import sources
from fedlite_jax.datasets import tff_sqlite


def _example_class():
  """tf.train.Example (tensorflow/core/example/*.proto) via descriptor_pb2."""
  fdp = descriptor_pb2.FileDescriptorProto(
      name='tensorflow/core/example/example_for_tests.proto',
      package='tensorflow', syntax='proto3')
  f = descriptor_pb2.FieldDescriptorProto
  rep, opt = f.LABEL_REPEATED, f.LABEL_OPTIONAL

  def message(name, fields):
    m = fdp.message_type.add(name=name)
    for fname, number, ftype, label, type_name in fields:
      m.field.add(name=fname, number=number, type=ftype, label=label,
                  type_name=type_name)
    return m

  message('BytesList', [('value', 1, f.TYPE_BYTES, rep, None)])
  message('FloatList', [('value', 1, f.TYPE_FLOAT, rep, None)])
  message('Int64List', [('value', 1, f.TYPE_INT64, rep, None)])
  feature = message('Feature', [
      ('bytes_list', 1, f.TYPE_MESSAGE, opt, '.tensorflow.BytesList'),
      ('float_list', 2, f.TYPE_MESSAGE, opt, '.tensorflow.FloatList'),
      ('int64_list', 3, f.TYPE_MESSAGE, opt, '.tensorflow.Int64List')])
  feature.oneof_decl.add(name='kind')
  for field in feature.field:
    field.oneof_index = 0
  features = message('Features', [
      ('feature', 1, f.TYPE_MESSAGE, rep,
       '.tensorflow.Features.FeatureEntry')])
  entry = features.nested_type.add(name='FeatureEntry')
  entry.options.map_entry = True
  entry.field.add(name='key', number=1, type=f.TYPE_STRING, label=opt)
  entry.field.add(name='value', number=2, type=f.TYPE_MESSAGE, label=opt,
                  type_name='.tensorflow.Feature')
  message('Example', [('features', 1, f.TYPE_MESSAGE, opt,
                       '.tensorflow.Features')])
  pool = descriptor_pool.DescriptorPool()
  pool.Add(fdp)
  return message_factory.GetMessageClass(
      pool.FindMessageTypeByName('tensorflow.Example'))


_EXAMPLE = _example_class()


def _serialize(features):
  """{name: list of bytes | float32 array | int list} -> Example bytes."""
  ex = _EXAMPLE()
  for name, values in features.items():
    feature = ex.features.feature[name]
    if isinstance(values, np.ndarray) and values.dtype == np.float32:
      feature.float_list.value.extend(values.reshape(-1).tolist())
    elif isinstance(values[0], bytes):
      feature.bytes_list.value.extend(values)
    else:
      feature.int64_list.value.extend(values)
  return ex.SerializeToString()


def _write_tff_sqlite(path, splits):
  """splits: {split_name: {client_id str: [feature dict per example]}}."""
  connection = sqlite3.connect(path)
  connection.executescript("""
    CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL,
                           serialized_example_proto BLOB NOT NULL);
    CREATE TABLE client_metadata (client_id TEXT NOT NULL,
                                  split_name TEXT NOT NULL,
                                  num_examples INTEGER NOT NULL);""")
  for split, clients in splits.items():
    for client_id, examples in clients.items():
      connection.execute('INSERT INTO client_metadata VALUES (?, ?, ?)',
                         (client_id, split, len(examples)))
      connection.executemany(
          'INSERT INTO examples VALUES (?, ?, ?)',
          [(split, client_id, _serialize(e)) for e in examples])
  connection.commit()
  connection.close()


@pytest.fixture
def home(tmp_path, monkeypatch):
  """Empty $HOME and cache dir, no $FEDLITE_DATA_DIR, no network."""
  home = tmp_path / 'home'
  home.mkdir()
  monkeypatch.setenv('HOME', str(home))
  monkeypatch.delenv('FEDLITE_DATA_DIR', raising=False)
  monkeypatch.setenv('FEDLITE_CACHE_DIR', str(tmp_path / 'cache'))

  def no_network(*args, **kwargs):
    raise AssertionError(f'network access attempted: {args}')

  monkeypatch.setattr(socket, 'create_connection', no_network)
  monkeypatch.setattr(downloads, 'maybe_download', no_network)
  return home


def _emnist_examples(rng, num, num_classes):
  return [{'pixels': rng.random((28, 28), dtype=np.float32),
           'label': [int(rng.integers(num_classes))]} for _ in range(num)]


def test_emnist_from_tff_sqlite(tmp_path, home):
  rng = np.random.default_rng(0)
  clients = {'f0001_00': 3, 'f0002_01': 1, 'f2100_07': 2}  # 2100: domain 0.
  splits = {}
  for split, num_classes in (('all_train', 62), ('all_test', 62),
                             ('digits_only_train', 10),
                             ('digits_only_test', 10)):
    splits[split] = {c: _emnist_examples(rng, n, num_classes)
                     for c, n in clients.items()}
  data = tmp_path / 'data'
  data.mkdir()
  _write_tff_sqlite(str(data / 'emnist_all.sqlite'), splits)

  for task, prefix in (('emnist', 'all'), ('emnist_digits', 'digits_only')):
    train, test, info = datasets.load_federated_data(task, str(data))
    assert info.format == 'tff_sqlite' and info.derived == ''
    assert info.cached_files and all(
        str(tmp_path / 'cache') in p for p in info.cached_files)
    for fd, split in ((train, f'{prefix}_train'), (test, f'{prefix}_test')):
      assert list(fd.client_ids()) == [c.encode() for c in sorted(clients)]
      for client_id, dataset in fd.clients():
        batch = dataset.all_examples()
        expected = splits[split][client_id.decode()]
        pixels = np.stack([e['pixels'] for e in expected])
        np.testing.assert_array_equal(batch['x'], 1 - pixels[..., None])
        np.testing.assert_array_equal(batch['y'],
                                      [e['label'][0] for e in expected])
        assert batch['y'].dtype == np.int32
        np.testing.assert_array_equal(
            batch['domain_id'], 0 if client_id == b'f2100_07' else 1)


def test_tff_sqlite_missing_split_is_reported(tmp_path, home):
  path = str(tmp_path / 'emnist_all.sqlite')
  _write_tff_sqlite(path, {'all_train': {'f0001_00': _emnist_examples(
      np.random.default_rng(0), 1, 62)}})
  assert tff_sqlite.split_names(path) == ['all_train']
  with pytest.raises(datasets.DatasetNotFoundError, match="'all_test'"):
    datasets.load_federated_data('emnist', str(tmp_path))


def test_shakespeare_tff_sqlite_equals_fedjax_sqlite(tmp_path, home, data_dir):
  # Real snippets of a few clients, written in TFF's SQLite format.
  names = [b'ALL_S_WELL_THAT_ENDS_WELL_ADAM', b'THE_TRAGEDY_OF_KING_LEAR_ALL']
  real = {}
  for split in ('train', 'test'):
    fd = fedjax.SQLiteFederatedData.new(
        str(data_dir / 'shakespeare' / f'shakespeare_{split}.sqlite'))
    real[split] = {c: fd.get_client(c).raw_examples['snippets']
                   for c in names}
  path = tmp_path / 'shakespeare.sqlite'
  _write_tff_sqlite(str(path), {
      split: {c.decode(): [{'snippets': [s]} for s in v]
              for c, v in clients.items()} for split, clients in real.items()})
  train, test, opened = datasets.load_shakespeare_snippets(str(tmp_path))
  assert opened.format == 'tff_sqlite'
  for split, fd in (('train', train), ('test', test)):
    assert list(fd.client_ids()) == names
    for c in names:
      got = fd.get_client(c).raw_examples['snippets']
      assert got.dtype == object
      assert list(got) == list(real[split][c])


def _so_example(tokens, tags=b'x', title=b't', kind=b'answer', score=1):
  return {'creation_date': [b'2010-01-08 09:34:05 UTC'], 'score': [score],
          'tags': [tags], 'title': [title], 'tokens': [tokens],
          'type': [kind]}


def test_stackoverflow_from_tff_sqlite(tmp_path, home):
  # Training words: a x5, b x3, c x2, d x2, e x1. With vocab_size 3 the
  # vocabulary is a=3, b=4, then c=5 (c ties d, c < d); OOV = 6.
  splits = {
      'train': {
          'u1': [_so_example(b'a b a', tags=b'p|q', kind=b'question'),
                 _so_example(b'c d a')],
          'u2': [_so_example(b'a b c d e b a', tags=b'q', score=-5)],
      },
      'heldout': {'u3': [_so_example(b'zz')]},
      'test': {'u1': [_so_example(b'b a zz d', tags=b'q|zz')]},
  }
  _write_tff_sqlite(str(tmp_path / 'stackoverflow.sqlite'), splits)
  train, test, info = datasets.load_federated_data(
      'stackoverflow_nwp', str(tmp_path), sequence_length=4, vocab_size=3)
  assert info.format == 'tff_sqlite'
  assert (info.num_classes, info.oov_id, info.vocab_size) == (7, 6, 3)
  u1 = train.get_client(b'u1').all_examples()
  np.testing.assert_array_equal(u1['x'], [[1, 3, 4, 3], [1, 5, 6, 3]])
  np.testing.assert_array_equal(u1['y'], [[3, 4, 3, 2], [5, 6, 3, 2]])
  np.testing.assert_array_equal(u1['domain_id'], [0, 1])  # question, answer
  u2 = train.get_client(b'u2').all_examples()
  np.testing.assert_array_equal(u2['x'], [[1, 3, 4, 5]])
  np.testing.assert_array_equal(u2['y'], [[3, 4, 5, 6]])
  t = test.get_client(b'u1').all_examples()
  np.testing.assert_array_equal(t['x'], [[1, 4, 3, 6]])
  np.testing.assert_array_equal(t['y'], [[4, 3, 6, 6]])

  # Tag prediction: word vocab (2) a, b; tag vocab (2): q (2), p (1).
  train, test, info = datasets.load_federated_data(
      'stackoverflow_tag', str(tmp_path), tag_word_vocab_size=2,
      tag_vocab_size=2)
  assert (info.num_classes, info.input_shape) == (2, (2,))
  u1 = train.get_client(b'u1').all_examples()
  # Example 1: words 'a b a t' -> a 2/4, b 1/4; tags p|q -> [q, p] = [1, 1].
  # Example 2: words 'c d a t' -> a 1/4.
  np.testing.assert_allclose(u1['x'], [[0.5, 0.25], [0.25, 0.0]])
  np.testing.assert_array_equal(u1['y'], [[1, 1], [0, 0]])
  t = test.get_client(b'u1').all_examples()
  np.testing.assert_allclose(t['x'], [[0.2, 0.2]])  # b a zz d t
  np.testing.assert_array_equal(t['y'], [[1, 0]])


def _so_columns(examples):
  """Feature dict of per-example dicts -> FedJAX's column arrays."""
  out = {}
  for name in ('creation_date', 'score', 'tags', 'title', 'tokens', 'type'):
    values = [e[name][0] for e in examples]
    if name == 'score':
      out[name] = np.array(values, np.int64)
    else:
      out[name] = np.empty(len(values), dtype=object)
      out[name][:] = values
  return out


@pytest.mark.parametrize('fmt', ['fedjax_sqlite', 'tff_sqlite', 'tff_hdf5'])
def test_stackoverflow_formats_agree(tmp_path, home, fmt):
  splits = {
      'train': {'u1': [_so_example(b'a b a'), _so_example(b'b  c', score=-2)],
                'u2': [_so_example(b'c a', tags=b'p|q', kind=b'question')]},
      'test': {'u1': [_so_example(b'a zz b c a')]},
  }
  if fmt == 'fedjax_sqlite':
    for split, clients in splits.items():
      with fedjax.SQLiteFederatedDataBuilder(
          str(tmp_path / f'stackoverflow_{split}.sqlite')) as builder:
        builder.add_many([(c.encode(), _so_columns(v))
                          for c, v in clients.items()])
  elif fmt == 'tff_sqlite':
    _write_tff_sqlite(str(tmp_path / 'stackoverflow.sqlite'), splits)
  else:
    for split, clients in splits.items():
      with h5py.File(tmp_path / f'stackoverflow_{split}.h5', 'w') as f:
        for c, v in clients.items():
          group = f.create_group(f'examples/{c}')
          for name, values in _so_columns(v).items():
            if name == 'tokens':  # Variable-length strings.
              group.create_dataset(name, data=values,
                                   dtype=h5py.string_dtype('utf-8'))
            elif name == 'score':
              group.create_dataset(name, data=values)
            else:  # Fixed-length strings.
              group.create_dataset(name, data=np.array(list(values), 'S'))
  opened = datasets.load_stackoverflow_raw(('train', 'test'), str(tmp_path))
  assert opened.format == fmt
  u1 = opened.splits['train'].get_client(b'u1').raw_examples
  assert list(u1['tokens']) == [b'a b a', b'b  c']
  assert u1['tokens'].dtype == object
  np.testing.assert_array_equal(u1['score'], [1, -2])
  assert u1['score'].dtype == np.int64

  # Counts a 3, b 2, c 2 (b < c), b'' 1 -> vocab a=3, b=4; OOV 5.
  train, test, info = datasets.load_federated_data(
      'stackoverflow_nwp', str(tmp_path), sequence_length=5, vocab_size=2)
  assert info.format == fmt
  np.testing.assert_array_equal(
      train.get_client(b'u1').all_examples()['x'],
      [[1, 3, 4, 3, 0], [1, 4, 5, 5, 0]])
  np.testing.assert_array_equal(
      test.get_client(b'u1').all_examples()['y'], [[3, 5, 4, 5, 3]])


def _write_fedjax_emnist(path, num_clients, label):
  with fedjax.SQLiteFederatedDataBuilder(str(path)) as builder:
    builder.add_many([
        (f'{i:016x}:f{i:04d}_00'.encode(),
         {'pixels': np.ones((2, 28, 28), np.float32),
          'label': np.full(2, label, np.int32)}) for i in range(num_clients)])


def _emnist_dir(path, num_clients, label):
  path.mkdir(parents=True, exist_ok=True)
  for split in ('train', 'test'):
    _write_fedjax_emnist(path / f'federated_emnist_{split}.sqlite',
                         num_clients, label)
  return path


def test_resolution_order(tmp_path, home, monkeypatch):
  _emnist_dir(home / '.cache' / 'fedjax', 1, label=1)
  env = _emnist_dir(tmp_path / 'env' / 'femnist105', 2, label=2)
  arg = _emnist_dir(tmp_path / 'arg', 3, label=3)

  def label_of(data_dir):
    train, _, info = datasets.load_federated_data('emnist', data_dir)
    return int(next(train.clients())[1].all_examples()['y'][0]), info

  assert label_of(None)[0] == 1  # Only the FedJAX cache.
  monkeypatch.setenv('FEDLITE_DATA_DIR', str(tmp_path / 'env'))
  label, info = label_of(None)  # $FEDLITE_DATA_DIR/femnist105 beats cache.
  assert label == 2 and info.source == str(env)
  label, info = label_of(str(arg))  # data_dir beats $FEDLITE_DATA_DIR.
  assert label == 3 and info.source == str(arg)


def test_cached_files_mean_no_network(data_dir, home):
  cache = home / '.cache' / 'fedjax'
  cache.mkdir(parents=True)
  for split in ('train', 'test'):
    shutil.copy(data_dir / 'femnist105' / f'federated_emnist_{split}.sqlite',
                cache)
  # maybe_download and socket.create_connection raise (fixture `home`).
  train, test, info = datasets.load_federated_data('emnist',
                                                   allow_download=True)
  assert info.format == 'fedjax_sqlite' and info.source == str(cache)
  assert (train.num_clients(), test.num_clients()) == (105, 105)


def test_missing_data_error_names_files_and_directories(tmp_path, home):
  with pytest.raises(datasets.DatasetNotFoundError) as err:
    datasets.load_federated_data('emnist', str(tmp_path / 'nowhere'))
  assert isinstance(err.value, FileNotFoundError)
  message = str(err.value)
  for expected in ('federated_emnist_train.sqlite',
                   'federated_emnist_test.sqlite', 'emnist_all.sqlite',
                   'fed_emnist_train.h5', str(tmp_path / 'nowhere'),
                   str(tmp_path / 'nowhere' / 'femnist105'),
                   'which does not exist', 'only place searched',
                   'allow_download=True'):
    assert expected in message, (expected, message)
  # An explicit data_dir is the only place searched: no caches.
  assert str(home / '.cache' / 'fedjax') not in message
  with pytest.raises(datasets.DatasetNotFoundError) as err:
    datasets.load_federated_data('emnist')
  for expected in (str(home / '.cache' / 'fedjax'), str(home / '.tff'),
                   'FEDLITE_DATA_DIR is not set'):
    assert expected in str(err.value), (expected, str(err.value))

  # Digits-only: names both the digits-only and the 62-class files.
  with pytest.raises(datasets.DatasetNotFoundError) as err:
    datasets.load_federated_data('emnist_digits')
  assert 'federated_emnist_digitsonly_train.sqlite' in str(err.value)
  assert 'federated_emnist_train.sqlite' in str(err.value)

  for task, name in (('stackoverflow_nwp', 'stackoverflow_train.sqlite'),
                     ('stackoverflow_tag', 'stackoverflow.sqlite'),
                     ('shakespeare', 'shakespeare_train.h5')):
    with pytest.raises(FileNotFoundError, match=name):
      datasets.load_federated_data(task)


def test_download_needs_a_reachable_network(home, monkeypatch):
  monkeypatch.setattr(sources, 'network_reachable', lambda: False)
  with pytest.raises(datasets.DatasetNotFoundError, match='not reachable'):
    datasets.load_federated_data('emnist', allow_download=True)


def test_download_goes_through_fedjax(data_dir, home, monkeypatch):
  monkeypatch.setattr(sources, 'network_reachable', lambda: True)
  calls = []

  def fake_maybe_download(url, cache_dir=None):
    calls.append((url, cache_dir))
    name = os.path.basename(url)
    os.makedirs(cache_dir, exist_ok=True)
    shutil.copy(data_dir / 'femnist105' / name, cache_dir)
    return os.path.join(cache_dir, name)

  monkeypatch.setattr(downloads, 'maybe_download', fake_maybe_download)
  train, _, info = datasets.load_federated_data('emnist', allow_download=True)
  cache = str(home / '.cache' / 'fedjax')
  assert calls == [
      ('https://storage.googleapis.com/gresearch/fedjax/emnist/'
       'federated_emnist_train.sqlite', cache),
      ('https://storage.googleapis.com/gresearch/fedjax/emnist/'
       'federated_emnist_test.sqlite', cache)]
  assert info.format == 'fedjax_download'
  assert train.num_clients() == 105

  # A failing download is reported as missing data, with the cause.
  def failing(url, cache_dir=None):
    raise OSError('HTTP 503')

  monkeypatch.setattr(downloads, 'maybe_download', failing)
  with pytest.raises(datasets.DatasetNotFoundError, match='HTTP 503'):
    datasets.load_federated_data('shakespeare', allow_download=True)


def test_unknown_task_lists_allowed_names():
  with pytest.raises(ValueError) as err:
    datasets.load_federated_data('cifar10')
  for name in datasets.TASKS:
    assert name in str(err.value)
  assert datasets.DEFAULT_TASK == 'embedded_mnist'


def test_misnamed_file_is_rejected(tmp_path, home):
  for split in ('train', 'test'):
    (tmp_path / f'federated_emnist_{split}.sqlite').write_bytes(b'not sqlite')
  with pytest.raises(ValueError, match='not an SQLite database'):
    datasets.load_federated_data('emnist', str(tmp_path))
