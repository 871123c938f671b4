"""Communication transforms: ``init`` / ``encode`` / ``decode`` plus bits.

Like optax's ``GradientTransformation`` and ``chain``: a :class:`CommTransform`
is three pure functions over pytrees, composed by :func:`chain`; the
algorithms encode on the client and decode on the server.

* ``state = t.init(example)``: reads shapes/dtypes only (``ShapeDtypeStruct``
  leaves are fine); may run host code.
* ``message, state = t.encode(x, state, key)``: pure, jittable, vmappable;
  every random choice derives from the PRNG ``key``.
* ``x_hat, state = t.decode(message, state)``: pure, jittable; ``x_hat`` has
  ``x``'s structure, shapes and dtypes.

``message`` is an :class:`Encoded`: ``values`` (what the receiver
reconstructs; a chain's next stage encodes it), ``side`` (passed through by
later stages: top-k indices, the subspace) and static bit counts
``bits = value_bits + side_bits`` (:func:`message_bits`). A chain's bits are
the last stage's ``value_bits`` plus every stage's ``side_bits``. The
algorithms accept only a read-only state (:func:`init_read_only`).
:func:`parse_chain` builds a transform from a stage string such as
``'intrinsic_projection:4096,uniform_quantization:8'``.

Beside the transforms sit the kernels they use and the reparameterization:
:mod:`~fedlite_jax.transforms.fwht` and :mod:`~fedlite_jax.transforms.fastfood`
(the ``D x d`` matrix ``A`` of :func:`intrinsic_projection`),
:mod:`~fedlite_jax.transforms.pq` and :mod:`~fedlite_jax.transforms.kmeans`
(FedLite's grouped PQ, :func:`product_quantization`), and
:mod:`~fedlite_jax.transforms.reparameterization` (training in the subspace
``theta_0 + A theta'``).

A new stage returns ``CommTransform(init, encode, decode)`` whose ``encode``
returns ``Encoded(values, side, value_bits, side_bits, spec)`` (bits from
static shapes; ``spec = TreeSpec.of(x)`` if ``decode`` rebuilds the input)
and is registered with :func:`register_stage`. E.g. signs with one float32
scale (mean ``|x|``) per leaf, after top-k:

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
"""

from fedlite_jax.transforms.base import (
    chain, CommTransform, decode_values, dtype_bits, Encoded, identity,
    init_read_only, message_bits, no_state, state_is_read_only, TreeSpec)
from fedlite_jax.transforms.intrinsic import (
    index_bits, intrinsic_projection, intrinsic_state, IntrinsicState,
    lift_subspaces, project_subspaces, sample_subspace, make_subspaces,
    select_subspace, subspace_seed)
from fedlite_jax.transforms.sketch import (
    count_sketch, median_rows, sketch_hashes, sketch_message_bits,
    sketch_vector, unsketch)
from fedlite_jax.transforms.stages import (
    parse_chain, register_stage, STAGE_FORMS)
from fedlite_jax.transforms.ternary import terngrad
from fedlite_jax.transforms.topk import (
    scatter, top_k, topk_abs, topk_message_bits)
from fedlite_jax.transforms.uniform import uniform_quantization
from fedlite_jax.transforms.product_quantization import product_quantization
from fedlite_jax.transforms import pvt

__all__ = [
    'CommTransform', 'Encoded', 'IntrinsicState', 'STAGE_FORMS', 'TreeSpec',
    'chain', 'count_sketch', 'decode_values', 'dtype_bits', 'identity',
    'index_bits', 'init_read_only', 'intrinsic_projection',
    'intrinsic_state', 'lift_subspaces', 'project_subspaces',
    'sample_subspace', 'make_subspaces', 'median_rows', 'message_bits',
    'no_state', 'parse_chain', 'product_quantization', 'pvt',
    'register_stage', 'scatter', 'select_subspace', 'sketch_hashes',
    'sketch_message_bits', 'sketch_vector', 'state_is_read_only',
    'subspace_seed', 'terngrad', 'top_k', 'topk_abs', 'topk_message_bits',
    'uniform_quantization', 'unsketch']
