"""Lanes that stream clients: the plan, its bound, and results equal to the loop.

References: the loop engine (one client at a time, no lanes) for the weighted
sums and diagnostics; the plan's invariants checked step by step against the
step counts; the sequential-step bound ``max(ceil(useful / L), longest) + S``
on real FEMNIST cohorts; JAX's own compile events for the program count;
the lowered HLO for the absence of convolutions under im2col.
"""

from __future__ import annotations

import math
import re

import fedlite_jax  # noqa: F401
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax.models import emnist
from fedlite_jax.rounds import engine as E
from fedlite_jax.rounds import lanes as L
from fedlite_jax.rounds import stats


def _check_plan(plan, counts, groups=None):
  """Every invariant of a LanePlan against the step counts."""
  counts = np.asarray(counts)
  n = len(counts)
  per, devices, slots = plan.lanes_per_device, plan.devices, plan.slots
  lane_of = {}
  for i, c in enumerate(counts):
    where = np.argwhere(plan.client == i)
    assert len(where) == c, (i, len(where), c)
    assert len(set(where[:, 1])) == 1, 'a client moved lanes'
    lane_of[i] = int(where[0, 1])
    assert list(plan.batch[plan.client == i]) == list(range(c))
    assert np.all(np.diff(where[:, 0]) > 0)
  # Each client starts once (begin or a slot) and ends once (slot or finish).
  started = [c for c in plan.begin if c >= 0] + [
      c for c in plan.start_client.ravel() if c >= 0]
  ended = [c for c in plan.finalize_client.ravel() if c >= 0] + [
      c for c in plan.finish if c >= 0]
  assert sorted(started) == list(range(n))
  assert sorted(ended) == list(range(n))
  for t, d, f in np.argwhere(plan.finalize >= 0):
    lane = d * per + plan.finalize[t, d, f]
    done, new = plan.finalize_client[t, d, f], plan.start_client[t, d, f]
    assert lane_of[done] == lane
    # Finalized after its last step, before the lane's next step.
    assert np.max(np.flatnonzero(plan.client[:, lane] == done)) < t
    if new >= 0:
      assert lane_of[new] == lane
      assert np.min(np.flatnonzero(plan.client[:, lane] == new)) == t
  for lane, c in enumerate(plan.begin):
    if c >= 0:
      assert lane_of[c] == lane
      assert np.min(np.flatnonzero(plan.client[:, lane] == c)) == 0
  assert plan.finalize.shape[1:] == (devices, slots)
  assert plan.steps % plan.segment_steps == 0
  if groups is not None:
    share = plan.lanes // len(groups)
    for p, members in enumerate(groups):
      for i in members:
        assert p * share <= lane_of[i] < (p + 1) * share


@pytest.mark.parametrize('seed', range(4))
def test_plans_hold_every_invariant(seed):
  rng = np.random.RandomState(seed)
  counts = rng.randint(1, 15, size=rng.randint(1, 40))
  for per in (1, 3, 7):
    for slots in (1, 2, per):
      for devices in (1, 2):
        plan = L.plan_lanes(counts, per, 4, slots, devices)
        _check_plan(plan, counts)
        assert plan.useful_steps == counts.sum()
  groups = [range(0, len(counts) // 2), range(len(counts) // 2, len(counts))]
  if all(len(g) for g in groups):
    plan = L.plan_lanes(counts, 2, 3, 1, 4, groups)
    _check_plan(plan, counts, groups)


def test_one_step_clients_finalize_on_every_lane():
  plan = L.plan_lanes([1] * 10, 5, 4, 5)
  _check_plan(plan, [1] * 10)
  assert plan.last_step == 2 and L.choose_slots([1] * 10, 5, 4) == 5


def _femnist_step_counts(data_dir, batch_size=20):
  fd = fedjax.SQLiteFederatedData.new(
      str(data_dir / 'femnist105' / 'federated_emnist_train.sqlite'))
  return np.asarray([math.ceil(len(cds) / batch_size)
                     for _, cds in fd.clients()])


def test_sequential_steps_bound_on_real_femnist(data_dir):
  if not (data_dir / 'femnist105').is_dir():
    pytest.skip('needs femnist105/ under FEDLITE_DATA_DIR')
  steps = _femnist_step_counts(data_dir)
  rng = np.random.RandomState(0)
  segment = 4
  for lanes in (10, 25, 50):
    for _ in range(5):
      counts = steps[rng.choice(len(steps), 100, replace=False)]
      slots = L.choose_slots(counts, lanes, segment)
      plan = L.plan_lanes(counts, lanes, segment, slots)
      useful = int(counts.sum())
      bound = max(-(-useful // lanes), int(counts.max())) + segment
      assert plan.steps <= bound, (lanes, plan.steps, bound)
      if lanes == 25:
        assert plan.executed_steps / useful <= 1.10


def test_auto_lanes_on_a_gpu_budget_waste_little(data_dir, monkeypatch):
  """lanes_per_device='auto' on an 80 GiB device, EMNIST CNN (1.2M
  parameters): lanes fixed at the first of 100-client FEMNIST cohorts plan
  every cohort within 1.15 x the useful steps (each lane-step is paid for);
  100 lanes (a lane per client) run ~1.2x."""
  if not (data_dir / 'femnist105').is_dir():
    pytest.skip('needs femnist105/ under FEDLITE_DATA_DIR')
  monkeypatch.setattr(stats.jax, 'default_backend', lambda: 'gpu')
  most = stats.resolve_lanes('auto', 4 * 1_206_590, memory_bytes=80 * 2**30)
  steps = _femnist_step_counts(data_dir)
  rng = np.random.RandomState(0)
  cohorts = [steps[rng.choice(len(steps), 100, replace=False)]
             for _ in range(6)]
  lanes = L.choose_lanes(cohorts[0], min(most, 100), 4)
  assert 1 < lanes < 100
  for counts in cohorts:
    slots = L.choose_slots(counts, lanes, 4)
    plan = L.plan_lanes(counts, lanes, 4, slots)
    _check_plan(plan, counts)
    assert plan.executed_steps / counts.sum() <= 1.15, (lanes, plan)
    wide = L.plan_lanes(counts, 100, 4, 100)
    assert wide.executed_steps / counts.sum() > 1.15
    # Fewer lanes than clients, yet no more steps than a few past the bound.
    assert plan.sequential_steps <= max(-(-counts.sum() // lanes),
                                        counts.max()) + 2


def test_choose_lanes_takes_the_least_modeled_time():
  """sequential steps x (step cost + lanes), by hand."""
  # 8 clients of 4 steps: 8 lanes run 4 steps (4 x 12 = 48; 4 lanes: 8 x 8).
  assert L.choose_lanes([4] * 8, 8, 4) == 8
  # One long client: 2 lanes run 10 + (5 + 5) in 10 steps (10 x 6 = 60;
  # 3 lanes 10 x 7 = 70; 1 lane 20 x 5 = 100).
  assert L.choose_lanes([10, 5, 5], 3, 4) == 2
  # 16 useful steps: 2 lanes run 8 steps (8 x 6 = 48, no masked step), 3
  # lanes 6 (6 x 7 = 42: 2 masked lane-steps buy 2 steps), 4 lanes 6 (48).
  counts = [6, 3, 5, 1, 1]
  assert L.choose_lanes(counts, 5, 4) == 3
  # A step that costs nothing fixed: the fewest lane-steps (2 x 8 = 16).
  assert L.choose_lanes(counts, 5, 4,  step_cost=0) == 2
  # XLA:CPU's step cost (0.2): 2 lanes only where they add few lane-steps:
  # 3 clients, 1 lane 24 x 1.2 = 28.8 against 2 lanes 15 x 2.2 = 33; 4
  # even clients, 2 lanes 8 x 2.2 = 17.6 against 16 x 1.2 = 19.2.
  cpu = L.AUTO_CPU_STEP_COST_LANES
  assert L.choose_lanes([9, 7, 8], 2, 4, step_cost=cpu) == 1
  assert L.choose_lanes([4] * 4, 2, 4, step_cost=cpu) == 2
  with pytest.raises(ValueError, match='step_cost must be >= 0'):
    L.choose_lanes(counts, 5, 4, step_cost=-1)


def test_choose_lanes_equals_planning_every_lane_count():
  """The bound that skips candidates never skips the best: the choice equals
  the least time over plans of every lane count (ties: more lanes)."""
  rng = np.random.RandomState(0)
  for trial in range(40):
    counts = rng.randint(1, 12, rng.randint(1, 30))
    most = int(rng.randint(1, len(counts) + 1))
    for cost in (0.0, L.AUTO_STEP_COST_LANES, 50.0):
      times = {per: L.plan_lanes(counts, per, 4, per).sequential_steps
                    * (cost + per) for per in range(1, most + 1)}
      want = max(times, key=lambda per: (-times[per], per))
      got = L.choose_lanes(counts, most, 4, step_cost=cost)
      assert got == want, (trial, counts, most, cost, times)


def test_bad_plan_inputs_are_one_line_errors():
  with pytest.raises(ValueError, match='>= 1 local step'):
    L.plan_lanes([2, 0], 2, 4, 1)
  with pytest.raises(ValueError, match='lanes_per_device'):
    L.plan_lanes([2], 0, 4, 1)
  with pytest.raises(ValueError, match='exactly once'):
    L.plan_lanes([2, 3], 1, 4, 1, 2, groups=[[0], [0]])
  with pytest.raises(ValueError, match="lanes_per_device must be an int"):
    stats.resolve_lanes('many', 10)
  with pytest.raises(ValueError, match="lanes_per_device must be an int"):
    E.VmapEngine(_program(), lanes_per_device=0)


def test_auto_lanes_follow_memory_and_parameters(monkeypatch):
  gib = 2**30
  assert stats.resolve_lanes('auto', 4 * 2**20, memory_bytes=80 * gib) == (
      stats.AUTO_CPU_LANES if jax.default_backend() == 'cpu' else
      stats.AUTO_MAX_LANES)
  monkeypatch.setattr(stats.jax, 'default_backend', lambda: 'gpu')
  small = stats.resolve_lanes('auto', 4 * 2**20, memory_bytes=80 * gib)
  large = stats.resolve_lanes('auto', 84 * 2**20, memory_bytes=80 * gib)
  lane = stats.AUTO_PARAM_COPIES * 84 * 2**20 + stats.AUTO_LANE_EXTRA_BYTES
  assert large == int(stats.AUTO_MEMORY_FRACTION * 80 * gib // lane)
  assert small == stats.AUTO_MAX_LANES
  assert stats.resolve_lanes('auto', 10**12, memory_bytes=gib) == 1
  assert stats.resolve_lanes(7, 1) == 7


def _program():
  def init(shared, client_input):
    return {'w': shared['w'] * client_input['scale'], 'seen': jnp.zeros(())}

  def step(state, batch):
    g = jax.grad(lambda w: jnp.mean((batch['x'] @ w - batch['y'])**2))(
        state['w'])
    return {'w': state['w'] - 0.1 * g, 'seen': state['seen'] + 1}

  def final(shared, state):
    return {'delta': state['w'] - shared['w']}, {'steps': state['seen'],
                                                 'norm': jnp.sum(state['w'])}

  return E.ClientProgram(init, step, final)


def _cohort(n, seed=0, max_steps=12):
  rng = np.random.RandomState(seed)
  work = []
  for c in range(n):
    batches = [{'x': rng.randn(4, 3).astype(np.float32),
                'y': rng.randn(4).astype(np.float32)}
               for _ in range(rng.randint(1, max_steps))]
    work.append(E.ClientWork(bytes([c]), batches,
                             {'scale': np.float32(1 + 0.1 * c)},
                             float(rng.randint(1, 9))))
  return work


def test_bad_engine_options_are_one_line_errors():
  """Each bad lane setting names itself and what is allowed."""
  with pytest.raises(ValueError, match='segment_steps must be >= 1'):
    E.VmapEngine(_program(), segment_steps=0)
  with pytest.raises(ValueError, match='slots must be >= 1'):
    E.VmapEngine(_program(), slots=0)
  with pytest.raises(ValueError, match="lanes_per_device must be an int"):
    E.VmapEngine(_program(), lanes_per_device='many')


def test_each_engine_runs_its_step():
  """The vmap engine's lanes run a program's ``step_in_place``, the loop
  engine its ``step`` (there the ordering dependences cost more than the
  copy they save); both engines give the loop's results."""
  base = _program()
  traced = []

  def tagged(tag):
    def step(state, batch):
      traced.append(tag)
      return base.step(state, batch)
    return step

  program = E.ClientProgram(base.init, tagged('step'), base.final,
                            step_in_place=tagged('in_place'))
  assert E.ClientProgram(base.init, base.step, base.final).carried_step \
      is base.step
  work = _cohort(7)
  shared = {'w': np.ones(3, np.float32)}
  ref = E.LoopEngine(program)(shared, work)
  assert traced and set(traced) == {'step'}
  traced.clear()
  out = E.VmapEngine(program, lanes_per_device=3)(shared, work)
  assert 'in_place' in traced
  np.testing.assert_allclose(out.weighted_sum['delta'],
                             ref.weighted_sum['delta'], rtol=1e-5, atol=1e-6)


def test_delta_program_steps_are_bit_equal():
  """``delta_client_program``'s two steps give the same state bit for bit
  (the in-place one only adds value-exact dependences), jitted apart."""
  from fedlite_jax.algorithms import rounds_common as rc  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  model = emnist.create_emnist_cnn(10).model
  params = model.init(jax.random.PRNGKey(0))
  program = rc.delta_client_program(
      fedjax.model_grad(model), optax.sgd(0.1),
      lambda shared, inp, delta, mask: (delta, {}))
  assert program.step_in_place is not None
  rng = np.random.RandomState(0)
  batch = {'x': rng.rand(5, 28, 28, 1).astype(np.float32),
           'y': rng.randint(0, 10, 5).astype(np.int32)}
  state = program.init({'params': params}, {'rng': jax.random.PRNGKey(1)})
  a = jax.jit(program.step)(state, batch)
  b = jax.jit(program.step_in_place)(state, batch)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8),
                                  np.asarray(y).view(np.uint8))


@pytest.mark.parametrize('lanes,slots', [
    (1, 'auto'), (3, 1), (3, 2), (5, 2), (13, 3), ('auto', 'auto')])
def test_vmap_engine_equals_the_loop_engine(lanes, slots):
  work = _cohort(13)
  shared = {'w': np.ones(3, np.float32)}
  ref = E.LoopEngine(_program())(shared, work)
  with stats.recording_stats() as rec:
    out = E.VmapEngine(_program(), lanes_per_device=lanes, slots=slots)(
        shared, work)
    counts = rec.take()
  np.testing.assert_allclose(out.weighted_sum['delta'],
                             ref.weighted_sum['delta'], rtol=1e-5, atol=1e-6)
  assert out.total_weight == ref.total_weight
  for got, want, w in zip(out.diagnostics, ref.diagnostics, work):
    assert int(got['steps']) == len(w.batches) == int(want['steps'])
    np.testing.assert_allclose(got['norm'], want['norm'], rtol=1e-6)
  useful = sum(len(w.batches) for w in work)
  assert counts['useful_steps'] == useful and counts['clients'] == 13
  assert counts['executed_steps'] == counts['sequential_steps'] * counts['lanes']
  # The last segment runs only the planned steps.
  assert counts['segments'] == -(-counts['sequential_steps'] // 4)
  if lanes != 'auto':
    assert counts['lanes'] == lanes
    assert counts['sequential_steps'] <= max(
        -(-useful // lanes), max(len(w.batches) for w in work)) + 4


def test_one_program_for_every_cohort():
  """Cohorts of other sizes and step counts reuse the first round's programs
  (counted by JAX's compile events): the first round compiles each lane
  program once, later rounds compile nothing at all."""
  shared = {'w': np.ones(3, np.float32)}
  cohorts = [_cohort(n, seed=seed, max_steps=20)
             for seed, n in ((1, 9), (2, 6), (3, 14), (4, 9))]
  refs = [E.LoopEngine(_program())(shared, work) for work in cohorts]
  engine = E.VmapEngine(_program(), lanes_per_device=4, segment_steps=3)
  with stats.counting_compilations() as first:
    engine(shared, _cohort(9, seed=0))
  for name in ('lanes_segment', 'lanes_begin', 'lanes_finish'):
    assert first.count(name) == 1, first.by_program
  with stats.counting_compilations() as later:
    outs = [engine(shared, work) for work in cohorts]
  assert later.total == 0, later.by_program
  for out, ref in zip(outs, refs):
    np.testing.assert_allclose(out.weighted_sum['delta'],
                               ref.weighted_sum['delta'], rtol=1e-5,
                               atol=1e-6)


def test_im2col_cnn_has_no_convolution_under_vmap():
  """The vmap engine's CNN: lax.conv becomes a grouped convolution over
  lanes; im2col leaves none and gives the same gradients to float rounding."""
  batch = {'x': np.random.RandomState(0).rand(3, 20, 28, 28, 1).astype(
      np.float32), 'y': np.tile(np.arange(20) % 62, (3, 1))}
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  grads = {}
  for impl in ('lax', 'im2col'):
    model = emnist.create_emnist_cnn(conv_implementation=impl).model
    params = jax.tree.map(lambda x: jnp.stack([x] * 3),
                          model.init(jax.random.PRNGKey(0)))
    fn = jax.jit(jax.vmap(fedjax.model_grad(model)))
    text = fn.lower(params, batch, keys).as_text()
    convs = text.count('stablehlo.convolution')
    assert (convs > 0) == (impl == 'lax'), (impl, convs)
    grads[impl] = fn(params, batch, keys)
  for a, b in zip(jax.tree.leaves(grads['lax']),
                  jax.tree.leaves(grads['im2col'])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_loop_engine_records_its_steps():
  work = _cohort(5, seed=3)
  with stats.recording_stats() as rec:
    E.LoopEngine(_program())({'w': np.ones(3, np.float32)}, work)
  counts = rec.totals()
  steps = [len(w.batches) for w in work]
  assert counts['useful_steps'] == sum(steps)
  assert counts['executed_steps'] == counts['sequential_steps'] == sum(steps)
  assert counts['lanes'] == 1


def _scatters(hlo_text):
  """``(scatters, scatters without unique indices)`` of optimized HLO."""
  import re  # pylint: disable=g-import-not-at-top
  found = re.findall(r'\sscatter\([^\n]*', hlo_text)
  return len(found), sum('unique_indices=true' not in s for s in found)


def _lane_programs(program, steps):
  """``(begin, segment, finish)`` of ``program`` on lanes."""
  from fedlite_jax.rounds import lane_programs  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import sharding  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_client_mesh(1)
  return lane_programs.build_lane_programs(
      program.init, lambda s, b: (program.carried_step(s, b), None),
      program.final, mesh=mesh, segment_steps=steps)[:3]


def _abstract_lane_args(lanes, slots, steps):
  """``(f32, shared, states, acc, inputs)``: abstract arguments of
  ``_program()``'s lane programs (``f32(*shape)`` makes more)."""
  from fedlite_jax.rounds import lane_programs as streaming  # pylint: disable=g-import-not-at-top
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  inputs = streaming.StepInputs(
      batch={'x': f32(lanes, steps, 4, 3), 'y': f32(lanes, steps, 4)},
      active=jax.ShapeDtypeStruct((lanes, steps), jnp.bool_),
      fin_lane=jax.ShapeDtypeStruct((slots, steps), jnp.int32),
      fin_weight=f32(slots, steps),
      start_input={'scale': f32(slots, steps)},
      start_on=jax.ShapeDtypeStruct((slots, steps), jnp.bool_))
  return (f32, {'w': f32(3)}, {'w': f32(lanes, 3), 'seen': f32(lanes)},
          {'delta': f32(1, 3)}, inputs)


def test_lane_programs_have_no_scatter():
  """Starting and finalizing clients adds no scatter (XLA:GPU writes a
  scatter with duplicate indices atomically): the lane programs of a client
  update whose step has none hold none, in the optimized HLO."""
  program = _program()
  lanes, slots, steps = 5, 2, 4
  begin, segment, finish = _lane_programs(program, steps)
  f32, shared, states, acc, inputs = _abstract_lane_args(lanes, slots, steps)
  texts = [
      begin.lower(shared, {'scale': f32(lanes)},
                  jax.ShapeDtypeStruct((lanes,), jnp.int32)),
      segment.lower(shared, states, acc, inputs,
                    jax.ShapeDtypeStruct((), jnp.int32)),
      finish.lower(shared, states, acc, f32(lanes))]
  for lowered in texts:
    text = lowered.compile().as_text()
    assert 'ENTRY' in text and _scatters(text) == (0, 0), text
  # The segment is a loop of a trip count XLA knows (S = 4); its traced
  # lane-step starts its slots' clients in a loop of `slots` (2) iterations,
  # also of a known trip count; conditionals skip idle transitions and the
  # steps past the plan.
  seg = texts[1].compile().as_text()
  trips = re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', seg)
  assert sorted(trips) == sorted([str(slots), str(steps)]), trips
  assert len(re.findall(r'\swhile\(', seg)) == 2
  assert re.search(r'\sconditional\(', seg)


class _Recorded(list):
  """A client's batches that record the thread reading each one, and raise
  ``RuntimeError`` at batch ``fail_at``."""

  def __init__(self, batches, threads, fail_at=None):
    super().__init__(batches)
    self.threads, self.fail_at = threads, fail_at

  def __getitem__(self, i):
    import threading  # pylint: disable=g-import-not-at-top
    if i == self.fail_at:
      raise RuntimeError(f'batch {i} unreadable')
    self.threads.append(threading.current_thread().name)
    return super().__getitem__(i)


def test_prefetch_reads_batches_on_its_thread():
  """Segment inputs are made ahead on the worker thread (each batch read
  there, none but the padding template on the caller's), with the loop
  engine's results."""
  shared = {'w': np.ones(3, np.float32)}
  threads = []
  cohort = _cohort(11, seed=5, max_steps=20)
  work = [E.ClientWork(w.client_id, _Recorded(w.batches, threads),
                       w.client_input, w.weight) for w in cohort]
  out = E.VmapEngine(_program(), lanes_per_device=3, segment_steps=2)(
      shared, work)
  main = threads.count('MainThread')
  worker = [n for n in threads if n.startswith('lanes_prefetch')]
  useful = sum(len(w.batches) for w in work)
  assert main == 1 and len(worker) == useful, (main, len(worker))
  ref = E.LoopEngine(_program())(shared, cohort)
  np.testing.assert_allclose(out.weighted_sum['delta'],
                             ref.weighted_sum['delta'], rtol=1e-5, atol=1e-6)


def test_prefetch_raises_what_batching_raises():
  """A batch that cannot be read fails the round with its own error."""
  work = _cohort(7, seed=2, max_steps=20)
  longest = max(range(7), key=lambda i: len(work[i].batches))
  w = work[longest]
  work[longest] = E.ClientWork(w.client_id, _Recorded(
      w.batches, [], fail_at=len(w.batches) - 1), w.client_input, w.weight)
  engine = E.VmapEngine(_program(), lanes_per_device=2, segment_steps=2)
  with pytest.raises(RuntimeError, match='unreadable'):
    engine({'w': np.ones(3, np.float32)}, work)


def test_client_batches_are_made_on_warm_up_threads(monkeypatch):
  """Clients' ``ClientBatches`` are handed to the warm-up threads and made
  (rows gathered, preprocessed) off the caller's thread, each once, and the
  round equals the loop engine's."""
  import threading  # pylint: disable=g-import-not-at-top
  from fedlite_jax.algorithms import batching  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import lane_inputs  # pylint: disable=g-import-not-at-top
  made, submitted = [], []
  pool_of = lane_inputs.pool

  class Spy:
    def __init__(self, name, workers):
      self.name, self.pool = name, pool_of(name, workers)

    def submit(self, fn, *args):
      submitted.append(self.name)
      return self.pool.submit(fn, *args)

  monkeypatch.setattr(lane_inputs, 'pool', Spy)

  def record(batch):
    made.append(threading.current_thread().name)
    return batch

  rng = np.random.RandomState(4)
  sizes = rng.randint(3, 60, size=12)
  datasets = [fedjax.ClientDataset(
      {'x': rng.randn(m, 3).astype(np.float32),
       'y': rng.randn(m).astype(np.float32)},
      fedjax.BatchPreprocessor([record])) for m in sizes]
  shared = {'w': np.ones(3, np.float32)}
  work = lambda: [E.ClientWork(bytes([c]), batching.ClientBatches(
      ds, fedjax.ShuffleRepeatBatchHParams(batch_size=4, seed=c)),
                               {'scale': np.float32(1 + 0.1 * c)}, 1.0 + c)
                  for c, ds in enumerate(datasets)]
  out = E.VmapEngine(_program(), lanes_per_device=3, segment_steps=2)(
      shared, work())
  # Each client's rows are preprocessed once (one call). Every client goes
  # to the warm-up threads. The caller makes the first client's batches
  # itself (the padding template); the others are made by the warm-up
  # threads, or by the prefetch thread where it needs one first.
  assert len(made) == len(datasets), made
  assert submitted.count('lanes_warm') == len(datasets), submitted
  assert made.count('MainThread') == 1, made
  assert all(n == 'MainThread' or n.startswith(('lanes_warm',
                                                'lanes_prefetch'))
             for n in made), made
  ref = E.LoopEngine(_program())(shared, work())
  np.testing.assert_allclose(out.weighted_sum['delta'],
                             ref.weighted_sum['delta'], rtol=1e-5, atol=1e-6)
