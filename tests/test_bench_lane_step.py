"""benchmarks/bench_lane_step.py, round_phases.py, bench_batching.py and
bench_round_inputs.py on CPU.

References: XLA's cost analysis of the one-client step (a vmapped step over
``L`` lanes does ``L`` clients' FLOPs, to 2%); the round's own wall clock
(the phases nested in a round cannot take longer than the round); the
batch count of FedJAX's batching (``ceil(examples / batch size)`` per
client, one epoch).
"""

from __future__ import annotations

import json
import os

import conftest
import pytest


@pytest.fixture(scope='module')
def benches():
  with conftest.benchmark_modules('bench_lane_step', 'round_phases') as mods:
    yield mods


def test_lane_step_rows(benches, tmp_path):
  bench, _ = benches
  out = tmp_path / 'steps.jsonl'
  bench.main(['--models=transformer_tiny', '--dtypes=float32',
              '--lanes=2,3', '--slots=2', '--segment_steps=2',
              '--repeats=2', f'--output={out}'])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  kinds = [(r['kind'], r['lanes']) for r in rows]
  assert kinds == [('client', 1), ('shared', 3), ('vmap', 2), ('vmap', 3),
                   ('idle', 3), ('transition', 3), ('segment', 3),
                   ('idle_cond', 3)], kinds
  client = rows[0]['flops']
  for r in rows:
    assert r['ms'] > 0 and r['compile_s'] > 0, r
  for r in rows[1:4]:  # shared, vmap: L clients' arithmetic
    assert r['flops'] == pytest.approx(r['lanes'] * client, rel=0.02), r
  # The idle lane-step adds its slots' starts (rows written back) to the
  # masked step.
  idle, idle_cond = rows[4], rows[-1]
  assert idle_cond['bytes'] > idle['bytes'], (idle, idle_cond)
  with pytest.raises(SystemExit):
    bench.main(['--kinds=client,nope'])


def test_round_phases(benches, tmp_path):
  _, phases = benches
  from fedlite_jax.rounds import streaming  # pylint: disable=g-import-not-at-top
  build = streaming.LaneStreams._build  # pylint: disable=protected-access
  ready = vars(streaming.LaneStreams)['_ready']
  out = tmp_path / 'phases.json'
  res = phases.main(['--model=transformer_tiny', '--engine=vmap',
                     '--cohort=4', '--max_examples=40', '--warmup_rounds=1',
                     '--rounds=1', '--lanes_per_device=2',
                     f'--output={out}'])
  del res
  # The wrappers are gone: later tests in this process see the engine.
  assert streaming.LaneStreams._build is build  # pylint: disable=protected-access
  assert vars(streaming.LaneStreams)['_ready'] is ready
  rounds = json.loads(out.read_text())['rounds']
  assert [r['warmup'] for r in rounds] == [True, False]
  for r in rounds:
    p = r['phases_s']
    assert r['calls']['make_work'] == 1 and r['calls']['engine'] == 1, r
    assert p['make_work'] + p['engine'] + p['server_update'] <= r['wall_s']
    assert p['call lanes_segment'] <= p['engine'], r


def test_bench_batching(benches, tmp_path):
  del benches  # Puts benchmarks/ on the path.
  import bench_batching  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'b.json'
  res = bench_batching.main(['--cohort=5', '--threads=1,2', '--rounds=2',
                             f'--output={out}'])
  assert json.loads(out.read_text())['ms'] == {
      str(k): v for k, v in res['ms'].items()}
  assert set(res['ms']) == {1, 2} and all(v > 0 for v in res['ms'].values())
  assert res['speedup'][1] == 1.0
  clients, _ = bench_batching.bench_rounds.population(
      'femnist', 5, 0, 0, os.environ.get('FEDLITE_DATA_DIR'))
  work = bench_batching.bench_rounds.fresh_cohort(clients, 5, 0, 1)
  assert res['batches'] == sum(-(-len(ds) // 20) for _, ds, _ in work)
  with pytest.raises(ValueError, match='must include 1'):
    bench_batching.measure(5, [2], 1)


def test_bench_round_inputs(benches, tmp_path):
  """Both ways run the same batches (the benchmark checks their sums); the
  batch count is FedJAX's; the ratio is of the two medians."""
  del benches  # Puts benchmarks/ on the path.
  import bench_round_inputs  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'r.json'
  results = bench_round_inputs.main(['--cohort=6', '--lanes_per_device=3',
                                     '--segment_steps=2', '--rounds=2',
                                     f'--output={out}'])
  assert [r['prefetch'] for r in results] == [False, True]
  clients, _ = bench_round_inputs.bench_rounds.population(
      'femnist', 6, 0, 0, os.environ.get('FEDLITE_DATA_DIR'))
  work = bench_round_inputs.bench_rounds.fresh_cohort(clients, 6, 0, 1)
  for r in results:
    assert r['batches'] == sum(-(-len(ds) // 20) for _, ds, _ in work), r
    assert r['ratio'] == pytest.approx(r['ms']['host'] / r['ms']['table'])
    assert all(v > 0 for v in r['ms'].values()), r
  assert json.loads(out.read_text())['results'][0]['ms'] == results[0]['ms']
