"""Distributed DP under secure aggregation through the runner's flags
(``--dp_mechanism=ddgauss|skellam``, ``--dp_bits``, ``--dp_rounding_beta``),
on tiny embedded_mnist: upload bytes are ``B * padded_dim / 8`` per client
and round, summary.json holds what epsilon is recomputed from (here with
the papers' formulas through ``ddp_accounting``), zero noise at ``B = 32``
trains as central clipping does, bad values give one line each (also from
``--validate_only``), and a DP run SIGKILLed mid-way resumes to the same
privacy keys and loss.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fedlite_jax.privacy import ddp_accounting
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import outputs
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run
from fedlite_jax.training import tasks

SMALL = dict(task='embedded_mnist', num_clients=12, clients_per_round=3,
             client_batch_size=32, progress=False, seed=3, num_rounds=3,
             eval_every=3, checkpoint_every=0)
IGC = dict(intrinsic_dim=4096)


def _rows(path):
  return outputs.read_metrics(path / 'metrics.jsonl')


def _recomputed_epsilon(p):
  """Epsilon from summary.json's privacy section alone (the papers'
  formulas, ``ddp_accounting``)."""
  return ddp_accounting.distributed_epsilon(
      p['mechanism'], p['gamma'], p['local_noise_std'],
      int(p['clients_per_round']), p['clip_norm'], p['beta'],
      p['padded_dim'], p['sampling_probability'], p['rounds'],
      p['delta']).epsilon


@pytest.mark.parametrize('mechanism', ['ddgauss', 'skellam'])
def test_igc_static_uploads_b_times_d_bits_and_summary_recomputes(
    tmp_path, mechanism):
  out = tmp_path / 'run'
  summary = run(RunConfig(output_dir=str(out), **SMALL, algorithm='igc_static',
                          options=dict(
      **IGC, dp_clip=1.0, dp_noise_multiplier=0.05, dp_mechanism=mechanism,
      dp_bits=16)))
  p = summary['privacy']
  assert p['mechanism'] == mechanism and p['bits'] == 16
  assert p['padded_dim'] == 4096 and p['upload_bits_per_client'] == 65536
  comm = summary['communication']
  assert comm['total_upload_bytes'] == 16 * 4096 / 8 * comm['client_rounds']
  rows = _rows(out)
  assert [r['comm/upload_bytes'] for r in rows] == [3 * 16 * 4096 / 8] * 3
  assert p['epsilon'] == pytest.approx(_recomputed_epsilon(p), rel=1e-12)
  assert rows[-1]['privacy/epsilon'] == p['epsilon']
  for key in ('gamma', 'local_noise_std', 'central_noise_std', 'beta',
              'rounded_l2_sensitivity', 'rounded_l1_sensitivity', 'tau',
              'rdp_order', 'scaled_local_noise_std'):
    assert key in p and p[key] is not None, key
  assert 'train/loss' in p['not_covered_by_epsilon']
  assert p['central_noise_std'] == pytest.approx(0.05 * 1.0)
  assert p['local_noise_std'] == pytest.approx(0.05 / math.sqrt(3))
  wrapped = [r['privacy/wrapped_fraction'] for r in rows]
  assert all(0 <= w < 0.01 for w in wrapped)
  assert math.isfinite(summary['final_eval']['loss'])


def test_fedavg_full_model_upload_bytes(tmp_path):
  out = tmp_path / 'run'
  summary = run(RunConfig(output_dir=str(out), **{**SMALL, 'num_rounds': 1},
                          options=dict(dp_clip=1.0, dp_noise_multiplier=0.1,
                                       dp_mechanism='ddgauss', dp_bits=16)))
  d = summary['privacy']['padded_dim']
  assert d == 2 ** math.ceil(math.log2(summary['communication']['num_params']))
  assert summary['communication']['total_upload_bytes'] == 3 * 16 * d / 8


def test_zero_noise_32_bits_trains_as_central_clipping(tmp_path):
  def final_rows(**dp):
    out = tmp_path / dp.get('dp_mechanism', 'gaussian')
    run(RunConfig(output_dir=str(out), **SMALL, algorithm='igc_static',
                  options=dict(
        **IGC, dp_clip=0.5, dp_noise_multiplier=0.0, **dp)))
    return _rows(out)
  central = final_rows()
  secure = final_rows(dp_mechanism='ddgauss', dp_bits=32)
  for a, b in zip(central, secure):
    assert b['train/loss'] == pytest.approx(a['train/loss'], rel=1e-4)
  assert secure[-1]['eval/loss'] == pytest.approx(central[-1]['eval/loss'],
                                                  rel=1e-4)


def _resolve(algorithm='fedavg', **options):
  task = tasks.get_task('embedded_mnist')
  return config_lib.resolve(RunConfig(
      task='embedded_mnist', num_clients=12, clients_per_round=3,
      num_rounds=3, algorithm=algorithm, options=options), task.defaults)


DDG = dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_mechanism='ddgauss')


@pytest.mark.parametrize('options,expected', [
    (dict(DDG, dp_bits=1), '--dp_bits=1: must be >= 2'),
    (dict(DDG, dp_bits=33), '--dp_bits=33: must be <= 32'),
    (dict(DDG, dp_bits=2), '--dp_bits=2 is too small for 3 clients per round '
     'at k=4 standard deviations: need --dp_bits >= 3.'),
    (dict(DDG, dp_rounding_beta=1.0), '--dp_rounding_beta=1.0: must be in '
     '[0, 1).'),
    (dict(DDG, dp_rounding_beta=-0.1), '--dp_rounding_beta=-0.1: must be >= '
     '0.0'),
    (dict(DDG, upload='uniform_quantization:8'),
     '--upload=uniform_quantization:8 with --dp_mechanism=ddgauss: secure '
     "aggregation sums the clients' own 16-bit integers"),
    (dict(DDG, upload='top_k:100'), 'and top-k is not linear'),
    (dict(DDG, dp_adaptive_quantile=0.5), 'adaptive clipping under secure '
     'aggregation is not supported'),
    (dict(DDG, dp_noise_cohort_size=100), '--dp_noise_cohort_size with '
     '--dp_mechanism=ddgauss'),
    (dict(DDG, dp_accountant='pld'), '--dp_accountant=pld with '
     '--dp_mechanism=ddgauss'),
    (dict(DDG, nonfinite_updates='skip'), '--nonfinite_updates=skip with'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_bits=16), '--dp_bits '
     'applies to --dp_mechanism=ddgauss or skellam only'),
    (dict(DDG, dp_mechanism='laplace'), '--dp_mechanism'),
])
def test_bad_values_one_config_error_line(options, expected):
  with pytest.raises(config_lib.ConfigError) as e:
    _resolve(**options)
  assert expected in str(e.value) and '\n' not in str(e.value)


def test_a_noise_cohort_below_the_trained_one_is_accounted_at_the_trained():
  config = _resolve(dp_clip=1.0, dp_noise_multiplier=1.0,
                    dp_noise_cohort_size=2, dp_population=100)
  p = dp_options.resolve(config, 12, 1000)
  assert p.sampling_probability == 3 / 100  # max(m = 3, M = 2) / N.
  bigger = dp_options.resolve(_resolve(
      dp_clip=1.0, dp_noise_multiplier=1.0, dp_noise_cohort_size=7,
      dp_population=100), 12, 1000)
  assert bigger.sampling_probability == 7 / 100


def test_pvt_is_allowed_with_a_distributed_mechanism():
  _resolve(**DDG, pvt_fraction=0.5)
  with pytest.raises(config_lib.ConfigError):
    _resolve(dp_clip=1.0, dp_noise_multiplier=1.0, pvt_fraction=0.5)


def _binary(repo_root, *flags, env=None, timeout=300):
  return subprocess.run(
      [sys.executable, str(repo_root / 'experiments' / 'run_experiment.py'),
       *flags], capture_output=True, text=True, timeout=timeout,
      env=dict(os.environ, PYTHONPATH=str(repo_root), **(env or {})))


def test_validate_only_refuses_in_one_line(repo_root, tmp_path):
  proc = _binary(repo_root, '--dp_clip=1', '--dp_noise_multiplier=1',
                 '--dp_mechanism=skellam', '--dp_bits=2',
                 '--clients_per_round=10', '--validate_only',
                 f'--output_dir={tmp_path / "v"}')
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [l for l in proc.stderr.splitlines() if 'dp_bits' in l]
  assert len(lines) == 1 and 'need --dp_bits >= 4' in lines[0], proc.stderr


# SIGKILL after the n-th metrics line (the checkpoints so far complete).
_DRIVER = textwrap.dedent('''
    import os, runpy, signal, sys
    import orbax.checkpoint as ocp
    from fedlite_jax.training.hooks import metrics_file
    n, managers, count = int(os.environ['KILL_AFTER_ROW']), [], [0]
    real_init = ocp.CheckpointManager.__init__
    def init(self, *args, **kwargs):
      managers.append(self)
      real_init(self, *args, **kwargs)
    ocp.CheckpointManager.__init__ = init
    real_write = metrics_file.MetricsFileHook.round_end
    def write(self, run, row):
      real_write(self, run, row)
      count[0] += 1
      if count[0] == n:
        for manager in managers:
          manager.wait_until_finished()
        os.kill(os.getpid(), signal.SIGKILL)
    metrics_file.MetricsFileHook.round_end = write
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name='__main__')
''')


def test_sigkilled_dp_run_resumes_to_the_same_privacy_and_loss(
    repo_root, tmp_path):
  flags = ['--algorithm=igc_static', '--intrinsic_dim=4096',
           '--num_clients=12', '--clients_per_round=3', '--seed=3',
           '--num_rounds=4', '--eval_every=2', '--checkpoint_every=2',
           '--dp_clip=1.0', '--dp_noise_multiplier=0.05',
           '--dp_mechanism=ddgauss', '--dp_bits=16', '--noprogress']
  reference = tmp_path / 'ref'
  run(RunConfig(
      output_dir=str(reference), progress=False, algorithm='igc_static',
      num_clients=12, clients_per_round=3, seed=3, num_rounds=4,
      eval_every=2, checkpoint_every=2, options=dict(
          intrinsic_dim=4096, dp_clip=1.0, dp_noise_multiplier=0.05,
          dp_mechanism='ddgauss', dp_bits=16)))
  driver = tmp_path / 'driver.py'
  driver.write_text(_DRIVER)
  out = tmp_path / 'killed'
  killed = subprocess.run(
      [sys.executable, str(driver),
       str(repo_root / 'experiments' / 'run_experiment.py'), *flags,
       f'--output_dir={out}'], capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=str(repo_root), KILL_AFTER_ROW='3'))
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert len(_rows(out)) == 3  # Rounds 1-3; the checkpoint after round 2.
  again = _binary(repo_root, *flags, f'--output_dir={out}')
  assert again.returncode == 0, again.stderr[-2000:]
  assert 'Continuing from round 2' in again.stderr + again.stdout
  got, want = _rows(out), _rows(reference)
  assert len(got) == len(want) == 4
  for a, b in zip(want, got):
    keys = [k for k in a if k.startswith('privacy/') or k.endswith('loss')]
    assert keys and {k: b[k] for k in keys} == {k: a[k] for k in keys}
  s_ref = json.loads((reference / 'summary.json').read_text())
  s_got = json.loads((out / 'summary.json').read_text())
  assert s_got['privacy'] == s_ref['privacy']
  assert s_got['final_eval'] == s_ref['final_eval']

