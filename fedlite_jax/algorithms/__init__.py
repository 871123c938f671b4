"""Federated algorithms as ``fedjax.FederatedAlgorithm`` builders."""

from fedlite_jax.algorithms.fedavg import ServerState
from fedlite_jax.algorithms.fedavg import federated_averaging
