"""The federated training loop: sample, train, account, evaluate, checkpoint.

The same flags give the same result, also across kills and restarts; see
``docs/notes/training.md`` for the determinism and restart rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import platform
import shutil
import tempfile
import time
import zlib
from typing import Any, Optional

from absl import logging
import fedjax
import jax
import numpy as np
import tqdm

from fedlite_jax import checkpoint
from fedlite_jax.algorithms import fedopt
from fedlite_jax.comm import CommLedger
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import data_path
from fedlite_jax.training import evaluation
from fedlite_jax.training import init_params
from fedlite_jax.training import outputs
from fedlite_jax.training import registry
from fedlite_jax.training import tasks
from fedlite_jax.rounds import default_engine_name
from fedlite_jax.rounds import engine as engine_lib
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import sharding

RunConfig = config_lib.RunConfig
ConfigError = config_lib.ConfigError

#: Engine counts of a metrics.jsonl row's rounds (``rounds.recording_stats``):
#: useful local steps, steps executed (incl. masked), compiled-program runs.
ROW_COUNTS = ('client_steps', 'padded_steps', 'chunks')
#: Wall-clock fields of a metrics.jsonl row (differ between identical runs).
ROW_TIMINGS = ('seconds_per_round', 'data_seconds', 'train_seconds',
               'eval_seconds')


def client_rng(seed: int, round_num: int, client_id: bytes) -> jax.Array:
  """The PRNG key of ``client_id`` in round ``round_num`` of a run."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), round_num)
  return jax.random.fold_in(key, zlib.crc32(bytes(client_id)))


def build_algorithm(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  """The ``--algorithm`` as a FedJAX algorithm (see ``registry``)."""
  return registry.get(ctx.config.algorithm).build(ctx)


def run(config: RunConfig) -> dict[str, Any]:
  """Runs (or resumes) one federated experiment and returns the summary.

  Args:
    config: the run's settings; ``None`` fields take the task's defaults.

  Returns:
    The summary also written to ``output_dir/summary.json``: ``final_eval``,
    ``communication`` (bytes each way, compression vs uncompressed FedAvg),
    ``rounds``, ``seconds_per_round``, ``flags`` and more.

  Raises:
    ConfigError: bad settings or ``--init_checkpoint``; an ``output_dir`` in
      use, or holding results of other flags (without ``--overwrite``).
    FileNotFoundError: missing data (the message names the files).
    checkpoint.CheckpointError: a corrupt or mismatched checkpoint.
    FloatingPointError: the model diverged (non-finite updates).
  """
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  if config.output_dir is None:
    config = dataclasses.replace(config, output_dir=str(
        pathlib.Path('runs') /
        f'{config.task}_{config.algorithm}_seed{config.seed}'))
  if config.num_processes > 1 and not jax.distributed.is_initialized():
    sharding.initialize_distributed(
        config.coordinator_address, config.num_processes, config.process_id,
        timeout_s=config.distributed_timeout)
  try:
    mesh = sharding.make_client_mesh(config.num_devices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if mesh.num_processes != config.num_processes:
    raise ConfigError(f'--num_processes={config.num_processes}, but JAX runs '
                      f'{mesh.num_processes} processes.')
  sharding.check_same_across_processes('Flags', config.fingerprint())
  # Process 0 writes every output and checkpoint; the others write to a
  # private scratch directory (removed at the end) and read checkpoints
  # from the shared output directory.
  out = pathlib.Path(config.output_dir)
  writer_process = jax.process_index() == 0
  with contextlib.ExitStack() as stack:
    if writer_process:
      out.mkdir(parents=True, exist_ok=True)
      stack.enter_context(outputs.lock_output_dir(out))
      # Leftovers of writes killed mid-way (nobody else writes here now).
      checkpoint.remove_partial_files(out / 'checkpoints')
      outputs.remove_partial_files(out)
      scratch = out
    else:
      scratch = pathlib.Path(tempfile.mkdtemp(prefix='fedlite_process'))
      stack.callback(shutil.rmtree, scratch, ignore_errors=True)
      for name in ('metrics.jsonl', 'communication.csv'):
        if (out / name).exists():
          shutil.copy(out / name, scratch / name)
    return _run(config, task, mesh, out, scratch)


def _load_init(config: RunConfig, like: Any
               ) -> Optional[init_params.InitParams]:
  """The ``--init_checkpoint`` parameters (None without it), or ConfigError."""
  if not config.init_checkpoint:
    return None
  try:
    init = init_params.load_init_params(config.init_checkpoint, like)
  except (OSError, ValueError) as e:
    raise ConfigError(str(e)) from None
  logging.info('Starting from --init_checkpoint=%s (%s%s, sha256 %s).',
               init.path, init.source,
               '' if init.round is None else f' after round {init.round}',
               init.sha256)
  return init


def _init_sha256(config: RunConfig) -> Optional[str]:
  """SHA-256 of the ``--init_checkpoint`` file (None without it)."""
  if not config.init_checkpoint:
    return None
  try:
    return init_params.file_sha256(config.init_checkpoint)
  except OSError as e:
    raise ConfigError(str(e)) from None


def _plan_start(config: RunConfig, fingerprint: dict[str, Any],
                out: pathlib.Path, scratch: pathlib.Path
                ) -> Optional[pathlib.Path]:
  """The checkpoint to resume from, or None to start over (clearing
  ``scratch``, this process's output directory), before loading data.

  Raises:
    ConfigError: ``out`` holds results these flags cannot continue (without
      ``--overwrite``).
    checkpoint.CheckpointError: with ``--overwrite``, a corrupt checkpoint.
  """
  latest = checkpoint.latest_checkpoint(out / 'checkpoints')
  if latest is not None and config.resume:
    if not config.overwrite:
      return latest  # The restore checks it against these flags.
    diffs = checkpoint.metadata_differences(
        checkpoint.read_metadata(latest), fingerprint)
    if not diffs:
      return latest
    logging.warning('--overwrite: replacing the results in %s (%s).', out,
                    '; '.join(diffs))
  # Results: evaluations or checkpoints (a run killed before its first
  # evaluation has none worth keeping).
  if not config.overwrite and (latest is not None or
                               (out / 'metrics.jsonl').exists()):
    previous = outputs.read_run_identity(out)
    if previous is None:
      reason = 'holds results of another run (metrics.jsonl or checkpoints)'
    elif diffs := checkpoint.metadata_differences(previous, fingerprint,
                                                   outputs.RUN_FILE):
      reason = f'holds results of a run with other flags ({"; ".join(diffs)})'
    elif not config.resume:
      reason = 'holds results of this run and --noresume was given'
    else:
      reason = None  # Killed before its first checkpoint: start over.
    if reason is not None:
      raise ConfigError(
          f'--output_dir={out} {reason}; pass --overwrite to replace them or '
          'choose another --output_dir.')
    logging.info('%s holds no checkpoint of this run yet; starting over from '
                 'round 0.', out)
  # Every process has decided before process 0 deletes anything.
  sharding.barrier('fedlite_run_start')
  outputs.clear_results(scratch)
  return None


def _run(config: RunConfig, task: tasks.Task, mesh: sharding.ClientMesh,
         out: pathlib.Path, scratch: pathlib.Path) -> dict[str, Any]:
  """The body of :func:`run`; ``scratch`` receives this process's writes."""
  ckpt_dir = scratch / 'checkpoints'
  fingerprint = config.fingerprint()
  init_sha256 = _init_sha256(config)
  if init_sha256 is not None:
    fingerprint['init_checkpoint_sha256'] = init_sha256
    try:
      sharding.check_same_across_processes(
          f'--init_checkpoint={config.init_checkpoint} contents', init_sha256)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  resume_from = _plan_start(config, fingerprint, out, scratch)
  code = outputs.code_version()
  previous_code = outputs.read_code_version(out)
  if resume_from is not None and previous_code and previous_code != code:
    logging.warning(
        'Resuming %s under other code (it started at commit %s, dirty=%s; '
        'now %s, dirty=%s): the rounds before and after the restart may '
        'differ; pass --noresume --overwrite to start over.', out,
        previous_code.get('commit'), previous_code.get('dirty'),
        code['commit'], code['dirty'])
  if jax.process_index() == 0:
    outputs.write_run_identity(out, fingerprint,
                               code if resume_from is None or not previous_code
                               else previous_code)

  train_fd, test_fd, info = task.load_data(config)
  num_train_clients = train_fd.num_clients()
  # What the sampler reads, from the background thread too: decoded clients
  # kept across rounds (--client_cache_mb=0: none), a SQLite connection per
  # thread; inside the multi-process partition (it decides by position).
  source = data_path.ClientCache(train_fd, config.client_cache_mb * 2**20)
  if config.clients_per_round > num_train_clients:
    raise ConfigError(
        f'--clients_per_round={config.clients_per_round} exceeds the '
        f'{num_train_clients} training clients of task {config.task!r}.')
  if mesh.multi_process:
    if config.clients_per_round < mesh.num_processes:
      raise ConfigError(
          f'--clients_per_round={config.clients_per_round}: must be >= '
          f'--num_processes={mesh.num_processes} (every process runs a '
          'client).')
    # Each process loads only the sampled clients it runs.
    train_fd = remote.PartitionedFederatedData(train_fd, mesh.is_local,
                                               mesh.owner)
    source = remote.PartitionedFederatedData(source, mesh.is_local,
                                             mesh.owner)
  split_model = task.build_model(config, info)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(config.seed))
  init = _load_init(config, params)
  if init is not None:
    if init.sha256 != init_sha256:
      raise ConfigError(f'--init_checkpoint={init.path} changed while the '
                        'run started; start it again.')
    params = jax.tree.map(jax.numpy.asarray, init.params)
  spec = registry.get(config.algorithm)
  if mesh.multi_process and not spec.multi_process:
    raise ConfigError(
        f'--algorithm={config.algorithm} does not run across processes yet '
        '(--num_processes > 1); use one process with several devices.')
  with sharding.use_client_mesh(mesh):
    try:
      algorithm = build_algorithm(registry.BuildContext(
          config=config, split_model=split_model,
          num_params=fedopt.num_params(params),
          train_client_ids=tuple(train_fd.client_ids()), info=info))
    except ValueError as e:
      if 'round engine' in str(e):
        raise ConfigError(str(e)) from None
      raise
  state = algorithm.init(params)
  ledger = CommLedger(fedopt.num_params(params), extra_bits={
      k: 0.0 for k in spec.communication_keys})

  start_round, rows = 0, []
  if resume_from is not None:
    start_round, restored = checkpoint.restore_checkpoint(
        resume_from, {'server': state, 'ledger': ledger.state_dict()},
        fingerprint)
    state = restored['server']
    ledger = CommLedger.from_state_dict(restored['ledger'])
    rows = outputs.truncate_metrics(scratch / 'metrics.jsonl', start_round)
    outputs.truncate_csv(scratch / 'communication.csv', start_round)
    logging.info('Resumed from %s at round %d.', resume_from, start_round)

  if info.synthetic_partition:
    logging.warning('Task %s uses a SYNTHETIC federated partition: %s',
                    config.task, info.description)
  writer = outputs.MetricsWriter(
      scratch, purge_step=start_round + 1 if start_round else None)
  csv = (scratch / 'communication.csv').open('a')
  ledger.attach_csv(csv)
  batches = evaluation.eval_batches(test_fd, config.eval_batch_size,
                                    config.eval_num_clients, config.seed)

  def eval_row(round_num: int) -> dict[str, Any]:
    comm = ledger.summary()
    return {'round': round_num,
            **evaluation.evaluate(model, spec.eval_params(state), batches),
            'upload_bytes': comm['total_upload_bytes'],
            'download_bytes': comm['total_download_bytes']}

  if init is not None and start_round == 0:  # The start: nothing sent yet.
    rows.append(eval_row(0))
    writer.write(rows[-1])
  cohorts = data_path.CohortPrefetcher(
      source, config.clients_per_round, config.seed,
      prefetch=config.prefetch_clients)
  cap = config.max_examples_per_client
  engine = config.round_engine
  if engine == 'auto':
    engine = 'vmap' if mesh.num_devices > 1 else default_engine_name()
  round_seconds = [r['seconds_per_round'] for r in rows
                   if 'seconds_per_round' in r]
  # Since the last row: training seconds and non-finite clients skipped per
  # round; seconds waiting for data and training, the engine's step counts.
  recent, skipped = [], []
  pending = dict.fromkeys(('data_seconds', 'train_seconds') + ROW_COUNTS, 0)
  bar = tqdm.tqdm(range(start_round, config.num_rounds), initial=start_round,
                  total=config.num_rounds,
                  disable=not config.progress or jax.process_index() != 0,
                  desc=f'{config.task}/{config.algorithm}', unit='round')
  try:
    with engine_lib.recording_stats() as recorder:
      for r in bar:
        t_data = time.perf_counter()
        sampled = cohorts.get(
            r, next_round=r + 1 if r + 1 < config.num_rounds else -1)
        clients = [(cid, cds[:cap] if cap and len(cds) > cap else cds,
                    client_rng(config.seed, r, cid))
                   for cid, cds, _ in sampled]
        t0 = time.perf_counter()
        state, diagnostics = algorithm.apply(state, clients)
        jax.block_until_ready(state)
        recent.append(time.perf_counter() - t0)
        pending['data_seconds'] += t0 - t_data
        pending['train_seconds'] += recent[-1]
        counts = recorder.take()
        for k in ROW_COUNTS:
          pending[k] += counts[k]
        skipped.append(ledger.record_round(r, diagnostics)['skipped_clients'])
        done = r + 1
        if done % config.eval_every == 0 or done == config.num_rounds:
          t_eval = time.perf_counter()
          row = {**eval_row(done),
                 'seconds_per_round': float(np.mean(recent)),
                 'skipped_clients': int(sum(skipped)),
                 **pending,
                 'eval_seconds': time.perf_counter() - t_eval}
          if any(skipped):
            row['skipped_clients_by_round'] = {
                str(done - len(skipped) + 1 + i): n
                for i, n in enumerate(skipped) if n}
          round_seconds.append(row['seconds_per_round'])
          recent, skipped = [], []
          pending = dict.fromkeys(pending, 0)
          writer.write(row)
          rows.append(row)
          bar.set_postfix({task.metric:
                           f'{row.get(task.metric, float("nan")):.4f}'})
        if (config.checkpoint_every and
            done % config.checkpoint_every == 0) or done == config.num_rounds:
          csv.flush()  # The CSV rows of the checkpointed rounds are on disk.
          checkpoint.save_checkpoint(
              ckpt_dir, done, {'server': state, 'ledger': ledger.state_dict()},
              fingerprint, params=spec.eval_params(state))
      engine_stats = recorder.totals()
  finally:
    cohorts.close()
    bar.close()
    writer.close()
    csv.close()

  final_eval = {k: v for k, v in (rows[-1] if rows else eval_row(0)).items()
                if k not in ('round', 'upload_bytes', 'download_bytes',
                             'seconds_per_round', 'skipped_clients',
                             'skipped_clients_by_round') + ROW_TIMINGS +
                ROW_COUNTS}
  communication = ledger.summary()
  if spec.communication_summary is not None:
    communication.update(spec.communication_summary(ledger.extra_bits))
  summary = {
      'task': config.task,
      'algorithm': config.algorithm,
      'rounds': config.num_rounds,
      'final_eval': final_eval,
      'communication': communication,
      'seconds_per_round': (float(np.mean(round_seconds)) if round_seconds
                            else None),
      'round_engine': engine,
      # Counts over every round (rows of earlier runs of a resumed one too).
      'engine': {'name': engine_stats['name'],
                 'clients_per_chunk': engine_stats['clients_per_chunk'],
                 **{k: int(sum(r.get(k, 0) for r in rows))
                    for k in ROW_COUNTS}},
      'data': info.description,
      'synthetic_partition': info.synthetic_partition,
      'model': {'cut_layer': split_model.cut_layer,
                'cut_size': split_model.cut_size,
                'num_params': ledger.num_params},
      'machine': {'platform': platform.platform(),
                  'python': platform.python_version(), 'jax': jax.__version__,
                  'backend': jax.default_backend(),
                  'devices': [str(d) for d in jax.devices()]},
      'code': code,
      'started_with_code': outputs.read_code_version(out),
      'placement': {'num_devices': mesh.num_devices,
                    'num_processes': mesh.num_processes,
                    'mesh_devices': [str(d) for d in mesh.mesh.devices.flat]},
      'init_checkpoint': None if init is None else init.describe(),
      'flags': dataclasses.asdict(config),
  }
  failure = evaluation.training_failure(final_eval, task.chance_loss(info))
  summary.update(status='failed' if failure else 'ok', failure=failure)
  outputs.write_summary(scratch, summary)
  outputs.plot_curves(scratch, rows, task.metric,
                      f'{config.task} / {config.algorithm} (seed {config.seed})')
  evaluation.check_trained(final_eval, task.chance_loss(info),
                           output_dir=str(out))
  return summary
