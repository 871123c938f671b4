"""fedlite_jax.privacy: DP-FedAvg aggregation, adaptive clipping, accounting
and the clip-order rule, each against an independent expectation."""

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax import privacy
from fedlite_jax.privacy import accounting
from fedlite_jax.privacy import aggregation


def _one_line(excinfo):
  assert '\n' not in str(excinfo.value)


# --- accounting ---------------------------------------------------------------

@pytest.mark.parametrize('name,acc', [
    ('rdp', dp_accounting.rdp.RdpAccountant),
    ('pld', dp_accounting.pld.PLDAccountant)])
def test_epsilon_equals_dp_accounting_on_the_same_event(name, acc):
  z, q, rounds, delta = 1.1, 0.02, 50, 1e-5
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
      rounds)
  want = acc().compose(event).get_epsilon(delta)
  got = privacy.epsilon(z, q, rounds, delta, accountant=name)
  assert got == pytest.approx(want, rel=1e-6)


def test_production_cohort_accounts_at_its_sampling_probability():
  q = privacy.sampling_probability(1000, 100_000)
  assert q == 0.01
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          0.01, dp_accounting.GaussianDpEvent(0.8)), 100)
  want = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-6)
  assert privacy.epsilon(0.8, q, 100, 1e-6) == pytest.approx(want, rel=1e-6)


def test_adaptive_clipping_event_is_the_combined_gaussian():
  z, sigma_b = 1.0, 5.0
  z_delta = privacy.effective_delta_noise_multiplier(z, sigma_b)
  assert z_delta == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5)
  assert z_delta > z
  event = privacy.adaptive_clipping_event(z_delta, sigma_b, 0.05, 20)
  composed = event.event.event
  assert composed.noise_multiplier == pytest.approx(z, rel=1e-12)
  # The combined Gaussian equals the composition of its two parts
  # (unsampled; dp_accounting composes the Gaussians itself).
  parts = dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(z_delta),
      dp_accounting.GaussianDpEvent(2 * sigma_b)])
  want = dp_accounting.rdp.RdpAccountant().compose(parts).get_epsilon(1e-5)
  got = dp_accounting.rdp.RdpAccountant().compose(
      dp_accounting.GaussianDpEvent(z)).get_epsilon(1e-5)
  assert got == pytest.approx(want, rel=1e-6)
  # Sampled and composed over rounds: the same epsilon as DP-FedAvg at z.
  assert privacy.event_epsilon(event, 1e-5) == pytest.approx(
      privacy.epsilon(z, 0.05, 20, 1e-5), rel=1e-9)
  with pytest.raises(ValueError, match='delta') as e:
    privacy.event_epsilon(event, 2.0)
  _one_line(e)


@pytest.mark.parametrize('target', [1.0, 4.0])
def test_calibration_lands_within_one_percent(target):
  q, rounds, delta = 0.01, 200, 1e-5
  z = privacy.calibrate_noise_multiplier(target, delta, q, rounds)
  eps = privacy.epsilon(z, q, rounds, delta)
  assert eps <= target * 1.000001
  assert eps == pytest.approx(target, rel=0.01)


def test_accounting_bad_inputs_are_one_line():
  cases = [
      (lambda: privacy.epsilon(1.0, 0.1, 10, 0.0), 'delta'),
      (lambda: privacy.epsilon(1.0, 0.1, 10, 1.0), 'delta'),
      (lambda: privacy.epsilon(-1.0, 0.1, 10, 1e-5), 'noise_multiplier'),
      (lambda: privacy.epsilon(1.0, 1.5, 10, 1e-5), 'sampling'),
      (lambda: privacy.epsilon(1.0, 0.1, 10, 1e-5, 'moments'), 'accountant'),
      (lambda: privacy.calibrate_noise_multiplier(0.0, 1e-5, 0.1, 10),
       'target_epsilon'),
      (lambda: privacy.calibrate_noise_multiplier(
          1e-3, 1e-5, 1.0, 10_000, max_noise_multiplier=5.0), 'unreachable'),
      (lambda: privacy.sampling_probability(10, 5), 'population'),
      (lambda: privacy.effective_delta_noise_multiplier(2.0, 1.0),
       'too small'),
  ]
  for fn, word in cases:
    with pytest.raises(ValueError, match=word) as e:
      fn()
    _one_line(e)


# --- clipping and noise --------------------------------------------------------

def _tree(key, m):
  k1, k2 = jax.random.split(key)
  return {'w': 3.0 * jax.random.normal(k1, (m, 4, 5)),
          'b': jax.random.normal(k2, (m, 7))}


def test_clipped_norms_are_at_most_c_and_small_ones_pass_unchanged():
  c = 2.5
  tree = _tree(jax.random.PRNGKey(0), 64)
  clipped, norms = jax.jit(jax.vmap(
      lambda t: privacy.clip_by_global_norm(t, c)))(tree)
  flat = np.concatenate([np.asarray(x).reshape(64, -1)
                         for x in jax.tree.leaves(tree)], axis=1)
  np.testing.assert_allclose(norms, np.linalg.norm(flat, axis=1), rtol=1e-5)
  new = np.concatenate([np.asarray(x).reshape(64, -1)
                        for x in jax.tree.leaves(clipped)], axis=1)
  assert np.all(np.linalg.norm(new, axis=1) <= c * (1 + 1e-6))
  small = jax.tree.map(lambda x: x[0] * (1.0 / float(norms[0])), tree)
  out, _ = privacy.clip_by_global_norm(small, c)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(small)):
    np.testing.assert_array_equal(a, b)


def test_noised_sum_of_zeros_has_mean_zero_and_std_zc():
  c, z, m, draws = 1.5, 0.7, 8, 2000
  zeros = {'w': jnp.zeros((m, 3)), 'b': jnp.zeros((m,))}
  keys = jax.random.split(jax.random.PRNGKey(1), draws)
  agg = jax.jit(jax.vmap(lambda k: privacy.dp_fedavg_aggregate(
      zeros, k, c, z, denominator=1.0)))(keys)
  samples = np.concatenate([np.asarray(agg.mean['w']).ravel(),
                            np.asarray(agg.mean['b']).ravel()])
  n = samples.size  # 8,000 independent N(0, (zC)^2) values
  sigma = z * c
  assert abs(samples.mean()) < 5 * sigma / math.sqrt(n)
  # Std error of the sample std ~ sigma / sqrt(2n).
  assert abs(samples.std() - sigma) < 5 * sigma / math.sqrt(2 * n)


def test_denominator_and_production_cohort_scale_the_noise():
  c, z = 2.0, 1.0
  assert privacy.noise_std_on_sum(c, z, 10) == pytest.approx(z * c)
  # Trained cohort m = 10 (the denominator), noise for 1,000 clients: the
  # std on the sum is z*C*m/n and on the mean z*C/n.
  assert privacy.noise_std_on_sum(c, z, 10, 1000) == pytest.approx(
      z * c * 10 / 1000)
  ones = {'x': jnp.ones((10, 4))}
  draws = jax.vmap(lambda k: privacy.dp_fedavg_aggregate(
      ones, k, c, z, noise_cohort_size=1000).mean['x'])(
          jax.random.split(jax.random.PRNGKey(2), 500))
  # ||ones row|| = 2 = C: unclipped, so the mean is 1 + N(0, (zC/n)^2).
  samples = np.asarray(draws).ravel()
  sigma = z * c / 1000
  assert abs(samples.mean() - 1.0) < 5 * sigma / math.sqrt(samples.size)
  assert abs(samples.std() - sigma) < 5 * sigma / math.sqrt(2 * samples.size)


def test_aggregate_is_the_clipped_mean_without_noise_and_masks_padding():
  c = 1.0
  tree = _tree(jax.random.PRNGKey(3), 6)
  mask = jnp.array([1, 1, 1, 1, 0, 0], jnp.float32)
  agg = privacy.dp_fedavg_aggregate(tree, jax.random.PRNGKey(0), c, 0.0,
                                    denominator=5.0, mask=mask)
  for name in tree:
    x = np.asarray(tree[name]).reshape(6, -1)
    flat = np.concatenate([np.asarray(v).reshape(6, -1)
                           for v in jax.tree.leaves(tree)], axis=1)
    scale = np.minimum(1.0, c / np.linalg.norm(flat, axis=1))
    want = (x * scale[:, None] * np.asarray(mask)[:, None]).sum(0) / 5.0
    np.testing.assert_allclose(np.asarray(agg.mean[name]).ravel(), want,
                               rtol=1e-5, atol=1e-7)


def test_clip_and_noise_bad_inputs_are_one_line():
  x = {'a': jnp.ones((2, 3))}
  key = jax.random.PRNGKey(0)
  for fn, word in [
      (lambda: privacy.clip_by_global_norm(x, 0.0), 'clip_norm'),
      (lambda: privacy.clip_by_global_norm(x, -1.0), 'clip_norm'),
      (lambda: privacy.dp_fedavg_aggregate(x, key, 1.0, -0.5),
       'noise_multiplier'),
      (lambda: privacy.dp_fedavg_aggregate(x, key, 0.0, 1.0), 'clip_norm'),
      (lambda: privacy.noise_std_on_sum(1.0, 1.0, 0.0), 'denominator'),
      (lambda: privacy.adaptive_clip_update(1.0, jnp.ones(3), key, 1.5, 0.2,
                                            0.0, 3.0), 'target_quantile'),
  ]:
    with pytest.raises(ValueError, match=word) as e:
      fn()
    _one_line(e)


# --- adaptive clipping ----------------------------------------------------------

@pytest.mark.parametrize('count_noise_std', [0.0, 5.0])
def test_adaptive_clip_moves_to_the_known_quantile(count_noise_std):
  # Norms ~ Exponential(1): the gamma-quantile is -log(1 - gamma).
  gamma, eta, m, rounds = 0.5, 0.2, 500, 150
  target = -math.log(1 - gamma)

  def one_round(c, key):
    k_norms, k_noise = jax.random.split(key)
    norms = jax.random.exponential(k_norms, (m,))
    out = privacy.adaptive_clip_update(c, norms, k_noise, gamma, eta,
                                       count_noise_std, float(m))
    return out.clip_norm, out.clip_norm

  keys = jax.random.split(jax.random.PRNGKey(4), rounds)
  start = 0.05
  _, path = jax.jit(lambda k: jax.lax.scan(one_round, jnp.float32(start),
                                           k))(keys)
  path = np.asarray(path)
  # Geometric steps: from 0.05 it needs ~log(0.69/0.05)/(0.2*0.5) ~ 27 rounds.
  assert abs(path[10] - target) < abs(start - target)
  final = path[-50:].mean()
  assert final == pytest.approx(target, rel=0.1)
  # From above as well.
  _, down = jax.jit(lambda k: jax.lax.scan(one_round, jnp.float32(20.0),
                                           k))(keys)
  assert np.asarray(down)[-50:].mean() == pytest.approx(target, rel=0.1)


def test_unclipped_fraction_is_clamped_to_the_unit_interval():
  # Noise-free, 4 unclipped clients over a denominator of 1: the raw
  # fraction is 4 * 0.5 / 1 + 0.5 = 2.5, clamped to 1 (as TF Privacy).
  norms = jnp.array([0.1, 0.2, 0.3, 0.4])
  c, gamma, eta = 1.0, 0.3, 0.2
  out = privacy.adaptive_clip_update(c, norms, jax.random.PRNGKey(0), gamma,
                                     eta, 0.0, 1.0)
  assert float(out.unclipped_fraction) == 1.0
  assert float(out.clip_norm) == pytest.approx(
      c * math.exp(-eta * (1.0 - gamma)), rel=1e-6)
  # All clipped: -2 / 1 + 0.5 = -1.5, clamped to 0.
  out = privacy.adaptive_clip_update(c, 10 * norms + 2, jax.random.PRNGKey(0),
                                     gamma, eta, 0.0, 1.0)
  assert float(out.unclipped_fraction) == 0.0
  assert float(out.clip_norm) == pytest.approx(c * math.exp(eta * gamma),
                                               rel=1e-6)
  # Huge count noise: every draw in [0, 1], both ends reached.
  b = jax.vmap(lambda k: privacy.noised_unclipped_fraction(
      norms, k, c, 100.0, 4.0))(jax.random.split(jax.random.PRNGKey(1), 200))
  b = np.asarray(b)
  assert b.min() == 0.0 and b.max() == 1.0
  assert np.all((b >= 0) & (b <= 1))


def test_dp_noised_mean_scales_both_noises_for_a_noise_cohort():
  """The server step both DP-FedAvg entry points run: sum noise
  z_Delta*C*W/M and count noise sigma_b*W/M, drawn from split(key)."""
  s = privacy.DPSettings(clip_norm=1.0, noise_multiplier=1.0, denominator=4.0,
                         noise_cohort_size=40.0, target_quantile=0.5,
                         clip_learning_rate=0.2, count_noise_std=2.0)
  assert s.count_noise_std_on_sum == pytest.approx(0.2)
  z_delta = privacy.effective_delta_noise_multiplier(1.0, 2.0)
  assert s.noise_std(1.0) == pytest.approx(z_delta * 4 / 40)
  total = {'w': jnp.arange(3.0)}
  norms = jnp.array([0.5, 0.5, 2.0, 2.0])
  key = jax.random.PRNGKey(3)
  out = jax.jit(privacy.dp_noised_mean, static_argnums=0)(
      s, total, key, jnp.float32(1.0), norms)
  k_sum, k_count = jax.random.split(key)
  want = (total['w'] + privacy.gaussian_noise_like(
      total, k_sum, s.noise_std(1.0))['w']) / 4.0
  np.testing.assert_allclose(out.mean['w'], want, rtol=1e-6)
  b_bar = 0.5 + 0.2 * float(jax.random.normal(k_count, ())) / 4.0
  assert float(out.unclipped_fraction) == pytest.approx(b_bar, rel=1e-6)
  assert float(out.clip_norm) == pytest.approx(
      math.exp(-0.2 * (b_bar - 0.5)), rel=1e-6)
  fixed = dataclasses.replace(s, target_quantile=None)
  out = privacy.dp_noised_mean(fixed, total, key, 1.0)
  assert float(out.clip_norm) == 1.0 and out.unclipped_fraction is None
  with pytest.raises(ValueError, match='norms') as e:
    privacy.dp_noised_mean(s, total, key, 1.0)
  _one_line(e)
  for bad, word in [(dict(target_quantile=1.5), 'target_quantile'),
                    (dict(clip_learning_rate=-1.0), 'learning_rate'),
                    (dict(count_noise_std=0.4), 'too small'),
                    (dict(noise_cohort_size=0.0), 'noise_cohort_size'),
                    (dict(clip_norm=0.0), 'clip_norm')]:
    with pytest.raises(ValueError, match=word) as e:
      dataclasses.replace(s, **bad).check()
    _one_line(e)


def test_noise_free_unclipped_fraction_is_the_exact_fraction():
  norms = jnp.array([0.5, 1.0, 1.5, 2.0])
  b = privacy.noised_unclipped_fraction(norms, jax.random.PRNGKey(0), 1.0,
                                        0.0, 4.0)
  assert float(b) == pytest.approx(0.5)


# --- the clip-order rule ----------------------------------------------------------

@pytest.mark.parametrize('stages,name', [
    ('uniform_quantization:8', 'uniform_quantization'),
    ('top_k:10,terngrad', 'terngrad'),
    ('count_sketch:3:100', 'count_sketch'),
    (['intrinsic_projection:64', 'top_k:5'], 'intrinsic_projection'),
])
def test_clip_before_a_norm_growing_encode_is_refused(stages, name):
  with pytest.raises(ValueError, match=f"'{name}' can grow") as e:
    privacy.clip_sensitivity(stages, 1.0, clip='before_encode')
  _one_line(e)


def test_valid_orders_state_the_bound_and_noise_size():
  s = privacy.clip_sensitivity('top_k:10', 2.0, clip='before_encode')
  assert s.bound == 2.0 and s.clip == 'before_encode'
  s = privacy.clip_sensitivity('uniform_quantization:4', 2.0)
  assert s.bound == 2.0 and s.clip == 'decoded' and s.noise_size is None
  # Static IGC subspace: the server sums d-vectors, so d noise draws.
  d = 64
  s = privacy.clip_sensitivity('intrinsic_projection:64,uniform_quantization:8',
                               1.0, aggregated=jax.ShapeDtypeStruct(
                                   (d,), jnp.float32))
  assert s.noise_size == d
  with pytest.raises(ValueError, match='clip must be one of') as e:
    privacy.clip_sensitivity('', 1.0, clip='after')
  _one_line(e)


def test_clip_after_decode_bounds_a_quantized_contribution():
  # The default order: encode/decode with a real quantizer, then clip in the
  # aggregation space; the sensitivity C holds for the decoded tree.
  from fedlite_jax import transforms
  t = transforms.parse_chain('uniform_quantization:2')
  x = {'w': jax.random.normal(jax.random.PRNGKey(5), (200,))}
  x, _ = privacy.clip_by_global_norm(x, 1.0)
  state = t.init(x)
  message, _ = t.encode(x, state, jax.random.PRNGKey(6))
  decoded, _ = t.decode(message, state)
  assert float(privacy.global_norm(decoded)) > 1.0  # the encode grew it
  clipped, _ = privacy.clip_by_global_norm(decoded, 1.0)
  assert float(privacy.global_norm(clipped)) <= 1.0 * (1 + 1e-6)


def test_module_functions_are_reexported():
  assert privacy.epsilon is accounting.epsilon
  assert privacy.dp_fedavg_aggregate is aggregation.dp_fedavg_aggregate


def test_static_igc_subspace_clips_and_noises_the_d_vectors():
  # Static IGC: the server sums the d-dimensional messages, then lifts once.
  from fedlite_jax import transforms
  d, m, c, z = 16, 5, 0.5, 1.0
  t = transforms.intrinsic_projection(d)
  updates = {'w': jax.random.normal(jax.random.PRNGKey(7), (m, 10, 10))}
  state = t.init(jax.tree.map(lambda x: x[0], updates))
  messages = jax.vmap(lambda u: t.encode(u, state, jax.random.PRNGKey(0))[0]
                      )(updates)
  assert messages.values.shape == (m, d)
  s = privacy.clip_sensitivity('intrinsic_projection:16', c,
                               aggregated=messages.values[0])
  assert s.noise_size == d
  agg = privacy.dp_fedavg_aggregate(messages.values, jax.random.PRNGKey(1),
                                    c, z)
  assert agg.mean.shape == (d,)
  # The noise is z*C per coordinate of the sum, z*C/m on the mean: d draws,
  # not D = 100. Over 2,000 keys (32,000 coordinates) the sample std has a
  # relative sd of 1/sqrt(64,000) = 0.4%, so 5% is > 12 sd.
  keys = jax.random.split(jax.random.PRNGKey(1), 2000)
  noised = jax.jit(jax.vmap(lambda k: privacy.dp_fedavg_aggregate(
      messages.values, k, c, z).mean))(keys)
  noise_free = privacy.dp_fedavg_aggregate(messages.values,
                                           jax.random.PRNGKey(1), c, 0.0)
  diff = np.asarray(noised - noise_free.mean[None])
  assert diff.shape == (2000, d)
  assert abs(diff.mean()) < 5 * (z * c / m) / math.sqrt(diff.size)
  assert diff.std() == pytest.approx(z * c / m, rel=0.05)
  one = jax.tree.map(lambda x: x[0], messages)
  lifted, _ = t.decode(dataclasses.replace(one, values=agg.mean), state)
  assert lifted['w'].shape == (10, 10)


def test_a_jitted_adaptive_dp_round_takes_a_traced_clip_norm():
  gamma, eta, z, sigma_b, m = 0.5, 0.2, 1.0, 2.0, 32
  z_delta = privacy.effective_delta_noise_multiplier(z, sigma_b)

  @jax.jit
  def round_(c, key, deltas):
    k_noise, k_count = jax.random.split(key)
    agg = privacy.dp_fedavg_aggregate(deltas, k_noise, c, z_delta)
    new = privacy.adaptive_clip_update(c, agg.norms, k_count, gamma, eta,
                                       sigma_b, float(m))
    return agg.mean, new.clip_norm

  deltas = {'w': jax.random.normal(jax.random.PRNGKey(8), (m, 6))}
  mean, c1 = round_(jnp.float32(0.1), jax.random.PRNGKey(9), deltas)
  assert mean['w'].shape == (6,)
  assert float(c1) > 0.1  # every norm ~ sqrt(6) > 0.1: C grows


def test_epsilon_keeps_dp_accountings_order_warnings_out_of_the_log(caplog):
  """At small z the RDP accountant drops orders that do not converge, with
  a warning each; the epsilon is the same, the log quiet."""
  import logging  # pylint: disable=g-import-not-at-top
  event = accounting.dp_fedavg_event(0.3, 0.95, 2)
  with caplog.at_level(logging.WARNING):
    direct = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(
        1e-6)
  assert any('failed to converge' in r.getMessage() for r in caplog.records)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    ours = accounting.epsilon(0.3, 0.95, 2, 1e-6)
  assert ours == direct
  assert not any('failed to converge' in r.getMessage()
                 for r in caplog.records)
