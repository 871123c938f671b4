#!/usr/bin/env python3
"""Host time of a round's lane inputs: batches cut on the host against
batch rows of a device table (``--data_on_device``).

For ``--rounds`` fresh cohorts of ``bench_rounds``' population (real FEMNIST
writers under ``$FEDLITE_DATA_DIR``, else its synthetic clients) it runs the
vmap engine's round (``rounds_common.make_work``, then ``VmapEngine`` with
``--lanes_per_device`` lanes and ``--segment_steps``) with a client update
that only sums its batches, so that the round's wall time is its host work:
the shuffles, the batches (or their rows), the stacking and the transfers,
and the device's gathers. Both ways run on the same cohorts in the same
process, alternating; it prints the median milliseconds per round over the
rounds after the first (which compiles) and their ratio, with the segment
inputs made between the calls (``LaneStreams.prefetch`` off: the host work
in series) and on the prefetch threads.

  python benchmarks/bench_round_inputs.py --cohort=100 --lanes_per_device=50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_batching  # noqa: E402
import bench_rounds  # noqa: E402  (imports fedlite_jax first)
import fedjax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fedlite_jax.algorithms import rounds_common as rc  # noqa: E402
from fedlite_jax.rounds import device_rows  # noqa: E402
from fedlite_jax.rounds import engine as engine_lib  # noqa: E402
from fedlite_jax.rounds import streaming  # noqa: E402

WAYS = ('host', 'table')


def _program() -> engine_lib.ClientProgram:
  """A client update whose state sums its batches (no model): the lane
  programs' bookkeeping, gathers and transfers, and no training."""
  def init(shared, client_input):
    del client_input
    return shared

  def step(state, batch):
    return state + sum(jnp.sum(v.astype(jnp.float32))
                       for v in jax.tree.leaves(batch))

  def final(shared, state):
    return state - shared, {'sum': state}
  return engine_lib.ClientProgram(init, step, final)


def measure(cohort: int, rounds: int, lanes: int, segment_steps: int,
            prefetch: bool, seed: int = 0, data_dir: str | None = None
            ) -> dict:
  """``{'ms': {way: median ms per round}, 'ratio': host / table, ...}``;
  checks that both ways sum the same batches (AssertionError if not)."""
  clients, data = bench_rounds.population('femnist', cohort, seed, 0,
                                          data_dir)
  table = device_rows.RowTable(clients)
  hparams = fedjax.ShuffleRepeatBatchHParams(
      batch_size=bench_rounds.FEMNIST_BATCH)
  streaming.LaneStreams.prefetch = prefetch
  engines = {w: engine_lib.VmapEngine(
      _program(), lanes_per_device=lanes, segment_steps=segment_steps)
             for w in WAYS}
  shared = jnp.zeros((), jnp.float32)
  times: dict[str, list[float]] = {w: [] for w in WAYS}
  batches = 0
  for r in range(rounds):
    cohort_r = bench_rounds.fresh_cohort(clients, cohort, seed, r)
    sums = {}
    for w in WAYS:
      if w == 'table':
        cohort_w = [(c, table.dataset(c, ds), k) for c, ds, k in cohort_r]
      else:
        cohort_w = cohort_r
      t = time.perf_counter()
      work = rc.make_work(cohort_w, hparams)
      result = engines[w](shared, work)
      sums[w] = float(jax.block_until_ready(result.weighted_sum))
      times[w].append(time.perf_counter() - t)
      batches = sum(len(x.batches) for x in work)
    if not np.isclose(sums['host'], sums['table'], rtol=1e-6):
      raise AssertionError(f'round {r}: the ways summed different batches: '
                           f'{sums}')
  ms = {w: 1e3 * float(np.median(v[1:] if len(v) > 1 else v))
        for w, v in times.items()}
  return {'data': data, 'cohort': cohort, 'batches': batches,
          'lanes': lanes, 'segment_steps': segment_steps,
          'prefetch': prefetch, 'table_mib': table.nbytes / 2**20,
          'device': jax.devices()[0].device_kind, 'cpus': os.cpu_count(),
          'ms': ms, 'ratio': ms['host'] / ms['table']}


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--cohort', type=int, default=100)
  ap.add_argument('--lanes_per_device', type=int, default=50,
                  help='lanes (an H200 ran 100 FEMNIST clients on 50)')
  ap.add_argument('--segment_steps', type=int, default=4)
  bench_batching.add_cohort_flags(ap)
  args = ap.parse_args(argv)
  results = []
  for prefetch in (False, True):
    res = measure(args.cohort, args.rounds, args.lanes_per_device,
                  args.segment_steps, prefetch, args.seed,
                  data_dir=args.data_dir or os.environ.get('FEDLITE_DATA_DIR'))
    results.append(res)
    print(f"{res['data']}, {res['cohort']} clients, {res['batches']} batches, "
          f"{res['lanes']} lanes, S={res['segment_steps']}, "
          f"prefetch={prefetch}, {res['device']}, {res['cpus']} CPUs: host "
          f"batches {res['ms']['host']:.1f} ms per round, table rows "
          f"{res['ms']['table']:.1f} ms ({res['ratio']:.2f}x)", flush=True)
  if args.output != '-':
    with open(args.output, 'w') as f:
      json.dump({'command': 'python benchmarks/bench_round_inputs.py ' +
                            ' '.join(sys.argv[1:] if argv is None else argv),
                 'results': results}, f, indent=1)
  return results


if __name__ == '__main__':
  main()
