"""Value-exact data dependences that order XLA's in-place writes.

A state carried through an on-device loop (a segment's lane states) is
updated in place. XLA copies a carried buffer before an in-place write when
some reader of the old value is not ordered before the write by a data
dependence: in a training step, the matmul that reads a weight for the
input gradient (``dx = dy W^T``) feeds earlier layers' gradients, not this
weight's update, so XLA copied every weight of every lane each step (XLA:CPU,
the 21M Transformer on 39 lanes: 6.6 GB per step, 8.7% of the plain step's
bytes). ``lax.optimization_barrier`` does not order them: it is removed
before copy insertion. :func:`ordered_after` adds the dependence instead.
Notes: docs/notes/engines.md.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from fedlite_jax.common import PyTree


def token(deps: PyTree) -> jax.Array:
  """``float32[]``: a finite scalar that depends on every leaf of ``deps``.

  Reads one element of each non-empty array leaf (its first), replaces a
  non-finite one by 0 and clips it to ``[-1, 1]`` before summing, so the
  sum is finite for any values. XLA cannot fold it away (it does not know
  the values).
  """
  parts = [lax.slice(x, (0,) * x.ndim, (1,) * x.ndim).reshape(1)
           .astype(jnp.float32)
           for x in jax.tree.leaves(deps)
           if hasattr(x, 'dtype') and x.size and x.dtype != jnp.bool_]
  if not parts:
    return jnp.zeros((), jnp.float32)
  v = jnp.concatenate(parts)
  return jnp.sum(jnp.clip(jnp.where(jnp.isfinite(v), v, 0), -1, 1))


def ordered_after(tree: PyTree, deps: PyTree) -> PyTree:
  """``tree`` with the same values, each leaf depending on ``deps``.

  Each leaf goes through ``where(isnan(token(deps)), 0, x)``: the token is
  finite, so the select returns ``x`` bit for bit (any dtype; NaN payloads,
  signed zeros and subnormals included: a select moves bits, where
  arithmetic such as ``x + (-0.0)`` flushes subnormals on XLA:CPU), and
  XLA cannot fold it (it does not know the token). Whatever consumes a
  returned leaf is then ordered after every producer of ``deps``; use it
  to let XLA update a buffer in place instead of copying it.

  Args:
    tree: arrays (any shapes and dtypes).
    deps: arrays whose producers must run first (any shapes and dtypes).

  Returns:
    ``tree``'s structure, shapes and dtypes, the same values.
  """
  never = jnp.isnan(token(deps))
  return jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x),
                      tree)
