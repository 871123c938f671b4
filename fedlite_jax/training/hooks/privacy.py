"""DP-FedAvg's per-round privacy metrics and summary.json's ``privacy``."""

from __future__ import annotations

from typing import Any

from fedlite_jax.training import dp_options
from fedlite_jax.training.build import Run
from fedlite_jax.training.hooks import Hook


class PrivacyHook(Hook):
  """Adds to every trained round's row ``privacy/epsilon`` (at
  ``--dp_delta`` after the rounds done: a function of the round number,
  so a resumed run gives the same), ``privacy/clip_norm`` (the round's C,
  from the server state) and ``privacy/noise_std`` (std of the noise on the
  trained cohort's clipped sum, ``z_Delta * C * W / M``, units of the
  parameters; over ``W`` on the mean), under a distributed mechanism
  ``privacy/wrapped_fraction`` (the share of the secure sum's coordinates
  that wrapped around 2^B); at the end
  ``summary['privacy']`` (:meth:`dp_options.Privacy.describe`). The runner
  places it among the row-making hooks when ``--dp_clip`` is set."""

  def __init__(self):
    self.privacy = None
    self.clip_norm = float('nan')

  def start(self, run: Run) -> None:
    """Takes the run's :class:`dp_options.Privacy`: the builder's own
    (:func:`dp_options.resolve` runs once per config)."""
    self.privacy = dp_options.resolve(run.config, run.source.num_clients(),
                                      run.ledger.num_params)

  def round_start(self, run: Run, round_num: int) -> None:
    """Reads the clip norm this round uses."""
    self.clip_norm = float(run.state.clip_norm)

  def round_end(self, run: Run, row: dict[str, Any]) -> None:
    """Adds ``privacy/*`` to a trained round's row."""
    if row['round'] == 0:
      return
    row.update({'privacy/epsilon': self.privacy.epsilon(row['round']),
                'privacy/clip_norm': self.clip_norm,
                'privacy/noise_std': float(
                    self.privacy.dp.noise_std(self.clip_norm))})
    if self.privacy.secure is not None:
      row['privacy/wrapped_fraction'] = float(run.state.wrapped_fraction)

  def end(self, run: Run, summary: dict[str, Any]) -> None:
    """Adds ``summary['privacy']``."""
    rounds = summary['rounds']
    summary['privacy'] = {**self.privacy.describe(rounds),
                          'final_clip_norm': float(run.state.clip_norm)}
