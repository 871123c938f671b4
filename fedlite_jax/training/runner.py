"""The experiment runner: set up a run, loop over rounds, hand rows to hooks.

:func:`run` is the top of the house: ``start`` decides where the run begins,
``build`` loads data, model and algorithm, ``loop`` trains round by round,
and the hooks (``hooks/``, one file each) do the rest. The same flags give
the same result, also across kills and restarts (``docs/notes/training.md``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import platform
import shutil
import tempfile
from typing import Any, Sequence

import jax
import numpy as np

from fedlite_jax.rounds import sharding
from fedlite_jax.training import build as build_lib
from fedlite_jax.training import compression_options
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import dp_options
from fedlite_jax.training import evaluation
from fedlite_jax.training import loop
from fedlite_jax.training import outputs
from fedlite_jax.training import start as start_lib
from fedlite_jax.training import tasks
from fedlite_jax.training.hooks import Hook
from fedlite_jax.training.hooks.checkpoints import CheckpointHook
from fedlite_jax.training.hooks.communication_csv import CommunicationCsvHook
from fedlite_jax.training.hooks.curves import CurvesHook
from fedlite_jax.training.hooks.engine_stats import EngineStatsHook
from fedlite_jax.training.hooks.evaluation import EvaluationHook
from fedlite_jax.training.hooks.metrics_file import MetricsFileHook
from fedlite_jax.training.hooks.privacy import PrivacyHook
from fedlite_jax.training.hooks.progress import ProgressHook
from fedlite_jax.training.hooks.tensorboard import TensorBoardHook

RunConfig = config_lib.RunConfig
ConfigError = config_lib.ConfigError
client_rng = loop.client_rng


def ordered_hooks(user_hooks: Sequence[Hook] = (),
                  privacy: bool = False) -> list[Hook]:
  """The runner's hooks and the user's in call order: those that make a
  row (evaluation, engine counts, DP metrics with ``privacy``), the user's
  (keys they add are written), then the writers (metrics.jsonl,
  TensorBoard, communication.csv, checkpoints, progress, curves.png)."""
  return [EvaluationHook(), EngineStatsHook(),
          *([PrivacyHook()] if privacy else []), *user_hooks,
          MetricsFileHook(), TensorBoardHook(), CommunicationCsvHook(),
          CheckpointHook(), ProgressHook(), CurvesHook()]


def run(config: RunConfig, hooks: Sequence[Hook] = ()) -> dict[str, Any]:
  """Runs (or resumes) one federated experiment and returns the summary.

  Args:
    config: the run's settings; ``None`` fields take the task's defaults.
    hooks: the user's :class:`~fedlite_jax.training.hooks.Hook` objects
      (:func:`ordered_hooks`: after the evaluation, before the writers).

  Returns:
    The summary also written to ``output_dir/summary.json``: ``final_eval``,
    ``communication`` (bytes each way, compression vs uncompressed FedAvg),
    ``rounds``, ``seconds_per_round``, ``flags`` and more. When the folder
    holds ``num_rounds`` or more rounds of this run, nothing is trained or
    written: ``{'status': 'stored', 'message', ...}``
    (:func:`start.stored_result`).

  Raises:
    ConfigError: bad settings, ``--upload`` / ``--download`` stages or
      ``--init_checkpoint``; an ``output_dir`` in use, holding results of
      other flags (without ``--overwrite``) or more rounds than asked.
    loop.RunInterrupted: SIGINT / SIGTERM; the rounds done are checkpointed.
    FileNotFoundError: missing data (the message names the files).
    state_io.CheckpointError: a corrupt or mismatched checkpoint.
    FloatingPointError: the model diverged (non-finite updates).
  """
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  compression = compression_options.run_compression(config)
  if config.output_dir is None:
    config = dataclasses.replace(
        config, output_dir=start_lib.default_output_dir(config))
  start_lib.use_compilation_cache(config.compilation_cache_dir)
  if config.num_processes > 1 and not jax.distributed.is_initialized():
    try:
      sharding.initialize_distributed(
          config.coordinator_address, config.num_processes, config.process_id,
          timeout_s=config.distributed_timeout)
    except ValueError as e:
      raise ConfigError(config_lib.flag_message(e)) from None
    except sharding.DistributedInitError as e:
      raise sharding.DistributedInitError(config_lib.flag_message(e)) from None
  try:
    mesh = sharding.make_client_mesh(config.num_devices)
  except ValueError as e:
    raise ConfigError(config_lib.flag_message(e)) from None
  if mesh.num_processes != config.num_processes:
    raise ConfigError(f'--num_processes={config.num_processes}, but JAX runs '
                      f'{mesh.num_processes} processes.')
  sharding.check_same_across_processes('Flags', config.fingerprint())
  # Process 0 writes every output and checkpoint; the others write to a
  # private scratch directory (removed at the end) and read checkpoints
  # from the shared output directory.
  out = pathlib.Path(config.output_dir)
  with contextlib.ExitStack() as stack:
    if jax.process_index() == 0:
      out.mkdir(parents=True, exist_ok=True)
      stack.enter_context(outputs.lock_output_dir(out))
      # Leftovers of killed writes (the checkpointer removes its own).
      outputs.remove_partial_files(out)
      scratch = out
    else:
      scratch = pathlib.Path(tempfile.mkdtemp(prefix='fedlite_process'))
      stack.callback(shutil.rmtree, scratch, ignore_errors=True)
      for name in ('metrics.jsonl', 'communication.csv'):
        if (out / name).exists():
          shutil.copy(out / name, scratch / name)
    start = start_lib.plan(config, out, scratch)
    if start.stored is not None:  # Nothing to train; nothing written.
      return start.stored
    engine = start_lib.engine_name(config, mesh)
    the_run = build_lib.build_run(
        config, task, mesh, engine, start_lib.model_config(config, engine),
        out, scratch, start, compression)
    all_hooks = ordered_hooks(hooks, dp_options.enabled(config))
    for hook in reversed(all_hooks):
      stack.callback(hook.close)
    with loop.stop_signals(mesh.num_processes == 1) as received:
      if (signum := loop.run_rounds(the_run, all_hooks, received)):
        raise loop.interrupted(the_run, all_hooks, signum)
    return _finish(the_run, all_hooks)


def _summary(run: build_lib.Run) -> dict[str, Any]:
  """summary.json before the hooks add theirs (``final_eval``, ``engine``)."""
  config, mesh = run.config, run.mesh
  communication = run.ledger.summary()
  if run.spec.communication_summary is not None:
    communication.update(run.spec.communication_summary(run.ledger.extra_bits))
  train_seconds = [r['time/train_seconds'] for r in run.rows
                   if 'time/train_seconds' in r]
  rounds = run.rows[-1]['round'] if run.rows else run.start_round
  return {
      'task': config.task, 'algorithm': config.algorithm, 'rounds': rounds,
      'stopped_early': run.stop_reason,
      'communication': communication,
      'seconds_per_round': (float(np.mean(train_seconds)) if train_seconds
                            else None),
      'round_engine': run.engine,
      'data': run.info.description,
      'synthetic_partition': run.info.synthetic_partition,
      'model': {'cut_layer': run.split_model.cut_layer,
                'cut_size': run.split_model.cut_size,
                'num_params': run.ledger.num_params},
      'machine': {'platform': platform.platform(),
                  'python': platform.python_version(), 'jax': jax.__version__,
                  'backend': jax.default_backend(),
                  'devices': [str(d) for d in jax.devices()]},
      'code': run.code,
      'started_with_code': outputs.read_code_version(run.out),
      'placement': {'num_devices': mesh.num_devices,
                    'num_processes': mesh.num_processes,
                    'mesh_devices': [str(d) for d in mesh.mesh.devices.flat]},
      'init_checkpoint': None if run.init is None else run.init.describe(),
      # The rounds reached (fewer than asked after a stop).
      'flags': dict(dataclasses.asdict(config), num_rounds=rounds),
  }


def _finish(run: build_lib.Run, hooks: Sequence[Hook]) -> dict[str, Any]:
  """The hooks' ``end``, then summary.json; returns the summary.

  Raises:
    evaluation.TrainingFailedError: the final model is non-finite or no
      better than chance (after writing the outputs).
  """
  summary = _summary(run)
  for hook in hooks:
    hook.end(run, summary)
  chance = run.task.chance_loss(run.info)
  failure = evaluation.training_failure(summary['final_eval'], chance)
  summary.update(status='failed' if failure else 'ok', failure=failure)
  outputs.write_summary(run.scratch, summary)
  evaluation.check_trained(summary['final_eval'], chance,
                           output_dir=str(run.out),
                           privacy=summary.get('privacy'))
  return summary
