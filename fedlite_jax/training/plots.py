"""Figures of runs: ``curves.png`` of one run (:func:`plot_curves`) and
several run folders overlaid (:func:`plot_runs`, ``experiments/plot_runs.py``).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterable, Mapping, Optional, Sequence

from fedlite_jax.training import config as config_lib
from fedlite_jax.training import outputs
from fedlite_jax.training import round_metrics

MB = 1e6  # bytes per MB on the upload axes
_STYLE = {'font.size': 11, 'axes.titlesize': 11, 'legend.fontsize': 9}


def run_title(config: config_lib.RunConfig) -> str:
  """``task / algorithm (seed s)`` and the compression stages, if any."""
  stages = '; '.join(f'{d} {config.options[d]}' for d in ('upload', 'download')
                     if config.options.get(d))
  return (f'{config.task} / {config.algorithm} (seed {config.seed})' +
          (f'\n{stages}' if stages else ''))


def _figure(ncols: int, title: str):
  """A Figure (no pyplot state) of ``ncols`` axes in a row, and the axes."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(4.6 * ncols, 4.0))
  fig.suptitle(title)
  return fig, fig.subplots(1, ncols)


def _save(fig, path: str | os.PathLike) -> None:
  for ax in fig.axes:
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=150)


def _metric_panels(ax_round, ax_mb, series: Sequence[list[dict]],
                   labels: Sequence[Optional[str]], metric: str) -> None:
  """Test ``metric`` of each series of evaluation rows vs round (integer
  ticks) and vs cumulative upload MB (log where it spans a decade; 0 MB
  left off there)."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  key = f'eval/{metric}'
  mb = [[r['comm/upload_bytes_total'] / MB for r in s] for s in series]
  positive = [x for xs in mb for x in xs if x > 0]
  log = bool(positive) and max(positive) >= 10 * min(positive)
  for s, xs, label in zip(series, mb, labels):
    ax_round.plot([r['round'] for r in s], [r[key] for r in s], marker='.',
                  label=label)
    keep = [i for i, x in enumerate(xs) if x > 0 or not log]
    ax_mb.plot([xs[i] for i in keep], [s[i][key] for i in keep], marker='.',
               label=label)
  if log:  # plain numbers (4, 10, 40), not 4 x 10^0
    ax_mb.set_xscale('log')
    ax_mb.xaxis.set_major_formatter(ticker.LogFormatter())
    ax_mb.xaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
  ax_mb.set_xlabel('cumulative upload (MB)')
  ax_round.set_xlabel('round')
  for ax in (ax_round, ax_mb):
    ax.set_ylabel(f'test {metric}')
  ax_round.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))


def plot_curves(output_dir: str | os.PathLike, rows: Iterable[dict],
                metric: str, title: str):
  """Saves ``output_dir/curves.png``: training loss per round beside test
  ``metric`` vs round and vs cumulative upload MB; returns the Figure
  (None, and nothing saved, without rows)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib.ticker import MaxNLocator  # pylint: disable=g-import-not-at-top
  rows = list(rows)
  evals = [r for r in rows if f'eval/{metric}' in r]
  train = [r for r in rows if 'train/loss' in r]
  if not evals and not train:
    return None
  with matplotlib.rc_context(_STYLE):
    fig, (ax0, ax1, ax2) = _figure(3, title)
    ax0.plot([r['round'] for r in train], [r['train/loss'] for r in train])
    ax0.set(xlabel='round', ylabel='training loss')
    ax0.xaxis.set_major_locator(MaxNLocator(integer=True))
    _metric_panels(ax1, ax2, [evals], [None], metric)
    _save(fig, pathlib.Path(output_dir) / 'curves.png')
  return fig


def run_label(summary: Mapping[str, Any]) -> str:
  """``algorithm, upload <stages> (seed s)`` from a run's summary.json."""
  run_flags = summary.get('flags', {})
  upload = run_flags.get('options', {}).get('upload') or 'uncompressed'
  return (f'{summary.get("algorithm", "?")}, upload {upload} '
          f'(seed {run_flags.get("seed")})')


def _read_run(run_dir: str | os.PathLike) -> tuple[list[dict], dict]:
  """A run folder's evaluation rows and summary ({} before it ends)."""
  folder = pathlib.Path(run_dir)
  if not (folder / 'metrics.jsonl').is_file():
    raise config_lib.ConfigError(f'{run_dir}: no metrics.jsonl (not a run '
                                 'folder)')
  rows = outputs.read_metrics(folder / 'metrics.jsonl')
  summary = folder / 'summary.json'
  return (round_metrics.evaluations(rows),
          json.loads(summary.read_text()) if summary.is_file() else {})


def plot_runs(run_dirs: Sequence[str | os.PathLike], output: str | os.PathLike,
              metric: Optional[str] = None,
              labels: Optional[Sequence[str]] = None):
  """Test ``metric`` (default: the first run's task metric, else accuracy)
  of each run folder vs round and vs cumulative upload MB, one line per run
  (labelled by :func:`run_label`), saved to ``output``; returns the Figure.

  Raises:
    ConfigError: naming the bad value (a folder without metrics.jsonl, a
      metric a run has no evaluations of, a label count); nothing written.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  runs = [_read_run(d) for d in run_dirs]
  if metric is None:
    from fedlite_jax.training import tasks  # pylint: disable=g-import-not-at-top
    task = tasks.TASKS.get(runs[0][1].get('task')) if runs else None
    metric = task.metric if task is not None else 'accuracy'
  key = f'eval/{metric}'
  for d, (evals, _) in zip(run_dirs, runs):
    if not any(key in r for r in evals):
      have = sorted({m for r in evals for m in round_metrics.eval_metrics(r)})
      raise config_lib.ConfigError(f'--metric={metric}: {d} has no {key} '
                                   f'(it has: {", ".join(have) or "none"})')
  if labels is not None and len(labels) != len(runs):
    raise config_lib.ConfigError(f'--labels: {len(labels)} labels for '
                                 f'{len(runs)} runs')
  labels = labels or [run_label(s) if s else pathlib.Path(d).name
                      for d, (_, s) in zip(run_dirs, runs)]
  with matplotlib.rc_context(_STYLE):
    fig, axes = _figure(2, f'test {metric}')
    _metric_panels(*axes, [[r for r in e if key in r] for e, _ in runs],
                   labels, metric)
    axes[1].legend()
    pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
    _save(fig, output)
  return fig
