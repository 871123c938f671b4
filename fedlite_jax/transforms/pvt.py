"""Partial Variable Training (PVT): per-client, per-round masks of variables.

Sources: Yang, Xiao, Wang, et al., "Partial Variable Training for Efficient
On-Device Federated Learning" (2021), the per-client-per-round (PCPR)
configuration; Ro et al., "Scaling Language Model Size in Cross-Device
Federated Learning" (2022), Section 4 and Appendix B: each sampled client
freezes a fresh random subset of the *multiplicative* variables ("the
embedding and weights of the LSTM, and for the Transformer, the weights of
the MLP layer, attention matrices, layer normalization in each block, and
embedding") so that the trainable share of the parameters is 10%..90%; only
the trained variables are uploaded, and the server averages each variable
over the clients that trained it. The target is met in expectation, not per
client (Ro et al.: "the number of trainable variables might average to the
desired percentage").

PVT is the one compression stage whose message size is random: it depends on
the client's mask. So it is not a :class:`~fedlite_jax.transforms.CommTransform`
(whose sizes are static) but a transform of the *upload*: :func:`masked_upload`
encodes only the trained variables with any per-variable CommTransform chain,
and :func:`masked_bits` sums the per-variable message sizes
(:func:`leaf_bits`) of the trained variables. The mask also freezes local
training (:func:`apply_mask` on gradients and updates), which is the
algorithm's job (:mod:`fedlite_jax.algorithms.fedopt`).

Pure functions over pytrees (no FedJAX; jittable where stated):

* :func:`make_plan` (host): which leaves are freezable, their sizes, and the
  inclusion probability ``p`` of a freezable leaf.
* :func:`sample_mask` (jittable): a ``bool[num_leaves]`` mask from a PRNG key.
* :func:`apply_mask`, :func:`mask_tree`: the mask applied to / as a pytree.
* :func:`masked_upload` (jittable): encode + decode the trained leaves.
* :func:`leaf_bits`, :func:`masked_bits`, :func:`expected_masked_bits`,
  :func:`trained_params`, :func:`realized_fraction` (host): sizes.

Sampling (exact in expectation). Let ``N`` be all parameters, ``A`` those of
leaves that are never frozen (biases, LayerNorm offsets, the output bias),
``S = N - A`` those of the ``n`` freezable leaves, and ``f`` the target
fraction. Every freezable leaf is trained with the same probability ``p = (f
N - A) / S``, so ``E[trained parameters] = A + p S = f N`` exactly. The
leaves are drawn by *systematic sampling* over a uniformly random order:
with ``u ~ U[0, 1)``, the leaf at position ``j`` of the random order is
trained iff ``floor(u + p (j + 1)) > floor(u + p j)``. Each leaf then has
inclusion probability exactly ``p`` and the number of trained freezable
leaves is ``floor(n p)`` or ``ceil(n p)`` (much less variable than
independent coin flips, and never 0 when ``n p >= 1``). ``f = 1`` trains
everything (``p = 1``: the mask is all True, a static special case), so PVT
100% is plain FedAvg.

Client compute: a frozen variable's gradient is computed and then zeroed
(one compiled step serves every mask, because the mask is data). Skipping
the frozen weight-gradient matmuls would need a gradient program split per
variable; it saved about 14% CPU per round for a small Transformer on the
one-client-per-call engine only (nothing under ``vmap``, nothing for the
LSTM), so it is not done.

Bad input (``ValueError`` naming the value): ``f`` outside (0, 1]; no
freezable leaf while ``f < 1``; ``f N < A`` (the target is below the
always-trained share); ``n p < 1`` on a model with no always-trained
parameter (some clients would train nothing); an explicit mask that trains
no variable (:func:`check_mask`); an upload chain that cannot encode one
variable on its own, or whose size is not a sum over variables
(:func:`leaf_bits`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.transforms import base
from fedlite_jax.common import PyTree

Path = tuple[Any, ...]

MULTIPLICATIVE_NAMES = ('kernel', 'embedding', 'scale', 'projection',
                        'pos_embedding')
"""Leaf names treated as multiplicative (freezable) by default: dense and
LSTM kernels (attention q/k/v/out and MLP kernels in the Transformer), the
LSTM projection, token and position embeddings, LayerNorm scales."""


def _key_name(entry: Any) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_name(path: Path) -> str:
  """'a/b/c' for a ``jax.tree_util`` key path."""
  return '/'.join(_key_name(e) for e in path)


def is_multiplicative(path: Path, leaf: Any) -> bool:
  """Default freezable predicate: the leaf's name is in MULTIPLICATIVE_NAMES.

  Args:
    path: the leaf's ``jax.tree_util`` key path.
    leaf: the leaf (unused; part of the predicate signature).

  Returns:
    True for kernels, projections, embeddings and LayerNorm scales; False
    for biases and anything else.
  """
  del leaf
  return bool(path) and _key_name(path[-1]) in MULTIPLICATIVE_NAMES


@dataclasses.dataclass(frozen=True)
class PVTPlan:
  """Static description of a model's freezable variables (hashable).

  Attributes:
    fraction: target trainable share of the parameters, in (0, 1].
    names: leaf paths ('a/b/kernel'), ``jax.tree.leaves`` order.
    sizes: parameters per leaf.
    freezable: whether each leaf may be frozen.
    probability: ``p``, the inclusion probability of a freezable leaf.
  """
  fraction: float
  names: tuple[str, ...]
  sizes: tuple[int, ...]
  freezable: tuple[bool, ...]
  probability: float

  @property
  def num_params(self) -> int:
    """N, all parameters."""
    return int(sum(self.sizes))

  @property
  def always_trained(self) -> int:
    """A, parameters of leaves that are never frozen."""
    return int(sum(s for s, f in zip(self.sizes, self.freezable) if not f))

  @property
  def freezable_indices(self) -> tuple[int, ...]:
    """Leaf indices of the freezable leaves."""
    return tuple(i for i, f in enumerate(self.freezable) if f)

  @property
  def trains_everything(self) -> bool:
    """True when ``p == 1`` (the mask is always all True)."""
    return self.probability >= 1.0


def make_plan(params: PyTree, fraction: float,
              is_freezable: Callable[[Path, Any], bool] = is_multiplicative
              ) -> PVTPlan:
  """Plans PVT for a model (host code; see the module docstring).

  Args:
    params: the model parameters (arrays or ``jax.ShapeDtypeStruct``).
    fraction: target trainable share of the parameters, in (0, 1].
    is_freezable: ``(key path, leaf) -> bool``; default
      :func:`is_multiplicative`.

  Returns:
    A :class:`PVTPlan`.

  Raises:
    ValueError: fraction outside (0, 1]; no freezable leaf (with fraction <
      1); a fraction below the always-trained share; or a plan under which a
      client could train nothing.
  """
  if isinstance(fraction, bool) or not isinstance(
      fraction, (int, float, np.floating)) or not 0.0 < fraction <= 1.0 or \
      math.isnan(fraction):
    raise ValueError(f'pvt_fraction must be in (0, 1], got {fraction!r}.')
  fraction = float(fraction)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  if not flat:
    raise ValueError('PVT needs a model with at least one parameter leaf.')
  names = tuple(path_name(p) for p, _ in flat)
  sizes = tuple(int(math.prod(np.shape(x))) for _, x in flat)
  freezable = tuple(bool(is_freezable(p, x)) for p, x in flat)
  total = sum(sizes)
  always = sum(s for s, f in zip(sizes, freezable) if not f)
  free = total - always
  if fraction >= 1.0:
    return PVTPlan(1.0, names, sizes, freezable, 1.0)
  if free == 0:
    raise ValueError(f'pvt_fraction={fraction}: the model has no freezable '
                     '(multiplicative) variable, so PVT cannot reduce the '
                     'trained share below 100%.')
  target = fraction * total
  if target < always:
    raise ValueError(
        f'pvt_fraction={fraction} is below the share of always-trained '
        f'(non-multiplicative) parameters, {always / total:.4f} '
        f'({always} of {total}); raise pvt_fraction.')
  p = min(1.0, (target - always) / free)
  n = sum(freezable)
  if always == 0 and n * p < 1.0:
    raise ValueError(
        f'pvt_fraction={fraction}: each of the {n} freezable variables is '
        f'trained with probability {p:.3f}, so some clients would train no '
        'variable at all (the model has no always-trained parameter); raise '
        'pvt_fraction.')
  return PVTPlan(fraction, names, sizes, freezable, p)


def sample_mask(plan: PVTPlan, key: jax.Array) -> jax.Array:
  """One client's PVT mask (jittable; ``plan`` is static).

  Args:
    plan: from :func:`make_plan`.
    key: a JAX PRNG key (derive it from the client's round key, e.g.
      ``jax.random.fold_in(client_key, common.PVT_STREAM)``).

  Returns:
    ``bool[num_leaves]``: True = trained (always True for non-freezable
    leaves; all True when ``plan.trains_everything``).
  """
  num = len(plan.sizes)
  base = jnp.asarray(np.logical_not(plan.freezable))
  idx = plan.freezable_indices
  if plan.trains_everything or not idx:
    return jnp.ones((num,), bool)
  perm_key, u_key = jax.random.split(key)
  order = jax.random.permutation(perm_key, jnp.asarray(idx, jnp.int32))
  u = jax.random.uniform(u_key, (), jnp.float32)
  j = jnp.arange(len(idx), dtype=jnp.float32)
  p = jnp.float32(plan.probability)
  chosen = jnp.floor(u + p * (j + 1)) > jnp.floor(u + p * j)
  return base.at[order].set(chosen)


def check_mask(plan: PVTPlan, mask: Any) -> np.ndarray:
  """Validates an explicit mask (host) and returns it as ``bool[num_leaves]``.

  Raises:
    ValueError: wrong length, a frozen non-freezable leaf, or a mask that
      trains no variable.
  """
  mask = np.asarray(mask, bool).reshape(-1)
  if mask.shape != (len(plan.sizes),):
    raise ValueError(f'PVT mask has {mask.size} entries; the model has '
                     f'{len(plan.sizes)} variables.')
  bad = [n for n, m, f in zip(plan.names, mask, plan.freezable)
         if not m and not f]
  if bad:
    raise ValueError(f'PVT mask freezes non-freezable variables {bad}.')
  if not mask.any():
    raise ValueError('PVT mask leaves no trainable variable.')
  return mask


def mask_tree(mask: jax.Array, like: PyTree, dtype: Any = jnp.float32
              ) -> PyTree:
  """The mask as a pytree shaped like ``like``: one scalar (0/1) per leaf."""
  leaves, treedef = jax.tree.flatten(like)
  return jax.tree.unflatten(
      treedef, [mask[i].astype(dtype) for i in range(len(leaves))])


def apply_mask(tree: PyTree, mask: jax.Array) -> PyTree:
  """Zeroes the frozen leaves of ``tree`` (jittable)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
      treedef, [jnp.where(mask[i], x, jnp.zeros_like(x))
                for i, x in enumerate(leaves)])


def trained_params(plan: PVTPlan, mask: Any) -> int:
  """Parameters a mask trains (host)."""
  mask = np.asarray(mask, bool).reshape(-1)
  return int(sum(s for s, m in zip(plan.sizes, mask) if m))


def realized_fraction(plan: PVTPlan, mask: Any) -> float:
  """Trained share of the parameters under ``mask`` (host)."""
  return trained_params(plan, mask) / plan.num_params


def masked_bits(leaf_bits: Sequence[float], mask: Any) -> float:
  """Upload size of the trained leaves: ``sum_i mask_i * leaf_bits_i``.

  Args:
    leaf_bits: bits of each leaf's message (``jax.tree.leaves`` order).
    mask: ``bool[num_leaves]``.

  Returns:
    Bits (Python float).

  Raises:
    ValueError: if the lengths differ.
  """
  mask = np.asarray(mask, bool).reshape(-1)
  if len(leaf_bits) != mask.size:
    raise ValueError(f'{len(leaf_bits)} leaf bit counts for a mask of '
                     f'{mask.size} leaves.')
  return float(sum(b for b, m in zip(leaf_bits, mask) if m))


def expected_masked_bits(plan: PVTPlan, leaf_bits: Sequence[float]) -> float:
  """Expected upload size over masks: ``sum_i P(leaf i trained) leaf_bits_i``.

  Non-freezable leaves count fully, freezable ones with probability
  ``plan.probability``; for per-value costs this is ``fraction`` of the
  unmasked size (plus the per-leaf overheads of the expected leaves).

  Raises:
    ValueError: if ``leaf_bits`` does not have one entry per leaf.
  """
  if len(leaf_bits) != len(plan.sizes):
    raise ValueError(f'{len(leaf_bits)} leaf bit counts for a model of '
                     f'{len(plan.sizes)} leaves.')
  p = plan.probability
  return float(sum(b * (p if f else 1.0)
                   for b, f in zip(leaf_bits, plan.freezable)))


def _shape_struct(tree: PyTree) -> PyTree:
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def leaf_bits(transform: Optional[base.CommTransform], params: PyTree,
              name: str = 'PVT') -> tuple[float, ...]:
  """Message size of each variable encoded alone, ``jax.tree.leaves`` order.

  Args:
    transform: a stateless per-variable CommTransform chain (e.g.
      ``uniform_quantization(8)``), or None (32 bits per float32 value).
    params: pytree of arrays or ``jax.ShapeDtypeStruct``.
    name: the algorithm, for error messages.

  Returns:
    Bits per leaf (Python floats).

  Raises:
    ValueError: the transform cannot encode a single variable (e.g. a top-k
      whose k exceeds a variable), or its size for the whole model is not
      the sum of the per-variable sizes.
  """
  example = _shape_struct(params)
  leaves = jax.tree.leaves(example)
  if transform is None:
    return tuple(float(base.dtype_bits(x.dtype) * math.prod(x.shape))
                 for x in leaves)
  try:
    bits = tuple(float(base.message_bits(transform, [x])) for x in leaves)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f'{name}: PVT needs an upload transform that encodes each variable '
        f'on its own, with a size that is a sum over variables; this one '
        f'cannot encode a single variable ({e})') from None
  whole = float(base.message_bits(transform, example))
  if not np.isclose(whole, sum(bits), rtol=1e-9, atol=0):
    raise ValueError(
        f'{name}: PVT needs an upload transform whose size is a sum over '
        f'variables; this one sends {whole} bits for the model but '
        f'{sum(bits)} for its variables one by one.')
  return bits


def masked_upload(transform: Optional[base.CommTransform], state: Any,
                  tree: PyTree, mask: jax.Array, key: jax.Array) -> PyTree:
  """What the server receives from a PVT client (jittable).

  Args:
    transform: the upload CommTransform (stateless or read-only state), or
      None (sent as is).
    state: its state.
    tree: the client's update pytree.
    mask: ``bool[num_leaves]`` (:func:`sample_mask`).
    key: the upload quantizer's key.

  Returns:
    ``decode(encode(tree))`` with the frozen leaves exactly zero (their
    values are never sent; :func:`masked_bits` counts only trained leaves).
  """
  if transform is not None:
    message, _ = transform.encode(tree, state, key)
    tree, _ = transform.decode(message, state)
  return apply_mask(tree, mask)
