"""The communication-transform interface: ``init`` / ``encode`` / ``decode``.

See the package docstring (:mod:`fedlite_jax.transforms`) for the contract.
This module holds the types (:class:`Encoded`, :class:`TreeSpec`,
:class:`CommTransform`), :func:`chain`, :func:`identity` and
:func:`message_bits`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from fedlite_jax.common import PyTree

State = Any

__all__ = [
    'CommTransform',
    'Encoded',
    'TreeSpec',
    'chain',
    'decode_values',
    'identity',
    'message_bits',
    'no_state',
    'dtype_bits',
    'init_read_only',
    'state_is_read_only',
]


def dtype_bits(dtype: Any) -> int:
  """Bits of one value of ``dtype`` sent uncompressed (float32: 32)."""
  return int(np.dtype(dtype).itemsize) * 8


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """Static description of a pytree of arrays: structure, shapes, dtypes.

  Hashable, so it can live in an :class:`Encoded`'s static metadata (it
  survives ``jit``, ``vmap`` and ``eval_shape``). Shape-changing transforms
  (top-k, intrinsic projection, sketches) record the spec of their input so
  that ``decode`` can rebuild a pytree of the same structure.

  Attributes:
    treedef: the tree structure.
    shapes: shape of each leaf, in ``jax.tree.leaves`` order.
    dtypes: dtype name of each leaf.
  """
  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]

  @classmethod
  def of(cls, tree: PyTree) -> 'TreeSpec':
    """The spec of ``tree`` (arrays, tracers or ``jax.ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(int(s) for s in jnp.shape(x)) for x in leaves)
    dtypes = tuple(jnp.result_type(x).name for x in leaves)
    return cls(treedef, shapes, dtypes)

  @property
  def size(self) -> int:
    """Total number of scalars (D)."""
    return int(sum(math.prod(s) for s in self.shapes))

  def check(self, tree: PyTree, what: str = 'input') -> None:
    """Raises ``ValueError`` unless ``tree`` has this structure and shapes."""
    other = TreeSpec.of(tree)
    if other.treedef != self.treedef or other.shapes != self.shapes:
      raise ValueError(
          f'{what}: pytree structure/shapes {other.treedef} {other.shapes} do '
          f'not match the expected {self.treedef} {self.shapes}.')

  def ravel(self, tree: PyTree, dtype: Any = jnp.float32) -> jax.Array:
    """Concatenates the raveled leaves (``jax.tree.leaves`` order) as ``dtype``.

    Raises:
      ValueError: if ``tree`` does not match this spec.
    """
    self.check(tree)
    leaves = jax.tree.leaves(tree)
    if not leaves:
      return jnp.zeros((0,), dtype)
    return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])

  def unravel(self, flat: jax.Array) -> PyTree:
    """Inverse of :meth:`ravel` (leaves cast back to their dtypes).

    Raises:
      ValueError: if ``flat`` does not have shape ``[size]``.
    """
    if flat.shape != (self.size,):
      raise ValueError(f'unravel expects shape ({self.size},); got '
                       f'{flat.shape}.')
    leaves, start = [], 0
    for shape, dtype in zip(self.shapes, self.dtypes):
      n = math.prod(shape)
      leaves.append(flat[start:start + n].reshape(shape).astype(dtype))
      start += n
    return jax.tree.unflatten(self.treedef, leaves)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=['values', 'side'],
    meta_fields=['value_bits', 'side_bits', 'spec'])
@dataclasses.dataclass(frozen=True)
class Encoded:
  """One message on the wire, with its size in bits.

  A JAX pytree whose array fields are ``values`` and ``side``; the bit counts
  and the input spec are static metadata, so they come back as exact Python
  numbers from ``jit``, ``vmap`` and ``jax.eval_shape`` (the latter computes
  a message's size without running the transform).

  Attributes:
    values: the floating payload as the receiver reconstructs it (e.g. the
      ``d`` intrinsic coordinates, the ``k`` top-k values, the dequantized
      values of a quantizer). In a :func:`chain` the next transform encodes
      exactly this.
    side: side information that later transforms of a chain pass through
      untouched (top-k indices, the chosen subspace, a chain's per-stage
      messages); a pytree of arrays, possibly empty.
    value_bits: bits spent on ``values`` as encoded (Python float).
    side_bits: bits spent on ``side`` (Python float).
    spec: :class:`TreeSpec` of this transform's input (for ``decode``), or
      None when ``decode`` does not need it.
  """
  values: PyTree
  side: PyTree
  value_bits: float
  side_bits: float
  spec: Optional[TreeSpec] = None

  @property
  def bits(self) -> float:
    """Total message size in bits: ``value_bits + side_bits``."""
    return self.value_bits + self.side_bits


class CommTransform(NamedTuple):
  """A (possibly stateful) compression transform: three pure functions.

  Attributes:
    init: ``init(example) -> state``. ``example`` is a pytree like the inputs
      to encode (only shapes/dtypes are read, so ``jax.ShapeDtypeStruct``
      leaves work). Sender and receiver each call ``init`` and keep their own
      state. May run host code (e.g. drawing a Fastfood permutation), so it
      is not necessarily jittable.
    encode: ``encode(x, state, key) -> (Encoded, state)``; pure and jittable;
      ``key`` is a JAX PRNG key (every random choice derives from it).
    decode: ``decode(message, state) -> (x_hat, state)``; pure and jittable;
      ``x_hat`` has the structure, shapes and dtypes of the encoded input.
  """
  init: Callable[[PyTree], State]
  encode: Callable[[PyTree, State, jax.Array], tuple[Encoded, State]]
  decode: Callable[[Encoded, State], tuple[PyTree, State]]


def _floating_spec(x: PyTree, what: str) -> TreeSpec:
  spec = TreeSpec.of(x)
  for dtype in spec.dtypes:
    if not jnp.issubdtype(np.dtype(dtype), jnp.floating):
      raise TypeError(f'{what} must have floating leaves; got {dtype}.')
  return spec


def no_state(example: PyTree) -> State:
  """``init`` of a stateless transform: the empty state ``()``."""
  del example
  return ()


def decode_values(message: Encoded, state: State) -> tuple[PyTree, State]:
  """``decode`` returning ``message.values`` unchanged.

  For transforms whose ``values`` already are the reconstruction of the
  input (:func:`identity`, the quantizers).
  """
  return message.values, state


def identity() -> CommTransform:
  """No compression: every value sent at its dtype width (float32: 32 bits).

  ``value_bits = sum over leaves of size * itemsize * 8``; ``decode`` returns
  the values unchanged.
  """

  def encode(x, state, key):
    del key
    spec = _floating_spec(x, 'identity input')
    bits = float(sum(math.prod(s) * dtype_bits(t)
                     for s, t in zip(spec.shapes, spec.dtypes)))
    return Encoded(x, (), bits, 0.0, None), state

  return CommTransform(no_state, encode, decode_values)


def chain(*transforms: CommTransform) -> CommTransform:
  """Composes transforms: encode left to right, decode right to left.

  ``chain(t1, t2).encode(x)`` encodes ``x`` with ``t1`` and then ``t1``'s
  ``values`` with ``t2``; ``decode`` undoes ``t2`` and then ``t1``. The chain's
  message has ``values`` of the last stage, ``value_bits`` of the last stage
  and ``side_bits`` summed over all stages (each stage's side information is
  sent too); ``side`` is the tuple of the per-stage messages with their
  ``values`` removed. Stage ``i`` encodes with ``jax.random.split(key, n)[i]``.
  The state is the tuple of stage states.

  Args:
    *transforms: one or more :class:`CommTransform`.

  Returns:
    A :class:`CommTransform`.

  Raises:
    ValueError: if no transform is given.
  """
  if not transforms:
    raise ValueError('chain() needs at least one transform.')
  n = len(transforms)

  def init(example):
    states = []
    current = example
    dummy_key = jax.random.PRNGKey(0)
    for i, t in enumerate(transforms):
      s = t.init(current)
      states.append(s)
      if i + 1 < n:
        shapes = jax.eval_shape(lambda x, s, t=t: t.encode(x, s, dummy_key)[0],
                                current, s)
        current = shapes.values
    return tuple(states)

  def encode(x, states, key):
    keys = jax.random.split(key, n)
    stages, new_states = [], []
    current = x
    for t, s, k in zip(transforms, states, keys):
      message, s = t.encode(current, s, k)
      new_states.append(s)
      stages.append(dataclasses.replace(message, values=None))
      current = message.values
    return Encoded(current, tuple(stages), stages[-1].value_bits,
                   float(sum(m.side_bits for m in stages)),
                   stages[0].spec), tuple(new_states)

  def decode(message, states):
    current = message.values
    new_states = list(states)
    for i in reversed(range(n)):
      stage = dataclasses.replace(message.side[i], values=current)
      current, new_states[i] = transforms[i].decode(stage, states[i])
    return current, tuple(new_states)

  return CommTransform(init, encode, decode)


def message_bits(transform: CommTransform, example: PyTree,
                 state: Optional[State] = None) -> float:
  """Size in bits of ``transform``'s message for inputs shaped like ``example``.

  Runs ``jax.eval_shape`` (nothing is computed), so it works for any size.

  Args:
    transform: the transform.
    example: pytree of arrays or ``jax.ShapeDtypeStruct``.
    state: the transform's state (default ``transform.init(example)``).

  Returns:
    ``Encoded.bits`` as a Python float.
  """
  if state is None:
    state = transform.init(example)
  out = jax.eval_shape(
      lambda x, s: transform.encode(x, s, jax.random.PRNGKey(0))[0],
      example, state)
  return out.bits


def _forwards_state(fn: Callable[..., State], args: tuple,
                    state: State) -> bool:
  """True iff ``fn(*args, state)`` returns ``state``'s leaves untouched.

  Traces ``fn`` (``jax.make_jaxpr``, nothing is computed) and checks that
  every output leaf is the very input variable of the same state leaf.
  """
  num_args = len(jax.tree.leaves(args))
  num_state = len(jax.tree.leaves(state))
  closed = jax.make_jaxpr(fn)(*args, state)
  jaxpr = closed.jaxpr
  state_in = jaxpr.invars[num_args:num_args + num_state]
  out = jaxpr.outvars
  if jax.tree.structure(jax.eval_shape(fn, *args, state)) != jax.tree.structure(
      state) or len(out) != len(state_in):
    return False
  return all(o is i for o, i in zip(out, state_in))


def state_is_read_only(transform: CommTransform, example: PyTree,
                       state: State) -> bool:
  """Whether ``encode`` and ``decode`` return ``state`` unchanged.

  A transform whose state is read-only (the intrinsic projection's Fastfood
  matrices, drawn by ``init`` from a seed) behaves like a stateless one with
  a constant: sender and receiver each build the same state with ``init``
  and nothing has to be kept between messages. A transform that updates its
  state (``top_k(error_feedback=True)``'s residual) carries memory from one
  message to the next.

  The check is exact for what it tests and runs nothing: it traces
  ``encode(x, state, key)`` and ``decode(message, state)`` with
  ``jax.make_jaxpr`` and requires every returned state leaf to BE the input
  state leaf (forwarded untouched, not recomputed, even to equal values).
  An empty state is read-only.

  Args:
    transform: the transform.
    example: pytree of arrays or ``jax.ShapeDtypeStruct`` shaped like the
      inputs.
    state: ``transform.init(example)``.

  Returns:
    True if both ``encode`` and ``decode`` forward the state.
  """
  if not jax.tree.leaves(state):
    return True
  key = jax.random.PRNGKey(0)
  encode_state = lambda x, k, s: transform.encode(x, s, k)[1]
  if not _forwards_state(encode_state, (example, key), state):
    return False
  message = jax.eval_shape(lambda x, s: transform.encode(x, s, key)[0],
                           example, state)
  decode_state = lambda m, s: transform.decode(m, s)[1]
  return _forwards_state(decode_state, (message,), state)


def init_read_only(transform: CommTransform, example: PyTree,
                   what: str = 'the transform') -> State:
  """``transform.init(example)``, refusing a state that encode/decode change.

  Federated clients take part in rare, random rounds and keep nothing in
  between, so a client-side transform may only have a read-only state (see
  :func:`state_is_read_only`): e.g. ``chain(intrinsic_projection(d),
  uniform_quantization(8))`` is accepted (both sides build the same Fastfood
  matrices from the seed), ``top_k(k, error_feedback=True)`` is refused.
  ``init`` must be a deterministic function of ``example`` (true for every
  transform of this package), so that sender and receiver agree.

  Args:
    transform: the transform.
    example: pytree of arrays or ``jax.ShapeDtypeStruct`` shaped like the
      inputs (only shapes and dtypes are read).
    what: its name in the error message (e.g. ``'the upload transform'``).

  Returns:
    The state, to pass to every ``encode`` and ``decode``.

  Raises:
    ValueError: (one line) if ``encode`` or ``decode`` returns a changed
      state; also whatever ``transform.init`` raises.
  """
  example = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
      example)
  state = transform.init(example)
  if not state_is_read_only(transform, example, state):
    raise ValueError(
        f'{what} updates its state in encode/decode (per-client memory such '
        'as top_k(error_feedback=True)\'s residual), but clients keep '
        'nothing between participations: use a stateless transform or one '
        'whose state is read-only (built by init, e.g. '
        'intrinsic_projection).')
  return state
