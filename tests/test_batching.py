"""fedlite_jax.algorithms.batching: the client's local batches.

Reference: FedJAX 0.0.17's own ``ClientDataset.shuffle_repeat_batch``
iteration; the vectorized batching must give the same batches, bit for bit,
in the same order.
"""

from __future__ import annotations

import itertools

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import numpy as np
import pytest

from fedlite_jax.algorithms import batching


def _dataset(n: int) -> fedjax.ClientDataset:
  rng = np.random.RandomState(n)
  pre = fedjax.BatchPreprocessor([lambda b: {**b, 'x': b['x'] * 2.0 + 1}])
  return fedjax.ClientDataset(
      {'x': rng.rand(n, 3).astype(np.float32),
       'y': rng.randint(0, 9, n).astype(np.int32)}, pre)


@pytest.mark.parametrize(
    'n,batch_size,epochs,steps,drop,skip',
    [(n, b, e, s, d, k) for n, b, e, s, d, k in itertools.product(
        (1, 7, 20), (1, 4, 20), (1, 3, None), (None, 5), (False, True),
        (False, True)) if (e, s) != (None, None)])
def test_batches_equal_fedjax(n, batch_size, epochs, steps, drop, skip):
  ds = _dataset(n)
  hp = fedjax.ShuffleRepeatBatchHParams(
      batch_size=batch_size, num_epochs=epochs, num_steps=steps,
      drop_remainder=drop, skip_shuffle=skip, seed=11 * n + batch_size)
  want = list(ds.shuffle_repeat_batch(hp))
  got = batching.client_batches(ds, hp, jax.random.PRNGKey(0))
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for k in w:
      np.testing.assert_array_equal(g[k], w[k])
      assert g[k].dtype == w[k].dtype


def test_seed_from_the_client_key_and_infinite_batching():
  ds = _dataset(13)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=4, num_epochs=2, seed=None)
  key = jax.random.PRNGKey(5)
  seeded = hp.replace(seed=batching.shuffle_seed_from_rng(key))
  want = list(ds.shuffle_repeat_batch(seeded))
  got = batching.client_batches(ds, hp, key)
  assert [b['y'].tolist() for b in got] == [b['y'].tolist() for b in want]
  with pytest.raises(ValueError, match='never ends'):
    batching.batch_indices(13, hp.replace(num_epochs=None))


def test_shuffle_seeds_in_one_transfer_equal_one_by_one():
  keys = [jax.random.PRNGKey(i) for i in range(5)] + [
      jax.random.key(7), jax.random.fold_in(jax.random.PRNGKey(3), 2)]
  assert batching.shuffle_seeds(keys) == [
      batching.shuffle_seed_from_rng(k) for k in keys]


def test_a_preprocessor_that_changes_rows_runs_per_batch():
  """FedJAX preprocesses each batch; a preprocessor that drops rows gives
  the same batches here as there."""
  rng = np.random.RandomState(1)
  pre = fedjax.BatchPreprocessor([lambda b: {k: v[::2] for k, v in b.items()}])
  ds = fedjax.ClientDataset({'x': rng.rand(11, 2)}, pre)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=4, num_epochs=2, seed=3)
  want = list(ds.shuffle_repeat_batch(hp))
  got = batching.client_batches(ds, hp, jax.random.PRNGKey(0))
  assert [g['x'].tolist() for g in got] == [w['x'].tolist() for w in want]


@pytest.mark.parametrize('task', ['emnist', 'shakespeare'])
def test_real_clients_batch_as_fedjax(task, data_dir):
  """The real tasks' preprocessors (pixels; character tokens) on 5 clients
  each: the same batches as FedJAX's own iteration."""
  from fedlite_jax import datasets  # pylint: disable=g-import-not-at-top
  folder = {'emnist': 'femnist105', 'shakespeare': 'shakespeare'}[task]
  if not (data_dir / folder).is_dir():
    pytest.skip(f'needs {folder}/ under FEDLITE_DATA_DIR')
  train = datasets.load_federated_data(task, str(data_dir))[0]
  ids = list(train.client_ids())[:5]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=8, num_epochs=2, seed=None)
  for i, (cid, cds) in enumerate(train.get_clients(ids)):
    key = jax.random.PRNGKey(i)
    seeded = hp.replace(seed=batching.shuffle_seed_from_rng(key))
    want = list(cds.shuffle_repeat_batch(seeded))
    got = batching.client_batches(cds, hp, key)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
      assert g.keys() == w.keys()
      for k in w:
        np.testing.assert_array_equal(g[k], w[k])
        assert g[k].dtype == w[k].dtype


def test_reseeded_shuffles_on_threads_equal_fedjax():
  """The shuffles reseed one RandomState per thread: from 4 threads at
  once, interleaved, every client's batches are still FedJAX's (its
  iteration makes a new ``RandomState(seed)`` per client)."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  cases = [(_dataset(n), fedjax.ShuffleRepeatBatchHParams(
      batch_size=4, num_epochs=2, seed=s)) for n, s in
           zip(range(5, 45), range(1000, 1040))]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    got = list(pool.map(lambda c: batching.batch_indices(len(c[0]), c[1]),
                        cases * 3))
  for (cds, hp), idx in zip(cases * 3, got):
    want = list(cds.shuffle_repeat_batch(hp))
    assert len(idx) == len(want)
    for rows, w in zip(idx, want):
      np.testing.assert_array_equal(cds.all_examples()['x'][rows], w['x'])
