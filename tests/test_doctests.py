"""The examples in the docstrings of fedlite_jax.transforms still run.

Runs ``doctest.testmod`` on the package and each of its modules; the
package docstring holds the new-stage recipe (define a quantizer, register
it, parse a chain, encode and decode). The stage table is restored after
each module, so a stage an example registers does not leak into other tests.
"""

import doctest
import importlib
import pkgutil

import pytest

import fedlite_jax  # noqa: F401  (compat patches before fedjax)
from fedlite_jax import transforms
from fedlite_jax.transforms import stages

MODULES = ['fedlite_jax.transforms'] + sorted(
    f'fedlite_jax.transforms.{m.name}'
    for m in pkgutil.iter_modules(transforms.__path__))


def test_package_docstring_has_examples():
  assert doctest.DocTestFinder().find(transforms)[0].examples


@pytest.mark.parametrize('name', MODULES)
def test_doctests(name, monkeypatch):
  monkeypatch.setattr(stages, '_STAGES', dict(stages._STAGES))
  monkeypatch.setattr(stages, 'STAGE_FORMS', stages.STAGE_FORMS[:])
  result = doctest.testmod(importlib.import_module(name),
                           optionflags=doctest.ELLIPSIS)
  assert result.failed == 0, f'{result.failed} doctest(s) failed in {name}'
