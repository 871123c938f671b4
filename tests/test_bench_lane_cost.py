"""benchmarks/bench_lane_cost.py on the smallest Transformer: what a
lane-step costs next to the plain vmapped step (XLA:CPU cost analysis).

References: the plain vmapped gradient + SGD step compiled in the same
process (FLOPs within 2% and planned bytes within 10%, the engine's budget
for its bookkeeping), the lane states' size (XLA copied them once per
lane-step before the starts wrote rows in place and the updates waited for
the gradients), and the optimized HLO (no scatter that the step itself
does not hold).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import conftest
import pytest


@pytest.fixture(scope='module')
def bench():
  with conftest.benchmark_modules('bench_lane_cost') as (bench_lane_cost,):
    yield bench_lane_cost


def test_a_scan_lane_step_costs_the_plain_step(bench, tmp_path):
  m = bench.measure('transformer_tiny', lanes=4, slots=2, segment_steps=2,
                    loop='scan')
  assert 1.0 <= m['flops_ratio'] <= 1.02, m
  assert 0.5 < m['idle_bytes_ratio'] <= m['body_bytes_ratio'], m
  assert 0 < m['transition_share'] <= 1, m
  assert m['planned_bytes_ratio'] <= 1.10, m
  # No copy of the lane states, nor of the weighted sums: XLA's copies
  # outside fusions in a segment move less than one read and write of ONE
  # client's float32 parameters. It copied every lane's when the starts
  # rewrote the states and the updates waited for no gradient, and the
  # weighted sums (one client's parameters, at each of the segment's two
  # conditionals) when the starts ran outside the lane-step's conditional.
  # The idle branch itself copies (next to) nothing.
  client_bytes = 4 * m['params']
  assert m['hlo_segment']['copy_bytes'] < 2 * client_bytes, m
  assert m['idle_copy_bytes'] < 0.1 * 2 * client_bytes, m
  # The step's own scatters (the embedding gradient), and no others.
  seg, plain = m['hlo_segment'], m['hlo_plain_steps']
  assert seg['scatter_not_unique'] <= plain['scatter_not_unique'] // 2, m
  out = tmp_path / 'cost.md'
  bench._write(str(out), ['test'], [m])  # pylint: disable=protected-access
  assert 'transformer_tiny | float32 | scan' in out.read_text()


def test_copied_bytes_leave_out_fusions(bench):
  """Copies in a fusion are its kernel's layout changes, not buffers."""
  hlo = ('%fused_computation (p: f32[8]) -> f32[8] {\n'
         '  %p = f32[8]{0} parameter(0)\n'
         '  ROOT %c = f32[8]{0} copy(%p)\n}\n\n'
         'ENTRY %main (q: f32[4], r: f32[8]) -> (f32[4], f32[8]) {\n'
         '  %q = f32[4]{0} parameter(0)\n'
         '  %r = f32[8]{0} parameter(1)\n'
         '  %k = f32[4]{0} copy(%q)\n'
         '  %f = f32[8]{0} fusion(%r), kind=kLoop, calls=%fused_computation\n'
         '  ROOT %t = (f32[4], f32[8]) tuple(%k, %f)\n}\n')
  assert bench.copied_bytes(hlo) == 2 * 4 * 4


def test_executed_kernels_follow_loops_and_branches(bench):
  """A loop's body counts its trip count times, a conditional its costlier
  branch, a fusion once whatever it holds, views and tuples not at all;
  a loop of unknown trip count counts once, its condition included."""
  hlo = (
      '%fused (p: f32[4]) -> f32[4] {\n'
      '  %p = f32[4]{0} parameter(0)\n'
      '  %a = f32[4]{0} add(%p, %p)\n'
      '  ROOT %m = f32[4]{0} multiply(%a, %a)\n}\n\n'
      '%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {\n'
      '  %t = (s32[], f32[4]{0}) parameter(0)\n'
      '  %x = f32[4]{0} get-tuple-element(%t), index=1\n'
      '  %i = s32[] get-tuple-element(%t), index=0\n'
      '  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused\n'
      '  %c = f32[4]{0} copy(%f)\n'
      '  ROOT %r = (s32[], /*index=1*/f32[4]{0}) tuple(%i, %c)\n}\n\n'
      '%cond (t: (s32[], f32[4])) -> pred[] {\n'
      '  %t = (s32[], f32[4]{0}) parameter(0)\n'
      '  %i = s32[] get-tuple-element(%t), index=0\n'
      '  %k = s32[] constant(3)\n'
      '  ROOT %lt = pred[] compare(%i, %k), direction=LT\n}\n\n'
      '%small (x: f32[4]) -> f32[4] {\n'
      '  %x = f32[4]{0} parameter(0)\n'
      '  ROOT %n = f32[4]{0} negate(%x)\n}\n\n'
      '%big (x: f32[4]) -> f32[4] {\n'
      '  %x = f32[4]{0} parameter(0)\n'
      '  %e = f32[4]{0} exponential(%x)\n'
      '  ROOT %l = f32[4]{0} log(%e)\n}\n\n'
      'ENTRY %main (x: f32[4], b: s32[]) -> f32[4] {\n'
      '  %x = f32[4]{0} parameter(0)\n'
      '  %b = s32[] parameter(1)\n'
      '  %z = s32[] constant(0)\n'
      '  %t = (s32[], /*index=1*/f32[4]{0}) tuple(%z, %x)\n'
      '  %w = (s32[], /*index=1*/f32[4]{0}) while(%t), condition=%cond, '
      'body=%body, backend_config={"known_trip_count":{"n":"3"}}\n'
      '  %u = (s32[], /*index=1*/f32[4]{0}) while(%w), condition=%cond, '
      'body=%body\n'
      '  %y = f32[4]{0} get-tuple-element(%u), index=1\n'
      '  %v = f32[4]{0} conditional(%b, %y, %y), '
      'branch_computations={%small, %big}\n'
      '  ROOT %o = f32[4]{0} call(%v), to_apply=%small\n}\n')
  # 3 x (fusion + copy) + (fusion + copy + compare) + max(1, 2) + 1.
  assert bench.executed_kernels(hlo) == 6 + 3 + 2 + 1
  # The conditional as its branch 0 (lax.cond's false branch).
  assert bench.executed_kernels(hlo, branch=0) == 6 + 3 + 1 + 1
  with pytest.raises(ValueError, match='no ENTRY'):
    bench.executed_kernels('%f (x: f32[]) -> f32[] {\n}\n')


def test_executed_kernels_read_xla_gpu_conditionals(bench):
  """XLA:GPU prints a two-way conditional as ``true_computation=...,
  false_computation=...``: two branches (the list does not run on into
  the next attribute), branch 0 the false one as ``lax.cond``'s; and
  ``copied=True`` weighs a run's copies by the bytes they read and write
  (a copy in a loop body its trip count times, in a fusion not at all),
  along the same path (a conditional's branch of the most kernels)."""
  hlo = (
      '%fused (p: f32[4]) -> f32[4] {\n'
      '  %p = f32[4]{0} parameter(0)\n'
      '  ROOT %c = f32[4]{0} copy(%p)\n}\n\n'
      '%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {\n'
      '  %t = (s32[], f32[8]{0}) parameter(0)\n'
      '  %x = f32[8]{0} get-tuple-element(%t), index=1\n'
      '  %i = s32[] get-tuple-element(%t), index=0\n'
      '  %c = f32[8]{0} copy(%x)\n'
      '  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %c)\n}\n\n'
      '%cond (t: (s32[], f32[8])) -> pred[] {\n'
      '  %t = (s32[], f32[8]{0}) parameter(0)\n'
      '  ROOT %p = pred[] constant(true)\n}\n\n'
      '%pass (x: f32[4]) -> f32[4] {\n'
      '  %x = f32[4]{0} parameter(0)\n'
      '  ROOT %c = f32[4]{0} copy(%x)\n}\n\n'
      '%work (x: f32[4]) -> f32[4] {\n'
      '  %x = f32[4]{0} parameter(0)\n'
      '  %e = f32[4]{0} exponential(%x)\n'
      '  %f = f32[4]{0} fusion(%e), kind=kLoop, calls=%fused\n'
      '  ROOT %l = f32[4]{0} log(%f)\n}\n\n'
      'ENTRY %main (x: f32[4], b: pred[], y: f32[8]) -> f32[4] {\n'
      '  %x = f32[4]{0} parameter(0)\n'
      '  %b = pred[] parameter(1)\n'
      '  %y = f32[8]{0} parameter(2)\n'
      '  %z = s32[] constant(0)\n'
      '  %t = (s32[], f32[8]{0}) tuple(%z, %y)\n'
      '  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, '
      'backend_config={"known_trip_count":{"n":"5"}}\n'
      '  ROOT %v = f32[4]{0} conditional(%b, %x, %x), '
      'true_computation=%work, false_computation=%pass, '
      'metadata={op_name="cond"}\n}\n')
  assert bench.executed_kernels(hlo) == 5 + 3
  assert bench.executed_kernels(hlo, branch=0) == 5 + 1
  assert bench.executed_kernels(hlo, branch=1) == 5 + 3
  # The loop's copies, 5 x (8 floats read and written); then the branch.
  loop = 5 * 2 * 8 * 4
  assert bench.executed_kernels(hlo, branch=0, copied=True) == loop + 32
  assert bench.executed_kernels(hlo, branch=1, copied=True) == loop
  # Unnamed, a conditional counts as its branch of the most kernels.
  assert bench.executed_kernels(hlo, copied=True) == loop


def test_scatter_starts_launch_fewer_kernels(bench):
  """Starting the slots' clients by one scatter per state leaf runs fewer
  kernels per transition than the loop of row writes over the slots, which
  writes every leaf once per slot. Where no client ends, the row starts
  run nothing (they are in the conditional's other branch); the scatters
  run after the conditional at every step, which returns the sums'
  increment: on XLA:CPU at most 4 kernels per state leaf (the new rows,
  their order after the finalization, the indices, the scatter) and a
  zero fill and an add per sum leaf more, far from a transition's. Both
  launch more than the plain step (the masked update) and fewer than a
  transition."""
  import jax  # pylint: disable=g-import-not-at-top
  got = {starts: bench.measure('transformer_tiny', lanes=4, slots=3,
                               segment_steps=2, loop='scan',
                               starts=starts)['kernels']
         for starts in ('rows', 'scatter')}
  for k in got.values():
    assert k['plain_step'] < k['idle_step'] < k['transition_step'], got
  assert got['scatter']['transition_step'] < got['rows']['transition_step'], \
      got
  model = bench.build_model('transformer_tiny')
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  program, shared = bench.client_program(model, params)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  states = jax.eval_shape(program.init, shared, {'rng': key})
  sums = jax.eval_shape(program.final, shared, states)[0]
  more = 4 * len(jax.tree.leaves(states)) + 2 * len(jax.tree.leaves(sums))
  assert (got['rows']['idle_step'] < got['scatter']['idle_step'] <=
          got['rows']['idle_step'] + more), (got, more)
  assert got['rows']['plain_step'] == got['scatter']['plain_step'], got


def test_an_idle_lane_step_does_not_grow_with_the_slots(bench):
  """The lane-step's idle branch holds neither the finalizations nor the
  starts: its kernels for 1 and 5 slots differ by at most the predicate's
  few (``any(fin_lane >= 0)`` over 1 or 5 slots), where a transition runs
  one row write per state leaf per slot more (rows starts)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import streaming  # pylint: disable=g-import-not-at-top
  model = bench.build_model('transformer_tiny')
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  program, shared = bench.client_program(model, params)
  lanes = 4
  states = jax.eval_shape(jax.vmap(program.init, in_axes=(None, 0)), shared,
                          bench._lead({'rng': key}, lanes))  # pylint: disable=protected-access
  acc = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct((1,) + s.shape, s.dtype),
      jax.eval_shape(program.final, shared, jax.tree.map(
          lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), states))[0])
  step = lambda st, b: (program.carried_step(st, b), None)
  kernels = {}
  for slots in (1, 5):
    x = streaming.StepInputs(
        batch=bench.batch_shape('transformer_tiny', lanes),
        active=jax.ShapeDtypeStruct((lanes,), jnp.bool_),
        fin_lane=jax.ShapeDtypeStruct((slots,), jnp.int32),
        fin_weight=jax.ShapeDtypeStruct((slots,), jnp.float32),
        start_input=bench._lead({'rng': key}, slots),  # pylint: disable=protected-access
        start_on=jax.ShapeDtypeStruct((slots,), jnp.bool_))
    fn = streaming.lane_step(program.init, step, program.final,
                             skip_idle=True, starts='rows')
    text = jax.jit(fn, donate_argnums=(1, 2)).lower(
        shared, states, acc, x).compile().as_text()
    kernels[slots] = (bench.executed_kernels(text, branch=0),
                      bench.executed_kernels(text))
  assert abs(kernels[1][0] - kernels[5][0]) <= 3, kernels
  leaves = len(jax.tree.leaves(states))
  assert kernels[5][1] - kernels[1][1] >= 4 * leaves, kernels


def test_idle_branch_copy_needs_the_lane_steps_conditional(bench):
  hlo = ('ENTRY %main (p: f32[4]) -> f32[4] {\n'
         '  %p = f32[4]{0} parameter(0)\n'
         '  ROOT %c = f32[4]{0} copy(%p)\n}\n')
  with pytest.raises(ValueError, match='found 0'):
    bench.idle_branch_copy_bytes(hlo)


def test_the_starts_loop_costs_one_slot_per_iteration(bench):
  """The loop over the slots' starts holds all their work: the rolled
  starts (one iteration counted, plus whatever runs outside the loop) cost
  under two slots' shares of the unrolled ones, so that the segment's
  count (rolled lane-step + unrolled - rolled) is exact. A vmapped
  ``init`` before the loop (the slots' new rows written first) gave 2.67
  shares here, bytes that count missed."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import streaming  # pylint: disable=g-import-not-at-top
  lanes, slots = 4, 4
  model = bench.build_model('transformer_tiny')
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  program, shared = bench.client_program(model, params)
  client_input = {'rng': key}
  states = jax.eval_shape(jax.vmap(program.init, in_axes=(None, 0)), shared,
                          bench._lead(client_input, lanes))  # pylint: disable=protected-access
  sd = jax.ShapeDtypeStruct
  x = streaming.StepInputs(
      batch=bench.batch_shape('transformer_tiny', lanes),
      active=sd((lanes,), jnp.bool_), fin_lane=sd((slots,), jnp.int32),
      fin_weight=sd((slots,), jnp.float32),
      start_input=bench._lead(client_input, slots),  # pylint: disable=protected-access
      start_on=sd((slots,), jnp.bool_))
  rolled, unrolled = bench.starts_cost(program, shared, states,
                                       sd((), jnp.float32), x)
  assert 0 < rolled['bytes'] < 2 * unrolled['bytes'] / slots, (rolled,
                                                                unrolled)


_PLUGIN_DIR = os.environ.get('FEDLITE_XLA_GPU_PLUGIN_DIR', '')


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(_PLUGIN_DIR, 'jax_plugins')),
    reason='needs XLA:GPU\'s compiler (no GPU): set '
    'FEDLITE_XLA_GPU_PLUGIN_DIR to a folder made by pip install '
    '--target=<folder> jax-cuda12-plugin==<jax version> '
    'jax-cuda12-pjrt==<jax version>')
def test_xla_gpu_copies_lane_states_through_conditionals_not_host_steps(
    tmp_path):
  """XLA:GPU, compiling for an H200 without a device (``--target=h200``):
  a scan segment copies every lane's state at each step (its conditionals
  pass the carried states through; reference: the states' bytes), a host
  loop's step programs copy nothing, its step where no client ends
  launches about the plain step's kernels, and scatter starts launch fewer
  kernels at a transition than row starts. Reruns a small case of
  ``benchmarks/results/lane_cost_h200_deviceless.md``."""
  out = tmp_path / 'gpu.md'
  env = conftest.script_env()
  env['PYTHONPATH'] += os.pathsep + _PLUGIN_DIR
  proc = subprocess.run(
      [sys.executable, 'benchmarks/bench_lane_cost.py',
       '--models=transformer_tiny', '--loops=scan,host',
       '--starts=rows,scatter', '--target=h200',
       '--shapes=transformer_tiny:8:2', f'--output={out}'],
      cwd=conftest._REPO, env=env, capture_output=True, text=True,  # pylint: disable=protected-access
      timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'XLA:GPU for NVIDIA H200 without a device' in out.read_text()
  rows = json.loads(re.search(r'<!-- rows: (.*) -->',
                              out.read_text()).group(1))
  got = {(r['loop'], r['starts']): r for r in rows}
  state_gb = 8 * 4 * rows[0]['params'] / 1e9  # 8 lanes, float32
  for starts in ('rows', 'scatter'):
    scan, host = got['scan', starts], got['host', starts]
    assert scan['copied_gb']['segment_per_step'] >= 2 * state_gb, scan
    assert host['copied_gb']['segment_per_step'] < 0.01 * state_gb, host
    assert host['copied_gb']['transition_step'] < 0.01 * state_gb, host
    k = host['kernels']
    assert k['idle_step'] <= 1.1 * k['plain_step'] < k['transition_step'], k
  assert (got['host', 'scatter']['kernels']['transition_step'] <
          got['host', 'rows']['kernels']['transition_step']), got
