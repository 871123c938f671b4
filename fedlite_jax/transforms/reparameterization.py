"""Intrinsic reparameterization of a pytree: theta = theta_0 + A theta'.

Source: Li et al., "Measuring the Intrinsic Dimension of Objective
Landscapes" (ICLR 2018), Eq. (1); Melas-Kyriazi & Wang, "Intrinsic Gradient
Compression for Federated Learning" (2022), Eq. (4)-(5). ``A`` is ONE
Fastfood transform of the whole raveled pytree (``ravel_pytree`` order).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedlite_jax.transforms import fastfood as ff
from fedlite_jax.common import PyTree

__all__ = ['IntrinsicSubspace', 'intrinsic_subspace', 'make_intrinsic',
           'intrinsic_to_params', 'intrinsic_lift', 'intrinsic_project']


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=['theta0_flat', 'fastfood'],
    meta_fields=['treedef', 'shapes', 'dtypes'])
@dataclasses.dataclass(frozen=True, eq=False)
class IntrinsicSubspace:
  """An affine d-dimensional subspace ``theta_0 + span(A)`` of parameter space.

  A JAX pytree (arrays are leaves, the tree structure is static).

  Attributes:
    theta0_flat: ``[D]`` the raveled initial parameters theta_0, in the
      common dtype of the leaves (as ``ravel_pytree``).
    fastfood: the Fastfood matrix ``A`` (D x d).
    treedef: tree structure of the parameter pytree.
    shapes: shape of each leaf, in ``jax.tree.leaves`` order.
    dtypes: dtype of each leaf (numpy dtype names).
  """
  theta0_flat: jax.Array
  fastfood: ff.FastfoodParams
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]

  @property
  def D(self) -> int:  # pylint: disable=invalid-name
    """Number of model parameters."""
    return self.fastfood.D

  @property
  def d(self) -> int:
    """Intrinsic dimension."""
    return self.fastfood.d


def intrinsic_subspace(params0: PyTree, d: int, seed: int,
                       scale: ff.Scale = 'unit_expectation',
                       L: int | None = None) -> IntrinsicSubspace:
  """Builds the subspace ``theta_0 + A theta'`` around ``params0``.

  Args:
    params0: pytree of floating arrays (e.g. flax/haiku/FedJAX params), the
      point theta_0; D = total number of entries.
    d: intrinsic dimension, >= 1.
    seed: Fastfood seed in ``[0, 2**32)``.
    scale: ``'unit_expectation'`` (default, E[A A^T] = I) or
      ``'unit_column'`` (E[A A^T] = (d/D) I); see
      :func:`~fedlite_jax.transforms.fastfood.fastfood_params`.
    L: Fastfood length (default ``2**ceil(log2(max(D, d)))``).

  Returns:
    An :class:`IntrinsicSubspace`.

  Raises:
    ValueError: if ``params0`` has no entries, and as
      :func:`~fedlite_jax.transforms.fastfood.fastfood_params` (bad seed,
      d, scale or L).
  """
  flat0, _ = ravel_pytree(params0)
  leaves, treedef = jax.tree.flatten(params0)
  shapes = tuple(tuple(int(s) for s in jnp.shape(x)) for x in leaves)
  dtypes = tuple(jnp.asarray(x).dtype.name for x in leaves)
  D = int(flat0.shape[0])
  if D == 0:
    raise ValueError('params0 has no entries (D = 0).')
  a = ff.fastfood_params(seed, D, d, scale=scale, L=L)
  return IntrinsicSubspace(theta0_flat=flat0, fastfood=a, treedef=treedef,
                           shapes=shapes, dtypes=dtypes)


def _ravel(subspace: IntrinsicSubspace, tree: PyTree) -> jax.Array:
  """``tree`` as one vector, after checking its structure and shapes."""
  leaves, treedef = jax.tree.flatten(tree)
  if treedef != subspace.treedef:
    raise ValueError(
        f'pytree structure {treedef} does not match the subspace\'s '
        f'{subspace.treedef}.')
  shapes = tuple(tuple(jnp.shape(x)) for x in leaves)
  if shapes != subspace.shapes:
    raise ValueError(
        f'leaf shapes {shapes} do not match the subspace\'s '
        f'{subspace.shapes}.')
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  return jnp.concatenate([jnp.ravel(x) for x in leaves])


def _unravel(subspace: IntrinsicSubspace, flat: jax.Array) -> PyTree:
  """Inverse of :func:`_ravel`, casting to the leaves' dtypes."""
  leaves = []
  start = 0
  for shape, dtype in zip(subspace.shapes, subspace.dtypes):
    size = math.prod(shape)
    leaves.append(
        flat[start:start + size].reshape(shape).astype(np.dtype(dtype)))
    start += size
  return jax.tree.unflatten(subspace.treedef, leaves)


def intrinsic_lift(subspace: IntrinsicSubspace,
                   theta_prime: jax.Array) -> PyTree:
  """``unravel(A theta')`` (paper Eq. 5, the server's ``A C``): ``float32[d]``
  -> a pytree like ``params0`` (its leaf dtypes)."""
  return _unravel(subspace, ff.fastfood_lift(subspace.fastfood, theta_prime))


def intrinsic_to_params(subspace: IntrinsicSubspace,
                        theta_prime: jax.Array) -> PyTree:
  """``theta_0 + A theta'`` as a pytree (Li et al. 2018, Eq. 1).

  Args:
    subspace: from :func:`intrinsic_subspace`.
    theta_prime: ``float32[d]``.

  Returns:
    Pytree like ``params0`` (its leaf dtypes); ``params0`` at 0.

  Raises:
    ValueError: if ``theta_prime`` does not have shape ``[d]``.
  """
  theta_prime = jnp.asarray(theta_prime)
  if theta_prime.shape != (subspace.d,):
    raise ValueError(
        f'theta_prime must have shape ({subspace.d},); got '
        f'{theta_prime.shape}.')
  flat = subspace.theta0_flat + ff.fastfood_lift(subspace.fastfood,
                                                 theta_prime)
  return _unravel(subspace, flat)


def intrinsic_project(subspace: IntrinsicSubspace, tree: PyTree) -> jax.Array:
  """``A^T ravel(tree)``: the compressed gradient of paper Eq. (5).

  Args:
    subspace: from :func:`intrinsic_subspace`.
    tree: pytree with the structure and leaf shapes of ``params0``.

  Returns:
    ``float32[d]`` (or the leaves' common floating dtype).

  Raises:
    ValueError: if the structure or shapes differ from ``params0``'s.
  """
  return ff.fastfood_project(subspace.fastfood, _ravel(subspace, tree))


def make_intrinsic(
    params0: PyTree,
    d: int,
    seed: int,
    scale: ff.Scale = 'unit_expectation',
    L: int | None = None,
) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
  """Reparameterizes a model by ``theta = theta_0 + A theta'`` (Li et al. 2018).

  ``jax.grad`` of ``loss(to_params(theta'))`` is ``A^T ravel(grad_theta)``
  (Melas-Kyriazi & Wang 2022, Eq. 4-5); reverse mode only (no ``jax.jvp``).

  Args:
    params0, d, seed, scale, L: as :func:`intrinsic_subspace`.

  Returns:
    ``(theta_prime0, to_params)``: ``float32[d]`` zeros, and a pure jittable
    function ``[d] -> pytree`` with ``to_params(theta_prime0) == params0``.

  Raises:
    ValueError: as :func:`intrinsic_subspace`.
  """
  subspace = intrinsic_subspace(params0, d, seed, scale=scale, L=L)
  return (jnp.zeros((subspace.d,), jnp.float32),
          functools.partial(intrinsic_to_params, subspace))
