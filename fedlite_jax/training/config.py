"""Run configuration: every flag of ``experiments/run_experiment.py``.

:class:`RunConfig` (defined in :mod:`~fedlite_jax.training.run_config`,
re-exported here with its choices) holds the settings; ``None`` fields
take the task's defaults (:func:`resolve`). Settings the run would ignore
are errors (:func:`check_explicit`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Iterable, Mapping

from fedlite_jax.models import lm
from fedlite_jax.training import compression_options
from fedlite_jax.training import dp_options
from fedlite_jax.training import registry
from fedlite_jax.training import spec
from fedlite_jax.training.run_config import (  # noqa: F401 (re-exported)
    CLIENT_OPTIMIZERS, COMPUTE_DTYPES, CONV_IMPLEMENTATIONS, PLOT_FORMATS,
    ROUND_ENGINES, SERVER_OPTIMIZERS, TOKENIZERS, RunConfig)

ConfigError = spec.ConfigError

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


#: Removed RunConfig fields (runner flags) and why each went: it had no
#: replacement, so setting it is an error (:func:`check_removed_fields`).
REMOVED_FIELDS: Mapping[str, str] = {
    'segment_loop': 'segments always run as an on-device scan',
    'data_on_device': 'batches are made on the host',
    'steps_per_call': 'the loop engine runs one jitted step per batch'}


def check_removed_fields(names: Iterable[str]) -> None:
  """Raises ConfigError ``--<name> was removed: <why>`` for the first of
  ``names`` (flags or options given) in :data:`REMOVED_FIELDS`."""
  for name in names:
    if name in REMOVED_FIELDS:
      raise ConfigError(f'--{name} was removed: {REMOVED_FIELDS[name]}.')


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
  including settings the run would ignore (:func:`check_explicit`), but the
  ``--upload`` / ``--download`` stage strings: the run parses those once
  (``compression_options.run_compression``).

  Raises:
    ConfigError: naming the first bad value and what is allowed.
  """
  compression_options.check_removed(config.options, config.algorithm)
  check_removed_fields(config.options)
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
               'server_lr', 'segment_steps', 'sequence_length', 'vocab_size',
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
                        ('conv_implementation', CONV_IMPLEMENTATIONS),
                        ('compute_dtype', COMPUTE_DTYPES),
                        ('plot_format', PLOT_FORMATS)):
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
  if name == 'lanes_per_device' and config.round_engine == 'loop' and \
      spec.uses_round_engine():
    return ('applies to --round_engine=vmap (or auto on GPU/TPU) and split '
            'learning, not the loop engine')
  if name == 'segment_steps' and (
      config.round_engine == 'loop' or not spec.uses_round_engine()):
    return ('applies to --round_engine=vmap (or auto on GPU/TPU), not the '
            'loop engine or split learning')
  if name in ('coordinator_address', 'distributed_timeout') and \
      config.num_processes == 1:
    return 'applies to multi-host runs (--num_processes > 1)'
  return None


def applies(config: RunConfig, name: str) -> bool:
  """Whether RunConfig field ``name`` may be set for resolved ``config``
  (:func:`check_explicit` would not refuse it)."""
  spec = registry.get(config.algorithm)
  return spec.ignored_reason(name) is None and \
      _not_applicable(name, config, spec) is None


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
