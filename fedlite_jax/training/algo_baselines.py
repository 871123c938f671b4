"""``--algorithm=sgd | topk | fetchsgd``: the baselines of Melas-Kyriazi &
Wang (2022), Table 2 / Figure 1.

``sgd``: uncompressed, one local step per round; ``topk``: local Top-K of the
client delta (``--upload`` stages); ``fetchsgd``: FetchSGD (Rothchild et al.
2020), count sketch + server momentum + error feedback + top-k.
"""

from __future__ import annotations

import fedjax
import jax
import jax.numpy as jnp

from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import fetchsgd as fetchsgd_lib
from fedlite_jax.algorithms import rounds_common
from fedlite_jax.training import compression_options as common
from fedlite_jax.training import optimizers
from fedlite_jax.training import spec
from fedlite_jax import transforms

ConfigError = spec.ConfigError
Option = spec.Option
_opt = spec.option_value

SKETCH_ROWS = Option(
    'sketch_rows', 5, 'FetchSGD count sketch rows.', lower_bound=1)
SKETCH_COLS = Option(
    'sketch_cols', 100_000, 'FetchSGD count sketch columns.', lower_bound=1)
SKETCH_MOMENTUM = Option(
    'sketch_momentum', 0.9, 'FetchSGD server momentum rho in [0, 1) (in sketch '
    'space).', lower_bound=0.0)
SKETCH_SEED = Option(
    'sketch_seed', -1, 'FetchSGD hash seed in [0, 2**32); -1 derives it from '
    '--seed.', lower_bound=-1, upper_bound=2**32 - 1)


def _check_common(ctx: spec.BuildContext) -> None:
  config = ctx.config
  if config.client_epochs != 1:
    raise ConfigError(f'{config.algorithm} takes --local_steps, not '
                      f'--client_epochs (got {config.client_epochs}).')


def _sgd_baseline(ctx: spec.BuildContext, name: str, upload,
                    download_accounting: str) -> fedjax.FederatedAlgorithm:
  config = ctx.config
  return fedopt.federated_averaging(
      rounds_common.train_grad(ctx.split_model.model),
      optimizers.client_optimizer(config),
      optimizers.server_optimizer(config),
      fedopt.batch_hparams(config.client_batch_size,
                           common.local_steps(config.options)),
      weighting='uniform', compression=fedopt.Compression(upload=upload),
      download_accounting=download_accounting,
      client_ids=ctx.train_client_ids,
      nonfinite=_opt(config.options, common.NONFINITE_UPDATES), name=name,
      **common.engine_options(config))


def _build_sgd(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  _check_common(ctx)
  return _sgd_baseline(ctx, 'sgd', None, 'dense')


def _topk_upload(ctx: spec.BuildContext) -> transforms.CommTransform:
  """The parsed ``--upload`` (default :data:`common.TOPK_DEFAULT_UPLOAD`),
  or ConfigError if it cannot encode the model (e.g. k > D)."""
  upload = common.compression_of(ctx).upload
  try:
    transforms.message_bits(
        upload, [jax.ShapeDtypeStruct((ctx.num_params,), jnp.float32)])
  except ValueError as e:
    stages = str(_opt(ctx.config.options, common.UPLOAD)).strip() or \
        common.TOPK_DEFAULT_UPLOAD
    raise ConfigError(f'--upload={stages}: {e}') from None
  return upload


def _build_topk(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  _check_common(ctx)
  return _sgd_baseline(ctx, 'topk', _topk_upload(ctx),
                       _opt(ctx.config.options, common.DOWNLOAD_ACCOUNTING))


def _build_fetchsgd(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  _check_common(ctx)
  config = ctx.config
  opts = config.options
  k = _opt(opts, common.TOPK_K)
  if k > ctx.num_params:
    raise ConfigError(f'--topk_k={k} exceeds the model\'s {ctx.num_params} '
                      'parameters.')
  if config.server_optimizer != 'sgd':
    raise ConfigError('fetchsgd has its own server step (momentum + error '
                      'feedback in the sketch); use --server_optimizer=sgd '
                      f'(got {config.server_optimizer!r}) and --server_lr.')
  momentum = _opt(opts, SKETCH_MOMENTUM)
  if not momentum < 1:
    raise ConfigError(f'--sketch_momentum={momentum}: must be in [0, 1).')
  return fetchsgd_lib.fetchsgd(
      rounds_common.train_grad(ctx.split_model.model),
      optimizers.client_optimizer(config),
      batch_size=config.client_batch_size,
      rows=_opt(opts, SKETCH_ROWS), cols=_opt(opts, SKETCH_COLS),
      k=_opt(opts, common.TOPK_K), server_lr=config.server_lr,
      momentum=momentum,
      local_steps=common.local_steps(opts),
      seed=common.derived_seed(_opt(opts, SKETCH_SEED), config.seed,
                               b'sketch'),
      download_accounting=_opt(opts, common.DOWNLOAD_ACCOUNTING),
      client_ids=ctx.train_client_ids,
      nonfinite=_opt(opts, common.NONFINITE_UPDATES),
      **common.engine_options(config))


SPECS = (
    spec.AlgorithmSpec(
        name='sgd',
        description='Uncompressed SGD: one local step per round '
        '(--local_steps > 1: FedAvg with local iterations); 32 bits/param '
        'each way.',
        build=_build_sgd,
        options=(common.LOCAL_STEPS, common.NONFINITE_UPDATES)),
    spec.AlgorithmSpec(
        name='topk',
        description='Local Top-K of the client update (--upload=top_k:k, '
        f'default {common.TOPK_DEFAULT_UPLOAD}); download = weights changed '
        'since last participation.',
        build=_build_topk,
        options=(common.UPLOAD, common.DOWNLOAD_ACCOUNTING,
                 common.LOCAL_STEPS, common.NONFINITE_UPDATES)),
    spec.AlgorithmSpec(
        name='fetchsgd',
        description='FetchSGD (Rothchild et al. 2020): count sketch upload, '
        'server momentum + error feedback + top-k.',
        build=_build_fetchsgd,
        options=(SKETCH_ROWS, SKETCH_COLS, common.TOPK_K, SKETCH_MOMENTUM,
                 SKETCH_SEED, common.DOWNLOAD_ACCOUNTING, common.LOCAL_STEPS,
                 common.NONFINITE_UPDATES)),
)
"""The algorithms of this module, collected by the registry."""
