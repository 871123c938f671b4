"""Round-loop hooks: everything the runner does besides training.

The loop (:func:`fedlite_jax.training.loop.run_rounds`) calls every hook in
order (the runner's own first, then the user's ``hooks=``):

* ``start(run)``: once, before the first round this process trains.
  ``run.start_round`` rounds are done already (> 0 after a resume) and
  ``run.rows`` holds their rows as read back from ``metrics.jsonl``; a hook
  that keeps state or files rebuilds or cuts them back to that round here.
* ``round_start(run, round_num)``: before round ``round_num`` (1-based;
  0 is the evaluation of an ``--init_checkpoint`` before training).
* ``round_end(run, row)``: after it. ``row`` is the round's metrics
  (:mod:`fedlite_jax.training.round_metrics`); a hook may add keys, which
  the hooks after it see (the evaluation hook adds ``eval/*``).
* ``evaluation(run, row)``: after ``round_end``, for rows with an
  evaluation.
* ``end(run, summary)``: once, after the last round; a hook may add entries
  to the summary before ``summary.json`` is written.
* ``close()``: always, last, also after an error: release files.

A hook ends a run early with ``run.request_stop(reason)``: the round ends,
is checkpointed and summarized (``summary['stopped_early']``). Restarted,
such a run resumes from that round and trains on.
"""

from __future__ import annotations

from typing import Any, TYPE_CHECKING

if TYPE_CHECKING:
  from fedlite_jax.training.build import Run


class Hook:
  """A round-loop hook; every method does nothing unless overridden."""

  def start(self, run: 'Run') -> None:
    """Before the first round to train (``run.rows``: the rounds done)."""

  def round_start(self, run: 'Run', round_num: int) -> None:
    """Before round ``round_num`` (1-based) trains."""

  def round_end(self, run: 'Run', row: dict[str, Any]) -> None:
    """After round ``row['round']``; may add keys to ``row``."""

  def evaluation(self, run: 'Run', row: dict[str, Any]) -> None:
    """After ``round_end`` of a row holding ``eval/*`` metrics."""

  def end(self, run: 'Run', summary: dict[str, Any]) -> None:
    """After the last round; may add entries to ``summary``."""

  def close(self) -> None:
    """Always, last (also after an error)."""
