"""Shared pytest setup.

Tests read the real federated data in ``../shared/data`` (beside the clone)
through ``FEDLITE_DATA_DIR``; a user may point it elsewhere. Nothing in the
library hard-codes that path.
"""

import os
import pathlib

import pytest

import fedlite_jax  # noqa: F401  (applies the FedJAX compatibility fixes)

_REPO = pathlib.Path(__file__).resolve().parent.parent
_DEFAULT_SHARED_DATA = _REPO.parent / 'shared' / 'data'

if 'FEDLITE_DATA_DIR' not in os.environ and _DEFAULT_SHARED_DATA.is_dir():
  os.environ['FEDLITE_DATA_DIR'] = str(_DEFAULT_SHARED_DATA)

# Read once, at import: tests that monkeypatch the variable away must not
# change what the session-scoped fixture below returns.
_DATA_DIR = os.environ.get('FEDLITE_DATA_DIR') or (
    str(_DEFAULT_SHARED_DATA) if _DEFAULT_SHARED_DATA.is_dir() else None)


@pytest.fixture(scope='session')
def data_dir() -> pathlib.Path:
  """The directory with femnist105/, shakespeare/, tff_shakespeare_h5/."""
  path = _DATA_DIR
  if not path or not pathlib.Path(path).is_dir():
    raise RuntimeError(
        'Tests need the real federated data: set FEDLITE_DATA_DIR to the '
        'directory holding femnist105/ and shakespeare/ (CI: ../shared/data).')
  return pathlib.Path(path)


@pytest.fixture(scope='session')
def repo_root() -> pathlib.Path:
  return _REPO
