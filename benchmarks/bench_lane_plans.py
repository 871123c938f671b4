#!/usr/bin/env python3
"""How ``lanes_per_device='auto'`` plans rounds: lanes, steps, padding.

The vmap engine fixes its lane count at the first round, from the first
cohort's local step counts (``rounds.choose_lanes``), and plans every later
cohort on those lanes. This script does the same on ``bench_rounds``'
populations (real FEMNIST-105 writers under ``$FEDLITE_DATA_DIR``, else its
synthetic counts; the 21M Transformer's synthetic token clients), one epoch
of batches (20 images, 16 sequences), fresh cohorts, for two rules:

* ``cost`` (the engine's): the least modeled device time of the first
  cohort's plan, ``sequential steps x (AUTO_STEP_COST_LANES + lanes)``;
* ``ratio`` (the rule before, the reference): the most lanes whose first
  plan executes at most 1.10x its useful steps.

The lane budget is the engine's for a GPU of ``--memory_gib``
(``stats.resolve_lanes``), at most the cohort. For each rule it prints the
lanes, the later cohorts' sequential steps and executed / useful steps
(mean and std), and the modeled time of a round against the other rule's
at several fixed step costs (a lane-step = 1; the cost rule's own constant
among them). These are plans, not timings: which rule runs faster is for a
GPU to show (``gpu_check.sh`` stage ``rounds_ratio_lanes``).

  FEDLITE_DATA_DIR=/path/to/data python benchmarks/bench_lane_plans.py \\
      --output=benchmarks/results/lane_plans.md
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_lane_cost  # noqa: E402  (imports fedlite_jax first)
import bench_rounds  # noqa: E402
import fedjax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedlite_jax.rounds import lanes as lanes_lib  # noqa: E402
from fedlite_jax.rounds import remote  # noqa: E402
from fedlite_jax.rounds import stats  # noqa: E402

RATIO = 1.10


def ratio_lanes(counts, most: int, segment_steps: int) -> int:
  """The rule before: the most lanes whose plan executes <= RATIO x the
  useful steps, else the lanes of the lowest ratio."""
  useful = int(np.sum(counts))
  best, best_ratio = 1, np.inf
  for per in range(most, 0, -1):
    plan = lanes_lib.plan_lanes(counts, per, segment_steps, per,
                                dynamic_steps=True)
    got = plan.executed_steps / useful
    if got <= RATIO:
      return per
    if got < best_ratio:
      best, best_ratio = per, got
  return best


def gpu_lane_budget(model: str, memory_gib: float) -> int:
  """``resolve_lanes('auto')`` for the model's parameters on a GPU of
  ``memory_gib`` (the backend check answered as on a GPU)."""
  params = jax.eval_shape(bench_lane_cost.build_model(model).init,
                          jax.random.key(0))
  with mock.patch.object(stats.jax, 'default_backend', lambda: 'gpu'):
    return stats.resolve_lanes('auto', stats.tree_bytes(params),
                               memory_bytes=int(memory_gib * 2**30))


def cohort_steps(model: str, cohort: int, rounds: int, seed: int
                 ) -> tuple[list[np.ndarray], str]:
  """Local steps of each client of rounds 0..``rounds - 1``'s cohorts (as
  ``bench_rounds`` draws them: its engine fixes its lanes at round 0's)."""
  clients, data = bench_rounds.population(
      model, cohort, seed, 0, os.environ.get('FEDLITE_DATA_DIR'))
  hp = fedjax.ShuffleRepeatBatchHParams(
      batch_size=bench_rounds.FEMNIST_BATCH if model == 'femnist'
      else bench_rounds.LM_BATCH)
  out = []
  for r in range(rounds):
    pick = bench_rounds.fresh_cohort(clients, cohort, seed, r)
    out.append(np.asarray([remote.num_shuffle_repeat_batches(len(c), hp)
                           for _, c, _ in pick], np.int64))
  return out, data


def measure(model: str, cohort: int, rounds: int, segment_steps: int,
            memory_gib: float, step_costs: list[float], seed: int) -> dict:
  """Both rules' lanes and their later cohorts' plans."""
  cohorts, data = cohort_steps(model, cohort, rounds + 1, seed)
  most = min(gpu_lane_budget(model, memory_gib), cohort)
  picks = {'cost': lanes_lib.choose_lanes(cohorts[0], most, segment_steps,
                                          dynamic_steps=True),
           'ratio': ratio_lanes(cohorts[0], most, segment_steps)}
  rules = {}
  for rule, per in picks.items():
    plans = [lanes_lib.plan_lanes(c, per, segment_steps, per,
                                  dynamic_steps=True) for c in cohorts[1:]]
    seq = np.asarray([p.sequential_steps for p in plans], np.float64)
    ratio = np.asarray([p.executed_steps / c.sum()
                        for p, c in zip(plans, cohorts[1:])])
    rules[rule] = {'lanes': per, 'seq_mean': seq.mean(),
                   'seq_std': seq.std(ddof=1), 'ratio_mean': ratio.mean(),
                   'ratio_std': ratio.std(ddof=1),
                   'time': {c: float(np.mean(seq * (c + per)))
                            for c in step_costs}}
  return {'model': model, 'seed': seed, 'data': data, 'most': most,
          'useful_mean': float(np.mean([c.sum() for c in cohorts[1:]])),
          'longest_mean': float(np.mean([c.max() for c in cohorts[1:]])),
          'rules': rules}


def report(results: list[dict], args) -> list[str]:
  costs = [float(c) for c in args.step_costs.split(',')]
  lines = [
      '# Lanes for `lanes_per_device=auto`: the cost rule against the '
      'ratio rule\n',
      f'Command: `python benchmarks/bench_lane_plans.py --cohort={args.cohort}'
      f' --rounds={args.rounds} --memory_gib={args.memory_gib:g} '
      f'--seeds={args.seeds}` (per seed: the population and cohorts; lanes '
      'from the cohort of round 0, as bench_rounds.py draws it; plans of '
      f'rounds 1-{args.rounds}; segment steps {args.segment_steps}, steps '
      'planned as a scan segment runs them; the cost rule\'s step cost '
      f'{lanes_lib.AUTO_STEP_COST_LANES:g} lanes). Plans, not timings.\n',
      '| model | seed | data | lane budget | useful steps | longest client '
      '| rule | lanes | sequential steps | executed / useful | ' +
      ' | '.join(f'modeled time, step cost {c:g}' for c in costs) + ' |',
      '|---|---:|---|---:|---:|---:|---|---:|---:|---:|' + '---:|' * len(costs)]
  ratios: dict[str, dict[float, list[float]]] = {}
  for m in results:
    ref = m['rules']['ratio']
    for rule, r in m['rules'].items():
      times = ' | '.join(f'{r["time"][c] / ref["time"][c]:.3f}x'
                         for c in costs)
      lines.append(
          f'| {m["model"]} | {m["seed"]} | {m["data"]} | {m["most"]} | '
          f'{m["useful_mean"]:.1f} | {m["longest_mean"]:.1f} | {rule} | '
          f'{r["lanes"]} | {r["seq_mean"]:.2f} ± {r["seq_std"]:.2f} | '
          f'{r["ratio_mean"]:.3f} ± {r["ratio_std"]:.3f} | {times} |')
    for c in costs:
      ratios.setdefault(m['model'], {}).setdefault(c, []).append(
          m['rules']['cost']['time'][c] / ref['time'][c])
  lines += [
      '\nModeled time: the mean over the later cohorts of sequential steps x '
      '(step cost + lanes), against the ratio rule\'s (1.000x); a step cost '
      'is the fixed device time of a step in lane-steps (on one H200 the '
      '21M Transformer\'s vmapped step measured 3.8-4.9; a device that the '
      'lanes leave idle has a larger one).\n',
      'Over the seeds, the cost rule\'s modeled time / the ratio rule\'s '
      '(mean ± std; seeds where the cost rule is faster, equal or slower):\n',
      '| model | ' + ' | '.join(f'step cost {c:g}' for c in costs) + ' |',
      '|---|' + '---:|' * len(costs)]
  for model, by_cost in ratios.items():
    cells = []
    for c in costs:
      x = np.asarray(by_cost[c])
      std = x.std(ddof=1) if len(x) > 1 else 0.0
      cells.append(f'{x.mean():.3f}x ± {std:.3f} ({int(np.sum(x < 1))} / '
                   f'{int(np.sum(x == 1))} / {int(np.sum(x > 1))})')
    lines.append(f'| {model} | ' + ' | '.join(cells) + ' |')
  return lines


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--models', default='femnist,transformer_large')
  ap.add_argument('--cohort', type=int, default=100)
  ap.add_argument('--rounds', type=int, default=20,
                  help='later cohorts planned on the first one\'s lanes')
  ap.add_argument('--segment_steps', type=int, default=4)
  ap.add_argument('--memory_gib', default='141',
                  help='the GPU\'s memory in GiB (141: one H200), or '
                  '"device": this process\'s first device')
  ap.add_argument('--step_costs', default='1,4,16,64')
  ap.add_argument('--seeds', default='0,1,2')
  ap.add_argument('--output', default='')
  ap.add_argument('--print_ratio_lanes', default='', metavar='MODEL',
                  help='print only the ratio rule\'s lanes for MODEL (a GPU '
                  'benchmark\'s reference run)')
  args = ap.parse_args(argv)
  args.memory_gib = (stats.device_memory_bytes() / 2**30
                     if args.memory_gib == 'device' else
                     float(args.memory_gib))
  if args.print_ratio_lanes:
    model = args.print_ratio_lanes
    seed = int(args.seeds.split(',')[0])
    cohorts, _ = cohort_steps(model, args.cohort, 1, seed)
    most = min(gpu_lane_budget(model, args.memory_gib), args.cohort)
    print(ratio_lanes(cohorts[0], most, args.segment_steps))
    return
  results = []
  for model in args.models.split(','):
    for seed in [int(x) for x in args.seeds.split(',')]:
      results.append(measure(model, args.cohort, args.rounds,
                             args.segment_steps, args.memory_gib,
                             [float(c) for c in args.step_costs.split(',')],
                             seed))
      r = results[-1]['rules']
      print(f'{model}, seed {seed}: cost rule {r["cost"]["lanes"]} lanes, '
            f'ratio rule {r["ratio"]["lanes"]} lanes', flush=True)
  lines = report(results, args)
  print('\n'.join(lines))
  if args.output:
    with open(args.output, 'w') as f:
      f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
  main()
