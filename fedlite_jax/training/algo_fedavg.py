"""``--algorithm=fedavg``: FedAvg / FedAdam (server optimizer by flag).

With the compression flags of :mod:`fedlite_jax.training.algo_lm`
(``--download_bits``, ``--upload_quantizer``, ``--pvt_fraction``, ...) it
becomes the efficient FedAvg of Ro et al. (2022); with their defaults it is
exactly :func:`fedlite_jax.algorithms.federated_averaging` (one FedOpt
builder either way).
"""

from __future__ import annotations

from fedlite_jax.training import algo_lm
from fedlite_jax.training import compression_options
from fedlite_jax.training import registry


registry.register(registry.AlgorithmSpec(
    name='fedavg',
    description='FedAvg (McMahan et al. 2017); with --server_optimizer=adam, '
    'FedAdam (Reddi et al. 2021). One pass over the client data per round '
    '(--client_epochs) or --local_steps=s local iterations. 32 bits/param '
    'each way unless the compression flags (--download_bits, '
    '--upload_quantizer, --pvt_fraction) are set.',
    build=algo_lm.build_fedavg,
    options=algo_lm.COMPRESSION_OPTIONS + (
        compression_options.LOCAL_STEPS,
        compression_options.NONFINITE_UPDATES)))
