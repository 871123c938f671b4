#!/usr/bin/env python3
"""Overlays run folders: test metric vs round and vs MB uploaded.

  python experiments/plot_runs.py RUN_DIR [RUN_DIR ...] --output=overlay.pdf \
      [--metric=accuracy] [--labels=a,b] [--format=png|pdf|svg] \
      [--allow_mixed_tasks]

The title names the task; one line per run, labelled from its summary.json
(algorithm; upload and download compression, or "no compression"; DP
epsilon and delta of a DP run; seed) unless ``--labels`` are given, in a
legend below the axes (:func:`fedlite_jax.training.plots.plot_runs`). The
format is ``--format``, else the ``--output`` suffix, else png. Runs of
different tasks are refused unless ``--allow_mixed_tasks`` (then a warning
line). A bad folder, metric, label count, format or a mix of tasks is one
error line naming it (exit status 2), and nothing is written.
"""

import argparse
import sys
import warnings

from fedlite_jax.training import ConfigError
from fedlite_jax.training import plots


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='plot_runs.py', description=__doc__,
                                   formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('run_dirs', nargs='+', metavar='RUN_DIR')
  parser.add_argument('--output', required=True,
                      help='File to write (.png, .pdf or .svg).')
  parser.add_argument('--format', default=None,
                      help='png, pdf or svg (default: the --output suffix, '
                      'else png).')
  parser.add_argument('--metric', default=None,
                      help="Test metric (default: the task's, else accuracy).")
  parser.add_argument('--labels', default=None,
                      help='Comma-separated legend labels, one per run.')
  parser.add_argument('--allow_mixed_tasks', action='store_true',
                      help='Overlay runs of different tasks (with a warning).')
  args = parser.parse_args(argv)
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      plots.plot_runs(args.run_dirs, args.output, metric=args.metric,
                      labels=args.labels.split(',') if args.labels else None,
                      format=args.format,
                      allow_mixed_tasks=args.allow_mixed_tasks)
  except ConfigError as e:
    sys.stderr.write(f'plot_runs.py: error: {e}\n')
    sys.exit(2)
  for w in caught:
    if issubclass(w.category, plots.MixedTasksWarning):
      sys.stderr.write(f'plot_runs.py: warning: {w.message}\n')
    else:
      warnings.showwarning(w.message, w.category, w.filename, w.lineno)
  print(args.output)


if __name__ == '__main__':
  main()
