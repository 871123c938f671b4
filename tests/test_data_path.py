"""The runner's data path: client cache, background cohort loading, and the
per-row seconds and engine counts it reports.

References: FedJAX's own ``UniformGetClientSampler`` over the same data (the
cohort and examples must be identical), a run with the cache and prefetch
off (the results must be identical), and hand-counted LRU evictions.
"""

from __future__ import annotations

import json
import threading

import fedlite_jax  # noqa: F401
import fedjax
import numpy as np
import pytest

from fedlite_jax import datasets
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import data_path
from fedlite_jax.training import runner


def _memory_fd(sizes):
  rng = np.random.RandomState(0)
  return fedjax.InMemoryFederatedData({
      b'c%d' % i: {'x': rng.randn(n, 4).astype(np.float32),
                   'y': rng.randint(0, 3, n).astype(np.int32)}
      for i, n in enumerate(sizes)})


def _same(a, b):
  assert set(a.raw_examples) == set(b.raw_examples)
  for k in a.raw_examples:
    np.testing.assert_array_equal(a.raw_examples[k], b.raw_examples[k])


def test_cache_returns_the_data_and_evicts_least_recently_used():
  fd = _memory_fd([10, 10, 10, 10])
  per_client = 10 * (4 * 4 + 4)  # float32[10, 4] + int32[10]
  cache = data_path.ClientCache(fd, budget_bytes=2 * per_client)
  got = dict(cache.get_clients([b'c0', b'c1']))
  for cid, ds in fd.get_clients([b'c0', b'c1']):
    _same(got[cid], ds)
  assert cache.misses == 2 and cache.cached_bytes == 2 * per_client
  list(cache.get_clients([b'c0']))  # c0 is now the most recent.
  assert cache.hits == 1
  list(cache.get_clients([b'c2']))  # Evicts c1, the least recent.
  assert b'c0' in cache and b'c2' in cache and b'c1' not in cache
  assert cache.cached_bytes == 2 * per_client
  # Order as asked, also when mixing hits and misses.
  assert [c for c, _ in cache.get_clients([b'c3', b'c0', b'c1'])] == [
      b'c3', b'c0', b'c1']
  assert cache.cached_bytes <= 2 * per_client
  with pytest.raises(ValueError, match='budget_bytes'):
    data_path.ClientCache(fd, -1)


@pytest.mark.parametrize('prefetch', [True, False])
def test_prefetched_cohorts_equal_fedjax_sampler(prefetch):
  fd = _memory_fd(range(5, 25))
  cache = data_path.ClientCache(fd, 10**6)
  with data_path.CohortPrefetcher(cache, 4, seed=3,
                                  prefetch=prefetch) as cohorts:
    for r in list(range(5)) + [9, 2]:  # In order, then jumps.
      want = fedjax.client_samplers.UniformGetClientSampler(
          fd, 4, 3, r).sample()
      got = cohorts.get(r)
      assert [c for c, _, _ in got] == [c for c, _, _ in want]
      for (_, a, ka), (_, b, kb) in zip(got, want):
        _same(a, b)
        np.testing.assert_array_equal(ka, kb)


def test_sqlite_cohort_loads_on_the_background_thread(data_dir):
  """SQLite objects belong to their thread: the background loader reads the
  next cohort over its own connection (no fallback to the training thread)
  and returns the examples FedJAX's sampler gives on the training thread."""
  train, _, _ = datasets.load_federated_data('emnist', str(data_dir))
  assert isinstance(train, fedjax.SQLiteFederatedData)
  threads = []

  class Recording(data_path.ClientCache):

    def get_clients(self, client_ids):
      threads.append(threading.current_thread().name)
      return super().get_clients(client_ids)

  for budget in (10**9, 0):  # With the cache, and without (reading only).
    threads.clear()
    cache = Recording(train, budget)
    with data_path.CohortPrefetcher(cache, 3, seed=0) as cohorts:
      cohorts.get(0)  # Starts round 1 in the background thread.
      got = cohorts.get(1)
      assert threads[0] == threading.main_thread().name
      assert threads[1].startswith('cohort'), threads
      assert cohorts.background_loads == 1
    want = fedjax.client_samplers.UniformGetClientSampler(train, 3, 0,
                                                          1).sample()
    assert [c for c, _, _ in got] == [c for c, _, _ in want]
    for (_, a, _), (_, b, _) in zip(got, want):
      _same(a, b)
    assert all((c in cache) == bool(budget) for c, _, _ in got)


def test_failed_background_load_raises():
  fd = _memory_fd(range(5, 25))

  class FailsInBackground:

    def client_ids(self):
      return fd.client_ids()

    def get_clients(self, client_ids):
      if threading.current_thread() is not threading.main_thread():
        raise RuntimeError('disk gone')
      return fd.get_clients(client_ids)

  with data_path.CohortPrefetcher(FailsInBackground(), 4, seed=0) as cohorts:
    cohorts.get(0)
    with pytest.raises(RuntimeError, match='disk gone'):
      cohorts.get(1)


def _run(tmp_path, name, **kw):
  config = config_lib.RunConfig(
      task='embedded_mnist', num_rounds=3, clients_per_round=4,
      client_batch_size=20, max_examples_per_client=60, eval_every=2,
      eval_num_clients=5, progress=False, checkpoint_every=0, seed=1,
      output_dir=str(tmp_path / name), **kw)
  summary = runner.run(config)
  rows = [json.loads(line) for line in
          (tmp_path / name / 'metrics.jsonl').read_text().splitlines()]
  return summary, rows


def test_rows_carry_seconds_and_engine_counts_and_cache_changes_nothing(
    tmp_path):
  summary, rows = _run(tmp_path, 'on')
  off, off_rows = _run(tmp_path, 'off', client_cache_mb=0,
                       prefetch_clients=False)
  assert summary['final_eval'] == off['final_eval']
  assert summary['communication'] == off['communication']
  assert [r['round'] for r in rows] == [1, 2, 3]
  for row in rows:
    for key in ('time/data_seconds', 'time/train_seconds'):
      assert row[key] >= 0
    assert row['engine/executed_steps'] >= row['engine/useful_steps'] > 0
    assert row['engine/segments'] > 0
  assert [r['round'] for r in rows if 'time/eval_seconds' in r] == [2, 3]
  engine = summary['engine']
  for key in ('useful_steps', 'executed_steps', 'sequential_steps', 'segments'):
    assert engine[key] == sum(r[f'engine/{key}'] for r in rows), key
  # Loop engine (CPU default): one jitted call per local step, no padding,
  # one client after another.
  assert engine['name'] == 'loop' and engine['lanes'] == 1
  assert engine['segments'] == engine['useful_steps']
  assert engine['executed_steps'] == engine['useful_steps']
  assert engine['sequential_steps'] == engine['useful_steps']
  # Each program's compile seconds (JAX's events): the rounds' are in them.
  by_program = engine['compile_seconds_by_program']
  assert set(by_program) == set(engine['compilations_by_program'])
  assert min(by_program.values(), default=0) >= 0
  assert sum(by_program.values()) >= sum(
      r['engine/compile_seconds'] for r in rows) - 1e-3 * len(by_program)
  # Compilations differ (the second run reuses this process's programs).
  same = lambda e: {k: v for k, v in e.items() if 'compil' not in k}
  assert same(off['engine']) == same(engine)
