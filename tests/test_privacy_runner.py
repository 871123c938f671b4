"""DP-FedAvg through the runner's ``--dp_*`` flags, on tiny embedded_mnist.

Checks the acceptance of issue 32 at the runner: epsilon in metrics.jsonl
is dp_accounting's own (called here directly), calibration lands on the
target, clipped contributions have norm <= C, the loop and vmap engines
agree, a killed run resumes to the same epsilon / clip norm / loss, bad
values give one line each, and compressed uploads run end to end; and the
same inside the IGC static subspace (clip and noise on d coordinates).
"""

from __future__ import annotations

import json
import math

import dp_accounting
import jax
import numpy as np
import pytest

from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import outputs
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run
from fedlite_jax import transforms as tx
from fedlite_jax.training import compression_options
from fedlite_jax.training import tasks
from fedlite_jax.training.hooks import Hook

SMALL = dict(task='embedded_mnist', num_clients=12, clients_per_round=3,
             client_batch_size=32, progress=False, seed=3, num_rounds=3,
             eval_every=3, checkpoint_every=0)


def _rows(path):
  return outputs.read_metrics(path / 'metrics.jsonl')


def _dp_epsilon(z, q, rounds, delta, accountant='rdp'):
  """dp_accounting's own RDP (or PLD) epsilon of ``rounds`` Poisson-sampled
  Gaussian rounds (not through fedlite_jax.privacy)."""
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(z)), rounds)
  acc = (dp_accounting.rdp.RdpAccountant() if accountant == 'rdp' else
         dp_accounting.pld.PLDAccountant())
  return acc.compose(event).get_epsilon(delta)


def test_epsilon_is_dp_accountings_and_summary_states_it(tmp_path,
                                                       monkeypatch):
  resolved = []
  unmemoized = dp_options._resolve  # pylint: disable=protected-access

  def counting(config, num_train_clients, num_params):
    resolved.append(num_train_clients)
    return unmemoized(config, num_train_clients, num_params)

  monkeypatch.setattr(dp_options, '_resolve', counting)
  out = tmp_path / 'run'
  summary = run(RunConfig(output_dir=str(out), **SMALL, options=dict(
      dp_clip=0.5, dp_noise_multiplier=1.1, dp_noise_cohort_size=1000,
      dp_population=20000, dp_delta=1e-5)))
  # Resolved once for the run: the builder's Privacy is the hook's.
  assert resolved == [12]
  rows = _rows(out)
  assert [r['round'] for r in rows] == [1, 2, 3]
  for r in rows:
    want = _dp_epsilon(1.1, 1000 / 20000, r['round'], 1e-5)
    assert r['privacy/epsilon'] == pytest.approx(want, rel=1e-6)
    assert r['privacy/clip_norm'] == 0.5
    # The production cohort's noise on the trained cohort's sum.
    assert r['privacy/noise_std'] == pytest.approx(1.1 * 0.5 * 3 / 1000)
    assert 0 <= r['privacy/clipped_fraction'] <= 1
  p = summary['privacy']
  assert p['epsilon'] == rows[-1]['privacy/epsilon']
  assert p['sampling_probability'] == 0.05 and p['population'] == 20000
  assert p['noise_cohort_size'] == 1000 and p['denominator'] == 3
  assert 'trusted server' in p['assumptions']
  assert 'Poisson' in p['assumptions']
  # TensorBoard got the same tags.
  tb = list(out.rglob('events.out.tfevents*'))
  assert tb


def test_target_epsilon_calibration_and_8bit_uploads(tmp_path):
  out = tmp_path / 'run'
  summary = run(RunConfig(output_dir=str(out), **SMALL, options=dict(
      dp_clip=1.0, dp_target_epsilon=8.0, dp_noise_cohort_size=1000,
      dp_population=100000, upload='uniform_quantization:8')))
  z = summary['privacy']['noise_multiplier']
  got = _dp_epsilon(z, 0.01, 3, 1e-6)
  assert got == pytest.approx(8.0, rel=0.01)
  assert _rows(out)[-1]['privacy/epsilon'] == pytest.approx(got, rel=1e-6)
  assert math.isfinite(summary['final_eval']['loss'])
  # 8-bit uploads: a quarter of float32 (plus scale words).
  comm = summary['communication']
  assert comm['total_upload_bytes'] < 0.3 * comm['total_download_bytes']


def test_pld_accountant_reports_and_calibrates_with_pld(tmp_path):
  out = tmp_path / 'run'
  summary = run(RunConfig(output_dir=str(out), **SMALL, options=dict(
      dp_clip=1.0, dp_target_epsilon=4.0, dp_noise_cohort_size=1000,
      dp_population=100000, dp_accountant='pld')))
  p = summary['privacy']
  assert p['accountant'] == 'pld' and 'PLD' in p['assumptions']
  z = p['noise_multiplier']
  got = _dp_epsilon(z, 0.01, 3, 1e-6, 'pld')
  assert got == pytest.approx(4.0, rel=0.01)
  for r in _rows(out):
    assert r['privacy/epsilon'] == pytest.approx(
        _dp_epsilon(z, 0.01, r['round'], 1e-6, 'pld'), rel=1e-6)
  # PLD is the tighter bound: RDP charges the same z more.
  assert _dp_epsilon(z, 0.01, 3, 1e-6) > got


class ParamsDelta(Hook):
  """Records the L2 norm of each round's change of the server model."""

  def __init__(self):
    self.norms, self.before = [], None

  def round_start(self, run, round_num):
    self.before = jax.device_get(run.state.params)

  def round_end(self, run, row):
    after = jax.device_get(run.state.params)
    diff = jax.tree.leaves(jax.tree.map(
        lambda a, b: a.astype(np.float64) - b.astype(np.float64), after,
        self.before))
    self.norms.append(float(np.sqrt(sum(np.sum(np.square(d))
                                        for d in diff))))


def test_clipped_contribution_has_norm_at_most_c(tmp_path):
  """z = 0, one client per round, server SGD at rate 1: the server's step is
  the clipped contribution itself."""
  hook = ParamsDelta()
  c = 0.05
  run(RunConfig(output_dir=str(tmp_path / 'run'),
                **{**SMALL, 'clients_per_round': 1},
                server_optimizer='sgd', server_lr=1.0,
                options=dict(dp_clip=c, dp_noise_multiplier=0.0)),
      hooks=[hook])
  assert len(hook.norms) == 3
  for n in hook.norms:
    assert 0 < n <= c * (1 + 1e-6)
  rows = _rows(tmp_path / 'run')
  clipped = [r['privacy/clipped_fraction'] for r in rows]
  assert set(clipped) <= {0.0, 1.0} and 1.0 in clipped
  for n, was in zip(hook.norms, clipped):
    if was:  # Clipped: the step is C, up to float32 rounding of w + step.
      assert n == pytest.approx(c, rel=1e-5)
  assert all(r['privacy/epsilon'] == 'inf' or r['privacy/epsilon'] ==
             math.inf for r in rows)


class KillAt(Hook):

  def __init__(self, at):
    self.at = at

  def round_end(self, run, row):
    if row['round'] == self.at:
      raise RuntimeError('killed')


ADAPTIVE = dict(dp_clip=0.05, dp_noise_multiplier=0.5,
                dp_adaptive_quantile=0.5, dp_noise_cohort_size=20,
                dp_population=200)
KEYS = ('privacy/epsilon', 'privacy/clip_norm', 'privacy/noise_std',
        'train/loss')


def test_adaptive_clipping_engines_agree_and_resume_is_identical(tmp_path):
  # One convolution for both engines: im2col (a matmul), as the vmap engine's.
  cfg = dict(SMALL, num_rounds=4, eval_every=2, checkpoint_every=1,
             conv_implementation='im2col', options=ADAPTIVE)
  full = run(RunConfig(output_dir=str(tmp_path / 'loop'),
                       round_engine='loop', **cfg))
  rows = _rows(tmp_path / 'loop')
  clips = [r['privacy/clip_norm'] for r in rows]
  assert clips[0] == pytest.approx(0.05)
  assert len(set(clips)) == 4  # adaptive: C moves every round
  assert full['privacy']['adaptive_clipping']['learning_rate'] == 0.2
  # Noise of a production cohort of 20 on a cohort of 3: z_Delta*C*3/20.
  z_delta = full['privacy']['delta_noise_multiplier']
  assert z_delta > 0.5
  assert rows[0]['privacy/noise_std'] == pytest.approx(
      z_delta * 0.05 * 3 / 20, rel=1e-6)

  vmap = run(RunConfig(output_dir=str(tmp_path / 'vmap'),
                       round_engine='vmap', lanes_per_device=2,
                       segment_steps=1, **cfg))
  # The lanes sum in another float order than the loop, which the adaptive
  # clip norm carries into later rounds: train/loss at round 4 differed by
  # 1.6e-4 relative (lax convolutions in the vmap engine's scan: 2e-3).
  for a, b in zip(rows, _rows(tmp_path / 'vmap')):
    for k in KEYS:
      assert b[k] == pytest.approx(a[k], rel=5e-4), (a['round'], k)
  assert vmap['final_eval']['loss'] == pytest.approx(
      full['final_eval']['loss'], rel=5e-4)

  out = tmp_path / 'resumed'
  with pytest.raises(RuntimeError, match='killed'):
    run(RunConfig(output_dir=str(out), round_engine='loop', **cfg),
        hooks=[KillAt(3)])
  assert [r['round'] for r in _rows(out)] == [1, 2]
  resumed = run(RunConfig(output_dir=str(out), round_engine='loop', **cfg))
  again = _rows(out)
  assert [r['round'] for r in again] == [1, 2, 3, 4]
  for a, b in zip(rows, again):
    assert {k: b[k] for k in KEYS} == {k: a[k] for k in KEYS}
  assert resumed['final_eval'] == full['final_eval']
  assert resumed['privacy'] == full['privacy']


def _resolve(algorithm='fedavg', **options):
  task = tasks.get_task('embedded_mnist')
  return config_lib.resolve(RunConfig(
      task='embedded_mnist', num_clients=12, clients_per_round=3,
      num_rounds=3, algorithm=algorithm, options=options), task.defaults)


@pytest.mark.parametrize('options,expected', [
    (dict(dp_clip=0.0, dp_noise_multiplier=1.0), '--dp_clip=0.0: must be > 0'),
    (dict(dp_clip=-1.0, dp_noise_multiplier=1.0),
     '--dp_clip=-1.0: must be > 0'),
    (dict(dp_clip=1.0, dp_noise_multiplier=-0.5),
     '--dp_noise_multiplier=-0.5: must be >= 0'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_delta=0.0),
     '--dp_delta=0.0: must be in (0, 1)'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_delta=1.0),
     '--dp_delta=1.0: must be in (0, 1)'),
    (dict(dp_clip=1.0, dp_target_epsilon=-2.0),
     '--dp_target_epsilon=-2.0: must be > 0'),
    (dict(dp_clip=1.0), '--dp_clip needs --dp_noise_multiplier'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_target_epsilon=2.0),
     'exclude each other'),
    (dict(dp_noise_multiplier=1.0), '--dp_noise_multiplier needs --dp_clip'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_adaptive_quantile=1.5),
     '--dp_adaptive_quantile=1.5: must be in [0, 1]'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_adaptive_quantile=0.5),
     'count noise (cohort/20) is too small'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_population=2),
     '--dp_population=2: must be >= the cohort of the accounting (3)'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_noise_cohort_size=-1),
     '--dp_noise_cohort_size=-1: must be >= 1'),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, pvt_fraction=0.5),
     '--pvt_fraction < 1 with --dp_clip'),
])
def test_bad_values_one_config_error_line(options, expected):
  with pytest.raises(config_lib.ConfigError) as e:
    _resolve(**options)
  assert expected in str(e.value) and '\n' not in str(e.value)


def test_dp_flags_refused_by_algorithms_without_dp():
  with pytest.raises(config_lib.ConfigError) as e:
    _resolve('topk', dp_clip=1.0)
  assert str(e.value) == ('--dp_clip is an option of --algorithm=fedavg, '
                          'fedprox, igc_static, not of topk; remove it or '
                          'change --algorithm.')


def test_unreachable_target_epsilon_and_fingerprint_without_dp():
  config = _resolve(dp_clip=1.0, dp_target_epsilon=1e-9)
  with pytest.raises(config_lib.ConfigError) as e:
    dp_options.resolve(config, 12, 1000)
  assert str(e.value).startswith('--dp_target_epsilon=1e-09: ')
  assert 'unreachable' in str(e.value) and '\n' not in str(e.value)
  # Without DP flags the fingerprint names none of them (old checkpoints
  # keep their identity); with them it does.
  assert not set(_resolve().fingerprint()['options']) & dp_options.NAMES
  fp = config.fingerprint()['options']
  assert fp['dp_clip'] == 1.0 and fp['dp_target_epsilon'] == 1e-9
  assert json.dumps(fp)


# DP inside the IGC static subspace: d = 256 intrinsic coordinates.
IGC = dict(SMALL, algorithm='igc_static', server_optimizer='sgd',
           server_lr=1.0)


class SigmaSteps(Hook):
  """Records each round's step of the intrinsic coordinates (``sigma``,
  ``[1, d]``) and of the model (``float64[D]``)."""

  def __init__(self):
    self.sigma, self.params, self.before = [], [], None

  def _get(self, run):
    return (np.asarray(run.state.sigma, np.float64),
            np.asarray(tx.TreeSpec.of(run.state.params).ravel(
                run.state.params), np.float64))

  def round_start(self, run, round_num):
    self.before = self._get(run)

  def round_end(self, run, row):
    (s1, p1), (s0, p0) = self._get(run), self.before
    self.sigma.append(s1 - s0)
    self.params.append(p1 - p0)


def test_igc_subspace_step_is_the_clipped_d_vector(tmp_path):
  """z = 0, one client per round, server SGD at rate 1: the subspace step is
  the clipped d-vector (norm <= C) and the model moves by A times it, A the
  run's Fastfood matrix rebuilt here from the seed."""
  hook, c, d = SigmaSteps(), 0.05, 256
  run(RunConfig(output_dir=str(tmp_path / 'run'),
                **{**IGC, 'clients_per_round': 1}, options=dict(
                    intrinsic_dim=d, dp_clip=c, dp_noise_multiplier=0.0)),
      hooks=[hook])
  rows = _rows(tmp_path / 'run')
  assert 1.0 in [r['privacy/clipped_fraction'] for r in rows]
  D = hook.params[0].size
  A = tx.make_subspaces(D, d, 1, compression_options.derived_seed(
      -1, SMALL['seed'], b'igc'))
  for step, moved, r in zip(hook.sigma, hook.params, rows):
    assert step.shape == (1, d)
    n = np.linalg.norm(step)
    assert 0 < n <= c * (1 + 1e-6)
    if r['privacy/clipped_fraction']:
      assert n == pytest.approx(c, rel=1e-5)
    lifted = np.asarray(tx.lift_subspaces(A, step.astype(np.float32)))
    np.testing.assert_allclose(moved, lifted, atol=1e-6 + 1e-4 * np.abs(
        lifted).max())


def test_igc_noise_is_d_numbers_of_std_zc_over_denominator(tmp_path):
  """Two one-round runs differing only in z: the subspace steps differ by
  the noise over the denominator, d = 256 numbers of std z*C*W/M / W (a
  sample std of 256 normals is within 25% of its std with probability
  > 1 - 1e-6: relative sd 1/sqrt(512) = 4.4%, 5.6 sigma)."""
  c, z, w, m, d = 0.05, 2.0, 3, 6, 256
  steps = []
  for noise in (0.0, z):
    hook = SigmaSteps()
    run(RunConfig(output_dir=str(tmp_path / f'z{noise}'),
                  **{**IGC, 'num_rounds': 1, 'eval_every': 1},
                  options=dict(intrinsic_dim=d, dp_clip=c,
                               dp_noise_multiplier=noise,
                               dp_noise_cohort_size=m)), hooks=[hook])
    steps.append(hook.sigma[0])
  noise = (steps[1] - steps[0]).ravel()
  assert noise.size == d
  want = z * c * w / m / w
  assert _rows(tmp_path / f'z{z}')[0]['privacy/noise_std'] == pytest.approx(
      z * c * w / m)
  assert abs(noise.mean()) < 5 * want / np.sqrt(d)
  assert np.std(noise) == pytest.approx(want, rel=0.25)


def test_igc_dp_killed_run_resumes_identically(tmp_path):
  cfg = dict(IGC, num_rounds=3, eval_every=3, checkpoint_every=1,
             options=dict(ADAPTIVE, intrinsic_dim=256))
  full = run(RunConfig(output_dir=str(tmp_path / 'full'), **cfg))
  rows = _rows(tmp_path / 'full')
  assert len({r['privacy/clip_norm'] for r in rows}) == 3  # adaptive
  out = tmp_path / 'resumed'
  with pytest.raises(RuntimeError, match='killed'):
    run(RunConfig(output_dir=str(out), **cfg), hooks=[KillAt(2)])
  resumed = run(RunConfig(output_dir=str(out), **cfg))
  again = _rows(out)
  assert [r['round'] for r in again] == [1, 2, 3]
  for a, b in zip(rows, again):
    assert {k: b[k] for k in KEYS} == {k: a[k] for k in KEYS}
  assert resumed['final_eval'] == full['final_eval']
  assert resumed['privacy'] == full['privacy']


@pytest.mark.parametrize('algorithm,options,expected', [
    ('igc_k_subspace', {}, '--dp_clip is an option of --algorithm=fedavg, '
     'fedprox, igc_static, not of igc_k_subspace; remove it or change '
     '--algorithm.'),
    ('igc_time_varying', {}, 'not of igc_time_varying'),
    ('igc_static', dict(igc_project_on_server=True),
     '--igc_project_on_server with --dp_clip'),
])
def test_igc_unsupported_variants_refused_in_one_line(algorithm, options,
                                                      expected):
  with pytest.raises(config_lib.ConfigError) as e:
    _resolve(algorithm, dp_clip=1.0, dp_noise_multiplier=1.0, **options)
  assert expected in str(e.value) and '\n' not in str(e.value)


def test_dp_with_a_fastfood_upload_on_real_femnist(data_dir, tmp_path):
  """``--upload=intrinsic_projection:4096`` with DP on FEMNIST-105: the
  clip acts on the decoded D-vector; epsilon is dp_accounting's, the
  upload is 4,096 float32 per client and round."""
  out = tmp_path / 'run'
  summary = run(RunConfig(
      task='emnist', data_dir=str(data_dir), num_rounds=2,
      clients_per_round=10, client_batch_size=20, eval_every=2,
      eval_num_clients=5, checkpoint_every=0, progress=False,
      output_dir=str(out), options=dict(
          upload='intrinsic_projection:4096', dp_clip=0.5,
          dp_target_epsilon=8.0, dp_noise_cohort_size=100,
          dp_population=100000)))
  p, comm = summary['privacy'], summary['communication']
  assert p['epsilon'] == pytest.approx(
      _dp_epsilon(p['noise_multiplier'], 0.001, 2, 1e-6), rel=1e-6)
  assert p['epsilon'] == pytest.approx(8.0, rel=0.01)
  assert comm['total_upload_bytes'] == 2 * 10 * 4096 * 4
  assert math.isfinite(summary['final_eval']['loss'])
