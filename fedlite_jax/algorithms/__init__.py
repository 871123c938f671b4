"""Federated algorithms as ``fedjax.FederatedAlgorithm`` builders.

:mod:`fedopt` is the round of every delta-based method; :mod:`mime_lite`,
:mod:`igc`, :mod:`fetchsgd` and :mod:`splitfed` add their own rules.
"""

from fedlite_jax.algorithms.fedopt import Compression
from fedlite_jax.algorithms.fedopt import compressed_sgd
from fedlite_jax.algorithms.fedopt import efficient_federated_averaging
from fedlite_jax.algorithms.fedopt import federated_averaging
from fedlite_jax.algorithms.fedopt import FedOptState
from fedlite_jax.algorithms.mime_lite import efficient_mime_lite
