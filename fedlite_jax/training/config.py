"""Run configuration: every flag of ``experiments/run_experiment.py``.

Each :class:`RunConfig` field's metadata holds its flag's help, type,
choices and bound; ``None`` fields take the task's defaults (:func:`resolve`).
Settings the run would ignore are errors (:func:`check_explicit`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from fedlite_jax import rounds
from fedlite_jax.models import layers as models_layers
from fedlite_jax.models import lm
from fedlite_jax.training import compression_options
from fedlite_jax.training import dp_options
from fedlite_jax.training import registry
from fedlite_jax.training import spec

ConfigError = spec.ConfigError

CLIENT_OPTIMIZERS = ('sgd', 'adam', 'adagrad')
SERVER_OPTIMIZERS = ('sgd', 'adam', 'adagrad', 'yogi')
TOKENIZERS = ('word', 'sentencepiece')
ROUND_ENGINES = rounds.ENGINE_NAMES
SEGMENT_LOOPS = rounds.streaming.LOOPS
DATA_ON_DEVICE = rounds.device_rows.SETTINGS
CONV_IMPLEMENTATIONS = ('auto',) + models_layers.CONV_IMPLEMENTATIONS
COMPUTE_DTYPES = ('float32', 'bfloat16')

#: Largest ``--seed``: numpy's ``RandomState`` takes seeds in [0, 2**32 - 1]
#: (``jax.random.PRNGKey`` would silently wrap larger ones).
MAX_SEED = 2**32 - 1
#: embedded_mnist: 5,000 digits, each client needs >= 2 (one train, one test).
EMBEDDED_MNIST_MAX_CLIENTS = 2500

#: Tasks by the data they read (names of ``tasks.TASKS``).
TEXT_TASKS = ('shakespeare', 'stackoverflow_nwp')
FILE_TASKS = ('emnist', 'emnist_digits', 'shakespeare', 'stackoverflow_nwp',
              'stackoverflow_tag')

#: Task-specific RunConfig fields -> the tasks that read them (setting one
#: for another task is an error). stackoverflow_tag has fixed vocabularies.
TASK_FIELDS: Mapping[str, tuple[str, ...]] = {
    'num_clients': ('embedded_mnist',), 'dirichlet_alpha': ('embedded_mnist',),
    'data_dir': FILE_TASKS, 'allow_download': FILE_TASKS,
    **dict.fromkeys(('sequence_length', 'vocab_size', 'tokenizer',
                     'sp_vocab_size', 'model', 'lm_loss_reduction'),
                    TEXT_TASKS)}


def _field(default: Any, help_text: str, *, kind: type | None = None,
           choices: Sequence[str] | None = None,
           lower_bound: float | None = None) -> Any:
  """A RunConfig field with its flag's help, type (default: type(default)),
  string choices and inclusive lower bound."""
  return dataclasses.field(default=default, metadata={
      'help': help_text, 'kind': kind or type(default), 'choices': choices,
      'lower_bound': lower_bound})


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """All settings of one federated run; each field is a runner flag."""
  task: str = _field('embedded_mnist', 'Federated task.')
  algorithm: str = _field(registry.DEFAULT_ALGORITHM, 'Federated algorithm.')
  num_rounds: int | None = _field(None, 'Training rounds.', kind=int,
                                  lower_bound=1)
  clients_per_round: int | None = _field(None, 'Cohort size.', kind=int,
                                         lower_bound=1)
  client_batch_size: int | None = _field(
      None, 'Local batch size (examples per local step).', kind=int,
      lower_bound=1)
  client_epochs: int = _field(1, 'Local epochs over the client data.',
                              lower_bound=1)
  max_examples_per_client: int | None = _field(
      None, "Use at most a client's first N examples per round (as TFF "
      'take()); 0 = all.', kind=int, lower_bound=0)
  client_optimizer: str | None = _field(None, 'Client optimizer.', kind=str,
                                        choices=CLIENT_OPTIMIZERS)
  client_lr: float | None = _field(None, 'Client learning rate.', kind=float)
  client_clip_norm: float | None = _field(
      None, 'Client gradient global-norm clip (0 = off).', kind=float)
  server_optimizer: str | None = _field(
      None, 'Server optimizer (sgd = FedAvg, adam = FedAdam).', kind=str,
      choices=SERVER_OPTIMIZERS)
  server_lr: float | None = _field(None, 'Server learning rate.', kind=float)
  server_beta1: float = _field(0.9, 'Server Adam/Yogi beta1.')
  server_beta2: float = _field(0.999, 'Server Adam/Yogi beta2.')
  server_eps: float | None = _field(None, 'Server optimizer epsilon.',
                                    kind=float)
  eval_every: int | None = _field(None, 'Evaluate every N rounds.', kind=int,
                                  lower_bound=1)
  eval_batch_size: int = _field(256, 'Evaluation batch size.', lower_bound=1)
  eval_num_clients: int | None = _field(
      None, 'Test clients to evaluate on (0 = all).', kind=int, lower_bound=0)
  seed: int = _field(0, 'Seed in [0, 2**32 - 1]; all keys (sampling, init, '
                     'shuffles) derive from seed, round, client.')
  data_dir: str | None = _field(
      None, 'Data directory, the only one searched when given (else '
      '$FEDLITE_DATA_DIR, ~/.cache/fedjax, ~/.tff).', kind=str)
  output_dir: str | None = _field(
      None, 'Output directory (default runs/<task>_<algorithm>_<hash of the '
      'result flags>_seed<seed>).',
      kind=str)
  checkpoint_every: int = _field(
      50, 'Checkpoint every N rounds (0 = only at the end).', lower_bound=0)
  resume: bool = _field(True, 'Resume from the latest checkpoint.')
  overwrite: bool = _field(False, 'Replace results of another run.')
  allow_download: bool = _field(
      False, 'Let FedJAX download missing data (needs network).')
  round_engine: str = _field(
      'auto', 'Client execution: vmap (one program; GPU/TPU), loop (jitted '
      'step blocks; CPU), auto (by platform).', choices=ROUND_ENGINES)
  steps_per_call: int = _field(
      1, 'Loop engine: local steps unrolled per jitted call.', lower_bound=1)
  lanes_per_device: Any = _field(
      'auto', 'vmap engine and split learning: clients run side by side per '
      'device, each lane streaming its clients (peak memory follows it); '
      'auto = from model and device memory, at most the cohort.', kind=str)
  segment_steps: int = _field(
      4, 'vmap engine: local steps per compiled segment (one call).',
      lower_bound=1)
  segment_loop: str = _field(
      'auto', 'vmap engine: a segment\'s steps unrolled (XLA:CPU runs '
      'convolutions in loops slowly), or in an on-device loop that computes '
      'only the planned steps and compiles one step: of segment_steps steps '
      '(scan) or of the planned count (while; a GPU call waits for its '
      'end); or fixed: segment_steps steps and no conditional, so a GPU '
      'call never waits for the device (the last segment pads with masked '
      'steps); or host: the step called once per planned step, after a '
      'call of the finalizations and starts where clients end (no device '
      'loop, no conditional; the step compiled once); auto = scan, but '
      'unroll on '
      'CPU for a client step with a lax convolution. Equal to float '
      'rounding.',
      choices=SEGMENT_LOOPS)
  data_on_device: str = _field(
      'auto', 'vmap engine: the training clients\' preprocessed examples '
      'sent to every device once, and each round\'s batches as row indices '
      'that the lanes gather (the same batches); auto = on with GPUs/TPUs '
      'on one process when they take at most 1/8 of a device\'s memory.',
      choices=DATA_ON_DEVICE)
  conv_implementation: str = _field(
      'auto', 'CNN convolutions: lax, im2col (a matmul: no grouped '
      'convolution when vmapped over clients), auto (im2col with the vmap '
      'engine or vmapped split learning). Equal to float rounding.',
      choices=CONV_IMPLEMENTATIONS)
  compute_dtype: str = _field(
      'float32', 'Model computation dtype (flax dtype); parameters, '
      'optimizer states, deltas and sums stay float32. bfloat16 is for '
      'GPU/TPU.', choices=COMPUTE_DTYPES)
  client_cache_mb: int = _field(
      1024, 'MiB of decoded client data kept across rounds (LRU; 0 = off). '
      'No effect on results.', lower_bound=0)
  prefetch_clients: bool = _field(
      True, "Load the next round's clients in a background thread. No "
      'effect on results.')
  compilation_cache_dir: str = _field(
      'auto', "JAX's persistent compilation cache: a later run of the same "
      'programs (another seed, a resumed run) loads them instead of '
      'compiling. auto = $JAX_COMPILATION_CACHE_DIR if set, else '
      '$XDG_CACHE_HOME (~/.cache)/fedlite_jax/xla; off; or a directory. No '
      'effect on results.', kind=str)
  num_devices: int | None = _field(
      None, "Local devices to split each round's clients over (default: "
      'all). Results equal up to float tolerance.', kind=int)
  coordinator_address: str | None = _field(
      None, 'Multi-host runs: host:port of process 0 (jax.distributed).',
      kind=str)
  num_processes: int = _field(1, 'Multi-host runs: number of processes.',
                              lower_bound=1)
  process_id: int = _field(0, "Multi-host runs: this process's index.",
                           lower_bound=0)
  distributed_timeout: int = _field(
      60, 'Multi-host runs: seconds to wait for all processes.', lower_bound=1)
  progress: bool = _field(True, 'Show a progress bar.')
  # Task-specific (see TASK_FIELDS).
  sequence_length: int = _field(20, 'Next-word prediction sequence length.',
                                lower_bound=1)
  vocab_size: int = _field(10000, 'Word vocabulary size (next-word '
                           'prediction).', lower_bound=1)
  num_clients: int = _field(50, 'embedded_mnist: number of synthetic '
                            'clients.', lower_bound=1)
  dirichlet_alpha: float = _field(
      0.5, 'embedded_mnist: Dirichlet label-skew concentration.')
  tokenizer: str = _field(
      'word', 'Text tasks: word vocabulary, or a SentencePiece model trained '
      'on the training split (Ro et al. 2022; with --sequence_length=30).',
      choices=TOKENIZERS)
  sp_vocab_size: int = _field(
      4096, 'SentencePiece ids incl. PAD/BOS/EOS/UNK (paper: 4K).',
      lower_bound=5)
  model: str | None = _field(
      None, 'Language model preset (Ro et al. 2022 Table 1, plus tiny CPU '
      'presets); default: the task model (lstm_small with sentencepiece).',
      kind=str, choices=tuple(lm.PRESETS))
  lm_loss_reduction: str = _field(
      'sequence_sum', 'LM presets: per-sequence sum (FedJAX) or mean of '
      'token cross-entropies.', choices=tuple(lm.LOSS_REDUCTIONS))
  init_checkpoint: str | None = _field(
      None, 'Start from the parameters of experiments/pretrain_centralized.py '
      'or a runner checkpoint (checkpoints/<round>).', kind=str)
  # Algorithm-specific options (registry.Option), by name.
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  # Flags that do not change the result (not in the checkpoint fingerprint).
  NON_RESULT_FIELDS = (
      'num_rounds', 'eval_every', 'eval_batch_size', 'eval_num_clients',
      'data_dir', 'output_dir', 'checkpoint_every', 'resume', 'overwrite',
      'allow_download', 'round_engine', 'steps_per_call', 'lanes_per_device',
      'segment_steps', 'segment_loop', 'data_on_device',
      'conv_implementation',
      'client_cache_mb', 'compilation_cache_dir',
      'prefetch_clients', 'num_devices',
      'coordinator_address', 'num_processes', 'process_id',
      'distributed_timeout', 'progress')

  # Result fields added later, left out at their default so that runs
  # written before them keep their identity.
  OMITTED_AT_DEFAULT = {'compute_dtype': 'float32'}

  def fingerprint(self) -> dict[str, Any]:
    """The result-determining settings (stored in checkpoints, checked)."""
    known = registry.all_options()
    out = {k: v for k, v in dataclasses.asdict(self).items()
           if k not in self.NON_RESULT_FIELDS and k != 'options' and
           self.OMITTED_AT_DEFAULT.get(k, object()) != v}
    out['options'] = {k: v for k, v in sorted(self.options.items())
                      if (k not in known or known[k].affects_result) and not
                      (k in dp_options.NAMES and v == known[k].default)}
    return out


def _is_finite(value: Any) -> bool:
  return not isinstance(value, float) or math.isfinite(value)


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive(name: str, value: Any) -> None:
  if value is None or not _is_finite(value) or value <= 0:
    raise ConfigError(f'--{name}={value}: must be a finite number > 0.')


def _check_path(name: str, value: str | None) -> None:
  if value is not None and not str(value).strip():
    raise ConfigError(f'--{name}={value!r}: empty path; give a path or omit '
                      'the flag.')


def check_output_dir(path: str) -> None:
  """Raises ConfigError unless ``path`` is (or can be made) a writable dir."""
  _check_path('output_dir', path)
  target = os.path.abspath(path)
  probe = target
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    what = 'it' if probe == target else f'its parent {probe}'
    raise ConfigError(f'--output_dir={path}: {what} is a file, not a '
                      'directory.')
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ConfigError(f'--output_dir={path}: {probe} is not writable.')


def _explicit_fields(config: RunConfig,
                     task_defaults: Mapping[str, Any]) -> list[str]:
  """Fields set to neither RunConfig's nor the task's default, and the
  options given (so resolving a resolved config finds none set)."""
  defaults, unset = RunConfig(), object()
  return [f.name for f in dataclasses.fields(RunConfig)
          if f.name != 'options' and getattr(config, f.name) not in (
              getattr(defaults, f.name), task_defaults.get(f.name, unset))
          ] + list(config.options)


def resolve(config: RunConfig, task_defaults: dict[str, Any]) -> RunConfig:
  """Fills ``None`` fields from the task defaults and validates everything,
  including settings the run would ignore (:func:`check_explicit`).

  Raises:
    ConfigError: naming the first bad value and what is allowed.
  """
  compression_options.check_removed(config.options, config.algorithm)
  explicit = _explicit_fields(config, task_defaults)
  filled = {k: (task_defaults[k] if v is None and k in task_defaults else v)
            for k, v in dataclasses.asdict(config).items()}
  try:
    spec = registry.get(filled['algorithm'])
  except ValueError as e:
    raise ConfigError(str(e)) from None
  filled['options'] = _resolve_options(spec, dict(filled['options']),
                                       task_defaults.get('options', {}))
  if filled['client_clip_norm'] is None:  # Tasks without a clip default.
    filled['client_clip_norm'] = 0.0
  config = RunConfig(**filled)
  for name in ('num_rounds', 'clients_per_round', 'client_batch_size',
               'client_epochs', 'eval_every', 'eval_batch_size', 'client_lr',
               'server_lr', 'steps_per_call', 'segment_steps',
               'sequence_length', 'vocab_size',
               'num_clients', 'dirichlet_alpha'):
    _positive(name, getattr(config, name))
  for name in ('checkpoint_every', 'client_clip_norm', 'eval_num_clients',
               'max_examples_per_client'):
    value = getattr(config, name)
    if value is not None and (not _is_finite(value) or value < 0):
      raise ConfigError(f'--{name}={value}: must be a finite number >= 0.')
  if not _is_int(config.seed) or not 0 <= config.seed <= MAX_SEED:
    raise ConfigError(f'--seed={config.seed}: must be an integer in [0, '
                      f'2**32 - 1 = {MAX_SEED}] (numpy RandomState seeds).')
  if config.task == 'embedded_mnist' and \
      config.num_clients > EMBEDDED_MNIST_MAX_CLIENTS:
    raise ConfigError(f'--num_clients={config.num_clients}: embedded_mnist '
                      f'has at most {EMBEDDED_MNIST_MAX_CLIENTS} clients (each '
                      'needs 2 of its 5,000 digits).')
  for name, allowed in (('client_optimizer', CLIENT_OPTIMIZERS),
                        ('server_optimizer', SERVER_OPTIMIZERS),
                        ('round_engine', ROUND_ENGINES),
                        ('segment_loop', SEGMENT_LOOPS),
                        ('data_on_device', DATA_ON_DEVICE),
                        ('conv_implementation', CONV_IMPLEMENTATIONS),
                        ('compute_dtype', COMPUTE_DTYPES)):
    _check_choice(name, getattr(config, name), allowed)
  config = dataclasses.replace(config, lanes_per_device=(
      parse_lanes_per_device(config.lanes_per_device)))
  if not _is_int(config.client_cache_mb) or config.client_cache_mb < 0:
    raise ConfigError(f'--client_cache_mb={config.client_cache_mb}: must be an '
                      'integer >= 0 (MiB of decoded client data kept across '
                      'rounds; 0 = off).')
  _check_placement(config)
  for name in ('server_beta1', 'server_beta2'):
    value = getattr(config, name)
    if not (_is_finite(value) and 0 <= value < 1):
      raise ConfigError(f'--{name}={value}: must be in [0, 1).')
  _check_text_and_paths(config)
  check_explicit(config, explicit)
  compression_options.check_options(config.options)
  dp_options.check(config, explicit)
  return config


def _check_placement(config: RunConfig) -> None:
  """Devices and processes (ConfigError naming the flag)."""
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


def _check_text_and_paths(config: RunConfig) -> None:
  """Tokenizer, model preset, paths (ConfigError naming the flag)."""
  _check_choice('tokenizer', config.tokenizer, TOKENIZERS)
  if config.model is not None:
    _check_choice('model', config.model, lm.PRESETS)
  if config.sp_vocab_size <= 4:
    raise ConfigError(f'--sp_vocab_size={config.sp_vocab_size}: must be > 4 '
                      '(PAD, BOS, EOS, UNK plus pieces).')
  _check_choice('lm_loss_reduction', config.lm_loss_reduction,
                lm.LOSS_REDUCTIONS)
  if config.server_eps is not None:
    _positive('server_eps', config.server_eps)
  for name in ('data_dir', 'init_checkpoint', 'coordinator_address',
               'compilation_cache_dir'):
    _check_path(name, getattr(config, name))
  if config.output_dir is not None:
    check_output_dir(config.output_dir)
  if config.init_checkpoint is not None and \
      not os.path.exists(config.init_checkpoint):
    raise ConfigError(f'--init_checkpoint={config.init_checkpoint}: no such '
                      'file or directory.')


def _check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
  if value not in allowed:
    raise ConfigError(f'--{name}={value!r}: allowed values are '
                      f'{", ".join(map(str, allowed))}.')


def parse_lanes_per_device(value: Any) -> int | str:
  """``--lanes_per_device`` as ``'auto'`` or an int >= 1, else ConfigError."""
  if isinstance(value, str):
    text = value.strip()
    if text == 'auto':
      return 'auto'
    if text.isdigit() and int(text) >= 1:
      return int(text)
  elif _is_int(value) and value >= 1:
    return int(value)
  raise ConfigError(f"--lanes_per_device={value}: must be 'auto' or an "
                    'integer >= 1 (clients run side by side per device by '
                    'the vmap engine and split learning).')


def flag_message(error: BaseException) -> str:
  """The message of ``error`` from below the runner, with the settings it
  quotes (its ``settings`` attribute, e.g. ``num_devices``; see
  ``rounds.SettingError``) named as flags (``--num_devices``)."""
  text = str(error)
  for name in getattr(error, 'settings', ()):
    text = re.sub(rf'(?<![\w-]){re.escape(name)}\b', f'--{name}', text)
  return text


def _not_applicable(name: str, config: RunConfig,
                    spec: registry.AlgorithmSpec) -> str | None:
  """Why run-level setting ``name`` has no effect on ``config`` of
  algorithm ``spec``, or None."""
  tasks = TASK_FIELDS.get(name)
  if tasks is not None and config.task not in tasks:
    return f'applies to --task={", ".join(tasks)}, not {config.task}'
  if name == 'vocab_size' and config.tokenizer != 'word':
    return ('sets the word vocabulary (--tokenizer=word); with '
            '--tokenizer=sentencepiece use --sp_vocab_size')
  if name == 'sp_vocab_size' and config.tokenizer != 'sentencepiece':
    return f'applies to --tokenizer=sentencepiece, not {config.tokenizer}'
  if name == 'lm_loss_reduction' and config.model is None and \
      config.tokenizer == 'word':
    return ('applies to the --model presets (and --tokenizer=sentencepiece), '
            "not the task's default model; set --model")
  if name in ('server_beta1', 'server_beta2') and \
      config.server_optimizer not in ('adam', 'yogi'):
    return ('applies to --server_optimizer=adam or yogi, not '
            f'{config.server_optimizer}')
  if name == 'server_eps' and config.server_optimizer == 'sgd':
    return 'applies to --server_optimizer=adam, adagrad or yogi, not sgd'
  if name == 'steps_per_call' and config.round_engine == 'vmap':
    return 'applies to --round_engine=loop (or auto on CPU), not vmap'
  if name == 'lanes_per_device' and config.round_engine == 'loop' and \
      spec.uses_round_engine():
    return ('applies to --round_engine=vmap (or auto on GPU/TPU) and split '
            'learning, not the loop engine')
  if name in ('segment_steps', 'segment_loop', 'data_on_device') and (
      config.round_engine == 'loop' or not spec.uses_round_engine()):
    return ('applies to --round_engine=vmap (or auto on GPU/TPU), not the '
            'loop engine or split learning')
  if name in ('coordinator_address', 'distributed_timeout') and \
      config.num_processes == 1:
    return 'applies to multi-host runs (--num_processes > 1)'
  return None


def check_explicit(config: RunConfig, names: Iterable[str]) -> None:
  """Rejects explicitly set ``names`` (fields, options; no ``--``) that the
  run of resolved ``config`` would ignore, or that are unknown (ConfigError).
  """
  specs = registry.algorithms()
  spec = specs[config.algorithm]
  own = {o.name for o in spec.options}
  known = registry.all_options()
  fields = {f.name for f in dataclasses.fields(RunConfig)}
  for name in names:
    if name in known:
      if name not in own:
        users = [s.name for s in specs.values()
                 if name in {o.name for o in s.options}]
        raise ConfigError(
            f'--{name} is an option of --algorithm={", ".join(users)}, not '
            f'of {config.algorithm}; remove it or change --algorithm.')
      continue
    if name not in fields:
      raise ConfigError(f'--{name}: no such setting or algorithm option.')
    reason = spec.ignored_reason(name)
    if reason is not None:
      raise ConfigError(f'--{name} is not used by --algorithm='
                        f'{config.algorithm} ({reason}); remove it.')
    reason = _not_applicable(name, config, spec)
    if reason is not None:
      raise ConfigError(f'--{name} {reason}; remove it.')


def _resolve_options(spec, given: dict[str, Any],
                     task_defaults: Mapping[str, Any]) -> dict[str, Any]:
  """The algorithm's options: given, else task default, else default."""
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
    if opt.choices is not None:
      _check_choice(opt.name, value, opt.choices)
    if not _is_finite(value):
      raise ConfigError(f'--{opt.name}={value}: must be a finite number.')
    if opt.lower_bound is not None and value < opt.lower_bound:
      raise ConfigError(f'--{opt.name}={value}: must be >= {opt.lower_bound}.')
    if opt.upper_bound is not None and value > opt.upper_bound:
      raise ConfigError(f'--{opt.name}={value}: must be <= {opt.upper_bound}.')
    out[opt.name] = value
  return out
