"""Loads the real test data (FEMNIST-105, Shakespeare) through every path.

Expected counts are those of the data folder's datasets (docs/data.md, "Test
data": 105 FEMNIST writers with 14,708 / 1,685 examples; TFF's Shakespeare, 715
clients with 16,068 / 2,356 snippets); raw arrays are compared with what ``sqlite3`` +
FedJAX's own deserializer or ``h5py`` read straight from the files.
"""

import sqlite3

import fedlite_jax  # noqa: F401  (applies FedJAX fixes; import before fedjax)
from fedjax.core import sqlite_federated_data  # pylint: disable=g-bad-import-order
import h5py
import numpy as np
import pytest

from fedlite_jax import datasets
from fedlite_jax.datasets import tff_hdf5


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('fedlite_cache')


def _raw_rows(path):
  """{client_id: examples} read with sqlite3 + FedJAX's deserializer."""
  connection = sqlite3.connect(path)
  try:
    rows = connection.execute(
        'SELECT client_id, data FROM federated_data ORDER BY rowid').fetchall()
  finally:
    connection.close()
  return {cid: sqlite_federated_data.decompress_and_deserialize(data)
          for cid, data in rows}


def _totals(fd):
  return sum(n for _, n in fd.client_sizes())


def test_femnist105_fedjax_sqlite(data_dir, cache_dir):
  train, test, info = datasets.load_federated_data('emnist', str(data_dir),
                                                   cache_dir=cache_dir)
  assert info.format == 'fedjax_sqlite'
  assert info.source.endswith('femnist105')
  assert (info.num_classes, info.input_shape, info.derived) == (
      62, (28, 28, 1), '')
  assert train.num_clients() == info.num_train_clients == 105
  assert (_totals(train), _totals(test)) == (14708, 1685)

  raw = _raw_rows(str(data_dir / 'femnist105' /
                      'federated_emnist_train.sqlite'))
  num_seen = 0
  for client_id, dataset in train.clients():
    batch = dataset.all_examples()
    x, y = batch['x'], batch['y']
    assert x.dtype == np.float32 and x.shape[1:] == (28, 28, 1)
    assert y.dtype == np.int32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert 0 <= y.min() and y.max() < 62
    # FedJAX's convention: x = 1 - pixels (background 0).
    np.testing.assert_array_equal(x[..., 0], 1 - raw[client_id]['pixels'])
    np.testing.assert_array_equal(y, raw[client_id]['label'])
    num_seen += len(y)
  assert num_seen == 14708
  # Background 0: the average pixel is mostly ink-free.
  assert np.mean(x) < 0.5


def test_femnist105_digits_derived(data_dir, cache_dir, caplog):
  with caplog.at_level('WARNING'):
    train, test, info = datasets.load_federated_data(
        'emnist_digits', str(data_dir), cache_dir=cache_dir)
  assert 'DERIVED' in caplog.text and 'DERIVED' in info.derived
  assert info.num_classes == 10
  for split, fd in (('train', train), ('test', test)):
    raw = _raw_rows(str(data_dir / 'femnist105' /
                        f'federated_emnist_{split}.sqlite'))
    expected = {cid: int(np.sum(ex['label'] < 10)) for cid, ex in raw.items()}
    expected = {cid: n for cid, n in expected.items() if n}
    assert dict(fd.client_sizes()) == expected
    labels = np.concatenate([d.all_examples()['y'] for _, d in fd.clients()])
    assert labels.max() < 10 and len(labels) == sum(expected.values())


def _all_raw(fd):
  return {cid: ds.raw_examples['snippets'] for cid, ds in fd.clients()}


def _all_batches(fd):
  return {cid: ds.all_examples() for cid, ds in fd.clients()}


def test_shakespeare_fedjax_sqlite_equals_tff_hdf5(data_dir, cache_dir):
  sq_train, sq_test, sq_opened = datasets.load_shakespeare_snippets(
      str(data_dir), cache_dir=cache_dir)
  h5_train, h5_test, h5_opened = datasets.load_shakespeare_snippets(
      str(data_dir / 'tff_shakespeare_h5'), cache_dir=cache_dir)
  assert sq_opened.format == 'fedjax_sqlite'
  assert h5_opened.format == 'tff_hdf5'
  for sq, h5, split, total in ((sq_train, h5_train, 'train', 16068),
                               (sq_test, h5_test, 'test', 2356)):
    assert sq.num_clients() == h5.num_clients() == 715
    assert _totals(sq) == _totals(h5) == total
    a, b = _all_raw(sq), _all_raw(h5)
    assert list(a) == list(b)
    for cid in a:
      assert a[cid].dtype == b[cid].dtype == object
      assert list(a[cid]) == list(b[cid])
    # Independent read of one client with h5py.
    with h5py.File(data_dir / 'tff_shakespeare_h5' /
                   f'shakespeare_{split}.h5', 'r') as f:
      cid = 'ALL_S_WELL_THAT_ENDS_WELL_ADAM'
      assert list(b[cid.encode()]) == list(f['examples'][cid]['snippets'][()])

  # The same after the word pipeline (vocabulary built from each source).
  sq_w_train, sq_w_test, sq_info = datasets.load_federated_data(
      'shakespeare', str(data_dir), cache_dir=cache_dir)
  h5_w_train, h5_w_test, h5_info = datasets.load_federated_data(
      'shakespeare', str(data_dir / 'tff_shakespeare_h5'), cache_dir=cache_dir)
  assert sq_info.format == 'fedjax_sqlite' and h5_info.format == 'tff_hdf5'
  assert sq_info.num_classes == h5_info.num_classes == 10004
  assert sq_info.oov_id == 10003
  for sq, h5 in ((sq_w_train, h5_w_train), (sq_w_test, h5_w_test)):
    a, b = _all_batches(sq), _all_batches(h5)
    assert list(a) == list(b)
    for cid in a:
      np.testing.assert_array_equal(a[cid]['x'], b[cid]['x'])
      np.testing.assert_array_equal(a[cid]['y'], b[cid]['y'])
      assert a[cid]['x'].shape[1:] == (20,) and a[cid]['x'].dtype == np.int32
  # Sanity of the pipeline on real text: every row starts with BOS and the
  # most frequent words are in the vocabulary.
  x = np.concatenate([v['x'] for v in a.values()])
  assert np.all(x[:, 0] == datasets.BOS)
  assert 0 <= x.min() and x.max() <= 10003
  assert np.mean(x[:, 1:][x[:, 1:] > 0] == 10003) < 0.1


def test_shakespeare_hdf5_conversion_is_cached(data_dir, cache_dir,
                                               monkeypatch):
  datasets.load_shakespeare_snippets(str(data_dir / 'tff_shakespeare_h5'),
                                     cache_dir=cache_dir)
  monkeypatch.setattr(tff_hdf5, 'iter_clients',
                      lambda *a: pytest.fail('converted again'))
  train, _, opened = datasets.load_shakespeare_snippets(
      str(data_dir / 'tff_shakespeare_h5'), cache_dir=cache_dir)
  assert train.num_clients() == 715
  assert all(str(cache_dir) in p for p in opened.cached.values())
