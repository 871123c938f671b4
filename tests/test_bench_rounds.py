"""Smoke run of ``benchmarks/bench_rounds.py`` and its device-facts helpers.

The run is tiny (a CPU language model, cohorts of 2 clients, two rounds on
fresh cohorts) and checks the plumbing: every (model, engine, cohort) row is
printed with its ratios and written, ratios are finite, executed steps >=
useful steps, the vmap engine compiles its client programs once for both
cohorts (JAX's compile events), the lane engines' fixed cost lies within
their profiled round, and a configuration over the time budget is skipped
with a reason (the skip rule is also checked on given numbers). No timing
is asserted. The GPU/TPU code paths (allocator peak, peak FLOP/s table) are
checked with stand-in devices. A benchmark killed as ``timeout`` kills it
leaves no worker process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import conftest
import pytest

from fedlite_jax import cpu_allocator

ENGINES = ('loop', 'vmap', 'fedjax_jit', 'fedjax_vmap')


def _load(repo_root: pathlib.Path):
  spec = importlib.util.spec_from_file_location(
      'bench_rounds', repo_root / 'benchmarks' / 'bench_rounds.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_rounds_smoke(repo_root, tmp_path):
  out_file = tmp_path / 'rounds.md'
  # Started without glibc's huge pages, as from a shell: on CPU the script
  # starts itself again with them where they apply (as the binary does).
  env = conftest.script_env()
  env.pop('GLIBC_TUNABLES', None)
  restarts = cpu_allocator.restart_env(
      env, cpu_allocator.thp_mode(), cpu_allocator.glibc_version()) is not None
  # Cohort 2 runs (the first cohort has no estimate: 0 s); cohort 2,000 is
  # estimated from cohort 2's times (positive) and is over a --max_seconds
  # of 1e-9 whatever the machine's speed: it is skipped with a reason.
  proc = conftest.run_script(
      'bench_rounds', '--models=lstm_tiny', f'--engines={",".join(ENGINES)}',
      '--cohorts=2,2000', '--rounds=2', '--max_examples=40',
      '--max_seconds=1e-9', '--lanes_per_device=1', '--segment_steps=1',
      '--no-isolate', f'--output={out_file}', env=env)
  out = proc.stdout
  text = out_file.read_text()
  assert 'command: `python benchmarks/bench_rounds.py --models=lstm_tiny' \
      in text
  assert 'jax ' in text and 'machine: ' in text
  allocator = 'CPU allocator system: default' + (
      ', huge pages' if restarts else '')
  assert re.search(rf'machine: .*{allocator}$', text, re.M), text[:600]
  rows = json.loads(re.search(r'<!-- rows: (.*) -->', text).group(1))
  assert sorted((r['engine'], r['cohort']) for r in rows) == sorted(
      (e, c) for e in ENGINES for c in (2, 2000))
  for r in rows:
    line = f'| lstm_tiny | {r["engine"]} | float32 | {r["cohort"]:,} |'
    assert line in out and line in text, line
    if r['cohort'] == 2000:
      assert 'skip' in r and '--max_seconds' in r['skip'], r
      continue
    assert 'skip' not in r, r
    # Two clients, at most ceil(40 / 16) = 3 steps each.
    assert 2 <= r['useful_steps'] <= 6 and r['rounds'] == 2
    assert r['executed_steps'] >= r['useful_steps']
    for key in ('rounds_per_s', 'host_share', 'mfu', 'step_flops',
                'peak_mem_bytes', 'run_s', 'compile_s'):
      assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert r['compilations'] >= r['client_program_compilations']
    assert sum(r['compile_s_by_program'].values()) == pytest.approx(
        r['compile_s'], abs=1e-3 * len(r['compile_s_by_program']))
    assert r['host_share'] < 1
    if r['engine'] in ('vmap', 'fedjax_vmap'):
      assert 0 <= r['fixed_s'] <= r['profiled_round_s'], r
      assert r['fixed_source'].startswith('XLA:CPU thunk events')
      assert f'| {r["fixed_s"]:.3g} of {r["profiled_round_s"]:.3g}' in text
    else:
      assert 'fixed_s' not in r
    # No upper bound on mfu: a ratio of two timings (the peak is measured
    # while other jobs may run); tests assert no timings.
    assert r['rounds_per_s'] == pytest.approx(1 / r['s_per_round'])
    if r['engine'] == 'fedjax_jit' or r['engine'] == 'loop':
      assert r['executed_steps'] == r['useful_steps'] == r['sequential_steps']
    if r['engine'] == 'loop':  # loop_init, loop_step, loop_final.
      assert r['client_program_compilations'] == 3
    if r['engine'] == 'vmap':
      # One lane streams both clients; lanes_begin, lanes_segment and
      # lanes_finish compile once for both rounds' cohorts.
      assert r['lanes'] == 1 and r['segment_steps'] == 1
      assert r['sequential_steps'] >= r['useful_steps']
      assert r['client_program_compilations'] == 3
      assert r['compile_s_by_program']['jit(lanes_segment)'] > 0
  # vs FedJAX jit / vs loop: their s/round / the row's, 1.00x on their own.
  ref = {e: next(r for r in rows if r['engine'] == e and r['cohort'] == 2)
         for e in ('fedjax_jit', 'loop')}
  # The references run first (fedjax_jit, loop), so each printed row has
  # its ratios, but fedjax_jit's row has none against loop (run after it).
  assert [r['engine'] for r in rows[::2]] == [
      'fedjax_jit', 'loop', 'vmap', 'fedjax_vmap']
  for r in rows:
    if r['cohort'] == 2:
      jit, loop = (f'{ref[e]["s_per_round"] / r["s_per_round"]:.2f}x'
                   for e in ('fedjax_jit', 'loop'))
      assert f'| {r["s_per_round"]:.3g} | {jit} | {loop} |' in text, r
      printed = loop if r['engine'] != 'fedjax_jit' else ''
      assert f'| {r["s_per_round"]:.3g} | {jit} | {printed} |' in out, r
  assert 'configuration wall s' in text
  # --merge: two files -> one file with both runs' rows and headers.
  merged = tmp_path / 'merged.md'
  proc = subprocess.run(
      [sys.executable, str(repo_root / 'benchmarks' / 'bench_rounds.py'),
       f'--merge={out_file},{out_file}', f'--output={merged}'],
      cwd=repo_root, env=env, capture_output=True, text=True, timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  bench = _load(repo_root)
  runs = bench.read_report(str(merged))
  assert [r for _, r in runs] == [rows, rows]
  assert '## Run 2' in merged.read_text()


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

  def fake_worker(args, emit=False, on_row=None):
    rows = []
    for cohort in args.cohorts:
      rows.append({'model': args.models, 'engine': args.engines,
                   'cohort': cohort, 'dtype': 'float32', 'skip': 'fake'})
      on_row(rows[-1])
      seen.append(bench.read_report(str(out_file))[0][1])
    return rows

  monkeypatch.setattr(bench, 'run_worker', fake_worker)
  bench.main(['--models=lstm_tiny', '--engines=loop', '--cohorts=2,3',
              '--no-isolate', f'--output={out_file}'])
  assert [[r['cohort'] for r in rows] for rows in seen] == [[2], [2, 3]]


def test_peak_flops_table_and_device_name(repo_root, monkeypatch):
  bench = _load(repo_root)
  assert bench.peak_flops_table('NVIDIA H100 80GB HBM3') == 494.7e12
  assert bench.peak_flops_table('NVIDIA H100 PCIe') == 378e12
  assert bench.peak_flops_table('NVIDIA H200') == 494.7e12
  assert bench.peak_flops_table('NVIDIA A100-SXM4-80GB') == 156e12
  assert bench.peak_flops_table('TPU v5 lite') == 197e12
  assert bench.peak_flops_table('TPU v4') == 275e12
  assert bench.peak_flops_table('cpu') is None
  assert bench.peak_flops_table('NVIDIA H100 80GB HBM3', 'bfloat16') == 989.4e12
  assert bench.peak_flops_table('TPU v4', 'bfloat16') == 275e12

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


def _workers_of(parent: int) -> list[int]:
  """Live (not zombie) worker processes started by benchmark ``parent``."""
  pids = []
  for d in os.listdir('/proc'):
    try:
      with open(f'/proc/{d}/cmdline', 'rb') as f:
        argv = f.read().split(b'\0')
      with open(f'/proc/{d}/stat', 'rb') as f:
        state = f.read().rsplit(b')', 1)[1].split()[0]
    except (OSError, IndexError):
      continue
    if (b'--worker' in argv and f'--parent={parent}'.encode() in argv
        and state != b'Z'):
      pids.append(int(d))
  return pids


@pytest.mark.skipif(not sys.platform.startswith('linux'),
                    reason='PR_SET_PDEATHSIG and /proc are Linux-only')
def test_a_killed_benchmark_leaves_no_worker(repo_root, tmp_path):
  """SIGTERM to the benchmark, as ``timeout`` sends at a stage's cap: its
  worker (own session, out of reach of a process-group kill) goes too; a
  GPU check's next stage must not share the device with it."""
  import signal
  import time
  proc = subprocess.Popen(
      [sys.executable, str(repo_root / 'benchmarks' / 'bench_rounds.py'),
       '--models=lstm_tiny', '--engines=vmap', '--cohorts=2', '--rounds=100000',
       '--max_examples=40', '--no-fixed_cost',
       f'--output={tmp_path / "rounds.md"}'],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 120
    workers = []
    while not workers and time.time() < deadline and proc.poll() is None:
      workers = _workers_of(proc.pid)
      time.sleep(0.1)
    assert workers, 'no worker started'
    assert os.getsid(workers[0]) != os.getsid(proc.pid)  # Its own session.
    proc.send_signal(signal.SIGTERM)
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
  """``--conv_implementation``: a lax convolution in the CNN's apply only
  where asked for (auto: im2col on the vmapped engines, lax on the loop
  engine), FedJAX's reference always lax; the worker and the profile get
  the flag."""
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
  args = argparse.Namespace(
      cohorts=[10], rounds=2, max_seconds=10, lanes_per_device='auto',
      segment_steps=4, segment_loop='auto', compute_dtype='float32',
      conv_implementation='lax', max_examples=0, seed=0, data_dir=None,
      fixed_cost=False, prefetch=True, lane_starts='rows',
      data_on_device='auto', variants='')
  assert '--conv_implementation=lax' in bench._worker_cmd(args, 'femnist',
                                                          'vmap')
  with pytest.raises(SystemExit):
    bench.main(['--conv_implementation=fft'])


def test_variants_run_in_the_vmap_process(repo_root, tmp_path):
  """``--variants``: the vmap worker (its own process) runs the flags as
  given, then each variant, on the same cohorts: every row is written with
  its label and the settings it ran with, and the notes give each
  variant's s/round against the first row's, as the rows' numbers say."""
  out_file = tmp_path / 'rounds.md'
  variants = ('segment_steps=2;lane_starts=scatter,prefetch=false;'
              'data_on_device=on;compute_dtype=bfloat16')
  conftest.run_script(
      'bench_rounds', '--models=lstm_tiny', '--engines=vmap', '--cohorts=2',
      '--rounds=2', '--max_examples=40', '--lanes_per_device=1',
      '--segment_steps=1', '--no-fixed_cost', '--extra=',
      f'--variants={variants}', f'--output={out_file}')
  text = out_file.read_text()
  rows = json.loads(re.search(r'<!-- rows: (.*) -->', text).group(1))
  labels = ['', 'segment_steps=2', 'lane_starts=scatter,prefetch=false',
            'data_on_device=on', 'compute_dtype=bfloat16']
  assert [r.get('variant', '') for r in rows] == labels
  assert all('skip' not in r for r in rows), rows
  assert [r['segment_steps'] for r in rows] == [1, 2, 1, 1, 1]
  assert [r['rows_on_device'] for r in rows] == [False, False, False, True,
                                                 False]
  assert [r['dtype'] for r in rows] == ['float32'] * 4 + ['bfloat16']
  # The same cohorts: the same useful steps in every row.
  assert len({r['useful_steps'] for r in rows}) == 1
  for r in rows[1:]:
    engine = f'vmap [{r["variant"]}]'
    assert f'| lstm_tiny | {engine} | {r["dtype"]} | 2 |' in text
    ratio = rows[0]['s_per_round'] / r['s_per_round']
    assert f'lstm_tiny cohort 2 [{r["variant"]}] {ratio:.2f}x' in text
  assert '--variants=' + variants in text


def test_bad_variants_get_one_line(repo_root):
  bench = _load(repo_root)
  assert bench.parse_variants('') == []
  assert bench.parse_variants(' segment_steps=16 ; prefetch=false,'
                              'lanes_per_device=auto') == [
                                  {'segment_steps': 16},
                                  {'prefetch': False,
                                   'lanes_per_device': 'auto'}]
  cases = [('foo=1', "'foo=1' is not option=value"),
           ('segment_loop', "'segment_loop' is not option=value"),
           ('segment_loop=bogus', "segment_loop='bogus': allowed values "
            'are auto, unroll, scan, while, fixed, host.'),
           ('prefetch=yes', "prefetch='yes': allowed values are true, "
            'false.'),
           ('segment_steps=0', "segment_steps='0': must be an int >= 1."),
           ('compute_dtype=float16', "compute_dtype='float16': allowed "
            'values are float32, bfloat16.'),
           ('lanes_per_device=many', "lanes_per_device='many': must be "
            "'auto' or an int >= 1.")]
  for text, message in cases:
    with pytest.raises(SystemExit, match=re.escape(message)):
      bench.parse_variants(text)
  with pytest.raises(SystemExit, match='--variants: '):
    bench.main(['--variants=data_on_device=maybe', '--output=-'])
  with pytest.raises(SystemExit, match='runs no vmap engine'):
    bench.main(['--engines=loop', '--variants=segment_steps=2',
                '--output=-'])


def test_cnn_step_flops_count_the_convolutions(repo_root):
  """XLA's count of the EMNIST CNN step (lowered for the CPU) vs a hand
  count of its multiply-adds (forward, input and weight gradients)."""
  import jax
  import numpy as np
  from fedlite_jax import models
  bench = _load(repo_root)
  model = models.create_emnist_cnn(62).model
  params = model.init(jax.random.PRNGKey(0))
  batch = {'x': np.zeros((20, 28, 28, 1), np.float32),
           'y': np.zeros((20,), np.int32)}
  b = 20
  conv1 = 2 * b * 26 * 26 * 32 * 9 * 1
  conv2 = 2 * b * 24 * 24 * 64 * 9 * 32
  dense = 2 * b * (9216 * 128 + 128 * 62)
  # Forward of each layer, its weight gradient, and the input gradient of
  # all but the first layer.
  hand = 3 * (conv2 + dense) + 2 * conv1
  flops = bench.step_flops(model, params, batch)
  assert hand <= flops <= 1.1 * hand, (flops, hand)


def test_step_flops_matches_dense_count(repo_root):
  """XLA's count of a linear model's step vs a hand count (independent)."""
  import fedjax
  import haiku as hk
  import jax
  import jax.numpy as jnp
  import numpy as np
  bench = _load(repo_root)
  b, d, k = 32, 64, 16

  def forward(batch):
    return hk.Linear(k, with_bias=False)(batch['x'])

  model = fedjax.create_model_from_haiku(
      hk.transform(forward), {'x': jnp.zeros((1, d))},
      train_loss=lambda batch, preds: jnp.sum((preds - batch['y'])**2, -1))
  params = model.init(jax.random.PRNGKey(0))
  batch = {'x': np.ones((b, d), np.float32), 'y': np.ones((b, k), np.float32)}
  flops = bench.step_flops(model, params, batch)
  matmuls = 2 * (2 * b * d * k)  # forward x@W and the gradient x^T@g.
  assert matmuls <= flops <= 1.5 * matmuls


def test_gpu_check_stages_are_the_ones_it_lists():
  """``benchmarks/gpu_check.sh`` parses (``bash -n``), and the stages its
  header lists are exactly those it runs (a stage named for a lent GPU's
  only call must exist), each calling a benchmark that exists."""
  root = pathlib.Path(__file__).resolve().parents[1]
  script = root / 'benchmarks' / 'gpu_check.sh'
  subprocess.run(['bash', '-n', str(script)], check=True)
  text = script.read_text()
  header = text.split('# Stages:', 1)[1].split('# (default:', 1)[0]
  listed = set(header.replace('#', ' ').split())
  cases = set(re.findall(r'^    ([a-z0-9_]+)\)', text, re.M))
  assert listed == cases, (listed ^ cases)
  default = re.search(r'\$\{@:-([a-z0-9_ ]+)\}', text).group(1).split()
  assert set(default) <= cases, default
  for path in set(re.findall(r'benchmarks/[a-z_]+\.py', text)):
    assert (root / path).is_file(), path
  # The rounds stages' --variants parse (a typo would fail only there).
  names = re.findall(r'^(AB_[A-Z]+)=', text, re.M)
  assert names, 'no AB_* variants in gpu_check.sh'
  defs = '\n'.join(re.findall(r'^AB_[A-Z]+="[^"]*"', text, re.M))
  values = subprocess.run(
      ['bash', '-c', defs + '\n' + ''.join(f'echo "${n}"\n' for n in names)],
      check=True, capture_output=True, text=True).stdout.splitlines()
  bench = _load(root)
  for name, value in zip(names, values):
    assert len(bench.parse_variants(value)) >= 2, (name, value)
