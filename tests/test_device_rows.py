"""Training data on the devices (``device_rows``): the same batches, gathered
by the lanes, and the same round.

References: FedJAX's own ``ClientDataset.shuffle_repeat_batch`` for the
batches; the vmap engine fed by the host (``batching.ClientBatches``) for
the round's sums, diagnostics and collected step results, bit for bit;
the runner's recorded baselines (``test_regression_runner.py``) for whole
runs.
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax.algorithms import batching
from fedlite_jax.rounds import device_rows
from fedlite_jax.rounds import engine as E
from fedlite_jax.rounds import stats
from fedlite_jax.rounds import streaming


def _clients(n=7, seed=0, lo=3, hi=30):
  """Clients with a row-wise preprocessor (scales and casts ``x``)."""
  rng = np.random.RandomState(seed)
  pre = fedjax.BatchPreprocessor([lambda ex: {
      **ex, 'x': (ex['x'] * 0.5).astype(np.float32)}])
  out = []
  for i in range(n):
    m = rng.randint(lo, hi)
    out.append((f'c{i}'.encode(), fedjax.ClientDataset(
        {'x': rng.randint(0, 255, size=(m, 3, 2)).astype(np.uint8),
         'y': rng.randint(0, 10, size=m).astype(np.int32)}, pre)))
  return out


@pytest.mark.parametrize('hparams', [
    dict(batch_size=4, num_epochs=1, seed=3),
    dict(batch_size=5, num_epochs=3, seed=11),
    dict(batch_size=8, num_steps=9, seed=0),
    dict(batch_size=6, num_epochs=2, seed=5, skip_shuffle=True),
])
def test_table_batches_are_fedjax_batches(hparams):
  clients = _clients()
  table = device_rows.RowTable(clients)
  hp = fedjax.ShuffleRepeatBatchHParams(**hparams)
  for cid, cds in clients:
    want = list(cds.shuffle_repeat_batch(hp))
    got = batching.client_batches(table.dataset(cid, cds), hp, rng=None)
    assert isinstance(got, batching.TableBatches)
    assert len(got) == len(want)
    for g, w in zip(got, want):
      assert g.keys() == w.keys()
      for k in w:
        assert g[k].dtype == w[k].dtype
        np.testing.assert_array_equal(g[k], w[k])
    # The rows index the table: the gather the lanes make.
    for r, w in zip(got.rows, want):
      np.testing.assert_array_equal(table.host['x'][r], w['x'])


def test_first_rows_of_a_client():
  """``cds[:n]`` (the runner's --max_examples_per_client) reads the
  client's first n rows of the table."""
  clients = _clients()
  table = device_rows.RowTable(clients)
  cid, cds = clients[2]
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=2, num_epochs=1, seed=1)
  want = list(cds[:3].shuffle_repeat_batch(hp))
  got = batching.client_batches(table.dataset(cid, cds[:3]), hp, rng=None)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g['x'], w['x'])


def test_bad_tables_say_why():
  clients = _clients(3)
  with pytest.raises(ValueError, match='appears twice'):
    device_rows.RowTable(clients + clients[:1])
  with pytest.raises(ValueError, match='at least one client'):
    device_rows.RowTable([])
  grows = fedjax.BatchPreprocessor([lambda ex: {
      k: np.concatenate([v, v]) for k, v in ex.items()}])
  cid, cds = clients[0]
  with pytest.raises(ValueError, match='one row out per row in'):
    device_rows.RowTable([(cid, fedjax.ClientDataset(cds.raw_examples,
                                                     grows))])
  other = fedjax.ClientDataset({'z': np.zeros((4, 1), np.float32)})
  with pytest.raises(ValueError, match='features'):
    device_rows.RowTable(clients + [(b'z', other)])
  for x in (np.zeros((4, 3, 2), np.float64), np.zeros((4, 2, 3), np.float32)):
    odd = fedjax.ClientDataset({'x': x, 'y': np.zeros(4, np.int32)})
    with pytest.raises(ValueError, match="feature 'x' is"):
      device_rows.RowTable(clients + [(b'odd', odd)])
  table = device_rows.RowTable(clients)
  with pytest.raises(KeyError, match='not in the row table'):
    table.dataset(b'nobody', cds)
  longer = fedjax.ClientDataset({k: np.concatenate([v, v]) for k, v in
                                 cds.raw_examples.items()}, cds.preprocessor)
  with pytest.raises(ValueError, match='holds'):
    table.dataset(cid, longer)


def _program():
  """A linear softmax-regression client update (SGD), with per-step
  results and diagnostics: every batch's rows matter to every output."""
  def init(shared, client_input):
    return {'w': shared, 'seen': jnp.zeros((), jnp.float32),
            'key': client_input}

  def step(state, batch):
    x = batch['x'].reshape(batch['x'].shape[0], -1)

    def loss(w):
      logits = x @ w
      return -jnp.mean(jax.nn.log_softmax(logits)[
          jnp.arange(x.shape[0]), batch['y']])
    g = jax.grad(loss)(state['w'])
    return {**state, 'w': state['w'] - 0.01 * g,
            'seen': state['seen'] + jnp.sum(x)}

  def final(shared, state):
    return state['w'] - shared, {'seen': state['seen'],
                                 'key_sum': jnp.sum(state['key'])}
  return E.ClientProgram(init, step, final)


def _work(clients, table, seed):
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=4, num_epochs=2)
  out = []
  for i, (cid, cds) in enumerate(clients):
    if table is not None:
      cds = table.dataset(cid, cds)
    rng = jax.random.PRNGKey(seed * 100 + i)
    out.append(E.ClientWork(
        cid, batching.client_batches(cds, hp, rng), rng, float(len(cds))))
  return out


@pytest.mark.parametrize('loop', ['scan', 'unroll', 'fixed', 'host'])
def test_vmap_round_on_device_rows_equals_host_batches(loop):
  """Two rounds, 3 lanes, 2 slots: the same sums and diagnostics, bit for
  bit, and the stats say which way the batches went."""
  clients = _clients(9, seed=1)
  table = device_rows.RowTable(clients)
  shared = jnp.zeros((6, 10), jnp.float32)
  got = {}
  for way in ('host', 'table'):
    eng = E.VmapEngine(_program(), lanes_per_device=3, segment_steps=3,
                       slots=2, segment_loop=loop)
    results = []
    with stats.recording_stats() as rec:
      for r in range(2):
        results.append(eng(shared, _work(clients[r:r + 7],
                                          table if way == 'table' else None,
                                          r)))
        assert rec.take()['rows_on_device'] == int(way == 'table')
    got[way] = results
  for h, t in zip(got['host'], got['table']):
    np.testing.assert_array_equal(np.asarray(h.weighted_sum),
                                  np.asarray(t.weighted_sum))
    assert h.total_weight == t.total_weight
    for dh, dt in zip(h.diagnostics, t.diagnostics):
      for k in dh:
        np.testing.assert_array_equal(dh[k], dt[k])
  assert float(np.sum(np.abs(got['table'][0].weighted_sum))) > 0
  # Sent once: the rounds (and engines) reuse the table's device arrays.
  assert len(table._device) == 1  # pylint: disable=protected-access


def test_collected_step_results_on_device_rows():
  """Collecting streams (per-client outputs and step results) agree too."""
  clients = _clients(5, seed=2)
  table = device_rows.RowTable(clients)
  program = _program()
  shared = jnp.zeros((6, 10), jnp.float32)

  def step(state, batch):
    new = program.step(state, batch)
    return new, jnp.sum(batch['x'])
  runs = {}
  for way in ('host', 'table'):
    lanes = streaming.LaneStreams(program.init, step, program.final,
                                  collect=True)
    work = _work(clients, table if way == 'table' else None, 0)
    counts = [len(w.batches) for w in work]
    from fedlite_jax.rounds import lanes as lanes_lib  # pylint: disable=g-import-not-at-top
    plan = lanes_lib.plan_lanes(counts, 2, 2, 1, 1, dynamic_steps=True)
    runs[way] = lanes.run(shared, plan, [w.batches for w in work],
                          [w.client_input for w in work],
                          [w.weight for w in work],
                          (work[0].batches[0], work[0].client_input),
                          loop='scan')
  assert runs['table'].rows_on_device and not runs['host'].rows_on_device
  for oh, ot in zip(runs['host'].outputs, runs['table'].outputs):
    np.testing.assert_array_equal(np.asarray(oh), np.asarray(ot))
  for rh, rt in zip(runs['host'].step_results, runs['table'].step_results):
    assert len(rh) == len(rt) > 0
    np.testing.assert_array_equal(np.asarray(rh), np.asarray(rt))


def test_a_round_reads_one_source_of_batches():
  clients = _clients(4)
  table = device_rows.RowTable(clients)
  work = _work(clients, table, 0)
  mixed = work[:2] + _work(clients[2:], None, 0)
  eng = E.VmapEngine(_program(), lanes_per_device=2, segment_steps=2)
  with pytest.raises(ValueError, match='one: wrap every client'):
    eng(jnp.zeros((6, 10), jnp.float32), mixed)


def test_auto_needs_device_memory():
  fits, why = device_rows.table_memory_ok(1, jax.devices('cpu')[0])
  assert not fits and 'reports no device memory' in why


@pytest.mark.parametrize('fits', [True, False])
def test_runner_auto_on_an_accelerator(fits, monkeypatch):
  """``--data_on_device=auto`` as on a GPU (the backend and the device's
  memory stood in for): the table's size is estimated from the examples'
  count and one client's rows, and the table is built only if it fits."""
  from fedlite_jax.rounds import sharding  # pylint: disable=g-import-not-at-top
  from fedlite_jax.training import build  # pylint: disable=g-import-not-at-top
  from fedlite_jax.training import config as config_lib  # pylint: disable=g-import-not-at-top
  clients = _clients(6)
  fd = fedjax.InMemoryFederatedData(
      {cid: cds.raw_examples for cid, cds in clients},
      preprocess_batch=clients[0][1].preprocessor)
  rows = sum(len(c) for _, c in clients)
  want = rows * (3 * 2 * 4 + 4)  # float32 x [3, 2], int32 y
  asked = []

  def memory_ok(nbytes, device=None):
    del device
    asked.append(nbytes)
    return fits, 'stand-in'
  monkeypatch.setattr(build.jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(device_rows, 'table_memory_ok', memory_ok)
  mesh = sharding.make_client_mesh(1)
  config = config_lib.RunConfig(task='emnist', data_on_device='auto')
  table = build._row_table(config, fd, mesh, 'vmap')  # pylint: disable=protected-access
  assert asked == [want]
  assert (table is not None) == fits
  if fits:
    assert table.nbytes == want and len(table) == rows
  assert build._row_table(config, fd, mesh, 'loop') is None  # pylint: disable=protected-access
