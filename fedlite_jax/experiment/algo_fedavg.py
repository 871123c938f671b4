"""``--algorithm=fedavg``: FedAvg / FedAdam (server optimizer by flag)."""

from __future__ import annotations

import fedjax

from fedlite_jax.algorithms import fedavg
from fedlite_jax.experiment import optimizers
from fedlite_jax.experiment import registry


def build(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  config = ctx.config
  return fedavg.federated_averaging(
      fedjax.model_grad(ctx.split_model.model),
      optimizers.client_optimizer(config),
      optimizers.server_optimizer(config),
      optimizers.client_batch_hparams(config),
      engine=config.round_engine,
      steps_per_call=config.steps_per_call)


registry.register(registry.AlgorithmSpec(
    name='fedavg',
    description='FedAvg (McMahan et al. 2017); with --server_optimizer=adam, '
    'FedAdam (Reddi et al. 2021). 32 bits/param each way.',
    build=build))
