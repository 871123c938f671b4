"""The communication-transform interface: ``init`` / ``encode`` / ``decode``.

Types, :func:`chain`, :func:`identity` and :func:`message_bits`; the contract
is in the package docstring (:mod:`fedlite_jax.transforms`).
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
    'CommTransform', 'Encoded', 'TreeSpec', 'chain', 'decode_values',
    'identity', 'message_bits', 'no_state', 'dtype_bits', 'init_read_only',
    'state_is_read_only']


def dtype_bits(dtype: Any) -> int:
  """Bits of one value of ``dtype`` sent uncompressed (float32: 32)."""
  return int(np.dtype(dtype).itemsize) * 8


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """Hashable structure, shapes and dtypes of a pytree (static metadata).

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
    """The leaves raveled and concatenated: ``dtype[size]``.

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
  """One message on the wire (a pytree; bits and spec are static metadata).

  Attributes:
    values: the floating payload as the receiver reconstructs it; a
      :func:`chain`'s next stage encodes it.
    side: pytree of arrays later stages pass through (top-k indices, the
      subspace, a chain's per-stage messages); possibly empty.
    value_bits: bits spent on ``values`` (Python float).
    side_bits: bits spent on ``side`` (Python float).
    spec: :class:`TreeSpec` of the input if ``decode`` needs it, else None.
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
  """A compression transform: three pure functions.

  Attributes:
    init: ``init(example) -> state``; reads shapes/dtypes only; may run host
      code (not necessarily jittable).
    encode: ``encode(x, state, key) -> (Encoded, state)``; jittable.
    decode: ``decode(message, state) -> (x_hat, state)``; jittable; ``x_hat``
      has the input's structure, shapes and dtypes.
  """
  init: Callable[[PyTree], State]
  encode: Callable[[PyTree, State, jax.Array], tuple[Encoded, State]]
  decode: Callable[[Encoded, State], tuple[PyTree, State]]


def _floating_spec(x: PyTree, what: str) -> TreeSpec:
  """``TreeSpec.of(x)``; ``TypeError`` for a non-floating leaf."""
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
  """``decode`` of transforms whose ``values`` are the reconstruction."""
  return message.values, state


def identity() -> CommTransform:
  """No compression: ``value_bits = sum over leaves of size * itemsize * 8``."""

  def encode(x, state, key):
    del key
    spec = _floating_spec(x, 'identity input')
    bits = float(sum(math.prod(s) * dtype_bits(t)
                     for s, t in zip(spec.shapes, spec.dtypes)))
    return Encoded(x, (), bits, 0.0, None), state

  return CommTransform(no_state, encode, decode_values)


def chain(*transforms: CommTransform) -> CommTransform:
  """Composes transforms: encode left to right, decode right to left.

  The message has the last stage's ``values`` and ``value_bits``, the sum of
  all stages' ``side_bits``, and ``side`` = the per-stage messages without
  ``values``. Stage ``i`` encodes with ``jax.random.split(key, n)[i]``; the
  state is the tuple of stage states.

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
  """``Encoded.bits`` of ``transform`` for inputs like ``example`` (eval_shape).

  Args:
    transform: the transform.
    example: pytree of arrays or ``jax.ShapeDtypeStruct``.
    state: the transform's state (default ``transform.init(example)``).
  """
  if state is None:
    state = transform.init(example)
  out = jax.eval_shape(
      lambda x, s: transform.encode(x, s, jax.random.PRNGKey(0))[0],
      example, state)
  return out.bits


def _forwards_state(fn: Callable[..., State], args: tuple,
                    state: State) -> bool:
  """True iff ``fn(*args, state)``'s jaxpr returns the state invars as is."""
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
  """Whether ``encode`` and ``decode`` forward ``state`` untouched (traced).

  Every returned state leaf must be the input leaf itself (not recomputed,
  even to equal values); an empty state is read-only.

  Args:
    transform: the transform.
    example: pytree of arrays or ``jax.ShapeDtypeStruct`` like the inputs.
    state: ``transform.init(example)``.
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

  Clients keep nothing between participations, so a client-side transform
  needs a read-only state (:func:`state_is_read_only`), e.g. the intrinsic
  projection's, not ``top_k(error_feedback=True)``'s residual.

  Args:
    transform: the transform.
    example: pytree of arrays or ``jax.ShapeDtypeStruct`` like the inputs.
    what: its name in the error message (e.g. ``'the upload transform'``).

  Returns:
    The state, to pass to every ``encode`` and ``decode``.

  Raises:
    ValueError: (one line) if ``encode`` or ``decode`` changes the state;
      also whatever ``transform.init`` raises.
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
