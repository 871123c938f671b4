"""Smoke tests of the FedLite benchmarks (``--smoke``, in a subprocess).

Only the exit code and the printed summary (``RATIO`` lines) are checked;
no timing is asserted. faiss is an optional benchmark extra: its lines are
expected only when it can be imported, and the skip path is exercised with a
stand-in ``faiss`` module that fails to import.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

HAVE_FAISS = importlib.util.find_spec('faiss') is not None


@pytest.fixture(scope='module')
def femnist_dir(data_dir: pathlib.Path) -> pathlib.Path:
  if not (data_dir / 'femnist105').is_dir():
    pytest.skip(f'no FEMNIST-105 data under {data_dir}')
  return data_dir


def _run(repo_root: pathlib.Path, data_dir: pathlib.Path, script: str,
         *args: str, python_path: tuple[str, ...] = ()
         ) -> subprocess.CompletedProcess:
  paths = [*python_path, str(repo_root)]
  if os.environ.get('PYTHONPATH'):
    paths.append(os.environ['PYTHONPATH'])
  env = dict(os.environ, FEDLITE_DATA_DIR=str(data_dir),
             PYTHONPATH=os.pathsep.join(paths))
  proc = subprocess.run(
      [sys.executable, str(repo_root / 'benchmarks' / script), '--smoke',
       *args], capture_output=True, text=True, env=env, cwd=str(repo_root),
      timeout=600)
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
  return proc


def _ratio_lines(stdout: str, prefix: str) -> list[str]:
  return [l for l in stdout.splitlines() if l.startswith(prefix)]


def test_bench_pq_smoke(repo_root, femnist_dir):
  proc = _run(repo_root, femnist_dir, 'bench_pq.py')
  out = proc.stdout
  assert _ratio_lines(out, 'RATIO scipy/ours grouped R=1 L=2:')
  if HAVE_FAISS:
    assert _ratio_lines(out, 'RATIO faiss/ours grouped R=1 L=2:')
    assert _ratio_lines(out, 'RATIO faiss/ours vanilla PQ R=1152 L=2:')
    assert 'SKIP faiss' not in out
  else:
    assert 'SKIP faiss' in out
  for line in _ratio_lines(out, 'RATIO'):
    assert 'x, vs seq' in line and 'rel err ours' in line


def test_bench_pq_smoke_without_faiss_on_real_activations(
    repo_root, femnist_dir, tmp_path):
  fake = tmp_path / 'nofaiss'
  fake.mkdir()
  (fake / 'faiss.py').write_text(
      "raise ImportError('faiss hidden by the test')\n")
  proc = _run(repo_root, femnist_dir, 'bench_pq.py', '--activations=femnist',
              python_path=(str(fake),))
  out = proc.stdout
  assert 'SKIP faiss' in out and 'faiss hidden by the test' in out
  assert not _ratio_lines(out, 'RATIO faiss')
  assert _ratio_lines(out, 'RATIO scipy/ours grouped R=1 L=2:')
  assert 'femnist activations' in out


def test_bench_fedlite_iteration_smoke(repo_root, femnist_dir):
  proc = _run(repo_root, femnist_dir, 'bench_fedlite_iteration.py',
              '--reverse')
  lines = _ratio_lines(proc.stdout, 'RATIO FedLite/SplitFed L=2:')
  assert len(lines) == 1
  assert 'quantization overhead' in lines[0]
