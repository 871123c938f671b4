"""Evaluation on the test clients every ``--eval_every`` rounds."""

from __future__ import annotations

import time
from typing import Any

from fedlite_jax.training import round_metrics
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class EvaluationHook(Hook):
  """Adds ``eval/<metric>`` and ``time/eval_seconds`` to the rows of rounds
  ``r`` with ``r % eval_every == 0``, the last round, round 0 (an
  ``--init_checkpoint``) and a round after which the run stops early."""

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Evaluates when due; adds ``eval/*``."""
    done = row['round']
    if not (done == 0 or done % run.config.eval_every == 0 or
            done == run.config.num_rounds or run.stop_reason is not None):
      return
    t = time.perf_counter()
    row.update(round_metrics.eval_row(run.evaluate()))
    if done == 0:  # Nothing sent yet.
      comm = run.ledger.summary()
      row.update({'comm/upload_bytes_total': comm['total_upload_bytes'],
                  'comm/download_bytes_total': comm['total_download_bytes']})
    else:
      row['time/eval_seconds'] = time.perf_counter() - t

  def end(self, run: Run, summary: dict[str, Any]) -> None:
    """``summary['final_eval']``: the last row's evaluation (evaluated now
    if that row has none)."""
    last = run.rows[-1] if run.rows else {}
    summary['final_eval'] = (round_metrics.eval_metrics(last)
                             if round_metrics.is_evaluation(last)
                             else run.evaluate())
