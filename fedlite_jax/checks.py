"""The package's one integer-argument check (sizes, counts, seeds, k).

Lowest layer: imports nothing from ``fedlite_jax``.
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ['NotAnIntegerError', 'check_int']


class NotAnIntegerError(TypeError, ValueError):
  """A non-integer where an integer is required (both a TypeError and a
  ValueError, so either ``except`` clause catches it)."""


def check_int(value: Any, name: str, minimum: int = 1) -> int:
  """``value`` (with ``__index__``; not a bool) as an int ``>= minimum``.

  Raises:
    NotAnIntegerError: ``value`` is not an integer (message names ``name``).
    ValueError: it is below ``minimum``.
  """
  if isinstance(value, bool):
    raise NotAnIntegerError(f'{name} must be an integer; got {value!r}.')
  try:
    i = operator.index(value)
  except TypeError as e:
    raise NotAnIntegerError(
        f'{name} must be an integer; got {value!r}.') from e
  if i < minimum:
    raise ValueError(f'{name} must be >= {minimum}; got {i}.')
  return i
