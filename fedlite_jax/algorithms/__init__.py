"""Federated algorithms as ``fedjax.FederatedAlgorithm`` builders.

:mod:`fedopt` is the one round of every delta-based method (FedAvg, FedAdam,
FedProx, MimeLite, SGD with local steps, Top-K, quantized / PVT variants);
:mod:`igc`, :mod:`fetchsgd` and :mod:`splitfed` add their own server rules.
"""

from fedlite_jax.algorithms.fedopt import Compression
from fedlite_jax.algorithms.fedopt import compressed_sgd
from fedlite_jax.algorithms.fedopt import efficient_federated_averaging
from fedlite_jax.algorithms.fedopt import efficient_mime_lite
from fedlite_jax.algorithms.fedopt import federated_averaging
from fedlite_jax.algorithms.fedopt import FedOptState
