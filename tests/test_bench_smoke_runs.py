"""Smoke runs of four benchmark scripts that had no test, at their smallest.

Each script runs its real code path on the embedded MNIST task (no files),
with 1-2 rounds and cohorts of 2-4 clients, writing only under ``tmp_path``:

* ``bench_run_compilations.py --compilation_cache``: two 2-round runner
  processes on the vmap engine (cold, then warm on the cache the first
  filled). The client program (``lanes_begin``/``lanes_segment``/
  ``lanes_finish``) compiles once each, and only in round 1, in both runs
  (``summary.json``, ``metrics.jsonl``, and the table's own statement); no
  round's sequential steps exceed the bound the script states; the warm
  run's final evaluation equals the cold run's. The script's task list has
  only tasks on real data, so the test adds an ``embedded_mnist`` entry to
  its ``RUNS`` before calling ``main()``.
* ``bench_lane_memory.py``: the streamed (4 clients on 2 lanes) and wide (4
  on 4 lanes) vmapped runs' final test loss equals the loop engine's
  within float tolerance, both as the table's relative difference and
  recomputed from its loss column; executed >= useful lane-steps; each run's
  sequential steps are at least the useful steps over its lanes.
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

import json
import math
import os
import re
import subprocess
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


def test_run_compilations_compile_once_and_cache(bench_env, tmp_path,
                                                 monkeypatch, capsys):
  with conftest.benchmark_modules('bench_run_compilations') as (bench,):
    monkeypatch.setitem(bench.RUNS, 'embedded_mnist',
                        ['--task=embedded_mnist'])
    work, out_file = tmp_path / 'work', tmp_path / 'compilations.md'
    monkeypatch.setattr(sys, 'argv', [
        'bench_run_compilations.py', '--runs=embedded_mnist', '--rounds=2',
        '--clients=2', '--compilation_cache', f'--work_dir={work}',
        f'--output={out_file}'])
    bench.main()
  text = out_file.read_text()
  assert text in capsys.readouterr().out  # The table is also printed.
  assert ('Command: `python benchmarks/bench_run_compilations.py '
          '--runs=embedded_mnist --rounds=2 --clients=2 '
          '--compilation_cache`') in text
  client_programs = ('jit(lanes_begin)', 'jit(lanes_segment)',
                     'jit(lanes_finish)')
  finals = []
  for run in ('embedded_mnist', 'embedded_mnist_warm'):
    summary = json.loads((work / run / 'summary.json').read_text())
    engine = summary['engine']
    by_program = engine['compilations_by_program']
    assert {p: by_program.get(p) for p in client_programs} == dict.fromkeys(
        client_programs, 1), (run, by_program)
    assert engine['client_program_compilations'] == 3, run
    assert engine['executed_steps'] >= engine['useful_steps'] > 0, run
    rows = [json.loads(l) for l in
            (work / run / 'metrics.jsonl').read_text().splitlines()
            if l.strip()]
    assert [r['round'] for r in rows] == [1, 2], run
    assert [r['engine/client_program_compilations'] for r in rows] == [3, 0]
    for r in rows:
      bound = max(-(-r['engine/useful_steps'] // engine['lanes']),
                  r['engine/longest_client_steps']) + engine['segment_steps']
      assert r['engine/sequential_steps'] <= bound, (run, r)
    finals.append(summary['final_eval'])
  assert finals[0] == finals[1] and math.isfinite(finals[0]['loss'])
  (cold,) = _table(text, '| run | lanes |')
  cold_engine = json.loads(
      (work / 'embedded_mnist' / 'summary.json').read_text())['engine']
  assert cold[:5] == ['embedded_mnist', str(cold_engine['lanes']),
                      str(cold_engine['segment_steps']), '3',
                      str(cold_engine['compilations'])], cold
  (cache,) = _table(text, '| run | compile s, cold |')
  assert cache[0] == 'embedded_mnist' and cache[-1] == 'True'
  assert ('- embedded_mnist: 2 rounds, 0 above the bound; the client program '
          'compiled in round(s) [1]') in text
  # The commands are shown without the machine's paths.
  assert str(tmp_path) not in text and '<tmp>/xla' in text


def test_lane_memory_vmapped_runs_match_the_loop(bench_env, repo_root,
                                                 tmp_path):
  out_file = tmp_path / 'lane_memory.md'
  proc = subprocess.run(
      [sys.executable, str(repo_root / 'benchmarks' / 'bench_lane_memory.py'),
       '--task=embedded_mnist', '--clients=4', '--lanes=2',
       f'--output={out_file}'],
      cwd=repo_root, env=bench_env, capture_output=True, text=True,
      timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  text = out_file.read_text()
  assert '# Peak memory of a vmapped round: 4 clients on 2 lanes' in text
  rows = {r[0]: r for r in _table(text, '| run | peak RSS')}
  assert list(rows) == ['loop', 'vmap 2 clients on 2 lanes (reference)',
                        'vmap 4 clients on 2 lanes',
                        'vmap 4 clients on 4 lanes']
  for name, r in rows.items():
    assert name in proc.stdout  # Each run's line is printed as it ends.
    rss = float(r[1])
    assert math.isfinite(rss) and rss > 0, r
    assert math.isfinite(float(r[3])), r
    assert float(r[5]) >= 1.0, r  # Executed >= useful lane-steps.
  assert rows['vmap 2 clients on 2 lanes (reference)'][2] == '1.00x'
  loop = rows['loop']
  assert float(loop[4]) == 0.0 and loop[5] == '1.000'
  useful = int(loop[6])  # The loop engine runs the useful steps in turn.
  loop_loss = float(loop[3])
  for name, lanes in (('vmap 4 clients on 2 lanes', 2),
                      ('vmap 4 clients on 4 lanes', 4)):
    r = rows[name]
    # The same clients and keys as the loop: the same final test loss, as
    # the script reports it and from the printed losses (7 digits).
    assert float(r[4]) <= 1e-5, r
    assert float(r[3]) == pytest.approx(loop_loss, rel=1e-5), r
    assert int(r[6]) >= -(-useful // lanes), r


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
        '--warmup=1', '--engines=loop:1,vmap'])
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
  assert list(rows) == [ref, 'ours loop, 1 step(s)/call',
                        'ours vmap (one program)']
  for name, (s, rate, ratio) in rows.items():
    assert math.isfinite(s) and s > 0, name
    assert _rate_consistent(rate, s), name
    assert math.isfinite(ratio) and ratio > 0, name
    assert _ratio_consistent(ratio, rows[ref][0], s), name
  assert rows[ref][2] == 1.0
