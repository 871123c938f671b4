"""communication.csv: each client's upload and download bits, per round."""

from __future__ import annotations

from fedlite_jax.training import outputs
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class CommunicationCsvHook(Hook):
  """Streams ``round,client_id,upload_bits,download_bits`` rows (rounds
  from 1, as in metrics.jsonl; a round's bits sum to its
  ``comm/upload_bytes`` x 8) from the ledger; cut back on a resume."""

  def __init__(self):
    self._file = None

  def start(self, run: Run) -> None:
    """Cuts the file back to the restored rounds; streams new ones."""
    path = run.scratch / 'communication.csv'
    outputs.truncate_csv(path, run.start_round)
    self._file = path.open('a')
    run.ledger.attach_csv(self._file)  # It flushes every round.

  def close(self) -> None:
    """Closes the file."""
    if self._file is not None:
      self._file.close()
      self._file = None
