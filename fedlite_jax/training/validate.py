"""``--validate_only``: a run's checks without training or writing anything."""

from __future__ import annotations

import dataclasses
import pathlib

import jax

from fedlite_jax import datasets
from fedlite_jax import transforms as tx
from fedlite_jax.algorithms import fedopt
from fedlite_jax.common import FLOAT_BITS
from fedlite_jax.training import build as build_lib
from fedlite_jax.training import compression_options
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import registry
from fedlite_jax.training import start as start_lib
from fedlite_jax.training import tasks

ConfigError = config_lib.ConfigError


def _bits_per_client(config: config_lib.RunConfig, c: fedopt.Compression,
                     params) -> dict[str, str]:
  """Upload and download bits per client per round as the ``--upload`` /
  ``--download`` stages ``c`` encode ``params`` (algorithms that take both)."""
  dense = FLOAT_BITS * fedopt.num_params(params)
  names = {o.name for o in registry.get(config.algorithm).options}
  if not {'upload', 'download'} <= names:
    return {'bits per client': f'{dense:,.0f} each way uncompressed; '
                               f'--algorithm={config.algorithm} counts its '
                               'own in each round'}
  out = {}
  for way, chain in (('upload', c.upload), ('download', c.download)):
    bits = dense if chain is None else tx.message_bits(chain, params)
    out[f'{way} bits per client'] = (
        f'{bits:,.0f} ({dense / bits:,.1f}x less than 32-bit floats; '
        f'{bits * config.clients_per_round / 8e6:,.3f} MB per round)')
  if c.pvt_fraction < 1:
    out['upload bits per client'] += (
        f'; PVT trains {c.pvt_fraction:g} of the variables, so the counted '
        'upload is lower and varies by client')
  return out


def validate(config: config_lib.RunConfig) -> dict[str, str]:
  """Checks ``config`` as a run would before its first round, loading the
  data index and building the model, and writes nothing.

  Returns:
    ``{what: value}`` lines to print: the output folder, the data, the
    resolved settings, the bits per client per round and, with
    ``--dp_clip``, z, q and the epsilon after ``--num_rounds``.

  Raises:
    ConfigError: bad settings or ``--upload`` / ``--download`` stages, the
      output folder holds results of other flags (without
      ``--overwrite``), the cohort exceeds the training clients, or the
      ``--dp_*`` accounting cannot be set up (population, target epsilon).
    datasets.DatasetNotFoundError: the data is not on disk (and
      ``--allow_download`` is not set).
  """
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  compression = compression_options.run_compression(config)
  out = pathlib.Path(config.output_dir or start_lib.default_output_dir(config))
  reason = start_lib.conflict(config, start_lib.fingerprint_of(config), out)
  if reason is not None:
    raise ConfigError(reason)
  lines = {'output folder': str(out)}
  try:  # Never a download here.
    train_fd, _, info = task.load_data(
        dataclasses.replace(config, allow_download=False))
  except datasets.DatasetNotFoundError:
    if not config.allow_download:
      raise
    lines['data'] = 'not on disk; the run downloads it (--allow_download)'
    return {**lines, 'flags': _flags(config)}
  build_lib.check_cohort(config, train_fd.num_clients())
  lines['data'] = info.description
  model = task.build_model(dataclasses.replace(
      config, conv_implementation='lax'), info).model  # Same parameters.
  params = model.init(jax.random.PRNGKey(config.seed))
  dp = dp_options.resolve(config, train_fd.num_clients(),
                          fedopt.num_params(params))
  if dp is not None:
    lines['privacy'] = (
        f'{dp_options.mechanism(config)}, z={dp.dp.noise_multiplier:.6g}, '
        f'q={dp.sampling_probability:.6g}, '
        f'epsilon={dp.epsilon(config.num_rounds):.6g} ({dp.accountant}) at '
        f'delta={dp.delta} after {config.num_rounds} rounds')
  bits = _bits_per_client(config, compression, params)
  if dp is not None and dp.secure is not None:
    up = dp.secure.bits * dp.secure.dim
    bits['upload bits per client'] = (
        f'{up:,.0f} (secure aggregation: --dp_bits={dp.secure.bits} x '
        f'{dp.secure.dim:,} padded coordinates; '
        f'{up * config.clients_per_round / 8e6:,.3f} MB per round)')
  return {**lines, 'flags': _flags(config), **bits}


def _flags(config: config_lib.RunConfig) -> str:
  """The resolved settings that determine the result, and ``--num_rounds``,
  as flags; none unset (None) or that the task or algorithm refuses."""
  fingerprint = config.fingerprint()
  options = fingerprint.pop('options', {})
  fields = {'num_rounds': config.num_rounds, **fingerprint}
  return ' '.join(f'--{k}={v}' for k, v in {**fields, **options}.items()
                  if v is not None and (
                      k in options or config_lib.applies(config, k)))
