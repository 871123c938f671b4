"""curves.png: the run's training loss and test metric, drawn at the end."""

from __future__ import annotations

from typing import Any

from fedlite_jax.training import plots
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class CurvesHook(Hook):
  """Draws ``curves.png`` from ``run.rows`` (:func:`plots.plot_curves`)."""

  def end(self, run: Run, summary: dict[str, Any]) -> None:
    """Draws curves.png."""
    plots.plot_curves(run.scratch, run.rows, run.task.metric,
                      plots.run_title(run.config),
                      format=run.config.plot_format)
