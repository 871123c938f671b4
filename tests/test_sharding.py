"""Clients split over devices and processes give the one-device result.

The multi-device checks run in subprocesses with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (the device count is
fixed when JAX starts). The reference is the same run on one device (the
loop engine), so an error in padding, sharding or the cross-device sum shows
up as a difference in the final parameters, not only in timing.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import fedlite_jax  # noqa: F401
import fedjax
import jax
import numpy as np
import pytest

from fedlite_jax.training import config as config_lib
from fedlite_jax.training import runner
from fedlite_jax import rounds
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import sharding

REPO = pathlib.Path(__file__).resolve().parents[1]

# Tiny settings on the embedded (always available) task: 7 clients, 2 rounds,
# 2 local steps of 20 examples each.
# One convolution for every placement (auto picks im2col on several
# devices, lax.conv on one), so that runs differ by the sharding alone; one
# step per segment, the smallest lane program to compile.
COMMON = dict(task='embedded_mnist', num_rounds=2, clients_per_round=7,
              client_batch_size=20, max_examples_per_client=40, eval_every=2,
              eval_num_clients=5, progress=False, checkpoint_every=1,
              conv_implementation='im2col', segment_steps=1)

ALGORITHMS = {
    'fedavg': dict(algorithm='fedavg'),
    'igc_static': dict(algorithm='igc_static',
                       options={'intrinsic_dim': 4096}),
    'fedlite': dict(algorithm='fedlite',
                    options={'num_subvectors': 1152, 'num_centroids': 8}),
    'fedavg_q8_pvt40': dict(algorithm='fedavg',
                            options={'upload': 'uniform_quantization:8',
                                     'pvt_fraction': 0.4}),
}

_HELPER = textwrap.dedent('''
    import json, pathlib, sys
    import fedlite_jax
    import jax
    import numpy as np
    from fedlite_jax.training import state_io
    from fedlite_jax.training import config as config_lib
    from fedlite_jax.training import runner

    def final_leaves(out):
      return state_io.read_leaves(
          state_io.latest_checkpoint(pathlib.Path(out) / 'checkpoints'))

    def run(out, **kw):
      return runner.run(config_lib.RunConfig(output_dir=str(out),
                                             overwrite=True, **kw))

    def compare(a, b, what, stochastic_rounding=False):
      ra, la = final_leaves(a)
      rb, lb = final_leaves(b)
      assert ra == rb, (what, ra, rb)
      assert len(la) == len(lb), what
      worst, flipped, total = 0.0, 0, 0
      for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype, what
        if x.dtype.kind != 'f':
          np.testing.assert_array_equal(x, y, err_msg=what)
          continue
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
        if not stochastic_rounding:
          np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5, err_msg=what)
        else:
          # A float-rounding difference in a client delta can move a value
          # across a stochastic-rounding threshold: that entry then lands
          # one quantization level away. Allow such flips on a tiny
          # fraction of entries, bounded by a quantization step.
          far = ~np.isclose(x, y, rtol=2e-4, atol=2e-5)
          flipped += int(far.sum())
          total += x.size
          assert float(np.max(np.abs(x - y), initial=0.0)) < 1e-3, what
      if stochastic_rounding:
        assert flipped <= 1e-4 * total, (what, flipped, total)
      return worst
''')


def _run_script(body: str, devices: int, tmp_path: pathlib.Path,
                timeout: int = 1500) -> str:
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      f' --xla_force_host_platform_device_count={devices}')
  env['JAX_PLATFORMS'] = 'cpu'
  script = tmp_path / 'check.py'
  script.write_text(_HELPER + textwrap.dedent(body))
  proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return proc.stdout


def test_num_shuffle_repeat_batches_matches_fedjax():
  rng = np.random.RandomState(0)
  for n in (1, 5, 19, 20, 21, 40, 57):
    ds = fedjax.ClientDataset({'x': rng.randn(n, 2)})
    for hp in (dict(batch_size=20), dict(batch_size=7, num_epochs=3),
               dict(batch_size=20, drop_remainder=True),
               dict(batch_size=4, num_epochs=2, num_steps=5),
               dict(batch_size=3, num_epochs=None, num_steps=4)):
      hparams = fedjax.ShuffleRepeatBatchHParams(seed=0, **hp)
      expected = len(list(ds.shuffle_repeat_batch(hparams)))
      assert remote.num_shuffle_repeat_batches(n, hparams) == expected, (n, hp)


def test_remote_client_dataset_has_size_but_no_examples():
  ds = remote.RemoteClientDataset(b'c', 45, owner=1)
  assert len(ds) == 45 and len(ds[:30]) == 30
  batches = ds.shuffle_repeat_batch(
      fedjax.ShuffleRepeatBatchHParams(batch_size=20))
  assert len(batches) == 3
  with pytest.raises(RuntimeError, match='process 1'):
    batches[0]


def test_num_devices_out_of_range_is_a_clear_error(tmp_path):
  present = jax.local_device_count()
  for bad in (0, present + 1):
    # rounds/ names the value; the runner names the flag.
    with pytest.raises(rounds.SettingError, match=f'^num_devices={bad}:'):
      sharding.make_client_mesh(bad)
  with pytest.raises(config_lib.ConfigError, match='--num_devices'):
    runner.run(config_lib.RunConfig(num_devices=present + 3, num_rounds=1,
                                    output_dir=str(tmp_path), progress=False))


def test_engine_errors_are_engine_config_errors():
  with pytest.raises(rounds.EngineConfigError, match='nope'):
    rounds.make_engine('nope', None)
  with pytest.raises(rounds.SettingError, match='^process_id=2: .* for '
                     'num_processes=2'):
    sharding.initialize_distributed('localhost:1', 2, 2)
  e = rounds.SettingError('process_id=2: must be in [0, 2) for '
                          'num_processes=2.', 'process_id', 'num_processes')
  assert config_lib.flag_message(e) == (
      '--process_id=2: must be in [0, 2) for --num_processes=2.')


def test_bad_multi_process_flags_are_clear_errors(tmp_path):
  with pytest.raises(config_lib.ConfigError, match='--coordinator_address'):
    runner.run(config_lib.RunConfig(num_processes=2, output_dir=str(tmp_path)))
  with pytest.raises(config_lib.ConfigError, match='--process_id=2'):
    runner.run(config_lib.RunConfig(num_processes=2, process_id=2,
                                    coordinator_address='localhost:1',
                                    output_dir=str(tmp_path)))


def test_unreachable_coordinator_times_out_with_a_message(tmp_path):
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  # Process 1 of 2 waits for a coordinator that never starts.
  out = _run_script(f'''
      from fedlite_jax.rounds import sharding
      try:
        sharding.initialize_distributed('localhost:{port}', 2, 1, timeout_s=3)
      except sharding.DistributedInitError as e:
        print('ERROR', e)
      ''', 1, tmp_path, timeout=300)
  assert 'ERROR' in out and f'localhost:{port}' in out and '3 s' in out


@pytest.mark.parametrize('name', list(ALGORITHMS))
def test_four_devices_equal_one_device(name, tmp_path):
  """FedAvg, IGC, FedLite, quantized+PVT FedAvg: 7 clients on 4 devices.

  One algorithm per test, so that the pytest workers share them.
  """
  kw = dict(COMMON, **ALGORITHMS[name])
  if name == 'fedlite':
    del kw['segment_steps']  # Split learning has no segments.
  out = _run_script(f'''
      import jax
      assert jax.local_device_count() == 4
      name, kw = {name!r}, {kw!r}
      one = run(pathlib.Path(name + '_1'), num_devices=1, **kw)
      four = run(pathlib.Path(name + '_4'), num_devices=4, **kw)
      assert one['round_engine'] == 'loop' or name == 'fedlite', one
      assert four['placement']['num_devices'] == 4, four['placement']
      assert one['communication'] == four['communication'], name
      worst = compare(name + '_1', name + '_4', name,
                      stochastic_rounding='q8' in name)
      print('OK', name, worst, one['final_eval'], four['final_eval'])
      ''', 4, tmp_path)
  assert f'OK {name}' in out, out


def test_checkpoint_on_four_devices_resumes_on_one(tmp_path):
  kw = dict(COMMON, algorithm='fedavg', num_rounds=3)
  out = _run_script(f'''
      kw = {kw!r}
      ref = run(pathlib.Path('ref'), num_devices=1, **kw)
      part = dict(kw, num_rounds=2)
      run(pathlib.Path('moved'), num_devices=4, **part)
      resumed = runner.run(config_lib.RunConfig(
          output_dir='moved', num_devices=1, **kw))
      assert resumed['communication'] == ref['communication']
      print('OK', compare('ref', 'moved', 'resume'))
      ''', 4, tmp_path)
  assert 'OK' in out, out


def test_two_processes_equal_one_process(tmp_path):
  """jax.distributed on localhost (gloo CPU collectives), 2 x 2 devices."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  flags = [f'--{k}={v}' for k, v in dict(COMMON, algorithm='fedavg').items()]
  env = dict(os.environ)
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      ' --xla_force_host_platform_device_count=2')
  env['JAX_PLATFORMS'] = 'cpu'
  binary = str(REPO / 'experiments' / 'run_experiment.py')
  procs = [
      subprocess.Popen(
          [sys.executable, binary, *flags, f'--output_dir={tmp_path / "multi"}',
           f'--coordinator_address=localhost:{port}', '--num_processes=2',
           f'--process_id={i}', '--distributed_timeout=120'],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  logs = [p.communicate(timeout=1500) for p in procs]
  for p, (o, e) in zip(procs, logs):
    assert p.returncode == 0, o[-2000:] + e[-6000:]
  out = _run_script(f'''
      kw = {dict(COMMON, algorithm='fedavg')!r}
      one = run(pathlib.Path('single'), num_devices=1, **kw)
      multi = json.loads(pathlib.Path({str(tmp_path / "multi")!r},
                                      'summary.json').read_text())
      assert multi['placement']['num_processes'] == 2, multi['placement']
      assert multi['placement']['num_devices'] == 4, multi['placement']
      assert multi['communication'] == one['communication']
      print('OK', compare('single', {str(tmp_path / "multi")!r}, 'multi'))
      ''', 1, tmp_path)
  assert 'OK' in out, out
