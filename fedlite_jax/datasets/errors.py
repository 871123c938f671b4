"""Errors raised by :mod:`fedlite_jax.datasets`."""

from __future__ import annotations


class DatasetNotFoundError(FileNotFoundError):
  """A dataset's files are in no searched directory (no substitute is used).

  The message names the expected files of every format, the directories
  searched (in order), whether a download was tried, and where to put files.
  """


class DatasetFormatError(ValueError):
  """A dataset file is corrupt, truncated, or not in its promised format or
  schema; the message is one line naming the file and the problem."""
