"""Algorithm registry: how ``--algorithm=<name>`` becomes a FedJAX algorithm.

Each built-in algorithm module (``algo_*.py``) declares its algorithms as
data, a module constant ``SPECS: tuple[AlgorithmSpec, ...]`` (see
:mod:`fedlite_jax.training.spec`); this module collects them from the
explicit list :data:`BUILTIN_MODULES`, in that order. Importing a module
registers nothing, so no result depends on import order. Each
:class:`Option` of a spec becomes an absl flag of
``experiments/run_experiment.py`` and is carried in
:class:`~fedlite_jax.training.config.RunConfig` ``options``.

Adding an algorithm:
  * to the library: write ``fedlite_jax/training/algo_<name>.py`` with its
    builders and ``SPECS``, importing only ``spec``, ``optimizers``,
    ``compression_options`` and ``fedlite_jax`` packages below ``training``
    (not another ``algo_*`` module, not this one), and add the module to
    :data:`BUILTIN_MODULES`;
  * from your own code, without editing the package: call
    :func:`register` with an :class:`AlgorithmSpec` before the run is
    configured (before :func:`fedlite_jax.training.run`, or before the
    binary defines its flags if you build your own binary).

The contract of a built algorithm is in :mod:`fedlite_jax.training.spec`.
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

#: The modules whose ``SPECS`` are the built-in algorithms, in ``--help``
#: order.
BUILTIN_MODULES: tuple[types.ModuleType, ...] = (
    algo_lm, algo_baselines, algo_igc, algo_splitfed)


def _builtin_specs() -> tuple[AlgorithmSpec, ...]:
  specs = tuple(s for module in BUILTIN_MODULES for s in module.SPECS)
  spec_lib.check_compatible(specs)
  return specs


_BUILTIN: tuple[AlgorithmSpec, ...] = _builtin_specs()
# Algorithms added at run time by users through register(), in call order.
_ADDED: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
  """Adds a user-defined algorithm ``spec`` for the rest of the process.

  The built-in algorithms need no call (see :data:`BUILTIN_MODULES`). An
  option name may be shared with other algorithms only with an identical
  :class:`Option` (same default, help, choices, bounds): it is one flag
  (e.g. ``--intrinsic_dim`` for all intrinsic-compression variants).

  Returns:
    ``spec``.

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
  """The algorithm called ``name``.

  Raises:
    ValueError: unknown name (lists the allowed ones).
  """
  specs = algorithms()
  if name not in specs:
    raise ValueError(f'--algorithm={name!r}: allowed values are '
                     f'{", ".join(specs)}.')
  return specs[name]
