"""Shared pytest setup.

Most tests need no files: they use the embedded MNIST digits or synthetic
arrays. Tests on real federated data take the ``data_dir`` fixture, which
reads ``$FEDLITE_DATA_DIR`` and SKIPS (with a reason that says how to get the
data) unless that folder holds every file of :data:`DATA_LAYOUT`. Nothing in
the library hard-codes a data path.

The project's CI keeps the data in ``shared/data`` next to the checkout; that
folder is used when ``FEDLITE_DATA_DIR`` is unset and it exists.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

# JAX's persistent compilation cache, shared by this session's processes (the
# xdist workers, and the experiment binaries, benchmarks and notebooks the
# tests start, which inherit the environment). Many tests compile the same
# programs (the same model, algorithm and shapes in other tests, or a killed
# run compiled again when it resumes); a cache hit loads the executable XLA
# compiled before, so results are unchanged, and JAX still reports it as a
# compile event (compilation counts are unchanged; only their seconds drop).
# Each session starts empty, so every program still compiles once per suite.
# A cache the user set is kept; FEDLITE_TEST_COMPILATION_CACHE=0 turns it off.
_CACHE_ENV = 'JAX_COMPILATION_CACHE_DIR'
if (os.environ.get('FEDLITE_TEST_COMPILATION_CACHE', '1') != '0'
    and _CACHE_ENV not in os.environ):
  _cache_dir = tempfile.mkdtemp(prefix='fedlite_jax_test_compilations_')
  os.environ[_CACHE_ENV] = _cache_dir
  # Programs that compile faster than this are not worth a file read.
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)

import pytest  # noqa: E402

import fedlite_jax  # noqa: F401,E402  (applies the FedJAX compatibility fixes)
# The processes this session starts (the xdist workers, binaries, notebooks)
# run with glibc's huge pages (glibc >= 2.35; ignored before), which spare
# XLA:CPU a page fault per 4 KiB of its large per-call buffers
# (docs/performance.md).
os.environ.setdefault('GLIBC_TUNABLES', 'glibc.malloc.hugetlb=1')

_REPO = pathlib.Path(__file__).resolve().parent.parent
_CI_DATA = _REPO.parent / 'shared' / 'data'
DATA_DIR_ENV = 'FEDLITE_DATA_DIR'

# What the real-data tests read, relative to $FEDLITE_DATA_DIR: subfolder ->
# (files, where they come from). Counts asserted by the tests are those of
# these exact datasets (105 FEMNIST writers; 715 Shakespeare clients).
DATA_LAYOUT: Mapping[str, tuple[tuple[str, ...], str]] = {
    'femnist105': (
        ('federated_emnist_train.sqlite', 'federated_emnist_test.sqlite'),
        'a 105-writer FEMNIST subset (LEAF writers; 14,708 train / 1,685 '
        'test examples, counts the tests check) in FedJAX SQLite format, the '
        'format fedjax.datasets.emnist.load_data() caches in ~/.cache/fedjax'),
    'shakespeare': (
        ('shakespeare_train.sqlite', 'shakespeare_test.sqlite'),
        'FedJAX\'s Shakespeare: fedjax.datasets.shakespeare.load_data() '
        'downloads these files into ~/.cache/fedjax'),
    'tff_shakespeare_h5': (
        ('shakespeare_train.h5', 'shakespeare_test.h5'),
        'the same Shakespeare in TFF\'s legacy HDF5 layout, as older TFF '
        'releases\' tff.simulation.datasets.shakespeare.load_data() '
        'extracted it into ~/.keras/datasets'),
}

if DATA_DIR_ENV not in os.environ and _CI_DATA.is_dir():
  os.environ[DATA_DIR_ENV] = str(_CI_DATA)

# Read once, at import: tests that monkeypatch the variable away must not
# change what the session-scoped fixture below returns.
_DATA_DIR = os.environ.get(DATA_DIR_ENV) or None


def missing_data_files(
    root: str | os.PathLike[str] | None,
    layout: Mapping[str, tuple[tuple[str, ...], str]] = DATA_LAYOUT,
) -> list[str]:
  """The files of ``layout`` that ``root`` lacks, as 'subfolder/file' strings.

  Args:
    root: the data folder, or None (then every file is missing).
    layout: subfolder -> (file names, description).

  Returns:
    Missing paths relative to ``root``, in ``layout`` order; [] if complete.
  """
  missing = []
  for sub, (names, _) in layout.items():
    for name in names:
      if root is None or not (pathlib.Path(root) / sub / name).is_file():
        missing.append(f'{sub}/{name}')
  return missing


def data_skip_reason(
    root: str | os.PathLike[str] | None,
    missing: Sequence[str],
    layout: Mapping[str, tuple[tuple[str, ...], str]] = DATA_LAYOUT,
) -> str:
  """One-line skip reason: what is missing and how to provide the data.

  Args:
    root: the data folder that was checked (None: $FEDLITE_DATA_DIR unset).
    missing: the missing files (from :func:`missing_data_files`).
    layout: subfolder -> (file names, description).

  Returns:
    Text naming ``$FEDLITE_DATA_DIR``, each subfolder with its files and
    source, and what was missing.
  """
  where = (f'${DATA_DIR_ENV} is not set' if root is None else
           f'${DATA_DIR_ENV}={root} lacks {", ".join(missing)}')
  parts = [f'{sub}/ ({", ".join(names)}: {about})'
           for sub, (names, about) in layout.items()]
  return (f'needs the real federated data ({where}). Set {DATA_DIR_ENV} to a '
          f'folder holding {"; ".join(parts)}. See docs/data.md, "Test data".')


@pytest.fixture(scope='session')
def data_dir() -> pathlib.Path:
  """$FEDLITE_DATA_DIR with femnist105/, shakespeare/, tff_shakespeare_h5/.

  Skips the requesting test when the variable is unset or a file of
  :data:`DATA_LAYOUT` is missing.
  """
  missing = missing_data_files(_DATA_DIR)
  if missing:
    pytest.skip(data_skip_reason(_DATA_DIR, missing))
  return pathlib.Path(_DATA_DIR)


@pytest.fixture(scope='session')
def repo_root() -> pathlib.Path:
  return _REPO


def script_env() -> dict[str, str]:
  """The environment of a benchmark script run as a subprocess on CPU JAX:
  the repository on ``PYTHONPATH``, ``FEDLITE_DATA_DIR`` removed (the
  scripts' synthetic data: no files needed)."""
  env = dict(os.environ)
  env.pop('FEDLITE_DATA_DIR', None)
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in (str(_REPO), env.get('PYTHONPATH')) if p)
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def run_script(name: str, *flags: str, timeout: int = 900,
               env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
  """``benchmarks/<name>.py flags...`` run on CPU JAX (``env``, default
  :func:`script_env`) from the repository root; fails the test, with the
  end of its stderr, unless it exits 0."""
  proc = subprocess.run(
      [sys.executable, str(_REPO / 'benchmarks' / f'{name}.py'), *flags],
      cwd=_REPO, env=script_env() if env is None else env,
      capture_output=True, text=True,
      timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


@contextlib.contextmanager
def benchmark_modules(*names: str):
  """The scripts ``benchmarks/<name>.py`` imported as modules, with
  ``benchmarks/`` on ``sys.path`` while in use (a script may import a helper module there)."""
  path = str(_REPO / 'benchmarks')
  sys.path.insert(0, path)
  try:
    yield tuple(importlib.import_module(n) for n in names)
  finally:
    sys.path.remove(path)

