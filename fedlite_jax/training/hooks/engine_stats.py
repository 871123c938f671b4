"""The round engines' counts and the compilations, per round and in total."""

from __future__ import annotations

import contextlib
from typing import Any

from fedlite_jax.rounds import engine as engine_lib
from fedlite_jax.rounds import stats as stats_lib
from fedlite_jax.training import round_metrics
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class EngineStatsHook(Hook):
  """Adds ``engine/<count>`` (the engines' counts) and the round's
  compilations (``engine/compilations``,
  ``engine/client_program_compilations``, ``engine/compile_seconds``: of
  sampling, training, server update, accounting and evaluation) to every
  trained round's row, and ``summary['engine']``. Placed after the
  evaluation hook, whose compilations it counts."""

  def __init__(self):
    self._stack = contextlib.ExitStack()
    self.recorder = self.compiles = None
    self._before = (0, 0, 0.0)

  def _counts(self) -> tuple[int, int, float]:
    c = self.compiles
    return (c.total, c.count(*stats_lib.CLIENT_PROGRAMS), c.total_seconds)

  def start(self, run: Run) -> None:
    """Starts recording engine counts and compilations."""
    self.recorder = self._stack.enter_context(engine_lib.recording_stats())
    self.compiles = self._stack.enter_context(
        stats_lib.counting_compilations())

  def round_start(self, run: Run, round_num: int) -> None:
    """Notes the compilations so far."""
    self._before = self._counts()

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Adds the round's ``engine/*`` counts."""
    if row['round'] == 0:
      return
    now = self._counts()
    row.update(round_metrics.engine_metrics(self.recorder.take()))
    row.update({'engine/compilations': now[0] - self._before[0],
                'engine/client_program_compilations':
                    now[1] - self._before[1],
                'engine/compile_seconds': now[2] - self._before[2]})

  def end(self, run: Run, summary: dict[str, Any]) -> None:
    """Counts over every round (rows of earlier runs of a resumed one too);
    compilations and their seconds by program of this process."""
    totals = self.recorder.totals()
    summary['engine'] = {
        **{k: totals[k] for k in ('name',) + stats_lib.SETTINGS},
        **round_metrics.engine_totals(run.rows),
        'compilations_by_program': dict(
            self.compiles.by_program.most_common()),
        'compile_seconds_by_program': {
            k: round(v, 3) for k, v in self.compiles.seconds.most_common()},
        'conv_implementation': run.conv_implementation,
        'compute_dtype': run.config.compute_dtype}

  def close(self) -> None:
    """Stops recording."""
    self._stack.close()
