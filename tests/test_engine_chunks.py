"""Chunked vmapped cohorts: the plan, its padding, and results equal to the loop.

References: the loop engine (one client at a time, no padding) for the
weighted sums and diagnostics; brute force over every contiguous cut for the
chunk plan's cost; hand-written values for the step grid.
"""

from __future__ import annotations

import itertools

import fedlite_jax  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax.rounds import engine as E


def test_grid_bucket_hand_values():
  got = [E.bucket_steps(n, 'grid') for n in range(1, 42)]
  want = [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20, 20, 20,
          20, 24, 24, 24, 24, 28, 28, 28, 28, 32, 32, 32, 32, 40, 40, 40, 40,
          40, 40, 40, 40, 48]
  assert got == want
  for n in range(1, 5000):
    b = E.bucket_steps(n, 'grid')
    assert n <= b <= 1.25 * n


def test_bad_bucket_and_chunk_size_are_one_line_errors():
  with pytest.raises(ValueError, match="step_bucket must be 'grid'"):
    E.bucket_steps(3, 'fine')
  with pytest.raises(ValueError, match='clients_per_chunk'):
    E.plan_chunks([1, 2], -1)
  with pytest.raises(ValueError, match="clients_per_chunk must be an int"):
    E.resolve_clients_per_chunk('many', 10)
  with pytest.raises(ValueError, match="clients_per_chunk must be an int"):
    E.VmapEngine(_program(), clients_per_chunk=-2)


def _brute_force_cost(counts, max_lanes, bucket='grid', multiple=1):
  """Least sum(lanes * steps) + max_lanes * chunks over every contiguous cut
  of the sorted counts (independent of the dynamic programme)."""
  s = sorted(counts)
  n = len(s)
  sizes = sorted({max_lanes} | {multiple * 2**k for k in range(12)
                                if multiple * 2**k < max_lanes})
  best = None
  for cuts in itertools.product([0, 1], repeat=n - 1):
    bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
    cost = 0
    for lo, hi in zip(bounds, bounds[1:]):
      if hi - lo > max_lanes:
        break
      lanes = min(z for z in sizes if z >= hi - lo)
      cost += lanes * E.bucket_steps(s[hi - 1], bucket) + max_lanes
    else:
      best = cost if best is None else min(best, cost)
  return best


@pytest.mark.parametrize('seed', range(6))
@pytest.mark.parametrize('per_chunk', [1, 3, 4, 0])
def test_plan_is_a_cover_and_optimal(seed, per_chunk):
  rng = np.random.RandomState(seed)
  counts = list(rng.randint(1, 40, size=rng.randint(1, 11)))
  max_lanes = min(per_chunk or len(counts), len(counts))
  chunks = E.plan_chunks(counts, per_chunk, chunk_cost=max_lanes)
  members = sorted(i for c in chunks for i in c.members)
  assert members == list(range(len(counts)))
  for c in chunks:
    assert len(c.members) <= c.lanes <= max_lanes
    assert all(counts[i] <= c.steps for i in c.members)
  cost = E.executed_steps(chunks) + max_lanes * len(chunks)
  assert cost == _brute_force_cost(counts, max_lanes)


def test_plan_lanes_are_multiples_of_the_device_count():
  rng = np.random.RandomState(7)
  counts = list(rng.randint(1, 30, size=23))
  for c in E.plan_chunks(counts, 3, lane_multiple=4):
    assert c.lanes % 4 == 0 and c.lanes <= 12


def test_padding_on_femnist_like_and_heavy_tailed_cohorts():
  """Executed steps stay within 1.25x the useful ones on realistic spreads
  (FEMNIST: ~10 steps on average, up to ~21; a heavy-tailed text cohort)."""
  rng = np.random.RandomState(0)
  cohorts = [np.clip(rng.normal(10, 4, size=100).round(), 1, 21),
             np.ceil(rng.lognormal(2.0, 1.0, size=40)),
             np.ceil(rng.lognormal(2.0, 1.0, size=1000))]
  for counts in cohorts:
    for per_chunk in (10, 64, 0):
      chunks = E.plan_chunks(counts.astype(int), per_chunk)
      ratio = E.executed_steps(chunks) / counts.sum()
      assert ratio <= 1.25, (per_chunk, ratio)
      if per_chunk:
        # Far fewer chunks than clients: lanes are shared.
        assert len(chunks) <= max(4, len(counts) // 4)


def test_auto_chunk_size_follows_memory_and_parameters():
  gib = 2**30
  small = E.resolve_clients_per_chunk('auto', 4 * 2**20, memory_bytes=80 * gib)
  large = E.resolve_clients_per_chunk('auto', 84 * 2**20, memory_bytes=80 * gib)
  lane = E.AUTO_PARAM_COPIES * 84 * 2**20 + E.AUTO_LANE_EXTRA_BYTES
  assert large == int(E.AUTO_MEMORY_FRACTION * 80 * gib // lane)
  assert small == E.AUTO_MAX_CLIENTS_PER_CHUNK
  assert E.resolve_clients_per_chunk('auto', 10**12, memory_bytes=gib) == 1
  assert E.resolve_clients_per_chunk(None, 1) == 0
  assert E.resolve_clients_per_chunk(7, 1) == 7


def _program():
  def init(shared, client_input):
    return {'w': shared['w'], 'seen': jnp.zeros(())}

  def step(state, batch):
    g = jax.grad(lambda w: jnp.mean((batch['x'] @ w - batch['y'])**2))(
        state['w'])
    return {'w': state['w'] - 0.1 * g, 'seen': state['seen'] + 1}

  def final(shared, state):
    return {'delta': state['w'] - shared['w']}, {'steps': state['seen'],
                                                 'norm': jnp.sum(state['w'])}

  return E.ClientProgram(init, step, final)


def _cohort(n, seed=0):
  rng = np.random.RandomState(seed)
  work = []
  for c in range(n):
    batches = [{'x': rng.randn(4, 3).astype(np.float32),
                'y': rng.randn(4).astype(np.float32)}
               for _ in range(rng.randint(1, 12))]
    work.append(E.ClientWork(bytes([c]), batches, {'id': np.int32(c)},
                             float(rng.randint(1, 9))))
  return work


@pytest.mark.parametrize('per_chunk', [1, 3, 0, 'auto'])
def test_vmap_chunks_equal_the_loop_engine(per_chunk):
  work = _cohort(13)
  shared = {'w': np.ones(3, np.float32)}
  ref = E.LoopEngine(_program())(shared, work)
  with E.recording_stats() as rec:
    out = E.VmapEngine(_program(), clients_per_chunk=per_chunk)(shared, work)
    stats = rec.take()
  np.testing.assert_allclose(out.weighted_sum['delta'],
                             ref.weighted_sum['delta'], rtol=1e-5, atol=1e-6)
  assert out.total_weight == ref.total_weight
  for got, want, w in zip(out.diagnostics, ref.diagnostics, work):
    assert int(got['steps']) == len(w.batches) == int(want['steps'])
    np.testing.assert_allclose(got['norm'], want['norm'], rtol=1e-6)
  useful = sum(len(w.batches) for w in work)
  assert stats['client_steps'] == useful
  assert stats['clients'] == 13
  assert useful <= stats['padded_steps']
  if per_chunk == 3:
    assert stats['chunks'] >= 5  # 13 clients, at most 3 per chunk.
    assert stats['clients_per_chunk'] == 3


def test_loop_engine_records_its_steps():
  work = _cohort(5, seed=3)
  with E.recording_stats() as rec:
    E.LoopEngine(_program(), steps_per_call=4)({'w': np.ones(3, np.float32)},
                                                work)
  stats = rec.totals()
  steps = [len(w.batches) for w in work]
  assert stats['client_steps'] == sum(steps)
  assert stats['padded_steps'] == sum(-(-n // 4) * 4 for n in steps)
  assert stats['chunks'] == 5 and stats['name'] == 'loop'
