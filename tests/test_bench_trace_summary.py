"""``benchmarks/trace_summary.py``: summaries of hand-built traces.

Traces with known durations (GPU streams and a derived line, nested XLA:CPU
thunks on two threads, program executions) against the numbers the summary must give. ``bench_rounds.py
--profile`` runs the real thing (``tests/test_bench_rounds.py``).
"""

from __future__ import annotations

import conftest
import pytest


@pytest.fixture(scope='module')
def prof():
  with conftest.benchmark_modules('trace_summary') as (module,):
    yield module


def _x(pid, tid, ts, dur, name, **args):
  return {'ph': 'X', 'pid': pid, 'tid': tid, 'ts': ts, 'dur': dur,
          'name': name, 'args': args}


def _meta(pid, name, tid=None):
  if tid is None:
    return {'ph': 'M', 'pid': pid, 'name': 'process_name',
            'args': {'name': name}}
  return {'ph': 'M', 'pid': pid, 'tid': tid, 'name': 'thread_name',
          'args': {'name': name}}


def test_classify_rules(prof):
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


def test_summary_of_a_gpu_trace(prof):
  """Two rounds of 1,000 us; kernels on a stream, a derived line ignored."""
  events = [
      _meta(1, '/host:CPU'), _meta(2, '/device:GPU:0'),
      _meta(2, 'Stream #7(Compute)', tid=7), _meta(2, 'XLA Ops', tid=99),
      _x(1, 1, 0, 1000, 'bench_rounds:round 0'),
      _x(1, 1, 2000, 1000, 'bench_rounds:round 1'),
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


def test_summary_of_nested_cpu_thunks(prof):
  """XLA:CPU: a thunk nested in another counts once; two threads overlap."""
  events = [
      _meta(1, '/host:CPU'),
      _x(1, 1, 0, 1000, 'bench_rounds:round 0'),
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


def test_summary_without_program_names(prof):
  """Kernels that name no hlo_module: op time is known, segment time not."""
  events = [_meta(2, '/device:GPU:0'), _meta(2, 'Stream #7', tid=7),
            _x(1, 1, 0, 1000, 'bench_rounds:round 0'),
            _x(2, 7, 10, 40, 'sgemm_kernel')]
  s = prof.summarize(events)
  assert s['classes']['matmul']['s'] == pytest.approx(40e-6)
  assert s['segment_s'] is None and s['outside_segment_s'] is None
  assert 'no hlo_module' in s['sources']['programs']


def test_summary_needs_round_windows(prof):
  with pytest.raises(ValueError, match='no round windows'):
    prof.summarize([_x(1, 1, 0, 10, 'dot.1', hlo_op='dot.1')])
