"""Communication transforms: interface, chaining, bits, and NumPy references."""

from __future__ import annotations

import fedlite_jax  # noqa: F401  (before fedjax)

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax import transforms as tx
from fedlite_jax.transforms import fastfood as ff
from fedlite_jax.transforms import sketch as sketch_lib


def _tree(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  return {'w': jax.random.normal(k1, (40, 30)),
          'b': jax.random.normal(k2, (30,)),
          'c': {'v': jax.random.normal(k3, (7, 3))}}


D_TREE = 40 * 30 + 30 + 21


def _ravel_np(tree):
  return np.concatenate([np.ravel(np.asarray(x))
                         for x in jax.tree.leaves(tree)])


# ---------------------------------------------------------------- identity --

def test_identity_sends_32_bits_per_float_and_decodes_exactly():
  t = tx.identity()
  x = _tree()
  s = t.init(x)
  msg, _ = t.encode(x, s, jax.random.PRNGKey(0))
  assert msg.bits == 32 * D_TREE and msg.side_bits == 0
  out, _ = t.decode(msg, s)
  jax.tree.map(np.testing.assert_array_equal, out, x)


def test_tree_spec_ravel_unravel_roundtrip_and_mismatch_error():
  x = _tree()
  spec = tx.TreeSpec.of(x)
  assert spec.size == D_TREE
  flat = spec.ravel(x)
  np.testing.assert_array_equal(np.asarray(flat), _ravel_np(x))
  jax.tree.map(np.testing.assert_array_equal, spec.unravel(flat), x)
  with pytest.raises(ValueError, match='do not match'):
    spec.ravel({'w': x['w']})
  with pytest.raises(ValueError, match='unravel expects'):
    spec.unravel(flat[:-1])


# ------------------------------------------------------------------- top-k --

@pytest.mark.parametrize('k', [1, 17, D_TREE])
def test_top_k_matches_numpy_reference(k):
  x = _tree(1)
  t = tx.top_k(k)
  s = t.init(x)
  msg, _ = t.encode(x, s, jax.random.PRNGKey(0))
  v = _ravel_np(x)
  ref_idx = np.argsort(-np.abs(v), kind='stable')[:k]
  np.testing.assert_array_equal(np.sort(np.asarray(msg.side['indices'])),
                                np.sort(ref_idx))
  np.testing.assert_array_equal(np.asarray(msg.values), v[ref_idx])
  dense = np.zeros_like(v)
  dense[ref_idx] = v[ref_idx]
  out, _ = t.decode(msg, s)
  np.testing.assert_array_equal(_ravel_np(out), dense)
  # D = 1251 -> ceil(log2 D) = 11 index bits.
  assert msg.bits == k * (32 + 11)
  assert tx.topk_message_bits(k, D_TREE, 'none') == 32 * k


def test_top_k_error_feedback_keeps_the_residual():
  x = _tree(2)
  t = tx.top_k(100, error_feedback=True)
  s = t.init(x)
  v = _ravel_np(x)
  msg, s1 = t.encode(x, s, jax.random.PRNGKey(0))
  sent, _ = t.decode(msg, s1)
  np.testing.assert_allclose(np.asarray(s1['residual']),
                             v - _ravel_np(sent), atol=0)
  # Second message sparsifies x + residual.
  msg2, s2 = t.encode(x, s1, jax.random.PRNGKey(0))
  w = v + np.asarray(s1['residual'])
  idx = np.argsort(-np.abs(w), kind='stable')[:100]
  np.testing.assert_allclose(np.sort(np.asarray(msg2.values)),
                             np.sort(w[idx]), rtol=1e-6)


def test_top_k_bad_k():
  with pytest.raises(ValueError, match='k must be >= 1'):
    tx.top_k(0)
  with pytest.raises(ValueError, match='exceeds'):
    tx.top_k(D_TREE + 1).init(_tree())
  with pytest.raises(ValueError, match='index_bits'):
    tx.top_k(3, index_bits='bytes')


# ------------------------------------------------------------ count sketch --

def _fmix32_np(x):
  x = x.astype(np.uint32)
  x ^= x >> np.uint32(16)
  x = (x * np.uint32(0x85EBCA6B)).astype(np.uint32)
  x ^= x >> np.uint32(13)
  x = (x * np.uint32(0xC2B2AE35)).astype(np.uint32)
  x ^= x >> np.uint32(16)
  return x


def test_fmix32_int_matches_numpy_reference():
  xs = [0, 1, 2, 12345, 2**31, 2**32 - 1]
  got = [sketch_lib.fmix32_int(x) for x in xs]
  assert got == [int(v) for v in _fmix32_np(np.asarray(xs, np.uint32))]
  assert got[0] == 0 and len(set(got)) == len(xs)
  assert sketch_lib.fmix32_int(2**32 + 7) == sketch_lib.fmix32_int(7)


def _np_hashes(seed, rows, cols, D):
  """The hash family as the sketch module's docstring defines it."""
  f = lambda v: int(_fmix32_np(np.asarray([v], np.uint32))[0])
  i = np.arange(D, dtype=np.uint32)
  buckets = np.zeros((rows, D), np.int64)
  signs = np.zeros((rows, D), np.float64)
  for r in range(rows):
    kb = f(seed ^ f(2 * r + 1))
    ks = f(seed ^ f(2 * r + 2))
    buckets[r] = _fmix32_np(i ^ np.uint32(kb)) % cols
    signs[r] = np.where(_fmix32_np(i ^ np.uint32(ks)) < 2**31, 1.0, -1.0)
  return buckets, signs


@pytest.mark.parametrize('rows,cols', [(1, 7), (3, 50), (4, 64), (5, 200)])
def test_count_sketch_matches_numpy_reference(rows, cols):
  seed = 12345
  v = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (1000,)))
  buckets, signs = _np_hashes(seed, rows, cols, v.size)
  b, s = tx.sketch_hashes(seed, rows, cols, v.size)
  np.testing.assert_array_equal(np.asarray(b), buckets)
  np.testing.assert_array_equal(np.asarray(s), signs)
  table = np.zeros((rows, cols))
  for r in range(rows):
    np.add.at(table[r], buckets[r], signs[r] * v)
  got = np.asarray(tx.sketch_vector(jnp.asarray(v), seed, rows, cols))
  np.testing.assert_allclose(got, table, rtol=1e-5, atol=1e-5)
  est = np.median(table[np.arange(rows)[:, None], buckets] * signs, axis=0)
  np.testing.assert_allclose(
      np.asarray(tx.unsketch(jnp.asarray(table, jnp.float32), seed, v.size)),
      est, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('rows', range(1, 10))
def test_median_rows_matches_numpy(rows):
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(rows), (rows, 333)))
  np.testing.assert_allclose(np.asarray(tx.median_rows(jnp.asarray(x))),
                             np.median(x, axis=0), rtol=1e-6, atol=1e-7)


def test_count_sketch_is_linear_and_finds_heavy_hitters():
  D, heavy = 20_000, np.array([5, 777, 4096, 12_345, 19_999])
  v = 0.01 * np.asarray(jax.random.normal(jax.random.PRNGKey(0), (D,)))
  v[heavy] = [10.0, -8.0, 6.0, -4.0, 3.0]
  t = tx.count_sketch(5, 500, seed=7, k=5)
  x = {'v': jnp.asarray(v, jnp.float32)}
  msg, _ = t.encode(x, t.init(x), None)
  assert msg.bits == 32 * 5 * 500 and msg.values.shape == (5, 500)
  out, _ = t.decode(msg, ())
  out = np.asarray(out['v'])
  np.testing.assert_array_equal(np.flatnonzero(out), np.sort(heavy))
  np.testing.assert_allclose(out[heavy], v[heavy], atol=0.1)
  y = jnp.asarray(np.roll(v, 3), jnp.float32)
  lin = tx.sketch_vector(x['v'] + 2 * y, 7, 5, 500)
  np.testing.assert_allclose(
      np.asarray(lin), np.asarray(tx.sketch_vector(x['v'], 7, 5, 500)
                                  + 2 * tx.sketch_vector(y, 7, 5, 500)),
      atol=1e-4)


def test_count_sketch_bad_sizes():
  with pytest.raises(ValueError, match='rows'):
    tx.count_sketch(0, 10)
  with pytest.raises(ValueError, match='cols'):
    tx.count_sketch(3, 0)
  with pytest.raises(ValueError, match='exceeds'):
    tx.count_sketch(3, 10, k=10**6).init(_tree())


# ------------------------------------------------------ intrinsic projection --

def test_subspace_seed_contract():
  assert tx.subspace_seed(1234, 0, 0) == 1234
  seeds = {tx.subspace_seed(1234, e, k) for e in range(40) for k in range(8)}
  assert len(seeds) == 320
  with pytest.raises(ValueError):
    tx.subspace_seed(-1, 0, 0)
  with pytest.raises(ValueError):
    tx.subspace_seed(2**32, 0, 0)


@pytest.mark.parametrize('K', [1, 4])
def test_intrinsic_projection_is_fastfood_project_and_lift(K):
  x = _tree(4)
  d, seed = 64, 99
  t = tx.intrinsic_projection(d, num_subspaces=K, seed=seed)
  s = t.init(x)
  flat = jnp.asarray(_ravel_np(x))
  seen = set()
  for i in range(12):
    msg, _ = t.encode(x, s, jax.random.PRNGKey(i))
    k = int(msg.side['subspace'])
    seen.add(k)
    a = ff.fastfood_params(tx.subspace_seed(seed, 0, k), D_TREE, d)
    np.testing.assert_allclose(np.asarray(msg.values),
                               np.asarray(ff.fastfood_project(a, flat)),
                               rtol=1e-6, atol=1e-6)
    out, _ = t.decode(msg, s)
    np.testing.assert_allclose(
        _ravel_np(out), np.asarray(ff.fastfood_lift(a, msg.values)),
        rtol=1e-6, atol=1e-6)
    assert msg.bits == 32 * d + (K - 1).bit_length()
  assert seen == set(range(K))


def test_intrinsic_subspace_choice_is_uniform():
  x = _tree()
  t = tx.intrinsic_projection(8, num_subspaces=4, seed=1)
  s = t.init(x)
  ks = jax.vmap(lambda key: t.encode(x, s, key)[0].side['subspace'])(
      jax.random.split(jax.random.PRNGKey(0), 2000))
  counts = np.bincount(np.asarray(ks), minlength=4)
  # Binomial(2000, 1/4): sd = 19.4; 5 sd bounds.
  assert np.all(np.abs(counts - 500) < 97), counts


def test_intrinsic_bad_input():
  with pytest.raises(ValueError, match='d \\(intrinsic dimension\\) must be >= 1'):
    tx.intrinsic_projection(0)
  with pytest.raises(ValueError, match='num_subspaces'):
    tx.intrinsic_projection(8, num_subspaces=0)
  with pytest.raises(TypeError):
    tx.intrinsic_projection(8.5)
  with pytest.raises(ValueError, match='exceeds the input size'):
    tx.intrinsic_projection(D_TREE + 1).init(_tree())
  t = tx.intrinsic_projection(8)
  s = t.init(_tree())
  with pytest.raises(ValueError, match='entries'):
    t.encode({'w': jnp.ones((3, 3))}, s, jax.random.PRNGKey(0))


# ------------------------------------------------------------------ chains --

@pytest.mark.parametrize('K', [1, 8])
def test_chain_intrinsic_then_8bit_quantization(K):
  x = _tree(5)
  d, seed, key = 128, 5, jax.random.PRNGKey(11)
  proj = tx.intrinsic_projection(d, num_subspaces=K, seed=seed)
  t = tx.chain(proj, tx.uniform_quantization(8))
  state = t.init(x)
  msg, _ = t.encode(x, state, key)
  # Bits of the final message: 8 bits x d + min/max floats + the index.
  assert msg.bits == 8 * d + 64 + (K - 1).bit_length()
  assert tx.message_bits(t, x, state) == msg.bits
  # Same bits through jit (static metadata survives).
  assert jax.jit(lambda x, s: t.encode(x, s, key)[0])(x, state).bits == \
      msg.bits
  # Stage by stage with the chain's keys: project, quantize, lift.
  k_proj, k_quant = jax.random.split(key)
  m1, _ = proj.encode(x, state[0], k_proj)
  q = tx.uniform.uniform_quantize_tree(m1.values, k_quant, 8).values
  np.testing.assert_array_equal(np.asarray(msg.values), np.asarray(q))
  c = np.asarray(m1.values)
  assert np.max(np.abs(np.asarray(q) - c)) <= (c.max() - c.min()) / 255 + 1e-6
  out, _ = t.decode(msg, state)
  k = int(m1.side['subspace'])
  a = ff.fastfood_params(tx.subspace_seed(seed, 0, k), D_TREE, d)
  np.testing.assert_allclose(_ravel_np(out),
                             np.asarray(ff.fastfood_lift(a, q)),
                             rtol=1e-5, atol=1e-5)
  assert jax.tree.structure(out) == jax.tree.structure(x)


def test_chain_top_k_then_quantization_passes_indices_through():
  x = _tree(6)
  t = tx.chain(tx.top_k(50), tx.uniform_quantization(4))
  state = t.init(x)
  msg, _ = t.encode(x, state, jax.random.PRNGKey(0))
  assert msg.bits == 4 * 50 + 64 + 50 * 11
  v = _ravel_np(x)
  idx = np.asarray(msg.side[0].side['indices'])
  np.testing.assert_array_equal(np.sort(idx),
                                np.sort(np.argsort(-np.abs(v))[:50]))
  out = _ravel_np(t.decode(msg, state)[0])
  assert np.count_nonzero(out) <= 50
  np.testing.assert_array_equal(np.flatnonzero(out), np.sort(idx)[
      np.isin(np.sort(idx), np.flatnonzero(out))])
  span = np.ptp(v[idx])
  assert np.max(np.abs(out[idx] - v[idx])) <= span / 15 + 1e-6


def test_chain_vmaps_over_clients_and_needs_a_stage():
  x = _tree()
  t = tx.chain(tx.intrinsic_projection(16, num_subspaces=2), tx.terngrad())
  s = t.init(x)
  msgs = jax.vmap(lambda k: t.encode(x, s, k)[0])(
      jax.random.split(jax.random.PRNGKey(0), 3))
  assert msgs.values.shape == (3, 16)
  assert msgs.bits == pytest.approx(16 * np.log2(3) + 32 + 1)
  with pytest.raises(ValueError, match='at least one'):
    tx.chain()


def test_product_quantization_is_fedlites_grouped_pq_message():
  # The transform sends exactly grouped_pq's codebook + codewords, and its
  # size is the paper's phi d R L / q + B q log2 L (Section 4.1), by hand:
  # B=32, d=64, q=8, R=1, L=16, phi=64: 64*64*16/8 + 32*8*4 = 9,216 bits.
  from fedlite_jax.transforms import pq
  z = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
  t = tx.product_quantization(8, 1, 16)
  key = jax.random.PRNGKey(5)
  msg, _ = jax.jit(t.encode)({'acts': z}, (), key)
  z_hat, _ = t.decode(msg, ())
  ref = pq.grouped_pq(z, jax.random.fold_in(key, 0), 8, 1, 16)
  np.testing.assert_array_equal(z_hat['acts'], ref.reconstruction)
  np.testing.assert_array_equal(msg.side['codewords'][0], ref.codewords)
  assert msg.bits == 9216.0 == tx.message_bits(t, {'acts': z})
  assert len(np.unique(np.asarray(z_hat['acts']).reshape(-1, 8), axis=0)) <= 16
  with pytest.raises(ValueError, match='q'):
    t.encode(jnp.zeros((32, 60)), (), key)  # q=8 does not divide d=60
