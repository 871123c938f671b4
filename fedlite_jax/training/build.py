"""A run set up for the round loop: data, model, algorithm, restored state."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any, Optional

import fedjax
import jax

from fedlite_jax.algorithms import fedopt
from fedlite_jax.comm import CommLedger
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import data_path
from fedlite_jax.training import evaluation
from fedlite_jax.training import outputs
from fedlite_jax.training import start as start_lib
from fedlite_jax.training import state_io
from fedlite_jax.training import registry
from fedlite_jax.training import tasks
from fedlite_jax.rounds import errors as rounds_errors
from fedlite_jax.rounds import remote
from fedlite_jax.rounds import sharding

ConfigError = config_lib.ConfigError
#: The runner's console lines (INFO: data, compiling, resuming, evaluations).
LOG = logging.getLogger('fedlite_jax.training')


@dataclasses.dataclass
class Run:
  """One run as the round loop and its hooks see it.

  Attributes:
    config: the resolved settings; ``task``: the task; ``mesh``: devices.
    out: the output directory; ``scratch``: where this process writes
      (``out`` on process 0, a private folder on the others).
    fingerprint: the settings that determine the result (checked on resume).
    code: this checkout's ``{'commit', 'dirty'}``.
    spec, algorithm: the registry entry and its FedJAX algorithm.
    state, ledger: server state and communication ledger (advance per round).
    split_model, info: the task's model and its dataset description.
    source: the training clients as the sampler reads them.
    test_batches: the evaluation batches.
    init: the ``--init_checkpoint`` parameters, or None.
    engine, conv_implementation: the round engine and convolutions used.
    compression: the ``--upload`` / ``--download`` stages, parsed once
      (``compression_options.run_compression``).
    start_round: rounds done before this process started (restored).
    rows: metrics.jsonl rows so far (one per round): on a resume, those of
      rounds <= ``start_round`` (the file cut back to them); the loop appends.
    stop_reason: set by :meth:`request_stop` to end after this round.
  """
  config: config_lib.RunConfig
  task: tasks.Task
  mesh: sharding.ClientMesh
  out: pathlib.Path
  scratch: pathlib.Path
  fingerprint: dict[str, Any]
  code: dict[str, Any]
  spec: registry.AlgorithmSpec
  algorithm: fedjax.FederatedAlgorithm
  state: Any
  ledger: CommLedger
  split_model: Any
  info: tasks.LoadedInfo
  source: Any
  test_batches: list[dict]
  init: Optional[state_io.InitParams]
  engine: str
  conv_implementation: str
  compression: fedopt.Compression
  start_round: int = 0
  rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  stop_reason: Optional[str] = None

  @property
  def writer_process(self) -> bool:
    """Whether this process writes the outputs and checkpoints (process 0)."""
    return jax.process_index() == 0

  def evaluate(self) -> dict[str, float]:
    """The test metrics of the current server state, by bare name."""
    return evaluation.evaluate(self.split_model.model,
                               self.spec.eval_params(self.state),
                               self.test_batches)

  def checkpoint_state(self) -> dict[str, Any]:
    """What a round checkpoint saves: server state and ledger."""
    return {'server': self.state, 'ledger': self.ledger.state_dict()}

  def request_stop(self, reason: str) -> None:
    """Ends the run after the current round (a hook calls it)."""
    self.stop_reason = reason


def build_algorithm(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  """The ``--algorithm`` as a FedJAX algorithm (see ``registry``)."""
  return registry.get(ctx.config.algorithm).build(ctx)


def _load_init(config: config_lib.RunConfig, like: Any, sha256: Optional[str]
               ) -> Optional[state_io.InitParams]:
  """The ``--init_checkpoint`` parameters (None without it), or ConfigError."""
  if not config.init_checkpoint:
    return None
  try:
    init = state_io.load_init_params(config.init_checkpoint, like)
  except (OSError, ValueError) as e:
    raise start_lib.init_error(config.init_checkpoint, e) from None
  if init.sha256 != sha256:
    raise ConfigError(f'--init_checkpoint={init.path} changed while the run '
                      'started; start it again.')
  LOG.info('Starting from --init_checkpoint=%s (%s%s, sha256 %s).',
           init.path, init.source,
           '' if init.round is None else f' after round {init.round}',
           init.sha256)
  return init


def check_cohort(config: config_lib.RunConfig, num_train_clients: int
                 ) -> None:
  """ConfigError if ``--clients_per_round`` exceeds the training clients."""
  if config.clients_per_round > num_train_clients:
    raise ConfigError(
        f'--clients_per_round={config.clients_per_round} exceeds the '
        f'{num_train_clients} training clients of task {config.task!r}.')


def _training_source(config, train_fd, mesh):
  """The sampler's view of the training clients (cached; partitioned by
  process on several hosts), or ConfigError for a cohort that cannot fit."""
  check_cohort(config, train_fd.num_clients())
  # Decoded clients kept across rounds (--client_cache_mb=0: none), a SQLite
  # connection per thread; inside the multi-process partition.
  source = data_path.ClientCache(train_fd, config.client_cache_mb * 2**20)
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
  return train_fd, source


def build_run(config: config_lib.RunConfig, task: tasks.Task,
              mesh: sharding.ClientMesh, engine: str, model_config:
              config_lib.RunConfig, out: pathlib.Path, scratch: pathlib.Path,
              start: start_lib.Start, compression: fedopt.Compression) -> Run:
  """Loads the data, builds model and algorithm, restores the checkpoint.

  ``start`` is ``start.plan``'s decision (fingerprint, checkpoint to resume
  from, code version). ``compression`` is
  ``compression_options.run_compression(config)``: the stages parsed once,
  before anything was written, carried to the algorithm's builder and
  :attr:`Run.compression`.

  Raises:
    ConfigError: settings that do not fit the data, the mesh or the
      algorithm; an ``--init_checkpoint`` that does not fit the model.
    state_io.CheckpointError: a corrupt or mismatched checkpoint.
  """
  fingerprint, resume_from = start.fingerprint, start.resume_from
  train_fd, test_fd, info = task.load_data(config)
  LOG.info('Data (--task=%s): %s', config.task, info.description)
  train_fd, source = _training_source(config, train_fd, mesh)
  split_model = task.build_model(model_config, info)
  params = split_model.model.init(jax.random.PRNGKey(config.seed))
  init = _load_init(config, params, fingerprint.get('init_checkpoint_sha256'))
  if init is not None:
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
          train_client_ids=tuple(train_fd.client_ids()), info=info,
          compression=compression))
    except rounds_errors.EngineConfigError as e:
      raise ConfigError(config_lib.flag_message(e)) from None
  state = algorithm.init(params)
  ledger = CommLedger(fedopt.num_params(params), extra_bits={
      k: 0.0 for k in spec.communication_keys})
  start_round, rows = 0, []
  if resume_from is not None:
    try:
      start_round, restored = state_io.restore_checkpoint(
          resume_from, {'server': state, 'ledger': ledger.state_dict()},
          fingerprint)
    except state_io.CheckpointError as e:
      raise state_io.CheckpointError(
          f'{e} Resume with the flags it was written with, or delete it or '
          'pass another --output_dir to start over.') from e
    state = restored['server']
    ledger = CommLedger.from_state_dict(restored['ledger'])
    rows = outputs.truncate_metrics(scratch / 'metrics.jsonl', start_round)
    LOG.info('Resumed from round %d (%s).', start_round, resume_from)
  # Committed to this process's first device from round 0 on, as the round
  # engines' sums are: the server update then compiles once, not twice.
  state = jax.device_put(state, jax.local_devices()[0])
  return Run(
      config=config, task=task, mesh=mesh, out=out, scratch=scratch,
      fingerprint=fingerprint, code=start.code, spec=spec, algorithm=algorithm,
      state=state, ledger=ledger, split_model=split_model, info=info,
      source=source, test_batches=evaluation.eval_batches(
          test_fd, config.eval_batch_size, config.eval_num_clients,
          config.seed),
      init=init, engine=engine, compression=compression,
      conv_implementation=model_config.conv_implementation,
      start_round=start_round, rows=rows)
