"""Federated algorithms as ``fedjax.FederatedAlgorithm`` builders.

One entry point per algorithm:

* FedAvg, FedAdam, FedProx, their quantized / PVT variants and IGC's SGD,
  FedAvg-with-local-steps and local Top-K baselines:
  :func:`federated_averaging` (:mod:`~fedlite_jax.algorithms.fedopt`; named
  and called as ``fedjax.algorithms.fed_avg.federated_averaging``).
* MimeLite: :func:`efficient_mime_lite`
  (:mod:`~fedlite_jax.algorithms.mime_lite`).
* Intrinsic gradient compression (static, K-subspace, time-varying):
  :func:`fedlite_jax.algorithms.igc.intrinsic_gradient_compression`.
* FetchSGD: :func:`fedlite_jax.algorithms.fetchsgd.fetchsgd`.
* DP-FedAvg (central DP, clipping in the aggregation space): ``dp=``
  :class:`DP` of :func:`federated_averaging`, or on FedJAX's own clients
  :func:`dp_federated_averaging` (:class:`AdaptiveClipping`); both run
  :func:`fedlite_jax.privacy.dp_noised_mean`.
* SplitFed and FedLite: :func:`fedlite_jax.algorithms.splitfed.splitfed` and
  :func:`fedlite_jax.algorithms.splitfed.fedlite`.

Client weights are ``'examples'`` (the client's example count) or
``'uniform'`` (1 per client) everywhere (``weighting=`` /
``client_weighting=``).
"""

from fedlite_jax.algorithms.dp_fedavg import AdaptiveClipping
from fedlite_jax.algorithms.dp_fedavg import dp_federated_averaging
from fedlite_jax.algorithms.fedopt import batch_hparams
from fedlite_jax.algorithms.fedopt import Compression
from fedlite_jax.algorithms.fedopt import DP
from fedlite_jax.algorithms.fedopt import federated_averaging
from fedlite_jax.algorithms.fedopt import FedOptState
from fedlite_jax.algorithms.mime_lite import efficient_mime_lite
