"""``--algorithm=fedavg | fedprox | mime_lite`` with the compression flags.

Source: Ro et al. (2022), "Scaling Language Model Size in Cross-Device
Federated Learning": FedAdam / FedProx / MimeLite with download and upload
quantization and PVT, all one FedOpt round (:mod:`algorithms.fedopt`).
MimeLite's base optimizer runs at ``--client_lr``, its server step is
``--server_lr`` (Ro et al. fix 1.0).
"""

from __future__ import annotations

import fedjax
import optax

from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import mime_lite
from fedlite_jax.algorithms import rounds_common
from fedlite_jax.training import compression_options as common
from fedlite_jax.training import dp_options
from fedlite_jax.training import optimizers
from fedlite_jax.training import spec

ConfigError = spec.ConfigError
Option = spec.Option
_opt = spec.option_value

# Shared with other algorithms (compression_options).
COMPRESSION_OPTIONS = common.COMPRESSION_OPTIONS
compression_from_options = common.compression_from_options

MIME_BASE_OPTIMIZERS = ('adagrad', 'sgd', 'adam')

FEDPROX_MU = Option(
    'fedprox_mu', 0.01, 'FedProx mu of 0.5 mu ||w - w_server||^2 (Li et al. '
    '2020); Ro et al. sweep 0, 1e-1..1e-4.', lower_bound=0.0)
MIME_BASE_OPTIMIZER = Option(
    'mime_base_optimizer', 'adagrad', 'MimeLite base optimizer (Ro et al.: '
    'Adagrad), run at --client_lr.', choices=MIME_BASE_OPTIMIZERS)
MIME_BASE_EPS = Option(
    'mime_base_eps', 1e-3, 'MimeLite base optimizer epsilon (Ro et al. sweep '
    '1e-1..1e-7).', lower_bound=0.0)
MIME_GRADS_BATCH_SIZE = Option(
    'mime_grads_batch_size', 16, "MimeLite: batch size of the full-batch "
    "gradient pass over each client's data.", lower_bound=1)

def _fedopt(ctx: spec.BuildContext, **kwargs) -> fedjax.FederatedAlgorithm:
  config = ctx.config
  compression = common.compression_of(ctx)
  dp = dp_options.resolve(config, len(ctx.train_client_ids),
                          ctx.num_params)
  if dp is not None:  # DP-FedAvg: uniform weights (McMahan et al. 2018).
    kwargs.update(dp=dp.algorithm_dp, weighting='uniform')
  return fedopt.federated_averaging(
      rounds_common.train_grad(ctx.split_model.model),
      optimizers.client_optimizer(config),
      optimizers.server_optimizer(config),
      optimizers.client_batch_hparams(config),
      compression=compression, seed=config.seed,
      **common.engine_options(config),
      nonfinite=_opt(config.options, common.NONFINITE_UPDATES), **kwargs)


def build_fedavg(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  """``--algorithm=fedavg``: uncompressed, FedAvg / FedAdam exactly."""
  return _fedopt(ctx, name='fedavg')


def build_fedprox(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  """``--algorithm=fedprox``: FedAvg's round plus ``--fedprox_mu``'s term."""
  return _fedopt(ctx, name='fedprox',
                 fedprox_mu=float(_opt(ctx.config.options, FEDPROX_MU)))


def mime_base_optimizer(config) -> optax.GradientTransformation:
  """``--mime_base_optimizer`` at ``--client_lr`` (+ ``--client_clip_norm``)."""
  name = _opt(config.options, MIME_BASE_OPTIMIZER)
  eps = float(_opt(config.options, MIME_BASE_EPS))
  if name == 'sgd':
    return optimizers.make_optimizer('sgd', config.client_lr,
                                     clip_norm=config.client_clip_norm)
  if eps <= 0:
    raise ConfigError(f'--mime_base_eps={eps}: must be > 0 for {name}.')
  return optimizers.make_optimizer(name, config.client_lr, eps=eps,
                                   clip_norm=config.client_clip_norm)


def build_mime_lite(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  """``--algorithm=mime_lite``: MimeLite with ``--mime_base_optimizer``."""
  config = ctx.config
  return mime_lite.efficient_mime_lite(
      rounds_common.train_grad(ctx.split_model.model),
      mime_base_optimizer(config),
      optimizers.client_batch_hparams(config),
      grads_batch_size=int(_opt(config.options, MIME_GRADS_BATCH_SIZE)),
      server_learning_rate=float(config.server_lr),
      compression=common.compression_of(ctx),
      seed=config.seed, name='mime_lite',
      **common.engine_options(config),
      nonfinite=_opt(config.options, common.NONFINITE_UPDATES))


SPECS = (
    spec.AlgorithmSpec(
        name='fedavg',
        description='FedAvg (McMahan et al. 2017); with '
        '--server_optimizer=adam, FedAdam (Reddi et al. 2021). One pass over '
        'the client data per round (--client_epochs) or --local_steps=s local '
        'iterations. 32 bits/param each way unless the compression flags '
        '(--upload, --download, --pvt_fraction) are set; DP-FedAvg with '
        '--dp_clip (docs/runner.md).',
        build=build_fedavg,
        options=COMPRESSION_OPTIONS + (common.LOCAL_STEPS,
                                       common.NONFINITE_UPDATES)
        + dp_options.DP_OPTIONS),
    spec.AlgorithmSpec(
        name='fedprox',
        description='FedProx (Li et al. 2020), --fedprox_mu; server optimizer '
        'by flag (FedAdam-style with --server_optimizer=adam); compression '
        'flags (--upload, --download, --pvt_fraction).',
        build=build_fedprox,
        options=(FEDPROX_MU,) + COMPRESSION_OPTIONS
        + (common.NONFINITE_UPDATES,) + dp_options.DP_OPTIONS),
    spec.AlgorithmSpec(
        name='mime_lite',
        description='MimeLite (Karimireddy et al. 2020), Adagrad base at '
        '--client_lr, server step --server_lr; compression flags. Uploads '
        'delta + gradient, downloads model + optimizer statistics.',
        build=build_mime_lite,
        options=(MIME_BASE_OPTIMIZER, MIME_BASE_EPS, MIME_GRADS_BATCH_SIZE)
        + COMPRESSION_OPTIONS + (common.NONFINITE_UPDATES,),
        # Its full-batch gradient pass reads every client's data on the host.
        multi_process=False),
)
"""The algorithms of this module, collected by the registry."""
