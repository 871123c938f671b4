"""``benchmarks/profile_rounds.py``: trace summaries and a tiny CPU run.

The summary is checked on hand-built traces with known durations (GPU
streams, nested XLA:CPU thunks, program executions); the run (a CPU
language model, 2 clients, 1 warm-up and 1 traced round, a few seconds)
checks the JSON's structure and that its numbers agree with each other.
No timing is asserted.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib
import sys

import conftest
import pytest


def _load(repo_root: pathlib.Path):
  sys.path.insert(0, str(repo_root / 'benchmarks'))
  spec = importlib.util.spec_from_file_location(
      'profile_rounds', repo_root / 'benchmarks' / 'profile_rounds.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _x(pid, tid, ts, dur, name, **args):
  return {'ph': 'X', 'pid': pid, 'tid': tid, 'ts': ts, 'dur': dur,
          'name': name, 'args': args}


def _meta(pid, name, tid=None):
  if tid is None:
    return {'ph': 'M', 'pid': pid, 'name': 'process_name',
            'args': {'name': name}}
  return {'ph': 'M', 'pid': pid, 'tid': tid, 'name': 'thread_name',
          'args': {'name': name}}


def test_classify_rules(repo_root):
  prof = _load(repo_root)
  assert prof.classify('sm90_xmma_fprop_implicit_gemm_f32') == 'convolution'
  assert prof.classify('ampere_sgemm_128x64_nn') == 'matmul'
  assert prof.classify('dot.53') == 'matmul'
  assert prof.classify('loop_add_fusion') == 'elementwise fusion'
  assert prof.classify('wrapped_add.1') == 'elementwise fusion'
  assert prof.classify('transpose.3') == 'copy/transpose'
  assert prof.classify('copy.107') == 'copy/transpose'
  assert prof.classify('input_reduce_fusion') == 'reduce'
  assert prof.classify('bitcast_dynamic-update-slice_fusion.9') == \
      'gather/scatter'
  assert prof.classify('ynn_fusion.3') == 'other'
  assert prof.classify('custom-call', hlo_op='cublas-gemm.1') == 'matmul'
  assert prof.classify('rng-bit-generator') == 'other'


def test_summary_of_a_gpu_trace(repo_root):
  """Two rounds of 1,000 us; kernels on a stream, a derived line ignored."""
  prof = _load(repo_root)
  events = [
      _meta(1, '/host:CPU'), _meta(2, '/device:GPU:0'),
      _meta(2, 'Stream #7(Compute)', tid=7), _meta(2, 'XLA Ops', tid=99),
      _x(1, 1, 0, 1000, 'profile_rounds:round 0'),
      _x(1, 1, 2000, 1000, 'profile_rounds:round 1'),
      # Round 0: a segment (run 1): gemm 300 + fusion 100; a server update.
      _x(2, 7, 100, 300, 'sm90_xmma_gemm_f32', hlo_module='jit_lanes_segment',
         hlo_op='dot.1', run_id=1),
      _x(2, 7, 400, 100, 'loop_add_fusion', hlo_module='jit_lanes_segment',
         hlo_op='add_fusion', run_id=1),
      _x(2, 7, 800, 50, 'input_reduce_fusion',
         hlo_module='jit_server_update', hlo_op='reduce', run_id=2),
      # Round 1: the same segment program again (run 3).
      _x(2, 7, 2100, 300, 'sm90_xmma_gemm_f32', hlo_module='jit_lanes_segment',
         hlo_op='dot.1', run_id=3),
      # Outside both rounds: not counted.
      _x(2, 7, 5000, 999, 'sm90_xmma_gemm_f32',
         hlo_module='jit_lanes_segment', hlo_op='dot.1', run_id=4),
      # A derived line repeating a kernel: not counted.
      _x(2, 99, 100, 300, 'dot.1', hlo_module='jit_lanes_segment'),
  ]
  s = prof.summarize(events)
  assert 'Stream' in s['sources']['ops']
  assert s['rounds'] == 2 and s['wall_s'] == pytest.approx(2000e-6)
  assert s['op_events'] == 4
  assert s['total_op_s'] == pytest.approx(750e-6)
  assert s['classes']['matmul']['s'] == pytest.approx(600e-6)
  assert s['classes']['matmul']['count'] == 2
  assert s['classes']['elementwise fusion']['s'] == pytest.approx(100e-6)
  assert s['classes']['reduce']['s'] == pytest.approx(50e-6)
  assert s['classes']['matmul']['share'] == pytest.approx(0.8)
  top = s['top_kernels'][0]
  assert (top['name'], top['count']) == ('sm90_xmma_gemm_f32', 2)
  assert top['total_s'] == pytest.approx(600e-6)
  assert s['busy_s'] == pytest.approx(750e-6)
  assert s['busy_share'] == pytest.approx(750 / 2000)
  seg = s['programs']['jit_lanes_segment']
  assert seg['executions'] == 2
  assert seg['span_s'] == pytest.approx(700e-6)  # 100..500 and 2100..2400.
  assert s['segment_s'] == pytest.approx(700e-6)
  assert s['outside_segment_s'] == pytest.approx(1300e-6)
  assert s['outside_segment_per_round_s'] == pytest.approx(650e-6)


def test_host_time_in_program_calls(repo_root):
  """A blocking call (the host inside it as long as its program runs) and a
  queued one; the nested repeat of a call (JAX's trace shows two
  PjitFunction events per call) counts once; calls outside rounds not."""
  prof = _load(repo_root)
  events = [
      _x(1, 1, 0, 1000, 'profile_rounds:round 0'),
      _x(1, 1, 100, 600, 'PjitFunction(lanes_segment)'),
      _x(1, 1, 100.4, 599, 'PjitFunction(lanes_segment)'),  # nested repeat
      _x(1, 1, 800, 20, 'PjitFunction(server_update)'),
      _x(1, 1, 850, 30, 'PjitFunction(lanes_segment)'),
      _x(1, 2, 120, 10, 'PjitFunction(lanes_segment)'),  # another thread
      _x(1, 1, 5000, 900, 'PjitFunction(lanes_segment)'),  # outside
  ]
  calls = prof.host_calls(events, [(0, 1000)])
  assert list(calls) == ['lanes_segment', 'server_update']
  seg = calls['lanes_segment']
  assert seg['calls'] == 3
  assert seg['host_s'] == pytest.approx(640e-6)
  assert seg['mean_ms'] == pytest.approx(640e-3 / 3)
  assert calls['server_update'] == {'calls': 1, 'host_s': pytest.approx(
      20e-6), 'mean_ms': pytest.approx(0.02)}
  assert prof.summarize(events)['host_calls'] == calls


def test_summary_of_nested_cpu_thunks(repo_root):
  """XLA:CPU: a thunk nested in another counts once; two threads overlap."""
  prof = _load(repo_root)
  events = [
      _meta(1, '/host:CPU'),
      _x(1, 1, 0, 1000, 'profile_rounds:round 0'),
      _x(1, 2, 100, 400, 'while.1', hlo_module='jit_lanes_segment',
         hlo_op='while.1', run_id=5),
      _x(1, 2, 150, 300, 'dot.2', hlo_module='jit_lanes_segment',
         hlo_op='dot.2', run_id=5),
      _x(1, 3, 200, 200, 'copy.3', hlo_module='jit_lanes_segment',
         hlo_op='copy.3', run_id=5),
      _x(1, 2, 151, 1, 'end: dot.2'),  # Thunk end marks are not ops.
      _x(1, 1, 700, 100, 'PjitFunction(lanes_segment)'),  # Not an op here.
  ]
  s = prof.summarize(events)
  assert s['sources']['ops'].startswith('XLA:CPU thunk events')
  assert s['op_events'] == 3
  # while: 400 - 300 own; dot 300; copy 200 (another thread).
  assert s['classes']['other']['s'] == pytest.approx(100e-6)
  assert s['classes']['matmul']['s'] == pytest.approx(300e-6)
  assert s['classes']['copy/transpose']['s'] == pytest.approx(200e-6)
  assert s['total_op_s'] == pytest.approx(600e-6)
  assert s['busy_s'] == pytest.approx(400e-6)  # The union: 100..500.
  assert s['segment_s'] == pytest.approx(400e-6)
  assert s['outside_segment_s'] == pytest.approx(600e-6)


def test_fusion_classes_from_optimized_hlo(repo_root, tmp_path):
  prof = _load(repo_root)
  (tmp_path / 'module_0003.jit_lanes_segment.cpu_after_optimizations.txt'
   ).write_text("""HloModule jit_lanes_segment

%fused_computation.1 (p0: f32[4,8], p1: f32[8,2]) -> f32[4,2] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,2]{1,0} parameter(1)
  ROOT %dot.5 = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.2 (p0: f32[4]) -> (f32[4], f32[4]) {
  %p0 = f32[4]{0} parameter(0)
  %t = f32[4]{0} tanh(%p0)
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(%t, %t)
}

ENTRY %main (a: f32[4,8], b: f32[8,2], c: f32[4]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  %c = f32[4]{0} parameter(2)
  %ynn_fusion.7 = f32[4,2]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.1
  %ynn_fusion.8 = (f32[4]{0}, f32[4]{0}) fusion(%c), kind=kCustom, calls=%fused_computation.2
  ROOT %copy.1 = f32[4,2]{1,0} copy(%ynn_fusion.7)
}
""")
  classes = prof.fusion_classes(str(tmp_path))
  assert classes == {('jit_lanes_segment', 'ynn_fusion.7'): 'matmul',
                     ('jit_lanes_segment', 'ynn_fusion.8'):
                     'elementwise fusion'}
  events = [_x(1, 1, 0, 100, 'profile_rounds:round 0'),
            _x(1, 2, 10, 30, 'ynn_fusion.7', hlo_op='ynn_fusion.7',
               hlo_module='jit_lanes_segment', run_id=1)]
  assert prof.summarize(events)['classes']['other']['s'] == \
      pytest.approx(30e-6)
  assert prof.summarize(events, fusions=classes)['classes']['matmul'][
      's'] == pytest.approx(30e-6)


def test_summary_without_program_names(repo_root):
  """Kernels that name no hlo_module: op time is known, segment time not."""
  prof = _load(repo_root)
  events = [_meta(2, '/device:GPU:0'), _meta(2, 'Stream #7', tid=7),
            _x(1, 1, 0, 1000, 'profile_rounds:round 0'),
            _x(2, 7, 10, 40, 'sgemm_kernel')]
  s = prof.summarize(events)
  assert s['classes']['matmul']['s'] == pytest.approx(40e-6)
  assert s['segment_s'] is None and s['outside_segment_s'] is None
  assert 'no hlo_module' in s['sources']['programs']


def test_summary_needs_round_windows(repo_root):
  prof = _load(repo_root)
  with pytest.raises(ValueError, match='no round windows'):
    prof.summarize([_x(1, 1, 0, 10, 'dot.1', hlo_op='dot.1')])


def test_profile_rounds_cpu_run(repo_root, tmp_path):
  out = tmp_path / 'profile.json'
  proc = conftest.run_script(
      'profile_rounds', '--model=lstm_tiny', '--engine=vmap', '--cohort=2',
      '--max_examples=40', '--lanes_per_device=1', '--segment_steps=1',
      '--warmup_rounds=1', '--rounds=1', f'--trace_dir={tmp_path / "tr"}',
      f'--output={out}', timeout=600)
  result = json.loads(out.read_text())
  assert result['status'] == 'done'
  assert len(result['warmup_round_s']) == 1
  assert len(result['traced_round_s']) == 1
  assert isinstance(result['traced_compilations'], int)
  with gzip.open(result['trace_file'], 'rt') as f:
    assert json.load(f)['traceEvents']
  s = result['summary']
  assert s['rounds'] == 1
  assert s['sources']['ops'].startswith('XLA:CPU thunk events')
  assert 'by the ops of their fused computations' in s['sources']['classes']
  assert s['op_events'] > 0
  assert list(s['classes']) == list(_load(repo_root).CLASSES)
  assert sum(c['s'] for c in s['classes'].values()) == pytest.approx(
      s['total_op_s'])
  assert sum(c['count'] for c in s['classes'].values()) == s['op_events']
  assert sum(c['share'] for c in s['classes'].values()) == pytest.approx(1)
  for c in s['classes'].values():
    assert 0 <= c['share'] <= 1
  assert 1 <= len(s['top_kernels']) <= 20
  for k in s['top_kernels']:
    assert k['count'] >= 1 and 0 <= k['share'] <= 1
  assert sum(k['total_s'] for k in s['top_kernels']) <= (
      s['total_op_s'] * (1 + 1e-9))
  assert 0 < s['busy_s'] <= s['wall_s'] and 0 < s['busy_share'] <= 1
  # The round ran lanes_begin, lanes_segment (at least once), lanes_finish.
  for name in ('jit_lanes_begin', 'jit_lanes_segment', 'jit_lanes_finish'):
    assert s['programs'][name]['executions'] >= 1, name
  assert 0 < s['segment_s'] <= s['wall_s']
  assert 0 <= s['outside_segment_s'] <= s['wall_s']
  assert s['outside_segment_s'] == pytest.approx(s['wall_s'] - s['segment_s'])
  assert 'lanes_segment' in proc.stdout and 'busy' in proc.stdout
