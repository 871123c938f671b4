"""Smoke runs of the LM performance benchmarks (``benchmarks/``).

Each benchmark runs in ``--smoke`` mode in a subprocess (as a user would run
it): it must exit 0 and print its ratio lines. No timing is asserted (the
machines are shared and noisy); the numbers live in
``benchmarks/results/lm_performance.md``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TIMEOUT_S = 1800  # Smoke runs take 1-5 min on 2 busy cores.


def _run(repo_root: pathlib.Path, script: str,
         data_dir: pathlib.Path | None = None) -> str:
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in (str(repo_root), env.get('PYTHONPATH')) if p)
  if data_dir is not None:
    env['FEDLITE_DATA_DIR'] = str(data_dir)
  proc = subprocess.run(
      [sys.executable, str(repo_root / 'benchmarks' / script), '--smoke'],
      cwd=repo_root, env=env, capture_output=True, text=True,
      timeout=TIMEOUT_S, check=False)
  assert proc.returncode == 0, (
      f'{script} --smoke exited {proc.returncode}\n--- stdout\n'
      f'{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}')
  return proc.stdout


def _ratio_lines(out: str) -> list[str]:
  return [line for line in out.splitlines() if line.startswith('ratio ')]


@pytest.fixture
def shakespeare_dir(data_dir: pathlib.Path) -> pathlib.Path:
  # data_dir skips (conftest) unless $FEDLITE_DATA_DIR holds shakespeare/.
  return data_dir


def test_bench_quantize_smoke(repo_root):
  out = _run(repo_root, 'bench_quantize.py')
  ratios = _ratio_lines(out)
  assert 'memory bandwidth' in out and 'bytes-moved model' in out
  for expected in ('[donate] hash 8-bit / bandwidth estimate',
                   '[fresh] hash 8-bit / bandwidth estimate',
                   '[donate] terngrad hash / bandwidth estimate',
                   '[donate] fedjax 8-bit / hash 8-bit',
                   '[donate] terngrad fedjax / terngrad hash',
                   '[sweep] hash 4-bit / bandwidth estimate',
                   '[tree] tree fedjax 8-bit / tree hash 8-bit'):
    assert any(expected in line for line in ratios), (expected, out)


def test_bench_lm_round_smoke(repo_root, shakespeare_dir):
  out = _run(repo_root, 'bench_lm_round.py', shakespeare_dir)
  ratios = _ratio_lines(out)
  assert 'model=transformer_tiny' in out
  for expected in ('ratio round PVT 40% + 8-bit upload / FedAvg',
                   'ratio PVT step, masked full grad / full step'):
    assert any(line.startswith(expected) for line in ratios), (expected, out)
  assert any('overhead' in line for line in ratios)
