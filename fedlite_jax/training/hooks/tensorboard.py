"""TensorBoard: every row's scalars (tag = key) and the run's hparams."""

from __future__ import annotations

import math
from typing import Any

from fedlite_jax.training import round_metrics
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class TensorBoardHook(Hook):
  """Writes each row's finite numbers to ``tb/`` (step: ``round``; a resume
  purges the events after the restored round) and, at the end, the run's
  settings for the HPARAMS tab with its ``eval/*`` tags as columns."""

  def __init__(self):
    self._tb = None

  def start(self, run: Run) -> None:
    """Opens the writer (purging events after a resume)."""
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self._tb = SummaryWriter(
        str(run.scratch / 'tb'),
        purge_step=run.start_round + 1 if run.start_round else None)

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Writes the row's finite numbers."""
    for k, v in row.items():
      if (k != 'round' and isinstance(v, (int, float)) and
          not isinstance(v, bool) and math.isfinite(v)):
        self._tb.add_scalar(k, v, row['round'])
    self._tb.flush()

  def end(self, run: Run, summary: dict[str, Any]) -> None:
    """Writes the run's hparams."""
    from tensorboardX import summary as tb_summary  # pylint: disable=g-import-not-at-top
    metrics = [round_metrics.EVAL + k for k in summary['final_eval']]
    hparams = round_metrics.hparams(run.fingerprint,
                                    algorithm=run.config.algorithm,
                                    num_rounds=run.config.num_rounds)
    for s in tb_summary.hparams(hparams, dict.fromkeys(metrics, 0.0)):
      self._tb.file_writer.add_summary(s)
    self._tb.flush()

  def close(self) -> None:
    """Closes the writer."""
    if self._tb is not None:
      self._tb.close()
      self._tb = None
