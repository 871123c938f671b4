"""FedLite (Wang et al.): grouped product quantization of activations and the
gradient-corrected quantization layer, as pure JAX functions.

* :mod:`fedlite_jax.fedlite.pq`: the quantizer of Section 4.1 and its message
  size in bits; its batched Lloyd k-means in :mod:`fedlite_jax.fedlite.kmeans`.
* :mod:`fedlite_jax.fedlite.vq_layer`: the ``custom_vjp`` layer of Section
  4.2 (equation 5) and a Flax module.

No FedJAX dependency.
"""

from fedlite_jax.fedlite.pq import DEFAULT_NUM_ITERS
from fedlite_jax.fedlite.pq import DEFAULT_PHI
from fedlite_jax.fedlite.pq import group_subvectors
from fedlite_jax.fedlite.pq import grouped_pq
from fedlite_jax.fedlite.pq import kmeans_init_indices
from fedlite_jax.fedlite.pq import pq_compression_ratio
from fedlite_jax.fedlite.pq import pq_message_bits
from fedlite_jax.fedlite.pq import PQResult
from fedlite_jax.fedlite.pq import quantization_errors
from fedlite_jax.fedlite.pq import uncompressed_bits
from fedlite_jax.fedlite.pq import ungroup_subvectors
from fedlite_jax.fedlite.pq import validate_pq_config
from fedlite_jax.fedlite.vq_layer import correction_coefficient
from fedlite_jax.fedlite.vq_layer import FedLiteQuantizer
from fedlite_jax.fedlite.vq_layer import quantize_with_correction
from fedlite_jax.fedlite.vq_layer import vq_with_correction
from fedlite_jax.fedlite.vq_layer import input_derived_key
from fedlite_jax.fedlite.vq_layer import RNG_COLLECTION
