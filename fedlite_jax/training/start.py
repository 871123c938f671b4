"""Before any data is loaded: the output folder, resume or start over, and
run.json (the run's fingerprint and code version)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Any, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from fedlite_jax.rounds import default_engine_name
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import evaluation
from fedlite_jax.training import outputs
from fedlite_jax.training import registry
from fedlite_jax.training import round_metrics
from fedlite_jax.training import state_io
from fedlite_jax.rounds import sharding

ConfigError = config_lib.ConfigError
LOG = logging.getLogger('fedlite_jax.training')


def engine_name(config: config_lib.RunConfig, mesh: sharding.ClientMesh) -> str:
  """``--round_engine`` with ``auto`` resolved (vmap on several devices)."""
  if config.round_engine != 'auto':
    return config.round_engine
  return 'vmap' if mesh.num_devices > 1 else default_engine_name()


def model_config(config: config_lib.RunConfig,
                 engine: str) -> config_lib.RunConfig:
  """``config`` with its algorithm's ``AlgorithmSpec.model_overrides``
  (e.g. ``--conv_implementation=auto`` resolved)."""
  spec = registry.get(config.algorithm)
  overrides = spec.model_overrides(config, engine)
  return dataclasses.replace(config, **overrides) if overrides else config


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


#: Short names of ``--upload`` / ``--download`` stages in folder names.
_STAGE_SHORT = {'intrinsic_projection': 'igc', 'uniform_quantization': 'q',
                'top_k': 'topk', 'terngrad': 'tern'}


def _stages_short(stages: str) -> str:
  """``intrinsic_projection:4096,uniform_quantization:8`` -> ``igc4096-q8``
  (other stages: their name without ``_``, then their arguments)."""
  parts = []
  for stage in filter(None, (s.strip() for s in str(stages).split(','))):
    name, *args = [a.strip() for a in stage.split(':')]
    short = _STAGE_SHORT.get(name, name.replace('_', ''))
    parts.append(re.sub(r'[^A-Za-z0-9.]', '', short + '.'.join(args)))
  return '-'.join(parts)


def _name_parts(config: config_lib.RunConfig) -> list[str]:
  """The readable parts of :func:`default_output_dir`'s name."""
  options = config.options
  parts = [config.task, config.algorithm]
  for flag in ('up', 'down'):
    stages = options.get('upload' if flag == 'up' else 'download') or ''
    if short := _stages_short(stages):
      parts.append(f'{flag}-{short}')
  if dp_options.enabled(config):
    epsilon = float(options.get('dp_target_epsilon') or 0.0)
    parts.append(f'dp-eps{epsilon:g}' if epsilon > 0 else
                 f'dp-z{float(options.get("dp_noise_multiplier", 0.0)):g}')
  return parts + [f'seed{config.seed}']


def default_output_dir(config: config_lib.RunConfig) -> str:
  """``runs/<task>_<algorithm>[_up-<stages>][_down-<stages>][_dp-eps<e> |
  _dp-z<z>]_seed<seed>_<hash>`` of a resolved config, e.g.
  ``runs/emnist_fedavg_up-igc4096-q8_seed0_159d7982``.

  Stages are shortened (``intrinsic_projection:4096`` -> ``igc4096``,
  ``uniform_quantization:8`` -> ``q8``, ``top_k:5000`` -> ``topk5000``,
  ``terngrad`` -> ``tern``; chained with ``-``); DP runs name their
  ``--dp_target_epsilon``, else their ``--dp_noise_multiplier``. ``hash``
  is 8 hex digits of the settings that change the result, but the seed, so
  runs of other settings never share a folder.
  """
  fingerprint = {k: v for k, v in config.fingerprint().items()
                 if k != 'seed'}
  digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True,
                                     default=str).encode()).hexdigest()[:8]
  return str(pathlib.Path('runs') /
             '_'.join(_name_parts(config) + [digest]))


@dataclasses.dataclass
class Start:
  """What :func:`plan` decided before any data is loaded.

  Attributes:
    fingerprint: the run's result-determining settings (checked on resume).
    resume_from: the checkpoint to continue from, or None (round 0).
    code: this checkout's :func:`outputs.code_version`.
    stored: when nothing is to be trained (the folder holds ``--num_rounds``
      rounds or more of this run), what the run returns instead of a new
      summary (:func:`stored_result`); None otherwise.
  """
  fingerprint: dict[str, Any]
  resume_from: Optional[pathlib.Path]
  code: dict[str, Any]
  stored: Optional[dict[str, Any]] = None


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
  ``scratch``, this process's output directory). With ``--overwrite``, a
  folder holding ``--num_rounds`` rounds or more starts over.

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
  if config.overwrite and latest is not None and \
      int(latest.name) >= config.num_rounds:
    LOG.warning('--overwrite: %s holds %s rounds, --num_rounds=%d are done; '
                'starting over.', out, latest.name, config.num_rounds)
    latest = None
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
  if resume_from is not None:
    stored = stored_result(config, fingerprint, out, resume_from)
    if stored is not None:
      return Start(fingerprint, resume_from, code, stored)
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
                               else previous_code, config.num_rounds)
  return Start(fingerprint, resume_from, code)


def _checked_identity(checkpoint: pathlib.Path,
                      fingerprint: dict[str, Any]) -> None:
  """Raises CheckpointError unless ``checkpoint`` was written by a run of
  ``fingerprint`` (as the restore would)."""
  diffs = state_io.metadata_differences(state_io.read_metadata(checkpoint),
                                        fingerprint)
  if diffs:
    raise state_io.CheckpointError(
        f'Checkpoint {checkpoint} was written with other metadata; refusing '
        f'to resume. Differences: {"; ".join(diffs)}. Resume with the flags '
        'it was written with, or pass another --output_dir to start over.')


def _metrics_text(values: dict[str, Any]) -> str:
  return ', '.join(f'{k} {v:.4f}' for k, v in sorted(values.items())
                   if isinstance(v, float))


def _stored_line(config: config_lib.RunConfig, out: pathlib.Path,
                 round_num: int) -> str:
  """``[task / algorithm] result at round N (stored): ...`` from the rows
  of rounds <= ``round_num`` in metrics.jsonl: the evaluation of round N,
  else its training loss and the last evaluation before it."""
  rows = [r for r in outputs.read_metrics(out / 'metrics.jsonl')
          if r['round'] <= round_num]
  row = rows[-1] if rows and rows[-1]['round'] == round_num else {}
  if round_metrics.is_evaluation(row):
    what = f'test {_metrics_text(round_metrics.eval_metrics(row))}'
  else:
    what = 'no evaluation at that round'
    if 'train/loss' in row:
      what += f' (train loss {row["train/loss"]:.4f})'
    if evals := round_metrics.evaluations(rows):
      what += (f'; last evaluation, round {evals[-1]["round"]}: test '
               f'{_metrics_text(round_metrics.eval_metrics(evals[-1]))}')
  return (f'[{config.task} / {config.algorithm}] result at round {round_num} '
          f'(stored): {what}; from {out / "metrics.jsonl"}, nothing was run.')


def stored_result(config: config_lib.RunConfig, fingerprint: dict[str, Any],
                  out: pathlib.Path, latest: pathlib.Path
                  ) -> Optional[dict[str, Any]]:
  """What a run that trains nothing returns, or None if rounds are to run.

  ``latest`` (the newest checkpoint) holds ``R`` rounds. A
  ``--dp_target_epsilon`` run keeps the ``--num_rounds`` it was calibrated
  to (run.json). ``--num_rounds`` > R: None (the run continues, logging ``Continuing from round R to N``;
  a stale summary.json is removed). = R with a summary.json of R rounds:
  nothing is run. < R with a checkpoint at exactly that round: its stored
  result. Nothing is written in either case.

  Returns:
    ``{'status': 'stored', 'rounds', 'output_dir', 'message', 'row'}``:
    ``message`` the one line to show, ``row`` the stored metrics row of
    ``rounds`` (or None).

  Raises:
    ConfigError: fewer rounds than stored and no checkpoint at that round;
      more ``--num_rounds`` than a ``--dp_target_epsilon`` run's.
    state_io.CheckpointError: a checkpoint of other flags.
    evaluation.TrainingFailedError: all rounds are done and summary.json
      says the run failed.
  """
  held, wanted = int(latest.name), config.num_rounds
  planned = outputs.read_planned_rounds(out)
  epsilon = float(config.options.get('dp_target_epsilon') or 0.0)
  if wanted > held and planned not in (None, wanted) and epsilon > 0 and \
      dp_options.enabled(config):
    raise ConfigError(
        f'{out} holds {held} rounds of a run whose noise multiplier '
        f'--dp_target_epsilon={epsilon:g} calibrated to --num_rounds='
        f'{planned}; pass --num_rounds={planned}, a new --output_dir, or '
        '--noresume --overwrite to start over.')
  if wanted > held:
    LOG.info('Continuing from round %d to %d.', held, wanted)
    if jax.process_index() == 0:
      (out / 'summary.json').unlink(missing_ok=True)
    return None
  summary = outputs.read_summary(out) or {}
  if wanted == held and summary.get('rounds') != held:
    return None  # Killed before its summary: the run finishes it.
  at = out / 'checkpoints' / str(wanted)
  if wanted < held and not state_io.is_checkpoint(at):
    raise ConfigError(
        f'{out} holds {held} rounds; --num_rounds={wanted} is fewer: pass '
        f'--num_rounds={held} for its result, more to continue, a new '
        '--output_dir, or --overwrite to start over.')
  _checked_identity(latest if wanted == held else at, fingerprint)
  if wanted == held:
    message = (f'Nothing was run: {out} holds all {held} rounds of this run; '
               f'its result is in {out / "summary.json"}.')
    if summary.get('status') == 'failed':
      raise evaluation.TrainingFailedError(
          f'{message[:-1]} (status "failed": {summary.get("failure")}); '
          'pass --overwrite to start over.')
  else:
    message = _stored_line(config, out, wanted)
  rows = [r for r in outputs.read_metrics(out / 'metrics.jsonl')
          if r['round'] == wanted]
  return {'status': 'stored', 'rounds': wanted, 'output_dir': str(out),
          'message': message, 'row': rows[-1] if rows else None}
