"""Pure, jittable quantization transforms that also report their bit cost.

No FedJAX dependency. Each function takes one layer (array) or a pytree (one
leaf = one layer), an explicit JAX PRNG key, and returns
``Quantized(values, num_bits)``: the dequantized values (what the receiver
reconstructs; same shapes and dtypes) and the message size in bits.

* :func:`uniform_quantize` / :func:`uniform_quantize_tree`: stochastic k-level
  uniform quantization, ``k = 2**bits`` (Suresh et al. 2017; Ro et al. 2022,
  App. C), optional zero-centred grid and l-infinity clipping.
* :func:`terngrad_quantize` / :func:`terngrad_quantize_tree`: TernGrad (Wen et
  al. 2017), optional clipping at ``c * std``.
* ``generator='hash'`` (fast counter-based, default) or ``'threefry'``
  (``jax.random.uniform``): :mod:`fedlite_jax.quantization.rng`.
"""

from fedlite_jax.quantization.rng import GENERATORS
from fedlite_jax.quantization.rng import hash_bits
from fedlite_jax.quantization.rng import hash_uniform
from fedlite_jax.quantization.rng import random_uniform
from fedlite_jax.quantization.terngrad import DEFAULT_CLIP_STD
from fedlite_jax.quantization.terngrad import terngrad_num_bits
from fedlite_jax.quantization.terngrad import terngrad_quantize
from fedlite_jax.quantization.terngrad import terngrad_quantize_tree
from fedlite_jax.quantization.uniform import clip_by_std
from fedlite_jax.quantization.uniform import FLOAT_BITS
from fedlite_jax.quantization.uniform import MAX_BITS
from fedlite_jax.quantization.uniform import MIN_BITS
from fedlite_jax.quantization.uniform import passthrough_bits
from fedlite_jax.quantization.uniform import Quantized
from fedlite_jax.quantization.uniform import uniform_num_bits
from fedlite_jax.quantization.uniform import uniform_quantize
from fedlite_jax.quantization.uniform import uniform_quantize_tree
from fedlite_jax.quantization.uniform import validate_bits

__all__ = [
    'DEFAULT_CLIP_STD',
    'FLOAT_BITS',
    'GENERATORS',
    'MAX_BITS',
    'MIN_BITS',
    'Quantized',
    'clip_by_std',
    'hash_bits',
    'hash_uniform',
    'passthrough_bits',
    'random_uniform',
    'terngrad_num_bits',
    'terngrad_quantize',
    'terngrad_quantize_tree',
    'uniform_num_bits',
    'uniform_quantize',
    'uniform_quantize_tree',
    'validate_bits',
]
