"""CompressedBackend: compression for UNMODIFIED FedJAX algorithms.

Independent expectations: the IGC message size ``8 d + 64`` bits (d = 4096
intrinsic coordinates at 8 bits plus the quantizer's min/max) against ``32
D`` for FedAvg; 16-bit uniform download ``16 D + 64 L`` (L = number of
variables); our own builder ``federated_averaging`` with the same
transforms and seed (same PRNG streams: it must give the same model); plain
FedJAX (no compression) for the pass-through path; and the loss of the
trained model on the clients' data.
"""

from __future__ import annotations

import os
import pathlib

import fedlite_jax  # noqa: F401  (must precede fedjax)
import fedjax
from fedjax.algorithms import fed_avg
from fedjax.algorithms import fed_prox
from fedjax.algorithms import mime_lite
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import datasets
from fedlite_jax import transforms as T
from fedlite_jax.algorithms import fedopt
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run
from fedlite_jax.models import emnist
from fedlite_jax.rounds import CompressedBackend
from fedlite_jax.rounds import compressed_backend

IGC_UPLOAD = 'intrinsic_projection:4096,uniform_quantization:8'
CNN_PARAMS = 1_206_590  # Reddi et al.'s EMNIST CNN, 62 classes.


def _femnist_dir() -> str:
  path = os.environ.get('FEDLITE_DATA_DIR')
  if not path or not (pathlib.Path(path) / 'femnist105').is_dir():
    pytest.skip('needs femnist105/ under FEDLITE_DATA_DIR (set '
                'FEDLITE_DATA_DIR to the directory holding it)')
  return path


@pytest.fixture(scope='module')
def femnist_train():
  train, _, _ = datasets.load_federated_data('emnist', _femnist_dir())
  ids = list(train.client_ids())[:4]
  return [(cid, cds[:60]) for cid, cds in train.get_clients(ids)]


def _round_clients(train, round_num, n=4):
  return [(cid, cds, jax.random.PRNGKey(100 * round_num + i))
          for i, (cid, cds) in enumerate(train[:n])]


@pytest.fixture(scope='module')
def cnn():
  model = emnist.create_emnist_cnn().model
  return model, model.init(jax.random.PRNGKey(0))


def _size(tree):
  return sum(x.size for x in jax.tree.leaves(tree))


def _max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _loss(model, params, train):
  batches = [b for _, cds in train
             for b in cds.padded_batch(fedjax.PaddedBatchHParams(60))]
  return float(fedjax.evaluate_model(model, params, batches)['loss'])


def test_fedjax_fed_avg_igc_upload_16bit_download(femnist_train, cnn):
  model, params = cnn
  D, L = _size(params), len(jax.tree.leaves(params))
  assert (D, L) == (CNN_PARAMS, 8)
  backend = CompressedBackend(upload=IGC_UPLOAD,
                              download='uniform_quantization:16')
  with fedjax.for_each_client_backend(backend):
    algorithm = fed_avg.federated_averaging(
        fedjax.model_grad(model), fedjax.optimizers.sgd(0.1),
        fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0))
  state = algorithm.init(params)
  for r in range(3):
    state, _ = algorithm.apply(state, _round_clients(femnist_train, r))

  summary = backend.ledger.summary()
  upload_ratio = 32 * D / (8 * 4096 + 64)
  assert round(upload_ratio) == 1176
  assert summary['upload_compression'] == pytest.approx(upload_ratio,
                                                        rel=1e-12)
  assert summary['download_compression'] == pytest.approx(
      32 * D / (16 * D + 64 * L), rel=1e-12)  # 1.99995
  assert summary['num_params'] == D
  assert (summary['rounds'], summary['client_rounds']) == (3, 12)
  for row in backend.client_bits.values():
    for bits in row.values():
      assert bits == {'upload_bits': 8 * 4096 + 64,
                      'download_bits': 16 * D + 64 * L}
  # The model trains through a 1,176x upload: loss on the clients' data
  # (4.12 at init) falls.
  assert _loss(model, state.params, femnist_train) < (
      _loss(model, params, femnist_train) - 0.2)


def test_fed_avg_backend_equals_our_federated_averaging(femnist_train, cnn):
  model, params = cnn
  up = T.chain(T.intrinsic_projection(4096), T.uniform_quantization(8))
  down = T.uniform_quantization(16)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0)
  backend = CompressedBackend(upload=up, download=down, seed=3)
  with fedjax.for_each_client_backend(backend):
    theirs = fed_avg.federated_averaging(
        fedjax.model_grad(model), fedjax.optimizers.sgd(0.1),
        fedjax.optimizers.sgd(1.0), hp)
  ours = fedopt.federated_averaging(
      fedjax.model_grad(model), optax.sgd(0.1), optax.sgd(1.0), hp,
      compression=fedopt.Compression(upload=up, download=down), seed=3,
      engine='loop')
  their_state, our_state = theirs.init(params), ours.init(params)
  for r in range(2):
    clients = [(cid, cds[:40], rng) for cid, cds, rng in
               _round_clients(femnist_train, r, 3)]
    their_state, _ = theirs.apply(their_state, clients)
    our_state, diag = ours.apply(our_state, clients)
    assert _max_diff(their_state.params, our_state.params) < 1e-6
    assert {cid: (d['upload_bits'], d['download_bits'])
            for cid, d in diag.items()} == {
                cid: (d['upload_bits'], d['download_bits'])
                for cid, d in backend.client_bits[r].items()}
  assert _max_diff(their_state.params, params) > 1e-3  # not vacuous
  # Same key derivation constants as the builder.
  assert compressed_backend.UPLOAD_STREAM == fedopt.UPLOAD_STREAM
  assert compressed_backend.DOWNLOAD_STREAM == fedopt.DOWNLOAD_STREAM


@pytest.fixture(scope='module')
def dense():
  model = fedjax.models.emnist.create_dense_model(only_digits=False,
                                                  hidden_units=32)
  return model, model.init(jax.random.PRNGKey(1))


def test_uncompressed_backend_is_fedjax_fed_prox(femnist_train, dense):
  model, params = dense
  D = _size(params)

  def build():
    return fed_prox.fed_prox(
        fedjax.model_per_example_loss(model), fedjax.optimizers.sgd(0.1),
        fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0),
        proximal_weight=0.01)

  plain = build()
  for base in ('jit', 'vmap'):
    backend = CompressedBackend(base=base)
    with fedjax.for_each_client_backend(backend):
      wrapped = build()
    a, b = plain.init(params), wrapped.init(params)
    for r in range(2):
      a, _ = plain.apply(a, _round_clients(femnist_train, r))
      b, _ = wrapped.apply(b, _round_clients(femnist_train, r))
    tol = 0 if base == 'jit' else 1e-6
    assert _max_diff(a.params, b.params) <= tol, base
    summary = backend.ledger.summary()
    assert summary['upload_compression'] == summary['download_compression'] == 1
    assert summary['total_upload_bytes'] == 2 * 4 * 32 * D / 8


def test_mime_lite_through_vmap_backend(femnist_train, dense):
  model, params = dense
  D, L = _size(params), len(jax.tree.leaves(params))
  backend = CompressedBackend(upload='uniform_quantization:8',
                              download='uniform_quantization:16',
                              base='vmap')
  base_optimizer = fedjax.optimizers.create_optimizer_from_optax(
      optax.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-3))
  with fedjax.for_each_client_backend(backend):
    algorithm = mime_lite.mime_lite(
        fedjax.model_per_example_loss(model), base_optimizer,
        fedjax.ShuffleRepeatBatchHParams(batch_size=20, seed=0),
        fedjax.PaddedBatchHParams(batch_size=30), server_learning_rate=1.0)
  state = algorithm.init(params)
  accumulator = [x for x in jax.tree.leaves(state.opt_state)
                 if jnp.ndim(x) >= 1]
  A, LA = _size(accumulator), len(accumulator)
  assert A == D  # Adagrad's sum of squares, one per parameter
  for r in range(2):
    new, _ = algorithm.apply(state, _round_clients(femnist_train, r))
    assert 1e-3 < _max_diff(new.params, state.params)
    assert all(bool(jnp.all(jnp.isfinite(x)))
               for x in jax.tree.leaves(new))
    state = new
  summary = backend.ledger.summary()
  # Two for_each_client calls per apply (training, full-batch gradients) make
  # ONE round; the gradient pass reuses the params already downloaded.
  assert (summary['rounds'], summary['client_rounds']) == (2, 8)
  for row in backend.client_bits.values():
    for bits in row.values():
      # delta + (num * grads, num): two 8-bit messages + one float32 count.
      assert bits['upload_bits'] == 2 * (8 * D + 64 * L) + 32
      # model + Adagrad statistics, each leaf at 16 bits + 64.
      assert bits['download_bits'] == (16 * D + 64 * L) + (16 * A + 64 * LA)


def _sum_clients(backend, seed_inputs):
  """A user's own for_each_client (client input: a dict, not a key)."""

  def init(shared, client_input):
    return {'x': shared['x'] * client_input['scale']}

  def step(state, batch):
    return {'x': state['x'] + batch['y']}

  def final(shared, state):
    del shared
    return {'x': state['x'], 'count': jnp.int32(3)}

  with fedjax.for_each_client_backend(backend):
    for_each = fedjax.for_each_client(init, step, final)
  shared = {'x': jnp.linspace(-1.0, 1.0, 50)}
  clients = [(f'c{i}'.encode(), [{'y': jnp.full((50,), 0.1 * i)}],
              {'scale': jnp.float32(s)}) for i, s in enumerate(seed_inputs)]
  return dict(for_each(shared, clients))


def test_user_algorithm_keys_from_seed_round_client():
  outs = [_sum_clients(CompressedBackend(upload='uniform_quantization:2',
                                         seed=s), [1.0, 2.0])
          for s in (5, 5, 6)]
  exact = _sum_clients(CompressedBackend(), [1.0, 2.0])
  for cid in exact:
    assert int(outs[0][cid]['count']) == 3  # int leaf passed through
    np.testing.assert_array_equal(outs[0][cid]['x'], outs[1][cid]['x'])
    assert not np.array_equal(outs[0][cid]['x'], exact[cid]['x'])
  assert any(not np.array_equal(outs[0][c]['x'], outs[2][c]['x'])
             for c in exact)


def test_refuses_error_feedback_and_reports_no_ledger_before_a_round():
  backend = CompressedBackend(upload=T.top_k(5, error_feedback=True))
  with pytest.raises(ValueError, match='no client has run yet'):
    backend.ledger  # pylint: disable=pointless-statement
  with pytest.raises(ValueError, match='upload transform updates its state'):
    _sum_clients(backend, [1.0])
  with pytest.raises(ValueError, match="base must be None, one of"):
    CompressedBackend(base='pmapp')
  with pytest.raises(ValueError, match='bad compression stage'):
    CompressedBackend(upload='uniform_quantization:99')


def test_runner_upload_flag_igc(tmp_path):
  path = _femnist_dir()
  base = dict(task='emnist', num_rounds=1, clients_per_round=2,
              client_batch_size=20, max_examples_per_client=40,
              eval_num_clients=2, eval_every=1, checkpoint_every=0,
              progress=False, seed=0, data_dir=path)
  comm = run(RunConfig(algorithm='fedavg', output_dir=str(tmp_path / 'a'),
                       options={'upload': IGC_UPLOAD}, **base)
             )['communication']
  assert comm['upload_compression'] == pytest.approx(
      32 * CNN_PARAMS / (8 * 4096 + 64), rel=1e-12)
  comm = run(RunConfig(algorithm='topk', output_dir=str(tmp_path / 'b'),
                       options={'upload': 'top_k:12000,uniform_quantization:8'},
                       **base))['communication']
  assert comm['total_upload_bytes'] == 2 * (
      8 * 12000 + 64 + 12000 * 21) / 8  # ceil(log2 D) = 21 index bits
