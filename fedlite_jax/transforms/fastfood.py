"""Fastfood random projection: the D x d matrix A of intrinsic compression.

Source: Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022), Section 3.2, after Le, Sarlos & Smola, "Fastfood" (ICML
2013), as used for intrinsic dimension by Li et al. (ICLR 2018) and
Aghajanyan et al. (ACL 2021)::

    A = s * Unpad_D . H . G . Pi . H . B . Pad_L            (D x d)
    A^T = s * Unpad_d . B . H . Pi^T . G . H . Pad_L         (d x D)

``L = 2**ceil(log2(max(D, d)))``; ``H`` the unnormalized L x L Sylvester
Hadamard matrix; ``B``, ``Pi``, ``G``: see :class:`FastfoodParams`; ``Pad_L``
zero-pads to length L, ``Unpad_D`` keeps the first D entries. A product
costs ``O(L log L)`` time and ``O(L)`` memory (``A`` is never materialized).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.checks import check_int
from fedlite_jax.transforms.fwht import fwht, is_power_of_two

__all__ = ['SCALES', 'FastfoodParams', 'check_int', 'check_seed',
           'fastfood_params', 'fastfood_lift', 'fastfood_project',
           'padded_length']

Scale = Literal['unit_expectation', 'unit_column']
SCALES: tuple[str, ...] = ('unit_expectation', 'unit_column')

# fold_in constants of the three random streams (part of the seed contract).
_STREAM_SIGNS = 0
_STREAM_PERM = 1
_STREAM_GAUSS = 2


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=['signs', 'perm', 'inv_perm', 'gauss', 'scale'],
    meta_fields=['D', 'd', 'L', 'scale_convention'])
@dataclasses.dataclass(frozen=True, eq=False)
class FastfoodParams:
  """The random diagonals and permutation defining one Fastfood matrix A.

  A JAX pytree (arrays are leaves: ``jit``, stack, ``vmap``; sizes static).

  Attributes:
    signs: ``int8[d]``, the diagonal of ``B`` in {-1, +1} (only its first d
      entries meet non-zeros after ``Pad_L``, so only those are stored).
    perm: ``int32[L]``, uniformly random; ``Pi`` is the gather
      ``(Pi v)[i] = v[perm[i]]``.
    inv_perm: ``int32[L]``, the inverse; ``Pi^T v = v[inv_perm]`` (the
      scatter ``w[perm[i]] = v[i]``).
    gauss: ``float32[L]``, the diagonal of ``G``, iid N(0, 1).
    scale: ``float32[]``, the scalar ``s`` (already includes ``1 / ||G||``).
    D: number of rows (model parameters).
    d: number of columns (intrinsic dimension).
    L: padded length, a power of two >= max(D, d).
    scale_convention: ``'unit_expectation'`` or ``'unit_column'``.
  """
  signs: jax.Array
  perm: jax.Array
  inv_perm: jax.Array
  gauss: jax.Array
  scale: jax.Array
  D: int
  d: int
  L: int
  scale_convention: str


def check_seed(seed: Any, name: str = 'seed') -> int:
  """A 32-bit seed: ``seed`` as a Python int in ``[0, 2**32)``.

  Raises:
    TypeError: if ``seed`` is not an integer.
    ValueError: if it is negative or ``>= 2**32``.
  """
  seed = check_int(seed, name, 0)
  if seed >= 2**32:
    raise ValueError(f'{name} must be < 2**32; got {seed}.')
  return seed


def padded_length(D: int, d: int) -> int:
  """``L = 2**ceil(log2(max(D, d)))``, the smallest admissible Fastfood length.

  Raises:
    ValueError: if D or d is not a positive integer.
  """
  D = check_int(D, 'D')
  d = check_int(d, 'd')
  return 1 << (max(D, d) - 1).bit_length()


@functools.partial(jax.jit, static_argnames=('d', 'L'))
def _draw_signs_gauss(key: jax.Array, d: int, L: int):
  """``B``'s d signs, ``G``'s diagonal and ``||G||``."""
  signs = jax.random.rademacher(
      jax.random.fold_in(key, _STREAM_SIGNS), (d,), dtype=jnp.int8)
  gauss = jax.random.normal(
      jax.random.fold_in(key, _STREAM_GAUSS), (L,), dtype=jnp.float32)
  # ||G|| as a two-level float32 sum (a flat sum loses precision at large L).
  block = min(L, 4096)
  sq = jnp.sum(jnp.square(gauss).reshape(L // block, block), axis=1)
  norm = jnp.sqrt(jnp.sum(sq))
  return signs, gauss, norm


def _draw_perm(key: jax.Array, L: int) -> np.ndarray:
  """``perm`` on the host (NumPy; ``jax.random.permutation`` sorts: slow)."""
  words = np.asarray(
      jax.random.key_data(jax.random.fold_in(key, _STREAM_PERM)),
      dtype=np.uint32).ravel()
  rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
      [int(w) for w in words])))
  return rng.permutation(L).astype(np.int32)


def fastfood_params(seed: int, D: int, d: int,
                    scale: Scale = 'unit_expectation',
                    L: int | None = None) -> FastfoodParams:
  """Draws the Fastfood matrix ``A`` (D x d) determined by ``seed``.

  Source: Melas-Kyriazi & Wang (2022), Section 3.2. Host-side (NumPy draws
  the permutation), O(L) time, 12 L bytes: draw once, reuse. With ``key =
  jax.random.key(seed)``: ``B`` from ``fold_in(key, 0)``, ``G`` from
  ``fold_in(key, 2)``, ``perm`` from NumPy ``PCG64`` seeded with the bits of
  ``fold_in(key, 1)`` (same ``jax_threefry_partitionable``: same ``A``).

  Args:
    seed: integer in ``[0, 2**32)``, the shared secret; the same seed, sizes
      and scale give the same ``A`` on every client and on the server.
    D: number of rows (model parameters), >= 1.
    d: number of columns (intrinsic dimension), >= 1. ``d > D`` is allowed.
    scale: ``'unit_expectation'``: ``s = 1 / (||G|| sqrt(d))``, ``E[A A^T]
      = I_D`` exactly, as Algorithms 1-3 assume (Eq. 5-6 is then SGD in
      expectation); ``'unit_column'`` (Li et al. 2018): ``s = 1 / (||G||
      sqrt(D))``, ``E[A A^T] = (d/D) I_D`` (D/d times larger learning rates).
    L: padded length; default ``2**ceil(log2(max(D, d)))``; a larger power
      of two gives a different, equally valid ``A``.

  Returns:
    A :class:`FastfoodParams`.

  Raises:
    ValueError: for a seed outside ``[0, 2**32)``, ``D`` or ``d`` < 1, an
      unknown ``scale``, an ``L`` that is not a power of two or ``< max(D,
      d)``.
    TypeError: for a non-integer seed (e.g. a tracer).
  """
  try:
    seed = operator.index(seed)
  except TypeError as e:
    raise TypeError(
        f'seed must be a Python/NumPy integer (fastfood_params runs on the '
        f'host); got {type(seed).__name__}.') from e
  if not 0 <= seed < 2**32:
    raise ValueError(
        f'seed must be in [0, 2**32) (jax.random.key keeps 32 bits without '
        f'jax_enable_x64, so larger seeds would collide); got {seed}.')
  D = check_int(D, 'D')
  d = check_int(d, 'd')
  if scale not in SCALES:
    raise ValueError(f'scale must be one of {SCALES}; got {scale!r}.')
  if L is None:
    L = padded_length(D, d)
  else:
    L = check_int(L, 'L')
    if L < max(D, d):
      raise ValueError(
          f'Fastfood length L={L} is smaller than max(D, d)={max(D, d)} '
          f'(D={D}, d={d}): the transform would silently truncate.')
    if not is_power_of_two(L):
      raise ValueError(f'Fastfood length L={L} is not a power of two.')

  key = jax.random.key(seed)
  signs, gauss, norm = _draw_signs_gauss(key, d, L)
  perm_np = _draw_perm(key, L)
  inv_np = np.empty_like(perm_np)
  inv_np[perm_np] = np.arange(L, dtype=np.int32)
  n_scale = d if scale == 'unit_expectation' else D
  s = (1.0 / (norm * np.sqrt(np.float32(n_scale)))).astype(jnp.float32)
  return FastfoodParams(signs=signs, perm=jnp.asarray(perm_np),
                        inv_perm=jnp.asarray(inv_np), gauss=gauss, scale=s,
                        D=D, d=d, L=L, scale_convention=scale)


def _block_length(d: int) -> int:
  """``m = 2**ceil(log2 d)``: ``H_L = H_{L/m} (x) H_m`` (one length-m FWHT)."""
  return 1 << (d - 1).bit_length()


def _floating_input(x: jax.Array, n: int, what: str, name: str) -> jax.Array:
  """``x`` as floating (else float32); ``ValueError`` unless ``[..., n]``."""
  x = jnp.asarray(x)
  if x.ndim == 0 or x.shape[-1] != n:
    raise ValueError(
        f'{what} expects {name} of shape [..., {n}]; got shape {x.shape}.')
  return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def _lift_impl(params: FastfoodParams, s: jax.Array) -> jax.Array:
  """``A s``; ``H_L Pad_L(v) = tile(H_m Pad_m(v), L/m)``."""
  d, L, D = params.d, params.L, params.D
  m = _block_length(d)
  lead = s.shape[:-1]
  v = s * params.signs.astype(s.dtype)                       # B
  v = jnp.pad(v, [(0, 0)] * len(lead) + [(0, m - d)])        # Pad_m
  v = fwht(v)                                                # H_m
  v = jnp.broadcast_to(v[..., None, :], lead + (L // m, m))  # H_L Pad_L
  v = v.reshape(lead + (L,))
  v = jnp.take(v, params.perm, axis=-1)                      # Pi (gather)
  v = v * params.gauss.astype(v.dtype)                       # G
  v = fwht(v)                                                # H_L
  return v[..., :D] * params.scale.astype(v.dtype)           # s Unpad_D


def _project_impl(params: FastfoodParams, g: jax.Array) -> jax.Array:
  """``A^T g``; ``first_m(H_L w) = H_m sum_blocks(w)``."""
  d, L, D = params.d, params.L, params.D
  m = _block_length(d)
  lead = g.shape[:-1]
  u = jnp.pad(g, [(0, 0)] * len(lead) + [(0, L - D)])        # Pad_L
  u = fwht(u)                                                # H_L
  u = u * params.gauss.astype(u.dtype)                       # G
  w = jnp.take(u, params.inv_perm, axis=-1)                  # Pi^T
  w = jnp.sum(w.reshape(lead + (L // m, m)), axis=-2)        # first_m H_L = H_m
  w = fwht(w)                                                #   . sum_blocks
  out = w[..., :d] * params.signs.astype(w.dtype)            # Unpad_d, B
  return out * params.scale.astype(out.dtype)


def _zero_cotangent(params: FastfoodParams) -> FastfoodParams:
  """Zeros (float0 for the integer leaves) shaped like ``params``."""
  return jax.tree.map(
      lambda x: (jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.inexact)
                 else np.zeros(x.shape, jax.dtypes.float0)), params)


_Product = Callable[[FastfoodParams, jax.Array], jax.Array]


def _with_transpose_vjp(product: _Product, transpose: _Product) -> _Product:
  """``product`` with VJP ``transpose(params, ct)``; ``params`` get zeros."""

  @jax.custom_vjp
  def f(params: FastfoodParams, x: jax.Array) -> jax.Array:
    return product(params, x)

  def fwd(params, x):
    return product(params, x), (params, jnp.zeros((), x.dtype))

  def bwd(res, ct):
    params, like = res
    return (_zero_cotangent(params),
            transpose(params, ct).astype(like.dtype))

  f.defvjp(fwd, bwd)
  return f


_lift_vjp = _with_transpose_vjp(_lift_impl, _project_impl)
_project_vjp = _with_transpose_vjp(_project_impl, _lift_impl)


@jax.jit
def fastfood_lift(params: FastfoodParams, s: jax.Array) -> jax.Array:
  """``A s``: maps intrinsic coordinates (R^d) into parameter space (R^D).

  Melas-Kyriazi & Wang 2022, Sec. 3.2. Jittable, vmappable; reverse mode
  only (the VJP is :func:`fastfood_project`; no ``jax.jvp``).

  Args:
    params: from :func:`fastfood_params` (one matrix; ``jax.vmap`` for more).
    s: ``float32[..., d]``; leading axes are batch axes.

  Returns:
    ``float32[..., D]``.

  Raises:
    ValueError: if the last axis of ``s`` is not d.
  """
  return _lift_vjp(params, _floating_input(s, params.d, 'fastfood_lift', 's'))


@jax.jit
def fastfood_project(params: FastfoodParams, g: jax.Array) -> jax.Array:
  """``A^T g``: compresses a parameter-space vector (R^D) to R^d.

  The compressed gradient of Melas-Kyriazi & Wang 2022, Eq. 5 (Sec. 3.2);
  its VJP is :func:`fastfood_lift`.

  Args:
    params: as for :func:`fastfood_lift`.
    g: ``float32[..., D]``.

  Returns:
    ``float32[..., d]``, with the leading (batch) axes of ``g``.

  Raises:
    ValueError: if the last axis of ``g`` is not D.
  """
  return _project_vjp(
      params, _floating_input(g, params.D, 'fastfood_project', 'g'))
