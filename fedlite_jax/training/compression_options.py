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
  --download=uniform_quantization:16`` (``terngrad``, ``terngrad:none``
  without clipping, ``top_k:k``, ...); ``--pvt_fraction`` (0 < f <= 1;
  needs per-variable upload stages), ``--quantizer_rng`` (hash, threefry).
  ``topk`` and ``igc_*`` take ``--upload`` too.

The earlier compression flags (:data:`REMOVED_FLAGS`) are one-line errors
naming their stage-string replacement (:func:`check_removed`).

This module imports no algorithm module (``algo_*``) and no registry.
"""

from __future__ import annotations

from typing import Optional
import zlib

import jax
import jax.numpy as jnp

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
    'FetchSGD k: coordinates updated per round; 1 <= k <= number of '
    'parameters. (Top-K uploads: --upload=top_k:k.)',
    lower_bound=1)

#: ``--algorithm=topk`` with an empty ``--upload``.
TOPK_DEFAULT_UPLOAD = 'top_k:12000'

DOWNLOAD_ACCOUNTING = Option(
    'download_accounting', 'changed',
    'Download bits of topk/fetchsgd: changed = 32 bits per weight changed '
    'since the client last participated (FetchSGD/CommEfficient), dense = '
    '32 bits x all parameters.',
    choices=fedopt.DOWNLOAD_ACCOUNTING)


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
    'projections use subspace seed 0 unless the stage gives one. '
    'fedavg/fedprox/mime_lite: applied to the client delta (empty = '
    'float32); topk: the upload of the client delta (empty = '
    f'{TOPK_DEFAULT_UPLOAD}); igc_*: applied to the d uploaded coordinates '
    '(empty = float32).')
DOWNLOAD = Option(
    'download', '',
    'Download (server model) compression as stages, same vocabulary as '
    '--upload, e.g. uniform_quantization:16; empty = float32.')

COMPRESSION_OPTIONS = (UPLOAD, DOWNLOAD, PVT_FRACTION, QUANTIZER_RNG)
"""The compression flags of fedavg, fedprox and mime_lite."""

#: Compression flags that were removed in favour of ``--upload`` /
#: ``--download`` (see :func:`check_removed`).
REMOVED_FLAGS = ('upload_quantizer', 'upload_bits', 'download_bits',
                 'upload_zero_center', 'upload_clip_std', 'terngrad_clip',
                 'igc_upload_quant_bits', 'topk_index_bits')


def _as_bool(value) -> bool:
  if isinstance(value, str):
    return value.strip().lower() not in ('false', '0', 'no', 'off', '')
  return bool(value)


def _stage_replacement(given, algorithm: str) -> list[str]:
  """The ``--upload`` / ``--download`` / ... flags that replace ``given``."""
  out = []
  if 'download_bits' in given:
    bits = str(given['download_bits']).strip()
    out.append(f'--download=uniform_quantization:{bits}' if bits != '32'
               else 'no --download (32 = float32)')
  if 'igc_upload_quant_bits' in given:
    bits = str(given['igc_upload_quant_bits']).strip()
    out.append(f'--upload=uniform_quantization:{bits}' if bits != '0'
               else 'no --upload (0 = float32)')
  if algorithm == 'topk' and ({'topk_k', 'topk_index_bits'} & set(given)):
    k = given.get('topk_k', TOPK_K.default)
    index = given.get('topk_index_bits')
    out.append(f'--upload=top_k:{k}' + (f':{index}' if index else ''))
  quantizer = given.get('upload_quantizer')
  if quantizer is None and 'upload_bits' in given:
    quantizer = 'uniform'
  if quantizer is None and 'terngrad_clip' in given:
    quantizer = 'terngrad'
  if quantizer == 'uniform':
    out.append(f'--upload=uniform_quantization:{given.get("upload_bits", 32)}')
  elif quantizer == 'terngrad':
    clip = _as_bool(given.get('terngrad_clip', True))
    out.append('--upload=terngrad' + ('' if clip else ':none'))
  elif quantizer is not None:
    out.append('no --upload (float32)')
  if 'upload_zero_center' in given or 'upload_clip_std' in given:
    out.append('transforms.uniform_quantization(bits, zero_center=..., '
               'clip_std=...) from Python (no stage form)')
  return out


def check_removed(given, algorithm: str) -> None:
  """Refuses removed compression flags, naming their replacement.

  Args:
    given: removed flag (or option) names -> values as given; other names
      are ignored. ``topk_k`` counts as removed for ``--algorithm=topk``
      only (it remains FetchSGD's k).
    algorithm: the ``--algorithm`` value.

  Raises:
    ConfigError: (one line) e.g. ``--upload_bits=8 was removed; use
      --upload=uniform_quantization:8``.
  """
  removed = set(REMOVED_FLAGS) | ({'topk_k'} if algorithm == 'topk' else set())
  given = {k: v for k, v in given.items() if k in removed and v is not None}
  if not given:
    return
  names = ' '.join(f'--{k}={v}' for k, v in given.items())
  verb = 'was' if len(given) == 1 else 'were'
  raise ConfigError(f'{names} {verb} removed; use '
                    f'{" ".join(_stage_replacement(given, algorithm))}.')


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
    it is empty (no compression, or the algorithm's default).

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


#: Two variables standing in for a model: PVT's upload must encode each
#: variable on its own, with sizes that add up (checked without the model).
_EXAMPLE_VARIABLES = (jax.ShapeDtypeStruct((4096,), jnp.float32),
                      jax.ShapeDtypeStruct((64, 64), jnp.float32))


def _check_per_variable(upload: transforms.CommTransform, options,
                        fraction: float) -> None:
  try:
    transforms.pvt.leaf_bits(upload, _EXAMPLE_VARIABLES, 'pvt')
  except ValueError:
    raise ConfigError(
        f'--upload={_opt(options, UPLOAD)} with --pvt_fraction={fraction}: '
        'partial variable training needs per-variable upload stages '
        '(identity, uniform_quantization, terngrad).') from None


def compression_from_options(options) -> fedopt.Compression:
  """A :class:`fedopt.Compression` from resolved option values.

  ``--upload`` / ``--download`` are stage strings
  (:func:`fedlite_jax.transforms.parse_chain`), e.g.
  ``--upload=uniform_quantization:8 --download=uniform_quantization:16``.

  Args:
    options: mapping of option name -> value (missing names take defaults).

  Returns:
    The compression settings.

  Raises:
    ConfigError: bad stage strings or ``--pvt_fraction`` (naming the flag).
  """
  rng = _opt(options, QUANTIZER_RNG)
  fraction = _opt(options, PVT_FRACTION)
  if not 0.0 < fraction <= 1.0:
    raise ConfigError(f'--pvt_fraction={fraction}: must be in (0, 1].')
  download = stages_from_option(options, DOWNLOAD, generator=rng)
  upload = stages_from_option(options, UPLOAD, generator=rng)
  if upload is not None and fraction < 1.0:
    _check_per_variable(upload, options, fraction)
  return fedopt.Compression(download=download, upload=upload,
                            pvt_fraction=float(fraction))


def check_options(options) -> None:
  """Builds the compression that ``options`` describe, without data, so that
  a flag check (``--validate_only``) rejects what a run would.

  Raises:
    ConfigError: as :func:`compression_from_options` (when ``options`` hold
      all of :data:`COMPRESSION_OPTIONS`) or :func:`stages_from_option`;
      ``--upload`` with ``--igc_project_on_server``.
  """
  names = set(options)
  if options.get('igc_project_on_server') and \
      str(options.get(UPLOAD.name, '')).strip():
    raise ConfigError('--igc_project_on_server needs a linear upload; it '
                      f'cannot be combined with --upload={options["upload"]}.')
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
