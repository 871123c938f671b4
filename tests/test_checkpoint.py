"""Checkpoints (orbax): exact round trip, retention, killed saves ignored,
corrupt and mismatched checkpoints fail loudly, the earlier msgpack format
named in one line."""

import json
import pathlib
import shutil
import threading

import numpy as np
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

from fedlite_jax.training import state_io
from fedlite_jax.algorithms import FedOptState

#: A round checkpoint written by fedlite_jax/checkpoint.py at commit 644e428
#: (msgpack): save_checkpoint(dir, 2, {'server': FedOptState(params,
#: adam(1e-3).init(params), 0, int32[0], int32[0]), 'ledger':
#: {'upload_bits': 1.0}}, {'seed': 0}, params=params) with params
#: {'dense': {'kernel': 3 * arange(6).reshape(2, 3), 'bias': full(3, 3.)}}.
LEGACY = pathlib.Path(__file__).parent / 'golden' / 'ckpt_00000002.msgpack'


def _server(params):
  ints = jnp.zeros((0,), jnp.int32)
  return FedOptState(params, optax.adam(1e-3).init(params),
                     jnp.zeros((), jnp.int32), ints, ints)


def _state(scale=1.0, shape=(2, 3)):
  params = {'w': np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * scale}
  return {'server': _server(params),
          'ledger': {'upload_bits': 12.5, 'rounds': 3,
                     'extra_bits': {'activation_bits': 0.1 + 0.2}}}


def test_roundtrip_is_exact_and_keeps_latest(tmp_path):
  with state_io.Checkpointer(tmp_path, keep=2) as ckpt:  # Async saves.
    for r in (2, 4, 6):
      ckpt.save(r, _state(r), {'seed': 0})
  assert sorted(p.name for p in tmp_path.iterdir()) == ['4', '6']
  latest = state_io.latest_checkpoint(tmp_path)
  assert latest == tmp_path / '6'
  r, state = state_io.restore_checkpoint(latest, _state(), {'seed': 0})
  assert r == 6
  np.testing.assert_array_equal(state['server'].params['w'],
                                _state(6)['server'].params['w'])
  # Python scalars come back as their type, bit for bit.
  assert state['ledger'] == {'upload_bits': 12.5, 'rounds': 3,
                             'extra_bits': {'activation_bits': 0.1 + 0.2}}
  assert isinstance(state['ledger']['rounds'], int)
  assert isinstance(state['server'], FedOptState)
  # Zero-size arrays (orbax stores none) keep their shape and dtype.
  assert state['server'].last_round.shape == (0,)
  assert state['server'].last_round.dtype == np.int32
  assert state_io.read_leaves(latest)[0] == 6


def test_saves_finish_in_the_background(tmp_path, monkeypatch):
  """save() returns while orbax still finalizes the checkpoint: its handler's
  finalize (before the rename to <round>) is held until the test lets it go.
  A synchronous save would finalize in this thread, before save() returns."""
  caller, release = threading.current_thread(), threading.Event()
  finalized_in = []  # The threads that ran the handler's finalize.
  finalize = ocp.CompositeCheckpointHandler.finalize

  def held_finalize(self, directory):
    finalized_in.append(threading.current_thread())
    if threading.current_thread() is not caller:
      release.wait()
    return finalize(self, directory)

  monkeypatch.setattr(ocp.CompositeCheckpointHandler, 'finalize',
                      held_finalize)
  state = {'w': np.arange(1 << 16, dtype=np.float32), 'round': 5}
  ckpt = state_io.Checkpointer(tmp_path)
  try:
    path = ckpt.save(5, state, {'seed': 0})
    assert caller not in finalized_in
    assert not path.exists() and state_io.latest_checkpoint(tmp_path) is None
  finally:
    release.set()
    ckpt.close()
  assert finalized_in and caller not in finalized_in
  assert state_io.latest_checkpoint(tmp_path) == path
  r, got = state_io.restore_checkpoint(path, state, {'seed': 0})
  assert r == 5 and got['round'] == 5
  np.testing.assert_array_equal(got['w'], state['w'])


def test_a_killed_save_is_ignored_and_cleaned_up(tmp_path):
  state_io.save_checkpoint(tmp_path, 1, _state(), {})
  # What a save killed mid-way leaves: orbax's temporary directory.
  shutil.copytree(tmp_path / '1', tmp_path / '2.orbax-checkpoint-tmp')
  assert state_io.latest_checkpoint(tmp_path) == tmp_path / '1'
  # The next run's checkpointer removes it (before its first save).
  with state_io.Checkpointer(tmp_path) as ckpt:
    ckpt.save(2, _state(2), {})
  assert sorted(p.name for p in tmp_path.iterdir()) == ['1', '2']
  assert state_io.read_leaves(tmp_path / '2')[0] == 2


def test_corrupt_checkpoint(tmp_path):
  path = state_io.save_checkpoint(tmp_path, 1, _state(), {})
  (path / 'meta' / 'metadata').write_text('{"round": ')
  with pytest.raises(state_io.CheckpointError, match='corrupt'):
    state_io.restore_checkpoint(path, _state(), {})
  shutil.rmtree(path / 'arrays')
  with pytest.raises(state_io.CheckpointError, match='corrupt'):
    state_io.read_leaves(path)
  with pytest.raises(state_io.CheckpointError, match='not a checkpoint'):
    state_io.read_metadata(tmp_path)
  assert not state_io.is_checkpoint(tmp_path)


def test_mismatched_flags_and_shapes(tmp_path):
  path = state_io.save_checkpoint(tmp_path, 1, _state(), {'lr': 0.1})
  assert state_io.is_checkpoint(path)
  with pytest.raises(state_io.CheckpointError, match=r'lr: checkpoint=0.1 now=0.2'):
    state_io.restore_checkpoint(path, _state(), {'lr': 0.2})
  with pytest.raises(state_io.CheckpointError, match='shape'):
    state_io.restore_checkpoint(path, _state(shape=(3, 2)), {'lr': 0.1})
  with pytest.raises(state_io.CheckpointError, match='structure'):
    state_io.restore_checkpoint(path, {'other': 1}, {'lr': 0.1})
  assert state_io.latest_checkpoint(tmp_path / 'missing') is None


def test_recorded_params(tmp_path):
  state = _state(3)
  path = state_io.save_checkpoint(tmp_path, 7, state, {},
                                    params=state['server'].params)
  r, params = state_io.stored_params(path, {'w': np.zeros((2, 3),
                                                            np.float32)})
  assert r == 7
  np.testing.assert_array_equal(params['w'], state['server'].params['w'])


def test_legacy_msgpack_checkpoint_is_named_in_one_line(tmp_path):
  assert state_io.legacy_checkpoints(tmp_path / 'missing') == []
  shutil.copy(LEGACY, tmp_path / LEGACY.name)
  assert state_io.legacy_checkpoints(tmp_path) == [tmp_path / LEGACY.name]
  assert state_io.latest_checkpoint(tmp_path) is None
  message = str(state_io.legacy_error(tmp_path))
  assert '\n' not in message
  assert 'ckpt_00000002.msgpack' in message and '644e428' in message
  assert '--' not in message  # The runner names the flags.
  payload = state_io.decode_legacy(LEGACY.read_bytes())
  assert payload['round'] == 2
  params = state_io.legacy_stored_params(
      payload, {'dense': {'bias': np.zeros(3, np.float32),
                          'kernel': np.zeros((2, 3), np.float32)}})
  np.testing.assert_array_equal(params['dense']['kernel'],
                                3 * np.arange(6, dtype=np.float32).reshape(2, 3))
  assert state_io.decode_legacy(json.dumps({'a': 1}).encode()) is None


def test_relative_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  path = state_io.save_checkpoint('ckpts', 3, _state(), {'seed': 0})
  assert path == tmp_path / 'ckpts' / '3'
  latest = state_io.latest_checkpoint('ckpts')
  assert latest == pathlib.Path('ckpts', '3')
  assert state_io.restore_checkpoint(latest, _state(), {'seed': 0})[0] == 3
