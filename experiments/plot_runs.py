#!/usr/bin/env python3
"""Overlays run folders: test metric vs round and vs MB uploaded.

  python experiments/plot_runs.py RUN_DIR [RUN_DIR ...] --output=overlay.png \
      [--metric=accuracy] [--labels=a,b]

One line per run, labelled from its summary.json (algorithm, upload stages,
seed) unless ``--labels`` are given (:func:`fedlite_jax.training.plots.
plot_runs`). A bad folder, metric or label count is one error line naming
it (exit status 2), and nothing is written.
"""

import argparse
import sys

from fedlite_jax.training import ConfigError
from fedlite_jax.training import plots


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='plot_runs.py', description=__doc__,
                                   formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('run_dirs', nargs='+', metavar='RUN_DIR')
  parser.add_argument('--output', required=True, help='PNG file to write.')
  parser.add_argument('--metric', default=None,
                      help="Test metric (default: the task's, else accuracy).")
  parser.add_argument('--labels', default=None,
                      help='Comma-separated legend labels, one per run.')
  args = parser.parse_args(argv)
  try:
    plots.plot_runs(args.run_dirs, args.output, metric=args.metric,
                    labels=args.labels.split(',') if args.labels else None)
  except ConfigError as e:
    sys.stderr.write(f'plot_runs.py: error: {e}\n')
    sys.exit(2)
  print(args.output)


if __name__ == '__main__':
  main()
