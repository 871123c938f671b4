"""Partial Variable Training (PVT) masks, per client per round.

Sources: Yang, Xiao, Wang, et al., "Partial Variable Training for Efficient
On-Device Federated Learning" (2021), the per-client-per-round (PCPR)
configuration; Ro et al., "Scaling Language Model Size in Cross-Device
Federated Learning" (2022), Section 4 and Appendix B: each sampled client
freezes a fresh random subset of the *multiplicative* variables ("the
embedding and weights of the LSTM, and for the Transformer, the weights of
the MLP layer, attention matrices, layer normalization in each block, and
embedding") so that the trainable share of the parameters is 10%..90%; only
the trained variables are uploaded, and the server averages each variable
over the clients that trained it. Ro et al. note that "the number of
trainable variables might average to the desired percentage" and varies a
lot per round for the LSTM (few, large variables): the target is met in
expectation, not per client.

Pure functions over pytrees (no FedJAX, jittable where stated), used by
:mod:`fedlite_jax.algorithms.efficient`:

* :func:`make_plan` (host): which leaves are freezable, their sizes, and the
  inclusion probability ``p`` of a freezable leaf.
* :func:`sample_mask` (jittable): a ``bool[num_leaves]`` mask from a PRNG key.
* :func:`mask_tree`, :func:`apply_mask`: the mask as a pytree of scalars.
* :func:`trained_params`, :func:`realized_fraction`, :func:`masked_bits`
  (host): what a mask trains and what its upload costs;
  :func:`expected_masked_bits`: its expectation over masks.
* :func:`gated_grad_fn` (jittable): a gradient function that does not
  compute the weight gradients of frozen variables (see "Compute savings").

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

Compute savings (:func:`gated_grad_fn`). A client's mask is sampled inside
its compiled program (it is data, not structure: one compiled step serves
every mask), so "differentiate only w.r.t. the trained variables" cannot be a
different ``jax.grad`` per client without one compilation per mask. Instead
the gradient program is split by data flow: the backward-pass operations
whose results reach ONLY the gradient of one freezable variable (its weight
gradient ``x^T dy`` of a dense layer, the scatter-add of an embedding, and
the whole backward chain below the first layer when only the embedding needs
it) are moved into a ``lax.cond`` on that variable's mask bit, whose false
branch returns zeros. Everything reaching another variable's gradient (the
activation gradients ``dy W^T``) runs as before. On XLA:CPU/GPU a
``lax.cond`` with an unbatched predicate executes one branch, so a frozen
variable's weight-gradient matmuls are skipped (the round engine's ``loop``
path, one client per call). Under ``jax.vmap`` over clients (the ``vmap``
engine) the predicate is batched, ``cond`` becomes a select that evaluates
both branches, and nothing is saved (results are still exact). Higher-order
operations (``lax.scan`` of the LSTM, ``custom_vjp`` calls, ...) are not
split: a weight gradient computed inside the LSTM's backward scan is always
computed. The forward pass and the activation gradients are always needed,
so the saving is at most the weight-gradient share of a step (about a third
of the FLOPs of a dense layer).

Bad input (``ValueError`` naming the value): ``f`` outside (0, 1]; no
freezable leaf while ``f < 1``; ``f N < A`` (the target is below the
always-trained share); ``n p < 1`` on a model with no always-trained
parameter (some clients would train nothing); an explicit mask that trains
no variable (:func:`check_mask`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax
import numpy as np

PyTree = Any
Path = tuple[Any, ...]

MULTIPLICATIVE_NAMES = ('kernel', 'embedding', 'scale', 'projection',
                        'pos_embedding')
"""Leaf names treated as multiplicative (freezable) by default: dense and
LSTM kernels (attention q/k/v/out and MLP kernels in the Transformer), the
LSTM projection, token and position embeddings, LayerNorm scales."""

# fold_in tag of the PVT key (ASCII 'pvt!'): the client's training stream is
# untouched, so PVT 100% reproduces FedAvg's dropout/shuffle draws.
PVT_STREAM = 0x70767421


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
      ``jax.random.fold_in(client_key, PVT_STREAM)``).

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


# ---------------------------------------------------------------------------
# Gradients that skip frozen variables (module docstring, "Compute savings").

# Call-like primitives whose body is inlined before the split (FedJAX's
# ``model_grad`` and flax/our models wrap their computations in ``jax.jit``,
# so without inlining the whole backward pass is ONE opaque equation).
_INLINE_PRIMITIVES = ('jit', 'pjit', 'closed_call', 'core_call')


@dataclasses.dataclass
class _Node:
  """One primitive application of the flattened gradient program."""
  primitive: Any
  params: dict
  inputs: list  # of refs: ('in', k) | ('lit', value) | ('node', j, out)
  num_outputs: int
  ctx: Any  # the equation's context (e.g. its compute type), re-entered


def _flatten_jaxpr(jaxpr: Any, consts: Sequence[Any], in_refs: list,
                   nodes: list[_Node]) -> list:
  """Appends ``jaxpr``'s equations to ``nodes`` (inlining calls); out refs."""
  env = {}
  for var, value in zip(jaxpr.constvars, consts):
    env[var] = ('lit', value)
  for var, ref in zip(jaxpr.invars, in_refs):
    env[var] = ref

  def read(v):
    if isinstance(v, jex.core.Literal):
      return ('lit', v.val)
    return env[v]

  for eqn in jaxpr.eqns:
    refs = [read(v) for v in eqn.invars]
    inner = eqn.params.get('jaxpr') if eqn.primitive.name in (
        _INLINE_PRIMITIVES) else None
    if inner is not None:
      if isinstance(inner, jex.core.ClosedJaxpr):
        inner_jaxpr, inner_consts = inner.jaxpr, inner.consts
      else:
        inner_jaxpr, inner_consts = inner, ()
      outs = _flatten_jaxpr(inner_jaxpr, inner_consts, refs, nodes)
    else:
      nodes.append(_Node(eqn.primitive, dict(eqn.params), refs,
                         len(eqn.outvars), getattr(eqn, 'ctx', None)))
      j = len(nodes) - 1
      outs = [('node', j, o) for o in range(len(eqn.outvars))]
    for var, ref in zip(eqn.outvars, outs):
      if not isinstance(var, jex.core.DropVar):
        env[var] = ref
  return [read(v) for v in jaxpr.outvars]


def _bind(node: _Node, values: Sequence[Any]) -> list:
  """Applies one primitive as ``jax.core.eval_jaxpr`` does (JAX 0.10)."""
  params = node.primitive.get_bind_params(node.params)
  if isinstance(params, tuple):  # older JAX: (subfuns, params)
    subfuns, params = params
    values = [*subfuns, *values]
  manager = getattr(node.ctx, 'manager', None)
  if manager is None:
    out = node.primitive.bind(*values, **params)
  else:
    with manager:
      out = node.primitive.bind(*values, **params)
  return list(out) if node.primitive.multiple_results else [out]


def _split_program(nodes: list[_Node], out_refs: list, gated: Sequence[bool]
                   ) -> list[int]:
  """Owner of each node: -1 = shared/main, i = only output i needs it.

  ``reach[j]`` is the set (a bit mask) of outputs node ``j`` contributes to;
  bit ``len(out_refs)`` stands for every output that is not gated. A node is
  owned by gated output ``i`` iff it reaches output ``i`` and nothing else.
  Nodes that reach nothing are dead (owner -2).
  """
  n_out = len(out_refs)
  shared_bit = 1 << n_out
  reach = [0] * len(nodes)
  for i, ref in enumerate(out_refs):
    if ref[0] == 'node':
      reach[ref[1]] |= (1 << i) if gated[i] else shared_bit
  for j in range(len(nodes) - 1, -1, -1):
    r = reach[j]
    if r:
      for ref in nodes[j].inputs:
        if ref[0] == 'node':
          reach[ref[1]] |= r
  owner = []
  for r in reach:
    if r == 0:
      owner.append(-2)
    elif r & shared_bit or r & (r - 1):
      owner.append(-1)
    else:
      owner.append(r.bit_length() - 1)
  return owner


def gated_grad_fn(grad_fn: Callable[..., PyTree],
                  gate: Optional[Sequence[bool]] = None
                  ) -> Callable[..., PyTree]:
  """``grad_fn`` that skips the gradient work of masked-out variables.

  Returns ``g(params, *args, mask)`` equal to ``apply_mask(grad_fn(params,
  *args), mask)``, where the backward-pass operations that contribute only to
  the gradient of a gated variable ``i`` run inside ``lax.cond(mask[i], ...,
  zeros)`` (module docstring, "Compute savings"; under ``vmap`` both branches
  run). The same primitives run on the same inputs as in ``grad_fn``, so
  results agree with the masked full gradient to float rounding (XLA may fuse
  the split program differently; ``tests/test_pvt.py`` checks it).

  Args:
    grad_fn: ``(params, *args) -> grads`` with ``grads`` shaped like
      ``params`` (e.g. ``fedjax.model_grad(model)``, called as ``(params,
      batch, rng)``); traced once per input shapes with
      ``jax.make_jaxpr``.
    gate: per leaf (``jax.tree.leaves(params)`` order), whether the leaf may
      be masked out (e.g. ``plan.freezable``); default: every leaf. Leaves
      that are not gated are always computed (and still masked).

  Returns:
    ``(params, *args, mask) -> grads`` with ``mask`` ``bool[num_leaves]``
    (traced data: one compiled program serves every mask). Frozen leaves
    are exactly zero.

  Raises:
    ValueError: if ``grad_fn``'s output does not have one leaf per
      parameter leaf, or ``gate`` has the wrong length.
  """

  def gated(params, *args):
    *args, mask = args
    flat_in, _ = jax.tree.flatten((params, *args))
    num = len(jax.tree.leaves(params))
    gates = [True] * num if gate is None else [bool(g) for g in gate]
    if len(gates) != num:
      raise ValueError(f'gate has {len(gates)} entries; params have {num} '
                       'leaves.')
    closed, out_shape = jax.make_jaxpr(grad_fn, return_shape=True)(
        params, *args)
    out_leaves, out_def = jax.tree.flatten(out_shape)
    if len(out_leaves) != num:
      raise ValueError(f'grad_fn returned {len(out_leaves)} leaves for '
                       f'{num} parameter leaves.')
    gates = [g and jnp.issubdtype(o.dtype, jnp.floating)
             for g, o in zip(gates, out_leaves)]
    nodes: list[_Node] = []
    out_refs = _flatten_jaxpr(closed.jaxpr, closed.consts,
                              [('in', k) for k in range(len(flat_in))], nodes)
    owner = _split_program(nodes, out_refs, gates)
    values: dict[int, list] = {}

    def read(ref, local=None):
      if ref[0] == 'in':
        return flat_in[ref[1]]
      if ref[0] == 'lit':
        return ref[1]
      if local is not None and ref[1] in local:
        return local[ref[1]][ref[2]]
      return values[ref[1]][ref[2]]

    for j, node in enumerate(nodes):  # shared part, in program order
      if owner[j] == -1:
        values[j] = _bind(node, [read(r) for r in node.inputs])
    groups: dict[int, list[int]] = {}
    for j, o in enumerate(owner):
      if o >= 0:
        groups.setdefault(o, []).append(j)
    grads = []
    for i, ref in enumerate(out_refs):
      group = groups.get(i)
      if not group:  # not gated, or nothing of its own to skip
        grads.append(read(ref))
        continue
      members = set(group)
      external = sorted({r for j in group for r in nodes[j].inputs
                         if r[0] == 'in' or (r[0] == 'node' and
                                             r[1] not in members)})
      aval = out_leaves[i]

      def compute(ops, group=group, external=external, ref=ref, aval=aval):
        ext = dict(zip(external, ops))
        local = {}
        for j in group:
          local[j] = _bind(nodes[j], [
              r[1] if r[0] == 'lit' else ext.get(r) if r in ext else
              local[r[1]][r[2]] for r in nodes[j].inputs])
        return jnp.asarray(read(ref, local), aval.dtype)

      def zeros(ops, aval=aval):
        del ops
        return jnp.zeros(aval.shape, aval.dtype)

      grads.append(lax.cond(mask[i], compute, zeros,
                            tuple(read(r) for r in external)))
    grads = [jnp.where(mask[i], g, jnp.zeros_like(g))
             for i, g in enumerate(grads)]
    return jax.tree.unflatten(out_def, grads)

  return gated
