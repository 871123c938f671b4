"""``--init_checkpoint``: the runner starts from given parameters.

Sources: a parameter file (``state_io.save_params``, written by
``experiments/pretrain_centralized.py``) or one of the runner's own round
checkpoints. The starting point is evaluated as a round-0 row of
metrics.jsonl; the file's SHA-256 is part of the run's fingerprint.
"""

import hashlib
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import jax.numpy as jnp
import optax
import pytest

from fedlite_jax.training import state_io
from fedlite_jax import models
from fedlite_jax.algorithms import FedOptState
from fedlite_jax.training import ConfigError
from fedlite_jax.training import RunConfig
from fedlite_jax.training import outputs
from fedlite_jax.training import round_metrics
from fedlite_jax.training import run

# embedded_mnist in 100 clients (~40 training examples each): 3 clients of 2
# local steps per round, 5 test clients.
TINY = dict(task='embedded_mnist', num_clients=100, clients_per_round=3,
            client_batch_size=20, eval_num_clients=5, progress=False, seed=3)


def _server(params):
  ints = jnp.zeros((0,), jnp.int32)
  return FedOptState(params, optax.adam(1e-3).init(params),
                     jnp.zeros((), jnp.int32), ints, ints)

def _rows(out_dir):
  """The run's evaluation-carrying rows with the test metrics by bare
  name (``eval/loss`` -> ``loss``), beside the other keys."""
  return [{**r, **round_metrics.eval_metrics(r)}
          for r in outputs.read_metrics(out_dir / 'metrics.jsonl')]


def _dir_sha256(path):
  """SHA-256 over a directory's files: length-prefixed relative path and
  contents, in path order."""
  digest = hashlib.sha256()
  for f in sorted(p for p in path.rglob('*') if p.is_file()):
    for part in (f.relative_to(path).as_posix().encode(), f.read_bytes()):
      digest.update(len(part).to_bytes(8, 'little') + part)
  return digest.hexdigest()


def _cnn_params(seed=3):
  """The embedded_mnist model's random init (what a plain run starts from)."""
  return models.create_emnist_cnn(num_classes=10).model.init(
      jax.random.PRNGKey(seed))


def _final_params(out_dir):
  path = state_io.latest_checkpoint(out_dir / 'checkpoints')
  return state_io.stored_params(path, _cnn_params())[1]


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A 20-round FedAvg run of embedded_mnist: (output dir, its rows)."""
  out = tmp_path_factory.mktemp('src') / 'run'
  run(RunConfig(num_rounds=20, eval_every=10, output_dir=str(out), **TINY))
  return out, _rows(out)


def test_starts_at_the_checkpoint_of_a_20_round_run(trained, tmp_path):
  src, src_rows = trained
  ckpt = state_io.latest_checkpoint(src / 'checkpoints')
  assert ckpt.name == '20' and ckpt.is_dir()
  out = tmp_path / 'fine_tune'
  summary = run(RunConfig(num_rounds=2, eval_every=2, init_checkpoint=str(ckpt),
                          output_dir=str(out), **TINY))
  rows = _rows(out)
  assert [r['round'] for r in rows] == [0, 1, 2]
  assert [r['round'] for r in rows if 'loss' in r] == [0, 2]
  # Round 0 is the 20-round model evaluated on the same test batches.
  assert rows[0]['accuracy'] == pytest.approx(src_rows[-1]['accuracy'], abs=1e-6)
  assert rows[0]['loss'] == pytest.approx(src_rows[-1]['loss'], rel=1e-5)
  assert rows[0]['comm/upload_bytes_total'] == 0
  assert rows[0]['comm/download_bytes_total'] == 0
  assert not any(k.startswith(('train/', 'time/')) for k in rows[0])
  # Trained from there, not from the random init: far above chance (0.1).
  assert rows[0]['accuracy'] > 0.4
  assert summary['init_checkpoint'] == {
      'path': str(ckpt), 'source': 'checkpoint', 'round': 20,
      'sha256': _dir_sha256(ckpt)}
  saved = json.loads((out / 'summary.json').read_text())
  assert saved['init_checkpoint'] == summary['init_checkpoint']


def test_split_learning_starts_from_a_fedavg_checkpoint(trained, tmp_path):
  """The state layout differs (SplitState), the model parameters do not."""
  src, src_rows = trained
  ckpt = state_io.latest_checkpoint(src / 'checkpoints')
  out = tmp_path / 'splitfed'
  run(RunConfig(algorithm='splitfed', num_rounds=1, eval_every=1,
                init_checkpoint=str(ckpt), output_dir=str(out), **TINY))
  row0 = _rows(out)[0]
  assert row0['round'] == 0
  assert row0['loss'] == pytest.approx(src_rows[-1]['loss'], rel=1e-5)


def test_all_zero_parameters_start_elsewhere_than_the_random_init(tmp_path):
  cfg = dict(num_rounds=1, eval_every=1, **TINY)
  # The seed's own random init as a file, and all-zero parameters.
  same = state_io.save_params(tmp_path / 'random.params', _cnn_params())
  zeros = state_io.save_params(
      tmp_path / 'zeros.params', jax.tree.map(np.zeros_like, _cnn_params()))
  run(RunConfig(output_dir=str(tmp_path / 'random'), init_checkpoint=same,
                **cfg))
  run(RunConfig(output_dir=str(tmp_path / 'zeros'), init_checkpoint=zeros,
                **cfg))
  random_row0 = _rows(tmp_path / 'random')[0]
  zeros_row0 = _rows(tmp_path / 'zeros')[0]
  assert zeros_row0['round'] == random_row0['round'] == 0
  # All-zero parameters: every logit is 0, so the loss is ln(10) (10
  # classes). The random init is close to uniform too, but not equal.
  assert zeros_row0['loss'] == pytest.approx(math.log(10), rel=1e-6)
  assert abs(random_row0['loss'] - zeros_row0['loss']) > 1e-5


def test_file_contents_are_part_of_the_fingerprint(tmp_path):
  path = tmp_path / 'init.params'
  state_io.save_params(path, _cnn_params())
  out = str(tmp_path / 'run')
  cfg = dict(eval_every=1, init_checkpoint=str(path), output_dir=out, **TINY)
  run(RunConfig(num_rounds=1, **cfg))
  # Same path, other contents: the run cannot be extended from its checkpoint.
  state_io.save_params(path, jax.tree.map(np.zeros_like, _cnn_params()))
  with pytest.raises(state_io.CheckpointError,
                     match='init_checkpoint_sha256'):
    run(RunConfig(num_rounds=2, **cfg))


def test_missing_or_unfit_file_is_one_config_error(tmp_path):
  missing = tmp_path / 'nope.params'
  with pytest.raises(ConfigError,
                     match=f'--init_checkpoint={missing}: no such file'):
    run(RunConfig(num_rounds=1, init_checkpoint=str(missing),
                  output_dir=str(tmp_path / 'a'), **TINY))
  wrong = state_io.save_params(
      tmp_path / 'lm.params', {'embed': np.zeros((5, 3), np.float32)})
  with pytest.raises(ConfigError, match='variables differ'):
    run(RunConfig(num_rounds=1, init_checkpoint=wrong,
                  output_dir=str(tmp_path / 'b'), **TINY))
  assert not (tmp_path / 'b' / 'metrics.jsonl').exists()


def test_binary_missing_init_checkpoint_fails(repo_root, tmp_path):
  missing = tmp_path / 'nope.params'
  proc = subprocess.run(
      [sys.executable, str(repo_root / 'experiments' / 'run_experiment.py'),
       f'--output_dir={tmp_path / "o"}', f'--init_checkpoint={missing}',
       '--num_rounds=1', '--noprogress'],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=str(repo_root)))
  assert proc.returncode == 2
  assert f'--init_checkpoint={missing}: no such file' in proc.stderr
  assert 'Traceback' not in proc.stderr


# load_init_params on a small pytree (no model needed).

def _like():
  return {'dense': {'kernel': np.ones((2, 3), np.float32),
                    'bias': np.ones((3,), np.float32)}}


def test_load_parameter_file_checks_structure_shape_dtype(tmp_path):
  params = jax.tree.map(lambda x: x * 2, _like())
  path = state_io.save_params(tmp_path / 'p', params, {'corpus': 'x'})
  got = state_io.load_init_params(path, _like())
  np.testing.assert_array_equal(got.params['dense']['kernel'],
                                params['dense']['kernel'])
  assert got.source == 'params_file' and got.round is None
  with open(path, 'rb') as f:
    assert got.sha256 == hashlib.sha256(f.read()).hexdigest()
  bad_shape = {'dense': {'kernel': np.ones((3, 3), np.float32),
                         'bias': np.ones((3,), np.float32)}}
  state_io.save_params(tmp_path / 'shape', bad_shape)
  with pytest.raises(ValueError, match=r'dense/kernel has shape \(3, 3\)'):
    state_io.load_init_params(tmp_path / 'shape', _like())
  bad_dtype = jax.tree.map(lambda x: x.astype(np.float64), _like())
  state_io.save_params(tmp_path / 'dtype', bad_dtype)
  with pytest.raises(ValueError, match='float64, the model needs'):
    state_io.load_init_params(tmp_path / 'dtype', _like())
  (tmp_path / 'junk').write_text('{"not": "msgpack"}')
  with pytest.raises(ValueError, match='junk: not a parameter file'):
    state_io.load_init_params(tmp_path / 'junk', _like())


def _server_state(params):
  return {'server': _server(params),
          'ledger': {'upload_bits': 1.0}}


def test_load_round_checkpoint_takes_the_recorded_params(tmp_path):
  params = jax.tree.map(lambda x: x * 3, _like())
  state = _server_state(params)
  path = state_io.save_checkpoint(tmp_path, 7, state, {'seed': 0},
                                    params=state['server'].params)
  got = state_io.load_init_params(path, _like())
  assert got.source == 'checkpoint' and got.round == 7
  assert state_io.file_kind(path) == 'checkpoint'
  assert got.sha256 == _dir_sha256(path)
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  # Parameters that are not arrays of the state are stored as copies.
  copy = jax.tree.map(lambda x: x + 1, params)
  path = state_io.save_checkpoint(tmp_path / 'c', 8, state, {}, params=copy)
  got = state_io.load_init_params(path, _like())
  np.testing.assert_array_equal(got.params['dense']['bias'],
                                copy['dense']['bias'])
  # Another model's checkpoint, and one without recorded parameters.
  with pytest.raises(ValueError, match='different structure'):
    state_io.load_init_params(path, {'w': np.ones(3, np.float32)})
  wide = {'dense': {'kernel': np.ones((2, 4), np.float32),
                    'bias': np.ones((3,), np.float32)}}
  with pytest.raises(ValueError, match=r"\['kernel'\] has shape \(2, 3\)"):
    state_io.load_init_params(path, wide)
  old = state_io.save_checkpoint(tmp_path / 'old', 1, state, {})
  with pytest.raises(ValueError, match='does not record'):
    state_io.load_init_params(old, _like())
  # The checkpoints directory itself is not a checkpoint.
  with pytest.raises(ValueError, match='old is not a checkpoint'):
    state_io.load_init_params(tmp_path / 'old', _like())


def test_msgpack_checkpoint_of_644e428_still_loads(repo_root):
  """Runner checkpoints of the earlier msgpack format still give their
  model parameters (see tests/test_checkpoint.py for how it was written)."""
  path = repo_root / 'tests' / 'golden' / 'ckpt_00000002.msgpack'
  got = state_io.load_init_params(path, _like())
  assert got.source == 'checkpoint' and got.round == 2
  assert state_io.file_kind(path) == 'checkpoint'
  assert got.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
  np.testing.assert_array_equal(
      got.params['dense']['kernel'],
      3 * np.arange(6, dtype=np.float32).reshape(2, 3))
  np.testing.assert_array_equal(got.params['dense']['bias'],
                                np.full(3, 3.0, np.float32))
