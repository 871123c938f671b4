"""Before any data is loaded: the output folder, resume or start over, and
run.json (the run's fingerprint and code version)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from fedlite_jax.training import config as config_lib
from fedlite_jax.training import outputs
from fedlite_jax.training import state_io
from fedlite_jax.rounds import sharding

ConfigError = config_lib.ConfigError
LOG = logging.getLogger('fedlite_jax.training')


def init_error(path: str, e: Exception) -> ConfigError:
  """A state_io error about ``path`` as one line naming --init_checkpoint."""
  return ConfigError(f'--init_checkpoint={path}: '
                     f'{str(e).removeprefix(f"{path}: ")}')


#: Programs that compile in at least this many seconds are cached (JAX's
#: default, 1 s, would leave out a run's evaluation and server programs).
CACHE_MIN_COMPILE_SECONDS = 0.1


def use_compilation_cache(setting: str) -> Optional[str]:
  """Points JAX's persistent compilation cache at ``--compilation_cache_dir``.

  A program XLA compiled in an earlier process (same program, flags, JAX
  and device) is then loaded, not compiled: JAX's own cache, keyed by all
  of these, so results are unchanged. ``auto``: ``$JAX_COMPILATION_CACHE_DIR``
  (JAX's setting) if set, else ``$XDG_CACHE_HOME/fedlite_jax/xla``
  (``~/.cache/fedlite_jax/xla``); ``off``: no cache. Programs that compile
  in :data:`CACHE_MIN_COMPILE_SECONDS` or more are cached, unless
  ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` (or JAX's setting) says
  otherwise. The settings stay for the rest of the process; nothing is
  changed while JAX's cache is disabled
  (``JAX_ENABLE_COMPILATION_CACHE=false``).

  Returns:
    The cache directory (created), or None when off or disabled.

  Raises:
    ConfigError: a directory that cannot be created (the message names the
      flag and the OS error).
  """
  if not jax.config.jax_enable_compilation_cache:
    return None
  path = None
  if setting == 'auto':
    path = jax.config.jax_compilation_cache_dir or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'),
        'fedlite_jax', 'xla')
  elif setting != 'off':
    path = os.path.expanduser(setting)
  if path is not None:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise ConfigError(
          f'--compilation_cache_dir={setting}: cannot create {path} '
          f'({e.strerror}); give a writable directory, or off.') from None
  min_seconds = 'jax_persistent_cache_min_compile_time_secs'
  if path is not None and getattr(jax.config, min_seconds) == 1.0 and \
      min_seconds.upper() not in os.environ:  # JAX's default.
    jax.config.update(min_seconds, CACHE_MIN_COMPILE_SECONDS)
  if path != jax.config.jax_compilation_cache_dir:
    jax_cache.set_cache_dir(path)
    jax_cache.reset_cache()  # Opened again, at the new path, when used.
  if path is not None:
    LOG.info('Compiled programs are cached in %s (--compilation_cache_dir).',
             path)
  return path


def default_output_dir(config: config_lib.RunConfig) -> str:
  """``runs/<task>_<algorithm>_<hash>_seed<seed>``: ``hash`` is 8 hex digits
  of the settings that change the result, but the seed, so a baseline and
  its compressed variant (``--upload``) never share a folder."""
  fingerprint = {k: v for k, v in config.fingerprint().items()
                 if k != 'seed'}
  digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True,
                                     default=str).encode()).hexdigest()[:8]
  return str(pathlib.Path('runs') / f'{config.task}_{config.algorithm}_'
             f'{digest}_seed{config.seed}')


@dataclasses.dataclass
class Start:
  """What :func:`plan` decided before any data is loaded.

  Attributes:
    fingerprint: the run's result-determining settings (checked on resume).
    resume_from: the checkpoint to continue from, or None (round 0).
    code: this checkout's :func:`outputs.code_version`.
  """
  fingerprint: dict[str, Any]
  resume_from: Optional[pathlib.Path]
  code: dict[str, Any]


def fingerprint_of(config: config_lib.RunConfig) -> dict[str, Any]:
  """``config.fingerprint()`` plus the ``--init_checkpoint`` file's SHA-256
  (the same on every process), or ConfigError."""
  fingerprint = config.fingerprint()
  if config.init_checkpoint:
    try:
      sha256 = state_io.file_sha256(config.init_checkpoint)
      sharding.check_same_across_processes(
          f'--init_checkpoint={config.init_checkpoint} contents', sha256)
    except (OSError, ValueError) as e:
      raise init_error(config.init_checkpoint, e) from None
    fingerprint['init_checkpoint_sha256'] = sha256
  return fingerprint


def conflict(config: config_lib.RunConfig, fingerprint: dict[str, Any],
             out: pathlib.Path) -> Optional[str]:
  """Why ``out`` holds results these settings must not touch (without
  ``--overwrite``), as the ConfigError line; None if it may be used."""
  latest = state_io.latest_checkpoint(out / 'checkpoints')
  if config.overwrite or (latest is None and
                          not (out / 'metrics.jsonl').exists()):
    return None
  previous = outputs.read_run_identity(out)
  if previous is None:
    reason = 'holds results of another run (metrics.jsonl or checkpoints)'
  elif diffs := state_io.metadata_differences(previous, fingerprint,
                                                 outputs.RUN_FILE):
    reason = f'holds results of a run with other flags ({"; ".join(diffs)})'
  elif not config.resume:
    reason = 'holds results of this run and --noresume was given'
  else:
    return None
  return (f'--output_dir={out} {reason}; pass --overwrite to replace them or '
          'choose another --output_dir.')


def _resume_from(config: config_lib.RunConfig, fingerprint: dict[str, Any],
                 out: pathlib.Path, scratch: pathlib.Path
                 ) -> Optional[pathlib.Path]:
  """The checkpoint to resume from, or None to start over (clearing
  ``scratch``, this process's output directory).

  Raises:
    ConfigError: ``out`` holds results these flags cannot continue.
    state_io.CheckpointError: with ``--overwrite``, a corrupt checkpoint;
      with ``--resume``, msgpack checkpoints of fedlite_jax 644e428 or
      before (:func:`state_io.legacy_error`).
  """
  if config.resume and state_io.legacy_checkpoints(out / 'checkpoints'):
    raise state_io.CheckpointError(
        f'{state_io.legacy_error(out / "checkpoints")} Finish the run with '
        f'fedlite_jax at commit {state_io.LEGACY_COMMIT}, or pass --noresume '
        '--overwrite to start it over; --init_checkpoint takes their model '
        'parameters.')
  latest = state_io.latest_checkpoint(out / 'checkpoints')
  if latest is not None and config.resume:
    if not config.overwrite:
      return latest  # The restore checks it against these flags.
    diffs = state_io.metadata_differences(
        state_io.read_metadata(latest), fingerprint)
    if not diffs:
      return latest
    LOG.warning('--overwrite: replacing the results in %s (%s).', out,
                '; '.join(diffs))
  if (reason := conflict(config, fingerprint, out)) is not None:
    raise ConfigError(reason)
  if latest is not None or (out / 'metrics.jsonl').exists():
    LOG.info('%s holds no checkpoint of this run yet; starting over from '
             'round 0.', out)
  # Every process has decided before process 0 deletes anything.
  sharding.barrier('fedlite_run_start')
  outputs.clear_results(scratch)
  return None


def plan(config: config_lib.RunConfig, out: pathlib.Path,
         scratch: pathlib.Path) -> Start:
  """Plans the start (resume or round 0) and writes run.json (process 0).

  Raises:
    ConfigError: an unreadable ``--init_checkpoint``, or results these flags
      cannot continue.
  """
  fingerprint = fingerprint_of(config)
  resume_from = _resume_from(config, fingerprint, out, scratch)
  code = outputs.code_version()
  previous_code = outputs.read_code_version(out)
  if resume_from is not None and previous_code and previous_code != code:
    LOG.warning(
        'Resuming %s under other code (it started at commit %s, dirty=%s; '
        'now %s, dirty=%s): the rounds before and after the restart may '
        'differ; pass --noresume --overwrite to start over.', out,
        previous_code.get('commit'), previous_code.get('dirty'),
        code['commit'], code['dirty'])
  if jax.process_index() == 0:
    outputs.write_run_identity(out, fingerprint,
                               code if resume_from is None or not previous_code
                               else previous_code)
  return Start(fingerprint, resume_from, code)
