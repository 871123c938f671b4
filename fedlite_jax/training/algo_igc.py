"""``--algorithm=igc_*``: intrinsic gradient compression.

Source: Melas-Kyriazi & Wang (2022), "Intrinsic Gradient Compression for
Federated Learning", Algorithms 1-3 and the K-subspace + time-varying
combination; see :mod:`fedlite_jax.algorithms.igc`.
"""

from __future__ import annotations

import fedjax

from fedlite_jax.algorithms import igc
from fedlite_jax.algorithms import rounds_common
from fedlite_jax.training import compression_options as common
from fedlite_jax.training import dp_options
from fedlite_jax.training import optimizers
from fedlite_jax.training import spec
from fedlite_jax.transforms import fastfood

ConfigError = spec.ConfigError
Option = spec.Option
_opt = spec.option_value

INTRINSIC_DIM = Option(
    'intrinsic_dim', 4096, 'd: intrinsic dimension (coordinates uploaded per '
    'client per round); 1 <= d <= number of parameters.', lower_bound=1)
NUM_SUBSPACES = Option(
    'num_subspaces', 8, 'K: number of subspaces (each client uploads in one, '
    'drawn uniformly; clients download all K). K = 1 equals static.',
    lower_bound=1)
SCALE = Option(
    'igc_scale', 'unit_expectation', "Fastfood scale: unit_expectation (E[A "
    "A^T] = I, the paper's assumption) or unit_column (Li et al. 2018; needs "
    "D/d times larger learning rates).", choices=fastfood.SCALES)
SEED = Option(
    'igc_seed', -1, 'Base Fastfood seed in [0, 2**32); -1 derives it from '
    '--seed.', lower_bound=-1, upper_bound=2**32 - 1)
ROUNDS_PER_EPOCH = Option(
    'igc_rounds_per_epoch', 0, 'Time-varying: rounds per epoch (new subspaces '
    'each epoch); 0 = one pass over the clients = ceil(train clients / '
    'clients_per_round).', lower_bound=0)
DOWNLOAD = Option(
    'igc_download_accounting', 'table1', "Download bits: table1 = the paper's "
    "Table 1 (d, dK, 2d, 2dK floats per client-round); exact = the vectors a "
    "client needs since it last took part, capped at the full model.",
    choices=igc.IGC_DOWNLOAD_ACCOUNTING)
INDEX_BITS = Option(
    'igc_count_index_bits', True, 'Charge ceil(log2 K) upload bits for the '
    'subspace index.')
PROJECT_ON_SERVER = common.IGC_PROJECT_ON_SERVER

_COMMON = (INTRINSIC_DIM, SCALE, SEED, DOWNLOAD, INDEX_BITS,
           common.UPLOAD, common.LOCAL_STEPS, common.NONFINITE_UPDATES,
           PROJECT_ON_SERVER)


def _builder(num_subspaces_option: bool, time_varying: bool):

  def build(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
    config = ctx.config
    opts = config.options
    name = config.algorithm
    d = _opt(opts, INTRINSIC_DIM)
    if d > ctx.num_params:
      raise ConfigError(f'--intrinsic_dim={d} exceeds the model\'s '
                        f'{ctx.num_params} parameters.')
    if config.client_epochs != 1:
      raise ConfigError(f'{name} takes --local_steps, not --client_epochs '
                        f'(got --client_epochs={config.client_epochs}).')
    upload = common.compression_of(ctx).upload
    common.check_options(opts)  # --igc_project_on_server: a linear upload.
    dp = dp_options.resolve(config, len(ctx.train_client_ids),
                            ctx.num_params)
    rpe = None
    if time_varying:
      rpe = _opt(opts, ROUNDS_PER_EPOCH) or igc.default_rounds_per_epoch(
          len(ctx.train_client_ids), config.clients_per_round)
    return igc.intrinsic_gradient_compression(
        rounds_common.train_grad(ctx.split_model.model),
        optimizers.client_optimizer(config),
        optimizers.server_optimizer(config),
        batch_size=config.client_batch_size,
        intrinsic_dim=d,
        local_steps=common.local_steps(opts),
        num_subspaces=_opt(opts, NUM_SUBSPACES) if num_subspaces_option else 1,
        time_varying=time_varying,
        rounds_per_epoch=rpe,
        seed=common.derived_seed(_opt(opts, SEED), config.seed, b'igc'),
        scale=_opt(opts, SCALE),
        count_index_bits=_opt(opts, INDEX_BITS),
        upload_transform=upload,
        download_accounting=_opt(opts, DOWNLOAD),
        client_ids=ctx.train_client_ids,
        nonfinite=_opt(opts, common.NONFINITE_UPDATES),
        **common.engine_options(config),
        project_on_server=_opt(opts, PROJECT_ON_SERVER),
        dp=None if dp is None else dp.algorithm_dp, dp_seed=config.seed)

  return build


SPECS = (
    spec.AlgorithmSpec(
        name='igc_static',
        description='Static intrinsic gradient compression (Melas-Kyriazi & '
        'Wang 2022, Alg. 1): upload/download d floats; DP-FedAvg in the '
        'subspace with --dp_clip (docs/runner.md).',
        build=_builder(False, False), options=_COMMON + dp_options.DP_OPTIONS),
    spec.AlgorithmSpec(
        name='igc_k_subspace',
        description='K-subspace intrinsic gradient compression (Alg. 2): '
        'upload d floats + index, download dK.',
        build=_builder(True, False), options=_COMMON + (NUM_SUBSPACES,)),
    spec.AlgorithmSpec(
        name='igc_time_varying',
        description='Time-varying intrinsic gradient compression (Alg. 3): new '
        'subspace each epoch; upload d, download 2d.',
        build=_builder(False, True), options=_COMMON + (ROUNDS_PER_EPOCH,)),
    spec.AlgorithmSpec(
        name='igc_k_subspace_time_varying',
        description='K-subspace + time-varying intrinsic gradient compression '
        '(described in Sec. 3.2): upload d + index, download 2dK.',
        build=_builder(True, True),
        options=_COMMON + (NUM_SUBSPACES, ROUNDS_PER_EPOCH)),
)
"""The algorithms of this module, collected by the registry."""
