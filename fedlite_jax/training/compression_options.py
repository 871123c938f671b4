"""Options shared by several algorithms (one flag each), and their parsing.

The same :class:`~fedlite_jax.training.spec.Option` object is listed by
every algorithm that takes it (an option name may be used by several
algorithms only when the options are identical, see
:func:`fedlite_jax.training.spec.check_compatible`), e.g. ``--local_steps``
for ``sgd``, ``topk``, ``fetchsgd`` and every ``igc_*``, and the
compression flags (:data:`COMPRESSION_OPTIONS`, Ro et al. 2022) for
``fedavg``, ``fedprox`` and ``mime_lite``:

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
  ``--pvt_fraction`` (0 < f <= 1), ``--quantizer_rng`` (hash, threefry).

This module imports no algorithm module (``algo_*``) and no registry.
"""

from __future__ import annotations

from typing import Optional
import zlib

from fedlite_jax import transforms
from fedlite_jax.algorithms import fedopt
from fedlite_jax.algorithms import nonfinite
from fedlite_jax.training import spec

ConfigError = spec.ConfigError
Option = spec.Option
_opt = spec.option_value

LOCAL_STEPS = Option(
    'local_steps', 0,
    'Local steps per round (each on one shuffled batch of '
    '--client_batch_size examples). 0 = the algorithm\'s default: one step '
    'for sgd/topk/fetchsgd/igc_* (one local step per update as in '
    'Melas-Kyriazi & Wang (2022) and FetchSGD), --client_epochs passes over '
    'the client data for fedavg. > 0: exactly that many steps (client data '
    'reshuffled and repeated as needed); compressed algorithms then compress '
    'the model delta; fedavg becomes FedAvg with s local iterations.',
    lower_bound=0)

NONFINITE_UPDATES = Option(
    'nonfinite_updates', 'raise',
    'What to do with a client whose update is NaN/Inf (every algorithm): '
    'raise = stop the run with an error naming the clients, before the bad '
    'round is evaluated or checkpointed; skip = drop the client from its '
    'round (it uploads 0 bits; its download is still counted; summary '
    'communication.skipped_client_rounds counts them) and log a warning; a '
    'round whose clients are all skipped still stops the run. A non-finite '
    'server model stops the run either way. Not part of the checkpoint '
    'fingerprint: a run stopped by raise can resume from its last '
    'checkpoint with skip.',
    choices=nonfinite.POLICIES, affects_result=False)

TOPK_K = Option(
    'topk_k', 12_000,
    'k: entries sent per client (topk) / coordinates updated per round '
    '(fetchsgd); 1 <= k <= number of parameters.',
    lower_bound=1)

DOWNLOAD_ACCOUNTING = Option(
    'download_accounting', 'changed',
    'Download bits of topk/fetchsgd: changed = 32 bits per weight changed '
    'since the client last participated (FetchSGD/CommEfficient), dense = '
    '32 bits x all parameters.',
    choices=fedopt.DOWNLOAD_ACCOUNTING)


UPLOAD_QUANTIZERS = ('none', 'uniform', 'terngrad')

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
    'threefry (jax.random.uniform).', choices=transforms.uniform.GENERATORS)
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
"""The compression flags of fedavg, fedprox and mime_lite."""


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
  stages = str(_opt(options, option)).strip()
  if not stages:
    return None
  try:
    return transforms.parse_chain(stages, generator=generator)
  except ValueError as e:
    raise ConfigError(f'--{option.name}={stages}: {e}') from None


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
        clip_std=(transforms.ternary.DEFAULT_CLIP_STD
                  if _opt(options, TERNGRAD_CLIP) else None), generator=rng)
  return fedopt.Compression(download=download, upload=upload,
                               pvt_fraction=float(fraction))


def check_options(options) -> None:
  """Builds the compression that ``options`` describe, without data, so that
  a flag check (``--validate_only``) rejects what a run would.

  Raises:
    ConfigError: as :func:`compression_from_options` (when ``options`` hold
      all of :data:`COMPRESSION_OPTIONS`) or :func:`stages_from_option`.
  """
  names = set(options)
  if {o.name for o in COMPRESSION_OPTIONS} <= names:
    compression_from_options(options)
    return
  for option in (UPLOAD, DOWNLOAD):
    if option.name in names:
      stages_from_option(options, option,
                         generator=options.get(QUANTIZER_RNG.name,
                                               QUANTIZER_RNG.default))


def local_steps(options) -> int:
  """``--local_steps`` for the one-step algorithms (0 means 1)."""
  return int(options['local_steps']) or 1


def derived_seed(option_value: int, run_seed: int, salt: bytes) -> int:
  """``option_value`` if >= 0, else a 32-bit seed derived from the run seed."""
  if option_value >= 0:
    return int(option_value) % 2**32
  return zlib.crc32(salt + int(run_seed).to_bytes(8, 'little', signed=True))
