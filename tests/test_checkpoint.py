"""Checkpoints: exact round trip, corrupt and mismatched files fail loudly."""

import numpy as np
import jax.numpy as jnp
import optax
import pytest

from fedlite_jax import checkpoint
from fedlite_jax.algorithms import FedOptState


def _server(params):
  ints = jnp.zeros((0,), jnp.int32)
  return FedOptState(params, optax.adam(1e-3).init(params),
                     jnp.zeros((), jnp.int32), ints, ints)

def _state(scale=1.0, shape=(2, 3)):
  params = {'w': np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * scale}
  return {'server': _server(params),
          'ledger': {'upload_bits': 12.5, 'rounds': 3}}


def test_roundtrip_is_exact_and_keeps_latest(tmp_path):
  for r in (2, 4, 6):
    checkpoint.save_checkpoint(tmp_path, r, _state(r), {'seed': 0}, keep=2)
  assert sorted(p.name for p in tmp_path.glob('ckpt_*')) == [
      'ckpt_00000004.msgpack', 'ckpt_00000006.msgpack']
  latest = checkpoint.latest_checkpoint(tmp_path)
  r, state = checkpoint.restore_checkpoint(latest, _state(), {'seed': 0})
  assert r == 6
  np.testing.assert_array_equal(state['server'].params['w'],
                                _state(6)['server'].params['w'])
  assert state['ledger'] == {'upload_bits': 12.5, 'rounds': 3}
  assert isinstance(state['server'], FedOptState)


def test_corrupt_checkpoint(tmp_path):
  path = checkpoint.save_checkpoint(tmp_path, 1, _state(), {})
  path.write_bytes(path.read_bytes()[:20])
  with pytest.raises(checkpoint.CheckpointError, match='corrupt'):
    checkpoint.restore_checkpoint(path, _state(), {})


def test_mismatched_flags_and_shapes(tmp_path):
  path = checkpoint.save_checkpoint(tmp_path, 1, _state(), {'lr': 0.1})
  with pytest.raises(checkpoint.CheckpointError, match=r'lr: checkpoint=0.1 now=0.2'):
    checkpoint.restore_checkpoint(path, _state(), {'lr': 0.2})
  with pytest.raises(checkpoint.CheckpointError, match='shape'):
    checkpoint.restore_checkpoint(path, _state(shape=(3, 2)), {'lr': 0.1})
  with pytest.raises(checkpoint.CheckpointError, match='structure'):
    checkpoint.restore_checkpoint(path, {'other': 1}, {'lr': 0.1})
  assert checkpoint.latest_checkpoint(tmp_path / 'missing') is None
