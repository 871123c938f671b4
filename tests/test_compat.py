"""FedJAX 0.0.17 runs on current JAX through fedlite_jax.compat.

FedJAX's own algorithms (fed_avg, fed_prox, mime_lite) train on real FEMNIST
writers with FedJAX's own haiku CNN, and ``for_each_client`` gives the same
results on its jit and (patched) pmap backends with 4 forced host devices.
"""

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

from fedlite_jax import compat


def test_guards_are_noops_when_reapplied():
  compat.apply()
  compat.apply()
  assert jax.tree_map is jax.tree.map or callable(jax.tree_map)
  assert jnp.NINF == -np.inf
  assert np.issctype(np.float32) and not np.issctype(3)


def test_device_put_sharded_and_replicated():
  devices = jax.local_devices()[:1]
  x = compat.device_put_sharded([{'a': np.arange(3)}], devices)
  np.testing.assert_array_equal(x['a'], np.arange(3)[None])
  y = compat.device_put_replicated(np.ones(2), devices)
  assert y.shape == (1, 2)
  with pytest.raises(ValueError, match='2 shards for 1 devices'):
    compat.device_put_sharded([1, 2], devices)


def test_serialization_of_numpy_scalars():
  # fedjax.serialization packs NumPy scalars through np.issctype.
  data = fedjax.serialization.msgpack_serialize({'a': np.float32(1.5)})
  assert fedjax.serialization.msgpack_deserialize(data)['a'] == 1.5


@pytest.fixture(scope='module')
def emnist_setup(data_dir):
  train, test = fedjax.datasets.emnist.load_data(
      cache_dir=str(data_dir / 'femnist105'))
  model = fedjax.models.emnist.create_conv_model(only_digits=False)
  ids = list(train.client_ids())[:4]
  clients = [(cid, cds, jax.random.PRNGKey(i))
             for i, (cid, cds) in enumerate(train.get_clients(ids))]
  batches = list(fedjax.padded_batch_client_datasets(
      [cds for _, cds, _ in clients], batch_size=256))
  return model, clients, batches


def _loss(model, params, batches):
  return float(fedjax.evaluate_model(model, params, batches)['loss'])


def _train(alg, params, clients, rounds=3):
  state = alg.init(params)
  for _ in range(rounds):
    state, _ = alg.apply(state, clients)
  return state.params


def test_fedjax_fed_avg_fed_prox_mime_lite_train(emnist_setup):
  model, clients, batches = emnist_setup
  params = model.init(jax.random.PRNGKey(0))
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0)
  per_example_loss = fedjax.model_per_example_loss(model)
  algorithms = {
      'fed_avg': fedjax.algorithms.fed_avg.federated_averaging(
          fedjax.model_grad(model), fedjax.optimizers.sgd(0.1),
          fedjax.optimizers.sgd(1.0), hp),
      'fed_prox': fedjax.algorithms.fed_prox.fed_prox(
          per_example_loss, fedjax.optimizers.sgd(0.1),
          fedjax.optimizers.sgd(1.0), hp, proximal_weight=0.01),
      'mime_lite': fedjax.algorithms.mime_lite.mime_lite(
          per_example_loss, fedjax.optimizers.sgd(0.1), hp,
          fedjax.PaddedBatchHParams(batch_size=64), server_learning_rate=1.0),
  }
  before = _loss(model, params, batches)
  for name, alg in algorithms.items():
    after = _loss(model, _train(alg, params, clients), batches)
    # Chance level for 62 classes is ln 62 = 4.13; three rounds of training on
    # these clients must cut the training loss clearly.
    assert after < before - 0.3, (name, before, after)


_PMAP_SCRIPT = textwrap.dedent('''
    import fedlite_jax
    import fedjax, jax, jax.numpy as jnp, numpy as np
    assert jax.local_device_count() == 4, jax.local_devices()

    def client_init(shared, client_input):
      return {'w': shared['w'] * client_input, 'n': jnp.zeros(())}
    def client_step(state, batch):
      w = state['w'] - 0.1 * jnp.mean(batch['x'], axis=0) * state['w']
      return {'w': w, 'n': state['n'] + 1}, {'norm': jnp.linalg.norm(w)}
    def client_final(shared, state):
      return {'delta': shared['w'] - state['w'], 'steps': state['n']}

    rng = np.random.RandomState(0)
    clients = []
    for i in range(7):  # 7 clients on 4 devices: one padded client
      batches = [{'x': rng.randn(5, 3).astype(np.float32)}
                 for _ in range(1 + i % 3)]  # uneven step counts
      clients.append((bytes([i]), batches, jnp.float32(1 + i)))
    shared = {'w': jnp.arange(3, dtype=jnp.float32)}
    results = {}
    for backend in ('jit', 'pmap'):
      # The backend is bound when for_each_client is called.
      with fedjax.for_each_client_backend(backend):
        fn = fedjax.for_each_client(client_init, client_step, client_final,
                                    with_step_result=True)
        assert type(fedjax.get_for_each_client_backend()).__name__ == (
            'ForEachClientJitBackend' if backend == 'jit'
            else 'ForEachClientPmapBackend')
        results[backend] = {cid: jax.device_get((out, steps))
                            for cid, out, steps in fn(shared, clients)}
    assert results['jit'].keys() == results['pmap'].keys()
    for cid in results['jit']:
      (a, sa), (b, sb) = results['jit'][cid], results['pmap'][cid]
      np.testing.assert_allclose(a['delta'], b['delta'], rtol=1e-6, atol=1e-7)
      assert a['steps'] == b['steps'] == 1 + cid[0] % 3
      assert len(sa) == len(sb)
      for x, y in zip(sa, sb):
        np.testing.assert_allclose(x['norm'], y['norm'], rtol=1e-6)
    print('PMAP_OK', len(results['pmap']))
''')


def test_for_each_client_jit_equals_pmap_on_4_devices(tmp_path):
  script = tmp_path / 'pmap_check.py'
  script.write_text(_PMAP_SCRIPT)
  env = dict(os.environ,
             XLA_FLAGS='--xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, str(script)], capture_output=True,
                        text=True, env=env, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'PMAP_OK 7' in proc.stdout
