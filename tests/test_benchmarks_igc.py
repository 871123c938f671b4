"""Smoke runs of the IGC performance benchmarks (no timing assertions).

Each benchmark script runs in a subprocess with ``--smoke`` and must exit 0
and print its machine-readable ``ratio ...`` (and ``memory ...``) lines.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

_REPO = pathlib.Path(__file__).resolve().parent.parent
_BENCH = _REPO / 'benchmarks'
_HAVE_CC = shutil.which('gcc') is not None or shutil.which('cc') is not None


def _run(script: str, *args: str, env: dict | None = None) -> str:
  proc = subprocess.run(
      [sys.executable, str(_BENCH / script), '--smoke', *args],
      cwd=_REPO, capture_output=True, text=True, timeout=900,
      env={**os.environ, **(env or {})})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_bench_fwht_smoke():
  out = _run('bench_fwht.py', *(() if _HAVE_CC else ('--no_c',)))
  lines = [l for l in out.splitlines() if l.startswith('ratio fwht')]
  assert [re.search(r'n=2\^(\d+)', l).group(1) for l in lines] == [
      '10', '12', '16']
  for line in lines:
    assert re.search(r'np/jax=[\d.]+', line), line
    if _HAVE_CC:
      assert re.search(r'jax/c=[\d.]+', line), line
  assert 'project' in out and 'lift' in out


def test_bench_fastfood_smoke():
  out = _run('bench_fastfood.py', *(() if _HAVE_CC else ('--no_c',)))
  ratios = [l for l in out.splitlines() if l.startswith('ratio fastfood')]
  assert len(ratios) == 4  # 2 sizes x {project, lift}.
  for line in ratios:
    assert re.search(r'jax/np(\+c)?=[\d.]+ jax_ns_per_LlogL=[\d.]+', line)
  memory = [l for l in out.splitlines() if l.startswith('memory fastfood')]
  assert [re.search(r'op=(\w+)', l).group(1) for l in memory] == [
      'project', 'lift']
  for line in memory:
    assert re.search(r'peak_mib=[\d.]+ bytes_per_L=[\d.]+', line), line


def test_bench_igc_round_smoke(data_dir):  # skips without the data
  out = _run('bench_igc_round.py', f'--data_dir={data_dir}', '--reverse')
  lines = [l for l in out.splitlines() if l.startswith('ratio igc_round ')]
  assert len(lines) == 1, out
  assert 'ratio igc_round_project_on_server local_steps=1' in out, out
  assert re.search(r'local_steps=1 igc/sgd=[\d.]+ overhead_pct=-?[\d.]+',
                   lines[0]), lines[0]
