"""Composable communication transforms: ``init`` / ``encode`` / ``decode`` + bits.

In the spirit of optax's ``GradientTransformation`` and ``optax.chain``: a
transform is a :class:`CommTransform`, a NamedTuple of three pure functions
over pytrees, and transforms compose with :func:`chain`. No FedJAX
dependency; the federated algorithms in :mod:`fedlite_jax.algorithms` use
them on the client (encode) and server (decode) side.

Interface
---------
``t = some_transform(...)``; then

* ``state = t.init(example)`` -- ``example`` is a pytree shaped like the
  inputs (only shapes/dtypes are read; ``jax.ShapeDtypeStruct`` leaves are
  fine). Sender and receiver each keep their own state. ``init`` may run host
  code (the intrinsic projection draws Fastfood permutations with NumPy).
* ``message, state = t.encode(x, state, key)`` -- pure, jittable, vmappable;
  ``key`` is an explicit JAX PRNG key from which every random choice derives
  (derive it from seed, round and client).
* ``x_hat, state = t.decode(message, state)`` -- pure, jittable; ``x_hat``
  has ``x``'s structure, shapes and dtypes.

``message`` is an :class:`Encoded` pytree:

* ``values``: the floating payload as the receiver reconstructs it; the next
  transform of a chain encodes exactly this.
* ``side``: side information later transforms pass through untouched (top-k
  indices, the chosen subspace).
* ``value_bits``, ``side_bits`` (static Python floats) and ``bits =
  value_bits + side_bits``: the message size in bits, exact numbers the
  communication ledger adds (they survive ``jit``/``vmap``, and
  :func:`message_bits` computes them with ``jax.eval_shape`` without running
  anything).

``chain(t1, t2, ...)`` encodes left to right (``t2`` encodes ``t1``'s
``values``) and decodes right to left; its bits are those of the final
message: the last stage's ``value_bits`` plus every stage's ``side_bits``.
Example -- intrinsic projection, then 8-bit quantization of the d
coordinates::

    t = chain(intrinsic_projection(d=4096, seed=0), uniform_quantization(8))
    state = t.init(params)
    msg, _ = t.encode(grads, state, key)    # msg.bits == 8 * 4096 + 64
    approx, _ = t.decode(msg, state)        # pytree like grads

State. Federated clients keep nothing between their (rare) participations,
so the algorithms accept a transform only if its state is read-only:
``encode`` and ``decode`` return it untouched (:func:`state_is_read_only`
checks this on the traced functions; :func:`init_read_only` inits and
checks). ``intrinsic_projection``'s Fastfood matrices qualify (``init``
draws them from the seed, identically on both sides);
``top_k(error_feedback=True)``'s residual does not.

Flags. :func:`parse_chain` (:mod:`fedlite_jax.transforms.stages`) turns a
stage string such as ``'intrinsic_projection:4096,uniform_quantization:8'``
into a transform; the runner's ``--upload`` / ``--download`` flags use it.

Writing a new transform (a quantizer, a PVT mask, ...): return
``CommTransform(init, encode, decode)``; make ``encode`` return
``Encoded(values, side, value_bits, side_bits, spec)`` with bit counts
computed from static shapes; put anything a later stage must not alter into
``side``; record ``TreeSpec.of(x)`` as ``spec`` if ``decode`` must rebuild
the input's structure. One :func:`register_stage` call makes it a stage of
:func:`parse_chain` (and of the runner's ``--upload`` / ``--download``); a
built-in one is one new module plus one such line in ``stages.py``. E.g.
signs with one float32 scale (mean ``|x|``) per leaf, after top-k:

>>> import jax, jax.numpy as jnp
>>> from fedlite_jax import transforms as T
>>> def sign_mean():
...   def encode(x, state, key):
...     values = jax.tree.map(lambda v: jnp.sign(v) * jnp.abs(v).mean(), x)
...     bits = sum(v.size + 32 for v in jax.tree.leaves(x))  # signs + scale
...     return T.Encoded(values, (), float(bits), 0.0), state
...   return T.CommTransform(T.no_state, encode, T.decode_values)
>>> T.register_stage('sign_mean', lambda args, seed, generator: sign_mean())
>>> t = T.parse_chain('top_k:2,sign_mean')
>>> x = jnp.array([0.5, -2.0, 0.1, 3.0])
>>> message, _ = t.encode(x, t.init(x), jax.random.PRNGKey(0))
>>> message.bits  # 2 signs + one 32-bit scale + 2 indices of log2(4) bits
38.0
>>> t.decode(message, t.init(x))[0].tolist()
[0.0, -2.5, 0.0, 2.5]

Transforms here
---------------
* :func:`identity`: uncompressed (32 bits per float32 value).
* :func:`intrinsic_projection`: ``(k, A^(k)T x)`` with Fastfood matrices
  (Melas-Kyriazi & Wang 2022, Alg. 1-3); static (K = 1), K-subspace, and
  per-epoch seeds via :func:`intrinsic_state` (time-varying).
* :func:`top_k`: local Top-K (values + indices; ``index_bits='log2'`` or
  FetchSGD's ``'none'``), optional sender-side error feedback.
* :func:`count_sketch`: FetchSGD's count sketch (rows x cols), decode =
  median estimates (+ top-k).
* :func:`uniform_quantization` (:mod:`~fedlite_jax.transforms.uniform`:
  stochastic k-level quantization, Suresh et al. 2017; Ro et al. 2022) and
  :func:`terngrad` (:mod:`~fedlite_jax.transforms.ternary`: Wen et al. 2017).
"""

from fedlite_jax.transforms.base import chain
from fedlite_jax.transforms.base import CommTransform
from fedlite_jax.transforms.base import decode_values
from fedlite_jax.transforms.base import dtype_bits
from fedlite_jax.transforms.base import Encoded
from fedlite_jax.transforms.base import identity
from fedlite_jax.transforms.base import init_read_only
from fedlite_jax.transforms.base import message_bits
from fedlite_jax.transforms.base import no_state
from fedlite_jax.transforms.base import state_is_read_only
from fedlite_jax.transforms.base import TreeSpec
from fedlite_jax.transforms.intrinsic import index_bits
from fedlite_jax.transforms.intrinsic import intrinsic_projection
from fedlite_jax.transforms.intrinsic import intrinsic_state
from fedlite_jax.transforms.intrinsic import IntrinsicState
from fedlite_jax.transforms.intrinsic import lift_subspaces
from fedlite_jax.transforms.intrinsic import project_subspaces
from fedlite_jax.transforms.intrinsic import sample_subspace
from fedlite_jax.transforms.intrinsic import make_subspaces
from fedlite_jax.transforms.intrinsic import select_subspace
from fedlite_jax.transforms.intrinsic import subspace_seed
from fedlite_jax.transforms.sketch import count_sketch
from fedlite_jax.transforms.sketch import median_rows
from fedlite_jax.transforms.sketch import sketch_hashes
from fedlite_jax.transforms.sketch import sketch_message_bits
from fedlite_jax.transforms.sketch import sketch_vector
from fedlite_jax.transforms.sketch import unsketch
from fedlite_jax.transforms.stages import parse_chain
from fedlite_jax.transforms.stages import register_stage
from fedlite_jax.transforms.stages import STAGE_FORMS
from fedlite_jax.transforms.ternary import terngrad
from fedlite_jax.transforms.topk import scatter
from fedlite_jax.transforms.topk import top_k
from fedlite_jax.transforms.topk import topk_abs
from fedlite_jax.transforms.topk import topk_message_bits
from fedlite_jax.transforms.uniform import uniform_quantization
from fedlite_jax.transforms import pvt
from fedlite_jax.transforms.product_quantization import product_quantization

__all__ = [
    'CommTransform',
    'Encoded',
    'IntrinsicState',
    'STAGE_FORMS',
    'TreeSpec',
    'chain',
    'count_sketch',
    'decode_values',
    'dtype_bits',
    'identity',
    'index_bits',
    'init_read_only',
    'intrinsic_projection',
    'intrinsic_state',
    'lift_subspaces',
    'project_subspaces',
    'sample_subspace',
    'make_subspaces',
    'median_rows',
    'message_bits',
    'no_state',
    'parse_chain',
    'product_quantization',
    'pvt',
    'register_stage',
    'scatter',
    'select_subspace',
    'sketch_hashes',
    'sketch_message_bits',
    'sketch_vector',
    'state_is_read_only',
    'subspace_seed',
    'terngrad',
    'top_k',
    'topk_abs',
    'topk_message_bits',
    'uniform_quantization',
    'unsketch',
]
