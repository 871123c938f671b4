"""experiments/gradient_inversion.py: DLG against full and compressed updates.

Independent expectations:
* a single-example gradient of a linear softmax layer determines the input
  exactly (``dW = x (p - y)^T``, ``db = p - y``, so ``x = dW[:, c] / db[c]``):
  the attack must reach it from the full gradient;
* ``A^T`` (d x D) with d >= D is injective, so ``A^T g`` determines ``g``
  and the attack recovers the input from it too;
* with d much smaller than the input dimension, ``A^T g`` is d equations for
  more unknowns: the attack matches the observation yet lands elsewhere;
* iDLG: ``softmax - onehot`` is negative only at the true class;
* DP-FedAvg's release (``clipped_noised_observation``): norm exactly C when
  clipped (unchanged below C), noise std z C within 5 sampling sd; clipping
  with a public C alone hides nothing, noise of norm ~ sqrt(D) z C >> C does;
  the stored DP rows reconstruct every image worse than the clean gradient;
* MSE / PSNR against hand-computed values.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from fedlite_jax.transforms import fastfood as ff

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent /
                       'experiments'))
# The attack lives beside its experiment (experiments/igc_privacy.py).
import gradient_inversion as privacy  # noqa: E402  pylint: disable=g-import-not-at-top

IN = 8
HIDDEN = 6
CLASSES = 4


def _linear_model(key):
  kw, kb = jax.random.split(key)
  params = {'w': jax.random.normal(kw, (IN, CLASSES)),
            'b': 0.1 * jax.random.normal(kb, (CLASSES,))}
  return params, lambda p, x: x @ p['w'] + p['b']


def _sigmoid_mlp(key):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  params = {'w1': jax.random.normal(k1, (IN, HIDDEN)),
            'b1': 0.5 * jax.random.normal(k2, (HIDDEN,)),
            'w2': jax.random.normal(k3, (HIDDEN, CLASSES)),
            'b2': 0.5 * jax.random.normal(k4, (CLASSES,))}

  def apply(p, x):
    h = jax.nn.sigmoid(x @ p['w1'] + p['b1'])
    return h @ p['w2'] + p['b2']

  return params, apply


def _true_example(seed=3):
  x = jax.random.uniform(jax.random.key(seed), (1, IN))
  y = jnp.array([2], jnp.int32)
  return x, y


def _attack(observe, x, y, steps=60, **kw):
  target = observe(x, jax.nn.one_hot(y, CLASSES))
  return privacy.gradient_inversion(
      observe, target, jax.random.key(11), x.shape, label=y,
      num_classes=CLASSES, num_steps=steps, **kw)


def test_mse_psnr_hand_values():
  ref = jnp.zeros((2, 3))
  x = ref + 0.1
  np.testing.assert_allclose(privacy.mse(x, ref), 0.01, rtol=1e-5)
  np.testing.assert_allclose(privacy.psnr(x, ref), 20.0, rtol=1e-5)
  np.testing.assert_allclose(privacy.psnr(x, ref, data_range=2.0),
                             20.0 + 20 * np.log10(2.0), rtol=1e-5)
  assert np.isinf(privacy.psnr(ref, ref))
  with pytest.raises(ValueError):
    privacy.mse(jnp.zeros(3), jnp.zeros(4))


def test_total_variation_hand_value():
  x = jnp.zeros((1, 2, 3, 1)).at[0, :, 1, 0].set(1.0)  # one vertical line
  # dx: |0-1|, |1-0| per row -> mean over 2*2 entries = 1; dy: all 0.
  np.testing.assert_allclose(privacy.total_variation(x), 1.0)


def test_infer_label_idlg_bias_and_kernel():
  params, apply = _linear_model(jax.random.key(0))
  observe = jax.jit(privacy.gradient_observation(apply, params))
  _, unravel = ravel_pytree(params)
  for c in range(CLASSES):
    x = jax.random.uniform(jax.random.key(c), (1, IN))  # x >= 0
    g = unravel(observe(x, jax.nn.one_hot(jnp.array([c]), CLASSES)))
    assert int(privacy.infer_label(g['b'])) == c
    assert int(privacy.infer_label(g['w'])) == c


def test_matching_loss_relative():
  t = {'a': jnp.array([3.0, 4.0])}
  np.testing.assert_allclose(
      privacy.matching_loss({'a': jnp.array([0.0, 4.0])}, t), 9.0 / 25.0)
  np.testing.assert_allclose(privacy.matching_loss(t, t), 0.0)


def test_full_gradient_linear_model_recovers_input_exactly():
  params, apply = _linear_model(jax.random.key(0))
  x, y = _true_example()
  # Independent check of the premise: x = dW[:, y] / db[y].
  observe = privacy.gradient_observation(apply, params)
  _, unravel = ravel_pytree(params)
  g = unravel(observe(x, jax.nn.one_hot(y, CLASSES)))
  np.testing.assert_allclose(g['w'][:, 2] / g['b'][2], x[0], rtol=1e-4)
  res = _attack(observe, x, y)
  assert res.x.shape == x.shape
  assert res.losses.shape == (60,)
  assert float(res.best_loss) < 1e-8
  assert float(privacy.mse(res.x, x)) < 1e-6


def _sigmoid_setup():
  params, apply = _sigmoid_mlp(jax.random.key(1))
  D = ravel_pytree(params)[0].shape[0]  # 8*6 + 6 + 6*4 + 4 = 82.
  return params, apply, D


def test_full_and_wide_projection_recover_sigmoid_mlp_input():
  params, apply, D = _sigmoid_setup()
  assert D == 82
  x, y = _true_example()
  full = _attack(privacy.gradient_observation(apply, params), x, y)
  assert float(privacy.mse(full.x, x)) < 1e-4
  # d = 128 >= D: A^T is injective, A^T g pins down g, hence x.
  a = ff.fastfood_params(5, D, 128)
  proj = _attack(privacy.gradient_observation(
      apply, params, lambda g: ff.fastfood_project(a, g)), x, y)
  assert float(privacy.mse(proj.x, x)) < 1e-4


def test_narrow_projection_matches_but_does_not_recover():
  params, apply, D = _sigmoid_setup()
  x, y = _true_example()
  # d = 2 numbers for IN = 8 unknowns: many inputs explain the observation.
  a = ff.fastfood_params(5, D, 2)
  res = _attack(privacy.gradient_observation(
      apply, params, lambda g: ff.fastfood_project(a, g)), x, y)
  assert float(res.best_loss) < 1e-4  # The observation is explained ...
  assert float(privacy.mse(res.x, x)) > 1e-2  # ... by a different input.


def test_joint_soft_label_dlg_recovers_label_and_input():
  params, apply = _linear_model(jax.random.key(0))
  x, y = _true_example()
  observe = privacy.gradient_observation(apply, params)
  target = observe(x, jax.nn.one_hot(y, CLASSES))
  res = privacy.gradient_inversion(observe, target, jax.random.key(4),
                                   x.shape, num_classes=CLASSES,
                                   num_steps=100)
  assert res.label_probs.shape == (1, CLASSES)
  assert int(jnp.argmax(res.label_probs[0])) == 2
  assert float(privacy.mse(res.x, x)) < 1e-4


def test_adam_decreases_loss_and_is_deterministic():
  params, apply = _linear_model(jax.random.key(0))
  x, y = _true_example()
  observe = privacy.gradient_observation(apply, params)
  r1 = _attack(observe, x, y, steps=150, optimizer='adam',
               learning_rate=0.05)
  r2 = _attack(observe, x, y, steps=150, optimizer='adam',
               learning_rate=0.05)
  assert float(r1.best_loss) < 1e-2 * float(r1.losses[0])
  np.testing.assert_array_equal(np.asarray(r1.x), np.asarray(r2.x))
  assert float(r1.best_loss) <= float(jnp.min(r1.losses))


def test_argument_errors():
  params, apply = _linear_model(jax.random.key(0))
  observe = privacy.gradient_observation(apply, params)
  x, y = _true_example()
  target = observe(x, jax.nn.one_hot(y, CLASSES))
  key = jax.random.key(0)
  with pytest.raises(ValueError, match='optimizer'):
    privacy.gradient_inversion(observe, target, key, x.shape, label=y,
                               num_classes=CLASSES, optimizer='sgd')
  with pytest.raises(ValueError, match='num_classes'):
    privacy.gradient_inversion(observe, target, key, x.shape)
  with pytest.raises(ValueError, match='num_steps'):
    privacy.gradient_inversion(observe, target, key, x.shape, label=y,
                               num_classes=CLASSES, num_steps=0)


def test_clipped_noised_observation_clips_to_c_and_adds_z_c_noise():
  params, apply, D = _sigmoid_setup()
  x, y = _true_example()
  y_probs = jax.nn.one_hot(y, CLASSES)
  observe = privacy.gradient_observation(apply, params)
  g = observe(x, y_probs)
  norm = float(jnp.linalg.norm(g))
  # C above the norm: clipping leaves g bit-for-bit unchanged.
  clipped, _ = privacy.clipped_noised_observation(observe, 2 * norm, 0.0)
  np.testing.assert_array_equal(np.asarray(clipped(x, y_probs)),
                                np.asarray(g))
  # C below the norm: the direction kept, the norm exactly C.
  c, z = 0.5 * norm, 1.0
  clipped, noised = privacy.clipped_noised_observation(observe, c, z * c)
  gc = clipped(x, y_probs)
  np.testing.assert_allclose(float(jnp.linalg.norm(gc)), c, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gc), np.asarray(g) * c / norm,
                             rtol=1e-5, atol=1e-7)
  # Noise: 64 draws x D = 82 entries, N = 5,248 samples of N(0, (zC)^2); the
  # sample std's relative error has sd 1/sqrt(2N) = 0.0098: allow 5 sd.
  keys = jax.random.split(jax.random.key(7), 64)
  noise = np.stack([np.asarray(noised(x, y_probs, k) - gc) for k in keys])
  assert noise.shape == (64, D)
  n = noise.size
  assert abs(noise.std() / (z * c) - 1) < 5 / np.sqrt(2 * n)
  assert abs(noise.mean()) < 5 * z * c / np.sqrt(n)
  # Different keys, different noise; the same key, the same noise.
  assert not np.allclose(noise[0], noise[1])
  np.testing.assert_array_equal(
      np.asarray(noised(x, y_probs, keys[0]) - gc), noise[0])


def test_attack_recovers_clipped_update_but_not_noised_one():
  params, apply, _ = _sigmoid_setup()
  x, y = _true_example()
  y_probs = jax.nn.one_hot(y, CLASSES)
  observe = privacy.gradient_observation(apply, params)
  norm = float(jnp.linalg.norm(observe(x, y_probs)))
  c = 0.5 * norm
  # Clipping alone (C public, z = 0) hides nothing: the attacker matches its
  # candidate's clipped gradient and recovers x as from g itself.
  clipped, _ = privacy.clipped_noised_observation(observe, c, 0.0)
  res = _attack(clipped, x, y)
  assert float(privacy.mse(res.x, x)) < 1e-4
  # z = 1: the noise has norm ~ sqrt(82) z C = 9 C against a signal of norm
  # C; the best match is another input.
  clipped, noised = privacy.clipped_noised_observation(observe, c, 1.0 * c)
  target = noised(x, y_probs, jax.random.key(5))
  res = privacy.gradient_inversion(clipped, target, jax.random.key(11),
                                   x.shape, label=y, num_classes=CLASSES,
                                   num_steps=60)
  assert float(privacy.mse(res.x, x)) > 1e-2
  assert float(res.best_loss) > 0.5  # Most of the observation is noise.


def test_stored_dp_rows_noise_std_and_worse_than_clean():
  """experiments/results/igc_privacy.json: the DP rows' noise is z C (a
  cohort of 1) and, with noise of norm ~ sqrt(44,054) z C ~ 210 C against a
  clipped update of norm C, no image is reconstructed as well as from the
  clean gradient of the same row setting (same image, same start)."""
  path = (pathlib.Path(__file__).resolve().parent.parent / 'experiments' /
          'results' / 'igc_privacy.json')
  rows = {r['run']: r for r in json.loads(path.read_text())['results']}
  dp = [r for r in rows.values() if r['observation'] == 'dp']
  assert dp
  for r in dp:
    assert r['noise_std'] == pytest.approx(r['noise_multiplier'] *
                                           r['clip_norm'])
    clean = rows[f'{r["model"]}|full|None|{r["tv_weight"]:g}']
    assert r['seeds'] == clean['seeds']
    for noised, full in zip(r['runs'], clean['runs']):
      assert noised['seed'] == full['seed']
      assert all(a < b for a, b in zip(noised['psnr'], full['psnr']))
    assert r['recognizable'] == 0
