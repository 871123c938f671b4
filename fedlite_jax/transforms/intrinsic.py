"""Intrinsic projection: compress an update to ``A^(k)T x`` (d numbers).

Source: Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022), Alg. 1 (static), Alg. 2 (K-subspace: upload ``(k, A^(k)T
g)``, ``k ~ Unif{0..K-1}``), Alg. 3 (time-varying: new matrices each epoch).
Matrices: :mod:`fedlite_jax.transforms.fastfood` (``D x d``, from a seed).
Bits per message: ``32 d + ceil(log2 K)`` (index dropped with
``count_index_bits=False``, as in the paper's Table 2).
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from fedlite_jax.transforms import fastfood as ff, base, sketch


__all__ = [
    'IntrinsicState', 'index_bits', 'intrinsic_projection',
    'intrinsic_state', 'lift_subspaces', 'make_subspaces',
    'select_subspace', 'subspace_seed']


class IntrinsicState(NamedTuple):
  """State of :func:`intrinsic_projection`: the current epoch's K matrices.

  Attributes:
    fastfood: :class:`~fedlite_jax.transforms.fastfood.FastfoodParams`,
      fields ``[K, ...]``.
  """
  fastfood: ff.FastfoodParams


def subspace_seed(seed: int, epoch: int, index: int) -> int:
  """Fastfood seed of subspace ``index`` in ``epoch``.

  ``seed`` for ``(0, 0)``, else ``seed XOR fmix32(cantor(epoch, index))``:
  distinct for distinct pairs; a protocol constant (costs no bits).

  Args:
    seed: the run's base subspace seed, in ``[0, 2**32)``.
    epoch: epoch number (>= 0); always 0 for static / K-subspace.
    index: subspace index k (>= 0).

  Returns:
    An integer in ``[0, 2**32)``.

  Raises:
    ValueError: negative arguments, a seed >= 2**32, or a pair index that
      does not fit 32 bits.
    TypeError: non-integer arguments.
  """
  seed = ff.check_seed(seed)
  epoch = ff.check_int(epoch, 'epoch', 0)
  index = ff.check_int(index, 'index', 0)
  pair = (epoch + index) * (epoch + index + 1) // 2 + index  # Cantor pairing.
  if pair >= 2**32:
    raise ValueError(f'(epoch={epoch}, index={index}) is too large for a '
                     '32-bit subspace seed.')
  return seed ^ sketch.fmix32_int(pair)


def make_subspaces(D: int, d: int, num_subspaces: int, seed: int,
                   epoch: int = 0,
                   scale: ff.Scale = 'unit_expectation') -> ff.FastfoodParams:
  """The K Fastfood matrices (D x d) of ``epoch``, stacked on axis 0 (host).

  Args:
    D: number of model parameters (>= 1).
    d: intrinsic dimension (>= 1).
    num_subspaces: K (>= 1).
    seed: base seed in ``[0, 2**32)``.
    epoch: epoch number (>= 0).
    scale: Fastfood scale convention (``'unit_expectation'``: E[A A^T] = I,
      the paper's assumption; ``'unit_column'``: Li et al. 2018).

  Returns:
    ``FastfoodParams`` with array fields ``[K, ...]``.

  Raises:
    ValueError: d, D or K < 1, bad seed/epoch, unknown scale.
  """
  d = ff.check_int(d, 'd (intrinsic dimension)')
  num_subspaces = ff.check_int(num_subspaces, 'num_subspaces (K)')
  mats = [ff.fastfood_params(subspace_seed(seed, epoch, k), D, d, scale=scale)
          for k in range(num_subspaces)]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *mats)


def intrinsic_state(D: int, d: int, num_subspaces: int, seed: int,
                    epoch: int = 0,
                    scale: ff.Scale = 'unit_expectation') -> IntrinsicState:
  """:class:`IntrinsicState` for ``epoch`` (see :func:`make_subspaces`)."""
  return IntrinsicState(make_subspaces(D, d, num_subspaces, seed, epoch, scale))


def index_bits(num_subspaces: int) -> int:
  """Bits to send a subspace index: ``ceil(log2 K)`` (0 for K = 1)."""
  num_subspaces = ff.check_int(num_subspaces, 'num_subspaces (K)')
  return (num_subspaces - 1).bit_length()


def select_subspace(fastfood: ff.FastfoodParams,
                    k: jax.Array) -> ff.FastfoodParams:
  """Matrix ``k`` of a stacked ``FastfoodParams`` (``k``: int32 scalar)."""
  return jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, k, axis=0, keepdims=False),
      fastfood)


def _num_subspaces(fastfood: ff.FastfoodParams) -> int:
  """K of a stacked ``FastfoodParams``."""
  return int(fastfood.signs.shape[0])


def _each_subspace(product: Callable[[ff.FastfoodParams, jax.Array], jax.Array],
                   fastfood: ff.FastfoodParams, rows: jax.Array, name: str,
                   width: int) -> Iterator[jax.Array]:
  """Lazy ``product(A^(k), rows[k])``, k = 0..K-1; checks ``[K, width]``."""
  K = _num_subspaces(fastfood)
  if rows.shape != (K, width):
    raise ValueError(f'{name} must have shape ({K}, {width}); got '
                     f'{rows.shape}.')
  return (product(select_subspace(fastfood, k), rows[k]) for k in range(K))


@jax.jit
def sample_subspace(key: jax.Array, num_subspaces: int) -> jax.Array:
  """A client's subspace index ``k ~ Unif{0..K-1}`` (Alg. 2): int32 scalar."""
  return jax.random.randint(key, (), 0, num_subspaces, dtype=jnp.int32)


def project_subspaces(fastfood: ff.FastfoodParams,
                      vectors: jax.Array) -> jax.Array:
  """``[A^(k)T v_k]_k``: K vectors of R^D -> their K intrinsic coordinates.

  Args:
    fastfood: stacked ``FastfoodParams`` ([K, ...]).
    vectors: ``float32[K, D]``.

  Returns:
    ``float32[K, d]``.

  Raises:
    ValueError: if ``vectors`` is not ``[K, D]``.
  """
  return jnp.stack(list(_each_subspace(ff.fastfood_project, fastfood,
                                        vectors, 'vectors', fastfood.D)))


def lift_subspaces(fastfood: ff.FastfoodParams, sigma: jax.Array) -> jax.Array:
  """``sum_k A^(k) sigma_k`` (Alg. 2): ``sigma`` ``float32[K, d]`` ->
  ``float32[D]``; ``fastfood`` stacked ([K, ...]). ValueError if ``sigma`` is
  not ``[K, d]``."""
  return functools.reduce(operator.add, _each_subspace(
      ff.fastfood_lift, fastfood, sigma, 'sigma', fastfood.d))


def intrinsic_projection(d: int, num_subspaces: int = 1, seed: int = 0,
                         scale: ff.Scale = 'unit_expectation',
                         count_index_bits: bool = True) -> base.CommTransform:
  """Intrinsic gradient compression of a pytree: ``(k, A^(k)T ravel(x))``.

  Source: Melas-Kyriazi & Wang (2022), Alg. 1-3 and Eq. 5. ``values``:
  ``float32[d]``; ``side``: ``{'subspace': int32 k}``; ``decode`` returns
  ``unravel(A^(k) values)``. ``init`` draws the epoch-0 matrices; use
  :func:`intrinsic_state` for another epoch.

  Args:
    d: intrinsic dimension (>= 1).
    num_subspaces: K (>= 1).
    seed: base subspace seed in ``[0, 2**32)`` (see :func:`subspace_seed`).
    scale: Fastfood scale convention (default: E[A A^T] = I).
    count_index_bits: charge ``ceil(log2 K)`` bits for the index.

  Returns:
    A ``CommTransform``; bits: ``32 d + ceil(log2 K)``.

  Raises:
    ValueError: d < 1, K < 1, bad seed or scale (here); at ``init``, also a
      model without parameters.
  """
  d = ff.check_int(d, 'd (intrinsic dimension)')
  num_subspaces = ff.check_int(num_subspaces, 'num_subspaces (K)')
  subspace_seed(seed, 0, 0)  # Validates the seed.
  if scale not in ff.SCALES:
    raise ValueError(f'scale must be one of {ff.SCALES}; got {scale!r}.')
  side_bits = float(index_bits(num_subspaces)) if count_index_bits else 0.0

  def init(example):
    D = base.TreeSpec.of(example).size
    if D == 0:
      raise ValueError('intrinsic_projection: the input has no entries.')
    if d > D:
      raise ValueError(f'intrinsic_projection: d={d} exceeds the input size '
                       f'D={D} (the message would be larger than the input).')
    return intrinsic_state(D, d, num_subspaces, seed, 0, scale)

  def encode(x, state, key):
    spec = base.TreeSpec.of(x)
    fastfood = state.fastfood
    if fastfood.D != spec.size:
      raise ValueError(f'intrinsic_projection: input has {spec.size} entries '
                       f'but the subspaces were drawn for D={fastfood.D}.')
    K = _num_subspaces(fastfood)
    k = sample_subspace(key, K)
    coords = ff.fastfood_project(select_subspace(fastfood, k),
                                 spec.ravel(x, jnp.float32))
    return base.Encoded(coords, {'subspace': k}, 32.0 * fastfood.d,
                        side_bits, spec), state

  def decode(message, state):
    a = select_subspace(state.fastfood, message.side['subspace'])
    return message.spec.unravel(ff.fastfood_lift(a, message.values)), state

  return base.CommTransform(init, encode, decode)
