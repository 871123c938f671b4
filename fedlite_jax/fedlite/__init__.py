"""FedLite (Wang et al.): grouped PQ (Section 4.1), corrected layer (4.2)."""

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
