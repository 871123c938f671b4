"""Errors raised by :mod:`fedlite_jax.datasets`."""

from __future__ import annotations


class DatasetNotFoundError(FileNotFoundError):
  """A federated dataset's files are not in any searched directory.

  A subclass of :class:`FileNotFoundError`, so ``except FileNotFoundError``
  catches it. The message names the expected file names of every supported
  on-disk format, the directories searched (in order), whether a download was
  tried, and where to put the files. The loaders never substitute another
  dataset when this is raised.
  """


class DatasetFormatError(ValueError):
  """A dataset file is there but unreadable: corrupt, truncated, or another
  format or schema than its name promises.

  A subclass of :class:`ValueError`. The message is one line that names the
  file and what is wrong with it.
  """
