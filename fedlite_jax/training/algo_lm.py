"""``--algorithm=fedprox | mime_lite`` (and the compressed ``fedavg`` builder).

Ro et al., "Scaling Language Model Size in Cross-Device Federated Learning"
(2022): FedAdam / FedProx / MimeLite, each combinable with download
quantization, upload quantization (uniform k-level, zero-centred, TernGrad
with/without clipping) and PVT. See :mod:`fedlite_jax.algorithms.fedopt`.

Flags (one shared set; the same :class:`registry.Option` objects are listed by
every algorithm that takes them):

  ``--upload`` / ``--download``: the compression as stages of
  :func:`fedlite_jax.transforms.parse_chain`, e.g.
  ``--upload=intrinsic_projection:4096,uniform_quantization:8
  --download=uniform_quantization:16``; when given they replace the legacy
  flags below (``--upload_quantizer``/``--upload_bits``/...,
  ``--download_bits``), which stay as aliases (giving both is an error);
  ``--download_bits`` (32 = uncompressed; 1..31 stochastic uniform
  quantization of the server model), ``--upload_quantizer`` (none, uniform,
  terngrad), ``--upload_bits`` (uniform: 1..32), ``--upload_zero_center``,
  ``--upload_clip_std`` (uniform: clip at c std, 0 = off),
  ``--terngrad_clip`` (TernGrad's 2.5 std clipping on/off),
  ``--pvt_fraction`` (0 < f <= 1), ``--quantizer_rng`` (hash, threefry);
  ``--fedprox_mu``; ``--mime_base_optimizer``, ``--mime_base_eps``,
  ``--mime_grads_batch_size``.

Optimizers: FedAvg/FedProx use ``--client_optimizer/--client_lr/
--client_clip_norm`` on clients and ``--server_optimizer/--server_lr/...``
on the server (FedAdam: ``--server_optimizer=adam``). MimeLite's base
optimizer is ``--mime_base_optimizer`` at ``--client_lr`` (the paper's
"base learning rate", with ``--client_clip_norm`` chained before it) and
its server step size is ``--server_lr`` (Ro et al. fix 1.0).

``build_fedavg`` is the builder ``--algorithm=fedavg`` should use to accept
these flags (see the integration notes in the report): with every
compression flag at its default it builds the unchanged
:func:`fedlite_jax.algorithms.federated_averaging`.
"""

from __future__ import annotations

from typing import Any, Optional

import fedjax
import optax

from fedlite_jax import quantization
from fedlite_jax import transforms
from fedlite_jax.algorithms import fedopt
from fedlite_jax.training import compression_options as common
from fedlite_jax.training import optimizers
from fedlite_jax.training import registry
from fedlite_jax.training.config import ConfigError

Option = registry.Option

UPLOAD_QUANTIZERS = ('none', 'uniform', 'terngrad')
MIME_BASE_OPTIMIZERS = ('adagrad', 'sgd', 'adam')

DOWNLOAD_BITS = Option(
    'download_bits', 32,
    'Bits per parameter of the server model sent to clients: 32 = float32 '
    '(uncompressed); 1..31 = stochastic k-level uniform quantization per '
    'layer, k = 2**bits (Ro et al. 2022, Sec. 4).', lower_bound=1)
UPLOAD_QUANTIZER = Option(
    'upload_quantizer', 'none',
    'Client-delta compression: none (float32), uniform (k-level, '
    '--upload_bits), terngrad (Wen et al. 2017, log2(3) bits).',
    choices=UPLOAD_QUANTIZERS)
UPLOAD_BITS = Option(
    'upload_bits', 32,
    'Bits per value for --upload_quantizer=uniform (1..32; >= 24 is the '
    'identity for float32 but still charged).', lower_bound=1)
UPLOAD_ZERO_CENTER = Option(
    'upload_zero_center', False,
    'Uniform upload grid symmetric around 0 ([-max|x|, max|x|], one float '
    'per layer) instead of [min, max].')
UPLOAD_CLIP_STD = Option(
    'upload_clip_std', 0.0,
    'Uniform upload: clip each layer at this many standard deviations '
    'before quantizing (0 = off).', lower_bound=0.0)
TERNGRAD_CLIP = Option(
    'terngrad_clip', True,
    'TernGrad: clip each layer at 2.5 standard deviations first (Wen et '
    'al. 2017).')
PVT_FRACTION = Option(
    'pvt_fraction', 1.0,
    'Partial variable training: target trainable share of the parameters '
    'per client per round, in (0, 1]; 1 = train everything.',
    lower_bound=0.0)
QUANTIZER_RNG = Option(
    'quantizer_rng', 'hash',
    'Random numbers for stochastic rounding: hash (fast counter-based) or '
    'threefry (jax.random.uniform).', choices=quantization.GENERATORS)
FEDPROX_MU = Option(
    'fedprox_mu', 0.01,
    'FedProx mu of 0.5 mu ||w - w_server||^2 (Li et al. 2020); Ro et al. '
    'sweep 0, 1e-1..1e-4.', lower_bound=0.0)
MIME_BASE_OPTIMIZER = Option(
    'mime_base_optimizer', 'adagrad',
    'MimeLite base optimizer (Ro et al.: Adagrad), run at --client_lr.',
    choices=MIME_BASE_OPTIMIZERS)
MIME_BASE_EPS = Option(
    'mime_base_eps', 1e-3,
    'MimeLite base optimizer epsilon (Ro et al. sweep 1e-1..1e-7).',
    lower_bound=0.0)
MIME_GRADS_BATCH_SIZE = Option(
    'mime_grads_batch_size', 16,
    'MimeLite: batch size of the full-batch gradient pass over each '
    "client's data (16 = the client batch; larger batches were slower per "
    'example on XLA:CPU here).', lower_bound=1)

UPLOAD = Option(
    'upload', '',
    'Upload compression as comma-separated stages applied left to right, '
    'named after the fedlite_jax.transforms functions: '
    + ', '.join(transforms.STAGE_FORMS) + '; e.g. '
    'intrinsic_projection:4096,uniform_quantization:8 (32 D / (8 * 4096 + '
    '64) compression) or top_k:12000,uniform_quantization:8. Intrinsic '
    'projections use subspace seed 0 unless the stage gives one. Empty = '
    "the algorithm's own upload flags (fedavg/fedprox/mime_lite: "
    '--upload_quantizer, --upload_bits, ...; topk: --topk_k, '
    '--topk_index_bits); giving both is an error.')
DOWNLOAD = Option(
    'download', '',
    'Download (server model) compression as stages, same vocabulary as '
    '--upload, e.g. uniform_quantization:16. Empty = --download_bits; '
    'giving both is an error.')

COMPRESSION_OPTIONS = (UPLOAD, DOWNLOAD, DOWNLOAD_BITS, UPLOAD_QUANTIZER,
                       UPLOAD_BITS, UPLOAD_ZERO_CENTER, UPLOAD_CLIP_STD,
                       TERNGRAD_CLIP, PVT_FRACTION, QUANTIZER_RNG)
"""The compression flags every algorithm of this module accepts."""


def _opt(options, option: Option) -> Any:
  return options.get(option.name, option.default)


def stages_from_option(options, option: Option, *,
                       generator: str = 'hash'
                       ) -> Optional[transforms.CommTransform]:
  """The transform of a stage-string option (``--upload`` / ``--download``).

  Args:
    options: mapping of option name -> value.
    option: :data:`UPLOAD` or :data:`DOWNLOAD`.
    generator: random generator of quantizer stages (``--quantizer_rng``).

  Returns:
    :func:`fedlite_jax.transforms.parse_chain` of the value, or None when
    it is empty (the algorithm's own flags apply).

  Raises:
    ConfigError: (one line) a bad stage string, naming the flag.
  """
  spec = str(_opt(options, option)).strip()
  if not spec:
    return None
  try:
    return transforms.parse_chain(spec, generator=generator)
  except ValueError as e:
    raise ConfigError(f'--{option.name}={spec}: {e}') from None


def check_no_legacy(options, option: Option,
                    legacy: tuple[Option, ...]) -> None:
  """Refuses a stage option given together with the flags it replaces.

  Raises:
    ConfigError: if ``option`` is set and any of ``legacy`` is not at its
      default (naming both).
  """
  if not str(_opt(options, option)).strip():
    return
  given = [f'--{o.name}={_opt(options, o)}' for o in legacy
           if _opt(options, o) != o.default]
  if given:
    raise ConfigError(
        f'--{option.name}={_opt(options, option)} replaces '
        f'{" ".join(given)}: give one or the other.')


def compression_from_options(options) -> fedopt.Compression:
  """A :class:`fedopt.Compression` from resolved option values.

  ``--upload`` / ``--download`` (stage strings,
  :func:`fedlite_jax.transforms.parse_chain`) take precedence; when empty,
  the legacy flags apply (``--upload_quantizer=uniform --upload_bits=8`` is
  the same transform as ``--upload=uniform_quantization:8``, and
  ``--download_bits=16`` as ``--download=uniform_quantization:16``).

  Args:
    options: mapping of option name -> value (missing names take defaults).

  Returns:
    The compression settings.

  Raises:
    ConfigError: inconsistent or out-of-range values (naming the flag),
      including ``--upload`` together with a legacy upload flag or
      ``--download`` together with ``--download_bits``.
  """
  download_bits = _opt(options, DOWNLOAD_BITS)
  if not 1 <= download_bits <= 32:
    raise ConfigError(f'--download_bits={download_bits}: must be in 1..32 '
                      '(32 = uncompressed).')
  quantizer = _opt(options, UPLOAD_QUANTIZER)
  bits = _opt(options, UPLOAD_BITS)
  if not 1 <= bits <= 32:
    raise ConfigError(f'--upload_bits={bits}: must be in 1..32.')
  rng = _opt(options, QUANTIZER_RNG)
  zero_center = _opt(options, UPLOAD_ZERO_CENTER)
  clip = _opt(options, UPLOAD_CLIP_STD)
  check_no_legacy(options, UPLOAD, (UPLOAD_QUANTIZER, UPLOAD_BITS,
                                    UPLOAD_ZERO_CENTER, UPLOAD_CLIP_STD,
                                    TERNGRAD_CLIP))
  check_no_legacy(options, DOWNLOAD, (DOWNLOAD_BITS,))
  uniform_only = [f'--{o.name}={_opt(options, o)}'
                  for o in (UPLOAD_BITS, UPLOAD_ZERO_CENTER, UPLOAD_CLIP_STD)
                  if _opt(options, o) != o.default]
  if quantizer != 'uniform' and uniform_only:
    raise ConfigError(
        f'{" ".join(uniform_only)}: applies to --upload_quantizer=uniform '
        f'only (got --upload_quantizer={quantizer}).')
  fraction = _opt(options, PVT_FRACTION)
  if not 0.0 < fraction <= 1.0:
    raise ConfigError(f'--pvt_fraction={fraction}: must be in (0, 1].')
  download = stages_from_option(options, DOWNLOAD, generator=rng)
  if download is None and download_bits != 32:
    download = transforms.uniform_quantization(download_bits, generator=rng)
  upload = stages_from_option(options, UPLOAD, generator=rng)
  if upload is None and quantizer == 'uniform':
    upload = transforms.uniform_quantization(
        bits, zero_center=zero_center, clip_std=clip or None, generator=rng)
  elif upload is None and quantizer == 'terngrad':
    upload = transforms.terngrad(
        clip_std=(quantization.DEFAULT_CLIP_STD
                  if _opt(options, TERNGRAD_CLIP) else None), generator=rng)
  return fedopt.Compression(download=download, upload=upload,
                               pvt_fraction=float(fraction))


def build_fedavg(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  """``--algorithm=fedavg`` with the compression flags.

  One FedOpt round (:mod:`fedlite_jax.algorithms.fedopt`); uncompressed it
  is FedAvg / FedAdam exactly.
  """
  config = ctx.config
  compression = compression_from_options(config.options)
  return fedopt.efficient_federated_averaging(
      fedjax.model_grad(ctx.split_model.model),
      optimizers.client_optimizer(config),
      optimizers.server_optimizer(config),
      optimizers.client_batch_hparams(config),
      compression=compression, seed=config.seed, name='fedavg',
      engine=config.round_engine, steps_per_call=config.steps_per_call,
      nonfinite=_opt(config.options, common.NONFINITE_UPDATES))


def build_fedprox(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  config = ctx.config
  return fedopt.efficient_federated_averaging(
      fedjax.model_grad(ctx.split_model.model),
      optimizers.client_optimizer(config),
      optimizers.server_optimizer(config),
      optimizers.client_batch_hparams(config),
      fedprox_mu=float(config.options[FEDPROX_MU.name]),
      compression=compression_from_options(config.options),
      seed=config.seed, name='fedprox',
      engine=config.round_engine, steps_per_call=config.steps_per_call,
      nonfinite=_opt(config.options, common.NONFINITE_UPDATES))


def mime_base_optimizer(config) -> optax.GradientTransformation:
  """``--mime_base_optimizer`` at ``--client_lr`` (+ ``--client_clip_norm``)."""
  name = config.options[MIME_BASE_OPTIMIZER.name]
  eps = float(config.options[MIME_BASE_EPS.name])
  if name == 'sgd':
    return optimizers.make_optimizer('sgd', config.client_lr,
                                     clip_norm=config.client_clip_norm)
  if eps <= 0:
    raise ConfigError(f'--mime_base_eps={eps}: must be > 0 for {name}.')
  return optimizers.make_optimizer(name, config.client_lr, eps=eps,
                                   clip_norm=config.client_clip_norm)


def build_mime_lite(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  config = ctx.config
  return fedopt.efficient_mime_lite(
      fedjax.model_grad(ctx.split_model.model),
      mime_base_optimizer(config),
      optimizers.client_batch_hparams(config),
      grads_batch_size=int(config.options[MIME_GRADS_BATCH_SIZE.name]),
      server_learning_rate=float(config.server_lr),
      compression=compression_from_options(config.options),
      seed=config.seed, name='mime_lite',
      engine=config.round_engine, steps_per_call=config.steps_per_call,
      nonfinite=_opt(config.options, common.NONFINITE_UPDATES))


registry.register(registry.AlgorithmSpec(
    name='fedprox',
    description='FedProx (Li et al. 2020), --fedprox_mu; server optimizer by '
    'flag (FedAdam-style with --server_optimizer=adam); compression flags '
    '(--download_bits, --upload_quantizer, --pvt_fraction, ...).',
    build=build_fedprox,
    options=(FEDPROX_MU,) + COMPRESSION_OPTIONS + (common.NONFINITE_UPDATES,)))

registry.register(registry.AlgorithmSpec(
    name='mime_lite',
    description='MimeLite (Karimireddy et al. 2020), Adagrad base at '
    '--client_lr, server step --server_lr; compression flags. Uploads delta '
    '+ gradient, downloads model + optimizer statistics.',
    build=build_mime_lite,
    options=(MIME_BASE_OPTIMIZER, MIME_BASE_EPS, MIME_GRADS_BATCH_SIZE)
    + COMPRESSION_OPTIONS + (common.NONFINITE_UPDATES,),
    # Its full-batch gradient pass reads every client's data on the host.
    multi_process=False))
