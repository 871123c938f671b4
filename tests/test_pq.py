"""Tests for fedlite_jax.transforms.pq (FedLite, Section 4.1).

Expectations come from the paper's numbers and from a NumPy Lloyd's algorithm
written here independently (float64, exact squared distances), started from
the same initial indices (``kmeans_init_indices``).
"""

from __future__ import annotations

import math

import fedlite_jax  # noqa: F401  (before fedjax; none is used here)
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.cluster import vq as scipy_vq

from fedlite_jax.transforms import pq

# ----------------------------------------------------------------------------
# Independent NumPy reference.


def np_lloyd(points, init_idx, num_iters, empty_cluster='farthest'):
  """Lloyd's algorithm on ``points [N, m]`` from ``points[init_idx]``.

  Documented semantics of ``grouped_pq``: ``num_iters`` (assign, update)
  steps, then a final assignment; ties -> lowest centroid index; an empty
  cluster keeps its centroid, except that with ``'farthest'`` the lowest-
  indexed empty cluster moves to the point farthest from its centroid (lowest
  point index on ties) when that distance is positive.
  """
  points = np.asarray(points, np.float64)
  centroids = points[np.asarray(init_idx)].copy()
  num_centroids = len(centroids)

  def assign(c):
    dist = ((points[:, None, :] - c[None, :, :])**2).sum(-1)
    a = dist.argmin(axis=1)
    return a, dist[np.arange(len(points)), a]

  for _ in range(num_iters):
    a, dist = assign(centroids)
    new = centroids.copy()
    empty = []
    for l in range(num_centroids):
      members = points[a == l]
      if len(members):
        new[l] = members.mean(axis=0)
      else:
        empty.append(l)
    if empty_cluster == 'farthest' and empty and dist.max() > 0:
      new[empty[0]] = points[dist.argmax()]
    centroids = new
  a, _ = assign(centroids)
  return centroids, a


def np_grouped_pq(z, init_idx, q, R, num_iters, empty_cluster='farthest'):
  """Reference grouped PQ: groups formed by subvector index (Figure 2)."""
  z = np.asarray(z, np.float64)
  b, d = z.shape
  m, g = d // q, q // R
  codebook, codewords = [], np.zeros((b, q), np.int64)
  recon = np.zeros((b, q, m))
  sub = z.reshape(b, q, m)
  for r in range(R):
    # Point n of group r: vector n // g, subvector r g + n % g.
    points = np.stack([sub[n // g, r * g + n % g] for n in range(b * g)])
    c, a = np_lloyd(points, init_idx[r], num_iters, empty_cluster)
    codebook.append(c)
    for n in range(b * g):
      j, s = n // g, r * g + n % g
      codewords[j, s] = a[n]
      recon[j, s] = c[a[n]]
  return np.stack(codebook), codewords, recon.reshape(b, d)


def separated_data(rng, num_vectors, d, num_protos=3, scale=10.0,
                   noise=0.1):
  """Vectors whose subvectors cluster tightly (no near-ties in k-means)."""
  protos = rng.normal(size=(num_protos, d)) * scale
  labels = rng.integers(0, num_protos, num_vectors)
  return (protos[labels] +
          noise * rng.normal(size=(num_vectors, d))).astype(np.float32)


def assert_matches_reference(result, ref, rtol=1e-5, atol=1e-4):
  codebook, codewords, recon = ref
  np.testing.assert_array_equal(np.asarray(result.codewords), codewords)
  np.testing.assert_allclose(np.asarray(result.codebook), codebook,
                             rtol=rtol, atol=atol)
  np.testing.assert_allclose(np.asarray(result.reconstruction), recon,
                             rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------
# Message size (Section 4.1) and the paper's ratios (Section 5).


def test_paper_compression_ratios():
  femnist = pq.pq_compression_ratio(d=9216, B=20, q=1152, R=1, L=2)
  so_tag = pq.pq_compression_ratio(d=2000, B=100, q=125, R=1, L=10)
  so_nwp = pq.pq_compression_ratio(d=96, B=128 * 30, q=24, R=1, L=30)
  assert f'{femnist:.4g}' == '490.2'
  assert f'{so_tag:.3g}' == '247'
  assert f'{so_nwp:.3g}' == '51.3'


def test_message_bits_formula():
  # FEMNIST: codebook 64 * 9216 * 2 / 1152 = 1024, codewords 20 * 1152 * 1.
  assert pq.pq_message_bits(9216, 20, 1152, 1, 2) == 1024 + 23040
  assert pq.uncompressed_bits(9216, 20) == 64 * 9216 * 20
  # log2 is not rounded up: L = 10 -> 3.3219... bits per codeword.
  bits = pq.pq_message_bits(2000, 100, 125, 1, 10, phi=32)
  assert bits == pytest.approx(32 * 2000 * 10 / 125 + 12500 * math.log2(10))
  # R multiplies the codebook; L = 1 has free codewords.
  assert pq.pq_message_bits(8, 4, 4, 4, 1) == 64 * 8 * 4 / 4
  assert pq.pq_message_bits(8, 4, 4, 2, 2) == 64 * 8 * 2 * 2 / 4 + 16


def test_result_reports_message_size():
  z = np.random.default_rng(0).normal(size=(20, 48)).astype(np.float32)
  result = pq.grouped_pq(jnp.asarray(z), jax.random.key(0), q=6, R=2, L=3,
                         num_iters=2)
  bits = 64 * 48 * 2 * 3 / 6 + 20 * 6 * math.log2(3)
  assert isinstance(result.message_bits, float)
  assert result.message_bits == pytest.approx(bits)
  assert result.uncompressed_bits == 64 * 48 * 20
  assert result.compression_ratio == pytest.approx(64 * 48 * 20 / bits)
  assert result.codebook.shape == (2, 3, 8)
  assert result.codebook.dtype == jnp.float32
  assert result.codewords.shape == (20, 6)
  assert result.codewords.dtype == jnp.int32
  assert result.reconstruction.shape == (20, 48)
  assert result.quantization_error.shape == ()
  sq = np.sum((z - np.asarray(result.reconstruction))**2)
  np.testing.assert_allclose(result.quantization_error, sq / 20, rtol=1e-5)
  np.testing.assert_allclose(result.relative_error, sq / np.sum(z**2),
                             rtol=1e-5)


# ----------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize('kwargs, match', [
    (dict(q=5, R=1, L=2), 'q .*must divide d=12, got q=5'),
    (dict(q=0, R=1, L=2), r'q .*>= 1; got 0'),
    (dict(q=4, R=3, L=2), 'R .*must divide q=4, got R=3'),
    (dict(q=4, R=0, L=2), r'R .*>= 1; got 0'),
    (dict(q=4, R=4, L=5), r'at most .* B\*q/R = 4\*4/4 = 4; got L=5'),
    (dict(q=4, R=1, L=0), r'L .*>= 1; got 0'),
    (dict(q=4.0, R=1, L=2), r'q .*integer; got 4.0'),
    (dict(q=True, R=1, L=2), r'q .*integer; got True'),
])
def test_invalid_configuration(kwargs, match):
  z = jnp.zeros((4, 12), jnp.float32)
  with pytest.raises(ValueError, match=match):
    pq.grouped_pq(z, jax.random.key(0), **kwargs)
  with pytest.raises(ValueError, match=match):
    pq.pq_message_bits(12, 4, kwargs['q'], kwargs['R'], kwargs['L'])


def test_invalid_inputs():
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r'\[B, d\].*\(12,\)'):
    pq.grouped_pq(jnp.zeros((12,)), key, 2, 1, 2)
  with pytest.raises(ValueError, match='floating dtype.*int32'):
    pq.grouped_pq(jnp.zeros((4, 12), jnp.int32), key, 2, 1, 2)
  with pytest.raises(ValueError, match=r'num_iters .*>= 0; got -1'):
    pq.grouped_pq(jnp.zeros((4, 12)), key, 2, 1, 2, num_iters=-1)
  with pytest.raises(ValueError, match="empty_cluster .*'drop'"):
    pq.grouped_pq(jnp.zeros((4, 12)), key, 2, 1, 2, empty_cluster='drop')
  with pytest.raises(ValueError, match="update_method .*'scatter'"):
    pq.grouped_pq(jnp.zeros((4, 12)), key, 2, 1, 2, update_method='scatter')
  with pytest.raises(ValueError, match='phi .*positive.*got 0'):
    pq.pq_message_bits(12, 4, 2, 1, 2, phi=0)
  with pytest.raises(ValueError, match=r'L .*at most .*N=5, got L=6'):
    pq.kmeans_init_indices(key, 1, 5, 6)


# ----------------------------------------------------------------------------
# Initialization.


def test_init_indices_are_stratified_and_distinct():
  idx = np.asarray(pq.kmeans_init_indices(jax.random.key(3), 4, 103, 10))
  assert idx.shape == (4, 10) and idx.dtype == np.int32
  edges = np.arange(11) * 103 // 10
  assert np.all(idx >= edges[:-1]) and np.all(idx < edges[1:])
  assert np.all(np.diff(idx, axis=1) > 0)
  # Independent per group; every point of a stratum is reachable.
  assert len({tuple(row) for row in idx}) > 1
  draws = np.asarray(jax.vmap(lambda k: pq.kmeans_init_indices(k, 1, 6, 2))(
      jax.random.split(jax.random.key(0), 200)))[:, 0]
  assert set(draws[:, 0]) == {0, 1, 2} and set(draws[:, 1]) == {3, 4, 5}
  # L = N: every point is a centroid.
  np.testing.assert_array_equal(
      pq.kmeans_init_indices(jax.random.key(1), 2, 7, 7),
      np.tile(np.arange(7), (2, 1)))


# ----------------------------------------------------------------------------
# Grouping and agreement with the NumPy reference.


def test_groups_by_subvector_index_not_by_batch():
  # B = 4 vectors, q = 4 subvectors of size 2, R = 2 groups. Subvectors
  # s = 0, 1 sit near (0, 0) / (10, 10); s = 2, 3 near (100, 0) / (0, 100).
  # By subvector index, group 0 = {s = 0, 1} and group 1 = {s = 2, 3}, each
  # with two tight clusters; grouping by batch (rows 0-1 vs rows 2-3) would
  # mix all four locations in every group.
  rng = np.random.default_rng(0)
  base = np.array([[0, 0], [10, 10], [100, 0], [0, 100]], np.float64)
  z = (base[None] + 0.1 * rng.normal(size=(4, 4, 2))).reshape(4, 8)
  z = z.astype(np.float32)
  q, R, L, iters = 4, 2, 2, 5
  key = jax.random.key(7)
  result = pq.grouped_pq(jnp.asarray(z), key, q, R, L, iters)
  init = np.asarray(pq.kmeans_init_indices(key, R, 4 * q // R, L))
  assert_matches_reference(result, np_grouped_pq(z, init, q, R, iters))

  codebook = np.asarray(result.codebook).round().astype(int) + 0
  assert sorted(map(tuple, codebook[0])) == [(0, 0), (10, 10)]
  assert sorted(map(tuple, codebook[1])) == [(0, 100), (100, 0)]
  # The by-batch grouping (the known bug) gives another codebook.
  by_batch = [np_lloyd(z[2 * r:2 * r + 2].reshape(-1, 2), init[r], iters)[0]
              for r in range(R)]
  assert not np.allclose(np.stack(by_batch), result.codebook, atol=1.0)
  # Codewords: vector j, subvector s -> the centroid of base[s].
  recon = np.asarray(result.reconstruction).reshape(4, 4, 2)
  np.testing.assert_allclose(recon, np.broadcast_to(base, (4, 4, 2)),
                             atol=0.3)


def test_group_subvectors_layout():
  z = jnp.arange(2 * 12, dtype=jnp.float32).reshape(2, 12)  # q=6, m=2
  groups = pq.group_subvectors(z, q=6, R=3)
  assert groups.shape == (3, 4, 2)
  # Group 1 holds subvectors s = 2, 3 of vector 0, then of vector 1.
  np.testing.assert_array_equal(
      groups[1], [[4, 5], [6, 7], [16, 17], [18, 19]])
  np.testing.assert_array_equal(pq.ungroup_subvectors(groups, 2), z)


@pytest.mark.parametrize(
    'num_vectors, d, q, R, L, num_iters',
    [
        (12, 24, 6, 2, 4, 6),  # direct distances, one block of centroids
        (24, 32, 2, 1, 40, 4),  # two blocks of centroids (L > 32)
        (10, 48, 3, 1, 5, 5),  # m = 16: matmul distances
    ])
def test_matches_numpy_reference(num_vectors, d, q, R, L, num_iters):
  rng = np.random.default_rng(num_vectors + d + q + R + L)
  z = separated_data(rng, num_vectors, d, num_protos=L + 1)
  key = jax.random.key(L)
  result = pq.grouped_pq(jnp.asarray(z), key, q, R, L, num_iters)
  init = np.asarray(
      pq.kmeans_init_indices(key, R, num_vectors * q // R, L))
  assert_matches_reference(result, np_grouped_pq(z, init, q, R, num_iters))


def test_q1_equals_scipy_kmeans2():
  rng = np.random.default_rng(1)
  z = separated_data(rng, 40, 16, num_protos=4)
  key = jax.random.key(2)
  result = pq.grouped_pq(jnp.asarray(z), key, 1, 1, 4, 7,
                         empty_cluster='keep')
  init = np.asarray(pq.kmeans_init_indices(key, 1, 40, 4))[0]
  # scipy keeps an empty cluster's centroid, as empty_cluster='keep' does.
  codebook, labels = scipy_vq.kmeans2(z.astype(np.float64), z[init].astype(
      np.float64), iter=7, minit='matrix', missing='warn')
  np.testing.assert_allclose(result.codebook[0], codebook, rtol=1e-5,
                             atol=1e-4)
  np.testing.assert_array_equal(result.codewords[:, 0], labels)


def test_vanilla_pq_is_independent_kmeans_per_subvector():
  rng = np.random.default_rng(3)
  z = separated_data(rng, 16, 12, num_protos=3)
  key = jax.random.key(4)
  q, L, iters = 4, 3, 5
  result = pq.grouped_pq(jnp.asarray(z), key, q, q, L, iters)
  init = np.asarray(pq.kmeans_init_indices(key, q, 16, L))
  for s in range(q):
    c, a = np_lloyd(z[:, 3 * s:3 * s + 3], init[s], iters)
    np.testing.assert_allclose(result.codebook[s], c, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(result.codewords[:, s], a)
  # Same codebook size as q = 1 k-means, vs. 1 codebook shared by R = 1.
  assert result.message_bits == pq.pq_message_bits(12, 16, q, q, L)


def test_empty_cluster_rules_match_reference():
  # Strata of the init (L = 4, N = 8): {0, 1}, {2, 3}, {4, 5}, {6, 7}. The
  # first two only hold the origin, so centroids 0 and 1 start equal and
  # centroid 1 (the tie loser) is empty. Integer data: exact arithmetic.
  z = np.array([[0, 0], [0, 0], [0, 0], [0, 0], [5, 5], [5, 6], [9, 0],
                [9, 1]], np.float32)
  key = jax.random.key(0)
  init = np.asarray(pq.kmeans_init_indices(key, 1, 8, 4))
  results = {}
  for rule in ('farthest', 'keep'):
    results[rule] = pq.grouped_pq(jnp.asarray(z), key, 1, 1, 4, 3,
                                  empty_cluster=rule)
    assert_matches_reference(results[rule],
                             np_grouped_pq(z, init, 1, 1, 3, rule))
  # 'keep' leaves centroid 1 at the origin; 'farthest' moves it onto a point
  # (the farthest one from its centroid), which ends up exact.
  np.testing.assert_array_equal(results['keep'].codebook[0, 1], [0, 0])
  assert 1 not in np.asarray(results['keep'].codewords)
  assert len({tuple(c) for c in np.asarray(results['farthest'].codebook[0])
             }) == 4
  assert (float(results['farthest'].quantization_error) <
          float(results['keep'].quantization_error))


# ----------------------------------------------------------------------------
# Quality properties.


def test_exact_when_enough_centroids():
  rng = np.random.default_rng(5)
  # Every group of subvectors takes 3 distinct values; L = 4 >= 3. Integer
  # values keep the cluster means exact in float32.
  protos = rng.integers(-9, 10, size=(3, 4)).astype(np.float32)
  z = protos[rng.integers(0, 3, (16, 6))].reshape(16, 24)
  for key in jax.random.split(jax.random.key(0), 3):
    result = pq.grouped_pq(jnp.asarray(z), key, 6, 2, 4, 8)
    np.testing.assert_array_equal(result.reconstruction, z)
    assert float(result.quantization_error) == 0.0
  # L = number of subvectors: every subvector is its own centroid at once.
  result = pq.grouped_pq(jnp.asarray(z), jax.random.key(1), 6, 2, 48, 0,
                         empty_cluster='keep')
  np.testing.assert_array_equal(result.reconstruction, z)


def _activations(rng, num_vectors, d):
  # ReLU of correlated Gaussians, like post-conv activations.
  mix = rng.normal(size=(8, d))
  return np.maximum(rng.normal(size=(num_vectors, 8)) @ mix, 0).astype(
      np.float32)


# One configuration shared by several tests (one compilation).
_Z_SHAPE, _Q, _R, _L, _ITERS = (20, 96), 24, 1, 4, 10


def _shared_z(seed):
  return jnp.asarray(_activations(np.random.default_rng(seed), *_Z_SHAPE))


def test_error_decreases_with_iterations_and_centroids():
  z = _shared_z(6)
  key = jax.random.key(0)
  errors = [float(pq.grouped_pq(z, key, _Q, _R, _L, it).quantization_error)
            for it in (0, 2, _ITERS)]
  assert all(b <= a * (1 + 1e-6) for a, b in zip(errors, errors[1:])), errors
  assert errors[-1] < errors[0]
  by_l = [float(pq.grouped_pq(z, key, _Q, _R, L, _ITERS).quantization_error)
          for L in (2, _L, 8)]
  assert all(b < a for a, b in zip(by_l, by_l[1:])), by_l


# ----------------------------------------------------------------------------
# Determinism, jit, vmap, alternatives.


def test_deterministic_given_key():
  z = _shared_z(7)
  a = pq.grouped_pq(z, jax.random.key(3), _Q, _R, _L, _ITERS)
  b = pq.grouped_pq(z, jax.random.key(3), _Q, _R, _L, _ITERS)
  c = pq.grouped_pq(z, jax.random.key(4), _Q, _R, _L, _ITERS)
  for field in ('codebook', 'codewords', 'reconstruction'):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  assert not np.array_equal(a.codebook, c.codebook)
  # Raw uint32 keys work as well.
  d = pq.grouped_pq(z, jax.random.PRNGKey(3), _Q, _R, _L, _ITERS)
  assert d.codebook.shape == a.codebook.shape


def test_vmap_over_clients_equals_loop():
  z = jnp.stack([_shared_z(seed) for seed in (8, 9, 10)])
  keys = jax.random.split(jax.random.key(0), 3)
  fn = lambda z, k: pq.grouped_pq(z, k, _Q, _R, _L, _ITERS)
  batched = jax.vmap(fn)(z, keys)
  assert batched.codebook.shape == (3, _R, _L, 4)
  assert batched.quantization_error.shape == (3,)
  assert batched.compression_ratio == fn(z[0], keys[0]).compression_ratio
  for i in range(3):
    single = fn(z[i], keys[i])
    for field in ('codebook', 'codewords', 'reconstruction',
                  'quantization_error'):
      # The error's float32 sum may be ordered differently under vmap.
      np.testing.assert_allclose(getattr(batched, field)[i],
                                 getattr(single, field), rtol=1e-5)
  # Shared batch, batched keys (only the initial centroids are batched).
  shared = jax.vmap(fn, in_axes=(None, 0))(z[0], keys)
  for i in range(3):
    np.testing.assert_array_equal(shared.codewords[i],
                                  fn(z[0], keys[i]).codewords)


def test_update_methods_agree():
  z = _shared_z(11)
  a = pq.grouped_pq(z, jax.random.key(0), _Q, _R, _L, _ITERS,
                    update_method='segment_sum')
  b = pq.grouped_pq(z, jax.random.key(0), _Q, _R, _L, _ITERS,
                    update_method='onehot')
  np.testing.assert_array_equal(a.codewords, b.codewords)
  np.testing.assert_allclose(a.codebook, b.codebook, rtol=1e-5, atol=1e-5)


def test_low_precision_input():
  z = jnp.asarray(separated_data(np.random.default_rng(10), 8, 8, 2),
                  jnp.bfloat16)
  result = pq.grouped_pq(z, jax.random.key(0), 2, 1, 2, 3)
  assert result.reconstruction.dtype == jnp.bfloat16
  assert result.codebook.dtype == jnp.float32


def test_differentiation_treats_quantizer_as_constant():
  z = jnp.asarray(separated_data(np.random.default_rng(12), 8, 8, 2))
  fn = lambda z: pq.grouped_pq(z, jax.random.key(0), 2, 1, 2, 3)
  recon = fn(z).reconstruction
  grad = jax.grad(lambda z: fn(z).quantization_error)(z)
  np.testing.assert_allclose(grad, 2 * (z - recon) / 8, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(
      jax.grad(lambda z: jnp.sum(fn(z).reconstruction))(z), 0.0)
