"""Distributed DP under secure aggregation: the client's encoding and the
server's decoding (pure JAX, jittable, vmappable).

Sources: Kairouz, Liu & Steinke, ICML 2021, "The Distributed Discrete
Gaussian Mechanism for Federated Learning with Secure Aggregation"
(DDGauss), Alg. 1 (client) and Alg. 2 (server); Agarwal, Kairouz & Liu,
NeurIPS 2021, "The Skellam Mechanism for Differentially Private Federated
Learning", Alg. 1 (the same pipeline with Skellam noise).

Client (:func:`client_encode`), in the papers' order:

1. clip the flat update to L2 norm ``C``;
2. zero-pad it to ``d = 2^k`` (:func:`padded_dim`);
3. rotate: ``x <- H S x / sqrt(d)``, ``S`` the diagonal of the round's
   shared random signs, ``H`` the Sylvester Hadamard matrix
   (``fedlite_jax.transforms.fwht``); an orthogonal map;
4. scale by ``1 / gamma``;
5. conditional randomized rounding to integers: each coordinate goes to
   ``floor(x)`` or ``floor(x) + 1`` with probability the fractional part,
   redrawn until the L2 norm is at most the rounded bound
   (``ddp_accounting.rounded_l2_norm_bound(C / gamma, beta, d)``);
6. add the client's share of integer noise: a discrete Gaussian of
   parameter ``sigma / gamma`` (DDGauss) or a Skellam of variance
   ``(sigma / gamma)^2`` (Skellam), ``sigma`` the local std in parameter
   units;
7. reduce mod ``2^B`` (``uint32``).

Server (:func:`server_decode`): the secure sum is the ``uint32`` sum of the
clients' ``uint32[d]`` vectors (``uint32`` arithmetic wraps mod ``2^32`` and
``2^B`` divides ``2^32``, so the sum mod ``2^B`` is exact, with no float
rounding), mapped to ``[-2^(B-1), 2^(B-1))``, multiplied by ``gamma``,
rotated back (``S H y / sqrt(d)``) and unpadded. The caller divides by the
fixed denominator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedlite_jax.privacy import ddp_accounting
from fedlite_jax.privacy import discrete_noise
from fedlite_jax.privacy import skellam_noise
from fedlite_jax.common import PyTree
from fedlite_jax.transforms.base import TreeSpec
from fedlite_jax.transforms.fwht import fwht

__all__ = [
    'MECHANISMS',
    'ClientMessage',
    'DistributedDP',
    'calibrate_secure',
    'client_encode',
    'conditional_round',
    'decode_sum',
    'encode_update',
    'padded_dim',
    'round_rotation_key',
    'secure_epsilon',
    'secure_settings',
    'rotation_signs',
    'server_decode',
    'wrapped_fraction',
]

MECHANISMS = ddp_accounting.MECHANISMS

# fold_in constants of the round's shared rotation and of a client's
# rounding and noise draws.
_ROTATION = 0x726F7461  # 'rota'
_ROUNDING = 0x726E6421  # 'rnd!'
_NOISE = 0x6E6F6973  # 'nois'


def padded_dim(size: int) -> int:
  """The smallest power of two ``>= size`` (``size`` >= 1): ``d``.

  Raises:
    ValueError: (one line) for ``size < 1``.
  """
  if not (isinstance(size, int) and size >= 1):
    raise ValueError(f'the vector size must be an int >= 1; got {size!r}.')
  return 1 << (size - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class DistributedDP:
  """The settings of one run's distributed mechanism (static).

  Attributes:
    mechanism: ``'ddgauss'`` or ``'skellam'``.
    clip_norm: ``C`` > 0, the L2 clip norm (parameter units).
    bits: ``B`` in [2, 32], bits per coordinate of the secure sum.
    gamma: the rounding granularity > 0 (parameter units per integer step).
    local_std: each client's noise std ``sigma`` >= 0 (parameter units);
      the secure sum's noise std is ``sqrt(n) * sigma``.
    beta: conditional rounding's ``beta`` in [0, 1) (0: unconditional).
    size: the length of the flat vector before padding (``D``, or the
      intrinsic dimension under static IGC).
    denominator: the fixed denominator of the mean (clients per round);
      also the number of clients whose noise shares make the sum's noise.
    k_stddevs: standard deviations of the noisy sum fitted into ``2^B``
      when ``gamma`` was chosen (reported only).
  """
  mechanism: str
  clip_norm: float
  bits: int
  gamma: float
  local_std: float
  beta: float
  size: int
  denominator: float
  k_stddevs: float = 0.0

  @property
  def dim(self) -> int:
    """``d``: the padded length (a power of two)."""
    return padded_dim(self.size)

  @property
  def scaled_local_std(self) -> float:
    """``sigma / gamma``: the client's noise std in integer steps."""
    return self.local_std / self.gamma

  @property
  def rounded_bound(self) -> float:
    """Conditional rounding's L2 bound in integer steps (Kairouz et al.,
    Thm. 1 / Prop. 22)."""
    return float(ddp_accounting.rounded_l2_norm_bound(
        self.clip_norm / self.gamma, self.beta, self.dim))

  def check(self) -> None:
    """Raises a one-line ``ValueError`` naming a bad field."""
    for bad, text in (
        (self.mechanism not in MECHANISMS,
         f'mechanism must be one of {MECHANISMS}; got {self.mechanism!r}.'),
        (not self.clip_norm > 0, f'clip_norm C must be > 0; got '
         f'{self.clip_norm}.'),
        (not (isinstance(self.bits, int) and 2 <= self.bits <= 32),
         f'bits B must be an int in [2, 32]; got {self.bits!r}.'),
        (not (math.isfinite(self.gamma) and self.gamma > 0),
         f'gamma must be finite and > 0; got {self.gamma}.'),
        (not (math.isfinite(self.local_std) and self.local_std >= 0),
         f'local_std must be finite and >= 0; got {self.local_std}.'),
        (not 0 <= self.beta < 1, f'beta must be in [0, 1); got {self.beta}.'),
        (not self.denominator > 0, f'denominator must be > 0; got '
         f'{self.denominator}.')):
      if bad:
        raise ValueError(text)
    padded_dim(self.size)


def rotation_signs(key: jax.Array, dim: int) -> jax.Array:
  """The round's shared random signs ``S``: ``float32[dim]`` of +-1.

  Every client of a round and the server draw them from the same ``key``.
  """
  return jnp.where(jax.random.bernoulli(key, 0.5, (dim,)), 1.0,
                   -1.0).astype(jnp.float32)


def _rotate(x: jax.Array, signs: jax.Array) -> jax.Array:
  """``H S x / sqrt(d)`` (orthogonal)."""
  return fwht(signs * x) / jnp.sqrt(jnp.float32(x.shape[-1]))


def _unrotate(y: jax.Array, signs: jax.Array) -> jax.Array:
  """``S H y / sqrt(d)``: the inverse of :func:`_rotate`."""
  return signs * fwht(y) / jnp.sqrt(jnp.float32(y.shape[-1]))


def conditional_round(key: jax.Array, x: jax.Array, bound: float
                      ) -> tuple[jax.Array, jax.Array]:
  """Conditional randomized rounding (Kairouz et al. 2021, Alg. 1, step 5).

  Each coordinate becomes ``floor(x)`` or ``floor(x) + 1``, the latter
  with probability ``x - floor(x)`` (unbiased); the whole vector is redrawn
  until its L2 norm is at most ``bound``. With ``bound`` the rounded bound
  of ``||x||`` at ``beta``, a draw is kept with probability at least
  ``1 - beta`` (Prop. 22), so the loop ends after about ``1 / (1 - beta)``
  draws. A non-finite ``x`` ends it at once (its norm is not ``> bound``).
  The norm is computed in float32: a draw is kept when that norm is at
  most ``bound * (1 + 2^-18)``, a tolerance above float32's error of the
  norm (without it, a vector with ``bound`` near ``2^31`` would never be
  kept); the accounting uses ``bound`` itself, so the sensitivity it
  assumes may be short by that relative 4e-6.

  Args:
    key: PRNG key of the draws.
    x: ``float32[d]``, scaled (integer-step units); ``|x| < 2^31``.
    bound: L2 bound in integer steps (float or float32 scalar).

  Returns:
    ``(int32[d] rounded, int32[] number of draws)``.
  """
  base = jnp.floor(x)
  frac = x - base

  def draw(k):
    up = jax.random.uniform(k, x.shape, jnp.float32) < frac
    return base + up.astype(jnp.float32)

  limit = jnp.float32(bound) * jnp.float32(1 + 2.0 ** -18)

  def not_done(carry):
    _, y, _ = carry
    return jnp.sqrt(jnp.sum(jnp.square(y))) > limit

  def again(carry):
    k, _, tries = carry
    k, use = jax.random.split(k)
    return k, draw(use), tries + 1

  k, first = jax.random.split(key)
  _, y, tries = jax.lax.while_loop(not_done, again,
                                   (k, draw(first), jnp.int32(1)))
  return y.astype(jnp.int32), tries


class ClientMessage(NamedTuple):
  """What :func:`client_encode` returns for one client.

  Attributes:
    residues: ``uint32[d]``: the noised integers mod ``2^B`` (what secure
      aggregation sums).
    integers: ``float32[d]``: the same integers before the reduction (the
      simulation sums them too, only for :func:`wrapped_fraction`).
    norm: ``float32[]``: the update's L2 norm before clipping.
    rounding_draws: ``int32[]``: conditional rounding's draws.
  """
  residues: jax.Array
  integers: jax.Array
  norm: jax.Array
  rounding_draws: jax.Array


def _noise(ddp: DistributedDP, key: jax.Array) -> jax.Array:
  """The client's integer noise share: ``int32[d]``."""
  s = ddp.scaled_local_std
  if ddp.mechanism == 'ddgauss':
    return discrete_noise.discrete_gaussian(key, (ddp.dim,), s)
  return skellam_noise.skellam(key, (ddp.dim,), s * s)


def client_encode(ddp: DistributedDP, vector: jax.Array,
                  rotation_key: jax.Array, key: jax.Array) -> ClientMessage:
  """Steps 1-7 of the client (module docstring) for one flat update.

  Args:
    ddp: the settings.
    vector: ``float32[ddp.size]``, the client's update (parameter units).
    rotation_key: the round's shared key (:func:`rotation_signs`).
    key: this client's own key (rounding and noise).

  Returns:
    A :class:`ClientMessage`.

  Raises:
    ValueError: (one line) if ``vector`` is not ``[ddp.size]``.
  """
  if vector.shape != (ddp.size,):
    raise ValueError(f'the update must have shape ({ddp.size},); got '
                     f'{vector.shape}.')
  x = vector.astype(jnp.float32)
  norm = jnp.sqrt(jnp.sum(jnp.square(x)))
  c = jnp.float32(ddp.clip_norm)
  x = x * (c / jnp.maximum(norm, c))
  x = jnp.pad(x, (0, ddp.dim - ddp.size))
  x = _rotate(x, rotation_signs(rotation_key, ddp.dim)) / ddp.gamma
  limit = jnp.float32(2.0 ** 31 - 2.0 ** 8)  # Below int32's range.
  x = jnp.clip(x, -limit, limit)
  rounded, draws = conditional_round(jax.random.fold_in(key, _ROUNDING), x,
                                     ddp.rounded_bound)
  noised = rounded + _noise(ddp, jax.random.fold_in(key, _NOISE))
  residues = noised.astype(jnp.uint32)  # Two's complement: mod 2^32.
  if ddp.bits < 32:
    residues = residues & jnp.uint32((1 << ddp.bits) - 1)
  return ClientMessage(residues, noised.astype(jnp.float32), norm, draws)


def _signed(residue_sum: jax.Array, bits: int) -> jax.Array:
  """``uint32`` sum mod ``2^B`` as integers in ``[-2^(B-1), 2^(B-1))``,
  returned as float32 (exact below ``2^24`` in magnitude)."""
  if bits == 32:
    return jax.lax.bitcast_convert_type(residue_sum, jnp.int32).astype(
        jnp.float32)
  r = (residue_sum & jnp.uint32((1 << bits) - 1)).astype(jnp.int32)
  r = jnp.where(r >= (1 << (bits - 1)), r - (1 << bits), r)
  return r.astype(jnp.float32)


def server_decode(ddp: DistributedDP, residue_sum: jax.Array,
                  rotation_key: jax.Array) -> jax.Array:
  """The server's decoding of the secure sum (Kairouz et al., Alg. 2).

  Args:
    ddp: the settings.
    residue_sum: ``uint32[d]``, the ``uint32`` sum of the clients'
      :attr:`ClientMessage.residues` (wrapping mod ``2^32``).
    rotation_key: the round's shared key, as the clients'.

  Returns:
    ``float32[ddp.size]``: the noised sum of the clipped updates (parameter
    units), before the division by the denominator.
  """
  y = _signed(residue_sum, ddp.bits) * jnp.float32(ddp.gamma)
  return _unrotate(y, rotation_signs(rotation_key, ddp.dim))[:ddp.size]


def wrapped_fraction(integer_sum: jax.Array, bits: int) -> jax.Array:
  """The fraction of coordinates whose sum left ``[-2^(B-1), 2^(B-1))``
  and so wrapped around the modulus: ``float32[]`` in [0, 1].

  Args:
    integer_sum: ``float32[d]``: the sum of the clients'
      :attr:`ClientMessage.integers` (known to the simulation only).
    bits: ``B``.
  """
  half = jnp.float32(2.0 ** (bits - 1))
  out = (integer_sum < -half) | (integer_sum > half - 1)
  return jnp.mean(out.astype(jnp.float32))


def round_rotation_key(round_key: jax.Array) -> jax.Array:
  """The round's shared rotation key from its DP key
  (``privacy.dp_round_key``)."""
  return jax.random.fold_in(round_key, _ROTATION)


def encode_update(ddp: DistributedDP, tree: PyTree, round_key: jax.Array,
                  client_key: jax.Array) -> tuple[dict, dict]:
  """:func:`client_encode` of a pytree update, as a round's client output.

  Args:
    ddp: the settings; ``ddp.size`` must be the tree's number of scalars.
    tree: the update (pytree of floating arrays, parameter units).
    round_key: the round's DP key (``privacy.dp_round_key``), shared.
    client_key: the client's own key.

  Returns:
    ``(output, diagnostics)``: output ``{'residues': uint32[d],
    'integers': float32[d]}`` (summed over the cohort); diagnostics
    ``dp_norm`` (float32, before clipping), ``dp_clipped`` (0/1),
    ``dp_rounding_draws`` (int32) and ``finite`` (the update's norm is
    finite: the residues of a non-finite update are not).
  """
  flat = TreeSpec.of(tree).ravel(tree, jnp.float32)
  msg = client_encode(ddp, flat, round_rotation_key(round_key), client_key)
  return ({'residues': msg.residues, 'integers': msg.integers}, {
      'dp_norm': msg.norm,
      'dp_clipped': (msg.norm > ddp.clip_norm).astype(jnp.float32),
      'dp_rounding_draws': msg.rounding_draws,
      'finite': jnp.isfinite(msg.norm)})


def decode_sum(ddp: DistributedDP, sums: dict, round_key: jax.Array,
               like: PyTree) -> tuple[PyTree, jax.Array]:
  """The noised mean from the cohort's summed :func:`encode_update` outputs.

  Args:
    ddp: the settings.
    sums: ``{'residues': uint32[d], 'integers': float32[d]}`` summed over
      the cohort (``uint32`` wrapping).
    round_key: the round's DP key, as the clients'.
    like: a pytree with the update's structure, shapes and dtypes.

  Returns:
    ``(mean, wrapped)``: :func:`server_decode` divided by
    ``ddp.denominator`` in ``like``'s structure, and
    :func:`wrapped_fraction` (float32[]).
  """
  total = server_decode(ddp, sums['residues'], round_rotation_key(round_key))
  mean = TreeSpec.of(like).unravel(total / jnp.float32(ddp.denominator))
  return mean, wrapped_fraction(sums['integers'], ddp.bits)


def secure_settings(*, mechanism: str, noise_multiplier: float,
                    clip_norm: float, bits: int, beta: float, clients: int,
                    size: int, k_stddevs: float) -> DistributedDP:
  """The :class:`DistributedDP` of noise multiplier ``z``: the secure sum's
  noise std ``z * C`` split over ``clients`` shares, ``gamma`` from
  ``ddp_accounting.distributed_params`` (``k_stddevs`` standard deviations
  of the noisy sum in ``2^bits``; Kairouz et al. 2021, Sec. 4).

  Raises:
    ValueError: (one line) bad values, or ``bits`` too small for
      ``clients`` and ``k_stddevs`` (naming the smallest that fits).
  """
  if noise_multiplier == 0:  # No noise: gamma for the clipped sum alone.
    gamma = 1 / ddp_accounting.scale_factor(0.0, clip_norm, bits, clients,
                                            padded_dim(size), k_stddevs)
    local_std = 0.0
  else:
    p = ddp_accounting.distributed_params(
        mechanism, noise_multiplier, clip_norm, bits, clients,
        padded_dim(size), beta, k_stddevs)
    gamma, local_std = p.gamma, p.local_std
  out = DistributedDP(mechanism, float(clip_norm), int(bits), float(gamma),
                      float(local_std), float(beta), int(size),
                      float(clients), float(k_stddevs))
  out.check()
  return out


def secure_epsilon(ddp: DistributedDP, q: float, rounds: int, delta: float
                   ) -> ddp_accounting.DistributedEpsilon:
  """``ddp_accounting.distributed_epsilon`` of ``ddp``: ``rounds`` rounds at
  sampling probability ``q``, epsilon at ``delta`` and its parameters."""
  return ddp_accounting.distributed_epsilon(
      ddp.mechanism, ddp.gamma, ddp.local_std, int(ddp.denominator),
      ddp.clip_norm, ddp.beta, ddp.dim, q, rounds, delta)


def calibrate_secure(*, target_epsilon: float, delta: float, q: float,
                     rounds: int, mechanism: str, clip_norm: float, bits: int,
                     beta: float, clients: int, size: int,
                     k_stddevs: float) -> float:
  """The smallest ``z`` whose :func:`secure_settings` reach
  ``target_epsilon`` (``ddp_accounting.calibrate_distributed_noise``).

  Raises:
    ValueError: (one line) an unreachable target or bad values.
  """
  return float(ddp_accounting.calibrate_distributed_noise(
      mechanism, target_epsilon, delta, clip_norm, bits, clients,
      padded_dim(size), beta, q, rounds, k_stddevs).noise_multiplier)
