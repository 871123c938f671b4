"""Algorithm registry: how ``--algorithm=<name>`` becomes a FedJAX algorithm.

Each algorithm module registers an :class:`AlgorithmSpec` with its builder and
its own options (which ``experiments/run_experiment.py`` turns into absl
flags, and :class:`~fedlite_jax.training.config.RunConfig` carries in
``options``). New algorithms add a module under ``fedlite_jax/training/``
that calls :func:`register`; nothing else in the runner changes.

Contract of a built algorithm (``fedjax.FederatedAlgorithm``):
  * ``init(params) -> state``; ``apply(state, clients) -> (state, diags)``
    with FedJAX's ``clients = [(client_id, ClientDataset, PRNGKey)]``.
  * ``diags[client_id]`` holds at least ``upload_bits`` and
    ``download_bits`` (the communication ledger reads them).
  * ``spec.eval_params(state)`` gives the model parameters to evaluate.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import fedjax


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


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
  """Adds ``spec``.

  An option name may be used by several algorithms only with an identical
  :class:`Option` (same default, help, choices, bounds): it is one flag
  (e.g. ``--intrinsic_dim`` for all intrinsic-compression variants).

  Raises:
    ValueError: duplicate algorithm name, or an option name defined
      differently by another algorithm.
  """
  if spec.name in _REGISTRY:
    raise ValueError(f'Algorithm {spec.name!r} is already registered.')
  taken = {o.name: o for s in _REGISTRY.values() for o in s.options}
  for o in spec.options:
    if o.name in taken and taken[o.name] != o:
      raise ValueError(f'Option --{o.name} of {spec.name!r} is already '
                       'defined differently by another algorithm.')
  _REGISTRY[spec.name] = spec
  return spec


def algorithms() -> dict[str, AlgorithmSpec]:
  """All registered algorithms (imports the built-in ones first)."""
  from fedlite_jax.training import builtin_algorithms  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  return dict(_REGISTRY)


def all_options() -> dict[str, Option]:
  """Every registered option by name."""
  return {o.name: o for s in algorithms().values() for o in s.options}


def get(name: str) -> AlgorithmSpec:
  """The algorithm called ``name``.

  Raises:
    ValueError: unknown name (lists the allowed ones).
  """
  specs = algorithms()
  if name not in specs:
    raise ValueError(f'--algorithm={name!r}: allowed values are '
                     f'{", ".join(specs)}.')
  return specs[name]
