"""The errors of the round engines that a caller can turn into its own.

They speak of values and parameters (``num_devices=3``), never of a
program's command-line flags: the caller (e.g. the runner) names its flags.
"""

from __future__ import annotations


class SettingError(ValueError):
  """A bad value of a setting of the run (a device count, a process index).

  Attributes:
    settings: the setting names the message quotes (as ``name=value`` or
      ``name``), so that a caller can replace them by its flag names.
  """

  def __init__(self, message: str, *settings: str):
    super().__init__(message)
    self.settings = settings


class EngineConfigError(SettingError):
  """A round engine that cannot run as asked (an unknown engine name, the
  loop engine on several devices, ...)."""
