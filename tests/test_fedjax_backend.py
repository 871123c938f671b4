"""The vmapped ``fedjax.ForEachClientBackend`` equals FedJAX's ``jit`` backend.

Unmodified FedJAX algorithms (``fed_avg``, ``fed_prox``, ``mime_lite``) on
real FEMNIST writers give the same parameters with either backend; a
``for_each_client`` with step results on 4 forced devices (7 clients, one
padded) gives the same outputs and step results as the jit backend.
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

  def __init__(self):
    super().__init__()
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


def test_mismatched_batch_shapes_are_a_clear_error():
  fn = VmapBackend()(lambda s, c: s, lambda s, b: (s + jnp.sum(b['x']), ()),
                     lambda s, st: st)
  clients = [(b'a', [{'x': np.ones(3)}], ()), (b'b', [{'x': np.ones(2)}], ())]
  with pytest.raises(ValueError, match="client b'b'"):
    list(fn(jnp.zeros(()), clients))


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
    got = list(fn(shared, clients))
    assert [c for c, _, _ in ref] == [c for c, _, _ in got]
    for (cid, a, sa), (_, b, sb) in zip(ref, got):
      np.testing.assert_allclose(a['delta'], b['delta'], rtol=1e-6, atol=1e-7)
      assert float(a['steps']) == float(b['steps'])
      assert len(sa) == len(sb), cid
      for x, y in zip(sa, sb):
        np.testing.assert_allclose(x['norm'], y['norm'], rtol=1e-6)
    print('OK', len(got))
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
