#!/usr/bin/env python3
"""How long a cohort's local batches take to make, on 1 and more threads.

For ``--rounds`` fresh cohorts of ``bench_rounds``' population (real FEMNIST
writers under ``$FEDLITE_DATA_DIR``, else its synthetic clients) it makes
every client's ``batching.ClientBatches`` (FedJAX's shuffle order, rows
gathered and preprocessed in one call), once per thread count of
``--threads``, in a thread pool as the lane engine's warm-up threads do
(``LaneStreams.warm_threads``). It prints per thread count the median
milliseconds per cohort over the rounds after the first, and the speed-up
over one thread measured in the same process (the reference).

  python benchmarks/bench_batching.py --cohort=100 --threads=1,2,4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_rounds  # noqa: E402  (imports fedlite_jax first)
import fedjax  # noqa: E402
import numpy as np  # noqa: E402

from fedlite_jax.algorithms import batching  # noqa: E402


def measure(cohort: int, threads: list[int], rounds: int, seed: int = 0,
            batch_size: int = bench_rounds.FEMNIST_BATCH,
            data_dir: str | None = None) -> dict:
  """``{'data', 'batches', 'ms': {threads: median ms}, 'speedup':
  {threads: one thread's ms / this}}`` (rounds after the first)."""
  if 1 not in threads:
    raise ValueError(f'--threads must include 1 (the reference); got '
                     f'{threads}.')
  clients, data = bench_rounds.population('femnist', cohort, seed, 0,
                                          data_dir)
  times: dict[int, list[float]] = {w: [] for w in threads}
  batches = 0
  for r in range(rounds):
    work = bench_rounds.fresh_cohort(clients, cohort, seed, r)
    for w in threads:
      made = [batching.ClientBatches(ds, fedjax.ShuffleRepeatBatchHParams(
          batch_size=batch_size, seed=i)) for i, (_, ds, _) in
              enumerate(work)]
      t = time.perf_counter()
      if w == 1:
        for b in made:
          b.make()
      else:
        with concurrent.futures.ThreadPoolExecutor(w) as pool:
          list(pool.map(lambda b: b.make(), made))
      times[w].append(time.perf_counter() - t)
      batches = sum(len(b) for b in made)
  ms = {w: 1e3 * float(np.median(v[1:] if len(v) > 1 else v))
        for w, v in times.items()}
  return {'data': data, 'cohort': cohort, 'batches': batches,
          'cpus': os.cpu_count(), 'ms': ms,
          'speedup': {w: ms[1] / ms[w] for w in threads}}


def add_cohort_flags(ap: argparse.ArgumentParser) -> None:
  """``--rounds``, ``--seed``, ``--data_dir``, ``--output`` (shared with
  ``bench_round_inputs.py``)."""
  ap.add_argument('--rounds', type=int, default=6,
                  help='fresh cohorts; medians over all but the first')
  ap.add_argument('--seed', type=int, default=0)
  ap.add_argument('--data_dir', default=None,
                  help='FEMNIST data (default $FEDLITE_DATA_DIR)')
  ap.add_argument('--output', default='-', help='JSON file ("-": none)')


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--cohort', type=int, default=100)
  ap.add_argument('--threads', default='1,2,4',
                  help='comma list of thread counts; must include 1')
  add_cohort_flags(ap)
  args = ap.parse_args(argv)
  res = measure(args.cohort, [int(t) for t in args.threads.split(',')],
                args.rounds, args.seed,
                data_dir=args.data_dir or os.environ.get('FEDLITE_DATA_DIR'))
  print(f"{res['data']}, {res['cohort']} clients, {res['batches']} batches "
        f"per cohort, {res['cpus']} CPUs")
  for w, v in res['ms'].items():
    print(f'{w} thread(s): {v:.1f} ms per cohort, {res["speedup"][w]:.2f}x '
          'one thread')
  res['command'] = 'python benchmarks/bench_batching.py ' + ' '.join(
      sys.argv[1:] if argv is None else argv)
  if args.output != '-':
    with open(args.output, 'w') as f:
      json.dump(res, f, indent=1)
  return res


if __name__ == '__main__':
  main()
