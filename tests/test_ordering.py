"""rounds/ordering.py: value-exact dependences that let XLA write in place.

References: the inputs' own bit patterns (no bit may change: NaN payloads,
signed zeros and subnormals included), and XLA:CPU's optimized HLO of
a loop whose carried matrix has a reader that its update does not wait for
(XLA copies the matrix every iteration without the dependence, not with it).
"""

from __future__ import annotations

import re

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.rounds import ordering


def _bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])


def test_values_are_unchanged_bit_for_bit():
  nan_payload = np.array([0x7FC00123], np.uint32).view(np.float32)[0]
  special = np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan,
                      nan_payload, 3e38, -1e-45], np.float32)
  tree = {'f32': special, 'bf16': special.astype(jnp.bfloat16),
          'i32': np.array([0, -3, 7], np.int32),
          'u32': np.array([1, 2**32 - 1], np.uint32),
          'flag': np.array([True, False])}
  deps = {'nan': np.array([np.nan, 1.0], np.float32),
          'big': np.full((3, 2), 3e38, np.float32),
          'inf': np.array([-np.inf], np.float32),
          'ints': np.array([2**31 - 1], np.int32),
          'empty': np.zeros((0,), np.float32)}
  out = jax.jit(ordering.ordered_after)(tree, deps)
  for k, v in tree.items():
    got = np.asarray(out[k])
    assert got.dtype == np.asarray(v).dtype, k
    if np.asarray(v).dtype == np.bool_:
      np.testing.assert_array_equal(got, v)
    else:
      np.testing.assert_array_equal(_bits(got), _bits(v), err_msg=k)
  # Many huge leaves: the token stays finite (clipped).
  t = jax.jit(ordering.token)([np.full(4, 3e38, np.float32)] * 1000)
  assert np.isfinite(t) and t == 1000.0
  assert ordering.token({}) == 0


def _loop(dependence: bool):
  """A carried matrix ``w``, read by ``a = v w`` (its update reads ``a``)
  and by ``b = a w^T`` (which only the next ``v`` reads)."""
  def body(_, carry):
    w, v = carry
    a = v @ w
    b = a @ w.T
    delta = 0.01 * jnp.outer(v, a)
    if dependence:
      delta = ordering.ordered_after(delta, b)
    return w - delta, jnp.tanh(b)
  return lambda w, v: lax.fori_loop(0, 3, body, (w, v))


def _carried_copies(text: str, n: int) -> int:
  """Copies of the loop-carried ``f32[n, n]`` in the optimized HLO."""
  return len(re.findall(rf'= f32\[{n},{n}\]\S* copy\(%get-tuple-element',
                        text))


def test_the_dependence_lets_xla_update_the_carried_matrix_in_place():
  n = 64
  w = jax.ShapeDtypeStruct((n, n), jnp.float32)
  v = jax.ShapeDtypeStruct((n,), jnp.float32)
  without = jax.jit(_loop(False)).lower(w, v).compile().as_text()
  with_dep = jax.jit(_loop(True)).lower(w, v).compile().as_text()
  assert _carried_copies(without, n) >= 1, without
  assert _carried_copies(with_dep, n) == 0, with_dep
  # Same values.
  wv = (jax.random.normal(jax.random.PRNGKey(0), (n, n)),
        jax.random.normal(jax.random.PRNGKey(1), (n,)))
  for x, y in zip(jax.jit(_loop(False))(*wv), jax.jit(_loop(True))(*wv)):
    np.testing.assert_array_equal(_bits(x), _bits(y))
