"""Run configuration: every flag of ``experiments/run_experiment.py``.

Fields left as ``None`` take the task's defaults (``tasks.TASKS[...]``);
:func:`resolve` fills and validates them, raising :class:`ConfigError` with a
one-line message that names the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from fedlite_jax.models import lm

CLIENT_OPTIMIZERS = ('sgd', 'adam', 'adagrad')
SERVER_OPTIMIZERS = ('sgd', 'adam', 'adagrad', 'yogi')
TOKENIZERS = ('word', 'sentencepiece')


class ConfigError(ValueError):
  """A bad flag value (one clear line, no traceback from the binary)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """All settings of one federated run (units in field comments)."""
  task: str = 'embedded_mnist'
  algorithm: str = 'fedavg'
  num_rounds: Optional[int] = None          # rounds
  clients_per_round: Optional[int] = None   # cohort size
  client_batch_size: Optional[int] = None   # examples per local step
  client_epochs: int = 1                    # local passes over client data
  max_examples_per_client: Optional[int] = None  # cap per round (0 = none)
  client_optimizer: Optional[str] = None
  client_lr: Optional[float] = None
  client_clip_norm: float = 0.0             # global-norm clip; 0 = off
  server_optimizer: Optional[str] = None
  server_lr: Optional[float] = None
  server_beta1: float = 0.9
  server_beta2: float = 0.999
  server_eps: Optional[float] = None
  eval_every: Optional[int] = None          # rounds
  eval_batch_size: int = 256
  eval_num_clients: Optional[int] = None    # test clients (0 = all)
  seed: int = 0
  data_dir: Optional[str] = None
  output_dir: Optional[str] = None
  checkpoint_every: int = 50                # rounds; 0 = only at the end
  resume: bool = True
  overwrite: bool = False
  allow_download: bool = False
  round_engine: str = 'auto'
  steps_per_call: int = 1
  num_devices: Optional[int] = None         # local devices; None = all
  coordinator_address: Optional[str] = None  # multi-host: host:port of p0
  num_processes: int = 1                    # multi-host: JAX processes
  process_id: int = 0                       # multi-host: this process
  distributed_timeout: int = 60             # seconds to reach coordinator
  progress: bool = True
  # Task-specific.
  sequence_length: int = 20
  vocab_size: int = 10000
  num_clients: int = 50                     # embedded task: clients
  dirichlet_alpha: float = 0.5              # embedded task: label skew
  tokenizer: str = 'word'                   # text tasks: word | sentencepiece
  sp_vocab_size: int = 4096                 # SentencePiece ids incl. specials
  model: Optional[str] = None               # LM preset; None = task default
  lm_loss_reduction: str = 'sequence_sum'   # LM presets: per-sequence loss
  init_checkpoint: Optional[str] = None     # params file to start from
  # Algorithm-specific options (registry.Option), by name.
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  # Flags that do not change the trained result (excluded from the
  # checkpoint fingerprint so a run can be extended or moved).
  NON_RESULT_FIELDS = ('num_rounds', 'eval_every', 'eval_batch_size',
                       'eval_num_clients', 'data_dir', 'output_dir',
                       'checkpoint_every', 'resume', 'overwrite',
                       'allow_download', 'round_engine', 'steps_per_call',
                       'num_devices', 'coordinator_address', 'num_processes',
                       'process_id', 'distributed_timeout', 'progress')

  def fingerprint(self) -> dict[str, Any]:
    """The result-determining settings (stored in and checked by checkpoints)."""
    from fedlite_jax.experiment import registry  # pylint: disable=g-import-not-at-top
    known = registry.all_options()
    out = {k: v for k, v in dataclasses.asdict(self).items()
           if k not in self.NON_RESULT_FIELDS and k != 'options'}
    out['options'] = {k: v for k, v in sorted(self.options.items())
                      if k not in known or known[k].affects_result}
    return out


def _positive(name: str, value: Any) -> None:
  if value is None or value <= 0:
    raise ConfigError(f'--{name}={value}: must be a positive number.')


def resolve(config: RunConfig, task_defaults: dict[str, Any]) -> RunConfig:
  """Fills ``None`` fields from the task defaults and validates everything.

  Raises:
    ConfigError: naming the first bad value and what is allowed.
  """
  filled = {k: (task_defaults[k] if v is None and k in task_defaults else v)
            for k, v in dataclasses.asdict(config).items()}
  from fedlite_jax.experiment import registry  # pylint: disable=g-import-not-at-top
  try:
    spec = registry.get(filled['algorithm'])
  except ValueError as e:
    raise ConfigError(str(e)) from None
  filled['options'] = _resolve_options(spec, dict(filled['options']),
                                       task_defaults.get('options', {}))
  config = RunConfig(**filled)
  for name in ('num_rounds', 'clients_per_round', 'client_batch_size',
               'client_epochs', 'eval_every', 'eval_batch_size', 'client_lr',
               'server_lr', 'steps_per_call', 'sequence_length', 'vocab_size',
               'num_clients', 'dirichlet_alpha'):
    _positive(name, getattr(config, name))
  for name in ('checkpoint_every', 'client_clip_norm', 'eval_num_clients',
               'max_examples_per_client'):
    value = getattr(config, name)
    if value is not None and value < 0:
      raise ConfigError(f'--{name}={value}: must be >= 0.')
  if config.client_optimizer not in CLIENT_OPTIMIZERS:
    raise ConfigError(f'--client_optimizer={config.client_optimizer!r}: '
                      f'allowed values are {", ".join(CLIENT_OPTIMIZERS)}.')
  if config.server_optimizer not in SERVER_OPTIMIZERS:
    raise ConfigError(f'--server_optimizer={config.server_optimizer!r}: '
                      f'allowed values are {", ".join(SERVER_OPTIMIZERS)}.')
  if config.round_engine not in ('auto', 'loop', 'vmap'):
    raise ConfigError(f'--round_engine={config.round_engine!r}: allowed '
                      'values are auto, loop, vmap.')
  if config.num_devices is not None and config.num_devices < 1:
    raise ConfigError(f'--num_devices={config.num_devices}: must be >= 1 (or '
                      'unset for all local devices).')
  if config.num_processes < 1:
    raise ConfigError(f'--num_processes={config.num_processes}: must be >= 1.')
  if not 0 <= config.process_id < config.num_processes:
    raise ConfigError(f'--process_id={config.process_id}: must be in [0, '
                      f'{config.num_processes}).')
  if config.num_processes > 1 and not config.coordinator_address:
    raise ConfigError(f'--num_processes={config.num_processes} needs '
                      '--coordinator_address=host:port (process 0).')
  if not 0 <= config.server_beta1 < 1 or not 0 <= config.server_beta2 < 1:
    raise ConfigError('--server_beta1/--server_beta2 must be in [0, 1).')
  if config.tokenizer not in TOKENIZERS:
    raise ConfigError(f'--tokenizer={config.tokenizer!r}: allowed values are '
                      f'{", ".join(TOKENIZERS)}.')
  if config.model is not None and config.model not in lm.PRESETS:
    raise ConfigError(f'--model={config.model!r}: allowed values are '
                      f'{", ".join(lm.PRESETS)}.')
  if config.sp_vocab_size <= 4:
    raise ConfigError(f'--sp_vocab_size={config.sp_vocab_size}: must be > 4 '
                      '(PAD, BOS, EOS, UNK plus pieces).')
  if config.lm_loss_reduction not in lm.LOSS_REDUCTIONS:
    raise ConfigError(f'--lm_loss_reduction={config.lm_loss_reduction!r}: '
                      f'allowed values are {", ".join(lm.LOSS_REDUCTIONS)}.')
  if config.server_eps is not None and config.server_eps <= 0:
    raise ConfigError(f'--server_eps={config.server_eps}: must be > 0.')
  return config


def _resolve_options(spec, given: dict[str, Any],
                     task_defaults: Mapping[str, Any]) -> dict[str, Any]:
  """The algorithm's options: given values, else task defaults, else defaults.

  Options of other algorithms are dropped (the binary passes all flags).

  Raises:
    ConfigError: a value of the wrong type, outside its choices or bounds.
  """
  out = {}
  for opt in spec.options:
    value = given.get(opt.name)
    if value is None:
      value = task_defaults.get(opt.name, opt.default)
    kind = type(opt.default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if not isinstance(value, kind):
      raise ConfigError(f'--{opt.name}={value!r}: must be a {kind.__name__}.')
    if opt.choices is not None and value not in opt.choices:
      raise ConfigError(f'--{opt.name}={value!r}: allowed values are '
                        f'{", ".join(map(str, opt.choices))}.')
    if opt.lower_bound is not None and value < opt.lower_bound:
      raise ConfigError(f'--{opt.name}={value}: must be >= {opt.lower_bound}.')
    out[opt.name] = value
  return out
