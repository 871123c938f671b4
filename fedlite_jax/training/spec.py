"""What an algorithm of the runner is: :class:`AlgorithmSpec` and its parts.

Imports no other runner module. A built algorithm is a
``fedjax.FederatedAlgorithm`` whose ``apply`` gives per-client diagnostics
with ``upload_bits`` and ``download_bits`` (read by the ledger).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import fedjax


class ConfigError(ValueError):
  """A bad flag value (one clear line, no traceback from the binary)."""


@dataclasses.dataclass(frozen=True)
class Option:
  """An algorithm-specific setting, exposed as ``--<name>``.

  Attributes:
    name: flag name (prefix with the method, e.g. 'igc_dim').
    default: default value; its type (bool, int, float, str) is the flag's.
    help: flag help text (units, source).
    choices: allowed values of a string enum, else None.
    lower_bound: inclusive lower bound of a number (floats must be finite).
    affects_result: False if it does not change the trained result (not in
      checkpoint fingerprints).
    upper_bound: inclusive upper bound of a number.
  """
  name: str
  default: Any
  help: str
  choices: Optional[Sequence[str]] = None
  lower_bound: Optional[float] = None
  affects_result: bool = True
  upper_bound: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class BuildContext:
  """Everything an algorithm builder may need.

  Attributes:
    config: the resolved RunConfig (options in ``config.options``).
    split_model: the task's SplitModel (``.model`` is the fedjax.Model).
    num_params: number of scalar model parameters (D).
    train_client_ids: the training clients' ids, in FedJAX order.
    info: the task's ``tasks.LoadedInfo``.
    compression: the run's ``fedopt.Compression`` with the ``--upload`` /
      ``--download`` stages parsed
      (``compression_options.run_compression``), or None: the builder
      parses them (``compression_options.compression_of``).
  """
  config: Any
  split_model: Any
  num_params: int
  train_client_ids: tuple[bytes, ...]
  info: Any
  compression: Any = None


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """A runnable algorithm.

  Attributes:
    name: the ``--algorithm`` value; ``description``: one line for --help.
    build: ``BuildContext -> fedjax.FederatedAlgorithm``.
    options: its own settings (see :class:`Option`).
    eval_params: ``state -> params`` of the model to evaluate.
    communication_keys: more per-client diagnostics keys (bits) to sum.
    communication_summary: ``{key: run total} -> dict`` merged into
      ``summary['communication']``.
    multi_process: runs with ``--num_processes > 1``.
    ignored_fields: RunConfig fields it does not read, each with the reason
      (setting one is a ConfigError naming it).
    client_vmap: ``(config, engine_name) -> bool``: whether its clients run
      vmapped; None: they do on the ``vmap`` round engine. An algorithm
      that runs its clients itself ignores ``round_engine`` and sets this.
  """
  name: str
  description: str
  build: Callable[[BuildContext], fedjax.FederatedAlgorithm]
  options: tuple[Option, ...] = ()
  eval_params: Callable[[Any], Any] = lambda state: state.params
  communication_keys: tuple[str, ...] = ()
  communication_summary: Optional[
      Callable[[Mapping[str, float]], dict[str, float]]] = None
  multi_process: bool = True
  ignored_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
  client_vmap: Optional[Callable[[Any, str], bool]] = None

  def ignored_reason(self, name: str) -> Optional[str]:
    """Why RunConfig field ``name`` is not read, or None if it is."""
    return self.ignored_fields.get(name)

  def uses_round_engine(self) -> bool:
    """Whether ``--round_engine`` runs its clients (else it runs them)."""
    return 'round_engine' not in self.ignored_fields

  def clients_vmapped(self, config: Any, engine_name: str) -> bool:
    """Whether the clients of ``config`` run vmapped, with round engine
    ``engine_name`` (``config.round_engine`` with ``auto`` resolved)."""
    if self.client_vmap is not None:
      return bool(self.client_vmap(config, engine_name))
    return engine_name == 'vmap'

  def model_overrides(self, config: Any, engine_name: str) -> dict[str, Any]:
    """RunConfig fields the model is built with instead of ``config``'s:
    ``conv_implementation=auto`` resolved, im2col where clients run vmapped
    (:meth:`clients_vmapped`), else lax."""
    if config.conv_implementation != 'auto':
      return {}
    vmapped = self.clients_vmapped(config, engine_name)
    return {'conv_implementation': 'im2col' if vmapped else 'lax'}


def option_value(options: Mapping[str, Any], option: Option) -> Any:
  """``options[option.name]``, or the option's default when it is absent.

  The one way algorithm code reads its options (``config.options``).
  """
  return options.get(option.name, option.default)


def check_compatible(specs: Iterable[AlgorithmSpec]) -> None:
  """Checks that ``specs`` can be offered together as one set of flags.

  Raises:
    ValueError: two specs with one name, or one option name with two
      different :class:`Option` s (one flag needs one definition).
  """
  names: set[str] = set()
  taken: dict[str, Option] = {}
  for spec in specs:
    if spec.name in names:
      raise ValueError(f'Algorithm {spec.name!r} is already registered.')
    names.add(spec.name)
    for o in spec.options:
      if taken.setdefault(o.name, o) != o:
        raise ValueError(f'Option --{o.name} of {spec.name!r} is already '
                         'defined differently by another algorithm.')
