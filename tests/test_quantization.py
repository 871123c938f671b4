"""Tests for the quantizers of fedlite_jax.transforms (uniform k-level, TernGrad,
generators).

Expectations are computed independently in float64 NumPy from the
definitions (Suresh et al. 2017, Sec. 2.2; Wen et al. 2017, Sec. 3), and
FedJAX's own quantizers serve as an outside reference.

Statistical bounds (R independent draws, one key each):

* Two-point law. Uniform quantization sends ``x_i`` (between adjacent levels
  ``b <= x_i <= b + d``) to ``b + d`` with probability ``p = (x_i - b) / d``,
  so ``E = x_i`` and ``v_i = Var = d**2 p (1 - p) = (x_i - b)(b + d - x_i)
  <= d**2 / 4``. TernGrad is a two-point law on ``{0, sign(x) s}`` with
  ``p = |x| / s``: ``v_i = s |x_i| - x_i**2``.
* Mean of R draws: standard deviation ``sqrt(v_i / R)``. We allow
  ``6 sqrt(v_i / R)`` (two-sided normal tail 2e-9; over ~10^4 checked
  elements in this file that is < 1e-4 total false-alarm probability), plus
  ``3 d / R`` for elements with ``p R << 1`` where the binomial is not normal
  (one stray draw moves the mean by ``d / R``; three have probability
  ``<= (pR)**3 / 6``), plus a float tolerance for float32 arithmetic.
* Unbiased sample variance ``s_i**2`` (ddof=1) of a two-point law: by the
  delta method ``sd(s_i**2) ~= d**2 |1 - 2p| sqrt(p (1 - p) / R)
  <= d**2 / (4 sqrt(R))`` (max of ``(1-2p)**2 p (1-p)`` is 1/16 at
  ``p(1-p) = 1/8``); at ``p = 1/2`` the first-order term vanishes and
  ``s**2 - v ~= -d**2 (p_hat - 1/2)**2 = -d**2 chi2_1 / (4R)``, whose 6-sigma
  equivalent tail (chi2_1 <= 36) is ``9 d**2 / R``. Bound:
  ``d**2 (6 / (4 sqrt(R)) + 9 / R)``.
* Independence across elements: ``S_r = sum_i (Q_ri - x_i)`` has variance
  ``sum_i v_i`` when elements are independent (as the definition requires);
  the sample variance of R draws of a near-normal ``S`` has relative sd
  ``sqrt(2 / (R - 1))``: we allow 6 of those. Correlated uniforms (e.g. one
  uniform reused for all elements) inflate it by up to a factor ``n``.
* Aggregate bias: ``sum_i (mean_i - x_i)`` has sd ``sqrt(sum_i v_i / R)``;
  6 of those plus ``n`` float tolerances (used where that is small).
"""

from __future__ import annotations

import math

import fedlite_jax  # noqa: F401  (compat patches before fedjax)
from fedlite_jax.transforms import ternary as tg
from fedlite_jax.transforms import uniform as q

import fedjax  # noqa: F401
from fedjax.aggregators import compression as fedjax_compression
import jax
import jax.numpy as jnp
import numpy as np
import pytest

R = 4000  # Draws per statistical test.
N = 512  # Elements per test vector.
EPS32 = float(np.finfo(np.float32).eps)

GENERATORS = ('hash', 'threefry')

# FedJAX's single-array quantizers are plain functions: jit them once each
# (op-by-op dispatch compiles every primitive separately).
_fedjax_uniform = jax.jit(fedjax_compression.uniform_stochastic_quantize,
                          static_argnums=1)
_fedjax_terngrad = jax.jit(fedjax_compression.terngrad_quantize)


def _keys(seed: int, n: int = R) -> jax.Array:
  return jax.random.split(jax.random.PRNGKey(seed), n)


def _test_vector(seed: int, n: int = N) -> np.ndarray:
  """Float32 values spread over a range, both signs, with some exact ties."""
  rs = np.random.RandomState(seed)
  x = rs.uniform(-1.3, 2.1, size=n).astype(np.float32)
  x[:4] = [-1.3, 2.1, 0.0, 0.5]  # min, max, zero, a repeated value
  x[4:8] = 0.5
  return x


def _grid(x: np.ndarray, bits: int, zero_center: bool):
  """Independent float64 levels: (lo, hi, step, floor level b, p)."""
  if zero_center:
    hi = float(np.max(np.abs(x)))
    lo = -hi
  else:
    lo, hi = float(np.min(x)), float(np.max(x))
  step = (hi - lo) / (2**bits - 1)
  t = (x.astype(np.float64) - lo) / step
  r = np.clip(np.floor(t), 0, 2**bits - 2)
  b = lo + r * step
  p = np.clip((x - b) / step, 0.0, 1.0)
  return lo, hi, step, b, p


def _check_two_point(draws: np.ndarray, x: np.ndarray, low: np.ndarray,
                     d: np.ndarray, tol: float, check_sum_bias: bool = True):
  """Checks draws (R, n) of a two-point law on {low, low + d} with mean x."""
  draws = draws.astype(np.float64)
  x = x.astype(np.float64)
  r = draws.shape[0]
  ad = np.abs(d)
  # Support: every draw is one of the two points.
  on_low = np.abs(draws - low) <= tol
  on_high = np.abs(draws - (low + d)) <= tol
  assert np.all(on_low | on_high), 'a draw is not one of the two levels'
  v = (x - low) * (low + d - x)
  v = np.maximum(v, 0.0)
  assert np.all(v <= d**2 / 4 * (1 + 1e-9) + tol)
  # Per-element mean.
  mean = draws.mean(axis=0)
  bound = 6 * np.sqrt(v / r) + 3 * ad / r + tol
  bad = np.flatnonzero(np.abs(mean - x) > bound)
  assert bad.size == 0, ('mean outside the 6-sigma bound', bad, x[bad],
                         mean[bad], bound[bad])
  # Per-element variance (0 where d = 0: the law is a point mass).
  var = draws.var(axis=0, ddof=1)
  vbound = d**2 * (6 / (4 * math.sqrt(r)) + 9 / r) + 2 * tol * ad
  bad = np.flatnonzero(np.abs(var - v) > vbound)
  assert bad.size == 0, ('variance outside the bound', bad, x[bad], var[bad],
                         v[bad], vbound[bad])
  # Independence across elements.
  total_v = v.sum()
  s = (draws - x).sum(axis=1)
  ratio = s.var(ddof=1) / total_v
  assert abs(ratio - 1) <= 6 * math.sqrt(2 / (r - 1)), ratio
  if check_sum_bias:
    z = abs((mean - x).sum()) / (6 * math.sqrt(total_v / r) + x.size * tol)
    assert z <= 1.0, f'aggregate bias {z:.2f} of the bound'


# ---------------------------------------------------------------- generators


def test_hash_uniform_distribution():
  n = 1 << 20
  key = jax.random.PRNGKey(3)
  u = np.asarray(q.hash_uniform(key, (n,)), np.float64)
  assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
  # 24-bit grid.
  assert np.all(u * 2**24 == np.floor(u * 2**24))
  # Mean: sd sqrt(1/12/n).
  assert abs(u.mean() - 0.5) <= 6 * math.sqrt(1 / 12 / n)
  # Chi-square over 256 bins: df = 255, mean 255, sd sqrt(2 * 255).
  counts = np.bincount((u * 256).astype(np.int64), minlength=256)
  chi2 = ((counts - n / 256)**2 / (n / 256)).sum()
  assert chi2 <= 255 + 6 * math.sqrt(2 * 255), chi2
  # Serial correlation at lags 1 and 2 and between streams of split keys:
  # sd of a sample correlation of independent uniforms ~ 1 / sqrt(n).
  c = u - 0.5
  for lag in (1, 2):
    corr = (c[:-lag] * c[lag:]).mean() / c.var()
    assert abs(corr) <= 6 / math.sqrt(n), (lag, corr)
  k1, k2 = jax.random.split(key)
  u1 = np.asarray(q.hash_uniform(k1, (n,)), np.float64) - 0.5
  u2 = np.asarray(q.hash_uniform(k2, (n,)), np.float64) - 0.5
  corr = (u1 * u2).mean() / math.sqrt(u1.var() * u2.var())
  assert abs(corr) <= 6 / math.sqrt(n), corr


def test_hash_bits_keys_and_shapes():
  key = jax.random.PRNGKey(11)
  a = np.asarray(q.hash_bits(key, (4, 5)))
  assert a.dtype == np.uint32 and a.shape == (4, 5)
  # Deterministic, row-major counters, typed keys give the same stream.
  flat = np.asarray(q.hash_bits(key, (20,)))
  np.testing.assert_array_equal(a, flat.reshape(4, 5))
  typed = np.asarray(q.hash_bits(jax.random.key(11), (4, 5)))
  np.testing.assert_array_equal(a, typed)
  assert len(np.unique(a)) == 20  # a bijection of the counter
  other = np.asarray(q.hash_bits(jax.random.PRNGKey(12), (4, 5)))
  assert not np.array_equal(a, other)
  u = q.random_uniform(key, (3,), jnp.float32, 'threefry')
  np.testing.assert_array_equal(u, jax.random.uniform(key, (3,)))
  with pytest.raises(ValueError, match="'hash', 'threefry'"):
    q.random_uniform(key, (3,), jnp.float32, 'philox')


def test_hash_uniform_float64():
  with jax.enable_x64(True):
    u = np.asarray(
        q.hash_uniform(jax.random.PRNGKey(0), (1 << 16,), jnp.float64))
    assert u.dtype == np.float64 and u.min() >= 0 and u.max() < 1
    assert np.all(u * 2**32 == np.floor(u * 2**32))
    assert abs(u.mean() - 0.5) <= 6 * math.sqrt(1 / 12 / u.size)


# ------------------------------------------------------------------- uniform


@pytest.mark.parametrize('generator', GENERATORS)
@pytest.mark.parametrize('zero_center', [False, True])
@pytest.mark.parametrize('bits', [1, 8, 16])
def test_uniform_unbiased_levels_variance(generator, zero_center, bits):
  x = _test_vector(seed=bits)
  lo, hi, step, b, _ = _grid(x, bits, zero_center)
  quantize = jax.jit(lambda k: q.uniform_quantize(
      x, k, bits, zero_center=zero_center, generator=generator).values)
  draws = np.asarray(jax.vmap(quantize)(_keys(100 + bits)))
  assert draws.shape == (R, N) and draws.dtype == np.float32
  assert np.all(draws >= np.float32(lo)) and np.all(draws <= np.float32(hi))
  # Float32 arithmetic: a few ulps of the range (see uniform.py docstring).
  tol = 8 * EPS32 * (abs(lo) + abs(hi))
  # Aggregate bias is only informative where n * tol << its 6-sigma bound.
  _check_two_point(draws, x, b, np.full_like(b, step), tol,
                   check_sum_bias=bits <= 8)
  if not zero_center:
    # The extremes come back exactly (zero variance).
    assert np.all(draws[:, 0] == x[0]) and np.all(draws[:, 1] == x[1])
  # At most k distinct values.
  assert len(np.unique(draws)) <= 2**bits


def test_uniform_one_bit_is_min_or_max():
  x = _test_vector(seed=5)
  draws = np.asarray(jax.vmap(lambda k: q.uniform_quantize(x, k, 1).values)(
      _keys(6, 200)))
  assert set(np.unique(draws)) == {np.float32(x.min()), np.float32(x.max())}


def test_uniform_pytree_bits_and_per_leaf_ranges():
  tree = {
      'w': jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
      'b': jnp.array([-1.0, 0.0, 3.0, 7.0], jnp.float32),
      'empty': jnp.zeros((0, 3), jnp.float32),
  }
  # 16 values at 8 bits + 2 non-empty layers x 2 floats x 32 bits.
  assert q.uniform_num_bits(tree, 8) == 8 * 16 + 2 * 2 * 32 == 256
  assert q.uniform_num_bits(tree, 8, zero_center=True) == 8 * 16 + 2 * 32
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
  assert q.uniform_num_bits(shapes, 3) == 3 * 16 + 128
  out = q.uniform_quantize_tree(tree, jax.random.PRNGKey(0), 8)
  assert out.bits == 256.0
  assert jax.tree.structure(out.values) == jax.tree.structure(tree)
  for name in tree:
    assert out.values[name].shape == tree[name].shape
    assert out.values[name].dtype == tree[name].dtype
  # Each leaf uses its own [min, max]: 'b' keeps its extremes.
  assert out.values['b'][0] == -1.0 and out.values['b'][3] == 7.0
  w = np.asarray(out.values['w'])
  assert w.min() >= 0 and w.max() <= 11
  single = q.uniform_quantize(tree['w'], jax.random.PRNGKey(0), 8)
  assert single.bits == 8 * 12 + 64
  assert q.uniform_quantize_tree({}, jax.random.PRNGKey(0), 8).bits == 0


@pytest.mark.parametrize('generator', GENERATORS)
@pytest.mark.parametrize('zero_center', [False, True])
def test_uniform_constant_layer_unchanged(generator, zero_center):
  key = jax.random.PRNGKey(1)
  # One constant layer per leaf (one compilation per bits).
  tree = {str(v): jnp.full((7, 3), v, jnp.float32)
          for v in (0.0, 2.5, -3.75, 1e-30, -3e38)}
  for bits, clip_std in ((1, None), (8, 2.5), (24, None)):
    out = q.uniform_quantize_tree(tree, key, bits, zero_center=zero_center,
                                  clip_std=clip_std, generator=generator)
    for name, x in tree.items():
      assert not np.any(np.isnan(out.values[name]))
      np.testing.assert_array_equal(out.values[name], x)
    assert out.bits == len(tree) * (bits * 21 + (32 if zero_center else 64))


def test_uniform_high_bits_float32_identity():
  x = jnp.asarray(_test_vector(seed=9))
  key = jax.random.PRNGKey(0)
  assert q.passthrough_bits(jnp.float32) == 24
  for bits in range(24, 33):
    for zero_center in (False, True):
      out = q.uniform_quantize(x, key, bits, zero_center=zero_center)
      np.testing.assert_array_equal(out.values, x)
      assert out.bits == bits * N + (32 if zero_center else 64)
  # Below the threshold it still quantizes: 23 bits moves values by at most
  # one level spacing, and stays within the range.
  out = q.uniform_quantize(x, key, 23).values
  lo, hi = float(x.min()), float(x.max())
  step = (hi - lo) / (2**23 - 1)
  err = np.abs(np.asarray(out, np.float64) - np.asarray(x, np.float64))
  assert np.all(err <= step + 8 * EPS32 * (abs(lo) + abs(hi)))
  assert float(out.min()) >= lo and float(out.max()) <= hi


def test_uniform_high_bits_float64_quantizes():
  with jax.enable_x64(True):
    assert q.passthrough_bits(jnp.float64) == 53
    x64 = _test_vector(seed=10, n=64).astype(np.float64)
    x64[8:] += np.random.RandomState(0).uniform(0, 1e-7, size=56)
    x = jnp.asarray(x64)
    bits = 32
    lo, hi, step, b, _ = _grid(x64, bits, False)
    draws = np.asarray(jax.vmap(
        lambda k: q.uniform_quantize(x, k, bits).values)(_keys(7, 2000)))
    assert draws.dtype == np.float64
    # Not the identity: interior values move to one of their two levels.
    assert np.mean(draws[0] != x64) > 0.5
    tol = 16 * np.finfo(np.float64).eps * (abs(lo) + abs(hi))
    _check_two_point(draws, x64, b, np.full_like(b, step), tol,
                     check_sum_bias=False)


def test_uniform_low_precision_dtypes():
  key = jax.random.PRNGKey(2)
  x = jnp.asarray(_test_vector(seed=12), jnp.bfloat16)
  assert q.passthrough_bits(jnp.bfloat16) == 8
  out = q.uniform_quantize(x, key, 8)
  assert out.values.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out.values, x)
  out = q.uniform_quantize(x.astype(jnp.float16), key, 3).values
  assert out.dtype == jnp.float16
  assert len(np.unique(np.asarray(out))) <= 8


def test_uniform_clipping():
  x = _test_vector(seed=13)
  x[10] = 40.0  # an outlier far beyond 2.5 std
  c = 2.5
  bound = c * np.std(x.astype(np.float64))
  clipped = np.clip(x.astype(np.float64), -bound, bound)
  np.testing.assert_allclose(q.clip_by_std(jnp.asarray(x), c), clipped,
                             rtol=1e-6)
  draws = np.asarray(jax.vmap(lambda k: q.uniform_quantize(
      x, k, 2, clip_std=c).values)(_keys(14, 2000)))
  assert np.all(np.abs(draws) <= bound * (1 + 1e-6))
  lo, hi, step, b, _ = _grid(clipped.astype(np.float32), 2, False)
  _check_two_point(draws, clipped, b, np.full_like(b, step),
                   8 * EPS32 * (abs(lo) + abs(hi)))


def test_invalid_arguments():
  x = jnp.ones((3,), jnp.float32)
  key = jax.random.PRNGKey(0)
  for bits in (0, 33, -1, 64):
    with pytest.raises(ValueError, match=rf'\[1, 32\].*got {bits}'):
      q.uniform_quantize(x, key, bits)
    with pytest.raises(ValueError, match=rf'got {bits}'):
      q.uniform_num_bits({'a': x}, bits)
  for bits in (8.0, True, '8', None):
    with pytest.raises(TypeError, match='bits must be'):
      q.uniform_quantize_tree({'a': x}, key, bits)
  assert q.validate_bits(np.int64(8)) == 8
  with pytest.raises(ValueError, match='generator'):
    q.uniform_quantize(x, key, 8, generator='rbg')
  with pytest.raises(ValueError, match='generator'):
    tg.terngrad_quantize(x, key, generator='rbg')
  with pytest.raises(ValueError, match='clip_std'):
    q.uniform_quantize(x, key, 8, clip_std=0.0)
  with pytest.raises(ValueError, match='clip_std'):
    tg.terngrad_quantize_tree({'a': x}, key, clip_std=-1.0)
  with pytest.raises(TypeError, match='floating'):
    q.uniform_quantize(jnp.ones((3,), jnp.int32), key, 8)
  with pytest.raises(TypeError, match='floating'):
    tg.terngrad_quantize_tree({'a': jnp.ones((3,), jnp.int32)}, key)


def test_jit_vmap_and_typed_keys():
  tree = {'a': jnp.asarray(_test_vector(seed=15)),
          'b': jnp.linspace(-1, 1, 10, dtype=jnp.float32)}
  key = jax.random.PRNGKey(4)

  @jax.jit
  def f(t, k):
    return q.uniform_quantize_tree(t, k, 4, zero_center=True).values

  eager = q.uniform_quantize_tree(tree, key, 4, zero_center=True).values
  jax.tree.map(np.testing.assert_array_equal, f(tree, key), eager)
  typed = q.uniform_quantize_tree(tree, jax.random.key(4), 4,
                                  zero_center=True).values
  jax.tree.map(np.testing.assert_array_equal, typed, eager)
  # vmap over clients: each client's layer gets its own range.
  xs = jnp.stack([jnp.linspace(0, 1, 9, dtype=jnp.float32),
                  jnp.linspace(-5, 5, 9, dtype=jnp.float32)])
  keys = _keys(8, 2)
  batched = jax.vmap(lambda x, k: q.uniform_quantize(x, k, 3).values)(xs, keys)
  for i in range(2):
    np.testing.assert_array_equal(batched[i],
                                  q.uniform_quantize(xs[i], keys[i], 3).values)
  # The generator changes the stream, not the law.
  h = q.uniform_quantize(tree['a'], key, 2, generator='hash').values
  t = q.uniform_quantize(tree['a'], key, 2, generator='threefry').values
  assert not np.array_equal(h, t)


# ------------------------------------------------------------------ terngrad


@pytest.mark.parametrize('generator', GENERATORS)
@pytest.mark.parametrize('clip_std', [None, 2.5])
def test_terngrad_unbiased_values_variance(generator, clip_std):
  x = _test_vector(seed=20).astype(np.float64)
  x[9] = 30.0  # an outlier: clipping at 2.5 std engages
  x = x.astype(np.float32)
  if clip_std is None:
    target = x.astype(np.float64)
  else:
    bound = clip_std * np.std(x.astype(np.float64))
    assert bound < 30.0
    target = np.clip(x.astype(np.float64), -bound, bound)
  s = np.max(np.abs(target))
  quantize = jax.jit(lambda k: tg.terngrad_quantize(
      x, k, clip_std=clip_std, generator=generator).values)
  draws = np.asarray(jax.vmap(quantize)(_keys(21 if clip_std else 22)))
  assert draws.dtype == np.float32
  tol = 8 * EPS32 * s
  # Values in {0, +-s}, with the sign of the input.
  mag = np.abs(draws.astype(np.float64))
  assert np.all((mag == 0) | (np.abs(mag - s) <= tol))
  assert np.all(draws * np.sign(x) >= 0)
  # Two-point law on {0, sign(x) s}: low = 0, d = sign(x) s; the variance
  # (x - 0)(sign(x) s - x) is s |x| - x**2.
  d = np.sign(target) * s
  _check_two_point(draws, target, np.zeros_like(target), d, tol)
  v = s * np.abs(target) - target**2
  np.testing.assert_allclose(v, target * (d - target), atol=1e-12)
  if clip_std is not None:
    # Biased w.r.t. the unclipped vector at the outlier.
    assert abs(draws[:, 9].mean() - 30.0) > 10.0


def test_terngrad_bits_and_edge_cases():
  # Constant layers (clipping skipped for them), a zero layer, an empty one.
  tree = {'w': jnp.ones((3, 4), jnp.float32),
          'b': jnp.zeros((4,), jnp.float32),
          'c': jnp.full((5,), -0.3, jnp.float32),
          'e': jnp.zeros((0,), jnp.float32)}
  expected = math.log2(3) * 21 + 3 * 32
  assert tg.terngrad_num_bits(tree) == pytest.approx(expected, rel=1e-15)
  key = jax.random.PRNGKey(0)
  for clip_std, generator in ((None, 'hash'), (2.5, 'hash'),
                              (2.5, 'threefry')):
    out = tg.terngrad_quantize_tree(tree, key, clip_std=clip_std,
                                   generator=generator)
    assert out.bits == pytest.approx(expected, rel=1e-15)
    jax.tree.map(np.testing.assert_array_equal, out.values, tree)
  single = tg.terngrad_quantize(jnp.arange(5.0), key)
  assert single.bits == pytest.approx(5 * math.log2(3) + 32)


# ------------------------------------------------- FedJAX as an outside check


def _fedjax_num_bits(aggregator, tree) -> float:
  state = aggregator.init()
  _, state = aggregator.apply([(b'client', tree, 1.0)], state)
  return float(state.num_bits)


def test_fedjax_bits_convention():
  """FedJAX's num_levels is k = 2**bits and charges 2 floats per layer."""
  tree = {'w': jnp.ones((3, 5), jnp.float32), 'b': jnp.ones((7,), jnp.float32)}
  key = jax.random.PRNGKey(0)
  for bits in (1, 2, 8, 16):
    agg = fedjax_compression.uniform_stochastic_quantizer(2**bits, key)
    assert _fedjax_num_bits(agg, tree) == q.uniform_num_bits(tree, bits)
  # TernGrad: same log2(3) per value; FedJAX charges 2 floats per layer, we
  # charge the one float (s) that TernGrad sends.
  agg = fedjax_compression.terngrad_quantizer(key)
  # (FedJAX accumulates num_bits in float32.)
  assert _fedjax_num_bits(agg, tree) == pytest.approx(
      tg.terngrad_num_bits(tree) + 32 * 2, rel=1e-6)


@pytest.mark.parametrize('bits', [1, 8])
def test_fedjax_same_key_threefry_agrees(bits):
  """Same key + threefry: same uniforms, so (almost) the same outputs.

  Outputs may differ only where the uniform falls within float rounding of
  the rounding probability (two float32 formulas for it): a fraction of order
  1e-6 per element.
  """
  x = jnp.asarray(_test_vector(seed=30 + bits, n=2048))
  agree = []
  for seed in range(2):
    key = jax.random.PRNGKey(seed)
    ours = np.asarray(
        q.uniform_quantize(x, key, bits, generator='threefry').values)
    ref = np.asarray(_fedjax_uniform(x, 2**bits, key))
    agree.append(np.isclose(ours, ref, rtol=0, atol=1e-5).mean())
  assert min(agree) >= 0.999, agree
  tree = {'a': x, 'b': x[:100] * 3}
  key = jax.random.PRNGKey(9)
  ours = q.uniform_quantize_tree(tree, key, bits, generator='threefry').values
  ref = fedjax_compression.uniform_stochastic_quantize_pytree(
      tree, 2**bits, key)
  for name in tree:
    assert np.isclose(ours[name], ref[name], rtol=0, atol=1e-5).mean() >= 0.999
  tern = np.asarray(tg.terngrad_quantize(x, key, generator='threefry').values)
  tern_ref = np.asarray(_fedjax_terngrad(x, key))
  assert np.isclose(tern, tern_ref, rtol=0, atol=1e-5).mean() >= 0.999


@pytest.mark.parametrize('bits', [2, 8])
def test_fedjax_distribution_matches_hash_generator(bits):
  """Hash generator vs FedJAX over R keys each: same levels, same law.

  Each element's draws from both quantizers lie on the same two levels; the
  means differ by less than 6 sd of a difference of two independent means,
  ``sqrt(2 v_i / R)``; the per-element sample variances agree within twice
  the one-sample bound.
  """
  x = _test_vector(seed=40 + bits)
  ours = np.asarray(jax.vmap(lambda k: q.uniform_quantize(x, k, bits).values)(
      _keys(41)), np.float64)
  ref = np.asarray(jax.vmap(lambda k: _fedjax_uniform(x, 2**bits, k))(
      _keys(42)), np.float64)
  lo, hi, step, b, _ = _grid(x, bits, False)
  tol = 8 * EPS32 * (abs(lo) + abs(hi))
  for draws in (ours, ref):
    on_levels = (np.abs(draws - b) <= tol) | (np.abs(draws - b - step) <= tol)
    assert np.all(on_levels)
  x64 = x.astype(np.float64)
  v = np.maximum((x64 - b) * (b + step - x64), 0)
  diff = np.abs(ours.mean(0) - ref.mean(0))
  assert np.all(diff <= 6 * np.sqrt(2 * v / R) + 6 * step / R + 2 * tol)
  vbound = step**2 * (6 / (4 * math.sqrt(R)) + 9 / R) + 2 * tol * step
  assert np.all(np.abs(ours.var(0, ddof=1) - ref.var(0, ddof=1)) <= 2 * vbound)
  # Same total variance (independent elements in both).
  total = v.sum()
  for draws in (ours, ref):
    ratio = (draws - x64).sum(1).var(ddof=1) / total
    assert abs(ratio - 1) <= 6 * math.sqrt(2 / (R - 1))


# ------------------------------------- fast single-pass form == previous form


def _previous_uniform(x, key, bits, zero_center, clip_std, generator):
  """The quantizer as written before the single-pass speed-up (reference).

  Two reductions (``jnp.min``, ``jnp.max``), ``t`` clamped to ``[0, k - 1]``
  and a NaN-propagating ``minimum``; the fast form must give the same bits.
  """
  dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  xf = x.astype(dtype)
  lo, hi = jnp.min(xf), jnp.max(xf)
  if clip_std is not None:
    bound = clip_std * jnp.std(xf)
    bound = jnp.where(hi == lo, jnp.inf, bound).astype(dtype)
    xf = jnp.clip(xf, -bound, bound)
    lo, hi = jnp.clip(lo, -bound, bound), jnp.clip(hi, -bound, bound)
  if zero_center:
    hi = jnp.maximum(hi, -lo)
    lo = -hi
  span = hi - lo
  levels = float(2**bits - 1)
  scale = levels / jnp.where(span > 0, span, 1).astype(dtype)
  t = jnp.where(xf >= hi, levels, jnp.clip((xf - lo) * scale, 0, levels))
  floor = jnp.floor(t)
  u = q.random_uniform(key, x.shape, dtype, generator)
  code = floor + (u < t - floor).astype(dtype)
  step = span / levels
  out = jnp.where(code >= levels, hi,
                  jnp.where(code <= 0, lo, jnp.minimum(lo + code * step, hi)))
  return out.astype(x.dtype)


@pytest.mark.parametrize('bits', [1, 2, 4, 8, 16, 23])
@pytest.mark.parametrize('zero_center,clip_std',
                         [(False, None), (True, None), (False, 2.5)])
def test_single_pass_form_is_bit_identical_to_previous(bits, zero_center,
                                                       clip_std):
  # The variadic min/max reduction and the clamp-free code path (see
  # uniform._quantize_values) change no output bit for finite inputs.
  rs = np.random.RandomState(bits)
  layers = [
      rs.standard_normal(100_003).astype(np.float32),
      (rs.standard_normal((64, 257)) * 1e-3 + 5).astype(np.float32),
      _test_vector(bits),
      np.full((7,), 0.25, np.float32),  # constant layer
      np.asarray([0.0, 1.0], np.float32),  # only the two ends
      (rs.standard_normal(4096) * 3).astype(np.float16),
  ]
  ref = jax.jit(_previous_uniform, static_argnums=(2, 3, 4, 5))
  for i, x in enumerate(layers):
    if bits >= q.passthrough_bits(x.dtype):
      continue  # identity (module docstring); not the formula under test
    for generator in GENERATORS:
      key = jax.random.PRNGKey(10 * bits + i)
      got = q.uniform_quantize(x, key, bits, zero_center=zero_center,
                               clip_std=clip_std, generator=generator).values
      want = ref(jnp.asarray(x), key, bits, zero_center, clip_std, generator)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
