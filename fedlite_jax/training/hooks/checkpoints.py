"""Round checkpoints (orbax, saved in the background) for exact resume."""

from __future__ import annotations

from typing import Any

from fedlite_jax.training import state_io
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class CheckpointHook(Hook):
  """Saves server state, ledger and parameters after every
  ``--checkpoint_every`` rounds and the last one (process 0; the two
  newest kept); ``close`` waits for a save still being written."""

  def __init__(self):
    self._ckpt = None
    self._saved = -1

  def start(self, run: Run) -> None:
    """Opens the checkpointer (process 0)."""
    self._saved = run.start_round
    if run.writer_process:
      self._ckpt = state_io.Checkpointer(run.scratch / 'checkpoints',
                                           keep=2)

  def _save(self, run: Run, done: int) -> None:
    if self._ckpt is not None:
      self._ckpt.save(done, run.checkpoint_state(), run.fingerprint,
                      params=run.spec.eval_params(run.state))
    self._saved = done

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Saves after every ``--checkpoint_every`` rounds and the last."""
    done, every = row['round'], run.config.checkpoint_every
    if done and ((every and done % every == 0) or
                 done == run.config.num_rounds):
      self._save(run, done)

  def end(self, run: Run, summary: dict[str, Any]) -> None:
    """Saves the last round if a hook stopped the run between saves."""
    done = run.rows[-1]['round'] if run.rows else 0
    if done > self._saved:
      self._save(run, done)

  def save_now(self, run: Run) -> None:
    """Saves the last round done (unless saved) and waits for the save: a
    run interrupted between two rounds."""
    self.end(run, {})
    if self._ckpt is not None:
      self._ckpt.wait()

  def close(self) -> None:
    """Waits for a save still being written."""
    if self._ckpt is not None:
      self._ckpt.close()
      self._ckpt = None
