"""Algorithm registry: how ``--algorithm=<name>`` becomes a FedJAX algorithm.

The built-in algorithms are the ``SPECS`` of :data:`BUILTIN_MODULES`
(``algo_*.py``, importing only ``spec``, ``optimizers``,
``compression_options`` and ``dp_options`` of this package); call :func:`register` for your
own before the run is configured. Each :class:`Option` becomes a flag.
"""

from __future__ import annotations

import types

from fedlite_jax.training import algo_baselines
from fedlite_jax.training import algo_igc
from fedlite_jax.training import algo_lm
from fedlite_jax.training import algo_splitfed
from fedlite_jax.training import spec as spec_lib

Option = spec_lib.Option
BuildContext = spec_lib.BuildContext
AlgorithmSpec = spec_lib.AlgorithmSpec

#: The modules whose ``SPECS`` are the built-in algorithms, in ``--help`` order.
BUILTIN_MODULES: tuple[types.ModuleType, ...] = (
    algo_lm, algo_baselines, algo_igc, algo_splitfed)

#: The ``--algorithm`` of a run that names none.
DEFAULT_ALGORITHM = 'fedavg'


def _builtin_specs() -> tuple[AlgorithmSpec, ...]:
  specs = tuple(s for module in BUILTIN_MODULES for s in module.SPECS)
  spec_lib.check_compatible(specs)
  return specs


_BUILTIN: tuple[AlgorithmSpec, ...] = _builtin_specs()
# Algorithms added at run time by users through register(), in call order.
_ADDED: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
  """Adds a user-defined algorithm ``spec`` for the process; returns it.

  Raises:
    ValueError: duplicate algorithm name, or an option name defined
      differently by another algorithm.
  """
  spec_lib.check_compatible(tuple(algorithms().values()) + (spec,))
  _ADDED[spec.name] = spec
  return spec


def algorithms() -> dict[str, AlgorithmSpec]:
  """All algorithms by name: the built-in ones, then the registered ones."""
  out = {s.name: s for s in _BUILTIN}
  out.update(_ADDED)
  return out


def all_options() -> dict[str, Option]:
  """Every algorithm option by name."""
  return {o.name: o for s in algorithms().values() for o in s.options}


def get(name: str) -> AlgorithmSpec:
  """The algorithm called ``name`` (ValueError listing the allowed ones)."""
  specs = algorithms()
  if name not in specs:
    raise ValueError(f'--algorithm={name!r}: allowed values are '
                     f'{", ".join(specs)}.')
  return specs[name]
