"""Smoke runs of ``benchmarks/bench_rounds.py`` and its helpers.

The runs are tiny (a CPU language model, cohorts of 2 clients, two rounds
on fresh cohorts) and check the plumbing: every (model, engine, dtype,
cohort) row is printed with its ratios and written, executed steps >=
useful steps, our engines compile their client programs in the first round
only, the profiled round leaves a trace and a summary, a configuration over
the time budget is skipped with a reason, and each configuration's own
process (``--isolate``) reports its rows. No timing is asserted. The
GPU/TPU code paths (allocator peak, peak FLOP/s table) are checked with
stand-in devices; a benchmark killed as ``timeout`` kills it leaves no
worker process behind; ``gpu_check.sh``'s commands parse.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import conftest
import pytest

ENGINES = ('loop', 'vmap', 'fedjax_jit', 'fedjax_vmap')


def _load(repo_root: pathlib.Path):
  spec = importlib.util.spec_from_file_location(
      'bench_rounds', repo_root / 'benchmarks' / 'bench_rounds.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _rows(path: pathlib.Path) -> list[dict]:
  return json.loads(re.search(r'<!-- rows: (.*) -->',
                              path.read_text()).group(1))


def test_bench_rounds_smoke(repo_root, tmp_path):
  out_file = tmp_path / 'rounds.md'
  # Cohort 2 runs (the first cohort has no estimate: 0 s); cohort 2,000 is
  # estimated from cohort 2's times (positive) and is over a --max_seconds
  # of 1e-9 whatever the machine's speed: it is skipped with a reason.
  proc = conftest.run_script(
      'bench_rounds', '--models=lstm_tiny', f'--engines={",".join(ENGINES)}',
      '--cohorts=2,2000', '--rounds=2', '--max_examples=40',
      '--max_seconds=1e-9', '--lanes_per_device=1', '--segment_steps=1',
      '--no-isolate', '--profile', f'--output={out_file}')
  out, text = proc.stdout, out_file.read_text()
  assert 'command: `python benchmarks/bench_rounds.py --models=lstm_tiny' \
      in text
  assert 'machine: 1 x cpu (cpu)' in text and 'fedjax 0.0.17' in text
  rows = _rows(out_file)
  # The references run first (fedjax_jit, loop): each row prints its ratios.
  assert [(r['engine'], r['cohort']) for r in rows] == [
      (e, c) for e in ('fedjax_jit', 'loop', 'vmap', 'fedjax_vmap')
      for c in (2, 2000)]
  for r in rows:
    line = f'| lstm_tiny | {r["engine"]} | float32 | {r["cohort"]:,} |'
    assert line in out and line in text, line
    if r['cohort'] == 2000:
      assert '--max_seconds' in r['skip'], r
      continue
    assert 'skip' not in r, r
    # Two clients, at most ceil(40 / 16) = 3 steps each.
    assert 2 <= r['useful_steps'] <= 6 and r['rounds'] == 2
    assert r['executed_steps'] >= r['useful_steps']
    assert r['sequential_steps'] <= r['executed_steps']
    for key in ('s_per_round', 'peak_mem_bytes', 'run_s', 'compile_s'):
      assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert r['compilations'] >= r['client_program_compilations']
    assert r['compilations'] >= r['later_compilations'] >= 0
    if r['engine'] == 'fedjax_jit':
      assert r['executed_steps'] == r['useful_steps'] == r['sequential_steps']
    if r['engine'] in ('loop', 'vmap'):
      # The client programs compile once, in the first round; a fresh cohort
      # of the same shapes compiles nothing.
      assert r['client_program_compilations'] == 3, r
      assert r['later_compilations'] == 0, r
    if r['engine'] == 'vmap':
      assert r['lanes'] == 1 and r['segment_steps'] == 1
      assert r['compile_s_by_program']['jit(lanes_segment)'] > 0
    # The profiled round: its summary beside the trace.
    summary = json.loads(pathlib.Path(r['profile']).read_text())
    assert pathlib.Path(summary['trace_file']).is_file()
    assert summary['rounds'] == 1 and summary['op_events'] > 0
    assert summary['sources']['ops'].startswith('XLA:CPU thunk events')
    assert sum(c['s'] for c in summary['classes'].values()) == pytest.approx(
        summary['total_op_s'])
    assert 0 < summary['busy_share'] <= 1
    if r['engine'] in ('vmap', 'fedjax_vmap'):
      for name in ('jit_lanes_begin', 'jit_lanes_segment',
                   'jit_lanes_finish'):
        assert summary['programs'][name]['executions'] >= 1, name
      assert 0 <= r['outside_segment_s'] <= summary['wall_s']
      assert f'| {r["outside_segment_s"]:.3g} |' in text
    else:
      assert r['outside_segment_s'] is None
  # vs FedJAX jit / vs loop: their s/round / the row's, 1.00x on their own.
  ref = {e: next(r for r in rows if r['engine'] == e and r['cohort'] == 2)
         for e in ('fedjax_jit', 'loop')}
  for r in rows:
    if r['cohort'] == 2:
      jit, loop = (f'{ref[e]["s_per_round"] / r["s_per_round"]:.2f}x'
                   for e in ('fedjax_jit', 'loop'))
      assert f'| {r["s_per_round"]:.3g} | {jit} | {loop} |' in text, r
      # fedjax_jit's printed row has no loop ratio yet (loop runs after it).
      printed = loop if r['engine'] != 'fedjax_jit' else ''
      assert f'| {r["s_per_round"]:.3g} | {jit} | {printed} |' in out, r
  assert 'compile s by program' in text


def test_dtypes_in_their_own_processes(repo_root, tmp_path):
  """``--compute_dtype=float32,bfloat16``: a vmap row per dtype, FedJAX's
  jit reference once (float32), each configuration in its own process."""
  out_file = tmp_path / 'rounds.md'
  conftest.run_script(
      'bench_rounds', '--models=lstm_tiny', '--engines=vmap,fedjax_jit',
      '--compute_dtype=float32,bfloat16', '--cohorts=2', '--rounds=2',
      '--max_examples=40', '--lanes_per_device=1', '--segment_steps=1',
      f'--output={out_file}')
  rows = _rows(out_file)
  assert [(r['engine'], r['dtype']) for r in rows] == [
      ('fedjax_jit', 'float32'), ('vmap', 'float32'), ('vmap', 'bfloat16')]
  assert all('skip' not in r for r in rows), rows
  assert len({r['useful_steps'] for r in rows}) == 1  # The same cohorts.
  text = out_file.read_text()
  for r in rows[1:]:
    ratio = rows[0]['s_per_round'] / r['s_per_round']
    assert (f'| lstm_tiny | vmap | {r["dtype"]} | 2 | '
            f'{r["s_per_round"]:.3g} | {ratio:.2f}x |') in text


def test_skip_rule(repo_root):
  bench = _load(repo_root)
  assert bench.estimate_seconds(None, 1000, 5) == 0.0
  # 3 s compiling + 0.5 s/round x (100 / 10 clients) x 5 rounds.
  assert bench.estimate_seconds((10, 0.5, 3.0), 100, 5) == 28.0
  assert bench.skip_reason(28.0, 30.0, 0.0, 100.0) is None
  assert bench.skip_reason(28.0, 20.0, 0.0, 100.0) == (
      'estimated 28 s > --max_seconds=20')
  assert bench.skip_reason(28.0, 30.0, 80.0, 100.0) == (
      "over the run's --total_seconds budget")


def test_report_rewritten_after_every_row(repo_root, tmp_path, monkeypatch):
  """A run killed after its first row leaves that row in the file."""
  bench = _load(repo_root)
  out_file = tmp_path / 'rounds.md'
  seen = []

  def fake_worker(args, on_row=None):
    for cohort in args.cohorts:
      on_row({'model': args.models, 'engine': args.engines,
              'cohort': cohort, 'dtype': 'float32', 'skip': 'fake'})
      seen.append([r['cohort'] for r in _rows(out_file)])

  monkeypatch.setattr(bench, 'run_worker', fake_worker)
  bench.main(['--models=lstm_tiny', '--engines=loop', '--cohorts=2,3',
              '--no-isolate', f'--output={out_file}'])
  assert seen == [[2], [2, 3]]


def test_bad_flags_get_one_line(repo_root):
  bench = _load(repo_root)
  for flag, message in (
      ('--engines=vmap,warp', "--engines: 'warp' is not one of loop, vmap"),
      ('--models=resnet', "--models: 'resnet' is not one of femnist"),
      ('--compute_dtype=float16', "--compute_dtype: 'float16' is not one of "
       'float32, bfloat16.'),
      ('--lanes_per_device=many', "--lanes_per_device must be 'auto' or an "
       "int >= 1; got 'many'."),
      ('--slots=0', "--slots must be 'auto' or an int >= 1; got '0'."),
      ('--cohorts=0', '--cohorts, --rounds and --profile_rounds must be >= 1')):
    with pytest.raises(SystemExit, match=re.escape(message)):
      bench.main([flag, '--output=-'])


def test_device_name_and_peak_memory(repo_root, monkeypatch):
  bench = _load(repo_root)

  class FakeDevice:
    device_kind = 'NVIDIA H100 80GB HBM3'

    def memory_stats(self):
      return {'peak_bytes_in_use': 123456789, 'bytes_limit': 80 * 2**30}

  monkeypatch.setattr(bench.jax, 'devices', lambda *a: [FakeDevice()])
  assert bench.device_name() == 'nvidia_h100_80gb_hbm3'
  assert bench.peak_memory_bytes() == (123456789,
                                       'device peak_bytes_in_use')


def test_fresh_cohorts_differ_and_repeat(repo_root):
  bench = _load(repo_root)
  clients, data = bench.population('lstm_tiny', 10, 0, 40, None)
  assert data == 'synthetic' and len(clients) == 1000
  a = [c for c, _, _ in bench.fresh_cohort(clients, 10, 0, 1)]
  b = [c for c, _, _ in bench.fresh_cohort(clients, 10, 0, 2)]
  assert len(set(a)) == 10 and a != b
  assert a == [c for c, _, _ in bench.fresh_cohort(clients, 10, 0, 1)]


def _workers_of(group: int) -> list[int]:
  """Live (not zombie) worker processes in process group ``group``."""
  pids = []
  for d in os.listdir('/proc'):
    try:
      with open(f'/proc/{d}/cmdline', 'rb') as f:
        argv = f.read().split(b'\0')
      with open(f'/proc/{d}/stat', 'rb') as f:
        state, _, pgrp = f.read().rsplit(b')', 1)[1].split()[:3]
    except (OSError, ValueError):
      continue
    if b'--worker' in argv and int(pgrp) == group and state != b'Z':
      pids.append(int(d))
  return pids


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='/proc is Linux-only')
def test_a_timed_out_benchmark_leaves_no_worker(repo_root, tmp_path):
  """SIGTERM to the benchmark's process group, as ``timeout`` sends at a
  stage's cap: its worker (a configuration's process) goes too; a GPU
  check's next stage must not share the device with it."""
  proc = subprocess.Popen(
      [sys.executable, str(repo_root / 'benchmarks' / 'bench_rounds.py'),
       '--models=lstm_tiny', '--engines=vmap', '--cohorts=2',
       '--rounds=100000', '--max_examples=40',
       f'--output={tmp_path / "rounds.md"}'],
      env=conftest.script_env(), stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL, start_new_session=True)
  try:
    deadline = time.time() + 120
    workers = []
    while not workers and time.time() < deadline and proc.poll() is None:
      workers = _workers_of(proc.pid)
      time.sleep(0.1)
    assert workers, 'no worker started'
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while _workers_of(proc.pid) and time.time() < deadline:
      time.sleep(0.1)
    assert not _workers_of(proc.pid)
  finally:  # Never leave one running (100,000 rounds), even on failure.
    for pid in _workers_of(proc.pid):
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
      proc.kill()


def test_conv_implementation_reaches_the_model(repo_root):
  """``--conv_implementation``: a lax convolution in the CNN only where
  asked for (auto: im2col on the vmapped engines, lax on the loop engine),
  FedJAX's reference always lax; the worker processes get the flag."""
  import jax
  import numpy as np
  bench = _load(repo_root)
  x = {'x': np.zeros((2, 28, 28, 1), np.float32)}

  def convolves(model):
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    return 'conv_general_dilated' in str(jax.make_jaxpr(
        lambda p: model.apply_for_eval(p, x))(params))

  cases = [('vmap', 'auto', False), ('vmap', 'lax', True),
           ('loop', 'auto', True), ('loop', 'im2col', False),
           ('fedjax_jit', 'im2col', True), ('fedjax_vmap', 'auto', False)]
  for engine, conv, expected in cases:
    assert convolves(bench._model('femnist', engine, conv=conv)) == expected, (
        engine, conv)
  assert 'conv_implementation' in bench._PASSED


def test_gpu_check_commands_parse(repo_root, tmp_path):
  """``benchmarks/gpu_check.sh`` parses (``bash -n``); each stage's
  ``bench_rounds.py`` flags parse, and every file it writes is under
  ``$OUT``."""
  script = repo_root / 'benchmarks' / 'gpu_check.sh'
  subprocess.run(['bash', '-n', str(script)], check=True)
  text = script.read_text().replace('\\\n', ' ')
  common = shlex.split(re.search(
      r'bench_rounds\.py (--engines=.*"\$@")', text).group(1))[:-1]
  stages = re.findall(r'^stage (\w+) \d+ (.*)$', text, re.M)
  assert [name for name, _ in stages] == ['femnist', 'transformer_large']
  bench = _load(repo_root)
  for name, flags in stages:
    argv = common + shlex.split(flags.replace('$OUT', str(tmp_path)))
    for flag in argv:
      if flag.startswith(('--output=', '--profile_dir=')):
        assert flag.split('=', 1)[1].startswith(str(tmp_path)), (name, flag)
    args = bench._parse(argv)
    assert args.cohorts == [100] and 'fedjax_jit' in args.engines, name
  assert '--profile' in stages[0][1]
