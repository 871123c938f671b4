"""The package's one integer-argument check (sizes, counts, seeds, k).

Lowest layer: imports nothing from ``fedlite_jax``, so every subpackage
(``igc``, ``transforms``, ``fedlite``, ``algorithms``, ``training``) may use
it.
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ['NotAnIntegerError', 'check_int']


class NotAnIntegerError(TypeError, ValueError):
  """A non-integer where an integer is required.

  Both a ``TypeError`` (the value's type is wrong) and a ``ValueError`` (what
  argument checks of the package raised before they were merged), so either
  ``except`` clause catches it.
  """


def check_int(value: Any, name: str, minimum: int = 1) -> int:
  """``value`` as a Python int, checked to be ``>= minimum``.

  Args:
    value: anything with ``__index__`` (Python and NumPy integers; not
      ``bool``, a float, a string or a tracer).
    name: the argument's name in the error message.
    minimum: the smallest allowed value.

  Returns:
    ``operator.index(value)``.

  Raises:
    NotAnIntegerError: ``value`` is not an integer (one line: ``'{name} must
      be an integer; got {value!r}.'``).
    ValueError: it is below ``minimum`` (``'{name} must be >= {minimum};
      got {value}.'``).
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
