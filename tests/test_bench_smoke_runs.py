"""Smoke runs of two benchmark scripts at their smallest.

Each script runs its real code path on the embedded MNIST task (no files),
with one timed round and cohorts of 2-4 clients:

* ``bench_scaling.py --smoke``: a row for each forced device count (1 and 2:
  the workers really saw that many devices), the loop reference, both
  FedJAX backends; every s/round finite and positive, rounds/s its
  inverse, and each printed ratio consistent with the printed s/round.
* ``bench_fedavg.py``: a row for FedJAX's fed_avg and for each requested
  engine, s/round finite and positive, rounds/s its inverse, FedJAX's own
  ratio 1.00x and every ratio consistent with the printed s/round.

No timing is asserted (ratios are only checked against the numbers printed
beside them, within their rounding).
"""

from __future__ import annotations

import math
import os
import re
import sys

import conftest
import pytest


@pytest.fixture
def bench_env(repo_root, monkeypatch):
  """The environment the scripts (and the processes they start) get: no
  real data (embedded MNIST), the checkout importable, JAX on the CPU."""
  monkeypatch.delenv('FEDLITE_DATA_DIR', raising=False)
  monkeypatch.setenv('PYTHONPATH', os.pathsep.join(
      p for p in (str(repo_root), os.environ.get('PYTHONPATH')) if p))
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  return dict(os.environ)


def _table(text: str, header: str) -> list[list[str]]:
  """The cells of the markdown table whose header row starts ``header``."""
  lines = text.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith(header))
  rows = []
  for line in lines[start + 2:]:  # Past the header and the |---| row.
    if not line.startswith('|'):
      break
    rows.append([c.strip() for c in line.strip('|').split('|')])
  return rows


def _ratio_consistent(printed: float, num: float, den: float,
                      half: float = 5e-4) -> bool:
  """Whether ``printed`` (2 decimals) can be num / den where num and den
  were printed to 3 decimals (each within ``half`` of its true value)."""
  low = (num - half) / (den + half)
  high = (num + half) / max(den - half, 1e-12)
  return low - 0.005 - 1e-9 <= printed <= high + 0.005 + 1e-9


def _rate_consistent(rate: float, seconds: float) -> bool:
  """Whether ``rate`` (2 decimals) can be 1 / seconds (3 decimals)."""
  return _ratio_consistent(rate, 1.0, seconds)


def test_scaling_smoke_rows_per_device_count(bench_env, monkeypatch, capsys):
  with conftest.benchmark_modules('bench_scaling') as (bench,):
    monkeypatch.setattr(sys, 'argv', ['bench_scaling.py', '--smoke'])
    bench.main()
  out = capsys.readouterr().out
  assert ('[devices] FedAvg, EMNIST CNN, task embedded_mnist, 4 '
          'clients/round, backend cpu') in out
  cells = [[c.strip() for c in line.split('|')] for line in out.splitlines()
           if re.match(r'\d+ \| (loop|vmap \(mesh\)) \|', line)]
  devices = [(int(c[0]), c[1]) for c in cells]
  # --smoke: devices 1,2; the loop engine only on one device.
  assert devices == [(1, 'loop'), (1, 'vmap (mesh)'), (2, 'vmap (mesh)')]
  s = {d: float(c[2]) for d, c in zip(devices, cells)}
  for d, c in zip(devices, cells):
    assert math.isfinite(s[d]) and s[d] > 0, c
    assert _rate_consistent(float(c[3]), s[d]), c
  vmap1, loop = s[(1, 'vmap (mesh)')], s[(1, 'loop')]
  for d, c in zip(devices, cells):
    vs_vmap = float(c[4].rstrip('x'))
    vs_loop = float(c[5].rstrip('x'))
    if d[1] == 'loop':
      assert _ratio_consistent(vs_vmap, vmap1, loop) and vs_loop == 1.0, c
    else:
      assert _ratio_consistent(vs_vmap, vmap1, s[d]), c
      assert _ratio_consistent(vs_loop, loop, s[d]), c
  assert cells[1][4] == '1.00x'
  backend = dict(re.findall(r'^(jit|vmap) \| ([0-9.]+) \| [0-9.]+$', out,
                            re.M))
  assert ('[backend] fedjax.algorithms.fed_avg (FedJAX haiku CNN), task '
          'embedded_mnist, 4 clients/round') in out
  assert set(backend) == {'jit', 'vmap'}
  jit, vmap = float(backend['jit']), float(backend['vmap'])
  assert min(jit, vmap) > 0 and math.isfinite(jit + vmap)
  ratio = float(re.search(r'ratio vmap/jit rounds per second: ([0-9.]+)x',
                          out).group(1))
  assert _ratio_consistent(ratio, jit, vmap), (ratio, jit, vmap)


def test_fedavg_rows_for_each_engine(bench_env, monkeypatch, capsys):
  with conftest.benchmark_modules('bench_fedavg') as (bench,):
    monkeypatch.setattr(sys, 'argv', [
        'bench_fedavg.py', '--clients_per_round=2', '--rounds=1',
        '--warmup=1', '--engines=loop,vmap'])
    bench.main()
  out = capsys.readouterr().out
  header = re.search(r'task=(\S+) model=flax backend=cpu devices=\d+ '
                     r'clients/round=2 batch=20 timed rounds=1 \(mean '
                     r'([0-9.]+) client-steps/round\)', out)
  assert header and header.group(1) == 'embedded_mnist', out
  assert float(header.group(2)) >= 2  # Two clients, a step or more each.
  rows = {m.group(1): [float(m.group(i)) for i in (2, 3, 4)]
          for m in re.finditer(r'^(\S.*?)\s+([0-9.]+)\s+([0-9.]+)\s+'
                               r'([0-9.]+)x$', out, re.M)}
  ref = 'fedjax.fed_avg (jit backend)'
  assert list(rows) == [ref, 'ours loop engine', 'ours vmap engine']
  for name, (s, rate, ratio) in rows.items():
    assert math.isfinite(s) and s > 0, name
    assert _rate_consistent(rate, s), name
    assert math.isfinite(ratio) and ratio > 0, name
    assert _ratio_consistent(ratio, rows[ref][0], s), name
  assert rows[ref][2] == 1.0
