"""Every public module, function, class and method of the package has a docstring.

The API reference (``docs/api/``) is generated from these docstrings, so a
public name without one would be an empty entry. Public: modules whose dotted
name has no part starting with ``_``; functions and classes defined in such a
module (``obj.__module__``) whose name does not start with ``_``; and the
functions, static/class methods and properties defined in such a class body
(dataclass fields with function defaults are attributes, documented in the
class docstring). A class's docstring must be its own, not the signature that
``NamedTuple`` / ``dataclass`` generate.

Independent expectation: the names are read from the imported modules, not
from a list kept here; no name is exempt.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re

import fedlite_jax

# Public names allowed without a docstring (none).
def public_modules() -> list[str]:
  """Dotted names of the package's public modules, the package included."""
  names = ['fedlite_jax'] + [
      m.name for m in pkgutil.walk_packages(fedlite_jax.__path__,
                                            'fedlite_jax.')]
  return sorted(n for n in names
                if not any(p.startswith('_') for p in n.split('.')))


def _own_doc(cls: type) -> str | None:
  """The class's own docstring, None if absent or auto-generated."""
  doc = cls.__dict__.get('__doc__')
  if not doc or re.fullmatch(rf'{re.escape(cls.__name__)}\(.*\)', doc.strip(),
                             re.S):
    return None
  return doc


def _members(cls: type):
  """``(name, function)`` of the public methods / properties of ``cls``."""
  fields = ({f.name for f in dataclasses.fields(cls)}
            if dataclasses.is_dataclass(cls) else set())
  for name, value in vars(cls).items():
    if name.startswith('_') or name in fields:
      continue
    if isinstance(value, (staticmethod, classmethod)):
      value = value.__func__
    elif isinstance(value, property):
      value = value.fget
    if inspect.isfunction(value):
      yield name, value


def public_objects():
  """``(qualified name, has docstring)`` of every public object."""
  for module_name in public_modules():
    module = importlib.import_module(module_name)
    yield module_name, bool(module.__doc__ and module.__doc__.strip())
    for name, obj in vars(module).items():
      if name.startswith('_') or getattr(obj, '__module__', None) != module_name:
        continue
      if inspect.isfunction(obj):
        yield f'{module_name}.{name}', bool(inspect.getdoc(obj))
      elif inspect.isclass(obj):
        yield f'{module_name}.{name}', _own_doc(obj) is not None
        for member, fn in _members(obj):
          yield f'{module_name}.{name}.{member}', bool(fn.__doc__)


def test_the_walk_sees_the_package():
  names = dict(public_objects())
  assert len(names) > 400
  assert names['fedlite_jax.transforms.base.chain']
  assert names['fedlite_jax.algorithms.fedopt.federated_averaging']
  assert 'fedlite_jax.algorithms.fedopt._Setup' not in names  # private


def test_auto_generated_class_docs_do_not_count():
  class Point:  # pylint: disable=too-few-public-methods
    pass
  Point.__doc__ = 'Point(x, y)'
  assert _own_doc(Point) is None
  Point.__doc__ = 'A point (x, y) in the plane.'
  assert _own_doc(Point)


def test_every_public_object_has_a_docstring():
  missing = sorted(name for name, documented in public_objects()
                   if not documented)
  assert not missing, ('public names without a docstring: ' +
                       ', '.join(missing))
