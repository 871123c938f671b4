"""Tests for fedlite_jax.transforms.fastfood: the Fastfood matrix A and its adjoint."""

from __future__ import annotations

import fedlite_jax  # noqa: F401  (before fedjax; applies compat fixes)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
import scipy.stats

from fedlite_jax.transforms import fastfood as ff


def _dense_from_parts(p: ff.FastfoodParams) -> np.ndarray:
  """A = s Unpad_D H G Pi H B Pad_L built explicitly (float64, NumPy/SciPy).

  Uses only the random parts (signs, perm, gauss) of ``p``; the scale is
  recomputed from its definition, not read from ``p.scale``.
  """
  L, D, d = p.L, p.D, p.d
  h = scipy.linalg.hadamard(L).astype(np.float64)
  b = np.zeros(L)
  b[:d] = np.asarray(p.signs, np.float64)  # B beyond d multiplies Pad's zeros.
  perm = np.asarray(p.perm)
  pi = np.eye(L)[perm]  # (Pi v)[i] = v[perm[i]].
  gauss = np.asarray(p.gauss, np.float64)
  pad = np.eye(L)[:, :d]
  unpad = np.eye(L)[:D]
  k = {'unit_expectation': d, 'unit_column': D}[p.scale_convention]
  s = 1.0 / (np.linalg.norm(gauss) * np.sqrt(k))
  return s * unpad @ h @ np.diag(gauss) @ pi @ h @ np.diag(b) @ pad


def _dense_via_lift(p: ff.FastfoodParams) -> jax.Array:
  return jax.vmap(lambda e: ff.fastfood_lift(p, e), out_axes=1)(
      jnp.eye(p.d, dtype=jnp.float32))


def _dense_via_project(p: ff.FastfoodParams) -> jax.Array:
  return jax.vmap(lambda e: ff.fastfood_project(p, e))(
      jnp.eye(p.D, dtype=jnp.float32))


DENSE_CASES = [
    # (D, d, L): D > d, D < d, D not a power of 2, D = L, trivial, larger L.
    (20, 6, None),
    (5, 12, None),
    (100, 3, None),
    (64, 64, None),
    (1, 1, None),
    (20, 6, 64),
]


@pytest.mark.parametrize('scale', ff.SCALES)
@pytest.mark.parametrize('D,d,L', DENSE_CASES)
def test_matches_explicit_dense_matrix(D, d, L, scale):
  p = ff.fastfood_params(11, D, d, scale=scale, L=L)
  assert p.L == (L or ff.padded_length(D, d))
  assert p.signs.shape == (d,) and p.signs.dtype == jnp.int8
  assert p.perm.shape == (p.L,) and p.gauss.shape == (p.L,)
  assert sorted(np.asarray(p.perm).tolist()) == list(range(p.L))
  np.testing.assert_array_equal(np.asarray(p.inv_perm)[np.asarray(p.perm)],
                                np.arange(p.L))
  assert set(np.asarray(p.signs).tolist()) <= {-1, 1}
  dense = _dense_from_parts(p)
  tol = 2e-6 * max(1.0, np.abs(dense).max()) * np.log2(p.L + 1)
  lifted = np.asarray(_dense_via_lift(p))
  projected = np.asarray(_dense_via_project(p))
  assert lifted.dtype == np.float32 and lifted.shape == (D, d)
  np.testing.assert_allclose(lifted, dense, rtol=0, atol=tol)
  np.testing.assert_allclose(projected, dense, rtol=0, atol=tol)


def test_padded_length():
  assert ff.padded_length(1, 1) == 1
  assert ff.padded_length(1_206_590, 16_384) == 2**21
  assert ff.padded_length(124_439_808, 65_536) == 2**27
  assert ff.padded_length(5, 12) == 16
  assert ff.padded_length(64, 3) == 64


# One medium shape shared by several tests (compilations are cached per shape).
_MD, _Md = 700, 30


def test_adjoint_identity():
  D, d = _MD, _Md
  p = ff.fastfood_params(5, D, d)
  kx, ky = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (d,))
  y = jax.random.normal(ky, (D,))
  lhs = float(jnp.vdot(ff.fastfood_lift(p, x), y))
  rhs = float(jnp.vdot(x, ff.fastfood_project(p, y)))
  scale = float(jnp.linalg.norm(ff.fastfood_lift(p, x)) * jnp.linalg.norm(y))
  assert abs(lhs - rhs) <= 1e-5 * scale


def test_lift_vjp_is_project():
  p = ff.fastfood_params(2, _MD, _Md)
  y = jax.random.normal(jax.random.key(0), (_MD,))
  _, vjp = jax.vjp(lambda s: ff.fastfood_lift(p, s), jnp.zeros((_Md,)))
  np.testing.assert_allclose(np.asarray(vjp(y)[0]),
                             np.asarray(ff.fastfood_project(p, y)),
                             rtol=1e-5, atol=1e-5)


def test_project_vjp_is_lift_and_grads_batch():
  p = ff.fastfood_params(2, _MD, _Md)
  s = jax.random.normal(jax.random.key(0), (3, _Md))
  _, vjp = jax.vjp(lambda g: ff.fastfood_project(p, g), jnp.zeros((3, _MD)))
  np.testing.assert_allclose(np.asarray(vjp(s)[0]),
                             np.asarray(ff.fastfood_lift(p, s)),
                             rtol=1e-5, atol=1e-5)
  # Per-example gradients under vmap and jit.
  ys = jax.random.normal(jax.random.key(1), (3, _MD))
  grads = jax.jit(jax.vmap(jax.grad(
      lambda t, y: jnp.vdot(ff.fastfood_lift(p, t), y)), (None, 0)))(
          jnp.zeros((_Md,)), ys)
  np.testing.assert_allclose(np.asarray(grads),
                             np.asarray(ff.fastfood_project(p, ys)),
                             rtol=1e-5, atol=1e-5)


def test_frobenius_norm_exact_when_D_is_L():
  # With D = L every column of H G Pi H B Pad has squared norm L ||G||^2, so
  # ||A||_F^2 = s^2 d L ||G||^2: exactly D for 'unit_expectation' (trace of
  # E[A A^T] = I_D) and exactly d for 'unit_column' (d unit columns).
  D, d = 256, 24
  for scale, expected in (('unit_expectation', D), ('unit_column', d)):
    for seed in range(3):
      a = np.asarray(_dense_via_lift(ff.fastfood_params(seed, D, d, scale)),
                     np.float64)
      np.testing.assert_allclose(np.sum(a * a), expected, rtol=1e-5)
      if scale == 'unit_column':
        np.testing.assert_allclose(np.sum(a * a, axis=0), 1.0, rtol=1e-5)


# E[A A^T] over seeds.
#
# For one entry (a, b), X_i = (A_i A_i^T)[a, b] over seeds i = 1..N are iid
# (the seed is the only randomness). They are bounded: every entry of the
# unscaled M = Unpad H G Pi H B Pad satisfies |M_aj| <= sum_c |g_c| <=
# sqrt(L) ||g||, so with s^2 = 1 / (||g||^2 k) (k = d or D),
# |X| <= s^2 d L ||g||^2 = L d / k. Bounded => finite variance => the CLT
# holds, and Z = (mean(X) - target) / (sd(X) / sqrt(N)) is ~ N(0, 1) under
# the null. Testing all m = D (D + 1) / 2 entries at |Z| <= z, the union
# bound gives P(false alarm) <= m * 2 * (1 - Phi(z)). The seeds are fixed,
# so the test is deterministic; the bound says a correct implementation
# fails it with probability < 1e-4 over the choice of seeds.
# Power: the same statistic must reject the other convention's target.
_STAT_D, _STAT_d, _STAT_N = 20, 6, 2000


def _stacked_params(seeds, D, d, scale):
  ps = [ff.fastfood_params(int(s), D, d, scale=scale) for s in seeds]
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *ps)


@pytest.mark.parametrize('scale,alt_scale', [
    ('unit_expectation', 'unit_column'), ('unit_column', 'unit_expectation')])
def test_expectation_of_A_At(scale, alt_scale):
  D, d, n = _STAT_D, _STAT_d, _STAT_N
  stack = _stacked_params(range(1000, 1000 + n), D, d, scale)
  dense = jax.jit(jax.vmap(_dense_via_lift))(stack)  # [N, D, d]
  dense = np.asarray(dense, np.float64)
  aat = np.einsum('nij,nkj->nik', dense, dense)
  target = {'unit_expectation': 1.0, 'unit_column': d / D}
  L = ff.padded_length(D, d)
  k = d if scale == 'unit_expectation' else D
  assert np.abs(aat).max() <= L * d / k * (1 + 1e-5)  # The derived bound.
  iu = np.triu_indices(D)
  mean = aat.mean(axis=0)[iu]
  se = aat.std(axis=0, ddof=1)[iu] / np.sqrt(n)
  m = len(mean)
  z = scipy.stats.norm.isf(1e-4 / (2 * m))  # ~5.4 for m = 210.
  expected = target[scale] * np.eye(D)[iu]
  assert np.all(np.abs(mean - expected) <= z * se), (
      np.max(np.abs(mean - expected) / se), z)
  # Power: the other scale's target is rejected on the diagonal.
  diag = iu[0] == iu[1]
  alt = target[alt_scale]
  assert np.all(np.abs(mean[diag] - alt) > z * se[diag])


def test_same_seed_same_matrix_different_seed_different():
  D, d = _MD, _Md
  a1 = ff.fastfood_params(42, D, d)
  a2 = ff.fastfood_params(42, D, d)  # e.g. the server regenerating it.
  b = ff.fastfood_params(43, D, d)
  for f in ('signs', 'perm', 'inv_perm', 'gauss', 'scale'):
    np.testing.assert_array_equal(np.asarray(getattr(a1, f)),
                                  np.asarray(getattr(a2, f)))
  g = jax.random.normal(jax.random.key(0), (D,))
  np.testing.assert_array_equal(np.asarray(ff.fastfood_project(a1, g)),
                                np.asarray(ff.fastfood_project(a2, g)))
  assert not np.array_equal(np.asarray(a1.perm), np.asarray(b.perm))
  assert not np.array_equal(np.asarray(a1.gauss), np.asarray(b.gauss))
  pa, pb = ff.fastfood_project(a1, g), ff.fastfood_project(b, g)
  assert float(jnp.linalg.norm(pa - pb)) > 0.5 * float(jnp.linalg.norm(pa))


def test_scale_conventions_differ_by_sqrt_D_over_d():
  D, d = _MD, _Md
  e = ff.fastfood_params(9, D, d, scale='unit_expectation')
  c = ff.fastfood_params(9, D, d, scale='unit_column')
  np.testing.assert_array_equal(np.asarray(e.gauss), np.asarray(c.gauss))
  np.testing.assert_allclose(float(e.scale) / float(c.scale),
                             np.sqrt(D / d), rtol=1e-6)


def test_short_L_rejected_naming_both_numbers():
  with pytest.raises(ValueError, match=r'L=64.*100'):
    ff.fastfood_params(0, 100, 3, L=64)
  with pytest.raises(ValueError, match=r'L=16.*20'):
    ff.fastfood_params(0, 5, 20, L=16)  # d > L.


@pytest.mark.parametrize('kwargs,exc', [
    (dict(seed=0, D=10, d=3, L=24), ValueError),  # not a power of two
    (dict(seed=0, D=10, d=3, scale='unit'), ValueError),
    (dict(seed=-1, D=10, d=3), ValueError),
    (dict(seed=2**32, D=10, d=3), ValueError),
    (dict(seed=0, D=0, d=3), ValueError),
    (dict(seed=0, D=10, d=0), ValueError),
    (dict(seed=1.5, D=10, d=3), TypeError),
])
def test_bad_arguments_rejected(kwargs, exc):
  with pytest.raises(exc):
    ff.fastfood_params(**kwargs)


def test_check_int_and_check_seed():
  assert ff.check_int(np.int64(5), 'n') == 5
  assert type(ff.check_int(np.int64(5), 'n')) is int
  assert ff.check_int(0, 'n', 0) == 0
  with pytest.raises(ValueError, match=r'^n must be >= 1; got 0\.$'):
    ff.check_int(0, 'n')
  with pytest.raises(TypeError, match=r'^n must be an integer; got 2\.0\.$'):
    ff.check_int(2.0, 'n')
  assert ff.check_seed(2**32 - 1) == 2**32 - 1
  with pytest.raises(ValueError, match=r'^s must be < 2\*\*32; got 4294967296'):
    ff.check_seed(2**32, 's')
  with pytest.raises(ValueError, match='>= 0'):
    ff.check_seed(-1)


def test_wrong_input_length_rejected():
  p = ff.fastfood_params(0, 10, 3)
  with pytest.raises(ValueError, match='10'):
    ff.fastfood_project(p, jnp.zeros((11,)))
  with pytest.raises(ValueError, match='3'):
    ff.fastfood_lift(p, jnp.zeros((4,)))


def test_batching_jit_and_vmap():
  D, d = _MD, _Md
  p = ff.fastfood_params(3, D, d)
  kx, kg = jax.random.split(jax.random.key(0))
  xs = jax.random.normal(kx, (4, d))
  gs = jax.random.normal(kg, (4, D))
  lift_rows = np.stack([np.asarray(ff.fastfood_lift(p, x)) for x in xs])
  proj_rows = np.stack([np.asarray(ff.fastfood_project(p, g)) for g in gs])
  tol = dict(rtol=1e-5, atol=1e-5)
  # Native leading batch axes, vmap over inputs, jit with params as argument.
  np.testing.assert_allclose(np.asarray(ff.fastfood_lift(p, xs)), lift_rows,
                             **tol)
  np.testing.assert_allclose(np.asarray(ff.fastfood_project(p, gs)), proj_rows,
                             **tol)
  np.testing.assert_allclose(
      np.asarray(jax.vmap(ff.fastfood_lift, (None, 0))(p, xs)), lift_rows,
      **tol)
  np.testing.assert_allclose(
      np.asarray(jax.jit(jax.vmap(ff.fastfood_project, (None, 0)))(p, gs)),
      proj_rows, **tol)
  np.testing.assert_allclose(
      np.asarray(jax.jit(ff.fastfood_project)(p, gs[0])), proj_rows[0], **tol)
  # vmap over a stack of matrices (e.g. K subspaces), one input each.
  seeds = [3, 4, 5, 6]
  stack = _stacked_params(seeds, D, d, 'unit_expectation')
  per = np.stack([np.asarray(ff.fastfood_project(
      ff.fastfood_params(s, D, d), g)) for s, g in zip(seeds, gs)])
  np.testing.assert_allclose(
      np.asarray(jax.jit(jax.vmap(ff.fastfood_project))(stack, gs)), per,
      **tol)
  per = np.stack([np.asarray(ff.fastfood_lift(
      ff.fastfood_params(s, D, d), x)) for s, x in zip(seeds, xs)])
  np.testing.assert_allclose(
      np.asarray(jax.vmap(ff.fastfood_lift)(stack, xs)), per, **tol)
