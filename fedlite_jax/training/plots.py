"""Figures of runs: ``curves.<format>`` of one run (:func:`plot_curves`) and
several run folders overlaid (:func:`plot_runs`, ``experiments/plot_runs.py``).

Every figure says what was run: the task in its title and, per run
(:func:`describe`), the algorithm, the compression of both directions (the
``--upload`` / ``--download`` stage strings), DP-FedAvg's (epsilon, delta)
when ``--dp_clip`` is set (McMahan et al. 2018; the accounting of
``dp_options.Privacy``) and the seed. Legends sit below the axes and
titles above them, inside the figure (constrained layout); round axes
have integer ticks.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import textwrap
import warnings
from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import outputs
from fedlite_jax.training import round_metrics
from fedlite_jax.training import spec

MB = 1e6  # bytes per MB on the upload axes
#: File formats a figure is saved in (matplotlib backends).
FORMATS = ('png', 'pdf', 'svg')
#: What :func:`run_title` writes for a DP run's epsilon when not given;
#: :func:`plot_curves` puts the rows' last ``privacy/epsilon`` there.
EPSILON_PENDING = 'eps=?'
EPSILON_KEY = 'privacy/epsilon'
_STYLE = {'font.size': 11, 'axes.titlesize': 11, 'legend.fontsize': 9}
_LABEL_WIDTH = 90  # characters per legend line before it wraps
_TITLE_WIDTH = 110  # characters per title line before it wraps


class MixedTasksWarning(UserWarning):
  """:func:`plot_runs` overlaid runs of different tasks
  (``allow_mixed_tasks``)."""


class RunInfo(NamedTuple):
  """What a run was, as its labels and titles name it.

  Attributes:
    task: ``--task`` (None when unknown).
    algorithm: ``--algorithm``.
    seed: ``--seed``.
    options: the algorithm options (``--upload``, ``--download``,
      ``--pvt_fraction``, ``--dp_*``, ...).
    dp: whether DP-FedAvg ran (``--dp_clip`` set).
    epsilon: epsilon of the rounds done at ``delta`` (None when not known).
    delta: the delta of epsilon (None without DP).
  """
  task: Optional[str]
  algorithm: str
  seed: Any
  options: Mapping[str, Any]
  dp: bool = False
  epsilon: Optional[float] = None
  delta: Optional[float] = None


def _num(x: float) -> str:
  """3 significant digits, exponents without leading zeros (1e-06 -> 1e-6)."""
  return re.sub(r'e([+-])0*(\d)', lambda m: 'e' + m.group(1).replace(
      '+', '') + m.group(2), f'{x:.3g}')


def compression_text(options: Mapping[str, Any]) -> str:
  """``upload U, download D`` from the ``--upload`` / ``--download`` stage
  strings (``uncompressed`` for an empty one; ``no compression`` when both
  are empty), with ``pvt_fraction f`` when ``--pvt_fraction`` < 1."""
  up, down = options.get('upload') or '', options.get('download') or ''
  text = (f'upload {up or "uncompressed"}, download {down or "uncompressed"}'
          if up or down else 'no compression')
  pvt = options.get('pvt_fraction', 1.0)
  return text + (f', pvt_fraction {_num(pvt)}' if pvt < 1 else '')


def dp_text(epsilon: Optional[float], delta: float) -> str:
  """``DP eps=E (delta D)``: the (epsilon, delta) of DP-FedAvg after the
  rounds done (epsilon: :data:`EPSILON_PENDING`'s ``?`` when None;
  ``inf`` for noise multiplier 0)."""
  eps = EPSILON_PENDING if epsilon is None else f'eps={_num(epsilon)}'
  return f'DP {eps} (delta {_num(delta)})'


def describe(info: RunInfo) -> str:
  """``algorithm; compression; DP eps=E (delta D); seed s`` (the DP part
  only for a DP run): a run's legend label."""
  parts = [info.algorithm, compression_text(info.options)]
  if info.dp:
    parts.append(dp_text(info.epsilon, info.delta))
  return '; '.join(parts + [f'seed {info.seed}'])


def run_title(config: config_lib.RunConfig,
              epsilon: Optional[float] = None) -> str:
  """``task: algorithm (seed s)`` over the compression of both directions
  and, for a DP run, ``DP eps=E (delta D)`` (:data:`EPSILON_PENDING` when
  ``epsilon`` is None; :func:`plot_curves` fills it from the rows).

  Args:
    config: the run's (resolved) settings.
    epsilon: epsilon after the run's rounds (summary.json ``privacy``).
  """
  second = compression_text(config.options)
  if dp_options.enabled(config):
    delta = spec.option_value(config.options, dp_options.DP_DELTA)
    second += '; ' + dp_text(epsilon, float(delta))
  return (f'{config.task}: {config.algorithm} (seed {config.seed})\n' +
          _wrap(second, _TITLE_WIDTH))


def output_format(output: str | os.PathLike, format: Optional[str] = None,
                  flag: str = '--format') -> str:
  """The file format ``output`` is saved in: ``format``, else its suffix
  (``.png``, ``.pdf``, ``.svg``), else png for a name without one.

  Args:
    output: the file to write.
    format: one of :data:`FORMATS`, or None.
    flag: the flag that ``format`` came from, for the error line.

  Returns:
    One of :data:`FORMATS`.

  Raises:
    ConfigError: a ``format`` not in :data:`FORMATS` or contradicting a
      suffix in them (``o.png`` with pdf), or without ``format`` a suffix
      not in them (one line naming it).
  """
  allowed = ', '.join(FORMATS)
  suffix = pathlib.Path(output).suffix.lower().lstrip('.')
  if format is not None:
    if format not in FORMATS:
      raise config_lib.ConfigError(f'{flag}={format}: unknown format; use '
                                   f'one of {allowed}.')
    if suffix in FORMATS and suffix != format:
      raise config_lib.ConfigError(
          f'{flag}={format} but {output} ends in .{suffix}; make them agree.')
    return format
  if suffix and suffix not in FORMATS:
    raise config_lib.ConfigError(
        f'{output}: unknown format .{suffix}; use one of {allowed} (or '
        f'{flag}).')
  return suffix or 'png'


def _wrap(text: str, width: int) -> str:
  """``text`` in lines of at most ``width`` characters, broken after its
  ``; `` separators first (inside a part only when the part is longer)."""
  lines: list[str] = []
  for part in text.split('; '):
    if lines and len(lines[-1]) + 2 + len(part) <= width:
      lines[-1] += '; ' + part
      continue
    if lines:
      lines[-1] += ';'
    lines += textwrap.wrap(part, width) or ['']
  return '\n'.join(lines)


def _figure(ncols: int, title: str, height: float = 4.0):
  """A constrained-layout Figure (no pyplot state) of ``ncols`` axes in a
  row, and the axes."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(4.8 * ncols, height), layout='constrained')
  fig.suptitle(title)
  return fig, fig.subplots(1, ncols)


def _save(fig, path: str | os.PathLike, fmt: str) -> None:
  for ax in fig.axes:
    ax.grid(alpha=0.3)
  fig.savefig(path, format=fmt, dpi=150, bbox_inches='tight', pad_inches=0.1)


def _round_axis(ax, rounds: Sequence[int]) -> None:
  """Integer ticks on ``ax``'s round axis, also for a single round."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  ax.set_xlabel('round')
  ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, min_n_ticks=1))
  if rounds and max(rounds) - min(rounds) < 1:
    ax.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)


def _metric_panels(ax_round, ax_mb, series: Sequence[list[dict]],
                   labels: Sequence[Optional[str]], metric: str) -> list:
  """Test ``metric`` of each series of evaluation rows vs round (integer
  ticks) and vs cumulative upload MB (log where it spans a decade; 0 MB
  left off there); returns the lines of ``ax_round``."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  key = f'eval/{metric}'
  mb = [[r['comm/upload_bytes_total'] / MB for r in s] for s in series]
  positive = [x for xs in mb for x in xs if x > 0]
  log = bool(positive) and max(positive) >= 10 * min(positive)
  lines = []
  for s, xs, label in zip(series, mb, labels):
    lines += ax_round.plot([r['round'] for r in s], [r[key] for r in s],
                           marker='.', label=label)
    keep = [i for i, x in enumerate(xs) if x > 0 or not log]
    ax_mb.plot([xs[i] for i in keep], [s[i][key] for i in keep], marker='.',
               label=label)
  if log:  # plain numbers (4, 10, 40), not 4 x 10^0
    ax_mb.set_xscale('log')
    ax_mb.xaxis.set_major_formatter(ticker.LogFormatter())
    ax_mb.xaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False))
  ax_mb.set_xlabel('cumulative upload (MB)')
  _round_axis(ax_round, [r['round'] for s in series for r in s])
  for ax in (ax_round, ax_mb):
    ax.set_ylabel(f'test {metric}')
  return lines


def _last_epsilon(rows: Sequence[dict]) -> Optional[float]:
  """The last row's ``privacy/epsilon`` (None if no row has one)."""
  found = [r[EPSILON_KEY] for r in rows if EPSILON_KEY in r]
  return float(found[-1]) if found else None


def plot_curves(output_dir: str | os.PathLike, rows: Iterable[dict],
                metric: str, title: str, format: str = 'png'):
  """Saves ``output_dir/curves.<format>``: training loss per round beside
  test ``metric`` vs round and vs cumulative upload MB, under ``title``.

  Args:
    output_dir: the run's folder.
    rows: the run's metrics rows (``round``, ``train/loss``,
      ``eval/<metric>``, ``comm/upload_bytes_total`` in bytes,
      ``privacy/epsilon`` of a DP run).
    metric: the task's test metric, e.g. ``accuracy``.
    title: e.g. :func:`run_title`; its :data:`EPSILON_PENDING` becomes the
      last row's ``privacy/epsilon``.
    format: one of :data:`FORMATS`.

  Returns:
    The matplotlib Figure; None (and nothing saved) without rows.

  Raises:
    ConfigError: ``format`` not in :data:`FORMATS`.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(output_dir) / f'curves.{format}'
  fmt = output_format(path, format, flag='--plot_format')
  rows = list(rows)
  evals = [r for r in rows if f'eval/{metric}' in r]
  train = [r for r in rows if 'train/loss' in r]
  if not evals and not train:
    return None
  epsilon = _last_epsilon(rows)
  if epsilon is not None:
    title = title.replace(EPSILON_PENDING, f'eps={_num(epsilon)}')
  with matplotlib.rc_context(_STYLE):
    fig, (ax0, ax1, ax2) = _figure(3, title)
    ax0.plot([r['round'] for r in train], [r['train/loss'] for r in train],
             marker='.' if len(train) < 2 else None)
    ax0.set_ylabel('training loss')
    _round_axis(ax0, [r['round'] for r in train])
    _metric_panels(ax1, ax2, [evals], [None], metric)
    if train and evals:  # one round axis over both panels
      ax1.sharex(ax0)
    _save(fig, path, fmt)
  return fig


def _summary_info(summary: Mapping[str, Any]) -> RunInfo:
  """The :class:`RunInfo` in summary.json's contents (``task``,
  ``algorithm``, ``flags``, and ``privacy`` of a DP run)."""
  flags, privacy = summary.get('flags', {}), summary.get('privacy')
  return RunInfo(summary.get('task'), summary.get('algorithm', '?'),
                 flags.get('seed'), flags.get('options', {}),
                 privacy is not None,
                 *((privacy.get('epsilon'), privacy.get('delta'))
                   if privacy else (None, None)))


def _run_info(folder: pathlib.Path, rows: Sequence[dict]
              ) -> Optional[RunInfo]:
  """The :class:`RunInfo` of a run folder: from summary.json once the run
  ended, else from run.json's fingerprint and the rows; None without
  either."""
  summary = folder / 'summary.json'
  if summary.is_file():
    return _summary_info(json.loads(summary.read_text()))
  fingerprint = outputs.read_run_identity(folder)
  if fingerprint is None:
    return None
  options = fingerprint.get('options', {})
  dp = bool(options.get(dp_options.DP_CLIP.name, 0))
  return RunInfo(fingerprint.get('task'), fingerprint.get('algorithm', '?'),
                 fingerprint.get('seed'), options, dp,
                 _last_epsilon(rows) if dp else None,
                 float(options.get(dp_options.DP_DELTA.name,
                                   dp_options.DP_DELTA.default))
                 if dp else None)


def _read_run(run_dir: str | os.PathLike
              ) -> tuple[list[dict], Optional[RunInfo]]:
  """A run folder's evaluation rows and :class:`RunInfo` (None if unknown)."""
  folder = pathlib.Path(run_dir)
  if not (folder / 'metrics.jsonl').is_file():
    raise config_lib.ConfigError(f'{run_dir}: no metrics.jsonl (not a run '
                                 'folder)')
  rows = outputs.read_metrics(folder / 'metrics.jsonl')
  return round_metrics.evaluations(rows), _run_info(folder, rows)


def run_label(summary: Mapping[str, Any]) -> str:
  """:func:`describe` of a finished run from its summary.json contents."""
  return describe(_summary_info(summary))


def _check_tasks(run_dirs: Sequence[Any], infos: Sequence[Optional[RunInfo]],
                 allow_mixed_tasks: bool) -> list[str]:
  """The runs' distinct known tasks, in order.

  Raises:
    ConfigError: runs of two or more tasks without ``allow_mixed_tasks``
      (which makes it a warning instead).
  """
  tasks = {}
  for d, info in zip(run_dirs, infos):
    if info is not None and info.task is not None:
      tasks.setdefault(info.task, d)
  if len(tasks) > 1:
    text = ('runs of different tasks: ' + ', '.join(
        f'{d} is {t}' for t, d in tasks.items()) + '; plot one task at a '
            'time (or pass --allow_mixed_tasks).')
    if not allow_mixed_tasks:
      raise config_lib.ConfigError(text)
    warnings.warn(text.split(';')[0] + ' (overlaid: --allow_mixed_tasks).',
                  MixedTasksWarning, stacklevel=3)
  return list(tasks)


def _default_metric(infos: Sequence[Optional[RunInfo]]) -> str:
  """The first run's task metric, else accuracy."""
  from fedlite_jax.training import tasks  # pylint: disable=g-import-not-at-top
  task = tasks.TASKS.get(infos[0].task) if infos and infos[0] else None
  return task.metric if task is not None else 'accuracy'


def _labels(run_dirs, infos, labels, mixed: bool) -> list[str]:
  """``labels`` (checked), else each run's :func:`describe` (its task first
  when ``mixed``; the folder name for a run without summary or run.json)."""
  if labels is not None and len(labels) != len(run_dirs):
    raise config_lib.ConfigError(f'--labels: {len(labels)} labels for '
                                 f'{len(run_dirs)} runs')
  if labels is None:
    labels = [pathlib.Path(d).name if info is None else
              (f'{info.task}: ' if mixed else '') + describe(info)
              for d, info in zip(run_dirs, infos)]
  return [_wrap(str(label), _LABEL_WIDTH) for label in labels]


def plot_runs(run_dirs: Sequence[str | os.PathLike], output: str | os.PathLike,
              metric: Optional[str] = None,
              labels: Optional[Sequence[str]] = None,
              format: Optional[str] = None, allow_mixed_tasks: bool = False):
  """Test ``metric`` of each run folder vs round and vs cumulative upload
  MB, one line per run, saved to ``output``: the task in the title, the
  legend (labels: :func:`describe`) below the axes, inside the figure.

  Args:
    run_dirs: run folders (each with metrics.jsonl).
    output: the file to write (its folder is created).
    metric: default: the first run's task metric, else accuracy.
    labels: one legend label per run (long ones wrap).
    format: png, pdf or svg (default: ``output``'s suffix, else png).
    allow_mixed_tasks: overlay runs of different tasks with a warning.

  Returns:
    The matplotlib Figure.

  Raises:
    ConfigError: naming the bad value (a folder without metrics.jsonl, a
      metric a run has no evaluations of, a label count, runs of different
      tasks, an unknown format); nothing written.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  fmt = output_format(output, format)
  runs = [_read_run(d) for d in run_dirs]
  infos = [info for _, info in runs]
  tasks = _check_tasks(run_dirs, infos, allow_mixed_tasks)
  metric = metric or _default_metric(infos)
  key = f'eval/{metric}'
  for d, (evals, _) in zip(run_dirs, runs):
    if not any(key in r for r in evals):
      have = sorted({m for r in evals for m in round_metrics.eval_metrics(r)})
      raise config_lib.ConfigError(f'--metric={metric}: {d} has no {key} '
                                   f'(it has: {", ".join(have) or "none"})')
  labels = _labels(run_dirs, infos, labels, len(tasks) > 1)
  title = (f'{" + ".join(tasks) or "unknown task"}: test {metric} vs round '
           'and vs cumulative upload')
  height = 4.0 + 0.17 * sum(label.count('\n') + 1 for label in labels)
  with matplotlib.rc_context(_STYLE):
    fig, axes = _figure(2, title, height=height)
    lines = _metric_panels(*axes, [[r for r in e if key in r] for e, _ in runs],
                           labels, metric)
    fig.legend(lines, labels, loc='outside lower center',
               ncols=1 if max(map(len, labels), default=0) > 40 else 2)
    pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
    _save(fig, output, fmt)
  return fig
