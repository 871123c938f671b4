"""The federated training loop: sample, train, account, evaluate, checkpoint.

The same flags give the same result, also across kills and restarts; see
``docs/notes/training.md`` for the determinism and restart rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from fedlite_jax.training import round_metrics
from fedlite_jax.training import tasks
from fedlite_jax.rounds import default_engine_name
from fedlite_jax.rounds import engine as engine_lib
from fedlite_jax.rounds import errors as rounds_errors
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import sharding
from fedlite_jax.rounds import stats as stats_lib

RunConfig = config_lib.RunConfig
ConfigError = config_lib.ConfigError

@functools.partial(jax.jit, static_argnums=0)
def _client_key(seed: int, round_num: np.uint32, crc: np.uint32) -> jax.Array:
  key = jax.random.fold_in(jax.random.PRNGKey(seed), round_num)
  return jax.random.fold_in(key, crc)


def client_rng(seed: int, round_num: int, client_id: bytes) -> jax.Array:
  """The PRNG key of ``client_id`` in round ``round_num`` of a run:
  ``fold_in(fold_in(PRNGKey(seed), round_num), crc32(client_id))``, one
  compiled program per seed (``uint32[2]``)."""
  return _client_key(int(seed), np.uint32(round_num),
                     np.uint32(zlib.crc32(bytes(client_id))))


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
  writer_process = jax.process_index() == 0
  with contextlib.ExitStack() as stack:
    if writer_process:
      out.mkdir(parents=True, exist_ok=True)
      stack.enter_context(outputs.lock_output_dir(out))
      # Leftovers of writes killed mid-way (nobody else writes here now;
      # the checkpointer removes those of killed checkpoint saves).
      outputs.remove_partial_files(out)
      scratch = out
    else:
      scratch = pathlib.Path(tempfile.mkdtemp(prefix='fedlite_process'))
      stack.callback(shutil.rmtree, scratch, ignore_errors=True)
      for name in ('metrics.jsonl', 'communication.csv'):
        if (out / name).exists():
          shutil.copy(out / name, scratch / name)
    return _run(config, task, mesh, out, scratch)


def _engine_name(config: RunConfig, mesh: sharding.ClientMesh) -> str:
  """``--round_engine`` with ``auto`` resolved (vmap on several devices)."""
  if config.round_engine != 'auto':
    return config.round_engine
  return 'vmap' if mesh.num_devices > 1 else default_engine_name()


def _model_config(config: RunConfig, mesh: sharding.ClientMesh
                  ) -> RunConfig:
  """``config`` with its algorithm's ``AlgorithmSpec.model_overrides``
  (e.g. ``--conv_implementation=auto`` resolved)."""
  spec = registry.get(config.algorithm)
  overrides = spec.model_overrides(config, _engine_name(config, mesh))
  return dataclasses.replace(config, **overrides) if overrides else config


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
    checkpoint.CheckpointError: with ``--overwrite``, a corrupt checkpoint;
      with ``--resume``, msgpack checkpoints of fedlite_jax 644e428 or
      before (:func:`checkpoint.legacy_error`).
  """
  if config.resume and checkpoint.legacy_checkpoints(out / 'checkpoints'):
    raise checkpoint.legacy_error(out / 'checkpoints')
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


@dataclasses.dataclass
class _Start:
  """What :func:`_start` decided before any data is loaded.

  Attributes:
    fingerprint: the run's result-determining settings (checked on resume).
    resume_from: the checkpoint to continue from, or None (round 0).
    code: this checkout's :func:`outputs.code_version`.
  """
  fingerprint: dict[str, Any]
  resume_from: Optional[pathlib.Path]
  code: dict[str, Any]


@dataclasses.dataclass
class _Built:
  """The run as :func:`_build` set it up for the round loop.

  Attributes:
    spec, algorithm, state, ledger: the algorithm, its server state and the
      communication ledger (``state``/``ledger`` advance round by round).
    split_model, info: the task's model and dataset description.
    source: the training clients as the sampler reads them.
    test_batches: the evaluation batches.
    init: the ``--init_checkpoint`` parameters, or None.
    engine: the round engine's name.
    conv_implementation: the CNN convolutions the model was built with.
    start_round: rounds already done (restored from a checkpoint).
    rows: metrics.jsonl rows so far (of rounds <= ``start_round``).
  """
  spec: Any
  algorithm: fedjax.FederatedAlgorithm
  state: Any
  ledger: CommLedger
  split_model: Any
  info: Any
  source: Any
  test_batches: Any
  init: Optional[init_params.InitParams]
  engine: str
  conv_implementation: str
  start_round: int
  rows: list[dict[str, Any]]

  def evaluate(self, round_num: int) -> dict[str, Any]:
    """The evaluation part of a row: test metrics (flat) and the bytes so
    far (``upload_bytes``, ``download_bytes``)."""
    comm = self.ledger.summary()
    return {**evaluation.evaluate(self.split_model.model,
                                  self.spec.eval_params(self.state),
                                  self.test_batches),
            'upload_bytes': comm['total_upload_bytes'],
            'download_bytes': comm['total_download_bytes']}

  def checkpoint_state(self) -> dict[str, Any]:
    return {'server': self.state, 'ledger': self.ledger.state_dict()}


def _run(config: RunConfig, task: tasks.Task, mesh: sharding.ClientMesh,
         out: pathlib.Path, scratch: pathlib.Path) -> dict[str, Any]:
  """The body of :func:`run`; ``scratch`` receives this process's writes."""
  start = _start(config, out, scratch)
  built = _build(config, task, mesh, start, scratch)
  with outputs.MetricsWriter(scratch, purge_step=(
      built.start_round + 1 if built.start_round else None)) as writer:
    if built.init is not None and built.start_round == 0:
      # The start, evaluated (nothing sent yet).
      built.rows.append({'round': 0, **built.evaluate(0)})
      writer.write(built.rows[-1])
    engine_stats, compiles = _round_loop(config, task, built, writer, scratch,
                                         start.fingerprint)
    return _finish(config, task, mesh, built, writer, engine_stats, compiles,
                   start, out, scratch)


def _start(config: RunConfig, out: pathlib.Path,
           scratch: pathlib.Path) -> _Start:
  """Plans the start (resume or round 0) and writes run.json (process 0).

  Raises:
    ConfigError: an unreadable or changing ``--init_checkpoint``, results
      these flags cannot continue (see :func:`_plan_start`).
  """
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
  return _Start(fingerprint, resume_from, code)


def _build(config: RunConfig, task: tasks.Task, mesh: sharding.ClientMesh,
           start: _Start, scratch: pathlib.Path) -> _Built:
  """Loads the data, builds model and algorithm, restores the checkpoint.

  Raises:
    ConfigError: settings that do not fit the data, the mesh or the
      algorithm; an ``--init_checkpoint`` that does not fit the model.
    checkpoint.CheckpointError: a corrupt or mismatched checkpoint.
  """
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
  model_config = _model_config(config, mesh)
  split_model = task.build_model(model_config, info)
  params = split_model.model.init(jax.random.PRNGKey(config.seed))
  init = _load_init(config, params)
  if init is not None:
    if init.sha256 != start.fingerprint.get('init_checkpoint_sha256'):
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
    except rounds_errors.EngineConfigError as e:
      raise ConfigError(config_lib.flag_message(e)) from None
  state = algorithm.init(params)
  ledger = CommLedger(fedopt.num_params(params), extra_bits={
      k: 0.0 for k in spec.communication_keys})

  start_round, rows = 0, []
  if start.resume_from is not None:
    start_round, restored = checkpoint.restore_checkpoint(
        start.resume_from, {'server': state, 'ledger': ledger.state_dict()},
        start.fingerprint)
    state = restored['server']
    ledger = CommLedger.from_state_dict(restored['ledger'])
    rows = outputs.truncate_metrics(scratch / 'metrics.jsonl', start_round)
    outputs.truncate_csv(scratch / 'communication.csv', start_round)
    logging.info('Resumed from %s at round %d.', start.resume_from,
                 start_round)
  # A SYNTHETIC partition (info.synthetic_partition) is warned about once,
  # by the dataset loader that makes it up.
  # Committed to this process's first device from round 0 on, as the round
  # engines' sums are: the server update then compiles once, not twice.
  state = jax.device_put(state, jax.local_devices()[0])
  return _Built(
      spec=spec, algorithm=algorithm, state=state, ledger=ledger,
      split_model=split_model, info=info, source=source,
      test_batches=evaluation.eval_batches(
          test_fd, config.eval_batch_size, config.eval_num_clients,
          config.seed),
      init=init, engine=_engine_name(config, mesh),
      conv_implementation=model_config.conv_implementation,
      start_round=start_round, rows=rows)


def _round_loop(config: RunConfig, task: tasks.Task, built: _Built,
                writer: outputs.MetricsWriter, scratch: pathlib.Path,
                fingerprint: dict[str, Any]) -> dict[str, Any]:
  """Rounds ``built.start_round`` .. ``num_rounds - 1``: one row each
  (:mod:`round_metrics`; evaluated every ``--eval_every`` rounds and at the
  end), a checkpoint every ``--checkpoint_every`` rounds and at the end.

  Returns:
    The round engines' totals (``recorder.totals()``) and the
    :class:`~fedlite_jax.rounds.stats.CompileCounter` of the loop.
  """
  cohorts = data_path.CohortPrefetcher(
      built.source, config.clients_per_round, config.seed,
      prefetch=config.prefetch_clients)
  cap = config.max_examples_per_client
  csv = (scratch / 'communication.csv').open('a')
  built.ledger.attach_csv(csv)
  # Process 0 writes the checkpoints (the others read them on a restart).
  ckpt = (checkpoint.Checkpointer(scratch / 'checkpoints', keep=2)
          if jax.process_index() == 0 else None)
  bar = tqdm.tqdm(range(built.start_round, config.num_rounds),
                  initial=built.start_round, total=config.num_rounds,
                  disable=not config.progress or jax.process_index() != 0,
                  desc=f'{config.task}/{config.algorithm}', unit='round')
  try:
    with engine_lib.recording_stats() as recorder, \
        stats_lib.counting_compilations() as compiles:
      for r in bar:
        before = (compiles.total, compiles.count(*stats_lib.CLIENT_PROGRAMS),
                  compiles.total_seconds)
        t_data = time.perf_counter()
        sampled = cohorts.get(
            r, next_round=r + 1 if r + 1 < config.num_rounds else -1)
        clients = [(cid, cds[:cap] if cap and len(cds) > cap else cds,
                    client_rng(config.seed, r, cid))
                   for cid, cds, _ in sampled]
        t_train = time.perf_counter()
        built.state, diagnostics = built.algorithm.apply(built.state, clients)
        jax.block_until_ready(built.state)
        t_done = time.perf_counter()
        totals = built.ledger.record_round(r, diagnostics)
        done = r + 1
        row = {'round': done,
               **round_metrics.train_metrics(diagnostics),
               **round_metrics.comm_metrics(totals, built.ledger.summary()),
               'time/data_seconds': t_train - t_data,
               'time/train_seconds': t_done - t_train,
               **round_metrics.engine_metrics(recorder.take())}
        if done % config.eval_every == 0 or done == config.num_rounds:
          t_eval = time.perf_counter()
          row.update(built.evaluate(done))
          row['time/eval_seconds'] = time.perf_counter() - t_eval
          bar.set_postfix({task.metric:
                           f'{row.get(task.metric, float("nan")):.4f}'})
        # The round's compilations: sampling, training, server update,
        # accounting and evaluation.
        row.update({
            'engine/compilations': compiles.total - before[0],
            'engine/client_program_compilations': compiles.count(
                *stats_lib.CLIENT_PROGRAMS) - before[1],
            'engine/compile_seconds': compiles.total_seconds - before[2]})
        writer.write(row)
        built.rows.append(row)
        if ckpt is not None and ((config.checkpoint_every and
                                  done % config.checkpoint_every == 0) or
                                 done == config.num_rounds):
          csv.flush()  # The CSV rows of the checkpointed rounds are on disk.
          ckpt.save(done, built.checkpoint_state(), fingerprint,
                    params=built.spec.eval_params(built.state))
      return recorder.totals(), compiles
  finally:
    if ckpt is not None:
      ckpt.close()  # Waits for a save still being written.
    cohorts.close()
    bar.close()
    csv.close()


def _finish(config: RunConfig, task: tasks.Task, mesh: sharding.ClientMesh,
            built: _Built, writer: outputs.MetricsWriter,
            engine_stats: dict[str, Any],
            compiles: stats_lib.CompileCounter, start: _Start,
            out: pathlib.Path, scratch: pathlib.Path) -> dict[str, Any]:
  """Writes summary.json, curves.png and the TensorBoard hparams; returns
  the summary.

  Raises:
    evaluation.TrainingFailedError: the final model is non-finite or no
      better than chance (after writing the outputs).
  """
  rows = built.rows
  evaluated = round_metrics.evaluations(rows)
  final_eval = round_metrics.eval_metrics(
      evaluated[-1] if evaluated else {'round': 0, **built.evaluate(0)})
  communication = built.ledger.summary()
  if built.spec.communication_summary is not None:
    communication.update(
        built.spec.communication_summary(built.ledger.extra_bits))
  train_seconds = [r['time/train_seconds'] for r in rows
                   if 'time/train_seconds' in r]
  summary = {
      'task': config.task,
      'algorithm': config.algorithm,
      'rounds': config.num_rounds,
      'final_eval': final_eval,
      'communication': communication,
      'seconds_per_round': (float(np.mean(train_seconds)) if train_seconds
                            else None),
      'round_engine': built.engine,
      # Counts over every round (rows of earlier runs of a resumed one too;
      # compilations from JAX's compile events, by program for this
      # process).
      'engine': {**{k: engine_stats[k]
                    for k in ('name',) + stats_lib.SETTINGS},
                 **round_metrics.engine_totals(rows),
                 'compilations_by_program': dict(
                     compiles.by_program.most_common()),
                 'conv_implementation': built.conv_implementation,
                 'compute_dtype': config.compute_dtype},
      'data': built.info.description,
      'synthetic_partition': built.info.synthetic_partition,
      'model': {'cut_layer': built.split_model.cut_layer,
                'cut_size': built.split_model.cut_size,
                'num_params': built.ledger.num_params},
      'machine': {'platform': platform.platform(),
                  'python': platform.python_version(), 'jax': jax.__version__,
                  'backend': jax.default_backend(),
                  'devices': [str(d) for d in jax.devices()]},
      'code': start.code,
      'started_with_code': outputs.read_code_version(out),
      'placement': {'num_devices': mesh.num_devices,
                    'num_processes': mesh.num_processes,
                    'mesh_devices': [str(d) for d in mesh.mesh.devices.flat]},
      'init_checkpoint': None if built.init is None else built.init.describe(),
      'flags': dataclasses.asdict(config),
  }
  failure = evaluation.training_failure(final_eval,
                                        task.chance_loss(built.info))
  summary.update(status='failed' if failure else 'ok', failure=failure)
  outputs.write_summary(scratch, summary)
  outputs.plot_curves(scratch, rows, task.metric,
                      f'{config.task} / {config.algorithm} (seed {config.seed})')
  writer.write_hparams(
      round_metrics.hparams(start.fingerprint, algorithm=config.algorithm,
                            num_rounds=config.num_rounds),
      [t for t in map(round_metrics.tb_tag, final_eval) if t is not None])
  evaluation.check_trained(final_eval, task.chance_loss(built.info),
                           output_dir=str(out))
  return summary
