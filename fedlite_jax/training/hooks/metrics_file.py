"""metrics.jsonl: one JSON row per round (:mod:`round_metrics`)."""

from __future__ import annotations

import json
from typing import Any

from fedlite_jax.training import outputs
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class MetricsFileHook(Hook):
  """Appends every row to ``metrics.jsonl`` (a resumed run's file was cut
  back to the restored rounds when they were read into ``run.rows``)."""

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Appends ``row`` to metrics.jsonl."""
    with (run.scratch / 'metrics.jsonl').open('a') as f:
      f.write(json.dumps(outputs.jsonable(row)) + '\n')
