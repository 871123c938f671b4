"""Partial Variable Training (PVT): per-client, per-round masks of variables.

Sources: Yang et al., "Partial Variable Training for Efficient On-Device
Federated Learning" (2021), per-client-per-round configuration; Ro et al.,
"Scaling Language Model Size in Cross-Device Federated Learning" (2022),
Sec. 4 and App. B: each client freezes a random subset of the multiplicative
variables so that the trained share is ``f`` in expectation; only trained
variables are uploaded, averaged over the clients that trained them.

With ``N`` parameters, ``A`` of them never frozen and ``S = N - A`` in ``n``
freezable leaves, each freezable leaf is trained with ``p = (f N - A) / S``
(``E[trained] = f N``), chosen by systematic sampling over a random order:
leaf ``j`` is trained iff ``floor(u + p (j + 1)) > floor(u + p j)``,
``u ~ U[0, 1)`` (``floor(n p)`` or ``ceil(n p)`` leaves). ``f = 1`` is FedAvg.
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
"""Leaf names freezable by default (kernels, embeddings, LayerNorm scales)."""


def _key_name(entry: Any) -> str:
  """The name of one key-path entry."""
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_name(path: Path) -> str:
  """'a/b/c' for a ``jax.tree_util`` key path."""
  return '/'.join(_key_name(e) for e in path)


def is_multiplicative(path: Path, leaf: Any) -> bool:
  """Default freezable predicate: the leaf's name is in MULTIPLICATIVE_NAMES."""
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
  """Plans PVT for a model (host code).

  Args:
    params: the model parameters (arrays or ``jax.ShapeDtypeStruct``).
    fraction: target trainable share of the parameters, in (0, 1].
    is_freezable: ``(key path, leaf) -> bool``; default
      :func:`is_multiplicative`.

  Returns:
    A :class:`PVTPlan`.

  Raises:
    ValueError: fraction outside (0, 1]; no freezable leaf (with fraction <
      1); ``f N < A``; or ``n p < 1`` with ``A = 0`` (a client could train
      nothing).
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
    key: a JAX PRNG key (e.g. ``fold_in(client_key, common.PVT_STREAM)``).

  Returns:
    ``bool[num_leaves]``, True = trained.
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
  """An explicit mask, validated (host), as ``bool[num_leaves]``.

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
  """Upload bits of the trained leaves: ``sum_i mask_i * leaf_bits_i``.

  Raises:
    ValueError: if the lengths differ.
  """
  mask = np.asarray(mask, bool).reshape(-1)
  if len(leaf_bits) != mask.size:
    raise ValueError(f'{len(leaf_bits)} leaf bit counts for a mask of '
                     f'{mask.size} leaves.')
  return float(sum(b for b, m in zip(leaf_bits, mask) if m))


def expected_masked_bits(plan: PVTPlan, leaf_bits: Sequence[float]) -> float:
  """Expected upload bits: ``sum_i P(leaf i trained) leaf_bits_i``.

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
  """``tree`` as ``jax.ShapeDtypeStruct`` leaves."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def leaf_bits(transform: Optional[base.CommTransform], params: PyTree,
              name: str = 'PVT') -> tuple[float, ...]:
  """Bits of each variable encoded alone, ``jax.tree.leaves`` order.

  Args:
    transform: a stateless per-variable transform, or None (dtype width).
    params: pytree of arrays or ``jax.ShapeDtypeStruct``.
    name: the algorithm, for error messages.

  Raises:
    ValueError: the transform cannot encode a single variable, or its size
      for the whole model is not the sum of the per-variable sizes.
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
  """``decode(encode(tree))`` with frozen leaves zero: the server's view.

  Args:
    transform: the upload transform (read-only state), or None (sent as is).
    state: its state.
    tree: the client's update pytree.
    mask: ``bool[num_leaves]`` (:func:`sample_mask`).
    key: the upload quantizer's key.
  """
  if transform is not None:
    message, _ = transform.encode(tree, state, key)
    tree, _ = transform.decode(message, state)
  return apply_mask(tree, mask)
