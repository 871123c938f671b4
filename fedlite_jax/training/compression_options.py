"""Options shared by several algorithms (one flag each), and their parsing.

E.g. ``--local_steps`` and the compression flags of Ro et al. (2022)
(:data:`COMPRESSION_OPTIONS`: ``--upload`` / ``--download`` stage strings of
:func:`fedlite_jax.transforms.parse_chain`, ``--pvt_fraction``,
``--quantizer_rng``). Imports no ``algo_*`` module and no registry.
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
    'local_steps', 0, 'Local steps per round, each on one shuffled batch. 0 = '
    'the default: one step for sgd/topk/fetchsgd/igc_* (Melas-Kyriazi & Wang '
    '2022, FetchSGD), --client_epochs passes for fedavg. > 0: exactly that '
    'many (data repeated as needed); compressed algorithms then compress the '
    'delta.', lower_bound=0)

NONFINITE_UPDATES = Option(
    'nonfinite_updates', 'raise', 'A client update with NaN/Inf: raise = stop '
    'the run naming the clients (before the round is evaluated or '
    'checkpointed); skip = drop the client from its round (0 upload bits; '
    'counted in communication.skipped_client_rounds) with a warning; a round '
    'of only skipped clients, or a non-finite server model, stops the run. A '
    'run stopped by raise can resume with skip.',
    choices=nonfinite.POLICIES, affects_result=False)

TOPK_K = Option(
    'topk_k', 12_000, 'FetchSGD k: coordinates updated per round, <= number of '
    'parameters (Top-K uploads: --upload=top_k:k).', lower_bound=1)

#: ``--algorithm=topk`` with an empty ``--upload``.
TOPK_DEFAULT_UPLOAD = 'top_k:12000'

DOWNLOAD_ACCOUNTING = Option(
    'download_accounting', 'changed', 'Download bits of topk/fetchsgd: changed '
    '= 32 per weight changed since the client last took part (FetchSGD), dense '
    '= 32 per parameter.', choices=fedopt.DOWNLOAD_ACCOUNTING)


PVT_FRACTION = Option(
    'pvt_fraction', 1.0, 'Partial variable training: target trainable share of '
    'the parameters per client-round, in (0, 1]; 1 = all.', lower_bound=0.0)
QUANTIZER_RNG = Option(
    'quantizer_rng', 'hash', 'Random numbers for stochastic rounding: hash '
    '(fast counter-based) or threefry (jax.random.uniform).',
    choices=transforms.uniform.GENERATORS)
UPLOAD = Option(
    'upload', '',
    'Upload compression: comma-separated stages applied left to right, '
    'named after the fedlite_jax.transforms functions: '
    + ', '.join(transforms.STAGE_FORMS) + '; e.g. '
    'intrinsic_projection:4096,uniform_quantization:8 (subspace seed 0 '
    'unless given). Applied to the client delta (igc_*: to the d uploaded '
    f'coordinates); empty = float32 (topk: {TOPK_DEFAULT_UPLOAD}).')
DOWNLOAD = Option(
    'download', '', 'Download (server model) compression as --upload stages, '
    'e.g. uniform_quantization:16; empty = float32.')

#: igc_*: the projection of the summed deltas on the server (here for
#: :func:`check_options`).
IGC_PROJECT_ON_SERVER = Option(
    'igc_project_on_server', False, 'Faster simulation, same result up to '
    'float rounding: project the per-subspace weighted sum of client deltas '
    'once on the server (the projection is linear); bits counted per client. '
    'Not with --upload.')

#: The compression flags of fedavg, fedprox and mime_lite.
COMPRESSION_OPTIONS = (UPLOAD, DOWNLOAD, PVT_FRACTION, QUANTIZER_RNG)

#: Removed compression flags (:func:`check_removed` names the replacement).
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
    given: flag names -> values; names not in :data:`REMOVED_FLAGS` are
      ignored, except ``topk_k`` for ``algorithm='topk'``.
    algorithm: the ``--algorithm`` value.

  Raises:
    ConfigError: e.g. ``--upload_bits=8 was removed; use
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
  """:func:`transforms.parse_chain` of :data:`UPLOAD` or :data:`DOWNLOAD`
  in ``options`` (None if empty), with quantizer ``generator``.

  Raises:
    ConfigError: a bad stage string, naming the flag.
  """
  stages = str(_opt(options, option)).strip()
  if not stages:
    return None
  try:
    return transforms.parse_chain(stages, generator=generator)
  except ValueError as e:
    raise ConfigError(f'--{option.name}={stages}: {e}') from None


#: Stand-in variables: PVT's upload must encode each variable on its own.
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
  """A :class:`fedopt.Compression` from option values (missing: defaults).

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
  """The checks of ``options`` that need no stage string parsed (ConfigError);
  :func:`run_compression` parses and checks the stages."""
  if _opt(options, IGC_PROJECT_ON_SERVER) and \
      str(_opt(options, UPLOAD)).strip():
    raise ConfigError('--igc_project_on_server needs a linear upload; it '
                      f'cannot be combined with --upload={_opt(options, UPLOAD)}.')
  fraction = _opt(options, PVT_FRACTION)
  if PVT_FRACTION.name in options and not 0.0 < fraction <= 1.0:
    raise ConfigError(f'--pvt_fraction={fraction}: must be in (0, 1].')


def run_compression(config) -> fedopt.Compression:
  """The compression of a resolved ``RunConfig``, its ``--upload`` and
  ``--download`` stage strings parsed: once per run (the runner and
  ``--validate_only`` carry the result to the algorithm's builder).

  An algorithm without one of the options gets None for its chain;
  ``--algorithm=topk`` with an empty ``--upload`` gets
  :data:`TOPK_DEFAULT_UPLOAD`.

  Raises:
    ConfigError: a bad stage string or ``--pvt_fraction`` (naming the flag).
  """
  options = dict(config.options)
  if config.algorithm == 'topk' and not str(
      options.get(UPLOAD.name, '')).strip():
    options[UPLOAD.name] = TOPK_DEFAULT_UPLOAD
  return compression_from_options(options)


def compression_of(ctx) -> fedopt.Compression:
  """``ctx.compression`` of a ``spec.BuildContext``, or
  :func:`run_compression` of ``ctx.config`` for a context built without it."""
  if ctx.compression is not None:
    return ctx.compression
  return run_compression(ctx.config)


def local_steps(options) -> int:
  """``--local_steps`` for the one-step algorithms (0 means 1)."""
  return int(_opt(options, LOCAL_STEPS)) or 1


def derived_seed(option_value: int, run_seed: int, salt: bytes) -> int:
  """``option_value`` if >= 0, else a 32-bit seed derived from the run seed."""
  if option_value >= 0:
    return int(option_value) % 2**32
  return zlib.crc32(salt + int(run_seed).to_bytes(8, 'little', signed=True))


def engine_options(config) -> dict:
  """The round engine's keyword arguments of a ``RunConfig``
  (``rounds.make_engine``: engine name and lane settings)."""
  return dict(engine=config.round_engine,
              lanes_per_device=config.lanes_per_device,
              segment_steps=config.segment_steps)
