"""The vmapped ``fedjax.ForEachClientBackend`` equals FedJAX's ``jit`` backend.

Unmodified FedJAX algorithms (``fed_avg``, ``fed_prox``, ``mime_lite`` on
real FEMNIST writers; ``apfl`` and ``hyp_cluster`` on synthetic data) give
the same parameters with either backend; batches of different shapes
(``ClientDataset.batch``'s smaller last batch, clients with different batch
sizes, a client with no batch), lane counts that do not divide the cohort
and a step that reshapes a 0-d state leaf give the jit backend's outputs and
step results, in the jit backend's (call) order; FedJAX's own ``mime`` and
``mime_lite`` tests pass under this backend; a ``for_each_client`` with step
results on 4 forced devices (7 clients, one lane idle) gives the same
outputs and step results as the jit backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fedlite_jax  # noqa: F401  (must precede fedjax)
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax.rounds import VmapBackend
from fedlite_jax.rounds import stats as stats_lib


@pytest.fixture(scope='module')
def femnist_clients(data_dir):
  train, _ = fedjax.datasets.emnist.load_data(
      cache_dir=str(data_dir / 'femnist105'))
  ids = list(train.client_ids())[:4]
  # 60 examples per client: 3 local steps of 20.
  return [(cid, cds[:60], jax.random.PRNGKey(i))
          for i, (cid, cds) in enumerate(train.get_clients(ids))]


class _SpyBackend(VmapBackend):
  """VmapBackend that counts the for_each_client functions it builds."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.built = 0

  def __call__(self, *args):
    self.built += 1
    return super().__call__(*args)


def _train(make_alg, params, clients, backend, rounds=2):
  # FedJAX resolves the backend when for_each_client is CALLED, i.e. when
  # the algorithm is built, so the algorithm is built inside the context.
  with fedjax.for_each_client_backend(backend):
    alg = make_alg()
  state = alg.init(params)
  for _ in range(rounds):
    state, diag = alg.apply(state, clients)
  return state, diag


def test_fedjax_algorithms_match_jit_backend(femnist_clients):
  model = fedjax.models.emnist.create_dense_model(only_digits=False,
                                                  hidden_units=64)
  params = model.init(jax.random.PRNGKey(0))
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0)
  per_example_loss = fedjax.model_per_example_loss(model)
  algorithms = {
      'fed_avg': lambda: fedjax.algorithms.fed_avg.federated_averaging(
          fedjax.model_grad(model), fedjax.optimizers.sgd(0.1),
          fedjax.optimizers.sgd(1.0), hp),
      'fed_prox': lambda: fedjax.algorithms.fed_prox.fed_prox(
          per_example_loss, fedjax.optimizers.sgd(0.1),
          fedjax.optimizers.sgd(1.0), hp, proximal_weight=0.01),
      'mime_lite': lambda: fedjax.algorithms.mime_lite.mime_lite(
          per_example_loss, fedjax.optimizers.sgd(0.1), hp,
          fedjax.PaddedBatchHParams(batch_size=32), server_learning_rate=1.0),
  }
  for name, make_alg in algorithms.items():
    ref, ref_diag = _train(make_alg, params, femnist_clients, 'jit')
    spy = _SpyBackend()
    got, got_diag = _train(make_alg, params, femnist_clients, spy)
    assert spy.built >= 1, name  # the vmapped backend really ran
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(ref.params), jax.tree.leaves(params)))
    assert moved > 1e-3, name  # the rounds did train
    for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(got.params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    assert set(ref_diag) == set(got_diag)


def _synthetic_clients(sizes, seed=0):
  rng = np.random.RandomState(seed)
  return [(b'c%d' % i, fedjax.ClientDataset({
      'x': rng.rand(n, 28, 28, 1).astype(np.float32),
      'y': rng.randint(0, 10, n).astype(np.int32)}), jax.random.PRNGKey(i))
          for i, n in enumerate(sizes)]


def _assert_trees_close(a, b, msg=''):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb), msg
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                               atol=1e-6, err_msg=msg)


def test_apfl_and_hyp_cluster_match_jit_backend():
  model = fedjax.models.emnist.create_dense_model(only_digits=True,
                                                  hidden_units=16)
  params = model.init(jax.random.PRNGKey(0))
  # 7 clients of 5..29 examples: 1 to 4 steps of 8 (last batch repeated).
  clients = _synthetic_clients([5, 29, 12, 17, 8, 23, 11])
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=8, num_epochs=1, seed=0)
  per_example_loss = fedjax.model_per_example_loss(model)
  algorithms = {
      'apfl': lambda: fedjax.algorithms.apfl.
              adaptive_personalized_federated_learning(
                  fedjax.model_grad(model), fedjax.optimizers.sgd(0.1),
                  fedjax.optimizers.sgd(1.0), hp, client_coefficient=0.5),
      'hyp_cluster': lambda: fedjax.algorithms.hyp_cluster.hyp_cluster(
          per_example_loss, fedjax.optimizers.sgd(0.1),
          fedjax.optimizers.sgd(1.0), fedjax.PaddedBatchHParams(batch_size=8),
          hp),
  }
  inits = {'apfl': params,
           'hyp_cluster': fedjax.algorithms.hyp_cluster.random_init(
               2, model.init, jax.random.PRNGKey(1))}
  for name, make_alg in algorithms.items():
    ref, ref_diag = _train(make_alg, inits[name], clients, 'jit')
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(ref), jax.tree.leaves(inits[name])))
    assert moved > 1e-3, name  # the rounds did train
    for lanes in ('auto', 3):
      spy = _SpyBackend(lanes_per_device=lanes)
      got, got_diag = _train(make_alg, inits[name], clients, spy)
      assert spy.built >= 1, name
      if name == 'apfl':
        # Personal states (params and 0-d mixing weights) per client too.
        assert set(ref.client_states) == set(got.client_states)
        for cid in ref.client_states:
          _assert_trees_close(ref.client_states[cid],
                              got.client_states[cid], f'{name} {cid}')
        _assert_trees_close(ref.params, got.params, name)
      else:
        _assert_trees_close(ref.cluster_params, got.cluster_params, name)
        assert ({k: int(v['cluster_id']) for k, v in ref_diag.items()} ==
                {k: int(v['cluster_id']) for k, v in got_diag.items()})


def _running_sum_fn(backend):
  """A for_each_client whose state, output and step results see every
  example of every batch in order (a weighted running sum)."""

  def client_init(shared, client_input):
    return {'s': shared['s'] * client_input['scale'], 'n': jnp.zeros(()),
            'k': jnp.zeros((), jnp.int32)}

  def client_step(state, batch):
    k = state['k'] + 1
    s = 0.5 * state['s'] + jnp.sum(batch['x'], axis=0) * k
    return ({'s': s, 'n': state['n'] + batch['x'].shape[0], 'k': k},
            {'size': jnp.float32(batch['x'].shape[0]), 'mean_s': jnp.mean(s)})

  def client_final(shared, state):
    return {'delta': state['s'] - shared['s'], 'n': state['n']}

  with fedjax.for_each_client_backend(backend):
    return fedjax.for_each_client(client_init, client_step, client_final,
                                  with_step_result=True)


def _uneven_clients():
  rng = np.random.RandomState(0)
  clients = []
  for i, (n, batch_size) in enumerate(
      [(10, 4), (8, 4), (3, 4), (7, 3), (0, 4), (13, 4), (9, 3)]):
    ds = fedjax.ClientDataset({'x': rng.randn(n, 3).astype(np.float32)})
    batches = list(ds.batch(fedjax.BatchHParams(batch_size=batch_size)))
    clients.append((b'c%d' % i, batches,
                    {'scale': np.float32(1 + 0.1 * i)}))
  return clients


def test_uneven_batches_and_chunks_match_jit_backend():
  clients = _uneven_clients()
  # Batches of 4, 4, 2 / 4, 4 / 3 / 3, 3, 1 / none / 4, 4, 4, 1 / 3, 3, 3.
  assert [len(b) for _, b, _ in clients] == [3, 2, 1, 3, 0, 4, 3]
  shared = {'s': np.arange(3, dtype=np.float32) + 1}
  ref = list(_running_sum_fn('jit')(shared, clients))
  by_cid = {}
  for lanes in ('auto', 3, 1):
    with stats_lib.recording_stats() as stats:
      got = list(_running_sum_fn(VmapBackend(lanes_per_device=lanes))(
          shared, clients))
    counts = stats.totals()
    assert counts['name'] == 'vmap_backend'
    assert counts['clients'] == 7
    assert counts['useful_steps'] == 16
    # Call order, as FedJAX's jit backend.
    assert [c for c, _, _ in got] == [c for c, _, _ in ref]
    got_by_cid = {c: (out, res) for c, out, res in got}
    for cid, out, res in ref:
      g_out, g_res = got_by_cid[cid]
      _assert_trees_close(out, g_out, str(cid))
      # Per-step results in step order (their sizes give the order away).
      assert len(res) == len(g_res), cid
      assert ([float(r['size']) for r in res] ==
              [float(r['size']) for r in g_res]), cid
      for a, b in zip(res, g_res):
        _assert_trees_close(a, b, str(cid))
    by_cid[lanes] = got_by_cid
  # Independent expectation for one client: batches 4, 4, 2 of client 0.
  x = np.concatenate([b['x'] for b in clients[0][1]])
  s = shared['s'] * 1.0
  for k, (lo, hi) in enumerate([(0, 4), (4, 8), (8, 10)], start=1):
    s = 0.5 * s + x[lo:hi].sum(axis=0) * k
  np.testing.assert_allclose(by_cid[3][b'c0'][0]['delta'], s - shared['s'],
                             rtol=1e-5)
  assert float(by_cid[3][b'c4'][0]['n']) == 0.  # no batch: init + final


def test_zero_d_state_leaf_reshaped_by_step():
  """A step turning a float32[] leaf into float32[1] (as FedJAX's apfl can)."""

  def client_init(shared, client_input):
    return {'w': shared * client_input, 'a': jnp.float32(0.5)}

  def client_step(state, batch):
    a = jnp.clip(state['a'] + jnp.sum(batch['x']).reshape(1) * 0.01,
                 0, 1)  # float32[1]
    return {'w': state['w'] * a + 1., 'a': a}, a

  def client_final(shared, state):
    return {'w': state['w'] - shared, 'a': state['a']}

  def make(backend):
    with fedjax.for_each_client_backend(backend):
      return fedjax.for_each_client(client_init, client_step, client_final,
                                    with_step_result=True)

  rng = np.random.RandomState(1)
  clients = [(i, [{'x': rng.rand(2, 2).astype(np.float32)}
                  for _ in range(1 + i % 3)], np.float32(1 + i))
             for i in range(5)]
  shared = np.ones(4, np.float32)
  ref = list(make('jit')(shared, clients))
  got_list = list(make(VmapBackend())(shared, clients))
  assert [c for c, _, _ in got_list] == [c for c, _, _ in ref]
  got = {c: (b, rb) for c, b, rb in got_list}
  for c, a, ra in ref:
    b, rb = got[c]
    assert np.shape(a['w']) == np.shape(b['w']) == (4,)
    np.testing.assert_allclose(a['w'], b['w'], rtol=1e-6)
    assert np.shape(a['a']) == ((1,) if ra else ())
    np.testing.assert_allclose(np.ravel(a['a']), np.ravel(b['a']), rtol=1e-6)
    np.testing.assert_allclose(np.ravel(ra), np.ravel(rb), rtol=1e-6)


def test_step_changing_a_leaf_size_is_a_clear_error():
  fn = VmapBackend()(lambda s, c: s,
                     lambda s, b: (jnp.concatenate([s, b['x']]), ()),
                     lambda s, st: st)
  clients = [(b'a', [{'x': np.ones(3)}], ())]
  with pytest.raises(ValueError, match='size stays the same'):
    list(fn(jnp.zeros(2), clients))


def test_bad_settings_are_clear_errors():
  with pytest.raises(ValueError, match='lanes_per_device'):
    VmapBackend(lanes_per_device=0)
  with pytest.raises(ValueError, match='segment_steps'):
    VmapBackend(segment_steps=0)


@pytest.mark.parametrize('module,test', [
    ('mime', 'test_create_grads_for_each_client'),
    ('mime', 'test_create_train_for_each_client'),
    ('mime_lite', 'test_create_train_for_each_client')])
def test_fedjax_mime_helpers_pass_their_own_tests(module, test):
  """FedJAX's own tests of these helpers (exact values, in call order)."""
  import importlib  # pylint: disable=g-import-not-at-top
  tests = importlib.import_module(f'fedjax.algorithms.{module}_test')
  case = next(c for c in vars(tests).values()
              if isinstance(c, type) and hasattr(c, test))
  with fedjax.for_each_client_backend(VmapBackend(lanes_per_device=1)):
    getattr(case(test), test)()


def test_windows_keep_call_order_and_results():
  """More clients than a window holds (lanes x window): call order and the
  jit backend's outputs."""
  clients = _uneven_clients() * 3
  clients = [(b'%d' % i, b, c) for i, (_, b, c) in enumerate(clients)]
  shared = {'s': np.arange(3, dtype=np.float32) + 1}
  ref = list(_running_sum_fn('jit')(shared, clients))
  got = list(_running_sum_fn(VmapBackend(lanes_per_device=2, window=2))(
      shared, clients))
  assert [c for c, _, _ in got] == [c for c, _, _ in ref]
  for (_, a, ra), (_, b, rb) in zip(ref, got):
    _assert_trees_close(a, b)
    assert len(ra) == len(rb)


_SCRIPT = textwrap.dedent('''
    import fedlite_jax
    import fedjax, jax, jax.numpy as jnp, numpy as np
    from fedlite_jax.rounds import VmapBackend
    assert jax.local_device_count() == 4

    def client_init(shared, client_input):
      return {'w': shared['w'] * client_input['scale'], 'n': jnp.zeros(())}
    def client_step(state, batch):
      w = state['w'] - 0.1 * jnp.mean(batch['x'], axis=0) * state['w']
      return {'w': w, 'n': state['n'] + 1}, {'norm': jnp.linalg.norm(w)}
    def client_final(shared, state):
      return {'delta': shared['w'] - state['w'], 'steps': state['n']}

    rng = np.random.RandomState(0)
    clients = []
    for i in range(7):  # 7 clients on 4 devices: one padding client
      batches = [{'x': rng.randn(5, 3).astype(np.float32)}
                 for _ in range(1 + i % 3)]
      clients.append((b'c%d' % i, batches,
                      {'scale': np.float32(1 + 0.1 * i)}))
    shared = {'w': np.arange(3, dtype=np.float32) + 1}
    # FedJAX picks the backend when for_each_client is called.
    def make():
      return fedjax.for_each_client(client_init, client_step, client_final,
                                    with_step_result=True)
    with fedjax.for_each_client_backend('jit'):
      ref = list(make()(shared, clients))
    backend = VmapBackend()
    with fedjax.for_each_client_backend(backend):
      fn = make()
    assert fn.__qualname__.startswith('VmapBackend'), fn.__qualname__
    got = {c: (o, s) for c, o, s in fn(shared, clients)}
    assert sorted(got) == [c for c, _, _ in ref]
    for cid, a, sa in ref:
      b, sb = got[cid]
      np.testing.assert_allclose(a['delta'], b['delta'], rtol=1e-6, atol=1e-7)
      assert float(a['steps']) == float(b['steps'])
      assert len(sa) == len(sb), cid
      for x, y in zip(sa, sb):
        np.testing.assert_allclose(x['norm'], y['norm'], rtol=1e-6)
    print('OK', len(got))

    # One lane per device (4 lanes streaming 7 clients) and a client with
    # a smaller last batch (a second program for its last step).
    clients[6] = (b'c6', clients[6][1] + [{'x': rng.randn(2, 3).astype(
        np.float32)}], clients[6][2])
    with fedjax.for_each_client_backend('jit'):
      ref = {c: (o, s) for c, o, s in make()(shared, clients)}
    with fedjax.for_each_client_backend(VmapBackend(lanes_per_device=1)):
      fn = make()
    got = {c: (o, s) for c, o, s in fn(shared, clients)}
    assert set(ref) == set(got)
    for cid, (a, sa) in ref.items():
      b, sb = got[cid]
      np.testing.assert_allclose(a['delta'], b['delta'], rtol=1e-6, atol=1e-7)
      assert len(sa) == len(sb), cid
      for x, y in zip(sa, sb):
        np.testing.assert_allclose(x['norm'], y['norm'], rtol=1e-6)
    print('OK lanes', len(got))
''')


def test_four_devices_seven_clients_match_jit_backend():
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      ' --xla_force_host_platform_device_count=4')
  env['JAX_PLATFORMS'] = 'cpu'
  proc = subprocess.run([sys.executable, '-c', _SCRIPT], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert 'OK 7' in proc.stdout
  assert 'OK lanes 7' in proc.stdout
