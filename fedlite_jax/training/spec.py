"""What an algorithm of the runner is: :class:`AlgorithmSpec` and its parts.

The contract between the runner and an algorithm module
(``fedlite_jax/training/algo_*.py``). This module imports no algorithm
module and no other runner module, so every layer above may import it:

  spec  <-  optimizers, compression_options  <-  algo_*  <-  registry
        <-  config  <-  tasks, runner  <-  experiments/run_experiment.py

Contract of a built algorithm (``fedjax.FederatedAlgorithm``):
  * ``init(params) -> state``; ``apply(state, clients) -> (state, diags)``
    with FedJAX's ``clients = [(client_id, ClientDataset, PRNGKey)]``.
  * ``diags[client_id]`` holds at least ``upload_bits`` and
    ``download_bits`` (the communication ledger reads them).
  * ``spec.eval_params(state)`` gives the model parameters to evaluate.
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
    name: flag name (globally unique; prefix with the method, e.g. 'igc_dim').
    default: default value; its type (bool, int, float, str) is the flag type.
    help: flag help text (units, source).
    choices: allowed values for a string enum, else None.
    lower_bound: inclusive lower bound for numbers, else None.
    affects_result: False for options that do not change the trained result
      (excluded from checkpoint fingerprints).
    upper_bound: inclusive upper bound for numbers, else None.

  Float options must be finite (NaN and +-inf are rejected).
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
    info: the task's dataset info (``fedlite_jax.training.tasks.LoadedInfo``).
  """
  config: Any
  split_model: Any
  num_params: int
  train_client_ids: tuple[bytes, ...]
  info: Any


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """A runnable algorithm.

  Attributes:
    name: the ``--algorithm`` value.
    description: one line for ``--help``.
    build: ``BuildContext -> fedjax.FederatedAlgorithm``.
    options: its own settings (see :class:`Option`).
    eval_params: ``state -> params`` of the model to evaluate.
    communication_keys: per-client diagnostics keys (bits) that the ledger
      sums over the run, beside ``upload_bits`` / ``download_bits``.
    communication_summary: ``totals -> dict`` merged into
      ``summary['communication']``; ``totals`` maps each of
      ``communication_keys`` to its sum over all client-rounds.
    multi_process: runs with ``--num_processes > 1`` (its clients go
      through a round engine, so each process loads only its own clients'
      data). Several devices of one process work for every algorithm.
    ignored_fields: RunConfig fields (flags) the algorithm does not read;
      setting one explicitly is an error naming the algorithm.
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
  ignored_fields: tuple[str, ...] = ()


def option_value(options: Mapping[str, Any], option: Option) -> Any:
  """``options[option.name]``, or the option's default when it is absent."""
  return options.get(option.name, option.default)


def check_compatible(specs: Iterable[AlgorithmSpec]) -> None:
  """Checks that ``specs`` can be offered together as one set of flags.

  An option name may be used by several algorithms only with an identical
  :class:`Option` (same default, help, choices, bounds): it is one flag
  (e.g. ``--intrinsic_dim`` for all intrinsic-compression variants).

  Raises:
    ValueError: two specs with one name, or an option name defined
      differently by two algorithms (naming the algorithm and the flag).
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
