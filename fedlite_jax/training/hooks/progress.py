"""What a user sees while a run trains: a bar on a terminal, else lines."""

from __future__ import annotations

import datetime
import sys
import time
from typing import Any

import tqdm

from fedlite_jax.training import dp_options
from fedlite_jax.training import round_metrics
from fedlite_jax.training import spec
from fedlite_jax.training.build import LOG
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


def _megabytes(n: float) -> str:
  return f'{n / 1e6:,.1f} MB'


def privacy_text(run: Run, row: dict[str, Any]) -> str:
  """``eps=E (delta=D)`` after the row's round of a DP run, else ''."""
  if 'privacy/epsilon' not in row:
    return ''
  delta = spec.option_value(run.config.options, dp_options.DP_DELTA)
  return f'eps={row["privacy/epsilon"]:.4g} (delta={delta:g})'


class ProgressHook(Hook):
  """A tqdm bar when ``--progress`` and stderr is a terminal (process 0);
  otherwise an INFO line per evaluation: round, test metrics, MB uploaded
  so far, seconds per round, the time left; a DP run's epsilon (and
  delta) so far on either. Either way an INFO line says that the first
  round compiles, and how long that took."""

  def __init__(self, stream=None):
    self._stream = stream or sys.stderr
    self._bar = None
    self._first = None
    self._times: list[float] = []
    self._t0 = 0.0

  def start(self, run: Run) -> None:
    """Opens the bar on a terminal."""
    if (run.config.progress and run.writer_process and
        getattr(self._stream, 'isatty', lambda: False)()):
      self._bar = tqdm.tqdm(total=run.config.num_rounds,
                            initial=run.start_round, file=self._stream,
                            desc=f'{run.config.task}/{run.config.algorithm}',
                            unit='round')

  def round_start(self, run: Run, round_num: int) -> None:
    """Says that the first round compiles."""
    self._t0 = time.perf_counter()
    if self._first is None and round_num > 0:
      self._first = round_num
      LOG.info('Round %d: compiling the client program and training.',
               round_num)

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Times the round; moves the bar."""
    if row['round'] == 0:
      return
    self._times.append(time.perf_counter() - self._t0)
    if row['round'] == self._first:
      LOG.info('Round %d done in %.1f s (%.1f s compiling, %d programs).',
               row['round'], self._times[-1],
               row.get('engine/compile_seconds', 0.0),
               row.get('engine/compilations', 0))
    if self._bar is not None:
      self._bar.update(1)

  def evaluation(self, run: Run, row: dict[str, Any]) -> None:
    """Shows the evaluation (bar or INFO line)."""
    metrics = round_metrics.eval_metrics(row)
    eps = privacy_text(run, row)
    if self._bar is not None:
      postfix = {k: f'{v:.4f}' for k, v in metrics.items()
                 if k == run.task.metric}
      if eps:
        postfix['eps'] = f'{row["privacy/epsilon"]:.4g}'
      self._bar.set_postfix(postfix)
      return
    steady = self._times[1:] or self._times
    per_round = sum(steady) / len(steady) if steady else float('nan')
    left = run.config.num_rounds - row['round']
    eta = (str(datetime.timedelta(seconds=round(per_round * left)))
           if steady else '?')
    LOG.info('Round %d/%d: %s; %suploaded %s; %.2f s per round; %s left.',
             row['round'], run.config.num_rounds,
             ', '.join(f'{k} {v:.4g}' for k, v in sorted(metrics.items())),
             eps + '; ' if eps else '',
             _megabytes(row.get('comm/upload_bytes_total', 0.0)), per_round,
             eta)

  def close(self) -> None:
    """Closes the bar."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None
