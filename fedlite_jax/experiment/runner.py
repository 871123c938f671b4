"""The federated training loop: sample, train, account, evaluate, checkpoint.

Determinism: the cohort of round r comes from FedJAX's
``UniformGetClientSampler(seed)`` (stateless in r), each client's PRNG key is
``fold_in(fold_in(PRNGKey(seed), r), crc32(client_id))`` (dropout draws and
the local shuffle derive from it), so the same flags give the same result,
and a run resumed from a checkpoint ends with exactly the same parameters as
an uninterrupted one (``tests/test_runner.py``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import platform
import time
import zlib
from typing import Any, Optional

from absl import logging
import fedjax
import jax
import numpy as np
import tqdm

from fedlite_jax import checkpoint
from fedlite_jax.algorithms import fedavg
from fedlite_jax.comm import CommLedger
from fedlite_jax.experiment import config as config_lib
from fedlite_jax.experiment import evaluation
from fedlite_jax.experiment import outputs
from fedlite_jax.experiment import registry
from fedlite_jax.experiment import tasks
from fedlite_jax.rounds import default_engine_name

RunConfig = config_lib.RunConfig
ConfigError = config_lib.ConfigError


def client_rng(seed: int, round_num: int, client_id: bytes) -> jax.Array:
  """The PRNG key of ``client_id`` in round ``round_num`` of a run."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), round_num)
  return jax.random.fold_in(key, zlib.crc32(bytes(client_id)))


def build_algorithm(ctx: registry.BuildContext) -> fedjax.FederatedAlgorithm:
  """The ``--algorithm`` as a FedJAX algorithm (see ``registry``)."""
  return registry.get(ctx.config.algorithm).build(ctx)


def _default_output_dir(config: RunConfig) -> str:
  return str(pathlib.Path('runs') / f'{config.task}_{config.algorithm}_seed{config.seed}')


def _machine() -> dict[str, Any]:
  return {
      'platform': platform.platform(),
      'python': platform.python_version(),
      'jax': jax.__version__,
      'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()],
  }


def run(config: RunConfig) -> dict[str, Any]:
  """Runs (or resumes) one federated experiment and returns the summary.

  Args:
    config: the run's settings; ``None`` fields take the task's defaults.

  Returns:
    The summary dict also written to ``output_dir/summary.json``, with keys
    ``final_eval`` (loss, accuracy or perplexity, ...), ``communication``
    (total_upload_bytes, total_download_bytes, upload_compression,
    download_compression, total_compression vs uncompressed FedAvg),
    ``rounds``, ``seconds_per_round``, ``flags`` and more.

  Raises:
    ConfigError: bad settings.
    FileNotFoundError: missing data (the message names the files).
    checkpoint.CheckpointError: a corrupt or mismatched checkpoint.
    FloatingPointError: the model diverged (non-finite updates).
  """
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  if config.output_dir is None:
    config = dataclasses.replace(config, output_dir=_default_output_dir(config))
  out = pathlib.Path(config.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  ckpt_dir = out / 'checkpoints'

  train_fd, test_fd, info = task.load_data(config)
  num_train_clients = train_fd.num_clients()
  if config.clients_per_round > num_train_clients:
    raise ConfigError(
        f'--clients_per_round={config.clients_per_round} exceeds the '
        f'{num_train_clients} training clients of task {config.task!r}.')
  split_model = task.build_model(config, info)
  model = split_model.model
  params = model.init(jax.random.PRNGKey(config.seed))
  spec = registry.get(config.algorithm)
  algorithm = build_algorithm(registry.BuildContext(
      config=config, split_model=split_model,
      num_params=fedavg.num_params(params),
      train_client_ids=tuple(train_fd.client_ids()), info=info))
  state = algorithm.init(params)
  ledger = CommLedger(fedavg.num_params(params), extra_bits={
      k: 0.0 for k in spec.communication_keys})

  fingerprint = config.fingerprint()
  start_round = 0
  latest = checkpoint.latest_checkpoint(ckpt_dir)
  metrics_path = out / 'metrics.jsonl'
  if latest is not None and config.resume:
    start_round, restored = checkpoint.restore_checkpoint(
        latest, {'server': state, 'ledger': ledger.state_dict()}, fingerprint)
    state = restored['server']
    ledger = CommLedger.from_state_dict(restored['ledger'])
    rows = outputs.truncate_metrics(metrics_path, start_round)
    outputs.truncate_csv(out / 'communication.csv', start_round)
    logging.info('Resumed from %s at round %d.', latest, start_round)
  else:
    if (metrics_path.exists() or latest is not None) and not config.overwrite:
      raise ConfigError(
          f'--output_dir={out} holds results of another run (metrics.jsonl or '
          'checkpoints) that cannot be resumed with these flags; pass '
          '--overwrite to replace them or choose another --output_dir.')
    for name in ('metrics.jsonl', 'communication.csv', 'summary.json'):
      (out / name).unlink(missing_ok=True)
    if ckpt_dir.exists():
      for p in ckpt_dir.iterdir():
        p.unlink()
    rows = []

  if info.synthetic_partition:
    logging.warning('Task %s uses a SYNTHETIC federated partition: %s',
                    config.task, info.description)
  writer = outputs.MetricsWriter(out)
  csv = (out / 'communication.csv').open('a')
  ledger.attach_csv(csv)
  batches = evaluation.eval_batches(test_fd, config.eval_batch_size,
                                    config.eval_num_clients, config.seed)
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train_fd, config.clients_per_round, config.seed, start_round)
  cap = config.max_examples_per_client
  engine = (default_engine_name() if config.round_engine == 'auto'
            else config.round_engine)
  round_seconds = [r['seconds_per_round'] for r in rows
                   if 'seconds_per_round' in r]
  recent = []
  bar = tqdm.tqdm(range(start_round, config.num_rounds), initial=start_round,
                  total=config.num_rounds, disable=not config.progress,
                  desc=f'{config.task}/{config.algorithm}', unit='round')
  try:
    for r in bar:
      clients = [(cid, cds[:cap] if cap and len(cds) > cap else cds,
                  client_rng(config.seed, r, cid))
                 for cid, cds, _ in sampler.sample()]
      t0 = time.perf_counter()
      state, diagnostics = algorithm.apply(state, clients)
      jax.block_until_ready(state)
      recent.append(time.perf_counter() - t0)
      ledger.record_round(r, diagnostics)
      done = r + 1
      if done % config.eval_every == 0 or done == config.num_rounds:
        metrics = evaluation.evaluate(model, spec.eval_params(state), batches)
        comm = ledger.summary()
        row = {'round': done, **metrics,
               'upload_bytes': comm['total_upload_bytes'],
               'download_bytes': comm['total_download_bytes'],
               'seconds_per_round': float(np.mean(recent))}
        round_seconds.append(row['seconds_per_round'])
        recent = []
        writer.write(row)
        rows.append(row)
        bar.set_postfix({task.metric: f'{metrics.get(task.metric, float("nan")):.4f}'})
      if (config.checkpoint_every and done % config.checkpoint_every == 0) or \
          done == config.num_rounds:
        checkpoint.save_checkpoint(
            ckpt_dir, done, {'server': state, 'ledger': ledger.state_dict()},
            fingerprint)
  finally:
    bar.close()
    writer.close()
    csv.close()

  final_eval = rows[-1] if rows else evaluation.evaluate(
      model, spec.eval_params(state), batches)
  final_eval = {k: v for k, v in final_eval.items()
                if k not in ('round', 'upload_bytes', 'download_bytes',
                             'seconds_per_round')}
  communication = ledger.summary()
  if spec.communication_summary is not None:
    communication.update(spec.communication_summary(ledger.extra_bits))
  summary = {
      'task': config.task,
      'algorithm': config.algorithm,
      'rounds': config.num_rounds,
      'final_eval': final_eval,
      'communication': communication,
      'seconds_per_round': float(np.mean(round_seconds)) if round_seconds else None,
      'round_engine': engine,
      'data': info.description,
      'synthetic_partition': info.synthetic_partition,
      'model': {'cut_layer': split_model.cut_layer,
                'cut_size': split_model.cut_size,
                'num_params': ledger.num_params},
      'machine': _machine(),
      'flags': dataclasses.asdict(config),
  }
  outputs.write_summary(out, summary)
  outputs.plot_curves(out, rows, task.metric,
                      f'{config.task} / {config.algorithm} (seed {config.seed})')
  return summary
