"""benchmarks/bench_lane_plans.py: both lane rules on bench_rounds'
populations (synthetic without data), checked against plans of every lane
count made here: the ratio rule's lanes are the most under 1.10x, the cost
rule's the least modeled time (``rounds.choose_lanes``, an independent
brute force)."""

from __future__ import annotations

import conftest
import numpy as np
import pytest

from fedlite_jax.rounds import lanes as lanes_lib


@pytest.fixture(scope='module')
def bench():
  with conftest.benchmark_modules('bench_lane_plans') as (bench_lane_plans,):
    yield bench_lane_plans


def test_both_rules_against_every_lane_count(bench, monkeypatch):
  monkeypatch.delenv('FEDLITE_DATA_DIR', raising=False)  # Synthetic counts.
  cohorts, data = bench.cohort_steps('transformer_large', 30, 4, seed=0)
  assert data == 'synthetic' and len(cohorts) == 4
  first = cohorts[0]
  plans = {per: lanes_lib.plan_lanes(first, per, 4, per, dynamic_steps=True)
           for per in range(1, 31)}
  under = [per for per, p in plans.items()
           if p.executed_steps <= 1.10 * first.sum()]
  assert bench.ratio_lanes(first, 30, 4) == max(under)
  cost = lanes_lib.AUTO_STEP_COST_LANES
  times = {per: p.sequential_steps * (cost + per) for per, p in plans.items()}
  m = bench.measure('transformer_large', 30, 3, 4, 141.0, [1.0, cost], 0)
  assert m['most'] == 30  # The cohort, under the budget (53 lanes).
  assert m['rules']['ratio']['lanes'] == max(under)
  assert times[m['rules']['cost']['lanes']] == min(times.values())
  for rule in m['rules'].values():
    seq = [lanes_lib.plan_lanes(c, rule['lanes'], 4, rule['lanes'],
                                dynamic_steps=True).sequential_steps
           for c in cohorts[1:]]
    assert rule['seq_mean'] == pytest.approx(np.mean(seq))
    assert rule['time'][1.0] == pytest.approx(np.mean(seq) *
                                              (1 + rule['lanes']))


def test_report_rows(bench, monkeypatch, tmp_path, capsys):
  monkeypatch.delenv('FEDLITE_DATA_DIR', raising=False)
  out = tmp_path / 'plans.md'
  bench.main(['--models=femnist,transformer_large', '--cohort=20',
              '--rounds=2', '--seeds=0,1', f'--output={out}'])
  text = out.read_text()
  for model in ('femnist', 'transformer_large'):
    for seed in (0, 1):
      assert f'| {model} | {seed} | synthetic |' in text
  for rule in ('cost', 'ratio'):
    assert f' | {rule} | ' in text
  # The reference rule's modeled time is 1.000x of itself at each cost.
  ratio_rows = [l for l in text.splitlines() if ' | ratio | ' in l]
  assert len(ratio_rows) == 4
  for row in ratio_rows:
    assert row.endswith('| 1.000x | 1.000x | 1.000x | 1.000x |'), row
  # The summary over seeds: each model's 2 seeds counted once per cost.
  for model in ('femnist', 'transformer_large'):
    row = next(l for l in text.splitlines() if l.startswith(f'| {model} | ')
               and 'x ±' in l)
    counts = [tuple(map(int, c.split('(')[1].split(')')[0].split(' / ')))
              for c in row.split(' | ')[1:]]
    assert counts and all(sum(c) == 2 for c in counts), row
  assert 'cost rule' in capsys.readouterr().out
  bench.main(['--print_ratio_lanes=transformer_large', '--cohort=30'])
  cohorts, _ = bench.cohort_steps('transformer_large', 30, 1, seed=0)
  assert capsys.readouterr().out == (
      f'{bench.ratio_lanes(cohorts[0], 30, 4)}\n')
